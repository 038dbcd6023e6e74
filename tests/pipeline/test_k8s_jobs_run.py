"""Manifests proven, not only validated: the rendered import and tokenize Jobs run as written.

Every pod of each Job runs its containers (see pod_emulation: command, args and env exactly as
rendered, the image's ENV, what Kubernetes injects, the Secret's keys) against a moto S3 server, in
this repository's environment. A misspelt variable name or command in a manifest fails here.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest

from dflash_pipeline import RunConfig, layout, parse_run_config, render_documents
from dflash_pipeline.drive.status import run_status
from dflash_pipeline.run.config import read_run_file
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_shared.storage import ObjectStore, join
from tests.pipeline.k8s_support import EXAMPLE_RUN, jobs
from tests.pipeline.pod_emulation import ContainerRun, run_pod
from tests.support.qwen_assets import build_tokenizer_dir

TOPICS = ["prime numbers", "binary search", "photosynthesis", "the water cycle", "熱力学", "sorting"]


def conversations(start: int, count: int) -> bytes:
    lines = []
    for i in range(start, start + count):
        topic = TOPICS[i % len(TOPICS)]
        lines.append(json.dumps({"messages": [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": f"Question {i}: explain {topic} in a few sentences."},
            {"role": "assistant", "reasoning_content": f"The user asks about {topic}; define it, then an example.",
             "content": f"{topic.capitalize()} is a well studied topic; example number {i} shows the idea well."},
        ]}, ensure_ascii=False))
    return ("\n".join(lines) + "\n").encode("utf-8")


def bucket_run(bucket: str, endpoint: str) -> RunConfig:
    """The example run pointed at the test bucket, with a completions source and two shards per stage."""
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = f"{bucket}/runs"
    data["source"] = {"kind": "completions", "uri": f"{bucket}/sources/chat"}
    data["target"] = {**data["target"], "uri": f"{bucket}/models/qwen3"}
    data["storage"] = {**data["storage"], "endpoint_url": endpoint, "region": "us-east-1"}
    data["stages"]["import"] = {**data["stages"]["import"], "shards": 2}
    # One CPU requested: one tokenizer worker process, which suits the machines the tests run on.
    data["stages"]["tokenize"] = {**data["stages"]["tokenize"], "shards": 2, "cpu": "1"}
    return parse_run_config(data, "test run")


@pytest.fixture
def secrets() -> dict[str, dict[str, str]]:
    """The cluster's Secrets: the one the run names, holding the moto server's test credentials."""
    return {"dflash-s3": {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}}


def _check(runs: list[ContainerRun], names: list[str]) -> None:
    assert [r.name for r in runs] == names, "\n".join(r.output[-3000:] for r in runs)
    for r in runs:
        assert r.returncode == 0, f"container {r.name} {r.argv} exited {r.returncode}:\n{r.output[-4000:]}"


@pytest.mark.slow
def test_import_and_tokenize_jobs_run_as_rendered(
    s3_bucket: str, moto_endpoint: str, store: ObjectStore, tmp_path: Path, secrets: dict[str, dict[str, str]]
) -> None:
    run = bucket_run(s3_bucket, moto_endpoint)
    tokenizer = build_tokenizer_dir(tmp_path / "tokenizer")
    for path in sorted(tokenizer.iterdir()):
        store.upload_from(str(path), join(run.target.uri, path.name))
    store.write_bytes(join(run.source.uri, "part-0.jsonl"), conversations(0, 4))
    store.write_bytes(join(run.source.uri, "part-1.jsonl"), conversations(4, 3))
    by_stage = jobs(render_documents(run))

    for index in range(by_stage["import"]["spec"]["completions"]):
        _check(run_pod(by_stage["import"], index, secrets, tmp_path / f"import-{index}"), ["import"])
    tokenize_runs = []
    for index in range(by_stage["tokenize"]["spec"]["completions"]):
        runs = run_pod(by_stage["tokenize"], index, secrets, tmp_path / f"tokenize-{index}")
        _check(runs, ["tokenize"])
        tokenize_runs.append(runs[0])

    lay = layout(run.root, run.run_id)
    completions = load_manifest(store, lay.completions, Kind.completions)
    tokenized = load_manifest(store, lay.tokenized, Kind.tokenized)
    manifest = tokenized.manifest
    assert completions.manifest.total_records == 7 and completions.manifest.run_id == run.run_id
    assert [(i.uri, i.kind, i.sha256) for i in manifest.inputs] == [
        (lay.manifest(Kind.completions), Kind.completions,
         hashlib.sha256(store.read_bytes(lay.manifest(Kind.completions))).hexdigest())
    ]
    assert manifest.accounting.input_records == 7 and manifest.total_records == 7
    assert manifest.run_id == run.run_id and manifest.section.target.model_id == run.target.model_id
    # The run file's override reached the stage through its environment variable.
    assert manifest.section.max_length == 8192 and manifest.producer.config["workers"] == 1
    assert all("preflight tokenize OK" in r.output for r in tokenize_runs)

    statuses = {s.stage: s for s in run_status(run, store)}
    assert statuses["import"].state == statuses["tokenize"].state == "complete"
    assert statuses["tokenize"].records == 7 and statuses["tokenize"].shards_done == 2
    # Each pod kept its log in the store (the entrypoint under dflash_shared.pod_log), named by the pod.
    kept = store.list(lay.logs("tokenize"))
    name = by_stage["tokenize"]["metadata"]["name"]
    assert [uri.rsplit("/", 1)[-1] for uri in kept] == [f"{name}-{i}-emulated.log" for i in range(2)]
    text = store.read_bytes(kept[0]).decode()
    assert "preflight tokenize OK" in text and text.rstrip().endswith("entrypoint.sh exited 0 (OK)")
    assert store.list(lay.logs("import"))  # import goes through the entrypoint too


@pytest.mark.slow
def test_a_misspelt_env_var_in_the_tokenize_job_exits_usage(
    s3_bucket: str, moto_endpoint: str, tmp_path: Path, secrets: dict[str, dict[str, str]]
) -> None:
    job = jobs(render_documents(bucket_run(s3_bucket, moto_endpoint)))["tokenize"]
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    (item,) = [e for e in env if e["name"] == "DFLASH_TOKENIZE_INPUT"]
    item["name"] = "DFLASH_TOKENIZE_INPTU"
    (result,) = run_pod(job, 0, secrets, tmp_path / "pod")
    assert result.returncode == ExitCode.USAGE, result.output
    assert "DFLASH_TOKENIZE_INPTU" in result.output


@pytest.mark.slow
def test_a_misspelt_command_in_the_import_job_fails(
    s3_bucket: str, moto_endpoint: str, tmp_path: Path, secrets: dict[str, dict[str, str]]
) -> None:
    job = jobs(render_documents(bucket_run(s3_bucket, moto_endpoint)))["import"]
    job = copy.deepcopy(job)
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["command"] = [container["command"][0], "imprt"]
    (result,) = run_pod(job, 0, secrets, tmp_path / "pod")
    assert result.returncode == ExitCode.USAGE, result.output
    container["command"] = ["dflash-tokenzie", "import"]
    with pytest.raises(AssertionError, match="dflash-tokenzie"):
        run_pod(job, 0, secrets, tmp_path / "pod2")


def test_a_missing_secret_stops_the_pod_like_the_kubelet(
    s3_bucket: str, moto_endpoint: str, tmp_path: Path
) -> None:
    job = jobs(render_documents(bucket_run(s3_bucket, moto_endpoint)))["import"]
    with pytest.raises(AssertionError, match="Secret 'dflash-s3' does not exist"):
        run_pod(job, 0, {}, tmp_path / "pod")
