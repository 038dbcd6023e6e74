"""The families beyond the two every test runs on, end to end: `demo/run_demo.py --target qwen3_moe` (and
`qwen3_6_moe`, the hybrid with a shared expert; `qwen2`, Qwen2.5 with no thinking mode and enable_thinking left
unset) runs every stage on the tiny target: generate on vLLM (CPU), tokenize, train with the target's hooks on its
layers, export, evaluate (lossless, float32) and the serving check in vLLM.

Each repeats the dense and hybrid demo's path with another target, so they run in the extended tier (`make
test-all`); the default tier keeps the families' own tests (parameter counts, hooks, packing, the offline loop, the
thinking mode, Qwen2.5's masks).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_shared.storage import ObjectStore

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.extended]
REPO = Path(__file__).resolve().parents[2]
RUNS = {"qwen3_moe": "demo-qwen3-moe", "qwen3_6_moe": "demo-qwen36-moe", "qwen2": "demo-qwen2"}
FAMILY = {"qwen3_moe": "qwen3_moe", "qwen3_6_moe": "qwen3_5", "qwen2": "qwen2"}
# The serving check compares every prompt where the engine ran the evaluation's float32, the prompts both decoded
# alike where it could not (vLLM's CPU build runs Gated DeltaNet in bfloat16 only).
COMPARED = {"qwen3_moe": "all", "qwen3_6_moe": "matched", "qwen2": "all"}


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("target", list(RUNS))
def test_every_stage_runs_on_the_other_families_targets(target: str, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "demo/run_demo.py", "--out", str(out), "--target", target], cwd=REPO,
                          capture_output=True, text=True, timeout=3300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    store, run = ObjectStore(), out / "store" / RUNS[target]
    kinds = {"prompts": Kind.prompts, "completions": Kind.completions, "tokenized": Kind.tokenized,
             "drafter": Kind.drafter, "export": Kind.drafter, "evaluation": Kind.evaluation,
             "serving": Kind.evaluation}
    loaded = {name: load_manifest(store, str(run / name), kind) for name, kind in kinds.items()}
    assert all(m.manifest.accounting.failed == 0 for m in loaded.values())
    completions = loaded["completions"].manifest.section
    assert completions.target_family == FAMILY[target]  # type: ignore[union-attr]
    # Off everywhere: the run file says so for the mixtures; for Qwen2.5, left unset, generation settled it from the
    # family (no thinking mode), and the later stages read it from the records.
    assert completions.target.enable_thinking is False  # type: ignore[union-attr]
    # The train stage counted what a token runs: fewer parameters than the checkpoint holds for a mixture.
    config = json.loads((out / f"model-{target}" / "config.json").read_text())
    performance = loaded["drafter"].manifest.section.performance  # type: ignore[union-attr]
    from dflash_train.training.target_params import target_sizes

    sizes = target_sizes(config)
    assert performance["target_parameters"] == sizes.active_params
    assert (sizes.active_params < sizes.params) == (target != "qwen2")
    report = next(s.uri for s in loaded["serving"].manifest.shards if s.uri.endswith("serve-check.json"))
    check = json.loads(store.read_bytes(report))
    assert check["compared"] == COMPARED[target] and check["output_mismatches"] == [], check
