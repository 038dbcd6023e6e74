"""The one-time setup of a namespace that runs pipelines: its Namespace object and the stages' ServiceAccount.

These are shared by every run in the namespace, so no run's objects include them (`render_documents`, the
kustomize base): `kubectl delete -k` of one run, or `pipeline cancel`, must never delete the namespace and the
other runs with it, and a run's apply must never reset pod-security labels a cluster admin relaxed on purpose
(RDMA that needs IPC_LOCK, for one). They are applied once, by whoever administers the namespace:

    python -m dflash_pipeline render --setup --config run.toml --out k8s/namespace
    kubectl apply -k k8s/namespace

The Namespace is included only with `create_namespace = true`; otherwise the namespace is expected to exist.
"""

from __future__ import annotations

from typing import Any

from dflash_pipeline.render.pods import PART_OF
from dflash_pipeline.run.config import RunConfig

SETUP_ROLE = "namespace-setup"
PLACEHOLDER = "REPLACE-ME"


def _labels() -> dict[str, str]:
    # No run label: these objects belong to no run, so selecting a run's objects never finds them.
    return {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/component": SETUP_ROLE}


def namespace(run: RunConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": run.namespace, "labels": {
            **_labels(),
            # Every pod rendered here meets the restricted Pod Security Standard.
            "pod-security.kubernetes.io/enforce": "restricted",
        }},
    }


def service_account(run: RunConfig) -> dict[str, Any]:
    """The account every stage pod runs as (no API access; with workload identity, the cloud role)."""
    metadata: dict[str, Any] = {"name": run.storage.service_account, "namespace": run.namespace,
                                "labels": _labels()}
    if run.storage.service_account_annotations:
        metadata["annotations"] = dict(sorted(run.storage.service_account_annotations.items()))
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata, "automountServiceAccountToken": False}


def example_secret(run: RunConfig) -> dict[str, Any]:
    """A Secret with the keys the stages read and placeholder values only: written beside the setup's files, never
    applied with them (`base`)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": run.storage.secret, "namespace": run.namespace,
                     "labels": {"app.kubernetes.io/part-of": PART_OF}},
        "type": "Opaque",
        "stringData": {
            "AWS_ACCESS_KEY_ID": f"{PLACEHOLDER}-access-key-id",
            "AWS_SECRET_ACCESS_KEY": f"{PLACEHOLDER}-secret-access-key",
        },
    }


def setup_documents(run: RunConfig) -> list[dict[str, Any]]:
    """What the namespace needs once, before any run is applied."""
    return [*([namespace(run)] if run.create_namespace else []), service_account(run)]
