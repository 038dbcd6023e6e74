"""The training data path: shard cache, packing plan, global row order, world-size invariance, resume."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_shared.errors import BadInputError
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_shared.storage import ObjectStore, join
from dflash_train.data.batch import PAD_DOCUMENT, pack_row
from dflash_train.data.loader import StepLoader
from dflash_train.data.plan import DataPlan, best_fit_rows, build_plan, epoch_rows, total_steps
from dflash_train.data.shards import ShardCache
from tests.train.train_fixtures import identity_of, synthetic_docs, tiny_target, write_tokenized

MAX_LEN = 128


def unique_docs(count: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Documents whose first token is their own number, so a packed row tells which documents it holds."""
    docs = synthetic_docs(count, seed, min_len=8, max_len=150)
    return [([50_000 + i, *ids[1:]], mask) for i, (ids, mask) in enumerate(docs)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[tuple[list[int], list[int]]]]:
    docs = unique_docs(120)
    root = str(tmp_path_factory.mktemp("data"))
    return write_tokenized(ObjectStore(), join(root, "tok"), docs, identity_of(tiny_target()), shards=4), docs


def make_plan(store: ObjectStore, prefix: str, cache: ShardCache, seed: int = 0, plan_uri: str | None = None,
              max_length: int = MAX_LEN) -> DataPlan:
    loaded = load_manifest(store, prefix, Kind.tokenized)
    return build_plan(store, plan_uri or join(prefix, "..", "plan.json"), loaded.manifest.shards, loaded.sha256,
                      cache, max_length, seed, 0, 1, lambda obj: [obj])


def docs_of_row(batch_ids: torch.Tensor, document_ids: torch.Tensor) -> list[int]:
    starts = (document_ids != PAD_DOCUMENT) & torch.cat(
        [torch.ones(1, dtype=torch.bool), document_ids[1:] != document_ids[:-1]])
    return [int(t) - 50_000 for t in batch_ids[starts]]


def test_best_fit_packs_every_document_once_and_row_count_ignores_order() -> None:
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 300, 500)
    rows = best_fit_rows(lengths, 256)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(500))
    assert all(sum(min(lengths[i], 256) for i in row) <= 256 for row in rows)
    # Shuffling the documents changes which ones share a row, never how many rows there are.
    for seed in range(3):
        perm = np.random.default_rng(seed).permutation(500)
        assert len(best_fit_rows(lengths[perm], 256)) == len(rows)
    fill = lengths.clip(max=256).sum() / (len(rows) * 256)
    assert fill > 0.95, f"best-fit decreasing should fill rows well, got {fill:.3f}"


def test_epoch_rows_are_deterministic_and_differ_between_epochs() -> None:
    lengths = np.random.default_rng(2).integers(5, 100, 200)
    first = epoch_rows(lengths, 256, seed=7, epoch=0, shard_index=3)
    assert first == epoch_rows(lengths, 256, seed=7, epoch=0, shard_index=3)
    assert first != epoch_rows(lengths, 256, seed=7, epoch=1, shard_index=3)
    assert first != epoch_rows(lengths, 256, seed=8, epoch=0, shard_index=3)


def test_rows_match_the_packing_primitive_and_cover_each_epoch_exactly(tmp_path: Path, dataset) -> None:
    prefix, docs = dataset
    store = ObjectStore()
    cache = ShardCache(store, str(tmp_path / "cache"), 10 * 2**20)
    plan = make_plan(store, prefix, cache, plan_uri=str(tmp_path / "plan.json"))
    rows_per_step = 4
    steps = plan.rows_per_epoch // rows_per_step
    loader = StepLoader(plan, cache, rows_per_step, micro_rows=2, rank=0, world=1, start_step=0, end_step=steps)
    seen: list[int] = []
    try:
        for item in loader:
            for batch in item.micro:
                assert batch.shape == (2, MAX_LEN)
                for r in range(2):
                    ids, doc_ids = batch.input_ids[r], batch.document_ids[r]
                    numbers = docs_of_row(ids, doc_ids)
                    expected = pack_row([docs[i] for i in numbers], MAX_LEN)
                    assert ids.tolist() == expected.input_ids
                    assert batch.position_ids[r].tolist() == expected.position_ids
                    assert doc_ids.tolist() == expected.document_ids
                    assert batch.loss_mask[r].tolist() == expected.loss_mask
                    seen += numbers
    finally:
        loader.close()
        cache.close()
    # Whole steps only: the last rows_per_epoch % 4 rows of the epoch go to the next step.
    assert len(seen) == len(set(seen))
    assert len(seen) >= len(docs) - 3 * 8, "every document should appear once per epoch"


def test_world_size_and_resume_see_the_same_global_batches(tmp_path: Path, dataset) -> None:
    prefix, _ = dataset
    store = ObjectStore()
    cache = ShardCache(store, str(tmp_path / "cache"), 10 * 2**20)
    plan = make_plan(store, prefix, cache, plan_uri=str(tmp_path / "plan.json"))
    end = 2 * plan.rows_per_epoch // 4 + 1  # crosses an epoch boundary

    def run(rank: int, world: int, start: int) -> dict[tuple[int, int], list[list[int]]]:
        loader = StepLoader(plan, cache, rows_per_step=4, micro_rows=1, rank=rank, world=world, start_step=start,
                            end_step=end, prefetch_steps=2)
        try:
            return {(item.step, g): b.input_ids.tolist() for item in loader for g, b in zip(item.micro_ids, item.micro,
                                                                                            strict=True)}
        finally:
            loader.close()

    single = run(0, 1, 0)
    assert len(single) == 4 * end
    two = {**run(0, 2, 0), **run(1, 2, 0)}
    assert two == single
    resumed = run(0, 1, 5)
    assert resumed == {k: v for k, v in single.items() if k[0] >= 5}
    cache.close()


def test_other_seed_gives_another_order(tmp_path: Path, dataset) -> None:
    prefix, _ = dataset
    store = ObjectStore()
    cache = ShardCache(store, str(tmp_path / "cache"), 10 * 2**20)
    orders = []
    for seed in (0, 1):
        plan = make_plan(store, prefix, cache, seed=seed, plan_uri=str(tmp_path / f"plan{seed}.json"))
        loader = StepLoader(plan, cache, 4, 4, 0, 1, 0, 1)
        orders.append(next(iter(loader)).micro[0].input_ids.tolist())
        loader.close()
    assert orders[0] != orders[1]
    cache.close()


def test_plan_is_saved_and_reused(tmp_path: Path, dataset) -> None:
    prefix, _ = dataset
    store = ObjectStore()
    plan_uri = str(tmp_path / "plan.json")
    cache = ShardCache(store, str(tmp_path / "cache"), 10 * 2**20)
    plan = make_plan(store, prefix, cache, plan_uri=plan_uri)
    assert os.path.isfile(plan_uri)
    # The saved plan is read back without counting: an empty cache with no shard access still works.
    fresh = ShardCache(ObjectStore(), str(tmp_path / "other-cache"), 1)
    again = make_plan(store, prefix, fresh, plan_uri=plan_uri)
    assert again == plan and os.listdir(tmp_path / "other-cache") == []
    assert total_steps(plan, 4, epochs=2, max_steps=None) == 2 * plan.rows_per_epoch // 4
    assert total_steps(plan, 4, epochs=2, max_steps=7) == 7
    with pytest.raises(BadInputError, match="do not fill one step"):
        total_steps(plan, 10 * plan.rows_per_epoch, epochs=1, max_steps=None)
    cache.close()
    fresh.close()


def cached_bytes(cache_dir: Path) -> int:
    """Bytes of the shards in the cache now; the prefetch thread may evict one between listing and stat."""
    total = 0
    for f in cache_dir.glob("*.arrow"):
        with contextlib.suppress(FileNotFoundError):
            total += f.stat().st_size
    return total


def test_cache_is_bounded_on_s3_and_refuses_corrupt_shards(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    docs = unique_docs(200, seed=3)
    prefix = write_tokenized(store, join(s3_bucket, "tok"), docs, identity_of(tiny_target()), shards=8)
    shards = load_manifest(store, prefix, Kind.tokenized).manifest.shards
    biggest = max(s.bytes for s in shards)
    cache_dir = tmp_path / "cache"
    cache = ShardCache(store, str(cache_dir), max_bytes=2 * biggest)
    plan = make_plan(store, prefix, cache, plan_uri=join(s3_bucket, "plan.json"))
    loader = StepLoader(plan, cache, 2, 2, 0, 1, 0, plan.rows_per_epoch // 2)
    peak = 0
    try:
        for _ in loader:
            peak = max(peak, cached_bytes(cache_dir))
    finally:
        loader.close()
    # Budget plus the shards pinned while in use (current, next prefetched, one being read).
    assert 0 < peak <= 4 * biggest
    assert len(list(cache_dir.glob("*.arrow"))) < len(shards)
    # A shard replaced after the manifest was written is refused with its URI.
    for f in cache_dir.iterdir():
        f.unlink()
    store.write_bytes(shards[0].uri, b"x" * shards[0].bytes)
    with pytest.raises(BadInputError, match=f"{shards[0].uri} does not match"):
        cache.get(shards[0])
    cache.close()


@pytest.mark.slow
def test_loader_delivers_at_least_ten_times_what_a_step_consumes(tmp_path: Path) -> None:
    from bench.bench_train_data import REQUIRED_RATIO, measure

    rates = measure(tmp_path, docs=300, max_length=256, rows_per_step=4, loader_steps=20, train_steps=1,
                    num_anchors=8)
    assert rates.loader_tokens_per_s > 0 and rates.step_tokens_per_s > 0
    assert rates.ratio >= REQUIRED_RATIO, rates


def test_the_plan_counts_what_rows_of_max_length_read(tmp_path: Path,
                                                      dataset: tuple[str, list[tuple[list[int], list[int]]]]) -> None:
    """Documents longer than a row are cut: the plan counts the tokens and loss tokens inside the window, and a
    resumed run reads them back from plan.json (a plan.json written before they were counted gives None)."""
    prefix, docs = dataset
    store = ObjectStore()
    window = 100  # the documents run from 8 to 150 tokens
    with contextlib.closing(ShardCache(store, str(tmp_path / "cache"), 2**30)) as cache:
        plan = make_plan(store, prefix, cache, plan_uri=str(tmp_path / "plan.json"), max_length=window)
        assert plan.window is not None
        assert plan.window.tokens == sum(len(ids) for ids, _ in docs)
        assert plan.window.tokens_in_window == sum(min(len(ids), window) for ids, _ in docs) < plan.window.tokens
        assert plan.window.loss_tokens == sum(sum(mask) for _, mask in docs)
        assert plan.window.loss_tokens_in_window == sum(sum(mask[:window]) for _, mask in docs)
        again = make_plan(store, prefix, cache, plan_uri=str(tmp_path / "plan.json"), max_length=window)
        assert again.window == plan.window
        saved = json.loads(store.read_bytes(str(tmp_path / "plan.json")))
        del saved["window_tokens"]
        store.write_bytes(str(tmp_path / "plan.json"), json.dumps(saved).encode())
        older = make_plan(store, prefix, cache, plan_uri=str(tmp_path / "plan.json"), max_length=window)
        assert older.rows_per_shard == plan.rows_per_shard and older.window is None
