"""A run owns its objects: two runs share a namespace, and deleting one (`cancel`, or `kubectl delete -k`, which
deletes the run object the stage Jobs are owned by) removes that run's objects and stops its Jobs, nothing else.

The cluster is `fake_kube_api.FakeKubeApi` with its garbage collector; the stage Jobs are the ones the run driver
really creates there (through the official client, authorized by its rendered Role).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline import RunConfig, parse_run_config, render_documents
from dflash_pipeline.drive.cancel import cancel_run
from dflash_pipeline.drive.driver import RunDriver
from dflash_pipeline.drive.kube import Cluster as KubeCluster
from dflash_pipeline.drive.kube import job_view
from dflash_pipeline.drive.run_state import read_run_state
from dflash_pipeline.render.namespace_setup import setup_documents
from dflash_pipeline.render.pods import RUN_LABEL
from dflash_pipeline.run.config import read_run_file
from dflash_shared.storage import ObjectStore
from tests.pipeline.fake_kube_api import FakeKubeApi
from tests.pipeline.k8s_support import EXAMPLE_RUN, REPO_ROOT
from tests.pipeline.test_run_driver import Cluster, DriverKilledError

NS = "dflash"


def run_file(bucket: str, run_id: str, **changes: Any) -> RunConfig:
    data = read_run_file(EXAMPLE_RUN)
    data.update(run_id=run_id, root=f"{bucket}/runs", **changes)
    return parse_run_config(data, run_id)


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    fake = FakeKubeApi().start()  # kubectl's rights: what `cancel` runs with
    try:
        yield fake
    finally:
        fake.stop()


def apply(api: FakeKubeApi, run: RunConfig, *, driver_job: bool = True) -> None:
    """`kubectl apply -k` of the run's base: every object it renders (the driver Job's pod is not run here:
    the tests drive the run in-process; `driver_job` False leaves the Job out while they do)."""
    for doc in render_documents(run):
        if driver_job or doc["kind"] != "Job":
            api.add(doc)


def apply_driver_jobs(api: FakeKubeApi, *runs: RunConfig) -> None:
    for run in runs:
        for doc in render_documents(run):
            if doc["kind"] == "Job":
                api.add(doc)


def drive_until_running(api: FakeKubeApi, store: ObjectStore, run: RunConfig, stage: str) -> None:
    """The run's driver, with its own Role, until `stage`'s Job runs; then the driver pod is lost."""
    (role,) = [d for d in render_documents(run) if d["kind"] == "Role"]
    api.role = role
    sim = Cluster(api, store, kill_when_running=stage, run_ticks={stage: 10**6})
    driver = RunDriver(KubeCluster(NS, api.api_client()), store, run.root, run.run_id, poll_s=0.01,
                       max_poll_s=0.02, sleep=sim)
    try:
        with pytest.raises(DriverKilledError):
            driver.run()
    finally:
        api.role = None


def objects_of(api: FakeKubeApi, run_id: str) -> set[tuple[str, str]]:
    return {(plural, name) for (plural, _, name), obj in api.objects.items()
            if (obj["metadata"].get("labels") or {}).get(RUN_LABEL) == run_id}


def test_every_object_of_a_run_is_labelled_with_our_key_and_nothing_shared_is_in_it(s3_bucket: str) -> None:
    run = run_file(s3_bucket, "example")
    docs = render_documents(run)
    assert {d["kind"] for d in docs} == {"CronJob", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Job"}
    for doc in docs:
        labels = doc["metadata"]["labels"]
        assert labels[RUN_LABEL] == "example"
        # Argo CD's tracking label (its default before v3): under Argo CD it would name the application.
        assert "app.kubernetes.io/instance" not in labels
    # The stages' account and the Namespace are the namespace's setup; create_namespace is off by default.
    assert parse_run_config({k: v for k, v in read_run_file(EXAMPLE_RUN).items() if k != "create_namespace"}
                            ).create_namespace is False
    assert run.storage.service_account not in {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    assert [d["kind"] for d in setup_documents(run)] == ["Namespace", "ServiceAccount"]


def test_cancel_removes_one_run_and_stops_its_jobs_leaving_the_other_run_and_the_setup(
    api: FakeKubeApi, store: ObjectStore, s3_bucket: str
) -> None:
    first, second = run_file(s3_bucket, "example"), run_file(s3_bucket, "other")
    for doc in setup_documents(first):
        api.add(doc)
    apply(api, first, driver_job=False)
    apply(api, second, driver_job=False)
    drive_until_running(api, store, first, "generate")
    drive_until_running(api, store, second, "import")
    apply_driver_jobs(api, first, second)

    owner = api.get("configmaps", NS, "dflash-example-run")
    assert owner is not None
    for name in ("dflash-example-import", "dflash-example-generate"):
        job = api.get("jobs", NS, name)
        assert job is not None
        assert job["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "ConfigMap",
                                                       "name": "dflash-example-run",
                                                       "uid": owner["metadata"]["uid"]}]
    # A running generate pod, owned by its Job as the Job controller makes it.
    generate = api.get("jobs", NS, "dflash-example-generate")
    assert generate is not None
    api.add({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "dflash-example-generate-0-abcde", "namespace": NS,
        "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": generate["metadata"]["name"],
                             "uid": generate["metadata"]["uid"]}]}})
    other_before = objects_of(api, "other")
    setup_before = {("namespaces", NS), ("serviceaccounts", "dflash-pipeline")}
    assert setup_before <= {(p, n) for (p, _, n) in api.objects}

    deleted = cancel_run(KubeCluster(NS, api.api_client()), "example")

    # The driver's Job went first, so it could create nothing while the rest was deleted.
    assert deleted[0] == "Job/dflash-example-driver"
    assert {"Job/dflash-example-generate", "ConfigMap/dflash-example-run", "CronJob/example-train",
            "Role/dflash-example-driver", "ServiceAccount/dflash-example-driver"} <= set(deleted)
    assert objects_of(api, "example") == set()
    assert "dflash-example-generate-0-abcde" not in api.names("pods")  # its GPU is free
    # Every Job was deleted with its pods (the API's default for a Job would orphan them).
    assert all(policy == "Background" for (plural, _, _), policy in api.deleted if plural == "jobs")
    assert objects_of(api, "other") == other_before and other_before
    assert setup_before <= {(p, n) for (p, _, n) in api.objects}


def test_deleting_the_run_object_as_kubectl_delete_k_does_collects_the_stage_jobs(
    api: FakeKubeApi, store: ObjectStore, s3_bucket: str
) -> None:
    run = run_file(s3_bucket, "example")
    apply(api, run, driver_job=False)
    drive_until_running(api, store, run, "generate")
    apply_driver_jobs(api, run)
    assert {"dflash-example-import", "dflash-example-generate"} <= set(api.names("jobs"))
    api.delete("configmaps", NS, "dflash-example-run", "Background")
    assert api.names("jobs") == ["dflash-example-driver"]  # applied with the run: kubectl deletes it itself

    # A Job a stopping driver still creates names an owner that is gone: the garbage collector takes it.
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "dflash-example-run", "uid": "gone"}
    (template,) = [d for d in render_documents(run) if d["kind"] == "CronJob"
                   and d["metadata"]["name"] == "example-tokenize"]
    from dflash_pipeline.drive.kube import template_from_cronjob

    assert KubeCluster(NS, api.api_client()).create_job(template_from_cronjob(template).body, owner)
    assert "dflash-example-tokenize" not in api.names("jobs")


def test_the_driver_refuses_to_start_without_its_run_object(api: FakeKubeApi, store: ObjectStore,
                                                            s3_bucket: str) -> None:
    run = run_file(s3_bucket, "example")
    for doc in render_documents(run):
        if doc["kind"] == "CronJob":
            api.add(doc)
    driver = RunDriver(KubeCluster(NS, api.api_client()), store, run.root, run.run_id, sleep=lambda s: None)
    with pytest.raises(ValueError, match="run object ConfigMap dflash-example-run is not in namespace dflash"):
        driver.run()
    assert api.names("jobs") == []


@pytest.mark.slow
def test_cancel_from_the_command_line_with_a_kubeconfig(api: FakeKubeApi, s3_bucket: str, tmp_path: Path) -> None:
    apply(api, run_file(s3_bucket, "example"))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(api.kubeconfig())
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("POD_NAMESPACE", None)

    def cancel(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dflash_pipeline", "cancel", "example", *args], env=env,
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)

    dry = cancel("--dry-run")  # the namespace defaults to the pipeline's, dflash
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[0] == "would delete Job/dflash-example-driver"
    assert objects_of(api, "example")  # a dry run deletes nothing
    done = cancel("--namespace", NS)
    assert done.returncode == 0, done.stderr
    assert objects_of(api, "example") == set() and len(done.stdout.splitlines()) == len(dry.stdout.splitlines())


@pytest.mark.slow
def test_cancel_takes_the_run_file_like_the_other_commands(api: FakeKubeApi, s3_bucket: str, tmp_path: Path) -> None:
    """`cancel --config RUN.toml`: the run id and namespace come from the run file (it used to take RUN_ID only)."""
    apply(api, run_file(s3_bucket, "example"))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(api.kubeconfig())
    data = read_run_file(EXAMPLE_RUN)
    data.update(run_id="example", root=f"{s3_bucket}/runs")
    path = tmp_path / "example.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("POD_NAMESPACE", None)

    def cancel(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dflash_pipeline", "cancel", *args], env=env, cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120, check=False)

    by_id, by_file = cancel("example", "--dry-run"), cancel("--config", str(path), "--dry-run")
    assert by_file.returncode == 0, by_file.stderr
    assert by_file.stdout == by_id.stdout and by_file.stdout.startswith("would delete Job/dflash-example-driver")
    done = cancel("--config", str(path))
    assert done.returncode == 0, done.stderr
    assert objects_of(api, "example") == set()


def test_a_job_held_for_a_missing_local_queue_says_so(api: FakeKubeApi, store: ObjectStore, s3_bucket: str) -> None:
    run = run_file(s3_bucket, "example", scheduling={"queue_name": "dflash-batch"})
    apply(api, run)
    (template,) = [d for d in render_documents(run) if d["kind"] == "CronJob"
                   and d["metadata"]["name"] == "example-import"]
    from dflash_pipeline.drive.kube import template_from_cronjob

    # Kueue suspended the import Job on creation and cannot admit it: its queue does not exist.
    body = template_from_cronjob(template).body
    api.add({**body, "spec": {**body["spec"], "suspend": True}})
    job = api.get("jobs", NS, "dflash-example-import")
    assert job is not None
    api.add({"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload", "metadata": {
        "name": "job-dflash-example-import-1a2b3", "namespace": NS,
        "labels": {"kueue.x-k8s.io/job-uid": job["metadata"]["uid"]}},
        "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Inadmissible",
                                   "message": "LocalQueue dflash-batch doesn't exist"}]}})
    (role,) = [d for d in render_documents(run) if d["kind"] == "Role"]
    api.role = role  # the driver's own rights suffice to read the Workload

    def lost(seconds: float) -> None:
        raise DriverKilledError("after one pass")

    driver = RunDriver(KubeCluster(NS, api.api_client()), store, run.root, run.run_id, sleep=lost)
    with pytest.raises(DriverKilledError):
        driver.run()
    state = read_run_state(store, run.root, run.run_id)
    assert state is not None and state.stages["import"].state == "created"
    assert (state.stages["import"].reason or "").startswith("no LocalQueue dflash-batch in namespace dflash")
    # Without Kueue's API on the cluster the plain reading stays.
    assert job_view(job).reason == "suspended: waiting for admission (a queue such as Kueue releases it)"
