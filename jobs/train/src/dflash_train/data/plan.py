"""The data order of a run: ONE global stream of packed rows, the same for every world size.

- epoch e visits the shards in a permutation drawn from (seed, e);
- inside a shard, documents are shuffled with (seed, e, shard) and packed best-fit-decreasing into rows of
  `max_length` tokens (documents longer than that are truncated); the rows are shuffled again. Because
  best-fit-decreasing depends only on the multiset of lengths, a shard yields the same number of rows in
  every epoch, so the row count of the whole run is known before training (`DataPlan`, counted once by the
  ranks together and saved beside the checkpoints) and the LR schedule, the step count and the data position
  follow from it;
- step s consumes global rows [s*R, (s+1)*R) (R = rows per step); `dflash_train.data.loader` builds them.

So the data position is just the number of rows consumed, a step boundary is the same place whatever the
world size, and resuming at another world size replays exactly the rows the interrupted run would have
seen.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_shared.errors import BadInputError
from dflash_shared.manifests import Shard
from dflash_shared.storage import ObjectStore
from dflash_train.data.shards import ShardCache, ShardTable

log = logging.getLogger(__name__)
# Part of the plan fingerprint: a change to packing or ordering must not resume an old run's position.
PACKING_VERSION = "bfd-1"


def best_fit_rows(lengths: np.ndarray, max_length: int) -> list[list[int]]:
    """Document indices grouped into rows of at most `max_length` tokens, best-fit decreasing.

    Longest document first (ties in the given order), each into the open row with the least room that
    still holds it. Documents longer than a row are counted as `max_length` (they are truncated).
    """
    clipped = np.minimum(np.asarray(lengths, dtype=np.int64), max_length)
    order = np.argsort(-clipped, kind="stable")
    caps: list[int] = []  # remaining room of open rows, ascending
    owners: list[int] = []  # row of each entry of caps
    rows: list[list[int]] = []
    for i, n in zip(order.tolist(), clipped[order].tolist(), strict=True):
        if n <= 0:
            continue
        k = bisect.bisect_left(caps, n)
        if k < len(caps):
            row, room = owners.pop(k), caps.pop(k) - n
            rows[row].append(i)
        else:
            row, room = len(rows), max_length - n
            rows.append([i])
        if room > 0:
            k = bisect.bisect_left(caps, room)
            caps.insert(k, room)
            owners.insert(k, row)
    return rows


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([abs(int(k)) for k in key])


def epoch_shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    return _rng(seed, epoch, 0).permutation(num_shards)


def epoch_rows(lengths: np.ndarray, max_length: int, seed: int, epoch: int, shard_index: int) -> list[list[int]]:
    """The rows of one shard in one epoch: documents shuffled, packed, rows shuffled (all from the seed)."""
    perm = _rng(seed, epoch, 1, shard_index).permutation(len(lengths))
    rows = [[int(perm[j]) for j in row] for row in best_fit_rows(lengths[perm], max_length)]
    return [rows[k] for k in _rng(seed, epoch, 2, shard_index).permutation(len(rows))]


@dataclass(frozen=True)
class WindowTokens:
    """Tokens of the data and the share rows of `max_length` read of them (documents longer are cut)."""

    tokens: int = 0
    tokens_in_window: int = 0
    loss_tokens: int = 0
    loss_tokens_in_window: int = 0

    def __add__(self, other: WindowTokens) -> WindowTokens:
        return WindowTokens(*(a + b for a, b in zip(self.as_list(), other.as_list(), strict=True)))

    def as_list(self) -> list[int]:
        return [self.tokens, self.tokens_in_window, self.loss_tokens, self.loss_tokens_in_window]

    @classmethod
    def of_table(cls, table: ShardTable, max_length: int) -> WindowTokens:
        """Counted from a shard's arrays: one cumulative sum of the mask, no loop over documents."""
        starts = table.offsets[:-1]
        ends = np.minimum(table.offsets[1:], starts + max_length)
        running = np.concatenate((np.zeros(1, np.int64), np.cumsum(table.mask, dtype=np.int64)))
        return cls(tokens=int(table.lengths.sum()), tokens_in_window=int((ends - starts).sum()),
                   loss_tokens=int(running[-1]), loss_tokens_in_window=int((running[ends] - running[starts]).sum()))


@dataclass(frozen=True)
class DataPlan:
    """Rows per shard (the same in every epoch) and what identifies the data order they belong to."""

    shards: tuple[Shard, ...]
    rows_per_shard: tuple[int, ...]
    max_length: int
    seed: int
    fingerprint: str
    # What the rows read of the data per epoch; None for a plan saved before it was counted (a resumed run).
    window: WindowTokens | None = None

    @staticmethod
    def make_fingerprint(manifest_sha256: str, max_length: int, seed: int) -> str:
        return hashlib.sha256(f"{manifest_sha256}|{max_length}|{seed}|{PACKING_VERSION}".encode()).hexdigest()[:24]

    @property
    def rows_per_epoch(self) -> int:
        return sum(self.rows_per_shard)

    def locate(self, row: int) -> tuple[int, int, int]:
        """(epoch, shard position in that epoch's order, row inside the shard) of global row `row`."""
        epoch, rest = divmod(row, self.rows_per_epoch)
        order = epoch_shard_order(len(self.shards), self.seed, epoch)
        ends = np.cumsum([self.rows_per_shard[i] for i in order])
        pos = int(np.searchsorted(ends, rest, side="right"))
        start = int(ends[pos - 1]) if pos else 0
        return epoch, pos, rest - start

    def position(self, consumed_rows: int) -> dict[str, int]:
        """The data position after `consumed_rows` rows, as stored in a checkpoint."""
        epoch, pos, row = self.locate(consumed_rows)
        return {"consumed_rows": consumed_rows, "epoch": epoch, "shard_position": pos, "row_in_shard": row}


def total_steps(plan: DataPlan, rows_per_step: int, epochs: int, max_steps: int | None) -> int:
    """Steps of the run: `max_steps`, else as many whole steps as `epochs` passes over the data hold."""
    if max_steps is not None:
        return max_steps
    steps = epochs * plan.rows_per_epoch // rows_per_step
    if steps < 1:
        raise BadInputError(
            f"the data packs into {plan.rows_per_epoch} rows of {plan.max_length} tokens per epoch; "
            f"{epochs} epoch(s) do not fill one step of {rows_per_step} rows (lower batch_tokens)"
        )
    return steps


def build_plan(
    store: ObjectStore,
    plan_uri: str,
    shards: Sequence[Shard],
    manifest_sha256: str,
    cache: ShardCache,
    max_length: int,
    seed: int,
    rank: int,
    world: int,
    gather: Callable[[Any], list[Any]],
) -> DataPlan:
    """The run's DataPlan: read from `plan_uri` when a previous attempt wrote it, else counted and saved.

    Counting downloads every shard once; rank r counts shards r, r+world, ... and `gather` (an
    all_gather_object) shares the counts, so the ranks split the work.
    """
    fingerprint = DataPlan.make_fingerprint(manifest_sha256, max_length, seed)
    if store.exists(plan_uri):
        saved = json.loads(store.read_bytes(plan_uri))
        if saved.get("fingerprint") == fingerprint and len(saved.get("rows_per_shard", [])) == len(shards):
            rows = tuple(int(n) for n in saved["rows_per_shard"])
            window = WindowTokens(*saved["window_tokens"]) if "window_tokens" in saved else None
            return DataPlan(tuple(shards), rows, max_length, seed, fingerprint, window)
        log.warning("ignoring %s: made for other data or settings (fingerprint %s, now %s)", plan_uri,
                    saved.get("fingerprint"), fingerprint)
    # Plain lists cross the gather (an all_gather_object), not dataclasses: [rows, *WindowTokens].
    mine: dict[int, list[int]] = {}
    for i in range(rank, len(shards), world):
        table = cache.read(shards[i])  # the file stays in the cache for the first epoch
        try:
            rows = len(best_fit_rows(table.lengths, max_length))
            mine[i] = [rows, *WindowTokens.of_table(table, max_length).as_list()]
        finally:
            cache.release(shards[i])
    counts: dict[int, list[int]] = {}
    for part in gather(mine):
        counts.update({int(k): [int(n) for n in v] for k, v in part.items()})
    window = sum((WindowTokens(*counts[i][1:]) for i in range(len(shards))), WindowTokens())
    plan = DataPlan(tuple(shards), tuple(counts[i][0] for i in range(len(shards))), max_length, seed, fingerprint,
                    window)
    if rank == 0:
        body = {"fingerprint": fingerprint, "max_length": max_length, "seed": seed, "packing": PACKING_VERSION,
                "rows_per_shard": list(plan.rows_per_shard), "shards": [s.uri for s in shards],
                "window_tokens": window.as_list()}
        store.write_bytes(plan_uri, json.dumps(body, indent=1).encode())
    log.info("data plan: %d shards, %d rows of %d tokens per epoch; the rows read %d of %d tokens (%d of %d loss "
             "tokens, %.1f%%)", len(shards), plan.rows_per_epoch, max_length, window.tokens_in_window, window.tokens,
             window.loss_tokens_in_window, window.loss_tokens,
             100 * window.loss_tokens_in_window / max(window.loss_tokens, 1))
    return plan
