"""`dflash-pipeline doctor --config RUN.toml`: every readiness check of the run, one verdict line each, exit 0 or 69.

The checks, in the order a fix is usually needed: the kubeconfig context, the namespace, the user's rights, the
stage ServiceAccount, the credentials Secret, the nodes of each GPU stage, Kueue's queues, the JobSet API, the
staged target and the run's prefix in the object store (with this machine's credentials: the pods use the
Secret's), and each image pulled by a probe pod (`--no-image-probe` leaves that out).
"""

from __future__ import annotations

import functools
from typing import Any

from dflash_pipeline.doctor.checks import (
    ClusterReader,
    check_jobset,
    check_namespace,
    check_nodes,
    check_queues,
    check_rights,
    check_secret,
    check_service_account,
)
from dflash_pipeline.doctor.image_probe import image_uses, probe_image
from dflash_pipeline.drive.kube import Cluster
from dflash_pipeline.render.run_objects import render_documents
from dflash_pipeline.run.config import RunConfig
from dflash_pipeline.run.layout import layout
from dflash_pipeline.staging.model_listing import LISTING_NAME
from dflash_shared.exit_codes import ExitCode
from dflash_shared.preflight import CheckError, Preflight
from dflash_shared.storage import ObjectStore, join

PROBE_TIMEOUT_S = 300


def _context() -> str:
    """The kubeconfig context `doctor` talks through, as kubectl would use it."""
    try:
        from kubernetes import config

        _, active = config.list_kube_config_contexts()
    except Exception:  # no kubeconfig: in a pod, the ServiceAccount's
        return "no kubeconfig: the API server of the pod's own cluster, as its ServiceAccount"
    context = active.get("context") or {}
    return (f"kubeconfig context {active.get('name')} (cluster {context.get('cluster')}, namespace "
            f"{context.get('namespace') or 'default'}; the run's objects go to its own namespace)")


def _target(store: ObjectStore, run: RunConfig) -> str:
    listing = join(run.target.uri, LISTING_NAME)
    if not store.exists(listing):
        raise CheckError(f"no model is staged at target.uri {run.target.uri} ({LISTING_NAME} is missing): "
                         "`dflash-pipeline stage-model --config RUN.toml --from MODEL_FOLDER`")
    return f"a staged model at {run.target.uri}"


def doctor_checks(run: RunConfig, store: ObjectStore, api_client: Any = None, *, probe_images: bool = True,
                  probe_timeout_s: int = PROBE_TIMEOUT_S, **probe_clock: Any) -> Preflight:
    """The run's readiness checks as one Preflight (`api_client`: a given API client instead of the kubeconfig)."""
    documents = render_documents(run)
    reader = ClusterReader(Cluster(run.namespace, api_client))
    checks = Preflight("doctor", store)
    checks.add("context", _context)
    checks.add("namespace", lambda: check_namespace(reader))
    checks.add("rights", lambda: check_rights(reader, documents))
    checks.add("service_account", lambda: check_service_account(reader, run))
    checks.add("secret", lambda: check_secret(reader, run))
    checks.add("nodes", lambda: check_nodes(reader, run))
    checks.add("queues", lambda: check_queues(reader, run))
    checks.add("jobset", lambda: check_jobset(reader, documents))
    checks.add("target", lambda: _target(checks.store, run))
    checks.storage_write(layout(run.root, run.run_id).run_prefix)
    if probe_images:
        for index, use in enumerate(image_uses(documents)):
            checks.add(f"image {use.image.rsplit('/', 1)[-1]}",
                       functools.partial(probe_image, reader, use, run.run_id, index, probe_timeout_s, **probe_clock))
    return checks


def run_doctor(run: RunConfig, store: ObjectStore, api_client: Any = None, **options: Any) -> int:
    """Every check, a line each; exit 0, or 69 with the failures' fixes in their lines (a setting the checks
    cannot even start from, such as an unrenderable run file, is the run file's: 64)."""
    code = doctor_checks(run, store, api_client, **options).run()
    return ExitCode.OK if code == ExitCode.OK else ExitCode.ENVIRONMENT
