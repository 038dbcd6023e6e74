"""How long a rank that never comes back keeps the other pods of a multi-node gang, and their GPUs.

Read from the rendered object (the train stage's Indexed Job, or its JobSet), by the rules of the controllers
that act on it. The worst case is a node that is lost for good while its pod stays Terminating (or its
replacement finds no node): the pod is never replaced, and the others can only give up.

1. The surviving ranks notice: their collective with the lost rank times out (the process group's timeout,
   `COLLECTIVE_TIMEOUT_S`; sooner when the lost pod hosted the rendezvous store).
2. They exit 75 (a peer is gone, `dflash_train.parallel.gang`): the Job ignores it and replaces each pod at once.
3. Each replacement starts (`POD_START_S`) and waits at the c10d rendezvous for `join_timeout`, which cannot
   complete: torchrun gives up and the pod exits 1, counted against its index's `backoffLimitPerIndex`. The
   Job controller recreates it after its backoff delay (10 s, doubling, at most 6 min).
4. Indexed Job: an index that failed more than `backoffLimitPerIndex` times is failed; more failed indexes than
   `maxFailedIndexes` fail the Job, which stops every pod. Without `maxFailedIndexes` the Job waits for every
   index, and the lost one never ends: the others are retried until `activeDeadlineSeconds` stops the Job.
   JobSet: the child Job fails on any pod failure (`backoffLimit: 0`); a rendezvous timeout (exit 1) restarts the
   whole gang, counted against `maxRestarts`, and the JobSet fails after `maxRestarts` + 1 of them.

The hold ends when the Job (or JobSet) fails; the pods' grace period is not counted, since a torchrun still in
its rendezvous stops at SIGTERM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# dflash_train.parallel.distributed.init_distributed's process-group timeout: a collective waits this long for a peer.
COLLECTIVE_TIMEOUT_S = 1800.0
# A replacement pod's way to its rendezvous: scheduling, container start with the image cached, the preflight.
POD_START_S = 60.0
# The Job controller's pod failure backoff: 10 s, doubled per failure of the index, at most 6 min.
BACKOFF_BASE_S, BACKOFF_MAX_S = 10.0, 360.0
_JOIN_TIMEOUT = re.compile(r"(?:^|[,=])join_timeout=(\d+)")


@dataclass
class GangHold:
    """Seconds the surviving pods of the gang hold their GPUs after one rank is lost, and how they add up."""

    seconds: float
    pods: int  # the surviving pods
    gpus: int  # their GPUs
    bounded_by: str  # what ends the hold: "maxFailedIndexes", "maxRestarts" or "activeDeadlineSeconds"
    steps: list[str] = field(default_factory=list)

    @property
    def gpu_hours(self) -> float:
        return self.seconds * self.gpus / 3600


def _join_timeout(pod_spec: dict[str, Any]) -> float:
    for arg in pod_spec["containers"][0].get("args", []):
        if arg.startswith("--rdzv-conf=") and (match := _JOIN_TIMEOUT.search(arg.removeprefix("--rdzv-conf="))):
            return float(match.group(1))
    raise ValueError("the gang's torchrun has no --rdzv-conf=join_timeout: its rendezvous waits unbounded")


def _gpus_per_pod(pod_spec: dict[str, Any]) -> int:
    limits = pod_spec["containers"][0].get("resources", {}).get("limits", {})
    return sum(int(v) for k, v in limits.items() if k.endswith("/gpu"))


def dead_rank_hold(obj: dict[str, Any]) -> GangHold:
    """The hold for a rendered multi-node Indexed Job or JobSet (see the module docstring)."""
    if obj["kind"] == "JobSet":
        return _jobset_hold(obj)
    spec = obj["spec"]
    pod = spec["template"]["spec"]
    join = _join_timeout(pod)
    survivors = int(spec["completions"]) - 1
    limit = int(spec.get("backoffLimitPerIndex", 0))
    max_failed = spec.get("maxFailedIndexes")
    deadline = spec.get("activeDeadlineSeconds")
    t = COLLECTIVE_TIMEOUT_S + POD_START_S
    steps = [f"{COLLECTIVE_TIMEOUT_S:.0f} s until the survivors' collective times out, {POD_START_S:.0f} s to "
             "replace them (exit 75, no retry used)"]
    for failures in range(1, limit + 2):  # until failure limit + 1 fails the index
        t += join
        steps.append(f"rendezvous {failures} gives up after {join:.0f} s (exit 1: failure {failures} of each "
                     f"surviving index, backoffLimitPerIndex {limit})")
        if failures <= limit:  # the Job controller's backoff, then a replacement starts
            t += min(BACKOFF_BASE_S * 2 ** (failures - 1), BACKOFF_MAX_S) + POD_START_S
    if max_failed is not None and survivors > int(max_failed):
        steps.append(f"{survivors} failed indexes > maxFailedIndexes {max_failed}: the Job fails")
        return GangHold(t, survivors, survivors * _gpus_per_pod(pod), "maxFailedIndexes", steps)
    # The Job waits for the lost index, which never finishes: only its deadline stops the retries.
    steps.append("no maxFailedIndexes below the failed count: the Job waits for the lost index until its deadline")
    held = float(deadline) if deadline else float("inf")
    return GangHold(held, survivors, survivors * _gpus_per_pod(pod), "activeDeadlineSeconds", steps)


def _jobset_hold(jobset: dict[str, Any]) -> GangHold:
    spec = jobset["spec"]
    (node,) = [r for r in spec["replicatedJobs"] if "dependsOn" in r]
    job_spec = node["template"]["spec"]
    pod = job_spec["template"]["spec"]
    join = _join_timeout(pod)
    survivors = int(job_spec["completions"]) - 1
    restarts = int(spec["failurePolicy"].get("maxRestarts", 0))
    # The survivors' exit 75 is a restart that costs nothing (RestartJobSetAndIgnoreMaxRestarts); every gang after
    # it waits at the rendezvous for the lost pod and gives up with exit 1, a counted restart.
    t = COLLECTIVE_TIMEOUT_S + (restarts + 1) * (POD_START_S + join)
    steps = [f"{COLLECTIVE_TIMEOUT_S:.0f} s until the collective times out, then {restarts + 1} gangs of "
             f"{POD_START_S:.0f} s start + {join:.0f} s rendezvous (maxRestarts {restarts})"]
    return GangHold(t, survivors, survivors * _gpus_per_pod(pod), "maxRestarts", steps)
