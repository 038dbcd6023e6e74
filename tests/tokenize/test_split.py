"""The held-out split: chosen by content id alone, recorded in the manifest, balanced in the accounting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind, Manifest, TokenizedSection
from dflash_shared.storage import ObjectStore
from dflash_tokenize.arrow_shards import Sequences, read_shard
from dflash_tokenize.config import TokenizeConfig
from dflash_tokenize.split import effective_fraction, is_heldout, partition
from dflash_tokenize.stage import run
from tests.support.qwen_assets import shared_tokenizer_dir
from tests.tokenize.stage_fixtures import completion, conversation, write_completions


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return shared_tokenizer_dir("qwen3")


def tokenize(src: str, out: str, tok: Path, **kw: object) -> Manifest:
    run(TokenizeConfig(input=src, output=out, tokenizer=str(tok), **kw), ObjectStore())  # type: ignore[arg-type]
    return load_manifest(ObjectStore(), out, Kind.tokenized).manifest


def ids_by_split(manifest: Manifest) -> dict[str, list[str]]:
    store = ObjectStore()
    return {split: [i for shard in manifest.split_shards(split)  # type: ignore[arg-type]
                    for i in read_shard(pa.py_buffer(store.read_bytes(shard.uri))).column("id").to_pylist()]
            for split in ("train", "heldout")}


def test_effective_fraction() -> None:
    assert effective_fraction(0.01, 64, 100_000) == 0.01
    assert effective_fraction(0.01, 64, 1_000) == 0.064  # the minimum count raises it on small inputs
    assert effective_fraction(0.01, 64, 50) == 0.5  # but never past half of the input
    assert effective_fraction(0.02, 0, 100) == 0.02
    assert effective_fraction(0, 64, 100) == effective_fraction(0.01, 64, 0) == 0.0


def test_partition_keeps_order_and_every_field() -> None:
    lengths = [3, 1, 4, 2]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    seqs = Sequences(ids=[f"r{i}" for i in range(4)], input_ids=np.arange(10, dtype=np.int32),
                     loss_mask=(np.arange(10) % 2).astype(np.int8), offsets=offsets)
    picked = seqs.take(np.array([2, 0]))
    assert picked.ids == ["r2", "r0"] and picked.offsets.tolist() == [0, 4, 7]
    assert picked.input_ids.tolist() == [4, 5, 6, 7, 0, 1, 2] and picked.loss_mask.tolist() == [0, 1, 0, 1, 0, 1, 0]
    train, heldout = partition(seqs, 0.5)
    assert sorted(train.ids + heldout.ids) == seqs.ids
    assert heldout.ids == [i for i in seqs.ids if is_heldout(i, 0.5)]
    assert partition(seqs, 0.0)[0] is seqs and len(partition(seqs, 0.0)[1]) == 0


def test_split_by_id_whatever_the_sharding_and_workers(tmp_path: Path, tok_dir: Path) -> None:
    records = [completion(conversation(i)) for i in range(120)]
    src = write_completions(ObjectStore(), str(tmp_path / "c"), records, shards=3)
    one = tokenize(src, str(tmp_path / "one"), tok_dir, workers=1, heldout_fraction=0.05, heldout_min_records=30)
    out = str(tmp_path / "two")
    for index in range(2):
        run(TokenizeConfig(input=src, output=out, tokenizer=str(tok_dir), workers=2, batch_records=16,
                           heldout_fraction=0.05, heldout_min_records=30, shard_index=index, num_shards=2),
            ObjectStore())
    two = load_manifest(ObjectStore(), out, Kind.tokenized).manifest
    split_one, split_two = ids_by_split(one), ids_by_split(two)
    assert {k: sorted(v) for k, v in split_one.items()} == {k: sorted(v) for k, v in split_two.items()}
    # Exactly the ids whose hash falls under max(5%, 30/120).
    section = one.section
    assert isinstance(section, TokenizedSection) and section.heldout is not None
    heldout = section.heldout
    assert (heldout.fraction, heldout.min_records, heldout.input_records, heldout.effective_fraction) == (
        0.05, 30, 120, 0.25)
    assert sorted(split_one["heldout"]) == sorted(r.id for r in records if is_heldout(r.id, 0.25))
    assert 15 <= heldout.records == len(split_one["heldout"]) <= 45
    assert all("/data/heldout/" in s.uri and s.split == "heldout" for s in one.split_shards("heldout"))
    assert all(s.split == "train" for s in one.split_shards("train"))
    shards = one.split_shards("heldout")
    assert heldout.tokens == sum(s.tokens or 0 for s in shards) and 0 < heldout.loss_tokens < heldout.tokens
    # Held-out rows are written, so they are succeeded records: the accounting balances as before.
    acc = one.accounting
    assert acc.input_records == acc.succeeded == 120 == len(split_one["train"]) + len(split_one["heldout"])
    assert section.total_tokens == sum(s.tokens or 0 for s in one.shards)


def test_zero_fraction_turns_the_split_off(tmp_path: Path, tok_dir: Path) -> None:
    src = write_completions(ObjectStore(), str(tmp_path / "c"), [completion(conversation(i)) for i in range(10)])
    off = tokenize(src, str(tmp_path / "off"), tok_dir, workers=1, heldout_fraction=0)
    assert off.split_shards("heldout") == [] and len(off.split_shards("train")) == len(off.shards)
    assert off.section.heldout.records == 0 and off.section.heldout.effective_fraction == 0  # type: ignore[union-attr]
    # The default minimum count on a tiny input holds out about half of it, never more than the hash says.
    small = tokenize(src, str(tmp_path / "small"), tok_dir, workers=1)
    assert small.section.heldout.effective_fraction == 0.5  # type: ignore[union-attr]
    assert ids_by_split(small)["heldout"] == [r for r in ids_by_split(off)["train"] if is_heldout(r, 0.5)]
