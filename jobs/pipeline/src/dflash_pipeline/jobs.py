"""Kubernetes objects of a run: one builder for every stage's Indexed Job (and a multi-node Job's Service).

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
parallelism = nodes) whose torchruns meet at a c10d rendezvous hosted by pod 0. Pod i of an Indexed Job
is named <job>-i; with `subdomain` set to a headless Service of the Job's pods, <job>-0.<service> resolves
to pod 0 as soon as it has an address. Where the ranks meet is a `Rendezvous` the caller may choose: the JobSet
(`jobset`) builds its gang's pod from the same template with the address JobSet gives pod 0.

The pod itself (security contexts, home, credentials) is `pods`, shared with the JobSet and the run driver.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dflash_pipeline.config import JobSettings, RunConfig
from dflash_pipeline.layout import layout
from dflash_pipeline.pods import (
    HOME_DIR,
    PART_OF,
    RUN_LABEL,
    SCRATCH_DIR,
    container,
    pod_spec,
    pull_secrets,
    storage_env,
)
from dflash_pipeline.scheduling import (
    active_deadline_seconds,
    device_resources,
    ephemeral_storage,
    job_metadata,
    pod_metadata,
    priority_class_name,
    scratch_limit,
)
from dflash_pipeline.stages import (
    EVALUATE,
    EXPORT,
    GENERATE,
    SERVE_CHECK,
    TOKENIZE,
    TRAIN,
    StageDef,
    plan,
    selected_stages,
    stage_config,
)
from dflash_shared.errors import ConfigError
from dflash_shared.exit_codes import ExitCode
from dflash_shared.pod_log import POD_NAME_ENV, PREFIX_ENV
from dflash_shared.runner import COUNT_ENV

ACCELERATOR_LABEL = "dflash-pipeline/accelerator"
# Kueue partial admission: the least parallelism it may admit a Job with when the quota for all is not free.
MIN_PARALLELISM_ANNOTATION = "kueue.x-k8s.io/job-min-parallelism"
TMP_SIZE = "1Gi"
RENDEZVOUS_PORT = 29500
# The headless Service's name, as the container sees it: a literal that kustomize renames with the Service (the
# base's kustomizeconfig.yaml), so a namePrefix or nameSuffix overlay keeps the rendezvous endpoint resolvable.
RENDEZVOUS_SERVICE_ENV = "RENDEZVOUS_SERVICE"


@dataclass(frozen=True)
class Rendezvous:
    """Where the torchruns of a multi-node stage meet, and what a pod needs to resolve that address."""

    endpoint: str  # pod 0's host:port for --rdzv-endpoint; the kubelet expands its $(VAR) from `env`
    env: dict[str, Any]  # the container variable the endpoint names
    subdomain: str | None  # the pods' subdomain (a headless Service of our own); None where a controller sets it


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


def service_rendezvous(run: RunConfig, stage: StageDef) -> Rendezvous:
    """Pod 0 of the Job under the Job's own headless Service (`rendezvous_service`).

    Pod 0's hostname is the Job's name (the driver creates it under that name, whatever an overlay calls the
    template) and its index; the kubelet expands the Service's name from the container's environment.
    """
    name = job_name(run, stage)
    return Rendezvous(endpoint=f"{name}-0.$({RENDEZVOUS_SERVICE_ENV}):{RENDEZVOUS_PORT}",
                      env={"name": RENDEZVOUS_SERVICE_ENV, "value": name}, subdomain=name)


def launch_args(run: RunConfig, stage: StageDef, settings: JobSettings, rendezvous: Rendezvous | None) -> list[str]:
    """Arguments of the image entrypoint: none (one process), or torchrun over the pod's GPUs and the Job's nodes.

    The entrypoint runs the preflight once per pod before torchrun. `$(JOB_COMPLETION_INDEX)` is expanded by
    the kubelet from the variable the Job controller gives each pod of an Indexed Job. `rendezvous` is where the
    torchruns of several nodes meet; None for a stage in one pod.
    """
    if stage.rank_command is None or (settings.gpus <= 1 and settings.nodes == 1):
        return []
    per_node = f"--nproc-per-node={max(settings.gpus, 1)}"
    if rendezvous is None:
        return ["torchrun", "--standalone", per_node, *stage.rank_command]
    return [
        "torchrun", f"--nnodes={settings.nodes}", per_node, "--node-rank=$(JOB_COMPLETION_INDEX)",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous.endpoint}", f"--rdzv-id={run.run_id}",
        f"--rdzv-conf=join_timeout={settings.rendezvous_timeout_seconds}", *stage.rank_command,
    ]


def rendezvous_service(run: RunConfig, stage: StageDef, settings: JobSettings) -> dict[str, Any]:
    """Headless Service giving each pod of a multi-node Job a DNS name (<job>-<index>.<service>)."""
    name = job_name(run, stage)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": run.namespace, "labels": labels(run, stage, settings)},
        "spec": {
            "clusterIP": "None",
            # The Job controller labels every pod with its Job's name.
            "selector": {"batch.kubernetes.io/job-name": name},
            # Names must resolve before the pods are Ready: the rendezvous happens during start-up.
            "publishNotReadyAddresses": True,
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT,
                       "protocol": "TCP"}],
        },
    }


def labels(run: RunConfig, stage: StageDef, settings: JobSettings) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": f"dflash-{stage.name}",
        "app.kubernetes.io/component": stage.name,
        "app.kubernetes.io/part-of": PART_OF,
        RUN_LABEL: run.run_id,
        ACCELERATOR_LABEL: "gpu" if settings.gpus else "cpu",
    }


def env_value(value: Any) -> str:
    """How pydantic-settings reads a value back from an environment variable."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return str(value)


def _resources(run: RunConfig, stage: StageDef, settings: JobSettings) -> dict[str, Any]:
    # Node disk is requested like memory and limited to the same amount: the scheduler only places the pod
    # where its emptyDirs fit, and a pod that writes more is evicted instead of filling a neighbour's disk.
    disk = ephemeral_storage(run, stage, settings, TMP_SIZE)
    requests: dict[str, Any] = {"cpu": settings.cpu, "memory": settings.memory, "ephemeral-storage": disk}
    limits: dict[str, Any] = {"memory": settings.memory_limit or settings.memory, "ephemeral-storage": disk}
    if settings.cpu_limit:
        limits["cpu"] = settings.cpu_limit
    devices = device_resources(settings)
    # GPUs keep their limit only (the request follows it); extra devices are written out in both.
    requests.update({k: v for k, v in devices.items() if k != settings.gpu_resource})
    limits.update(devices)
    return {"requests": requests, "limits": limits}


def _volumes(
    run: RunConfig, stage: StageDef, settings: JobSettings
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): writable emptyDirs for a read-only root filesystem, and /dev/shm for GPU stages."""
    volumes = [
        {"name": "scratch", "emptyDir": {"sizeLimit": scratch_limit(run, stage, settings)}},
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}},
        {"name": "home", "emptyDir": {"sizeLimit": settings.home_size}},
    ]
    mounts = [
        {"name": "scratch", "mountPath": SCRATCH_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "home", "mountPath": HOME_DIR},
    ]
    if settings.shm_size:
        # Container runtimes give /dev/shm 64 MiB; NCCL and engine worker processes need far more.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _placement(run: RunConfig, settings: JobSettings) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if settings.node_selector:
        spec["nodeSelector"] = dict(sorted(settings.node_selector.items()))
    if settings.gpu_types:
        term = {"matchExpressions": [{"key": settings.gpu_type_label, "operator": "In",
                                      "values": list(settings.gpu_types)}]}
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [term]}}}
    if settings.tolerations:
        spec["tolerations"] = [t.manifest() for t in settings.tolerations]
    if settings.runtime_class_name:
        spec["runtimeClassName"] = settings.runtime_class_name
    if priority := priority_class_name(run, settings):
        spec["priorityClassName"] = priority
    return spec


def log_env(run: RunConfig, stage: StageDef) -> list[dict[str, Any]]:
    """Where the pod keeps its log: the image entrypoint runs under `dflash_shared.pod_log` when
    DFLASH_LOG_PREFIX is set, which copies the pod's output to `<run>/logs/<stage>/<pod name>.log`."""
    return [{"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": PREFIX_ENV, "value": layout(run.root, run.run_id).logs(stage.name)}]


def stage_pod(
    run: RunConfig, stage: StageDef, settings: JobSettings, rendezvous: Rendezvous | None
) -> dict[str, Any]:
    """The pod template of the stage: its config as DFLASH_<STAGE>_* variables, resources, volumes, placement.

    `rendezvous` is where the pods of a multi-node stage meet (None: the stage runs in one pod).
    """
    image = run.images.ref(stage.image)
    config = stage_config(stage, run, settings)
    env = [{"name": COUNT_ENV, "value": str(settings.shards)}] if stage.sharded else []
    env += [{"name": stage.env_name(key), "value": env_value(value)} for key, value in config.items()]
    env += [{"name": "TMPDIR", "value": SCRATCH_DIR}, {"name": "HOME", "value": HOME_DIR}]
    env += log_env(run, stage)
    env += storage_env(run)
    env += [{"name": k, "value": v} for k, v in sorted(settings.env.items())]
    if rendezvous is not None:
        env.append(rendezvous.env)
    volumes, mounts = _volumes(run, stage, settings)
    resources = _resources(run, stage, settings)
    args = launch_args(run, stage, settings, rendezvous)
    main = container(run, stage.name, image, list(stage.command), env, resources, mounts, args=args)
    spec = pod_spec(run, [main], volumes, grace_seconds=settings.termination_grace_seconds,
                    subdomain=rendezvous.subdomain if rendezvous is not None else None)
    spec.update(_placement(run, settings))
    spec.update(pull_secrets(run))
    pod_labels, pod_annotations = pod_metadata(run, settings)
    meta: dict[str, Any] = {"labels": {**labels(run, stage, settings), **pod_labels}}
    if pod_annotations:
        meta["annotations"] = pod_annotations
    return {"metadata": meta, "spec": spec}


def stage_metadata(run: RunConfig, stage: StageDef, settings: JobSettings) -> dict[str, Any]:
    """The metadata of the stage's workload (its Job, or its JobSet): name, labels, and the prefixes it reads
    and writes as annotations."""
    lay = layout(run.root, run.run_id)
    annotations = {"dflash-pipeline/output": stage.output_prefix(lay)}
    if (upstream := stage.input_manifest(lay)) is not None:
        annotations["dflash-pipeline/input"] = upstream
    extra_labels, extra_annotations = job_metadata(run, stage, settings)
    annotations.update(extra_annotations)
    if settings.min_parallelism is not None and settings.min_parallelism < settings.shards:
        annotations[MIN_PARALLELISM_ANNOTATION] = str(settings.min_parallelism)
    return {"name": job_name(run, stage), "namespace": run.namespace,
            "labels": {**labels(run, stage, settings), **extra_labels}, "annotations": annotations}


def build_job(run: RunConfig, stage: StageDef, settings: JobSettings) -> dict[str, Any]:
    """The Indexed Job of one stage; every stage goes through here."""
    check_shape(stage, settings)
    template = stage_pod(run, stage, settings, service_rendezvous(run, stage) if settings.nodes > 1 else None)
    metadata = stage_metadata(run, stage, settings)
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": pods(stage, settings),
        "parallelism": pods(stage, settings),
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
    if deadline := active_deadline_seconds(settings):
        spec["activeDeadlineSeconds"] = deadline
    spec["template"] = template
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": spec}


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
