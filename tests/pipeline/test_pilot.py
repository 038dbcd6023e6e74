"""The pilot of the headline run file, rendered and compared with the full run object by object.

What can fail at scale must be the same (images, placement, resources, the train gang's size, every shape);
only counts may differ, and each count that differs must be smaller. The pilot's plan must fit in an hour and in
2% of the full run's GPU-hours.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.pilot.derive import derive_pilot, pilot_cost
from dflash_pipeline.plan.run_plan import build_plan
from dflash_pipeline.render.run_objects import render_documents
from dflash_pipeline.run.config import load_run_config, parse_run_config
from dflash_shared.errors import ConfigError
from tests.pipeline.k8s_support import containers, env_of, jobs

REPO = Path(__file__).resolve().parents[2]
HEADLINE = REPO / "k8s" / "examples" / "qwen3.6-27b.toml"

# Per stage, the stage config variables that are counts (the pilot may shrink them); every other variable must
# be identical, apart from the names that carry the run id.
COUNTS = {
    "import": {"DFLASH_IMPORT_SAMPLE_RECORDS", "DFLASH_NUM_SHARDS"},
    "tokenize": {"DFLASH_TOKENIZE_HELDOUT_MIN_RECORDS", "DFLASH_NUM_SHARDS"},
    "generate": {"DFLASH_NUM_SHARDS"},
    "train": {"DFLASH_TRAIN_MAX_STEPS", "DFLASH_TRAIN_CHECKPOINT_EVERY", "DFLASH_TRAIN_RESTART_AFTER_STEP",
              "DFLASH_TRAIN_LOG_EVERY"},
    "evaluate": {"DFLASH_EVALUATE_NUM_PROMPTS", "DFLASH_EVALUATE_BASELINE_PROMPTS",
                 "DFLASH_EVALUATE_LOSSLESS_PROMPTS", "DFLASH_EVALUATE_MIN_TAU",
                 "DFLASH_EVALUATE_LEARNABILITY_DOCUMENTS"},
}


@pytest.fixture(scope="module")
def runs() -> tuple[Any, Any]:
    full = load_run_config(HEADLINE)
    return full, derive_pilot(full)


def _without_run_id(value: Any, full_id: str, pilot_id: str) -> Any:
    """The rendered value with the pilot's run id written as the full run's (names, labels, prefixes)."""
    return json.loads(json.dumps(value).replace(pilot_id, full_id))


def _pod(job: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = job["spec"]["template"]["spec"]
    return spec


def test_the_pilot_keeps_every_image_placement_resource_and_the_train_gang(runs: tuple[Any, Any]) -> None:
    full, pilot = runs
    assert pilot.run_id == f"{full.run_id}-pilot" and pilot.pilot_of == full.run_id
    full_jobs, pilot_jobs = jobs(render_documents(full)), jobs(render_documents(pilot))
    assert set(full_jobs) == set(pilot_jobs)
    for stage, full_job in full_jobs.items():
        pilot_job = _without_run_id(pilot_jobs[stage], full.run_id, pilot.run_id)
        for key in ("nodeSelector", "tolerations", "affinity", "runtimeClassName", "securityContext",
                    "serviceAccountName", "priorityClassName", "subdomain", "volumes"):
            assert _pod(pilot_job).get(key) == _pod(full_job).get(key), f"{stage}: {key}"
        for p_c, f_c in zip(containers(pilot_job), containers(full_job), strict=True):
            assert p_c["image"] == f_c["image"], stage
            assert p_c["resources"] == f_c["resources"], stage
            assert p_c.get("command") == f_c.get("command") and p_c.get("args") == f_c.get("args"), stage
    train_full, train_pilot = full_jobs["train"]["spec"], pilot_jobs["train"]["spec"]
    # The multi-node gang forms with as many pods as the full run's.
    assert train_pilot["parallelism"] == train_full["parallelism"] == full.stages.train.nodes == 4
    assert train_pilot["completions"] == train_full["completions"]
    # The restart the pilot makes (exit 75) is one the Job replaces without counting it, as a preemption.
    assert train_pilot["podFailurePolicy"] == train_full["podFailurePolicy"]


def test_only_counts_differ_and_each_is_smaller(runs: tuple[Any, Any]) -> None:
    full, pilot = runs
    full_jobs, pilot_jobs = jobs(render_documents(full)), jobs(render_documents(pilot))
    shapes_checked = 0
    for stage, full_job in full_jobs.items():
        pilot_job = _without_run_id(pilot_jobs[stage], full.run_id, pilot.run_id)
        for p_c, f_c in zip(containers(pilot_job), containers(full_job), strict=True):
            p_env, f_env = env_of(p_c), env_of(f_c)
            counts = COUNTS.get(stage, set())
            for name in sorted(set(p_env) | set(f_env)):
                if name in counts:
                    continue
                assert p_env.get(name) == f_env.get(name), f"{stage}: {name} {f_env.get(name)} -> {p_env.get(name)}"
                shapes_checked += 1
    assert shapes_checked > 40
    train = env_of(containers(pilot_jobs["train"])[-1])
    full_train = env_of(containers(full_jobs["train"])[-1])
    for shape in ("DFLASH_TRAIN_MAX_LENGTH", "DFLASH_TRAIN_BATCH_TOKENS", "DFLASH_TRAIN_ACTIVATION_CHECKPOINTING",
                  "DFLASH_TRAIN_MAX_ANCHORS_PER_ROW"):
        assert train[shape] == full_train[shape]
    assert (train["DFLASH_TRAIN_MAX_STEPS"], train["DFLASH_TRAIN_RESTART_AFTER_STEP"]) == ("30", "15")
    assert env_of(containers(pilot_jobs["import"])[-1])["DFLASH_IMPORT_SAMPLE_RECORDS"] == "256"
    # The sample is drawn over every record by one worker: one import pod.
    assert pilot_jobs["import"]["spec"]["completions"] == 1 < full_jobs["import"]["spec"]["completions"]
    evaluate = env_of(containers(pilot_jobs["evaluate"])[-1])
    assert evaluate["DFLASH_EVALUATE_NUM_PROMPTS"] == "16"
    # The pilot runs the learnability gate; the full run does not: the gate tests the code path the pilot ran.
    assert evaluate["DFLASH_EVALUATE_LEARNABILITY_DOCUMENTS"] == "4"
    assert "DFLASH_EVALUATE_LEARNABILITY_DOCUMENTS" not in env_of(containers(full_jobs["evaluate"])[-1])
    assert int(env_of(containers(full_jobs["evaluate"])[-1])["DFLASH_EVALUATE_NUM_PROMPTS"]) > 16
    assert pilot_jobs["generate"]["spec"]["completions"] < full_jobs["generate"]["spec"]["completions"]
    for stage, job in pilot_jobs.items():
        assert job["spec"]["activeDeadlineSeconds"] <= full_jobs[stage]["spec"]["activeDeadlineSeconds"], stage
        assert job["spec"]["activeDeadlineSeconds"] <= 2 * 3600, stage


def test_the_pilots_plan_is_under_an_hour_and_two_percent_of_the_run(runs: tuple[Any, Any]) -> None:
    full, pilot = runs
    cost = pilot_cost(full, build_plan(pilot), build_plan(full))
    assert cost["wall_seconds"] < 3600 and cost["within_wall"]
    assert cost["gpu_hour_share"] < 0.02 and cost["within_share"]
    assert cost["cost"] == pytest.approx(cost["gpu_hours"] * 4.0)


def test_plan_pilot_prints_the_cost_beside_the_full_run() -> None:
    out = subprocess.run([sys.executable, "-m", "dflash_pipeline", "plan", "--pilot", "--config", str(HEADLINE)],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "plan of run qwen36-27b-v1-pilot" in out
    assert "of the full run's 2,975" in out and "USD" in out
    assert "a restart resuming from step 15" in out


def test_a_pilot_is_not_derived_twice_and_its_run_id_must_fit(runs: tuple[Any, Any]) -> None:
    _, pilot = runs
    with pytest.raises(ConfigError, match="already the pilot"):
        derive_pilot(pilot)
    data = json.loads(runs[0].model_dump_json(by_alias=True, exclude_none=True))
    data["run_id"] = "a" * 33
    with pytest.raises(ConfigError, match="shorten run_id to at most 30"):
        derive_pilot(parse_run_config(data))
    data["run_id"] = "short"
    data["pilot"] = {"train_steps": 10, "restart_at_step": 10}
    with pytest.raises(ConfigError, match="restart_at_step 10 must come before"):
        derive_pilot(parse_run_config(data))
    data["pilot"] = {"prompts": 48, "evaluate_prompts": 16}
    with pytest.raises(ConfigError, match="prompts must be at least 64"):
        derive_pilot(parse_run_config(data))


def test_the_pilots_run_object_carries_its_config_for_the_report(runs: tuple[Any, Any]) -> None:
    full, pilot = runs
    (full_object,) = [d for d in render_documents(full) if d["kind"] == "ConfigMap"]
    (pilot_object,) = [d for d in render_documents(pilot) if d["kind"] == "ConfigMap"]
    assert "pilot-run.json" not in full_object["data"]
    assert pilot_object["data"]["pilot_of"] == full.run_id
    assert parse_run_config(json.loads(pilot_object["data"]["pilot-run.json"])) == pilot


def _report(full: Any, measured: dict[str, float]) -> Any:
    from dflash_pipeline.pilot.report import PilotReport
    from dflash_pipeline.plan.run_plan import plan_json

    pilot = derive_pilot(full)
    return PilotReport(run_id=pilot.run_id, pilot_of=full.run_id, gpu_model="NVIDIA-H200", stages=[],
                       measured=measured, planned=plan_json(build_plan(pilot)))


def test_replan_puts_the_measured_rates_in_place_of_the_assumptions_and_names_each(runs: tuple[Any, Any]) -> None:
    from dflash_pipeline.pilot.replan import format_moved, replan

    full, _ = runs
    before = build_plan(full)
    # Generation at half the assumed rate, training 20% faster, answers as long as assumed.
    report = _report(full, {"generate_tokens_per_s_per_gpu": 750.0, "train_tokens_per_s_per_gpu": 3600.0,
                            "mean_completion_tokens": before.figures["mean completion tokens"].value})
    after, moved = replan(full, report, None)
    by_name = {m.name: m for m in moved}
    assert by_name["generate tokens/s/GPU"].after == 750.0 and by_name["generate tokens/s/GPU"].after_source == "pilot"
    assert by_name["train tokens/s/GPU"].change == pytest.approx(0.2)
    assert after.figures["generate tokens/s/GPU"].source == "pilot"
    # The answers' mean was as assumed: it did not move (the uncut mean is recovered from the cut one).
    assert "mean answer tokens (uncut)" not in by_name
    generate_before = next(s for s in before.stages if s.stage == "generate")
    generate_after = next(s for s in after.stages if s.stage == "generate")
    assert generate_after.gpu_hours is not None and generate_before.gpu_hours is not None
    assert generate_after.gpu_hours > 1.8 * generate_before.gpu_hours
    text = format_moved(before, after, moved)
    assert "re-planned from the pilot" in text
    assert "moved: generate tokens/s/GPU: 1,500.00 (estimate for NVIDIA-H200) -> 750.00 (pilot), -50%" in text


def test_replan_refuses_another_runs_report(runs: tuple[Any, Any]) -> None:
    from dflash_pipeline.pilot.replan import replan

    full, _ = runs
    report = _report(full, {}).model_copy(update={"pilot_of": "someone-else"})
    with pytest.raises(ConfigError, match="pilot of run 'someone-else'"):
        replan(full, report, None)


def test_submit_warns_without_a_pilot_report_and_stops_warning_once_there_is_one(
        tmp_path: Path, s3_bucket: str, store: Any) -> None:
    import os

    from dflash_pipeline.pilot.report import pilot_report_uri

    data = json.loads(load_run_config(HEADLINE).model_dump_json(by_alias=True, exclude_none=True))
    data["root"] = f"{s3_bucket}/runs"
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps(data))

    def submit(*extra: str) -> str:
        return subprocess.run([sys.executable, "-m", "dflash_pipeline", "submit", "--config", str(run_file),
                               "--dry-run", *extra], cwd=REPO, capture_output=True, text=True, check=True,
                              env=dict(os.environ)).stderr

    first = submit()
    assert "warning: no pilot report at" in first and f"pilot --config {run_file}`" in first  # the file, not the id
    assert "no pilot report" not in submit("--no-pilot")
    store.write_bytes(pilot_report_uri(data["root"], data["run_id"]),
                      _report(load_run_config(HEADLINE), {}).model_dump_json().encode())
    assert "no pilot report" not in submit()


def test_plan_from_pilot_refuses_a_missing_or_foreign_report(tmp_path: Path) -> None:
    bad = tmp_path / "report.json"
    bad.write_text('{"stages": []}')
    for report, message in ((tmp_path / "none.json", "no pilot report at"), (bad, "is not a pilot report")):
        proc = subprocess.run([sys.executable, "-m", "dflash_pipeline", "plan", "--config", str(HEADLINE),
                               "--offline", "--from-pilot", str(report)], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 64 and message in proc.stderr, proc.stderr
