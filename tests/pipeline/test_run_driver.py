"""The run driver against a real S3 endpoint (moto) and a Kubernetes API below the official client library.

The cluster is `fake_kube_api.FakeKubeApi`: a local HTTP server holding the run's rendered templates and
authorizing every request against the driver's rendered Role. No controller runs there: `Cluster` below
plays the Job controller and the stage pods, one step each time the driver sleeps between passes, and
commits a stage's output manifest to S3 when its Job succeeds, as the stage's last pod would.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from dflash_pipeline import RunConfig, parse_run_config, render_documents
from dflash_pipeline.drive.driver import RunDriver, StageFailedError
from dflash_pipeline.drive.kube import Cluster as KubeCluster
from dflash_pipeline.drive.kube import ClusterAccessError, ClusterRejectedError
from dflash_pipeline.drive.run_state import read_run_state
from dflash_pipeline.drive.wait import wait_for_manifest
from dflash_pipeline.run.config import read_run_file
from dflash_shared.errors import exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.storage import ObjectStore, join
from tests.pipeline.fake_kube_api import AdmissionDenied, FakeKubeApi
from tests.pipeline.k8s_support import EXAMPLE_RUN, REPO_ROOT, schema_errors

NS = "dflash"
STAGES = ["import", "generate", "tokenize", "train", "export", "evaluate", "serve-check"]
GPU_STAGES = {"generate", "train", "evaluate", "serve-check"}


class DriverKilledError(Exception):
    """The driver pod dies (node lost): raised from its sleep, as a SIGKILL would end it there."""


def example_run(bucket: str) -> RunConfig:
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = f"{bucket}/runs"
    return parse_run_config(data, "test run")


def output_manifest(job: dict[str, Any]) -> str:
    return join(job["metadata"]["annotations"]["dflash-pipeline/output"], "manifest.json")


class Cluster:
    """The Job controller and the stage pods: on each driver sleep, every unfinished Job moves one step.

    A Job is first running (one active pod), then, after `run_ticks[stage]` more steps (default 1), either
    failed (`fail[stage]`: the Job's Failed condition and a pod that exited with a code and message) or
    complete, with its output manifest committed to S3 first.
    """

    def __init__(self, api: FakeKubeApi, store: ObjectStore, *, fail: dict[str, tuple[int, str]] | None = None,
                 run_ticks: dict[str, int] | None = None, kill_when_running: str | None = None,
                 stuck: dict[str, dict[str, Any]] | None = None) -> None:
        self.api, self.store = api, store
        self.fail = fail or {}
        # stage -> a pod status that never changes: its Job stays active (a pod that cannot start), never finishing.
        self.stuck = stuck or {}
        self.run_ticks = run_ticks or {}
        self.kill_when_running = kill_when_running
        self.sleeps: list[float] = []
        self.created: list[tuple[str, bool]] = []  # (stage, its input manifest existed at creation)
        self._ticks: dict[str, int] = {}
        api.on_create = self._created

    def _created(self, job: dict[str, Any]) -> None:
        stage = job["metadata"]["labels"]["app.kubernetes.io/component"]
        upstream = job["metadata"]["annotations"].get("dflash-pipeline/input")
        self.created.append((stage, upstream is None or self.store.exists(upstream)))

    def __call__(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        assert len(self.sleeps) < 200, "the driver did not finish"
        for name in self.api.names("jobs"):
            job = self.api.get("jobs", NS, name)
            assert job is not None
            if job["metadata"]["labels"].get("dflash-pipeline/role") == "driver":
                continue  # a run's driver Job, where a test applied one: its pod is the driver under test
            stage = job["metadata"]["labels"]["app.kubernetes.io/component"]
            status = job["status"]
            if status.get("conditions"):
                continue
            if not status.get("active"):
                self.api.set_status(NS, name, {"active": 1})
                if stage in self.stuck:
                    self.api.add({"apiVersion": "v1", "kind": "Pod", "metadata": {
                        "name": f"{name}-0-q8r4w", "namespace": NS, "labels": {"batch.kubernetes.io/job-name": name},
                        "creationTimestamp": "2026-12-01T12:00:00Z"}, "status": self.stuck[stage]})
                continue
            if stage in self.stuck:
                continue
            if stage == self.kill_when_running:
                raise DriverKilledError(stage)
            self._ticks[stage] = self._ticks.get(stage, 0) + 1
            if self._ticks[stage] < self.run_ticks.get(stage, 1):
                continue
            if stage in self.fail:
                code, message = self.fail[stage]
                self._failed(job, code, message)
                continue
            self.store.write_bytes(output_manifest(job), b'{"kind": "test"}\n')
            self.api.set_status(NS, name, {"succeeded": 1, "conditions": [
                {"type": "Complete", "status": "True"}]})

    def _failed(self, job: dict[str, Any], code: int, message: str) -> None:
        name = job["metadata"]["name"]
        self.api.add({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": f"{name}-0-x7k2p", "namespace": NS, "labels": {"batch.kubernetes.io/job-name": name}},
            "status": {"phase": "Failed", "containerStatuses": [{"name": "main", "state": {"terminated": {
                "exitCode": code, "message": message, "finishedAt": "2026-12-01T12:00:00Z"}}}]}})
        self.api.set_status(NS, name, {"failed": 1, "conditions": [
            {"type": "FailureTarget", "status": "True", "reason": "PodFailurePolicy"},
            {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
             "message": f"Container main for pod {NS}/{name}-0-x7k2p failed with exit code {code} matching "
                        "FailJob rule at index 0"}]})


@pytest.fixture
def run(s3_bucket: str) -> RunConfig:
    return example_run(s3_bucket)


@pytest.fixture
def api(run: RunConfig) -> Iterator[FakeKubeApi]:
    """The cluster after `kubectl apply`: the run's templates, authorization by the driver's own Role."""
    docs = render_documents(run)
    (role,) = [d for d in docs if d["kind"] == "Role"]
    fake = FakeKubeApi(role).start()
    for doc in docs:
        if doc["kind"] in ("CronJob", "ConfigMap"):
            fake.add(doc)
    try:
        yield fake
    finally:
        fake.stop()


def driver(api: FakeKubeApi, store: ObjectStore, run: RunConfig, sim: Cluster) -> RunDriver:
    return RunDriver(KubeCluster(NS, api.api_client()), store, run.root, run.run_id, poll_s=0.01, max_poll_s=0.04,
                     sleep=sim)


def stage_states(store: ObjectStore, run: RunConfig) -> dict[str, str]:
    state = read_run_state(store, run.root, run.run_id)
    assert state is not None
    return {name: s.state for name, s in state.stages.items()}


def test_each_stage_job_is_created_only_once_its_input_is_committed(
    api: FakeKubeApi, store: ObjectStore, run: RunConfig
) -> None:
    sim = Cluster(api, store, run_ticks={"train": 4})
    assert driver(api, store, run, sim).run() == ExitCode.OK

    assert [stage for stage, _ in sim.created] == STAGES
    assert all(input_was_there for _, input_was_there in sim.created), sim.created
    # Only what the Role grants was asked for (a verb outside it would have been answered 403).
    assert {verb for verb, _ in api.requests} <= {"get", "list", "create"}
    assert stage_states(store, run) == dict.fromkeys(STAGES, "succeeded")
    # While train ran on unchanged, the driver backed off: the interval doubled up to its maximum.
    assert 0.02 in sim.sleeps and max(sim.sleeps) == 0.04 and sim.sleeps[0] == 0.01
    # What the driver created is a valid Job of every supported Kubernetes version.
    jobs = [api.get("jobs", NS, name) for name in api.names("jobs")]
    bodies = [{k: v for k, v in job.items() if k != "status"} for job in jobs if job]
    for job in bodies:
        for key in ("uid", "creationTimestamp", "resourceVersion"):
            job["metadata"].pop(key)
        assert job["metadata"]["labels"]["dflash-pipeline/created-by"] == "driver"
        assert "suspend" not in job["spec"]  # Kueue's to set; the driver never touches it
    assert schema_errors(bodies) == []


def test_no_gpu_stage_is_created_while_its_input_is_missing(
    api: FakeKubeApi, store: ObjectStore, run: RunConfig
) -> None:
    # Generation never finishes here: the driver keeps waiting and creates nothing after it.
    sim = Cluster(api, store, run_ticks={"generate": 10**6})
    sim_sleep = sim.__call__

    def sleep(seconds: float) -> None:
        if len(sim.sleeps) >= 30:
            raise DriverKilledError("enough")
        sim_sleep(seconds)

    rd = RunDriver(KubeCluster(NS, api.api_client()), store, run.root, run.run_id, poll_s=0.01, max_poll_s=0.04,
                   sleep=sleep)
    with pytest.raises(DriverKilledError):
        rd.run()
    assert api.names("jobs") == ["dflash-example-generate", "dflash-example-import"]
    states = stage_states(store, run)
    assert states["generate"] == "running" and states["tokenize"] == "waiting"
    state = read_run_state(store, run.root, run.run_id)
    assert state is not None
    assert state.stages["tokenize"].reason == f"input {run.root}/example/completions/manifest.json not committed yet"
    assert not any(name.endswith(tuple(GPU_STAGES - {"generate"})) for name in api.names("jobs"))


def test_a_failed_stage_stops_the_run_with_its_reason_and_a_rerun_after_the_fix_continues(
    api: FakeKubeApi, store: ObjectStore, run: RunConfig
) -> None:
    message = "quality gate: 812 of 1,000 records have no loss tokens (empty_completion)"
    sim = Cluster(api, store, fail={"train": (int(ExitCode.BAD_INPUT), message)})
    with pytest.raises(StageFailedError) as failed:
        driver(api, store, run, sim).run()

    text = str(failed.value)
    assert text.startswith("stage train failed (Job dflash-example-train): PodFailurePolicy: Container main")
    assert f"exited 65 (BAD_INPUT): {message}" in text
    assert "then `python -m dflash_pipeline resume --config RUN.toml`" in text
    assert exit_code_for(failed.value) == ExitCode.BAD_INPUT  # the driver Job's policy: FailJob
    # Nothing downstream of the failure was created.
    assert [stage for stage, _ in sim.created] == ["import", "generate", "tokenize", "train"]
    state = read_run_state(store, run.root, run.run_id)
    assert state is not None
    assert state.stages["train"].state == "failed" and message in (state.stages["train"].reason or "")
    assert state.stages["export"].state == "waiting"
    assert state.stages["export"].reason == "run stopped: upstream stage train failed"

    # The fix, as `pipeline resume` makes it (test_follow_run): delete the failed stage Job (and the driver's),
    # apply again. The new driver skips what is committed and creates train again.
    api.delete("jobs", NS, "dflash-example-train")
    rerun = Cluster(api, store)
    assert driver(api, store, run, rerun).run() == ExitCode.OK
    assert [stage for stage, _ in rerun.created] == ["train", "export", "evaluate", "serve-check"]
    assert stage_states(store, run) == {**dict.fromkeys(STAGES[:3], "skipped"),
                                        **dict.fromkeys(STAGES[3:], "succeeded")}


def waiting_pod(reason: str, message: str, phase: str = "Pending") -> dict[str, Any]:
    return {"phase": phase, "containerStatuses": [{"name": "main", "state": {"waiting": {
        "reason": reason, "message": message}}}]}


IMAGE_PULL = waiting_pod("ImagePullBackOff", 'Back-off pulling image "registry.invalid/dflash-generator@sha256:ab"')
UNSCHEDULABLE = {"phase": "Pending", "conditions": [{
    "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "lastTransitionTime": "2026-12-01T12:00:00Z",
    "message": "0/8 nodes are available: 8 node(s) didn't match Pod's node affinity/selector."}]}
# Each reason the driver fails a stage for, the words of the message it passes on, and of the fix it names.
STUCK = {
    "ImagePullBackOff": (IMAGE_PULL, "Back-off pulling image", "imagePullSecret"),
    "ErrImagePull": (waiting_pod("ErrImagePull", "manifest unknown"), "manifest unknown", "make build-images"),
    "CreateContainerConfigError": (waiting_pod("CreateContainerConfigError", 'secret "dflash-s3" not found'),
                                   'secret "dflash-s3" not found', "create the Secret"),
    "Unschedulable": (UNSCHEDULABLE, "didn't match Pod's node affinity/selector", "nvidia.com/gpu.product"),
    "CrashLoopBackOff": (waiting_pod("CrashLoopBackOff", "back-off 5m0s restarting failed container", "Running"),
                         "restarting failed container", "dflash_pipeline logs"),
}


@pytest.mark.parametrize("reason", list(STUCK))
def test_a_pod_that_cannot_start_fails_its_stage_in_minutes_naming_why_and_the_fix(
        api: FakeKubeApi, store: ObjectStore, run: RunConfig, reason: str) -> None:
    """Its Job counts the pod as active: without the check the run would read "running" until the deadline."""
    status, message, fix = STUCK[reason]
    sim = Cluster(api, store, stuck={"generate": status})
    with pytest.raises(StageFailedError) as failed:
        driver(api, store, run, sim).run()
    text = str(failed.value)
    assert text.startswith("stage generate failed (Job dflash-example-generate): its pod cannot start: pod "), text
    assert f"{reason} for " in text and message in text and fix in text
    assert [stage for stage, _ in sim.created] == ["import", "generate"]
    state = read_run_state(store, run.root, run.run_id)
    assert state is not None and state.stages["generate"].state == "failed"


def test_status_shows_a_waiting_pod_while_the_grace_runs(api: FakeKubeApi, store: ObjectStore, run: RunConfig) -> None:
    from dflash_pipeline.drive.kube import pods_waiting

    sim = Cluster(api, store, stuck={"generate": IMAGE_PULL})
    grace = driver(api, store, run, sim)
    grace.stuck_after_s = 10 * 365 * 86400  # longer than the test pod's age: the stage keeps waiting
    templates = grace.cluster.templates(run.run_id)
    for _ in range(8):  # import runs and commits, generate's Job starts and its pod waits
        grace.step(templates)
        sim(0.0)
    grace.step(templates)
    entry = grace.state.stages["generate"]
    assert entry.state == "running" and "ImagePullBackOff" in (entry.reason or ""), entry
    assert "the stage fails after" in (entry.reason or "")
    assert pods_waiting([{"metadata": {"name": "p"}, "status": {**IMAGE_PULL, "phase": "Failed"}}], 0.0) == []


def test_a_pod_is_stuck_only_for_a_reason_no_wait_heals() -> None:
    from dflash_pipeline.drive.kube import pods_waiting

    def pod(status: dict[str, Any]) -> dict[str, Any]:
        return {"metadata": {"name": "p", "creationTimestamp": "2026-12-01T12:00:00Z"}, "status": status}

    created = 1796126400.0  # 2026-12-01T12:00:00Z
    (pull,) = pods_waiting([pod(IMAGE_PULL)], created + 601)
    assert pull.reason == "ImagePullBackOff" and round(pull.seconds) == 601
    assert pods_waiting([pod(waiting_pod("ContainerCreating", ""))], created + 3600) == []  # a large image pulling
    (unscheduled,) = pods_waiting([pod(UNSCHEDULABLE)], created + 601)
    assert "0/8 nodes are available" in unscheduled.describe()


def test_a_failed_job_left_in_place_stops_the_rerun_again(api: FakeKubeApi, store: ObjectStore, run: RunConfig) -> None:
    sim = Cluster(api, store, fail={"tokenize": (137, "")})
    with pytest.raises(StageFailedError, match="exited 137"):
        driver(api, store, run, sim).run()
    again = Cluster(api, store)
    with pytest.raises(StageFailedError, match="stage tokenize failed"):
        driver(api, store, run, again).run()
    assert again.created == []


def test_a_restarted_driver_adopts_the_running_job_instead_of_creating_another(
    api: FakeKubeApi, store: ObjectStore, run: RunConfig
) -> None:
    first = Cluster(api, store, kill_when_running="train")
    with pytest.raises(DriverKilledError):
        driver(api, store, run, first).run()
    assert [stage for stage, _ in first.created][-1] == "train"

    second = Cluster(api, store)
    assert driver(api, store, run, second).run() == ExitCode.OK
    assert [stage for stage, _ in second.created] == ["export", "evaluate", "serve-check"]
    states = stage_states(store, run)
    assert states["train"] == "succeeded" and states["import"] == "skipped"


def test_a_failed_train_jobset_stops_the_run_before_export(s3_bucket: str, store: ObjectStore) -> None:
    # Multi-node training as a JobSet is applied with the run (it waits for its data itself); the driver
    # creates the other stages and notices the JobSet's failure while export waits for the drafter.
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = f"{s3_bucket}/runs"
    data["stages"]["train"] = {**data["stages"]["train"], "gang": "jobset", "nodes": 2}
    run = parse_run_config(data, "jobset run")
    docs = render_documents(run)
    (role,) = [d for d in docs if d["kind"] == "Role"]
    fake = FakeKubeApi(role).start()
    try:
        for doc in docs:
            if doc["kind"] in ("CronJob", "ConfigMap", "JobSet"):
                fake.add(doc)
        sim = Cluster(fake, store)
        tokenized = f"{run.root}/{run.run_id}/tokenized/manifest.json"
        reason = "FailedJobs: jobset failed due to job dflash-example-train-node-0: exit code 65 (BAD_INPUT)"

        def sleep(seconds: float) -> None:
            sim(seconds)
            if store.exists(tokenized):
                fake.set_status(NS, "dflash-example-train", {"conditions": [
                    {"type": "Failed", "status": "True", "reason": reason.split(": ", 1)[0],
                     "message": reason.split(": ", 1)[1]}]}, plural="jobsets")

        rd = RunDriver(KubeCluster(NS, fake.api_client()), store, run.root, run.run_id, poll_s=0.01,
                       max_poll_s=0.04, sleep=sleep)
        with pytest.raises(StageFailedError, match=r"stage train failed \(JobSet dflash-example-train\): FailedJobs"):
            rd.run()
        assert [stage for stage, _ in sim.created] == ["import", "generate", "tokenize"]
        state = read_run_state(store, run.root, run.run_id)
        assert state is not None
        assert state.stages["train"].state == "failed" and state.stages["train"].reason == reason
        assert state.stages["export"].reason == "run stopped: upstream stage train failed"
    finally:
        fake.stop()


def test_a_role_without_the_needed_verb_exits_environment_naming_it(store: ObjectStore, run: RunConfig) -> None:
    (role,) = [d for d in render_documents(run) if d["kind"] == "Role"]
    role["rules"] = [r for r in role["rules"] if r["resources"] != ["jobs"]]
    fake = FakeKubeApi(role).start()
    try:
        for doc in render_documents(run):
            if doc["kind"] in ("CronJob", "ConfigMap"):
                fake.add(doc)
        with pytest.raises(ClusterAccessError, match='cannot get resource "jobs"') as refused:
            driver(fake, store, run, Cluster(fake, store)).run()
        assert exit_code_for(refused.value) == ExitCode.ENVIRONMENT
    finally:
        fake.stop()


def test_a_job_an_admission_webhook_denies_exits_usage_naming_it(
    api: FakeKubeApi, store: ObjectStore, run: RunConfig
) -> None:
    sim = Cluster(api, store)

    def deny(job: dict[str, Any]) -> None:
        if job["metadata"]["name"] == "dflash-example-generate":
            raise AdmissionDenied("LocalQueue gpu-queue does not exist")
        sim._created(job)

    api.on_create = deny
    with pytest.raises(ClusterRejectedError, match="create Job dflash-example-generate: 403 admission webhook "
                       '"validate.example.io" denied the request: LocalQueue gpu-queue does not exist') as denied:
        driver(api, store, run, sim).run()
    assert exit_code_for(denied.value) == ExitCode.USAGE
    assert api.names("jobs") == ["dflash-example-import"]


# ---------------------------------------------------------------------- S3 access refused (real IAM checks)


def _reset_auth(endpoint: str, count: str) -> None:
    req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=count.encode(), method="POST",
                                 headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


@pytest.fixture
def refused_keys(moto_endpoint: str, s3_bucket: str) -> Iterator[tuple[str, str]]:
    """Keys of an IAM user with no S3 permission; IAM enforced meanwhile (torn down before the bucket)."""
    iam = boto3.client("iam", endpoint_url=moto_endpoint, region_name="us-east-1")
    user = f"nobody-{uuid.uuid4().hex[:12]}"
    iam.create_user(UserName=user)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    _reset_auth(moto_endpoint, "0")
    try:
        yield key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        _reset_auth(moto_endpoint, "inf")


@pytest.mark.slow
def test_a_403_from_s3_exits_69_at_once_naming_it(
    api: FakeKubeApi, run: RunConfig, refused_keys: tuple[str, str], tmp_path: Path
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(api.kubeconfig())
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "AWS_ACCESS_KEY_ID": refused_keys[0],
           "AWS_SECRET_ACCESS_KEY": refused_keys[1], "AWS_MAX_ATTEMPTS": "1", "POD_NAMESPACE": NS}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dflash_pipeline", "drive", "--run-id", run.run_id, "--root",
                           run.root, "--poll-seconds", "600", "--max-poll-seconds", "600"], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    elapsed = time.monotonic() - start
    assert done.returncode == ExitCode.ENVIRONMENT, done.stderr
    assert "AccessDenied" in done.stderr and f"{run.root}/{run.run_id}/driver/state.json" in done.stderr
    assert elapsed < 300  # a retry would have slept the 600 s poll interval first
    assert api.names("jobs") == []


def test_wait_fails_fast_on_a_403(store: ObjectStore, run: RunConfig, refused_keys: tuple[str, str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", refused_keys[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", refused_keys[1])
    slept: list[float] = []
    uri = f"{run.root}/{run.run_id}/completions/manifest.json"
    assert wait_for_manifest(ObjectStore(max_attempts=1), uri, timeout_s=3600, sleep=slept.append) == (
        ExitCode.ENVIRONMENT)
    assert slept == []


def test_state_file_schema(api: FakeKubeApi, store: ObjectStore, run: RunConfig) -> None:
    sim = Cluster(api, store)
    driver(api, store, run, sim).run()
    raw = json.loads(store.read_bytes(f"{run.root}/{run.run_id}/driver/state.json"))
    assert raw["schema"] == 1 and set(raw) == {"schema", "updated", "stages"}
    assert list(raw["stages"]) == STAGES
    assert set(raw["stages"]["train"]) == {"state", "job", "reason", "updated"}
    assert raw["stages"]["train"]["job"] == "dflash-example-train"


@contextlib.contextmanager
def applied(run: RunConfig) -> Iterator[FakeKubeApi]:
    """A cluster after `kubectl apply` of `run` (the `api` fixture, for a run made inside the test)."""
    docs = render_documents(run)
    (role,) = [d for d in docs if d["kind"] == "Role"]
    fake = FakeKubeApi(role).start()
    try:
        for doc in docs:
            if doc["kind"] in ("CronJob", "ConfigMap"):
                fake.add(doc)
        yield fake
    finally:
        fake.stop()


def test_a_pilots_driver_writes_its_report_when_the_run_ends(s3_bucket: str, store: ObjectStore) -> None:
    """The pilot's run object carries its config; the driver builds the report from it and the manifests."""
    from dflash_pipeline.pilot.derive import derive_pilot
    from dflash_pipeline.pilot.report import pilot_report_uri, read_report

    pilot = derive_pilot(example_run(s3_bucket))
    with applied(pilot) as fake:
        assert driver(fake, store, pilot, Cluster(fake, store)).run() == ExitCode.OK
    report = read_report(store, pilot_report_uri(pilot.root, "example"))
    assert report is not None and report.run_id == "example-pilot" and report.pilot_of == "example"
    assert [s.stage for s in report.stages] == STAGES
    # The stand-in pods commit placeholder manifests, which the report refuses to read figures from.
    assert not any(s.committed for s in report.stages)
    assert report.planned["run_id"] == "example-pilot"
    # A full run's driver writes none.
    assert not store.exists(join(pilot.root, "example", "report.json"))


def test_a_failed_pilot_reports_the_stage_that_would_not_fit(s3_bucket: str, store: ObjectStore) -> None:
    from dflash_pipeline.pilot.derive import derive_pilot
    from dflash_pipeline.pilot.report import pilot_report_uri, read_report

    pilot = derive_pilot(example_run(s3_bucket))
    with applied(pilot) as fake:
        sim = Cluster(fake, store, fail={"train": (64, "predicted peak 121.3 GiB per rank does not fit 79.0 GiB")})
        with pytest.raises(StageFailedError):
            driver(fake, store, pilot, sim).run()
    report = read_report(store, pilot_report_uri(pilot.root, "example"))
    assert report is not None
    train, export = report.stage("train"), report.stage("export")
    assert train is not None and train.verdict.startswith("would not fit:") and "121.3 GiB" in train.verdict
    assert train.fix is not None and "parallelism" in train.fix
    assert export is not None and export.verdict.startswith("not committed")
