"""The run driver's objects as `kubectl apply -k` sends them, for both overlays, built by kubectl's kustomize.

What is applied holds exactly one Job, the driver; every stage is a suspended CronJob that never fires,
whose jobTemplate the overlays' patches reach; the driver's Role grants only what it calls, in its namespace.
The driver takes the run-wide scheduling hooks (workload identity's pod label) but no Kueue queue of the stages.
"""

from __future__ import annotations

from typing import Any

import pytest

from dflash_pipeline import load_run_config, parse_run_config, render_documents
from dflash_pipeline.drive.kube import template_from_cronjob
from dflash_pipeline.render.driver_objects import NEVER, STAGE_FAILED
from dflash_pipeline.render.scheduling import PRIORITY_LABEL, QUEUE_LABEL
from dflash_pipeline.run.config import read_run_file
from dflash_shared.exit_codes import ExitCode
from tests.pipeline.k8s_support import EXAMPLE_RUN, OVERLAYS, failure_action, jobs, kustomize_build, schema_errors

OVERLAY_NAMES = ("local-cpu", "gpu-cluster")
AZURE_LABEL = "azure.workload.identity/use"


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@pytest.fixture(scope="module", params=OVERLAY_NAMES)
def built(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, kustomize_build(OVERLAYS / request.param)


def test_the_driver_is_the_only_job_applied(built: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = built
    (driver,) = by_kind(docs, "Job")
    assert driver["metadata"]["name"] == "dflash-example-driver"
    pod = driver["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:2] == ["dflash-pipeline", "drive"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"] and "nodeSelector" not in pod
    assert pod["serviceAccountName"] == "dflash-example-driver" and pod["automountServiceAccountToken"] is True
    # The overlay renames the image and keeps the run file's tag; no overlay sets a tag of its own.
    expected = "registry.invalid/dflash/dflash-pipeline:0.1.0" if overlay == "gpu-cluster" else (
        "localhost/dflash-pipeline:0.1.0")
    assert container["image"] == expected
    # The namespace comes from the pod itself, so a kustomize `namespace:` moves the driver with the run.
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in (
        container["env"])
    # A failed stage, bad arguments, refused storage: no retry of the driver; preemption: no retry counted.
    for code in (STAGE_FAILED, ExitCode.USAGE, ExitCode.ENVIRONMENT):
        assert failure_action(driver, int(code)) == "FailJob"
    assert failure_action(driver, int(ExitCode.PREEMPTED)) == "Ignore"
    assert failure_action(driver, int(ExitCode.RETRYABLE)) == "Count"


def test_stage_templates_are_suspended_and_never_scheduled(built: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = built
    templates = by_kind(docs, "CronJob")
    assert len(templates) == 7
    for cronjob in templates:
        assert cronjob["spec"]["suspend"] is True and cronjob["spec"]["schedule"] == NEVER
        assert len(cronjob["metadata"]["name"]) <= 52  # the API server's limit for CronJob names
        assert "suspend" not in cronjob["spec"]["jobTemplate"]["spec"]  # Kueue's, on the Job it admits
    orders = sorted(int(c["metadata"]["annotations"]["dflash-pipeline/order"]) for c in templates)
    assert orders == list(range(7))
    # What the driver creates from the patched templates is a valid Job for every supported version.
    assert schema_errors(list(jobs(docs).values())) == []


def test_overlay_patches_reach_the_jobs_the_driver_creates() -> None:
    local = jobs(kustomize_build(OVERLAYS / "local-cpu"))
    gpu = jobs(kustomize_build(OVERLAYS / "gpu-cluster"))
    assert all(job["spec"]["parallelism"] == 1 for job in local.values())
    assert all(job["metadata"]["labels"]["dflash-pipeline/accelerator"] == "cpu" for job in local.values())
    # The GPU product is the run file's to pin (where `plan` sees it), never the overlay's.
    assert "nvidia.com/gpu.product" not in gpu["train"]["spec"]["template"]["spec"]["nodeSelector"]
    assert {t.get("key") for t in gpu["train"]["spec"]["template"]["spec"]["tolerations"]} == {
        "nvidia.com/gpu", "dedicated"}
    assert gpu["tokenize"]["spec"]["template"]["spec"]["containers"][0]["image"].startswith("registry.invalid/")


def test_the_driver_role_grants_only_what_it_calls(built: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = built
    assert by_kind(docs, "ClusterRole") == [] and by_kind(docs, "ClusterRoleBinding") == []
    (role,) = by_kind(docs, "Role")
    grants = {(rule["apiGroups"][0], resource, verb) for rule in role["rules"] for resource in rule["resources"]
              for verb in rule["verbs"]}
    assert grants == {("batch", "cronjobs", "get"), ("batch", "cronjobs", "list"), ("batch", "jobs", "get"),
                      ("batch", "jobs", "create"), ("", "pods", "list"), ("jobset.x-k8s.io", "jobsets", "list"),
                      ("", "configmaps", "get"), ("kueue.x-k8s.io", "workloads", "list")}
    # Of the ConfigMaps, only the run object (the stage Jobs' owner) may be read.
    (configmaps,) = [r for r in role["rules"] if r["resources"] == ["configmaps"]]
    assert configmaps["resourceNames"] == ["dflash-example-run"]
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dflash-example-driver", "namespace": "dflash"}]
    # The stages' own account still has no API access: nothing binds it.
    assert all(s["name"] != "dflash-pipeline" for b in by_kind(docs, "RoleBinding") for s in b["subjects"])


def test_a_template_without_its_annotations_is_refused_by_name() -> None:
    (cronjob,) = [d for d in render_documents(load_run_config(EXAMPLE_RUN), ["train"]) if d["kind"] == "CronJob"]
    del cronjob["metadata"]["annotations"]["dflash-pipeline/job-name"]
    with pytest.raises(ValueError, match="CronJob 'example-train' .* lacks the annotation.*dflash-pipeline/job-name"):
        template_from_cronjob(cronjob)


def hooked_run(**scheduling: Any) -> dict[str, Any]:
    """The example run with Azure workload identity, a Kueue queue for the stages and the other run-wide hooks."""
    data = read_run_file(EXAMPLE_RUN)
    data["storage"] = {"credentials": "workload_identity",
                       "service_account_annotations": {"azure.workload.identity/client-id": "0000-client"}}
    data["scheduling"] = {
        "queue_name": "dflash-gpu", "workload_priority_class": "research", "priority_class_name": "batch-high",
        "job_labels": {"team": "drafters"}, "job_annotations": {"example.com/owner": "ml-platform"},
        "pod_labels": {AZURE_LABEL: "true"}, "pod_annotations": {"example.com/trace": "on"},
        **scheduling,
    }
    # A stage's own hooks are its own: none of them may reach the driver.
    data["stages"]["train"] = {**data["stages"].get("train", {}), "pod_labels": {"stage-only": "yes"},
                               "job_labels": {"stage-job-only": "yes"}, "priority_class_name": "gpu-top"}
    return data


def driver_documents(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    docs = render_documents(parse_run_config(data))
    return {d["kind"]: d for d in docs if d["metadata"]["name"] == "dflash-example-driver"}


def test_the_driver_gets_the_run_wide_hooks_but_no_queue() -> None:
    objects = driver_documents(hooked_run())
    job, account = objects["Job"], objects["ServiceAccount"]
    pod_meta, pod = job["spec"]["template"]["metadata"], job["spec"]["template"]["spec"]
    # The workload identity webhook mutates the driver's pod too, for the account that carries the identity.
    assert pod_meta["labels"][AZURE_LABEL] == "true" and pod_meta["annotations"] == {"example.com/trace": "on"}
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert account["metadata"]["annotations"] == {"azure.workload.identity/client-id": "0000-client"}
    assert "envFrom" not in pod["containers"][0]
    assert "stage-only" not in pod_meta["labels"] and pod_meta["labels"]["dflash-pipeline/role"] == "driver"
    assert pod["priorityClassName"] == "batch-high"
    labels = job["metadata"]["labels"]
    assert labels["team"] == "drafters" and "stage-job-only" not in labels
    assert job["metadata"]["annotations"] == {"example.com/owner": "ml-platform"}
    assert QUEUE_LABEL not in labels and PRIORITY_LABEL not in labels
    # The stages are queued as before.
    stage_jobs = {d["metadata"]["name"]: d for d in render_documents(parse_run_config(hooked_run()))
                  if d["kind"] == "CronJob"}
    assert stage_jobs["example-tokenize"]["spec"]["jobTemplate"]["metadata"]["labels"][QUEUE_LABEL] == "dflash-gpu"
    resources = pod["containers"][0]["resources"]
    assert resources["requests"]["ephemeral-storage"] == resources["limits"]["ephemeral-storage"] == "1Gi"
    assert schema_errors(list(objects.values())) == []


def test_a_queue_label_in_job_labels_does_not_queue_the_driver() -> None:
    job = driver_documents(hooked_run(queue_name=None, job_labels={QUEUE_LABEL: "dflash-gpu"}))["Job"]
    assert QUEUE_LABEL not in job["metadata"]["labels"]


def test_the_driver_is_queued_only_in_its_own_queue_when_given() -> None:
    job = driver_documents(hooked_run(driver_queue_name="dflash-drivers"))["Job"]
    labels = job["metadata"]["labels"]
    assert labels[QUEUE_LABEL] == "dflash-drivers" and labels[PRIORITY_LABEL] == "research"
    assert schema_errors([job]) == []


def test_without_hooks_the_driver_pod_has_only_its_own_labels(built: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = built
    (driver,) = by_kind(docs, "Job")
    template = driver["spec"]["template"]
    assert "annotations" not in template["metadata"] and "priorityClassName" not in template["spec"]
    assert all(key.startswith(("app.kubernetes.io/", "dflash-pipeline/")) for key in template["metadata"]["labels"])
    assert template["spec"]["containers"][0]["resources"]["requests"]["ephemeral-storage"] == "1Gi"
