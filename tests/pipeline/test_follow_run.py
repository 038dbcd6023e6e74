"""Following a run from one command: `status` with the stages' own progress reports and a failed stage's cause and
next command, `logs` from the cluster and then the store, `resume` after a failure on the fake API server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from dflash_generate.worker_status import WorkerStatus
from dflash_pipeline import RunConfig, layout, render_documents
from dflash_pipeline.drive.driver import StageFailedError
from dflash_pipeline.drive.kube import Cluster as KubeCluster
from dflash_pipeline.drive.kube import ClusterAccessError
from dflash_pipeline.drive.resume import resume_run
from dflash_pipeline.drive.run_logs import collect_logs, format_logs
from dflash_pipeline.drive.run_state import RunState, write_run_state
from dflash_pipeline.drive.status import format_status, run_status
from dflash_pipeline.run.config import read_run_file
from dflash_shared.exit_codes import ExitCode
from dflash_shared.progress_report import write_report
from dflash_shared.storage import ObjectStore, join
from tests.pipeline.fake_kube_api import FakeKubeApi
from tests.pipeline.k8s_support import EXAMPLE_RUN, REPO_ROOT
from tests.pipeline.test_run_driver import STAGES, Cluster, driver, example_run, stage_states
from tests.pipeline.test_run_ownership import run_file

NS = "dflash"
_PLURALS = {"Job": "jobs", "CronJob": "cronjobs", "ConfigMap": "configmaps", "Service": "services",
            "ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings"}
FAILURE = ("PodFailurePolicy: Container train for pod dflash/dflash-example-train-0-x7k2p failed with exit code 65 "
           "matching FailJob rule at index 0; pod dflash-example-train-0-x7k2p container train exited 65 (BAD_INPUT): "
           "exit 65 (BAD_INPUT): quality gate: 812 of 1,000 records have no loss tokens (empty_completion)")


def stamp(ago_s: float) -> str:
    return (datetime.now(UTC) - timedelta(seconds=ago_s)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
def run(s3_bucket: str) -> RunConfig:
    return example_run(s3_bucket)


def kubectl_apply(api: FakeKubeApi, run: RunConfig) -> int:
    """What `kubectl apply` leaves: every object of the run, the ones that exist unchanged (their uid kept)."""
    for doc in render_documents(run):
        if api.get(_PLURALS[doc["kind"]], NS, doc["metadata"]["name"]) is None:
            api.add(doc)
    return ExitCode.OK


def test_status_shows_training_progress_from_its_report(run: RunConfig, store: ObjectStore) -> None:
    lay = layout(run.root, run.run_id)
    state = RunState()
    for stage in STAGES[:3]:
        state.set(stage, "succeeded")
    state.set("train", "running", job="dflash-example-train", reason="4 pod(s) active")
    write_run_state(store, run.root, run.run_id, state)
    # What the trainer's MetricsSink writes (tests/train/test_metrics.py checks that it does).
    write_report(store, join(lay.drafter, "progress.json"), {
        "schema": 1, "stage": "train", "state": "training", "step": 41_230, "total": 120_000,
        "tokens": 41_230 * 65_536, "loss": 2.31047, "tau": 3.214, "accuracy": 0.61, "tokens_per_s": 451_000.0,
        "eta_s": 2.5 * 86400, "every_s": 300.0, "updated": stamp(240),
        "last_checkpoint": {"step": 41_000, "uri": f"{lay.drafter}/checkpoints/step-00041000", "saved": stamp(900)}})

    statuses = {s.stage: s for s in run_status(run, store)}
    assert statuses["train"].reports[0]["step"] == 41_230
    text = format_status(run, list(statuses.values()), "my-run.toml")
    print(text)
    assert ("train: training: step 41,230/120,000 (34%), loss 2.3105, tau 3.21, 451k tok/s, 2.7G tokens, ETA 2.5 d; "
            "last checkpoint step 41,000; updated 4 min ago") in text
    (row,) = [line for line in text.splitlines() if line.startswith("train ")]
    assert row.split()[1] == "running"


def test_a_stale_training_report_says_so(run: RunConfig, store: ObjectStore) -> None:
    write_report(store, join(layout(run.root, run.run_id).drafter, "progress.json"), {
        "state": "training", "step": 10, "total": 100, "every_s": 300.0, "updated": stamp(3 * 3600)})
    train = {s.stage: s for s in run_status(run, store)}["train"]
    assert "updated 3.0 h ago (stale: reports come every 5 min; is its pod running?" in train.live


def test_generate_workers_add_up_rate_and_the_slowest_eta(run: RunConfig, store: ObjectStore) -> None:
    lay = layout(run.root, run.run_id)
    clock = [0.0]
    workers = [WorkerStatus(store, lay.completions, i, 4, chunks=10, chunks_resumed=i, interval_s=300.0,
                            clock=lambda: clock[0]) for i in range(3)]
    for w in workers[:2]:
        w.generating(1000)
    clock[0] = 100.0
    workers[0].update(500, 200_000)  # 2,000 tok/s, 100 s left
    workers[1].update(250, 100_000)  # 1,000 tok/s, 300 s left
    for w in workers[:2]:
        w.finish("generating")  # writes the report as it stands
    workers[2].finish("done")
    generate = {s.stage: s for s in run_status(run, store)}["generate"]
    assert {r["worker"] for r in generate.reports} == {0, 1, 2}
    assert generate.live.startswith("workers: 1 done, 2 generating (3 of 4 reporting); now 3k tok/s, 300k tokens, "
                                    "prompts 750/2,000 of the chunks they generate, ETA 5 min (slowest worker)")


def test_status_shows_a_failed_stage_with_its_exit_class_and_the_next_command(run: RunConfig,
                                                                            store: ObjectStore) -> None:
    state = RunState()
    for stage in STAGES[:3]:
        state.set(stage, "succeeded")
    state.set("train", "failed", job="dflash-example-train", reason=FAILURE)
    for stage in STAGES[4:]:
        state.set(stage, "waiting", reason="run stopped: upstream stage train failed")
    write_run_state(store, run.root, run.run_id, state)

    statuses = run_status(run, store)
    text = format_status(run, statuses, "my-run.toml")
    print(text)
    (row,) = [line for line in text.splitlines() if line.startswith("train ")]
    assert row.split()[1] == "failed"
    assert f"train: FAILED (Job dflash-example-train): {FAILURE}" in text
    assert "train: exit 65: the input failed a check (no retry can pass)" in text
    assert ("train: next: read the log (`python -m dflash_pipeline logs --config my-run.toml train`), fix the cause, "
            "then `python -m dflash_pipeline resume --config my-run.toml`") in text
    failure = {s.stage: s for s in statuses}["train"].to_json()["failure"]
    assert failure["exit_code"] == 65 and failure["job"] == "dflash-example-train"


def test_resume_after_a_failed_stage_deletes_the_failed_jobs_and_the_run_completes(
        run: RunConfig, store: ObjectStore, s3_bucket: str) -> None:
    api = FakeKubeApi().start()  # the user's rights, as kubectl has them
    try:
        kubectl_apply(api, run)
        kubectl_apply(api, run_file(s3_bucket, "other"))
        failed = {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
                                               "message": "exit code 65 matching FailJob rule"}]}
        api.set_status(NS, "dflash-other-driver", failed)
        # The driver runs until train fails; its own Job then fails (exit 65: FailJob).
        sim = Cluster(api, store, fail={"train": (int(ExitCode.BAD_INPUT), "quality gate: no loss tokens")})
        with pytest.raises(StageFailedError, match="resume --config RUN.toml"):
            driver(api, store, run, sim).run()
        api.set_status(NS, "dflash-example-driver", failed)
        before = format_status(run, run_status(run, store), "run.toml")
        assert "train: FAILED (Job dflash-example-train)" in before

        said: list[str] = []
        code = resume_run(KubeCluster(NS, api.api_client()), run.run_id, lambda: kubectl_apply(api, run),
                          say=said.append)
        assert code == ExitCode.OK
        # Only this run's failed Jobs, the driver's first, with their pods.
        assert [(key[2], policy) for key, policy in api.deleted if key[0] == "jobs"][:2] == [
            ("dflash-example-driver", "Background"), ("dflash-example-train", "Background")]
        assert said[0].startswith("deleted Job/dflash-example-driver (failed: PodFailurePolicy")
        assert api.get("jobs", NS, "dflash-other-driver") is not None
        driver_job = api.get("jobs", NS, "dflash-example-driver")
        assert driver_job is not None and not driver_job["status"].get("conditions")  # applied again
        assert api.get("jobs", NS, "dflash-example-tokenize") is not None  # a succeeded Job stays

        # The new driver pod: committed stages are skipped, train is created again, the run completes.
        rerun = Cluster(api, store)
        assert driver(api, store, run, rerun).run() == ExitCode.OK
        assert [stage for stage, _ in rerun.created] == ["train", "export", "evaluate", "serve-check"]
        assert stage_states(store, run) == {**dict.fromkeys(STAGES[:3], "skipped"),
                                            **dict.fromkeys(STAGES[3:], "succeeded")}
        # (The simulated stages commit placeholder manifests, so `status` calls them invalid, not failed.)
        assert not any(s.shown_state == "failed" or s.failure for s in run_status(run, store))
    finally:
        api.stop()


def _pod(name: str, stage: str, run_id: str = "example") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": {
        "dflash-pipeline/run": run_id, "app.kubernetes.io/component": stage}},
        "spec": {"containers": [{"name": stage}]}, "status": {"phase": "Running"}}


def test_logs_come_from_the_cluster_while_the_pods_exist_and_from_the_store_after(run: RunConfig,
                                                                                 store: ObjectStore) -> None:
    lay = layout(run.root, run.run_id)
    store.write_bytes(join(lay.logs("tokenize"), "dflash-example-tokenize-0-aaaaa.log"), b"tok 1\ntok 2\n")
    store.write_bytes(join(lay.logs("train"), "dflash-example-train-0-old00.log"), b"first try\nexit 1\n")
    store.write_bytes(join(lay.logs("train"), "dflash-example-train-0-live0.log"), b"stale copy\n")
    api = FakeKubeApi().start()
    try:
        api.add(_pod("dflash-example-train-0-live0", "train"))
        api.add(_pod("dflash-other-train-0-zzzzz", "train", run_id="other"))
        api.logs[(NS, "dflash-example-train-0-live0")] = "step 1\nstep 2\nstep 3\n"
        logs, notes = collect_logs(run, store, tail=2, cluster=lambda: KubeCluster(NS, api.api_client()))
        assert notes == []
        assert [(p.stage, p.pod, p.text) for p in logs] == [
            ("tokenize", "dflash-example-tokenize-0-aaaaa", "tok 1\ntok 2\n"),
            ("train", "dflash-example-train-0-live0", "step 2\nstep 3\n"),
            ("train", "dflash-example-train-0-old00", "first try\nexit 1\n"),
        ]
        assert ("get", "pods/log") in api.requests
        text = format_logs(logs)
        assert "==> train: dflash-example-train-0-live0 (pod, Running) <==\nstep 2\n" in text
        assert f"==> train: dflash-example-train-0-old00 (kept at {lay.logs('train')}/" in text
        only, _ = collect_logs(run, store, "tokenize", cluster=lambda: KubeCluster(NS, api.api_client()))
        assert [p.stage for p in only] == ["tokenize"]
    finally:
        api.stop()

    def no_cluster() -> KubeCluster:
        raise ClusterAccessError("no Kubernetes API to talk to: not in a pod, and no usable kubeconfig")

    logs, notes = collect_logs(run, store, "train", cluster=no_cluster)
    assert [p.pod for p in logs] == ["dflash-example-train-0-live0", "dflash-example-train-0-old00"]
    assert "no usable kubeconfig" in notes[0] and "copies in the store" in notes[0]
    none, notes = collect_logs(run, store, "export")
    assert none == [] and notes == [f"no logs of stage export of run example: no pod in the cluster, none kept under "
                                    f"{lay.logs('export')}"]


@pytest.mark.slow
def test_resume_and_logs_from_the_command_line_with_a_kubeconfig(run: RunConfig, store: ObjectStore,
                                                                   tmp_path: Path) -> None:
    api = FakeKubeApi().start()
    try:
        kubectl_apply(api, run)
        failed = {"failed": 1, "conditions": [{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}]}
        api.add({"apiVersion": "batch/v1", "kind": "Job", "spec": {}, "metadata": {
            "name": "dflash-example-tokenize", "namespace": NS, "labels": {"dflash-pipeline/run": run.run_id}}})
        for name in ("dflash-example-driver", "dflash-example-tokenize"):
            api.set_status(NS, name, failed)
        api.add(_pod("dflash-example-tokenize-0-abcde", "tokenize"))
        api.logs[(NS, "dflash-example-tokenize-0-abcde")] = "exit 65 (BAD_INPUT): no records\n"
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(api.kubeconfig())
        run_path = tmp_path / "run.json"
        data = read_run_file(EXAMPLE_RUN)
        data["root"] = run.root
        run_path.write_text(json.dumps(data))
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "dflash_pipeline", *args, "--config", str(run_path)],
                                  env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, check=False)

        dry = cli("resume", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "would delete Job/dflash-example-driver (failed: PodFailurePolicy)" in dry.stderr
        assert "would delete Job/dflash-example-tokenize (failed: PodFailurePolicy)" in dry.stderr
        assert "kind: CronJob" in dry.stdout and api.deleted == []  # printed, nothing deleted
        logs = cli("logs", "tokenize")
        assert logs.returncode == 0, logs.stderr
        assert logs.stdout == ("==> tokenize: dflash-example-tokenize-0-abcde (pod, Running) <==\n"
                               "exit 65 (BAD_INPUT): no records\n")
    finally:
        api.stop()
