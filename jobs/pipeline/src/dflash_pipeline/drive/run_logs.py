"""`pipeline logs --config RUN.toml [STAGE]`: the run's pod logs, from the cluster while the pods exist, from
the store after (`<root>/<run_id>/logs/<stage>/<pod>.log`, kept by `dflash_shared.pod_log`).

The cluster is read with the user's kubeconfig and rights, as kubectl would (reading pod logs is not in the
run driver's Role): the run's pods by its label (`driver` names the run driver's pod), each one's log from
the API server. Then every log in the store whose pod is gone: a Job deleted by its TTL, a pod replaced after
a retry, a local run (`local` keeps its logs there too). Without a usable kubeconfig, or with `--store-only`,
the store's copies alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_pipeline.drive.kube import Cluster, ClusterAccessError, ClusterRejectedError, ClusterUnavailableError
from dflash_pipeline.render.driver_objects import DRIVER_ROLE
from dflash_pipeline.render.pods import RUN_LABEL
from dflash_pipeline.run.config import RunConfig
from dflash_pipeline.run.layout import layout
from dflash_pipeline.run.stages import plan
from dflash_shared.errors import ConfigError
from dflash_shared.storage import ObjectStore

COMPONENT_LABEL = "app.kubernetes.io/component"
# The API server is asked with a deadline: a kubeconfig naming an unreachable cluster must not hang the command.
_REQUEST_TIMEOUT_S = 30


@dataclass(frozen=True)
class PodLog:
    stage: str
    pod: str
    source: str  # where the text comes from, in words
    text: str


def _tail(text: str, lines: int | None) -> str:
    return text if lines is None else "".join(text.splitlines(keepends=True)[-lines:])


def cluster_logs(cluster: Cluster, run_id: str, stage: str | None, tail: int | None) -> list[PodLog]:
    """The logs of the run's pods that exist now, each pod's main container."""
    selector = f"{RUN_LABEL}={run_id}" + (f",{COMPONENT_LABEL}={stage}" if stage else "")
    with cluster.call(f"list pods ({selector})"):
        resp = cluster.core.list_namespaced_pod(cluster.namespace, label_selector=selector, _preload_content=False,
                                                _request_timeout=_REQUEST_TIMEOUT_S)
    out = []
    for pod in json.loads(resp.data).get("items", []):
        meta, spec = pod["metadata"], pod.get("spec") or {}
        containers = spec.get("containers") or [{}]
        phase = (pod.get("status") or {}).get("phase", "?")
        kwargs: dict[str, Any] = {"_preload_content": False, "_request_timeout": _REQUEST_TIMEOUT_S}
        if containers[0].get("name"):
            kwargs["container"] = containers[0]["name"]
        if tail is not None:
            kwargs["tail_lines"] = tail
        try:
            with cluster.call(f"read the log of pod {meta['name']}"):
                text = cluster.core.read_namespaced_pod_log(meta["name"], cluster.namespace, **kwargs).data.decode(
                    "utf-8", errors="replace")
        except (ClusterRejectedError, ClusterUnavailableError) as err:
            text = f"(no log to read: {err})\n"  # a pod not started yet, or its node gone
        stage_of = (meta.get("labels") or {}).get(COMPONENT_LABEL, "?")
        out.append(PodLog(stage_of, meta["name"], f"pod, {phase}", text))
    return out


def store_logs(store: ObjectStore, run: RunConfig, stage: str | None, tail: int | None,
               skip: set[str]) -> list[PodLog]:
    """The logs kept in the store, but those of the pods in `skip` (read from the cluster instead)."""
    out = []
    for uri in store.list(layout(run.root, run.run_id).logs(stage), suffix=".log"):
        folder, name = uri.rsplit("/", 2)[-2:]
        pod = name.removesuffix(".log")
        if pod in skip:
            continue
        text = store.read_bytes(uri).decode("utf-8", errors="replace")
        out.append(PodLog(folder, pod, f"kept at {uri}", _tail(text, tail)))
    return out


def collect_logs(run: RunConfig, store: ObjectStore, stage: str | None = None, tail: int | None = None,
                 cluster: Callable[[], Cluster] | None = None) -> tuple[list[PodLog], list[str]]:
    """(the logs, upstream stages first, then the driver; notes on what could not be read). `cluster` makes the
    cluster client (None: the store only)."""
    names = [s.name for s in plan(run)]
    if stage is not None and stage not in (*names, DRIVER_ROLE):
        raise ConfigError(f"unknown stage {stage!r}; this run has {', '.join(names)} (and its {DRIVER_ROLE})")
    notes: list[str] = []
    live: list[PodLog] = []
    if cluster is not None:
        try:
            live = cluster_logs(cluster(), run.run_id, stage, tail)
        except (ClusterAccessError, ClusterUnavailableError) as err:
            notes.append(f"the cluster's pods could not be read ({err}); showing the copies in the store")
    # The driver keeps no copy: its state is in driver/state.json, which `status` shows.
    kept = [] if stage == DRIVER_ROLE else store_logs(store, run, stage, tail, {p.pod for p in live})
    order = {name: i for i, name in enumerate([*names, DRIVER_ROLE])}
    logs = sorted([*live, *kept], key=lambda p: (order.get(p.stage, len(order)), p.pod))
    if not logs:
        where = f"stage {stage} of run {run.run_id}" if stage else f"run {run.run_id}"
        notes.append(f"no logs of {where}: no pod in the cluster, none kept under "
                     f"{layout(run.root, run.run_id).logs(stage)}")
    return logs, notes


def format_logs(logs: list[PodLog]) -> str:
    """Each log under a header naming its stage, its pod and where it was read."""
    out = []
    for item in logs:
        out.append(f"==> {item.stage}: {item.pod} ({item.source}) <==\n")
        out.append(item.text if item.text.endswith("\n") or not item.text else item.text + "\n")
    return "".join(out)
