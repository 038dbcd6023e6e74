"""`pipeline cancel RUN`: delete one run's objects and stop its Jobs; nothing of another run, nothing shared.

Everything a run applies or creates carries the label `dflash-pipeline/run=<run_id>`; the namespace, the stages'
ServiceAccount and the credentials Secret (the namespace's one-time setup) carry none, so they stay. The order
matters:

1. the run driver's Job first, so it creates no stage Job while the others go;
2. the stage Jobs and JobSets, with propagationPolicy Background: their pods go too (a batch/v1 Job deleted
   through the API without a policy orphans its pods, which would keep their GPUs);
3. the run object (the owner of every stage Job): should the stopping driver still have created a Job, the
   garbage collector deletes it, since its owner is gone;
4. the templates, the rendezvous Services and the driver's RBAC.

`kubectl delete -k` of the run's kustomization does the same through the garbage collector (it deletes the
run object, which owns the stage Jobs).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_pipeline.drive.kube import JOBSET_GROUP, JOBSET_VERSION, Cluster, ClusterUnavailableError
from dflash_pipeline.render.driver_objects import DRIVER_ROLE, ROLE_LABEL
from dflash_pipeline.render.pods import RUN_LABEL

logger = logging.getLogger("dflash.pipeline.cancel")
BACKGROUND = "Background"


@dataclass(frozen=True)
class _Kind:
    """One kind of the run's objects: how to list and delete it with the official client."""

    kind: str
    list: Callable[[Cluster, str], Any]
    delete: Callable[[Cluster, str], Any]
    driver_first: bool = False  # within the kind, the driver's object before the others


def _kinds(ns: str) -> list[_Kind]:
    opts: dict[str, Any] = {"propagation_policy": BACKGROUND, "_preload_content": False}
    raw = {"_preload_content": False}
    return [
        _Kind("Job", lambda c, sel: c.batch.list_namespaced_job(ns, label_selector=sel, **raw),
              lambda c, name: c.batch.delete_namespaced_job(name, ns, **opts), driver_first=True),
        _Kind("JobSet", lambda c, sel: c.custom.list_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets", label_selector=sel, **raw),
              lambda c, name: c.custom.delete_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, ns, "jobsets", name, **opts)),
        _Kind("ConfigMap", lambda c, sel: c.core.list_namespaced_config_map(ns, label_selector=sel, **raw),
              lambda c, name: c.core.delete_namespaced_config_map(name, ns, **opts)),
        _Kind("CronJob", lambda c, sel: c.batch.list_namespaced_cron_job(ns, label_selector=sel, **raw),
              lambda c, name: c.batch.delete_namespaced_cron_job(name, ns, **opts)),
        _Kind("Service", lambda c, sel: c.core.list_namespaced_service(ns, label_selector=sel, **raw),
              lambda c, name: c.core.delete_namespaced_service(name, ns, **opts)),
        _Kind("RoleBinding", lambda c, sel: c.rbac.list_namespaced_role_binding(ns, label_selector=sel, **raw),
              lambda c, name: c.rbac.delete_namespaced_role_binding(name, ns, **opts)),
        _Kind("Role", lambda c, sel: c.rbac.list_namespaced_role(ns, label_selector=sel, **raw),
              lambda c, name: c.rbac.delete_namespaced_role(name, ns, **opts)),
        _Kind("ServiceAccount", lambda c, sel: c.core.list_namespaced_service_account(ns, label_selector=sel, **raw),
              lambda c, name: c.core.delete_namespaced_service_account(name, ns, **opts)),
    ]


def _not_found(err: ClusterUnavailableError) -> bool:
    from kubernetes.client.exceptions import ApiException

    return isinstance(err.__cause__, ApiException) and err.__cause__.status == 404


def cancel_run(cluster: Cluster, run_id: str, *, dry_run: bool = False) -> list[str]:
    """Delete every object labelled with the run (see the module docstring); returns 'Kind/name' of each."""
    selector = f"{RUN_LABEL}={run_id}"
    deleted: list[str] = []
    for kind in _kinds(cluster.namespace):
        try:
            with cluster.call(f"list {kind.kind}s ({selector})"):
                items = json.loads(kind.list(cluster, selector).data).get("items", [])
        except ClusterUnavailableError as err:
            if kind.kind == "JobSet" and _not_found(err):
                continue  # no JobSet controller on this cluster
            raise
        if kind.driver_first:
            items.sort(key=lambda i: (i["metadata"].get("labels") or {}).get(ROLE_LABEL) != DRIVER_ROLE)
        for item in items:
            name = item["metadata"]["name"]
            if not dry_run:
                try:
                    with cluster.call(f"delete {kind.kind} {name}"):
                        kind.delete(cluster, name)
                except ClusterUnavailableError as err:
                    if not _not_found(err):  # gone already (the garbage collector was first)
                        raise
            logger.info("%s %s/%s", "would delete" if dry_run else "deleted", kind.kind, name)
            deleted.append(f"{kind.kind}/{name}")
    return deleted
