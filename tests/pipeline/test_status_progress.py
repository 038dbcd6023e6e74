"""`pipeline status` inside a running stage: generate's chunks from their receipts, the driver's failure reasons."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_generate.chunks import ChunkReceipt, plan_chunks, receipt_uri
from dflash_pipeline import layout, parse_run_config
from dflash_pipeline.drive.run_state import RunState, write_run_state
from dflash_pipeline.drive.status import format_status, run_status
from dflash_pipeline.run.config import RunConfig, read_run_file
from dflash_shared.manifest_io import write_manifest
from dflash_shared.manifests import Accounting, Kind, Manifest, Producer, PromptsSection, Shard
from dflash_shared.storage import ObjectStore, join
from tests.pipeline.k8s_support import EXAMPLE_RUN


def _run(s3_bucket: str, tmp_path: Path, chunk_records: int) -> tuple[Path, RunConfig]:
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = join(s3_bucket, "runs")
    data["stages"]["generate"]["config"]["chunk_records"] = chunk_records
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps(data), encoding="utf-8")
    return run_file, parse_run_config(data)


def _prompts(store: ObjectStore, run: RunConfig, records: list[int]) -> list[Shard]:
    lay = layout(run.root, run.run_id)
    shards = [Shard(uri=f"part-{i:05d}.jsonl.zst", bytes=1, sha256="0" * 64, records=n) for i, n in enumerate(records)]
    write_manifest(store, lay.prompts, Manifest(
        kind=Kind.prompts, run_id=run.run_id, producer=Producer(stage="import"), shards=shards,
        accounting=Accounting(input_records=sum(records), succeeded=sum(records), failed=0, skipped=0),
        section=PromptsSection(sources=["s3://src"], duplicates=0)))
    return [shard.model_copy(update={"uri": join(lay.prompts, shard.uri)}) for shard in shards]


def test_generate_progress_counts_committed_chunks_with_rate_and_eta(s3_bucket: str, store: ObjectStore,
                                                                     tmp_path: Path) -> None:
    _, run = _run(s3_bucket, tmp_path, chunk_records=100)
    shards = _prompts(store, run, [250, 150])  # chunks of 100: 3 + 2 = 5 planned
    chunks = plan_chunks(shards, 100)
    assert len(chunks) == 5
    lay = layout(run.root, run.run_id)
    # Two chunks committed, each 100 prompts -> 20,000 tokens in 10 engine-seconds.
    for chunk in chunks[:2]:
        receipt = ChunkReceipt(item=chunk.item, input_sha256="0" * 64, settings_sha256="0" * 64, shard=None,
                               accounting=Accounting(input_records=100, succeeded=100, failed=0, skipped=0),
                               prompt_tokens=5000, output_tokens=20_000, engine_seconds=10.0)
        store.write_bytes(receipt_uri(lay.completions, chunk), receipt.model_dump_json().encode())

    statuses = run_status(run, store)
    generate = {s.stage: s for s in statuses}["generate"]
    # 2,000 tok/s per engine, 4 engines (the example's shards); 3 chunks x 10 s left over 4 engines.
    assert generate.progress == "2/5 chunks committed (40%), 8,000 tok/s over 4 engine(s), ETA 0 min"
    # What `pipeline status` prints (its command line: test_k8s_status).
    assert "generate: 2/5 chunks committed (40%)" in format_status(run, statuses)


def test_an_unreadable_receipt_is_named_and_not_counted(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    _, run = _run(s3_bucket, tmp_path, chunk_records=100)
    chunks = plan_chunks(_prompts(store, run, [200]), 100)
    lay = layout(run.root, run.run_id)
    receipt = ChunkReceipt(item=chunks[0].item, input_sha256="0" * 64, settings_sha256="0" * 64, shard=None,
                           accounting=Accounting(input_records=100, succeeded=100, failed=0, skipped=0),
                           prompt_tokens=1, output_tokens=1000, engine_seconds=1.0)
    store.write_bytes(receipt_uri(lay.completions, chunks[0]), receipt.model_dump_json().encode())
    store.write_bytes(receipt_uri(lay.completions, chunks[1]), b'{"output_tok')  # cut short
    generate = {s.stage: s for s in run_status(run, store)}["generate"]
    assert generate.progress.startswith("1/2 chunks committed (50%)")
    cut = receipt_uri(lay.completions, chunks[1])
    assert f"1 unreadable receipt(s) not counted (first: {cut})" in generate.progress


def test_generate_progress_before_any_chunk(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    _, run = _run(s3_bucket, tmp_path, chunk_records=64)
    _prompts(store, run, [640])
    generate = {s.stage: s for s in run_status(run, store)}["generate"]
    assert generate.progress == "0/10 chunks committed"


def test_a_failed_stage_shows_the_drivers_reason(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    _, run = _run(s3_bucket, tmp_path, chunk_records=64)
    state = RunState()
    state.set("import", "succeeded", job="dflash-example-import")
    state.set("generate", "failed", job="dflash-example-generate",
              reason="BackoffLimitExceeded: pod dflash-example-generate-2-x exited 65 (bad_fraction 0.31 > 0.05)")
    write_run_state(store, run.root, run.run_id, state)
    statuses = run_status(run, store)
    text = format_status(run, statuses)
    assert ("generate: FAILED (Job dflash-example-generate): BackoffLimitExceeded: pod dflash-example-generate-2-x "
            "exited 65 (bad_fraction 0.31 > 0.05)") in text
    assert "generate: exit 65: the input failed a check" in text and "resume --config RUN.toml" in text
    assert "import: driver" not in text  # a stage that succeeded needs no driver line
