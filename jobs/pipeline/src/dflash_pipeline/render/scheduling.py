"""What the cluster's scheduler, admission and nodes see of a stage besides its command.

- Labels and annotations from `[scheduling]` and the stage's own settings (the stage wins key by key), with
  Kueue's queue and WorkloadPriorityClass labels on the Job, where Kueue reads them.
- `ephemeral-storage` requested and limited per pod from what its emptyDirs may hold: the stage's scratch plus,
  for a stage that copies the target there, the target's size. Without a request the scheduler may place a
  54 GB copy on a node with 20 GB of free disk and the kubelet evicts the pod half-way through the copy; with
  the scratch sizeLimit equal to what was requested, a pod that outgrows its share is evicted alone.
- The Job's activeDeadlineSeconds, the pod's requests and limits (extra device resources, RDMA, next to the
  GPUs) and its placement (node selector, GPU type affinity, tolerations, runtime and priority class).

- The pod's emptyDirs (scratch, /tmp, HOME, /dev/shm), sized as requested.

`stage_scheduling` resolves all of it for one stage at once (`StageScheduling`): the Job and the JobSet of a
stage are built from that one value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from pathlib import Path
from typing import Any

from dflash_pipeline.render.pods import HOME_DIR, SCRATCH_DIR
from dflash_pipeline.run.config import JobSettings, RunConfig, quantity_value
from dflash_pipeline.run.stages import StageDef
from dflash_shared.errors import ConfigError
from dflash_shared.target_family import stated_parameters

# The /tmp emptyDir of every stage pod (disk-backed, so counted in its ephemeral storage).
TMP_SIZE = "1Gi"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# Writable layer and container logs count against the pod's ephemeral storage too; the root filesystem is
# read-only, so the logs are what remains.
LOG_ALLOWANCE = Decimal(2**30)
GIB = Decimal(2**30)
# bf16 weights; model ids round the count (Qwen3-8B holds 8.2 B), and the tokenizer and index files come along.
BYTES_PER_PARAMETER = Decimal(2)
SIZE_MARGIN = Decimal("1.1")


def _up_to_gib(num_bytes: Decimal) -> Decimal:
    return (num_bytes / GIB).to_integral_value(rounding=ROUND_CEILING) * GIB


def whole_gib(num_bytes: Decimal) -> str:
    """A byte count as a quantity of whole GiB, rounded up, so that it is never below what it stands for."""
    return f"{int(_up_to_gib(num_bytes) / GIB)}Gi"


def target_disk_bytes(run: RunConfig) -> Decimal:
    """Bytes a copy of the target takes on a pod's scratch: `target.disk_size`, or estimated from its id."""
    if run.target.disk_size is not None:
        return quantity_value(run.target.disk_size)
    if run.target.uri.startswith("/") and os.path.isdir(run.target.uri):
        # A local run's target (the demo's): its files are here to be counted.
        return Decimal(sum(p.stat().st_size for p in Path(run.target.uri).rglob("*") if p.is_file()))
    # Of "30B-A3B" the total: every expert's weights are copied.
    total_b = stated_parameters(run.target.model_id).total_b
    if total_b is None:
        raise ConfigError(
            f"cannot tell the size of target.model_id {run.target.model_id!r} from its name (no parameter count "
            "such as '8B'): set target.disk_size to the size of the model directory (for example \"60Gi\")"
        )
    return Decimal(str(total_b)) * Decimal(10**9) * BYTES_PER_PARAMETER * SIZE_MARGIN


def _disk(run: RunConfig, stage: StageDef, settings: JobSettings) -> tuple[str, str]:
    """(sizeLimit of the scratch emptyDir, the pod's ephemeral storage), in whole GiB.

    The scratch holds the stage's working space, plus the target copy where it makes one. The ephemeral storage
    is what a stage pod may write to node disk: its disk-backed emptyDirs (scratch, /tmp, HOME; not /dev/shm,
    which is memory) and its logs.
    """
    target = target_disk_bytes(run) if stage.copies_target else Decimal(0)
    scratch, tmp, home = (quantity_value(q) for q in (settings.scratch_size, TMP_SIZE, settings.home_size))
    limit = _up_to_gib(scratch + target)
    return whole_gib(limit), whole_gib(limit + tmp + home + LOG_ALLOWANCE)


def scratch_limit(run: RunConfig, stage: StageDef, settings: JobSettings) -> str:
    """sizeLimit of the scratch emptyDir: the stage's working space, plus the target copy where it makes one."""
    return _disk(run, stage, settings)[0]


def _volumes(settings: JobSettings, scratch: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): writable emptyDirs for a read-only root filesystem, and /dev/shm for GPU stages."""
    volumes = [
        {"name": "scratch", "emptyDir": {"sizeLimit": scratch}},
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


def device_resources(settings: JobSettings) -> dict[str, Any]:
    """The pod's devices by extended resource name: its GPUs, then the run file's extra ones (RDMA).

    Extended resources cannot be overcommitted, so a request, where given, must equal the limit.
    """
    out: dict[str, Any] = {}
    if settings.gpus:
        out[settings.gpu_resource] = settings.gpus
    out |= dict(sorted(settings.extra_resources.items()))
    return out


def _merged(run_wide: dict[str, str], own: dict[str, str]) -> dict[str, str]:
    return dict(sorted({**run_wide, **own}.items()))


def _kueue_labels(run: RunConfig, stage: StageDef, settings: JobSettings, labels: dict[str, str]) -> dict[str, str]:
    out = {}
    for key, value, field in (
        (QUEUE_LABEL, settings.queue_name or run.scheduling.queue_name, "queue_name"),
        (PRIORITY_LABEL, settings.workload_priority_class or run.scheduling.workload_priority_class,
         "workload_priority_class"),
    ):
        if value is None:
            continue
        if key in labels:
            raise ConfigError(f"stages.{stage.name}: the Job label {key} is set both by {field} and by job_labels; "
                              f"keep one (scheduling.{field} or stages.{stage.name}.{field} is the usual place)")
        out[key] = value
    return out


def job_metadata(run: RunConfig, stage: StageDef, settings: JobSettings) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) the run file adds to the stage's Job (the project's own come on top)."""
    labels = _merged(run.scheduling.job_labels, settings.job_labels)
    labels |= _kueue_labels(run, stage, settings, labels)
    return dict(sorted(labels.items())), _merged(run.scheduling.job_annotations, settings.job_annotations)


def pod_metadata(run: RunConfig, settings: JobSettings) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) the run file adds to every pod of the stage."""
    return (_merged(run.scheduling.pod_labels, settings.pod_labels),
            _merged(run.scheduling.pod_annotations, settings.pod_annotations))


def priority_class_name(run: RunConfig, settings: JobSettings) -> str | None:
    return settings.priority_class_name or run.scheduling.priority_class_name


def active_deadline_seconds(settings: JobSettings) -> int | None:
    """The Job's activeDeadlineSeconds, or None for none (0 in the run file).

    The deadline counts from the Job's start; Kueue's release of a suspended Job restarts it, so time spent
    queued for quota does not count against the stage.
    """
    return settings.active_deadline_seconds or None


def _resources(settings: JobSettings, disk: str) -> dict[str, Any]:
    # Node disk is requested like memory and limited to the same amount: the scheduler only places the pod
    # where its emptyDirs fit, and a pod that writes more is evicted instead of filling a neighbour's disk.
    requests: dict[str, Any] = {"cpu": settings.cpu, "memory": settings.memory, "ephemeral-storage": disk}
    limits: dict[str, Any] = {"memory": settings.memory_limit or settings.memory, "ephemeral-storage": disk}
    if settings.cpu_limit:
        limits["cpu"] = settings.cpu_limit
    devices = device_resources(settings)
    # GPUs keep their limit only (the request follows it); extra devices are written out in both.
    requests |= {k: v for k, v in devices.items() if k != settings.gpu_resource}
    limits |= devices
    return {"requests": requests, "limits": limits}


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


@dataclass(frozen=True)
class StageScheduling:
    """What the scheduler, admission and nodes see of one stage's workload, resolved from the run file once."""

    job_labels: dict[str, str]  # the run file's, on the Job (or JobSet) beside the project's own
    job_annotations: dict[str, str]
    pod_labels: dict[str, str]  # the run file's, on every pod
    pod_annotations: dict[str, str]
    placement: dict[str, Any]  # pod spec fields: nodeSelector, affinity, tolerations, runtime and priority class
    resources: dict[str, Any]  # the stage container's requests and limits
    volumes: list[dict[str, Any]]  # the pod's emptyDirs: scratch (sized for a target copy), /tmp, HOME, /dev/shm
    mounts: list[dict[str, Any]]  # where the stage container mounts them
    deadline_seconds: int | None  # activeDeadlineSeconds, None for none


def stage_scheduling(run: RunConfig, stage: StageDef, settings: JobSettings) -> StageScheduling:
    """Everything of `[scheduling]` and the stage's settings that its Job, JobSet and pods carry."""
    job_labels, job_annotations = job_metadata(run, stage, settings)
    pod_labels, pod_annotations = pod_metadata(run, settings)
    placement = _placement(run, settings)
    deadline = active_deadline_seconds(settings)
    scratch, disk = _disk(run, stage, settings)
    volumes, mounts = _volumes(settings, scratch)
    return StageScheduling(
        job_labels=job_labels, job_annotations=job_annotations, pod_labels=pod_labels,
        pod_annotations=pod_annotations, placement=placement, resources=_resources(settings, disk), volumes=volumes,
        mounts=mounts, deadline_seconds=deadline,
    )
