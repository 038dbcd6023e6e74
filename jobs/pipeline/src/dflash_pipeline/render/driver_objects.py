"""What `kubectl apply -k` creates for a run: the stage Job templates and the run driver that instantiates them.

No stage Job is applied directly. Each stage's rendered Job travels as the `jobTemplate` of a suspended
CronJob that never fires (the API's one object that stores a complete Job spec without running it), and a
small CPU Job, the run driver, creates the stage Job from it once the stage's input manifest is in S3.

Why CronJob templates rather than ConfigMaps holding the Job YAML (or the run file):
- kustomize still patches them: the overlays' JSON 6902 patches and the `images` transformer reach a
  CronJob's `spec.jobTemplate`, never text inside a ConfigMap;
- the API server validates every stage's Job spec (schema, admission policies) at `kubectl apply`, not
  days later when the driver creates the train Job after generation;
- `kubectl create job NAME --from=cronjob/TEMPLATE` is a manual fallback anyone knows.

The driver runs as its own ServiceAccount with a namespaced Role: read the templates, create and read Jobs,
list pods (for a failed pod's exit code and termination message). The stages' ServiceAccount keeps no
Kubernetes API access at all.

Every Job the driver creates is owned (an ownerReference) by the run object, a ConfigMap `dflash-<run_id>-run`
applied with the run: deleting the run (`kubectl delete -k`, `pipeline cancel`) lets the garbage collector
delete its stage Jobs and their pods, and tools that prune by ownership (`kubectl apply --prune`, Argo CD)
see them as the run's. The driver Job does not own them: a driver restarted after a fix must find the running
generation where it was.

Of the run file's `[scheduling]` the driver takes the run-wide hooks only, never a stage's: pod labels and
annotations (a workload identity webhook must mutate its pod too, since it reads and writes the run's
prefix), Job labels and annotations, and the pod priorityClassName. Not the Kueue queue (see
`_driver_job_labels`).
"""

from __future__ import annotations

from typing import Any

from dflash_pipeline.render.pods import (
    HOME_DIR,
    PART_OF,
    RUN_LABEL,
    Container,
    pod_spec,
    small_dirs,
)
from dflash_pipeline.render.scheduling import PRIORITY_LABEL, QUEUE_LABEL
from dflash_pipeline.run.config import RunConfig
from dflash_shared.exit_codes import ExitCode

# Labels and annotations the driver finds its templates by.
ROLE_LABEL = "dflash-pipeline/role"
TEMPLATE_ROLE = "stage-template"
DRIVER_ROLE = "driver"
RUN_OBJECT_ROLE = "run"
RUN_OBJECT_ENV = "DFLASH_RUN_OBJECT"
JOB_NAME_ANNOTATION = "dflash-pipeline/job-name"
ORDER_ANNOTATION = "dflash-pipeline/order"
INPUT_ANNOTATION = "dflash-pipeline/input"
OUTPUT_ANNOTATION = "dflash-pipeline/output"
# Set on every Job the driver creates, so `kubectl get jobs -l` tells them from hand-made ones.
CREATED_BY_LABEL = "dflash-pipeline/created-by"
# February 31st: a schedule that never comes, so even an unsuspended template starts nothing.
NEVER = "0 0 31 2 *"
# The API server refuses CronJob names over 52 characters (it appends an 11-character suffix to Job names).
MAX_TEMPLATE_NAME = 52
DRIVER_IMAGE = "pipeline"
DRIVER_VOLUME_SIZE = "256Mi"
# Node disk: its two emptyDirs (DRIVER_VOLUME_SIZE each) and its logs, which the kubelet rotates. Requested
# like the stages' so the scheduler counts it, limited so a runaway log evicts the driver alone.
DRIVER_DISK = "1Gi"
DRIVER_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi", "ephemeral-storage": DRIVER_DISK},
                    "limits": {"memory": "512Mi", "ephemeral-storage": DRIVER_DISK}}
DRIVER_TTL_S = 3 * 86400
# The driver's exit code when a stage Job failed: retrying the driver cannot help until someone fixes the
# stage and deletes its failed Job, so the driver Job's podFailurePolicy fails it at once.
STAGE_FAILED = ExitCode.BAD_INPUT


def template_name(run_id: str, stage: str) -> str:
    """`<run_id>-<stage>`: the stage's Job name is `dflash-<run_id>-<stage>`, up to 55 characters, too long."""
    name = f"{run_id}-{stage}"
    assert len(name) <= MAX_TEMPLATE_NAME, name  # MAX_RUN_ID leaves room for the longest stage name
    return name


def driver_name(run_id: str) -> str:
    return f"dflash-{run_id}-driver"


def run_object_name(run_id: str) -> str:
    return f"dflash-{run_id}-run"


def stage_template(job: dict[str, Any], order: int) -> dict[str, Any]:
    """The stage Job as a suspended CronJob's jobTemplate; its labels let the overlays' patches find it."""
    meta = job["metadata"]
    labels = dict(meta["labels"])
    stage = labels["app.kubernetes.io/component"]
    run_id = labels[RUN_LABEL]
    annotations = {**meta.get("annotations", {}), JOB_NAME_ANNOTATION: meta["name"], ORDER_ANNOTATION: str(order)}
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {"name": template_name(run_id, stage), "namespace": meta["namespace"],
                     "labels": {**labels, ROLE_LABEL: TEMPLATE_ROLE}, "annotations": annotations},
        "spec": {
            "schedule": NEVER,
            "suspend": True,
            "concurrencyPolicy": "Forbid",
            "jobTemplate": {"metadata": {"labels": labels, "annotations": dict(meta.get("annotations", {}))},
                            "spec": job["spec"]},
        },
    }


def _driver_labels(run: RunConfig) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "dflash-driver",
        "app.kubernetes.io/component": DRIVER_ROLE,
        "app.kubernetes.io/part-of": PART_OF,
        RUN_LABEL: run.run_id,
        ROLE_LABEL: DRIVER_ROLE,
    }


def _driver_job_labels(run: RunConfig) -> dict[str, str]:
    """The driver Job's labels: the run's job_labels without a Kueue queue, unless driver_queue_name sets one.

    The driver is a tiny CPU pod that must run for any stage Job to be created at all, and it holds its
    quota for the whole run. In the stages' queue, one with no CPU quota (a GPU-only ClusterQueue) never
    admits it, and one whose CPU quota is held by running drivers admits none of their stage Jobs, which
    those drivers wait for: the runs deadlock. So the driver is not queued (even through job_labels) unless
    the run file names a queue for it, one with quota kept for drivers.
    """
    sched = run.scheduling
    labels = {k: v for k, v in sched.job_labels.items() if k != QUEUE_LABEL}
    if sched.driver_queue_name is not None:
        labels[QUEUE_LABEL] = sched.driver_queue_name
        if sched.workload_priority_class is not None:
            labels.setdefault(PRIORITY_LABEL, sched.workload_priority_class)
    return {**dict(sorted(labels.items())), **_driver_labels(run)}


def _driver_pod_metadata(run: RunConfig) -> dict[str, Any]:
    """Run-wide pod labels and annotations: what a pod-mutating webhook (workload identity) reads."""
    meta: dict[str, Any] = {"labels": {**dict(sorted(run.scheduling.pod_labels.items())), **_driver_labels(run)}}
    if run.scheduling.pod_annotations:
        meta["annotations"] = dict(sorted(run.scheduling.pod_annotations.items()))
    return meta


def driver_service_account(run: RunConfig) -> dict[str, Any]:
    # The same cloud identity as the stages' account: the driver reads and writes the run's prefix too
    # (with workload identity, the role's trust policy must name this account as well).
    metadata: dict[str, Any] = {"name": driver_name(run.run_id), "namespace": run.namespace,
                                "labels": _driver_labels(run)}
    if run.storage.service_account_annotations:
        metadata["annotations"] = dict(sorted(run.storage.service_account_annotations.items()))
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata}


def driver_role(run: RunConfig) -> dict[str, Any]:
    """Only what the driver calls: no delete, no update, no suspend; nothing outside the namespace."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": driver_name(run.run_id), "namespace": run.namespace, "labels": _driver_labels(run)},
        "rules": [
            {"apiGroups": ["batch"], "resources": ["cronjobs"], "verbs": ["get", "list"]},
            {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "create"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
            # The run object, whose uid the stage Jobs' ownerReference names; only that one ConfigMap.
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"],
             "resourceNames": [run_object_name(run.run_id)]},
            # Why Kueue holds a Job (a LocalQueue that does not exist, no quota): its Workload's conditions.
            {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["list"]},
            # A multi-node train stage rendered as a JobSet runs on its own; the driver only notices its failure.
            {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["list"]},
        ],
    }


def driver_role_binding(run: RunConfig) -> dict[str, Any]:
    name = driver_name(run.run_id)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": run.namespace, "labels": _driver_labels(run)},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": run.namespace}],
    }


def driver_job(run: RunConfig) -> dict[str, Any]:
    """The run driver: one small CPU pod that lives as long as the run."""
    metadata: dict[str, Any] = {"name": driver_name(run.run_id), "namespace": run.namespace,
                                "labels": _driver_job_labels(run)}
    if run.scheduling.job_annotations:
        metadata["annotations"] = dict(sorted(run.scheduling.job_annotations.items()))
    pod_metadata = _driver_pod_metadata(run)
    volumes, mounts = small_dirs(DRIVER_VOLUME_SIZE)
    env: list[dict[str, Any]] = [
        # From the pod itself, so an overlay that moves the run to another namespace moves the driver too.
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        # The run object's name: renamed with it by a namePrefix overlay (the base's kustomizeconfig.yaml).
        {"name": RUN_OBJECT_ENV, "value": run_object_name(run.run_id)},
        {"name": "HOME", "value": HOME_DIR},
        {"name": "TMPDIR", "value": "/tmp"},
    ]
    command = ["dflash-pipeline", "drive", "--run-id", run.run_id, "--root", run.root]
    driver = Container("driver", run.images.ref(DRIVER_IMAGE), command, env, DRIVER_RESOURCES, mounts)
    # The one pod of a run that talks to the API server.
    pod = pod_spec(run, driver, volumes, service_account=driver_name(run.run_id), api_token=True)
    # The run-wide class, as the stages have unless they set their own: at a lower priority the driver is
    # the first pod kube-scheduler preempts for the very stage pods it created, and its replacement then
    # waits behind them while no downstream Job can be created.
    if run.scheduling.priority_class_name:
        pod["priorityClassName"] = run.scheduling.priority_class_name
    fail_now = [int(ExitCode.USAGE), int(ExitCode.ENVIRONMENT), int(STAGE_FAILED)]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            # A restarted driver adopts the Jobs it created: a crash or an evicted node costs nothing.
            "backoffLimit": 6,
            "podFailurePolicy": {"rules": [
                # Bad arguments, storage it may not use, a failed stage: the same again on every retry.
                {"action": "FailJob", "onExitCodes": {"operator": "In", "values": fail_now}},
                # Stopped (SIGTERM) or evicted: the replacement adopts the run where it stands.
                {"action": "Ignore", "onExitCodes": {"operator": "In", "values": [int(ExitCode.PREEMPTED)]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "ttlSecondsAfterFinished": DRIVER_TTL_S,
            "template": {"metadata": pod_metadata, "spec": pod},
        },
    }


# The run object's key holding a pilot's RunConfig as JSON (no secrets: a run file names Secrets, never holds them).
PILOT_RUN_KEY = "pilot-run.json"


def run_object(run: RunConfig) -> dict[str, Any]:
    """The run itself as an object: the owner of every stage Job the driver creates (see the module docstring).

    A ConfigMap because every cluster has the kind, holds no secret, and needs no controller; its data says
    what the run is, for people reading it with kubectl.
    """
    labels = {"app.kubernetes.io/name": "dflash-run", "app.kubernetes.io/component": RUN_OBJECT_ROLE,
              "app.kubernetes.io/part-of": PART_OF, RUN_LABEL: run.run_id, ROLE_LABEL: RUN_OBJECT_ROLE}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": run_object_name(run.run_id), "namespace": run.namespace, "labels": labels},
        "data": {"run_id": run.run_id, "root": run.root,
                 # A pilot's driver writes its report when the run ends, from the run config and the manifests.
                 **({"pilot_of": run.pilot_of, PILOT_RUN_KEY: run.model_dump_json(by_alias=True)}
                    if run.pilot_of is not None else {})},
    }


def driver_objects(run: RunConfig) -> list[dict[str, Any]]:
    """The run object, then the ServiceAccount, Role, RoleBinding and Job of the run driver."""
    return [run_object(run), driver_service_account(run), driver_role(run), driver_role_binding(run),
            driver_job(run)]
