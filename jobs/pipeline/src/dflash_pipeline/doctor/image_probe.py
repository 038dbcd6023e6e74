"""Each image the run uses, pulled by a short pod on the nodes its stage would run on (deleted after).

The probe pod copies the placement and pull settings of the first pod template that uses the image (node
selector, affinity, tolerations, imagePullSecrets, ServiceAccount, security contexts) and runs `true` in it with
a few millicores and no GPU, so it holds nothing a run needs. It passes once its container has started (the image
was pulled; a container that then fails still proves the pull), fails at once on a pull or configuration error
(the driver's own list, drive.kube.STUCK_WAITING), and fails when no node takes it within the timeout (GPU
nodes that autoscale may take minutes to appear).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from dflash_pipeline.doctor.checks import ClusterReader
from dflash_pipeline.drive.kube import pods_waiting
from dflash_shared.preflight import CheckError

# The probe pods' label (its value: the run id); not the run's own label, so `logs` and `cancel` never see them.
PROBE_LABEL = "dflash-pipeline/doctor-probe"
# What a probe pod takes: enough to start `true`, nothing a stage pod needs.
PROBE_RESOURCES = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}}
_PLACEMENT = ("nodeSelector", "affinity", "tolerations", "imagePullSecrets", "serviceAccountName",
              "securityContext", "runtimeClassName", "priorityClassName")


@dataclass(frozen=True)
class ImageUse:
    """An image and the first pod template (and the object holding it) that uses it."""

    image: str
    source: str  # "CronJob dflash-r1-train", for the verdict
    pod_spec: dict[str, Any]
    container: dict[str, Any]


def _pod_specs(obj: Any) -> Iterator[dict[str, Any]]:
    """Every pod spec inside a rendered object (a Job's, a CronJob's job template's, a JobSet's replicated jobs')."""
    if isinstance(obj, dict):
        if isinstance(obj.get("containers"), list):
            yield obj
        for value in obj.values():
            yield from _pod_specs(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _pod_specs(value)


def image_uses(documents: list[dict[str, Any]]) -> list[ImageUse]:
    uses: dict[str, ImageUse] = {}
    for doc in documents:
        for spec in _pod_specs(doc.get("spec")):
            for container in [*(spec.get("initContainers") or []), *spec["containers"]]:
                image = container.get("image")
                if image and image not in uses:
                    uses[image] = ImageUse(image, f"{doc.get('kind')} {doc['metadata']['name']}", spec, container)
    return list(uses.values())


def probe_pod(use: ImageUse, run_id: str, index: int, timeout_s: int) -> dict[str, Any]:
    container = {"name": "probe", "image": use.image, "command": ["true"], "resources": PROBE_RESOURCES,
                 "imagePullPolicy": use.container.get("imagePullPolicy", "IfNotPresent")}
    if use.container.get("securityContext"):
        container["securityContext"] = use.container["securityContext"]
    spec = {key: use.pod_spec[key] for key in _PLACEMENT if key in use.pod_spec}
    spec.update(containers=[container], restartPolicy="Never", activeDeadlineSeconds=timeout_s,
                automountServiceAccountToken=False)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"dflash-doctor-{run_id}-{index}"[:63].rstrip("-"),
        "labels": {PROBE_LABEL: run_id}}, "spec": spec}


def _started(pod: dict[str, Any]) -> str | None:
    """Where the probe's image was pulled and its container started, or None while it has not."""
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if cs.get("imageID") or "running" in state or "terminated" in state:
            return (pod.get("spec") or {}).get("nodeName") or status.get("hostIP") or "a node"
    return None


def probe_image(reader: ClusterReader, use: ImageUse, run_id: str, index: int, timeout_s: int,
                sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.time) -> str:
    core, ns = reader.cluster.core, reader.namespace
    body = probe_pod(use, run_id, index, timeout_s)
    name = body["metadata"]["name"]
    reader.read(core.delete_namespaced_pod, name, ns)  # a probe a killed doctor left
    status, created = reader.read(core.create_namespaced_pod, ns, body)
    if status not in (200, 201):
        raise CheckError(f"{use.image} ({use.source}): cannot create a probe pod ({status} "
                         f"{created.get('message', '')})")
    began = clock()
    try:
        while True:
            status, pod = reader.read(core.read_namespaced_pod, name, ns)
            if status == 200 and (node := _started(pod)):
                return f"{use.image} pulled on {node} in {clock() - began:.0f} s ({use.source})"
            stuck = [w for w in pods_waiting([pod], clock()) if w.reason != "Unschedulable"] if status == 200 else []
            if stuck:
                raise CheckError(f"{use.image} ({use.source}): {stuck[0].reason}: {stuck[0].message}; fix: "
                                 f"{stuck[0].fix}")
            if clock() - began > timeout_s:
                waiting = pods_waiting([pod], clock()) if status == 200 else []
                why = f"{waiting[0].reason}: {waiting[0].message}" if waiting else json.dumps(pod.get("status"))[:300]
                raise CheckError(f"{use.image} ({use.source}): the probe pod did not start within {timeout_s} s "
                                 f"({why}); fix: check the stage's placement (gpu_types, node selector, taints) and "
                                 "that its nodes can pull the image")
            sleep(2.0)
    finally:
        reader.read(core.delete_namespaced_pod, name, ns)
