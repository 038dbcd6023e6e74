"""The run driver's few calls to the Kubernetes API, through the official `kubernetes` client.

    templates(run_id)      list the run's stage templates (suspended CronJobs)   batch/v1 cronjobs: list
    run_owner(run_id)      the run object that owns the stage Jobs               v1 configmaps: get (that one)
    job(name)              read a stage Job: its phase and failure reason        batch/v1 jobs: get
    create_job(body, owner) create a stage Job (an existing one is adopted)      batch/v1 jobs: create
    failure_detail(name)   a failed pod's container exit code and message        v1 pods: list
    failed_jobsets(run_id) the run's JobSets that failed, with their reason      jobset.x-k8s.io jobsets: list
    admission(job)         why Kueue holds a suspended Job                       kueue.x-k8s.io workloads: list

Responses are read as raw JSON (`_preload_content=False`) rather than as the client's models: a client
older than the cluster drops fields it has no model for (a Job's `podFailurePolicy` or `managedBy`
would vanish from a template on its way to `create`), while the JSON is what the API server stored.

`suspend` is never read to decide anything and never written: Kueue owns it on the Jobs it admits. A
suspended Job is only reported as waiting for admission.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from dflash_pipeline.render.driver_objects import (
    CREATED_BY_LABEL,
    DRIVER_ROLE,
    INPUT_ANNOTATION,
    JOB_NAME_ANNOTATION,
    ORDER_ANNOTATION,
    OUTPUT_ANNOTATION,
    ROLE_LABEL,
    TEMPLATE_ROLE,
    run_object_name,
)
from dflash_pipeline.render.pods import RUN_LABEL
from dflash_pipeline.render.scheduling import QUEUE_LABEL
from dflash_shared.errors import ConfigError, PreflightError
from dflash_shared.exit_codes import describe
from dflash_shared.manifests import MANIFEST_NAME
from dflash_shared.storage import join

logger = logging.getLogger("dflash.pipeline.kube")
JobPhase = Literal["created", "running", "succeeded", "failed"]
# The Job controller labels every pod with its Job's name (Kubernetes >= 1.27).
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
# A multi-node stage rendered as a JobSet is applied with the run, not created by the driver (see jobset.py).
JOBSET_GROUP, JOBSET_VERSION = "jobset.x-k8s.io", "v1alpha2"
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta1"
# Kueue labels each Workload with the uid of the Job it stands for.
WORKLOAD_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
# How much of a termination message goes into a reason: the last lines are where the error is.
_MESSAGE_CHARS = 600


class ClusterAccessError(PreflightError):
    """The API server refused the driver (401/403: its Role lacks a permission). Exit 69; no retry helps."""


class ClusterRejectedError(ConfigError):
    """The API server refused a request as invalid (400/422: a template's Job spec, an admission webhook such as
    Kueue's). Exit 64: the same request fails on every retry until the run file is fixed."""


class ClusterUnavailableError(RuntimeError):
    """The API server could not be reached or answered an error worth retrying (5xx, timeouts)."""


@dataclass(frozen=True)
class StageTemplate:
    """One stage as the driver runs it: the Job to create and the manifests that order it."""

    stage: str
    order: int
    job_name: str
    input_manifest: str | None
    output_manifest: str
    body: dict[str, Any]


@dataclass(frozen=True)
class JobView:
    name: str
    phase: JobPhase
    reason: str | None = None
    uid: str | None = None
    queue: str | None = None  # the Kueue LocalQueue it is labelled for
    suspended: bool = False


def owner_reference(obj: dict[str, Any]) -> dict[str, Any]:
    """An ownerReference to `obj` as the API server stored it (its uid). Not a controller reference and no
    blockOwnerDeletion: the Job controller stays the controller of the pods, Kueue does not mistake the run
    object for a parent workload, and the driver needs no update right on the owner."""
    meta = obj["metadata"]
    return {"apiVersion": obj.get("apiVersion", "v1"), "kind": obj.get("kind", "ConfigMap"), "name": meta["name"],
            "uid": meta["uid"]}


def template_from_cronjob(cronjob: dict[str, Any]) -> StageTemplate:
    """The Job a template describes, with the driver's label; errors name the template and the missing key."""
    meta = cronjob.get("metadata", {})
    annotations = meta.get("annotations") or {}
    where = f"CronJob {meta.get('name')!r}"
    missing = [k for k in (JOB_NAME_ANNOTATION, ORDER_ANNOTATION, OUTPUT_ANNOTATION) if k not in annotations]
    if missing:
        raise ConfigError(f"{where} is labelled a stage template but lacks the annotation(s) {', '.join(missing)}; "
                          "render the run again (python -m dflash_pipeline render)")
    template = cronjob["spec"]["jobTemplate"]
    labels = {**(template.get("metadata", {}).get("labels") or {}), CREATED_BY_LABEL: DRIVER_ROLE}
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": annotations[JOB_NAME_ANNOTATION], "namespace": meta.get("namespace"), "labels": labels,
                     "annotations": dict(template.get("metadata", {}).get("annotations") or {})},
        "spec": template["spec"],
    }
    return StageTemplate(
        stage=(meta.get("labels") or {}).get("app.kubernetes.io/component", meta.get("name", "?")),
        order=int(annotations[ORDER_ANNOTATION]),
        job_name=annotations[JOB_NAME_ANNOTATION],
        input_manifest=annotations.get(INPUT_ANNOTATION),
        output_manifest=join(annotations[OUTPUT_ANNOTATION], MANIFEST_NAME),
        body=body,
    )


def job_view(job: dict[str, Any]) -> JobView:
    """A Job's phase from its status conditions (only Failed and Complete are final), uid and Kueue queue."""
    found = _job_view(job)
    labels = job["metadata"].get("labels") or {}
    return JobView(found.name, found.phase, found.reason, job["metadata"].get("uid"), labels.get(QUEUE_LABEL),
                   bool((job.get("spec") or {}).get("suspend")))


def _job_view(job: dict[str, Any]) -> JobView:
    name = job["metadata"]["name"]
    status = job.get("status") or {}
    true = {c["type"]: c for c in status.get("conditions") or [] if c.get("status") == "True"}
    if "Failed" in true:
        cond = true["Failed"]
        return JobView(name, "failed", ": ".join(p for p in (cond.get("reason"), cond.get("message")) if p) or None)
    if "Complete" in true:
        return JobView(name, "succeeded")
    if (status.get("active") or 0) > 0:
        return JobView(name, "running", f"{status['active']} pod(s) active")
    if (job.get("spec") or {}).get("suspend"):
        return JobView(name, "created", "suspended: waiting for admission (a queue such as Kueue releases it)")
    return JobView(name, "created", "no pod running yet")


def pod_failure(pods: list[dict[str, Any]]) -> str | None:
    """The latest failed container of these pods: exit code and termination message; else a pod's own reason."""
    found: list[tuple[str, str]] = []
    for pod in pods:
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if term and term.get("exitCode", 0) != 0:
                message = (term.get("message") or term.get("reason") or "").strip()
                if len(message) > _MESSAGE_CHARS:
                    message = "..." + message[-_MESSAGE_CHARS:]
                text = f"pod {name} container {cs.get('name')} exited {describe(int(term['exitCode']))}"
                found.append((term.get("finishedAt") or "", text + (f": {message}" if message else "")))
        if status.get("phase") == "Failed" and status.get("reason") and not found:
            # Evicted, DeadlineExceeded: the pod failed without a container exit of its own.
            found.append(("", f"pod {name} {status['reason']}: {status.get('message', '')}".rstrip(": ")))
    return max(found)[1] if found else None


# Container waiting reasons that no wait heals, and what fixes each: an image that cannot be pulled or named, a
# Secret or ConfigMap the pod reads that does not exist, a container the runtime cannot create, one that keeps
# exiting.
_IMAGE_FIX = ("check the stage's image reference and that the nodes can pull it (`make build-images`, push, "
              "`images.registry` and digests in the run file, an imagePullSecret for a private registry)")
STUCK_WAITING: dict[str, str] = {
    "ImagePullBackOff": _IMAGE_FIX, "ErrImagePull": _IMAGE_FIX, "InvalidImageName": _IMAGE_FIX,
    "ErrImageNeverPull": _IMAGE_FIX,
    "CreateContainerConfigError": "create the Secret or ConfigMap it names in the run's namespace (the S3 "
                                  "credentials Secret: k8s/README.md)",
    "CreateContainerError": "read the pod's events (`kubectl describe pod`): the runtime cannot create the container",
    "CrashLoopBackOff": "read its log (`python -m dflash_pipeline logs --config RUN.toml STAGE`): the container keeps "
                        "exiting",
}
_UNSCHEDULABLE_FIX = ("check the stage's gpu_types against the nodes' nvidia.com/gpu.product labels, their allocatable "
                      "GPUs and memory, and their taints")


@dataclass(frozen=True)
class PodWaiting:
    """A pod that cannot start, why, since how long, and what fixes it."""

    pod: str
    reason: str
    message: str
    seconds: float
    fix: str

    def describe(self) -> str:
        message = f": {self.message}" if self.message else ""
        return f"pod {self.pod} {self.reason} for {self.seconds / 60:.0f} min{message}; fix: {self.fix}"


def _age(timestamp: str | None, now: float) -> float:
    """Seconds since a Kubernetes timestamp ('2026-12-01T12:00:00Z'); 0 where there is none."""
    if not timestamp:
        return 0.0
    from datetime import datetime

    return max(0.0, now - datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp())


def pods_waiting(pods: list[dict[str, Any]], now: float) -> list[PodWaiting]:
    """The pods that cannot start however long the run waits: a container waiting for a reason of STUCK_WAITING
    (counted from the pod's creation), or no node for the pod (Unschedulable, counted from its PodScheduled
    condition's last change, with the scheduler's message). Longest-waiting first.

    A Job counts such a pod as active, so without this the run would read "running" until the Job's deadline
    (hours) instead of failing in minutes with the reason.
    """
    found: list[PodWaiting] = []
    for pod in pods:
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        if status.get("phase") not in (None, "Pending", "Running"):
            continue
        age = _age(pod["metadata"].get("creationTimestamp"), now)
        for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if (reason := waiting.get("reason")) in STUCK_WAITING:
                message = (waiting.get("message") or "").strip()[-_MESSAGE_CHARS:]
                found.append(PodWaiting(f"{name} (container {cs.get('name')})", reason, message, age,
                                        STUCK_WAITING[reason]))
        for cond in status.get("conditions") or []:
            if (cond.get("type"), cond.get("status"), cond.get("reason")) == ("PodScheduled", "False", "Unschedulable"):
                found.append(PodWaiting(name, "Unschedulable", (cond.get("message") or "").strip()[-_MESSAGE_CHARS:],
                                        _age(cond.get("lastTransitionTime"), now) or age, _UNSCHEDULABLE_FIX))
    return sorted(found, key=lambda w: -w.seconds)


class Cluster:
    """The namespace the driver runs in, through one ApiClient: the pod's own ServiceAccount in the cluster,
    else the kubeconfig ($KUBECONFIG, ~/.kube/config) as for kubectl, or an ApiClient given by the caller."""

    def __init__(self, namespace: str, api_client: Any = None) -> None:
        from kubernetes import client

        if api_client is None:
            from kubernetes import config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                # Outside a pod (a laptop, CI): drive the run with the user's own kubeconfig and rights.
                try:
                    config.load_kube_config()
                except (config.ConfigException, OSError) as err:
                    raise ClusterAccessError(
                        f"no Kubernetes API to talk to: not in a pod, and no usable kubeconfig ({err})") from err
            api_client = client.ApiClient()
        self.namespace = namespace
        # Any: with _preload_content=False the calls return the raw HTTP response, not the annotated model.
        self.batch: Any = client.BatchV1Api(api_client)
        self.core: Any = client.CoreV1Api(api_client)
        self.custom: Any = client.CustomObjectsApi(api_client)
        self.rbac: Any = client.RbacAuthorizationV1Api(api_client)

    @contextlib.contextmanager
    def call(self, what: str) -> Iterator[None]:
        """Map the API server's refusals onto the pipeline's errors (and so its exit codes) for `what`."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            yield
        except ApiException as err:
            detail = api_message(err)
            # Admission webhooks (Kueue's, Gatekeeper's) deny with 403 too, naming themselves; RBAC names the verb.
            if err.status in (400, 422) or (err.status == 403 and "admission webhook" in detail):
                raise ClusterRejectedError(f"the API server refused to {what}: {err.status} {detail}") from err
            if err.status in (401, 403):
                raise ClusterAccessError(
                    f"the API server refused to {what} in namespace {self.namespace}: {err.status} {detail}; "
                    "the driver's Role (k8s/base/role-driver.yaml) must allow it"
                ) from err
            raise ClusterUnavailableError(f"cannot {what}: {err.status} {detail}") from err
        except (HTTPError, OSError) as err:
            raise ClusterUnavailableError(f"cannot {what}: {err}") from err

    def templates(self, run_id: str) -> list[StageTemplate]:
        selector = f"{ROLE_LABEL}={TEMPLATE_ROLE},{RUN_LABEL}={run_id}"
        with self.call(f"list CronJobs ({selector})"):
            resp = self.batch.list_namespaced_cron_job(self.namespace, label_selector=selector,
                                                       _preload_content=False)
        items = json.loads(resp.data).get("items", [])
        return sorted((template_from_cronjob(item) for item in items), key=lambda t: t.order)

    def run_owner(self, run_id: str, name: str | None = None) -> dict[str, Any]:
        """The ownerReference every stage Job gets: the run object applied with the run (`name`: as an overlay
        renamed it; default `dflash-<run_id>-run`)."""
        return owner_reference({"apiVersion": "v1", "kind": "ConfigMap", **self.run_object(run_id, name)})

    def run_object(self, run_id: str, name: str | None = None) -> dict[str, Any]:
        """The run object ConfigMap itself (its data says what the run is; a pilot's holds its run config)."""
        from kubernetes.client.exceptions import ApiException

        name = name or run_object_name(run_id)
        try:
            with self.call(f"get ConfigMap {name}"):
                resp = self.core.read_namespaced_config_map(name, self.namespace, _preload_content=False)
        except ClusterUnavailableError as err:
            if isinstance(err.__cause__, ApiException) and err.__cause__.status == 404:
                raise ConfigError(
                    f"the run object ConfigMap {name} is not in namespace {self.namespace}: apply the run's "
                    "kustomization again (python -m dflash_pipeline render); the stage Jobs are owned by it") from err
            raise
        body: dict[str, Any] = json.loads(resp.data)
        return body

    def job(self, name: str) -> JobView | None:
        from kubernetes.client.exceptions import ApiException

        try:
            with self.call(f"get Job {name}"):
                resp = self.batch.read_namespaced_job(name, self.namespace, _preload_content=False)
        except ClusterUnavailableError as err:
            if isinstance(err.__cause__, ApiException) and err.__cause__.status == 404:
                return None
            raise
        return job_view(json.loads(resp.data))

    def create_job(self, body: dict[str, Any], owner: dict[str, Any] | None = None) -> bool:
        """True when created, False when a Job of that name exists already (a driver before this one made it).

        `owner`: the run object's ownerReference; deleting the run then deletes the Job and its pods.
        """
        from kubernetes.client.exceptions import ApiException

        name = body["metadata"]["name"]
        if owner is not None:
            body = {**body, "metadata": {**body["metadata"], "ownerReferences": [owner]}}
        try:
            with self.call(f"create Job {name}"):
                self.batch.create_namespaced_job(self.namespace, quantities_as_strings(body),
                                                 _preload_content=False)
        except ClusterUnavailableError as err:
            if isinstance(err.__cause__, ApiException) and err.__cause__.status == 409:
                return False
            raise
        return True

    def failed_jobsets(self, run_id: str) -> list[tuple[str, JobView]]:
        """(stage, JobSet) of the run's JobSets whose Failed condition is true; none where JobSet is not installed."""
        from kubernetes.client.exceptions import ApiException

        selector = f"{RUN_LABEL}={run_id}"
        try:
            with self.call(f"list JobSets ({selector})"):
                resp = self.custom.list_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, self.namespace, "jobsets", label_selector=selector,
                    _preload_content=False)
        except ClusterUnavailableError as err:
            if isinstance(err.__cause__, ApiException) and err.__cause__.status == 404:
                return []
            raise
        items = json.loads(resp.data).get("items", [])
        views = [((i["metadata"].get("labels") or {}).get("app.kubernetes.io/component", "?"), job_view(i))
                 for i in items]
        return [(stage, view) for stage, view in views if view.phase == "failed"]

    def admission(self, job: JobView) -> str | None:
        """Why Kueue has not admitted a suspended Job, from its Workload; None without Kueue or a reason.

        A Job labelled for a LocalQueue that does not exist is never admitted and would read "waiting for
        admission" forever: Kueue says so in the Workload's QuotaReserved condition.
        """
        from kubernetes.client.exceptions import ApiException

        if not job.suspended or job.uid is None:
            return None
        selector = f"{WORKLOAD_JOB_UID_LABEL}={job.uid}"
        try:
            with self.call(f"list Workloads ({selector})"):
                resp = self.custom.list_namespaced_custom_object(
                    KUEUE_GROUP, KUEUE_VERSION, self.namespace, "workloads", label_selector=selector,
                    _preload_content=False)
        except ClusterUnavailableError as err:
            if isinstance(err.__cause__, ApiException) and err.__cause__.status == 404:
                return None  # no Kueue on this cluster
            raise
        except ClusterAccessError:
            return None  # an older Role without the rule: the plain "waiting for admission" stays
        items = json.loads(resp.data).get("items", [])
        if not items:
            queue = f" (LocalQueue {job.queue})" if job.queue else ""
            return f"no Kueue Workload for the Job yet{queue}"
        conditions = {c["type"]: c for c in (items[0].get("status") or {}).get("conditions") or []}
        held = conditions.get("QuotaReserved")
        if held and held.get("status") == "False" and held.get("message"):
            message = str(held["message"])
            if job.queue and "doesn't exist" in message and "LocalQueue" in message:
                return (f"no LocalQueue {job.queue} in namespace {self.namespace}: Kueue never admits the Job until "
                        f"one is created, or the run file names another queue (Kueue: {message})")
            return f"Kueue: {message}"
        return None

    def _job_pods(self, job_name: str) -> list[dict[str, Any]]:
        selector = f"{JOB_NAME_LABEL}={job_name}"
        with self.call(f"list pods ({selector})"):
            resp = self.core.list_namespaced_pod(self.namespace, label_selector=selector, _preload_content=False)
        items: list[dict[str, Any]] = json.loads(resp.data).get("items", [])
        return items

    def failure_detail(self, job_name: str) -> str | None:
        return pod_failure(self._job_pods(job_name))

    def pods_waiting(self, job_name: str, now: float | None = None) -> list[PodWaiting]:
        """The Job's pods that cannot start (`pods_waiting`)."""
        import time

        return pods_waiting(self._job_pods(job_name), time.time() if now is None else now)


def quantities_as_strings(obj: Any, key: str = "") -> Any:
    """A copy with every resource quantity a string (`nvidia.com/gpu: 1` -> "1").

    The API takes a quantity as an int or a string and stores the string; the client checks its arguments
    against its models before sending, and those accept only strings.
    """
    if isinstance(obj, dict):
        if key in ("requests", "limits"):
            return {k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in obj.items()}
        return {k: quantities_as_strings(v, k) for k, v in obj.items()}
    if isinstance(obj, list):
        return [quantities_as_strings(v, key) for v in obj]
    return obj


def api_message(err: Any) -> str:
    """The Status message the API server sent, else the HTTP reason."""
    try:
        return str(json.loads(err.body).get("message") or err.reason)
    except (TypeError, ValueError):
        return str(err.reason)
