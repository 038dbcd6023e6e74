"""How long a rank that never comes back keeps the other GPUs of a multi-node gang, from the rendered objects.

`dflash_pipeline.plan.gang_hold` adds the hold up from the rules; here a second-by-second emulation of the Job
controller (each surviving index on its own: pod start, rendezvous timeout, exit code, the podFailurePolicy's
action, the per-index backoff, maxFailedIndexes, the deadline) runs the rendered Job and must end where the
model says, for the headline run and with the settings changed.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from dflash_pipeline import parse_run_config
from dflash_pipeline.plan.gang_hold import COLLECTIVE_TIMEOUT_S, POD_START_S, dead_rank_hold
from dflash_pipeline.render.run_objects import objects_of_stage
from dflash_pipeline.run.config import read_run_file
from dflash_pipeline.run.stages import TRAIN
from dflash_shared.exit_codes import ExitCode
from tests.pipeline.k8s_support import REPO_ROOT, failure_action

HEADLINE_RUN = REPO_ROOT / "k8s" / "examples" / "qwen3.6-27b.toml"


def gang(**train: Any) -> dict[str, Any]:
    data = read_run_file(HEADLINE_RUN)
    data["stages"]["train"] = {**data["stages"]["train"], **train}
    run = parse_run_config(data)
    (obj,) = [d for d in objects_of_stage(run, TRAIN) if d["kind"] in ("Job", "JobSet")]
    return obj


def emulate_job(job: dict[str, Any]) -> float:
    """Seconds from the loss of the last index's node until the Job stops, one second at a time."""
    spec = job["spec"]
    pod = spec["template"]["spec"]
    args = pod["containers"][0]["args"]
    join = int(re.search(r"join_timeout=(\d+)", next(a for a in args if a.startswith("--rdzv-conf="))).group(1))
    survivors = range(spec["completions"] - 1)  # the last index is lost and never replaced
    limit, max_failed = spec["backoffLimitPerIndex"], spec.get("maxFailedIndexes")
    deadline = spec.get("activeDeadlineSeconds") or 10**9
    # Per index: seconds until its current pod exits (and with what), failures counted, time a replacement waits.
    exits = dict.fromkeys(survivors, int(COLLECTIVE_TIMEOUT_S))
    code = dict.fromkeys(survivors, int(ExitCode.PREEMPTED))  # the collective with the lost peer times out
    failures, failed = dict.fromkeys(survivors, 0), set()
    for second in range(1, deadline + 1):
        for i in survivors:
            if i in failed or second != exits[i]:
                continue
            action = failure_action(job, code[i])
            delay = 0
            if action == "Count":
                failures[i] += 1
                if failures[i] > limit:
                    failed.add(i)
                    continue
                delay = min(10 * 2 ** (failures[i] - 1), 360)
            elif action != "Ignore":
                raise AssertionError(f"exit {code[i]} -> {action}")
            # The replacement starts, waits for the lost rank at the rendezvous, and torchrun gives up: exit 1.
            exits[i] = second + delay + int(POD_START_S) + join
            code[i] = 1
        if max_failed is not None and len(failed) > max_failed:
            return float(second)
    return float(deadline)


def test_a_lost_rank_fails_the_headline_gang_within_the_bound_the_plan_prints() -> None:
    job = gang()
    assert job["spec"]["maxFailedIndexes"] == 0 and job["spec"]["podReplacementPolicy"] == "Failed"
    assert "--rdzv-conf=join_timeout=600" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    hold = dead_rank_hold(job)
    assert hold.bounded_by == "maxFailedIndexes"
    # 30 min for the collective to time out, a restart, then 4 rendezvous of 10 min (3 retries) with the backoff.
    assert hold.seconds == emulate_job(job) == 1800 + 60 + 4 * 600 + (10 + 60) + (20 + 60) + (40 + 60)
    assert hold.pods == 3 and hold.gpus == 24
    assert hold.gpu_hours == pytest.approx(4510 * 24 / 3600)  # ~30 GPU-hours, not the 7-day deadline


def test_without_max_failed_indexes_the_gang_holds_its_gpus_until_the_deadline() -> None:
    """The Job as rendered before: no maxFailedIndexes, a 30-minute rendezvous."""
    job = gang(rendezvous_timeout_seconds=1800)
    del job["spec"]["maxFailedIndexes"]
    hold = dead_rank_hold(job)
    assert hold.bounded_by == "activeDeadlineSeconds" and hold.seconds == 7 * 86400 == emulate_job(job)
    assert hold.gpu_hours == 7 * 24 * 24


@pytest.mark.parametrize("train", [{"rendezvous_timeout_seconds": 300}, {"retries_per_shard": 0},
                                   {"retries_per_shard": 6, "rendezvous_timeout_seconds": 900}, {"nodes": 2}])
def test_the_model_follows_the_rendered_settings(train: dict[str, Any]) -> None:
    job = gang(**train)
    assert dead_rank_hold(job).seconds == emulate_job(job)


def test_the_jobset_gang_is_bounded_by_its_restarts() -> None:
    jobset = gang(gang="jobset")
    hold = dead_rank_hold(jobset)
    assert hold.bounded_by == "maxRestarts" and jobset["spec"]["failurePolicy"]["maxRestarts"] == 3
    assert hold.seconds == 1800 + 4 * (60 + 600) and hold.gpus == 24


def test_the_collective_timeout_is_the_trainers() -> None:
    distributed = REPO_ROOT / "jobs" / "train" / "src" / "dflash_train" / "parallel" / "distributed.py"
    source = distributed.read_text(encoding="utf-8")
    match = re.search(r"def init_distributed\(.*timeout_s: float = ([0-9.]+)\)", source)
    assert match is not None and float(match.group(1)) == COLLECTIVE_TIMEOUT_S


def test_a_rendezvous_without_a_timeout_is_refused() -> None:
    job = gang()
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    job["spec"]["template"]["spec"]["containers"][0]["args"] = [a for a in args if not a.startswith("--rdzv-conf")]
    with pytest.raises(ValueError, match="waits unbounded"):
        dead_rank_hold(job)
