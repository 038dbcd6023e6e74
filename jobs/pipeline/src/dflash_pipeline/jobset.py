"""Multi-node training as a JobSet (sigs.k8s.io JobSet, jobset.x-k8s.io/v1alpha2): one gang, restarted whole.

Selected with `[stages.train] gang = "jobset"`; needs JobSet v0.10 or later (onJobFailureMessagePatterns).
The plain Indexed Job (`jobs.build_job`) replaces a failed pod on its own and the gang meets again at the
rendezvous; a JobSet instead treats the N pods as one unit:

- replicatedJob `node`: one Indexed Job of N pods (one torchrun agent per node), built from the same pod
  template as the plain Job (`jobs.stage_pod`), with JobSet's address of pod 0 as its rendezvous.
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
- replicatedJob `wait-for-input`: one small CPU pod (the run driver's image) that waits for the tokenized
  manifest; `node` dependsOn it being Complete, so no GPU pod exists before the data does (the JobSet is
  applied with the run and is not created by the run driver, which drives batch/v1 Jobs). A wait that
  times out (65) or cannot reach storage (69) fails the JobSet.
- successPolicy: the JobSet succeeds when the `node` Job completes.
- Kueue: the run file's queue-name and priority labels go on the JobSet (Kueue admits a JobSet as one
  workload, all pods or none); the child Jobs carry none, since Kueue manages them through their JobSet.
"""

from __future__ import annotations

from typing import Any

from dflash_pipeline.config import JobSettings, RunConfig
from dflash_pipeline.jobs import (
    RENDEZVOUS_PORT,
    Rendezvous,
    check_shape,
    pods,
    stage_metadata,
    stage_pod,
)
from dflash_pipeline.layout import layout
from dflash_pipeline.pods import HOME_DIR, container, pod_spec, small_dirs, storage_env
from dflash_pipeline.scheduling import active_deadline_seconds
from dflash_pipeline.stages import StageDef
from dflash_shared.errors import ConfigError
from dflash_shared.exit_codes import ExitCode

API_VERSION = "jobset.x-k8s.io/v1alpha2"
NODE_JOB = "node"
WAIT_JOB = "wait-for-input"
KUEUE_PREFIX = "kueue.x-k8s.io/"
EXCLUSIVE_TOPOLOGY_ANNOTATION = "alpha.jobset.sigs.k8s.io/exclusive-topology"
# The waiting pod costs 50m CPU, so it may wait long: generation of a headline run takes days.
WAIT_FOR_INPUT_S = 14 * 86400
# The orchestration image (dflash_pipeline, its `wait` command); no stage image carries it.
WAIT_IMAGE = "pipeline"
WAIT_RESOURCES = {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}}
WAIT_VOLUME_SIZE = "64Mi"
DETERMINISTIC_CODES = (int(ExitCode.USAGE), int(ExitCode.BAD_INPUT))
# The Job controller's message for a pod that matched a FailJob rule (stable since Kubernetes 1.26; JobSet's
# onJobFailureMessagePatterns exists to read it): "Container <c> for pod <ns>/<pod> failed with exit code
# <code> matching FailJob rule at index <i>" and "Pod <ns>/<pod> has condition <type> matching FailJob rule
# at index <i>".
DETERMINISTIC_MESSAGE = ".*failed with exit code (64|65) matching FailJob rule.*"
PREEMPTED_MESSAGES = [f".*failed with exit code {int(ExitCode.PREEMPTED)} matching FailJob rule.*",
                      ".*has condition DisruptionTarget matching FailJob rule.*"]


# The JobSet's name as its pods see it (JobSet labels every pod with it): a namePrefix overlay renames the
# JobSet, and with it the pods' hostnames and the headless Service, so the endpoint is built from the label.
JOBSET_NAME_ENV = "JOBSET_NAME"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"


def node_pod_name() -> str:
    """Hostname of pod 0 of the node Job, <jobset>-<replicatedJob>-<job index>-<pod index>, for the kubelet to
    expand."""
    return f"$({JOBSET_NAME_ENV})-{NODE_JOB}-0-0"


def gang_rendezvous() -> Rendezvous:
    """Pod 0 of the node Job under the Service JobSet makes, named after the JobSet (network.subdomain left to
    its default); JobSet sets the pods' subdomain itself."""
    return Rendezvous(
        endpoint=f"{node_pod_name()}.$({JOBSET_NAME_ENV}):{RENDEZVOUS_PORT}",
        env={"name": JOBSET_NAME_ENV,
             "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOBSET_NAME_LABEL}']"}}},
        subdomain=None,
    )


def _gang_failure_policy() -> dict[str, Any]:
    """The child Job's podFailurePolicy: every failure fails the Job, for the JobSet's rules to judge."""
    return {"rules": [
        {"action": "FailJob", "onExitCodes": {"operator": "In",
                                               "values": [*DETERMINISTIC_CODES, int(ExitCode.PREEMPTED)]}},
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]}


def _node_job(
    stage: StageDef, settings: JobSettings, template: dict[str, Any], labels: dict[str, str]
) -> dict[str, Any]:
    """The child Job template of the node replicatedJob: `nodes` pods of the stage's pod `template`."""
    child: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": pods(stage, settings),
        "parallelism": pods(stage, settings),
        # A failed pod fails its Job at once; the JobSet restarts the whole gang (or fails) by its rules.
        "backoffLimit": 0,
        "podFailurePolicy": _gang_failure_policy(),
        "template": template,
    }
    if deadline := active_deadline_seconds(settings):
        child["activeDeadlineSeconds"] = deadline
    return {"metadata": {"labels": labels}, "spec": child}


def _wait_job(run: RunConfig, stage: StageDef, labels: dict[str, str]) -> dict[str, Any]:
    manifest = stage.input_manifest(layout(run.root, run.run_id))
    assert manifest is not None, f"{stage.name} reads no upstream manifest"
    volumes, mounts = small_dirs(WAIT_VOLUME_SIZE)
    command = ["dflash-pipeline", "wait", "--manifest", manifest, "--timeout-seconds", str(WAIT_FOR_INPUT_S)]
    env = [{"name": "HOME", "value": HOME_DIR}, {"name": "TMPDIR", "value": "/tmp"}, *storage_env(run)]
    wait = container(run, WAIT_JOB, run.images.ref(WAIT_IMAGE), command, env, WAIT_RESOURCES, mounts)
    pod = pod_spec(run, [wait], volumes)
    own = {**labels, "app.kubernetes.io/component": f"{stage.name}-{WAIT_JOB}"}
    return {"metadata": {"labels": own},
            "spec": {"completions": 1, "parallelism": 1, "backoffLimit": 2, "podFailurePolicy": {"rules": [
                # Timed out (65) or storage refused (69): fail now; other failures are retried twice.
                {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [
                    int(ExitCode.BAD_INPUT), int(ExitCode.ENVIRONMENT)]}}]}, "template": {
                "metadata": {"labels": own}, "spec": pod}}}


def build_jobset(run: RunConfig, stage: StageDef, settings: JobSettings) -> dict[str, Any]:
    """The stage's JobSet: the wait pod, then the gang of `nodes` pods (see the module docstring)."""
    if stage.rank_command is None:
        raise ConfigError(f"stages.{stage.name}.gang = \"jobset\": only a torchrun stage (train) runs as a gang; "
                          "set gang = \"indexed-job\" (the default)")
    if settings.nodes < 2:
        raise ConfigError(f"stages.{stage.name}.gang = \"jobset\" with nodes = {settings.nodes}: a JobSet is for "
                          "several nodes; on one node the Indexed Job already restarts the one pod")
    check_shape(stage, settings)
    template = stage_pod(run, stage, settings, gang_rendezvous())
    metadata = stage_metadata(run, stage, settings)
    # Kueue admits the JobSet as one workload: its queue and priority labels stay on the JobSet alone.
    labels = {k: v for k, v in metadata["labels"].items() if not k.startswith(KUEUE_PREFIX)}
    node = _node_job(stage, settings, template, labels)
    wait = _wait_job(run, stage, labels)
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
