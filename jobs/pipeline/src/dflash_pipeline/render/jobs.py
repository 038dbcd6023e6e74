"""Kubernetes objects of a run: one builder for every stage's Indexed Job, from the stage's workload resolved once.

Each stage is an Indexed Job with completions = parallelism = shards: pod i gets JOB_COMPLETION_INDEX=i
from Kubernetes and DFLASH_NUM_SHARDS from the Job, which is all the sharded runner needs. The stage's
config travels as DFLASH_<STAGE>_* environment variables, so the image's entrypoint hands the same
settings to its preflight and its run. Exit codes map onto the Job's podFailurePolicy (see
`dflash_shared.exit_codes`): bad configuration and bad input fail the Job at once, preemption is not
counted as a failure, anything else is retried per index.

No stage Job waits for its input: the run driver (`driver_objects`, `driver`) creates each Job only once
its upstream manifest is committed, so a pod never holds a node (GPUs included) while it waits.

The train stage is one process group rather than shards: a pod with several GPUs runs torchrun
(`--standalone`), and a Job of several nodes is an Indexed Job with one pod per node (completions =
parallelism = nodes) whose torchruns meet at a c10d rendezvous hosted by pod 0. Where the ranks meet
is `rendezvous`: pod 0 under the Job's own headless Service, or under the JobSet's.

A stage's workload is resolved from the run once (`stage_workload`, from the stage's wiring: its scheduling, its
pod template, a gang's wait pod, its metadata), and its Job (`job_object`) or its JobSet (`jobset`) is built from
that value. The pod itself (security contexts, home, credentials) is `pods`, shared with the wait pod and the run
driver; how torchrun is started, `rendezvous.launch_args`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_pipeline.render.input_wait import wait_pod
from dflash_pipeline.render.pods import (
    HOME_DIR,
    PART_OF,
    RUN_LABEL,
    SCRATCH_DIR,
    Container,
    pod_spec,
)
from dflash_pipeline.render.rendezvous import Rendezvous, launch_args, stage_rendezvous
from dflash_pipeline.render.scheduling import StageScheduling, stage_scheduling
from dflash_pipeline.run.config import JobSettings, RunConfig
from dflash_pipeline.run.layout import layout
from dflash_pipeline.run.stages import (
    EVALUATE,
    EXPORT,
    GENERATE,
    SERVE_CHECK,
    TOKENIZE,
    TRAIN,
    StageDef,
    StageWiring,
    plan,
    selected_stages,
    stage_wiring,
)
from dflash_shared.errors import ConfigError
from dflash_shared.exit_codes import ExitCode
from dflash_shared.pod_log import POD_NAME_ENV, PREFIX_ENV
from dflash_shared.runner import COUNT_ENV

ACCELERATOR_LABEL = "dflash-pipeline/accelerator"
# Kueue partial admission: the least parallelism it may admit a Job with when the quota for all is not free.
MIN_PARALLELISM_ANNOTATION = "kueue.x-k8s.io/job-min-parallelism"


@dataclass(frozen=True)
class StageWorkload:
    """What a stage's Job and its JobSet are both built from, resolved from the run once (`stage_workload`)."""

    name: str  # the Job's (or JobSet's) name
    labels: dict[str, str]  # the project's labels of the stage, for objects beside it (its Service)
    metadata: dict[str, Any]  # the workload's metadata: name, labels, the prefixes it reads and writes
    pods: int  # pods of its Indexed Job (`pods`): one per shard, or one per node
    template: dict[str, Any]  # the pod template
    wait_pod: dict[str, Any] | None  # a gang's pod that waits for its input (`input_wait`); None for a Job
    wiring: StageWiring
    scheduling: StageScheduling
    rendezvous: Rendezvous | None  # where the pods of a multi-node stage meet; None in one pod


def pod_failure_policy() -> dict[str, Any]:
    """Exit codes -> Job actions; the first matching rule wins."""
    return {
        "rules": [
            # A config or input error fails the same way on every retry: stop the whole Job.
            {"action": "FailJob",
             "onExitCodes": {"operator": "In", "values": [int(ExitCode.USAGE), int(ExitCode.BAD_INPUT)]}},
            # Preempted (SIGTERM) work is committed; the replacement pod resumes without using a retry.
            {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [int(ExitCode.PREEMPTED)]}},
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }


def job_name(run: RunConfig, stage: StageDef) -> str:
    return f"dflash-{run.run_id}-{stage.name}"


def pods(stage: StageDef, settings: JobSettings) -> int:
    """Pods of the stage's Indexed Job: one per shard, or one per node for a process-group stage."""
    return settings.shards if stage.sharded else settings.nodes


def check_shape(stage: StageDef, settings: JobSettings) -> None:
    """Refuse shards, nodes and gang settings that the stage's kind of Job cannot have."""
    where = f"stages.{stage.name}"
    if settings.gang == "jobset" and stage.rank_command is None:
        raise ConfigError(f"{where}.gang = \"jobset\": only a torchrun stage (train) runs as a gang; "
                          "set gang = \"indexed-job\" (the default)")
    if settings.gang == "jobset" and settings.nodes < 2:
        raise ConfigError(f"{where}.gang = \"jobset\" with nodes = {settings.nodes}: a JobSet is for "
                          "several nodes; on one node the Indexed Job already restarts the one pod")
    if settings.nodes > 1 and stage.rank_command is None:
        raise ConfigError(f"{where}.nodes = {settings.nodes}: only a torchrun stage (train) spans nodes; "
                          f"scale {stage.name} with `shards` instead")
    if not stage.sharded and settings.shards != 1:
        raise ConfigError(f"{where}.shards = {settings.shards}: {stage.name} is one process group, not shards; "
                          "scale it with `nodes` and `gpus`")
    if not stage.sharded and settings.max_failed_shards:
        raise ConfigError(f"{where}.max_failed_shards = {settings.max_failed_shards}: the pods of {stage.name} are "
                          "one process group, which fails as a whole when one of them cannot come back")
    if not stage.sharded and settings.min_parallelism is not None:
        raise ConfigError(f"{where}.min_parallelism: {stage.name} is one process group; it cannot start with "
                          "fewer pods (a gang is admitted whole)")
    if settings.exclusive_topology is not None and settings.gang != "jobset":
        raise ConfigError(f"{where}.exclusive_topology needs gang = \"jobset\" (JobSet places the gang)")


def labels(run: RunConfig, stage: StageDef, settings: JobSettings) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": f"dflash-{stage.name}",
        "app.kubernetes.io/component": stage.name,
        "app.kubernetes.io/part-of": PART_OF,
        RUN_LABEL: run.run_id,
        ACCELERATOR_LABEL: "gpu" if settings.gpus else "cpu",
    }


def _stage_env(stage: StageDef, settings: JobSettings, wiring: StageWiring) -> list[dict[str, Any]]:
    """The stage container's own environment: its config as DFLASH_<STAGE>_* variables, its scratch and home,
    and where it keeps its log (`dflash_shared.pod_log` copies the pod's output to
    `<run>/logs/<stage>/<pod name>.log`)."""
    env: list[dict[str, Any]] = [{"name": COUNT_ENV, "value": str(settings.shards)}] if stage.sharded else []
    env += [{"name": name, "value": value} for name, value in wiring.environment.items()]
    return [*env, {"name": "TMPDIR", "value": SCRATCH_DIR}, {"name": "HOME", "value": HOME_DIR},
            {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": PREFIX_ENV, "value": wiring.log_prefix}]


def stage_workload(run: RunConfig, stage: StageDef, settings: JobSettings, wiring: StageWiring) -> StageWorkload:
    """The stage's workload in this run, from its `wiring` (`stages.stage_wiring`): its scheduling, its pods and
    its metadata.

    What is the stage's own comes first, then what the other builders resolve (rendezvous and launch, scheduling,
    the pods), each once.
    """
    check_shape(stage, settings)
    name = job_name(run, stage)
    own_labels = labels(run, stage, settings)
    env = _stage_env(stage, settings, wiring)
    count = pods(stage, settings)
    rendezvous = stage_rendezvous(name, settings)
    args = launch_args(run.run_id, stage, settings, rendezvous)
    sched = stage_scheduling(run, stage, settings)
    # A gang is applied with the run, so it waits for its input in the cluster; the run driver creates every other
    # stage's Job only once its input is there.
    wait = (wait_pod(run, wiring.input_manifest)
            if settings.gang == "jobset" and wiring.input_manifest is not None else None)
    # The run file's own `env` and the rendezvous' name come after the run's storage settings.
    after = [{"name": k, "value": v} for k, v in sorted(settings.env.items())]
    after += [rendezvous.env] if rendezvous is not None else []
    main = Container(stage.name, run.images.ref(stage.image), list(stage.command), env, sched.resources,
                     sched.mounts, args=args, env_after_storage=after)
    spec = pod_spec(run, main, sched.volumes, grace_seconds=settings.termination_grace_seconds,
                    subdomain=rendezvous.subdomain if rendezvous is not None else None)
    spec |= sched.placement
    pod_meta: dict[str, Any] = {"labels": {**own_labels, **sched.pod_labels}}
    if sched.pod_annotations:
        pod_meta["annotations"] = sched.pod_annotations
    annotations = {"dflash-pipeline/output": wiring.output_prefix}
    if wiring.input_manifest is not None:
        annotations["dflash-pipeline/input"] = wiring.input_manifest
    annotations |= sched.job_annotations
    if settings.min_parallelism is not None and settings.min_parallelism < settings.shards:
        annotations[MIN_PARALLELISM_ANNOTATION] = str(settings.min_parallelism)
    metadata = {"name": name, "namespace": run.namespace, "labels": {**own_labels, **sched.job_labels},
                "annotations": annotations}
    return StageWorkload(name=name, labels=own_labels, metadata=metadata, pods=count,
                         template={"metadata": pod_meta, "spec": spec}, wait_pod=wait, wiring=wiring,
                         scheduling=sched, rendezvous=rendezvous)


def job_object(stage: StageDef, settings: JobSettings, workload: StageWorkload) -> dict[str, Any]:
    """The Indexed Job of one stage, from its workload; every stage's Job is built here."""
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": workload.pods,
        "parallelism": workload.pods,
        "backoffLimitPerIndex": settings.retries_per_shard,
    }
    if not stage.sharded:
        # One process group: once a pod has used up its retries (or its node is gone and every other pod times
        # out at the rendezvous), the Job fails at once and frees every GPU, rather than waiting for the other
        # indexes to run out of retries in a rendezvous that cannot complete (see `gang_hold`).
        spec["maxFailedIndexes"] = 0
    elif settings.max_failed_shards is not None:
        spec["maxFailedIndexes"] = settings.max_failed_shards
    spec["podFailurePolicy"] = pod_failure_policy()
    # A replacement starts only once the failed pod is gone, so one index never has two writers (and the Job
    # API requires it with a podFailurePolicy). A pod stuck Terminating on an unreachable node is therefore
    # never replaced until the node is tainted out-of-service or deleted (k8s/README.md, "A lost node").
    spec["podReplacementPolicy"] = "Failed"
    spec["ttlSecondsAfterFinished"] = settings.ttl_seconds_after_finished
    if deadline := workload.scheduling.deadline_seconds:
        spec["activeDeadlineSeconds"] = deadline
    spec["template"] = workload.template
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": workload.metadata, "spec": spec}


def build_job(run: RunConfig, stage: StageDef, settings: JobSettings) -> dict[str, Any]:
    """The Indexed Job of one stage in this run."""
    wiring = stage_wiring(stage, run, settings, layout(run.root, run.run_id))
    return job_object(stage, settings, stage_workload(run, stage, settings, wiring))


def _job_of(run: RunConfig, stage: StageDef) -> dict[str, Any]:
    return build_job(run, stage, run.stages.for_stage(stage.name))


def import_job(run: RunConfig) -> dict[str, Any]:
    """Import of the source conversations into the run's prompts or completions prefix."""
    return _job_of(run, plan(run)[0])


def generate_job(run: RunConfig) -> dict[str, Any]:
    """Generation of completions with the target model (GPU)."""
    return _job_of(run, GENERATE)


def tokenize_job(run: RunConfig) -> dict[str, Any]:
    """Tokenization of the completions into loss-masked shards (CPU)."""
    return _job_of(run, TOKENIZE)


def train_job(run: RunConfig) -> dict[str, Any]:
    """Drafter training on the tokenized shards (GPU; torchrun over several GPUs or nodes)."""
    return _job_of(run, TRAIN)


def export_job(run: RunConfig) -> dict[str, Any]:
    """The trained drafter's serving files (CPU)."""
    return _job_of(run, EXPORT)


def evaluate_job(run: RunConfig) -> dict[str, Any]:
    """Offline acceptance of the exported drafter (GPU)."""
    return _job_of(run, EVALUATE)


def serve_check_job(run: RunConfig) -> dict[str, Any]:
    """The exported drafter in vLLM, engine tau against offline tau (GPU)."""
    return _job_of(run, SERVE_CHECK)


def stage_jobs(run: RunConfig, only: list[str] | None = None) -> list[dict[str, Any]]:
    """The Jobs of the run, upstream first; `only` restricts them to the named stages."""
    return [_job_of(run, s) for s in selected_stages(run, only)]
