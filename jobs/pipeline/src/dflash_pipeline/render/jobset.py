"""Multi-node training as a JobSet (sigs.k8s.io JobSet, jobset.x-k8s.io/v1alpha2): one gang, restarted whole.

Selected with `[stages.train] gang = "jobset"`; needs JobSet v0.10 or later (onJobFailureMessagePatterns).
The plain Indexed Job (`jobs.build_job`) replaces a failed pod on its own and the gang meets again at the
rendezvous; a JobSet instead treats the N pods as one unit:

- replicatedJob `node`: one Indexed Job of N pods (one torchrun agent per node), built from the same pod
  template as the plain Job (`jobs.stage_workload`), with JobSet's address of pod 0 as its rendezvous
  (`rendezvous.gang_rendezvous`).
  `backoffLimit: 0` and a podFailurePolicy that fails the child Job on ANY failure (64/65 bad config or
  input, 75 preempted, a DisruptionTarget condition, anything else through the backoff limit) hand every
  decision to the JobSet's failurePolicy, which reads the Job's failure reason and message:
    exit 64/65 on any pod        -> FailJobSet: no rerun can heal bad config or input;
    the Job's deadline passed    -> FailJobSet;
    exit 75, or a disruption     -> RestartJobSetAndIgnoreMaxRestarts: a preemption costs no restart;
    anything else                -> RestartJobSet, at most `retries_per_shard` times (maxRestarts).
  A restart recreates every pod (BlockingRecreate: the old gang is gone before the new one starts, so a
  checkpoint never has two writers); the ranks resume from the newest complete checkpoint.
- network: JobSet makes the headless Service itself (subdomain = the JobSet's name); pod 0 of the Job is
  `<jobset>-node-0-0.<jobset>`, the c10d rendezvous endpoint. No Service of our own.
- replicatedJob `wait-for-input`: one small CPU pod (the run driver's image; `input_wait`, resolved with the
  stage's workload) that waits for the tokenized manifest; `node` dependsOn it being Complete, so no GPU pod
  exists before the data does (the JobSet is applied with the run and is not created by the run driver, which
  drives batch/v1 Jobs). A wait that times out (65) or cannot reach storage (69) fails the JobSet.
- successPolicy: the JobSet succeeds when the `node` Job completes.
- Kueue: the run file's queue-name and priority labels go on the JobSet (Kueue admits a JobSet as one
  workload, all pods or none); the child Jobs carry none, since Kueue manages them through their JobSet.
"""

from __future__ import annotations

from typing import Any

from dflash_pipeline.render.input_wait import WAIT_JOB
from dflash_pipeline.render.jobs import StageWorkload
from dflash_pipeline.render.rendezvous import NODE_JOB
from dflash_pipeline.run.config import JobSettings
from dflash_pipeline.run.stages import StageDef
from dflash_shared.exit_codes import ExitCode

API_VERSION = "jobset.x-k8s.io/v1alpha2"
KUEUE_PREFIX = "kueue.x-k8s.io/"
EXCLUSIVE_TOPOLOGY_ANNOTATION = "alpha.jobset.sigs.k8s.io/exclusive-topology"
DETERMINISTIC_CODES = (int(ExitCode.USAGE), int(ExitCode.BAD_INPUT))
# The Job controller's message for a pod that matched a FailJob rule (stable since Kubernetes 1.26; JobSet's
# onJobFailureMessagePatterns exists to read it): "Container <c> for pod <ns>/<pod> failed with exit code
# <code> matching FailJob rule at index <i>" and "Pod <ns>/<pod> has condition <type> matching FailJob rule
# at index <i>".
DETERMINISTIC_MESSAGE = ".*failed with exit code (64|65) matching FailJob rule.*"
PREEMPTED_MESSAGES = [f".*failed with exit code {int(ExitCode.PREEMPTED)} matching FailJob rule.*",
                      ".*has condition DisruptionTarget matching FailJob rule.*"]


def _gang_failure_policy() -> dict[str, Any]:
    """The child Job's podFailurePolicy: every failure fails the Job, for the JobSet's rules to judge."""
    return {"rules": [
        {"action": "FailJob", "onExitCodes": {"operator": "In",
                                               "values": [*DETERMINISTIC_CODES, int(ExitCode.PREEMPTED)]}},
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]}


def _node_job(workload: StageWorkload, labels: dict[str, str]) -> dict[str, Any]:
    """The child Job template of the node replicatedJob: `nodes` pods of the stage's pod `template`."""
    child: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": workload.pods,
        "parallelism": workload.pods,
        # A failed pod fails its Job at once; the JobSet restarts the whole gang (or fails) by its rules.
        "backoffLimit": 0,
        "podFailurePolicy": _gang_failure_policy(),
        "template": workload.template,
    }
    if deadline := workload.scheduling.deadline_seconds:
        child["activeDeadlineSeconds"] = deadline
    return {"metadata": {"labels": labels}, "spec": child}


def _wait_job(stage: StageDef, workload: StageWorkload, labels: dict[str, str]) -> dict[str, Any]:
    """The child Job template of the wait-for-input replicatedJob: the workload's `wait_pod`, once."""
    assert workload.wait_pod is not None, f"{stage.name} waits for no upstream manifest"
    own = {**labels, "app.kubernetes.io/component": f"{stage.name}-{WAIT_JOB}"}
    return {"metadata": {"labels": own},
            "spec": {"completions": 1, "parallelism": 1, "backoffLimit": 2, "podFailurePolicy": {"rules": [
                # Timed out (65) or storage refused (69): fail now; other failures are retried twice.
                {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [
                    int(ExitCode.BAD_INPUT), int(ExitCode.ENVIRONMENT)]}}]}, "template": {
                "metadata": {"labels": own}, "spec": workload.wait_pod}}}


def jobset_object(stage: StageDef, settings: JobSettings, workload: StageWorkload) -> dict[str, Any]:
    """The stage's JobSet: the wait pod, then the gang of `nodes` pods (see the module docstring)."""
    metadata = workload.metadata
    # Kueue admits the JobSet as one workload: its queue and priority labels stay on the JobSet alone.
    labels = {k: v for k, v in metadata["labels"].items() if not k.startswith(KUEUE_PREFIX)}
    node = _node_job(workload, labels)
    wait = _wait_job(stage, workload, labels)
    rules = [
        {"name": "input-never-came", "action": "FailJobSet", "targetReplicatedJobs": [WAIT_JOB]},
        {"name": "bad-config-or-input", "action": "FailJobSet", "targetReplicatedJobs": [NODE_JOB],
         "onJobFailureReasons": ["PodFailurePolicy"], "onJobFailureMessagePatterns": [DETERMINISTIC_MESSAGE]},
        {"name": "deadline", "action": "FailJobSet", "onJobFailureReasons": ["DeadlineExceeded"]},
        {"name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts", "targetReplicatedJobs": [NODE_JOB],
         "onJobFailureReasons": ["PodFailurePolicy"], "onJobFailureMessagePatterns": PREEMPTED_MESSAGES},
        # No rule matched (a rank's own error, exit 1 or 69): RestartJobSet, counted against maxRestarts.
    ]
    spec: dict[str, Any] = {
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [NODE_JOB]},
        "failurePolicy": {"maxRestarts": settings.retries_per_shard, "restartStrategy": "BlockingRecreate",
                          "rules": rules},
        "replicatedJobs": [
            {"name": WAIT_JOB, "replicas": 1, "template": wait},
            {"name": NODE_JOB, "replicas": 1, "dependsOn": [{"name": WAIT_JOB, "status": "Complete"}],
             "template": node},
        ],
        "ttlSecondsAfterFinished": settings.ttl_seconds_after_finished,
    }
    if settings.exclusive_topology:
        # One gang per topology domain: JobSet pins all pods of the node Job to nodes sharing this label's value
        # and keeps other JobSets' gangs out of it.
        metadata["annotations"][EXCLUSIVE_TOPOLOGY_ANNOTATION] = settings.exclusive_topology
    return {"apiVersion": API_VERSION, "kind": "JobSet", "metadata": metadata, "spec": spec}
