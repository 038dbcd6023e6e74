"""The run driver's objects as `kubectl apply -k` sends them, for both overlays, built by kubectl's kustomize.

What is applied holds exactly one Job, the driver; every stage is a suspended CronJob that never fires,
whose jobTemplate the overlays' patches reach; the driver's Role grants only what it calls, in its namespace.
"""

from __future__ import annotations

from typing import Any

import pytest

from dflash_pipeline import load_run_config, render_documents
from dflash_pipeline.driver_objects import NEVER, STAGE_FAILED
from dflash_pipeline.kube import template_from_cronjob
from dflash_shared.exit_codes import ExitCode
from tests.k8s.k8s_support import EXAMPLE_RUN, OVERLAYS, failure_action, jobs, kustomize_build, schema_errors

OVERLAY_NAMES = ("local-cpu", "gpu-cluster")


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
    expected = "registry.invalid/dflash/dflash-pipeline:latest" if overlay == "gpu-cluster" else (
        "localhost/dflash-pipeline:latest")
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
    assert gpu["train"]["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == (
        "NVIDIA-H100-80GB-HBM3")
    assert gpu["tokenize"]["spec"]["template"]["spec"]["containers"][0]["image"].startswith("registry.invalid/")


def test_the_driver_role_grants_only_what_it_calls(built: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = built
    assert by_kind(docs, "ClusterRole") == [] and by_kind(docs, "ClusterRoleBinding") == []
    (role,) = by_kind(docs, "Role")
    grants = {(rule["apiGroups"][0], resource, verb) for rule in role["rules"] for resource in rule["resources"]
              for verb in rule["verbs"]}
    assert grants == {("batch", "cronjobs", "get"), ("batch", "cronjobs", "list"), ("batch", "jobs", "get"),
                      ("batch", "jobs", "create"), ("", "pods", "list"), ("jobset.x-k8s.io", "jobsets", "list")}
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
