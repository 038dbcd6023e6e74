"""`status` and `wait` against a moto S3 server: progress read from manifests and shard markers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_pipeline import layout, parse_run_config
from dflash_pipeline.drive.status import stage_status
from dflash_pipeline.drive.wait import wait_for_manifest
from dflash_pipeline.run.config import read_run_file
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifest_io import write_manifest
from dflash_shared.manifests import Accounting, Kind, Manifest, Producer, PromptsSection
from dflash_shared.runner import ShardContext, ShardOutcome, run_shard
from dflash_shared.storage import ObjectStore, join
from tests.pipeline.k8s_support import EXAMPLE_RUN, REPO_ROOT


def _generate_shard(ctx: ShardContext) -> ShardOutcome:
    """Stands in for a generate shard: publishes one file and accounts for its items."""
    ctx.publish(b"x" * 10, ctx.part_name(0, ".jsonl.zst"), records=len(ctx.items) - 1)
    accounting = Accounting(input_records=len(ctx.items), succeeded=len(ctx.items) - 1, failed=1, skipped=0,
                            failures_by_reason={"engine_error": 1}, examples={"engine_error": ["p-3: timed out"]})
    return ctx.outcome(accounting)


@pytest.mark.slow
def test_status_reports_complete_in_progress_and_not_started(s3_bucket: str, store: ObjectStore,
                                                             tmp_path: Path) -> None:
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = f"{s3_bucket}/runs"
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps(data), encoding="utf-8")
    run = parse_run_config(data)
    lay = layout(run.root, run.run_id)
    prompts = Manifest(
        kind=Kind.prompts, run_id=run.run_id, producer=Producer(stage="import"),
        accounting=Accounting(input_records=12, succeeded=9, failed=2, skipped=1,
                              failures_by_reason={"malformed": 2}, skips_by_reason={"duplicate": 1},
                              examples={"malformed": ["a.jsonl:3: not valid JSON"]}),
        section=PromptsSection(sources=[run.source.uri], duplicates=1),
    )
    write_manifest(store, lay.prompts, prompts)
    # Shard 1 of generate's 4 is done: its marker is all that exists under the completions prefix.
    run_shard("generate", store, lay.completions, [f"p-{i}" for i in range(8)], 1, 4, _generate_shard)

    proc = subprocess.run([sys.executable, "-m", "dflash_pipeline", "status", "--config", str(run_file),
                           "--json"], capture_output=True, text=True, env={**os.environ}, cwd=REPO_ROOT,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    got = {s["stage"]: s for s in json.loads(proc.stdout)["stages"]}
    assert [got[s]["state"] for s in ("import", "generate", "tokenize")] == ["complete", "in progress", "not started"]
    assert got["import"]["records"] == 0 and got["import"]["failures_by_reason"] == {"malformed": 2}
    assert got["import"]["skips_by_reason"] == {"duplicate": 1}
    assert (got["generate"]["shards_done"], got["generate"]["shard_count"], got["generate"]["records"]) == (1, 4, 1)
    assert got["generate"]["failures_by_reason"] == {"engine_error": 1}
    assert got["tokenize"]["prefix"] == lay.tokenized and got["tokenize"]["shards_done"] == 0

    text = subprocess.run([sys.executable, "-m", "dflash_pipeline", "status", "--config", str(run_file)],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, check=True).stdout
    assert "in progress" in text and "1/4" in text
    assert "import: failed malformed: 2 (e.g. a.jsonl:3: not valid JSON)" in text


def test_status_flags_a_prefix_of_another_kind(s3_bucket: str, store: ObjectStore) -> None:
    prefix = join(s3_bucket, "x")
    write_manifest(store, prefix, Manifest(
        kind=Kind.prompts, run_id="r", producer=Producer(stage="import"),
        accounting=Accounting(input_records=0, succeeded=0, failed=0, skipped=0),
        section=PromptsSection(sources=[], duplicates=0)))
    status = stage_status(store, "tokenize", Kind.tokenized, prefix, 2)
    assert status.state == "invalid" and "prompts manifest, not tokenized" in status.detail


def test_wait_returns_once_the_manifest_exists_and_fails_after_the_timeout(s3_bucket: str, store: ObjectStore) -> None:
    uri = join(s3_bucket, "runs", "r", "completions", "manifest.json")
    started = time.monotonic()
    assert wait_for_manifest(store, uri, timeout_s=0.6, poll_s=0.1) == ExitCode.BAD_INPUT
    assert time.monotonic() - started >= 0.6
    polls: list[float] = []

    def sleep(seconds: float) -> None:
        polls.append(seconds)
        if len(polls) == 2:  # the upstream stage commits while the pod is waiting
            store.write_bytes(uri, b"{}")

    assert wait_for_manifest(store, uri, timeout_s=3600, poll_s=30, sleep=sleep) == ExitCode.OK
    assert polls == [30, 30]


@pytest.mark.slow
def test_status_of_an_unreadable_store_fails_once_with_exit_69(moto_endpoint: str, tmp_path: Path) -> None:
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = "s3://no-such-bucket-dflash-status/runs"
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps(data), encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "dflash_pipeline", "status", "--config", str(run_file)],
                          capture_output=True, text=True, env={**os.environ}, cwd=REPO_ROOT, timeout=60, check=False)
    assert proc.returncode == ExitCode.ENVIRONMENT, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "cannot read the run's storage" in errors[0] and "NoSuchBucket" in errors[0]
    assert "unknown" not in proc.stdout
