"""What the cluster's scheduler, admission and nodes see of a stage besides its command.

- Labels and annotations from `[scheduling]` and the stage's own settings (the stage wins key by key), with
  Kueue's queue and WorkloadPriorityClass labels on the Job, where Kueue reads them.
- `ephemeral-storage` requested and limited per pod from what its emptyDirs may hold: the stage's scratch plus,
  for a stage that copies the target there, the target's size. Without a request the scheduler may place a
  54 GB copy on a node with 20 GB of free disk and the kubelet evicts the pod half-way through the copy; with
  the scratch sizeLimit equal to what was requested, a pod that outgrows its share is evicted alone.
- The Job's activeDeadlineSeconds, and extra device resources (RDMA) next to the GPUs.
"""

from __future__ import annotations

import os
import re
from decimal import ROUND_CEILING, Decimal
from pathlib import Path
from typing import Any

from dflash_pipeline.config import JobSettings, RunConfig, quantity_value
from dflash_pipeline.stages import StageDef
from dflash_shared.errors import ConfigError

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# Writable layer and container logs count against the pod's ephemeral storage too; the root filesystem is
# read-only, so the logs are what remains.
LOG_ALLOWANCE = Decimal(2**30)
GIB = Decimal(2**30)
# bf16 weights; model ids round the count (Qwen3-8B holds 8.2 B), and the tokenizer and index files come along.
BYTES_PER_PARAMETER = Decimal(2)
SIZE_MARGIN = Decimal("1.1")
# "Qwen3-8B", "Qwen3.6-27B", "Qwen3-30B-A3B" (total, not active), "Llama-3.1-70B-Instruct", "gpt-oss-120b".
_PARAMETERS = re.compile(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)[bB](?![A-Za-z0-9])")


def whole_gib(num_bytes: Decimal) -> str:
    """A byte count as a quantity of whole GiB, rounded up, so that it is never below what it stands for."""
    return f"{int((num_bytes / GIB).to_integral_value(rounding=ROUND_CEILING))}Gi"


def target_disk_bytes(run: RunConfig) -> Decimal:
    """Bytes a copy of the target takes on a pod's scratch: `target.disk_size`, or estimated from its id."""
    if run.target.disk_size is not None:
        return quantity_value(run.target.disk_size)
    if run.target.uri.startswith("/") and os.path.isdir(run.target.uri):
        # A local run's target (the demo's): its files are here to be counted.
        return Decimal(sum(p.stat().st_size for p in Path(run.target.uri).rglob("*") if p.is_file()))
    name = run.target.model_id.rsplit("/", 1)[-1]
    counts = [Decimal(m.group(1)) for m in _PARAMETERS.finditer(name)]
    if not counts:
        raise ConfigError(
            f"cannot tell the size of target.model_id {run.target.model_id!r} from its name (no parameter count "
            "such as '8B'): set target.disk_size to the size of the model directory (for example \"60Gi\")"
        )
    # Of "30B-A3B" the larger number is the total; every weight is copied.
    return max(counts) * Decimal(10**9) * BYTES_PER_PARAMETER * SIZE_MARGIN


def scratch_limit(run: RunConfig, stage: StageDef, settings: JobSettings) -> str:
    """sizeLimit of the scratch emptyDir: the stage's working space, plus the target copy where it makes one."""
    size = quantity_value(settings.scratch_size)
    if stage.copies_target:
        size += target_disk_bytes(run)
    return whole_gib(size)


def ephemeral_storage(run: RunConfig, stage: StageDef, settings: JobSettings, tmp_size: str) -> str:
    """What the pod may write to node disk: its disk-backed emptyDirs (not /dev/shm, which is memory) and logs."""
    total = sum((quantity_value(q) for q in (scratch_limit(run, stage, settings), tmp_size, settings.home_size)),
                LOG_ALLOWANCE)
    return whole_gib(total)


def device_resources(settings: JobSettings) -> dict[str, Any]:
    """The pod's devices by extended resource name: its GPUs, then the run file's extra ones (RDMA).

    Extended resources cannot be overcommitted, so a request, where given, must equal the limit.
    """
    out: dict[str, Any] = {}
    if settings.gpus:
        out[settings.gpu_resource] = settings.gpus
    out.update(sorted(settings.extra_resources.items()))
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
    labels.update(_kueue_labels(run, stage, settings, labels))
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
