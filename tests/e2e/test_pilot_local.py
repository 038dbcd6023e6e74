"""The demo run's pilot end to end on a real S3 endpoint (moto): every stage at the run's shapes, the train
stage's restart resumed, the report written with measured figures, and the full run re-planned from it.

The dense tiny Qwen3 target keeps it to a few minutes; the pilot's code paths do not depend on the target family.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_pipeline.pilot.report import PilotReport
from dflash_shared.storage import ObjectStore, join
from tests.e2e.test_demo_pipeline import demo_env, require_environments

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


# Seven stages, two vLLM engines and a train restart: about 5 minutes on 2 idle cores, more beside other work.
@pytest.mark.timeout(2400)
def test_the_demo_pilot_runs_resumes_reports_and_replans(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    require_environments()
    root = join(s3_bucket, "runs")
    out = tmp_path / "out"
    # The offline loop decodes one prompt at a time on CPU, the slowest part here: fewer prompts, same paths.
    overrides = tmp_path / "overrides.json"
    overrides.write_text(json.dumps({"pilot": {"evaluate_prompts": 8, "baseline_prompts": 2, "lossless_prompts": 2,
                                               "learnability_documents": 2}}))
    proc = subprocess.run([sys.executable, "demo/run_demo.py", "--pilot", "--target", "qwen3", "--out", str(out),
                           "--root", root, "--overrides", str(overrides)], cwd=REPO, capture_output=True, text=True,
                          timeout=2400, check=False, env=demo_env(tmp_path / "tmp"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = PilotReport.model_validate_json(store.read_bytes(join(root, "demo-pilot", "report.json")))
    assert report.pilot_of == "demo" and report.run_id == "demo-pilot"
    assert [s.stage for s in report.stages] == ["import", "generate", "tokenize", "train", "export", "evaluate",
                                                "serve-check"]
    assert all(s.committed and s.wall_seconds is not None for s in report.stages), report.stages
    figures = {(s.stage, f.name): f for s in report.stages for f in s.figures}
    # Measured, not copied from the plan: every one of these is a figure a stage recorded in its manifest.
    for key in [("generate", "decode tokens/s per GPU"), ("generate", "prefill (prompt) tokens/s per GPU"),
                ("tokenize", "records/s"), ("train", "step time"), ("train", "tokens/s per GPU"),
                ("train", "peak memory per GPU"), ("train", "checkpoint save"), ("train", "resume from checkpoint"),
                ("export", "loaded by the engine"), ("evaluate", "tau offline"), ("serve-check", "tau engine")]:
        assert figures[key].measured is not None and figures[key].measured > 0, key
    # The pilot ran the learnability gate (the stage fails when it does): nearly every drafted token accepted.
    assert (figures[("evaluate", "learnability gate")].measured or 0) >= 0.9
    # The memory plan's prediction sits beside the measured peak; on CPU no MFU is claimed.
    assert figures[("train", "peak memory per GPU")].planned is not None
    assert figures[("train", "MFU")].measured is None
    # The trained labels' agreement with the trainer target's own greedy tokens is reported (the demo's random
    # target regenerates in bf16 and trains in fp32: how far they agree is its near-ties', not asserted here).
    agreement = figures[("train", "label agreement")].measured
    assert agreement is not None and 0.0 <= agreement <= 1.0
    assert {"generate_tokens_per_s_per_gpu", "train_tokens_per_s_per_gpu", "mean_completion_tokens"} <= set(
        report.measured)
    # The train stage stopped at its checkpoint as a preemption does, and the rerun resumed from it.
    train_log = (out / "logs" / "qwen3-pilot" / "train-0.log").read_text(errors="replace")
    assert "stopped at step 15 (restart_after_step)" in train_log
    # `plan --from-pilot` (the demo prints it) re-planned the full run from the measured rates.
    assert "re-planned from the pilot" in proc.stdout
    assert "moved: train tokens/s/GPU" in proc.stdout and "(pilot)" in proc.stdout
    # `status` of the full run shows its pilot's report below the stage table.
    status = subprocess.run([sys.executable, "-m", "dflash_pipeline", "status", "--config", str(out / "run-qwen3.json"),
                             "--pilot"], cwd=REPO, capture_output=True, text=True, check=True, env=demo_env(tmp_path))
    assert "pilot report of demo (run demo-pilot" in status.stdout and "resume from checkpoint:" in status.stdout
    record = json.loads((out / "last-pilot-demo.json").read_text())
    assert record["report"].endswith("demo-pilot/report.json") and record["wall_s"] > 0
