"""Chunk planning, prompt reading (duplicates, malformed lines, damaged shards) and chunk receipts.

These run without an engine, on both storage backends (a temp dir and a moto S3 server).
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import pytest

from dflash_generate.chunks import (
    DUPLICATE,
    ChunkReceipt,
    PromptReader,
    Rejected,
    load_receipts,
    plan_chunks,
    receipt_uri,
)
from dflash_shared.errors import BadInputError
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Accounting, Kind, Shard
from dflash_shared.quality import MALFORMED
from dflash_shared.records import PromptRecord
from dflash_shared.runner import ShardingError
from dflash_shared.storage import ObjectStore, join
from tests.generate.stage_support import varied_prompts, write_prompts
from tests.support.jsonl_manifests import zst


def shard(uri: str, records: int) -> Shard:
    return Shard(uri=uri, bytes=1, sha256="0" * 64, records=records)


def test_chunks_cover_every_record_once() -> None:
    chunks = plan_chunks([shard("s3://b/p/a", 7), shard("s3://b/p/b", 0), shard("s3://b/p/c", 3)], 3)
    assert [(c.file_index, c.first, c.end) for c in chunks] == [(0, 0, 3), (0, 3, 6), (0, 6, 7), (2, 0, 3)]
    assert chunks[1].item == "s3://b/p/a#000000003-000000006"
    assert chunks[1].data_name == "chunk-00000-000000003.jsonl.zst"
    # Sorting the items (as the runner does) keeps each shard's chunks in reading order.
    assert sorted(c.item for c in chunks) == [c.item for c in chunks]


def bad_input_lines() -> list[PromptRecord | bytes]:
    good = varied_prompts(6)
    return [
        good[0], good[1],
        b"{not json",                                  # malformed: not JSON
        good[2],
        good[0],                                       # duplicate of line 1, in a later chunk
        b'{"id": "x", "messages": "not a list"}',      # malformed: not a prompt record
        good[3], good[4], good[2], good[5],            # line 9 duplicates line 4, in the same chunk
    ]


def read_all(reader: PromptReader, chunks: list) -> list[tuple[str, PromptRecord | Rejected]]:
    return [entry for chunk in chunks for entry in reader.read(chunk)]


def test_reader_counts_duplicates_the_same_whatever_the_chunking(storage_root: str, store: ObjectStore,
                                                                 tmp_path: Path) -> None:
    prefix = write_prompts(store, join(storage_root, "prompts"), bad_input_lines())
    manifest = load_manifest(store, prefix, Kind.prompts).manifest
    uri = manifest.shards[0].uri
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    outcomes = {}
    for size in (1, 3, 4, 10):
        chunks = plan_chunks(manifest.shards, size)
        reader = PromptReader(store, manifest.shards, str(scratch))
        got = read_all(reader, chunks)
        reader.close()
        outcomes[size] = [(where, r.reason if isinstance(r, Rejected) else r.id) for where, r in got]
    assert outcomes[1] == outcomes[3] == outcomes[4] == outcomes[10]
    reasons = [r for _, r in outcomes[3] if r in (MALFORMED, DUPLICATE)]
    assert reasons == [MALFORMED, DUPLICATE, MALFORMED, DUPLICATE]
    assert [where for where, r in outcomes[3] if r == DUPLICATE] == [f"{uri}:5", f"{uri}:9"]
    # A worker given only the last chunk still knows the ids before it (the scratch dir is left clean).
    reader = PromptReader(store, manifest.shards, str(scratch))
    last = plan_chunks(manifest.shards, 4)[-1]
    assert [(w, r.reason if isinstance(r, Rejected) else r.id) for w, r in reader.read(last)] == outcomes[4][8:]
    reader.close()
    assert list(scratch.iterdir()) == []


def test_damaged_or_miscounted_shards_are_refused(tmp_path: Path, store: ObjectStore) -> None:
    prefix = write_prompts(store, str(tmp_path / "prompts"), varied_prompts(5))
    good = load_manifest(store, prefix, Kind.prompts).manifest.shards[0]
    scratch = tempfile.mkdtemp(dir=tmp_path)
    changed = good.model_copy(update={"sha256": "1" * 64})
    with pytest.raises(BadInputError, match="does not match its manifest"):
        list(PromptReader(store, [changed], scratch).read(plan_chunks([changed], 10)[0]))
    # The bytes match, but the manifest claims a record count the file does not have.
    data = zst([b'{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'] * 2)
    uri = str(tmp_path / "two.jsonl.zst")
    store.write_bytes(uri, data)
    for claimed, message in ((3, "ends after 2 records"), (1, "holds more than the 1 records")):
        entry = Shard(uri=uri, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), records=claimed)
        with pytest.raises(BadInputError, match=message):
            list(PromptReader(store, [entry], scratch).read(plan_chunks([entry], 10)[0]))


def receipt(chunk_item: str, shard_entry: Shard | None, settings: str = "s" * 64) -> ChunkReceipt:
    return ChunkReceipt(
        item=chunk_item, input_sha256="i" * 64, settings_sha256=settings, shard=shard_entry,
        accounting=Accounting(input_records=3, succeeded=3, failed=0, skipped=0),
        prompt_tokens=30, output_tokens=12, engine_seconds=1.5,
    )


def test_receipts_are_checked_before_a_chunk_is_adopted(storage_root: str, store: ObjectStore) -> None:
    out = join(storage_root, "completions")
    chunks = plan_chunks([shard(join(storage_root, "p.jsonl.zst"), 9)], 3)
    data_uri = join(out, "data", chunks[0].data_name)
    store.write_bytes(data_uri, b"12345")
    file_entry = Shard(uri=data_uri, bytes=5, sha256="f" * 64, records=3)
    store.write_bytes(receipt_uri(out, chunks[0]), receipt(chunks[0].item, file_entry).model_dump_json().encode())
    # Its file is gone: chunk 1 is generated again rather than trusted.
    gone = file_entry.model_copy(update={"uri": join(out, "data", chunks[1].data_name)})
    store.write_bytes(receipt_uri(out, chunks[1]), receipt(chunks[1].item, gone).model_dump_json().encode())
    loaded = load_receipts(store, out, chunks, "i" * 64, "s" * 64)
    assert list(loaded) == [chunks[0].item] and loaded[chunks[0].item].shard == file_entry
    with pytest.raises(ShardingError, match="other generation settings"):
        load_receipts(store, out, chunks, "i" * 64, "t" * 64)
    with pytest.raises(ShardingError, match="another prompts manifest"):
        load_receipts(store, out, chunks, "j" * 64, "s" * 64)
