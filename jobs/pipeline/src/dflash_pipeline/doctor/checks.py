"""The cluster side of `doctor`: what the run file names must exist in the cluster, and the user must be allowed to
create what `submit` applies.

Each check returns the line it passed with, raises CheckError (exit 69) with the fix, or CheckWarning where it
cannot tell (the user may not read Secrets or list nodes: a cluster-scoped right many users lack); the verdicts
and exit codes are the stages' own preflight's (dflash_shared.preflight).

    namespace        the run's namespace exists
    rights           the user may create, patch and read every kind `submit` applies, and read pods and logs
    service_account  the stage pods' ServiceAccount exists (the namespace setup, `submit --setup`)
    secret           the S3 credentials Secret exists and holds the two keys (never read out)
    nodes            per GPU stage: nodes whose labels match its gpu_types and node selector, whose taints it
                     tolerates, with its GPUs allocatable; a multi-node train gang needs that many at once
    queues           every Kueue LocalQueue the run names exists
    jobset           the JobSet API is served, when a multi-node train stage is rendered as a JobSet
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dflash_pipeline.drive.kube import Cluster, api_message
from dflash_pipeline.plan.gpu_models import PRODUCT_LABEL
from dflash_pipeline.run.config import JobSettings, RunConfig
from dflash_pipeline.run.stages import plan as run_stages
from dflash_shared.preflight import CheckError, CheckWarning

GPU_RESOURCE = "nvidia.com/gpu"
# kind -> (API group, resource) of what `submit` may apply.
RESOURCES = {
    "CronJob": ("batch", "cronjobs"), "Job": ("batch", "jobs"), "ConfigMap": ("", "configmaps"),
    "Service": ("", "services"), "ServiceAccount": ("", "serviceaccounts"), "Secret": ("", "secrets"),
    "Role": ("rbac.authorization.k8s.io", "roles"), "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"),
    "JobSet": ("jobset.x-k8s.io", "jobsets"),
}
# `kubectl apply` reads, creates and patches; `status`, `logs`, `resume` and `cancel` read pods, logs and delete.
APPLY_VERBS = ("get", "create", "patch")
FOLLOW_RIGHTS = (("list", "", "pods"), ("get", "", "pods/log"), ("delete", "batch", "jobs"))
SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


class ClusterReader:
    """Reads through the official client, answering (HTTP status, JSON body): here a refusal or an absence is a
    verdict, not an error. A server that cannot be reached at all fails the check that asked."""

    def __init__(self, cluster: Cluster) -> None:
        from kubernetes import client

        self.cluster = cluster
        self.namespace = cluster.namespace
        self.auth: Any = client.AuthorizationV1Api(cluster.core.api_client)

    def read(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return 200, json.loads(call(*args, _preload_content=False, **kwargs).data)
        except ApiException as err:
            return int(err.status or 0), {"message": api_message(err)}
        except (HTTPError, OSError) as err:
            raise CheckError(f"cannot reach the Kubernetes API server: {err} (check the kubeconfig's context, "
                             "`kubectl config current-context`)") from err


def check_namespace(reader: ClusterReader) -> str:
    ns = reader.namespace
    status, body = reader.read(reader.cluster.core.read_namespace, ns)
    if status == 200:
        return f"namespace {ns} exists"
    if status == 404:
        raise CheckError(f"namespace {ns} does not exist: `dflash-pipeline submit --config RUN.toml --setup` creates "
                         "it (with create_namespace = true), or ask your cluster's admin for it")
    # Reading a Namespace is a cluster-scoped right: without it, listing something in it answers instead.
    listed, _ = reader.read(reader.cluster.core.list_namespaced_config_map, ns, limit=1)
    if listed == 200:
        return f"namespace {ns}: its ConfigMaps can be listed (reading the Namespace itself: {status})"
    raise CheckError(f"namespace {ns} cannot be read ({status} {body.get('message', '')}): check the namespace in "
                     "the run file and your rights in it")


def _allowed(reader: ClusterReader, verb: str, group: str, resource: str) -> bool | None:
    """The API server's answer to "may I `verb` `resource` here" (a SelfSubjectAccessReview); None: no answer."""
    plural, _, sub = resource.partition("/")
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview", "spec": {
        "resourceAttributes": {"namespace": reader.namespace, "verb": verb, "group": group, "resource": plural,
                               **({"subresource": sub} if sub else {})}}}
    status, body = reader.read(reader.auth.create_self_subject_access_review, review)
    if status not in (200, 201):
        return None
    return bool((body.get("status") or {}).get("allowed"))


def check_rights(reader: ClusterReader, documents: list[dict[str, Any]]) -> str:
    kinds = sorted({str(doc.get("kind")) for doc in documents} & set(RESOURCES))
    wanted = [(verb, *RESOURCES[kind]) for kind in kinds for verb in APPLY_VERBS] + list(FOLLOW_RIGHTS)
    answers = {(verb, group, resource): _allowed(reader, verb, group, resource) for verb, group, resource in wanted}
    if all(answer is None for answer in answers.values()):
        raise CheckWarning("the API server answers no access reviews here: your rights are checked when `submit` "
                           "applies the run")
    missing = [f"{verb} {resource}{'.' + group if group else ''}" for (verb, group, resource), ok in answers.items()
               if ok is False]
    if missing:
        raise CheckError(f"you may not {', '.join(missing)} in namespace {reader.namespace}: `submit` applies "
                         f"{', '.join(kinds)} and `status`/`logs`/`resume` read pods and delete Jobs; ask for a Role "
                         "granting them (k8s/README.md lists what each command needs)")
    return f"you may apply {', '.join(kinds)} and follow the run ({len(answers)} access reviews)"


def check_service_account(reader: ClusterReader, run: RunConfig) -> str:
    name = run.storage.service_account
    status, body = reader.read(reader.cluster.core.read_namespaced_service_account, name, reader.namespace)
    if status == 200:
        return f"ServiceAccount {name} exists"
    if status == 404:
        raise CheckError(f"ServiceAccount {name}, which the stage pods run as, does not exist in {reader.namespace}: "
                         "`dflash-pipeline submit --config RUN.toml --setup` creates it (the namespace's one-time "
                         "setup)")
    raise CheckWarning(f"cannot read ServiceAccount {name} ({status} {body.get('message', '')}): a missing one "
                       "keeps every stage Job from creating its pods")


def check_secret(reader: ClusterReader, run: RunConfig) -> str:
    name = run.storage.secret
    if name is None:
        return "S3 credentials come from workload identity (no Secret)"
    status, body = reader.read(reader.cluster.core.read_namespaced_secret, name, reader.namespace)
    create = (f"`kubectl -n {reader.namespace} create secret generic {name} --from-literal=AWS_ACCESS_KEY_ID=... "
              "--from-literal=AWS_SECRET_ACCESS_KEY=...`")
    if status == 404:
        raise CheckError(f"Secret {name} (the pods' S3 credentials, storage.secret_name) does not exist in "
                         f"{reader.namespace}: {create}")
    if status != 200:
        raise CheckWarning(f"cannot read Secret {name} ({status}): a missing Secret stops every pod at "
                           "CreateContainerConfigError, which the run driver reports within minutes")
    # Only the key names are looked at: no value leaves the API server's answer.
    keys = set((body.get("data") or {}) | (body.get("stringData") or {}))
    lacking = [key for key in SECRET_KEYS if key not in keys]
    if lacking:
        raise CheckError(f"Secret {name} lacks {', '.join(lacking)}: the pods read their S3 credentials from these "
                         f"keys; recreate it: {create}")
    return f"Secret {name} holds {', '.join(SECRET_KEYS)}"


def _tolerated(taint: dict[str, Any], tolerations: list[dict[str, Any]]) -> bool:
    if taint.get("effect") not in ("NoSchedule", "NoExecute"):
        return True  # PreferNoSchedule only steers
    for tol in tolerations:
        if tol.get("effect") not in (None, "", taint.get("effect")):
            continue
        if tol.get("operator") == "Exists" and tol.get("key") in (None, "", taint.get("key")):
            return True
        if tol.get("key") == taint.get("key") and tol.get("value") == taint.get("value"):
            return True
    return False


def _allocatable_gpus(node: dict[str, Any]) -> int:
    try:
        return int((node.get("status") or {}).get("allocatable", {}).get(GPU_RESOURCE, 0))
    except (TypeError, ValueError):
        return 0


def stage_nodes(nodes: list[dict[str, Any]], settings: JobSettings) -> tuple[list[dict[str, Any]], str]:
    """The nodes a stage's pods may land on and hold their GPUs, and why the others may not (for the message)."""
    tolerations = [t.model_dump(exclude_none=True) for t in settings.tolerations]
    fits, seen = [], set()
    for node in nodes:
        labels = node["metadata"].get("labels") or {}
        product = labels.get(settings.gpu_type_label, "")
        if settings.gpu_types and product not in settings.gpu_types:
            seen.add(f"{product or 'no ' + settings.gpu_type_label}")
            continue
        if any(labels.get(key) != value for key, value in settings.node_selector.items()):
            continue
        if not all(_tolerated(t, tolerations) for t in (node.get("spec") or {}).get("taints") or []):
            continue
        if (node.get("spec") or {}).get("unschedulable") or _allocatable_gpus(node) < settings.gpus:
            continue
        fits.append(node)
    others = f" (the nodes' {settings.gpu_type_label}: {', '.join(sorted(seen))})" if seen else ""
    return fits, others


def check_nodes(reader: ClusterReader, run: RunConfig) -> str:
    status, body = reader.read(reader.cluster.core.list_node)
    if status != 200:
        raise CheckWarning(f"cannot list nodes ({status}: a cluster-scoped right): each stage's placement is checked "
                           "when its pods are scheduled, and a pod no node takes fails its stage within minutes")
    nodes = body.get("items") or []
    lines, failures = [], []
    for stage in run_stages(run):
        settings = run.stages.for_stage(stage.name)
        if not settings.gpus:
            continue
        fits, others = stage_nodes(nodes, settings)
        wanted = f"{settings.gpus} allocatable {GPU_RESOURCE}"
        where = f"{settings.gpu_type_label} in {settings.gpu_types}" if settings.gpu_types else "any GPU product"
        gang = settings.nodes if stage.name == "train" else 1
        if len(fits) < gang:
            failures.append(f"{stage.name} needs {gang} node(s) with {wanted} ({where}"
                            f"{', nodeSelector ' + str(settings.node_selector) if settings.node_selector else ''}, "
                            f"taints tolerated); {len(fits)} match{others}")
            continue
        total = sum(_allocatable_gpus(n) // settings.gpus for n in fits)
        lines.append(f"{stage.name} {len(fits)} node(s), room for {total} pod(s) of {settings.gpus} GPU(s)")
    if failures:
        raise CheckError("; ".join(failures) + f". `kubectl get nodes -L {PRODUCT_LABEL}` lists the products; set "
                         "the stage's gpu_types to one of them (or check the nodes' taints and allocatable GPUs)")
    return "; ".join(lines) or "no stage runs on a GPU"


def queue_names(run: RunConfig) -> list[str]:
    names = {run.scheduling.queue_name, run.scheduling.driver_queue_name}
    names |= {run.stages.for_stage(stage.name).queue_name for stage in run_stages(run)}
    return sorted(name for name in names if name)


def check_queues(reader: ClusterReader, run: RunConfig) -> str:
    from dflash_pipeline.drive.kube import KUEUE_GROUP, KUEUE_VERSION

    found, missing = [], []
    for name in queue_names(run):
        status, body = reader.read(reader.cluster.custom.get_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION,
                                   reader.namespace, "localqueues", name)
        if status == 200:
            found.append(name)
        elif status == 404:
            missing.append(name)
        else:
            raise CheckWarning(f"cannot read LocalQueue {name} ({status} {body.get('message', '')})")
    if missing:
        raise CheckError(f"LocalQueue {', '.join(missing)} does not exist in {reader.namespace} (or Kueue is not "
                         "installed): a Job labelled with a missing queue stays suspended forever; create it or "
                         "correct queue_name")
    return f"LocalQueue {', '.join(found)} exists" if found else "the run names no Kueue queue"


def check_jobset(reader: ClusterReader, documents: list[dict[str, Any]]) -> str:
    from dflash_pipeline.drive.kube import JOBSET_GROUP, JOBSET_VERSION

    if not any(doc.get("kind") == "JobSet" for doc in documents):
        return "no stage is rendered as a JobSet"
    status, body = reader.read(reader.cluster.custom.list_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION,
                               reader.namespace, "jobsets", limit=1)
    if status == 200:
        return f"the JobSet API ({JOBSET_GROUP}/{JOBSET_VERSION}) is served"
    if status == 404:
        raise CheckError(f"the cluster does not serve {JOBSET_GROUP}/{JOBSET_VERSION}, which the multi-node train "
                         "stage is rendered as: install JobSet (its release manifests), or train on one node")
    raise CheckWarning(f"cannot list JobSets ({status} {body.get('message', '')})")

