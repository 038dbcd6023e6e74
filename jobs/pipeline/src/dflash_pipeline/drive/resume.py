"""`pipeline resume --config RUN.toml`: continue a run that stopped. The one way to recover from a failure.

A failed stage Job stays failed (a Job is immutable, and the driver never creates a Job whose name exists), and
the driver that saw it fails too (exit 65, `driver.StageFailedError`). `resume` deletes exactly those: the
run's Jobs and JobSets whose Failed condition is true, found by the run label as `cancel` finds a run's
objects, the driver's first, each with propagationPolicy Background so that their pods go as well. Then it
applies the run again, as `submit` does. The new driver skips every committed stage, creates the failed
stage's Job again from its template (changed by the fix, if the run file was), and that stage resumes from
its committed shards, chunks or last checkpoint. Nothing running is touched, nothing of another run, and no
data in the store. With no failed Job (a run whose Jobs have expired, or a driver still running) it is the
same as `submit`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_pipeline.drive.kube import JOBSET_GROUP, JOBSET_VERSION, Cluster, ClusterUnavailableError, job_view
from dflash_pipeline.render.driver_objects import DRIVER_ROLE, ROLE_LABEL
from dflash_pipeline.render.pods import RUN_LABEL

logger = logging.getLogger("dflash.pipeline.resume")
BACKGROUND = "Background"
# How long to wait for a deleted Job to be gone before applying its name again.
GONE_WAIT_S = 60.0


@dataclass(frozen=True)
class FailedObject:
    kind: str  # Job or JobSet
    name: str
    driver: bool
    reason: str | None

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"


def _not_found(err: ClusterUnavailableError) -> bool:
    from kubernetes.client.exceptions import ApiException

    return isinstance(err.__cause__, ApiException) and err.__cause__.status == 404


def _items(cluster: Cluster, kind: str, selector: str) -> list[dict[str, Any]]:
    raw = {"label_selector": selector, "_preload_content": False}
    try:
        with cluster.call(f"list {kind}s ({selector})"):
            if kind == "Job":
                resp = cluster.batch.list_namespaced_job(cluster.namespace, **raw)
            else:
                resp = cluster.custom.list_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, cluster.namespace,
                                                                    "jobsets", **raw)
    except ClusterUnavailableError as err:
        if kind == "JobSet" and _not_found(err):
            return []  # no JobSet controller on this cluster
        raise
    items: list[dict[str, Any]] = json.loads(resp.data).get("items", [])
    return items


def failed_objects(cluster: Cluster, run_id: str) -> list[FailedObject]:
    """The run's failed Jobs and JobSets, the driver's Job first."""
    selector = f"{RUN_LABEL}={run_id}"
    found = []
    for kind in ("Job", "JobSet"):
        for item in _items(cluster, kind, selector):
            view = job_view(item)
            if view.phase == "failed":
                role = (item["metadata"].get("labels") or {}).get(ROLE_LABEL)
                found.append(FailedObject(kind, view.name, role == DRIVER_ROLE, view.reason))
    return sorted(found, key=lambda o: (not o.driver, o.kind, o.name))


def _delete(cluster: Cluster, obj: FailedObject) -> None:
    opts: dict[str, Any] = {"propagation_policy": BACKGROUND, "_preload_content": False}
    try:
        with cluster.call(f"delete {obj}"):
            if obj.kind == "Job":
                cluster.batch.delete_namespaced_job(obj.name, cluster.namespace, **opts)
            else:
                cluster.custom.delete_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, cluster.namespace,
                                                               "jobsets", obj.name, **opts)
    except ClusterUnavailableError as err:
        if not _not_found(err):  # gone already (its TTL, or the garbage collector, was first)
            raise


def _exists(cluster: Cluster, obj: FailedObject) -> bool:
    if obj.kind == "Job":
        return cluster.job(obj.name) is not None
    try:
        with cluster.call(f"get {obj}"):
            cluster.custom.get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, cluster.namespace, "jobsets",
                                                        obj.name, _preload_content=False)
    except ClusterUnavailableError as err:
        if _not_found(err):
            return False
        raise
    return True


def clear_failed(cluster: Cluster, run_id: str, *, dry_run: bool = False, wait_s: float = GONE_WAIT_S,
                 sleep: Callable[[float], None] = time.sleep) -> list[FailedObject]:
    """Delete the run's failed Jobs and JobSets (the driver's first) and wait until they are gone."""
    failed = failed_objects(cluster, run_id)
    if dry_run:
        return failed
    for obj in failed:
        _delete(cluster, obj)
        logger.info("deleted %s (failed: %s)", obj, obj.reason or "no reason given")
    waited = 0.0
    left = [o for o in failed if _exists(cluster, o)]
    while left and waited < wait_s:
        sleep(1.0)
        waited += 1.0
        left = [o for o in left if _exists(cluster, o)]
    if left:
        logger.warning("%s still there after %.0f s (finalizers?); applying anyway: kubectl may refuse the "
                       "driver's Job until it is gone, then run resume again", ", ".join(map(str, left)), wait_s)
    return failed


def resume_run(cluster: Cluster, run_id: str, apply: Callable[[], int], *, dry_run: bool = False,
               say: Callable[[str], None] = logger.info) -> int:
    """Delete the run's failed Jobs, then `apply` the run (submit's apply); returns apply's exit code."""
    removed = clear_failed(cluster, run_id, dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    for obj in removed:
        say(f"{verb} {obj} (failed: {obj.reason or 'no reason given'})")
    if not removed:
        say(f"no failed Job of run {run_id} in namespace {cluster.namespace}: applying the run as submit does")
    return apply()
