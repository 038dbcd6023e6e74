"""Manifests stay valid wherever their run root goes: moved, copied to another bucket, read from another directory.

A user who imports with `--output store/x` and later points a stage at `/abs/store/x` from elsewhere (or
moves the store to a bigger disk) must not get "object not found" for shards that are right there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dflash_shared.importing import ImportSpec, run_import
from dflash_shared.jsonl import iter_lines
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind, Producer
from dflash_shared.storage import ObjectStore, join, relative_location, resolve_location


def _conversations(n: int) -> bytes:
    lines = [
        {"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                      {"role": "assistant", "content": f"<think>\nadd\n</think>\n\nIt is {2 * i}."}]}
        for i in range(n)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _import(store: ObjectStore, source: str, output: str) -> None:
    store.write_bytes(join(source, "a.jsonl"), _conversations(12))
    spec = ImportSpec(Kind.completions, source, output, "run-1")
    assert run_import(store, spec, Producer(stage="import")) is not None


def _records(store: ObjectStore, prefix: str) -> int:
    loaded = load_manifest(store, prefix, Kind.completions)  # verifies every shard's size and sha256
    return sum(1 for shard in loaded.manifest.shards for _ in iter_lines(store, shard.uri))


@pytest.mark.parametrize(
    ("base", "uri", "relative"),
    [
        ("/r/run/tokenized", "/r/run/tokenized/data/part-0.arrow", "data/part-0.arrow"),
        ("/r/run/export", "/r/run/export", "."),
        ("/r/run/tokenized", "/r/run/completions/manifest.json", "../completions/manifest.json"),
        ("/r/run/tokenized", "/models/qwen", "/models/qwen"),  # outside the run root: stays absolute
        ("s3://b/runs/x/tokenized", "s3://b/runs/x/tokenized/data/p", "data/p"),
        ("s3://b/runs/x/tokenized", "s3://b/runs/x/drafter/manifest.json", "../drafter/manifest.json"),
        ("s3://b/runs/x/tokenized", "s3://other/runs/x/data/p", "s3://other/runs/x/data/p"),
        ("s3://b/runs/x/tokenized", "/local/file", "/local/file"),
    ],
)
def test_locations_round_trip(base: str, uri: str, relative: str) -> None:
    assert relative_location(base, uri) == relative
    assert resolve_location(base, relative) == uri


def test_a_relative_output_reads_from_another_directory_and_after_a_move(
    tmp_path: Path, store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    _import(store, "sources", "store/x")  # both relative to the working directory, as a user types them
    written = json.loads((work / "store/x/manifest.json").read_text())
    assert all(not os.path.isabs(s["uri"]) and s["uri"].startswith("data/") for s in written["shards"])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert _records(store, str(work / "store/x")) == 12

    moved = tmp_path / "bigger-disk" / "store"
    moved.parent.mkdir()
    shutil.move(str(work / "store"), str(moved))
    assert _records(store, str(moved / "x")) == 12
    monkeypatch.chdir(moved)
    assert _records(store, "x") == 12


def test_an_s3_prefix_copied_elsewhere_still_reads(s3_bucket: str, store: ObjectStore) -> None:
    original, copy = f"{s3_bucket}/runs/a/completions", f"{s3_bucket}/archive/runs/a/completions"
    _import(store, f"{s3_bucket}/sources", original)
    for uri in store.list(original):
        store.write_bytes(copy + uri[len(original):], store.read_bytes(uri))
    for uri in store.list(original):
        store.delete(uri)
    assert _records(store, copy) == 12
