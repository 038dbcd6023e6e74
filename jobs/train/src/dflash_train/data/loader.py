"""Training data: tokenized Arrow shards streamed from the store into packed batches, in a resumable order.

The data order is ONE global stream of packed rows, the same for every world size:

- epoch e visits the shards in a permutation drawn from (seed, e);
- inside a shard, documents are shuffled with (seed, e, shard) and packed best-fit-decreasing into rows of
  `max_length` tokens (documents longer than that are truncated); the rows are shuffled again. Because
  best-fit-decreasing depends only on the multiset of lengths, a shard yields the same number of rows in
  every epoch, so the row count of the whole run is known before training (`DataPlan`) and the LR
  schedule, the step count and the data position follow from it;
- step s consumes global rows [s*R, (s+1)*R) (R = rows per step); they form R/m micro-batches of m rows,
  and rank r trains micro-batches r, r+world, r+2*world, ... ("every world-th packed batch").

So the data position is just the number of rows consumed, a step boundary is the same place whatever the
world size, and resuming at another world size replays exactly the rows the interrupted run would have
seen. Shards are downloaded into a bounded LRU cache (content-addressed, shared by the ranks of a node),
checked against the manifest's sha256, and prefetched ahead of use; a background thread packs the batches
of the next steps while the current one trains.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_shared.errors import BadInputError
from dflash_shared.manifests import Shard
from dflash_shared.storage import ObjectStore
from dflash_train.data.batch import PackedBatch, pack_row, stack_rows

log = logging.getLogger(__name__)
# Part of the plan fingerprint: a change to packing or ordering must not resume an old run's position.
PACKING_VERSION = "bfd-1"
_COLUMNS = ("input_ids", "loss_mask", "length")


# ---------------------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class ShardTable:
    """One tokenized shard as flat arrays: tokens of document i are ids[offsets[i]:offsets[i+1]]."""

    ids: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray

    @classmethod
    def read(cls, path: str, uri: str) -> ShardTable:
        try:
            with pa.ipc.open_stream(pa.memory_map(path)) as reader:
                table = reader.read_all()
        except FileNotFoundError:
            raise  # the cache's concern (evicted meanwhile), not bad input
        except (pa.ArrowInvalid, OSError) as err:
            raise BadInputError(f"shard {uri} is not a readable Arrow IPC stream: {err}") from err
        missing = [name for name in _COLUMNS if name not in table.column_names]
        if missing:
            raise BadInputError(f"shard {uri} lacks column(s) {missing}; has {table.column_names}")

        def integer_lists(name: str) -> tuple[np.ndarray, np.ndarray]:
            """(values, offsets from 0) of a list-of-integers column without nulls; BadInputError otherwise."""
            kind = table.schema.field(name).type
            if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not (
                    pa.types.is_integer(kind.value_type) or pa.types.is_boolean(kind.value_type)):
                raise BadInputError(f"shard {uri}: column {name} is {kind}, not a list of integers")
            column = table.column(name).combine_chunks()
            values = column.flatten()  # honours a sliced array's offset, unlike .values
            if column.null_count or values.null_count:
                raise BadInputError(f"shard {uri}: column {name} holds nulls")
            offsets = column.offsets.to_numpy().astype(np.int64) if len(column) else np.zeros(1, np.int64)
            return values.to_numpy(zero_copy_only=False), offsets - offsets[0]

        # Any failure decoding the rows is the shard's: bad input (exit 65), never a crash a retry repeats.
        try:
            ids, offsets = integer_lists("input_ids")
            mask, mask_offsets = integer_lists("loss_mask")
            if not np.array_equal(offsets, mask_offsets):
                raise BadInputError(f"shard {uri}: input_ids and loss_mask rows differ in length")
            lengths = np.diff(offsets)
            if not np.array_equal(table.column("length").to_numpy(zero_copy_only=False), lengths):
                raise BadInputError(f"shard {uri}: its length column disagrees with the input_ids rows")
            if ids.size and ids.min() < 0:
                raise BadInputError(f"shard {uri}: input_ids holds a negative token id ({ids.min()})")
            if mask.size and (mask.min() < 0 or mask.max() > 1):
                raise BadInputError(f"shard {uri}: loss_mask holds values other than 0 and 1")
        except (BadInputError, MemoryError):
            raise
        except Exception as err:
            raise BadInputError(f"shard {uri}: rows cannot be decoded ({type(err).__name__}: {err})") from err
        return cls(ids=ids, mask=mask, offsets=offsets, lengths=lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def document(self, i: int) -> tuple[list[int], list[int]]:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[start:end].tolist(), self.mask[start:end].tolist()


class ShardCache:
    """Downloads shards into `directory` (named by sha256), verifies them, and keeps at most `max_bytes`.

    Least recently used files are evicted first; files this process still uses are never evicted. The
    directory may be shared by the ranks of a node: placement is an atomic rename of a verified file.
    """

    def __init__(self, store: ObjectStore, directory: str, max_bytes: int, verify: bool = True,
                 workers: int = 2) -> None:
        self.store, self.directory, self.max_bytes, self.verify = store, directory, max_bytes, verify
        os.makedirs(directory, exist_ok=True)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard-fetch")
        self._pending: dict[str, tuple[Shard, Future[str]]] = {}
        self._pinned: set[str] = set()
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()

    def local_path(self, shard: Shard) -> str:
        return os.path.join(self.directory, f"{shard.sha256[:32]}.arrow")

    def _fetch(self, shard: Shard) -> str:
        path = self.local_path(shard)
        if os.path.isfile(path) and os.path.getsize(path) == shard.bytes:
            os.utime(path)  # most recently used
            return path
        partial = f"{path}.partial-{os.getpid()}-{threading.get_ident()}"
        try:
            self.store.download_to(shard.uri, partial)
            size = os.path.getsize(partial)
            digest = self.store.sha256(partial) if self.verify else shard.sha256
            if (size, digest) != (shard.bytes, shard.sha256):
                raise BadInputError(
                    f"shard {shard.uri} does not match the tokenized manifest: {size} bytes sha256 {digest}, "
                    f"expected {shard.bytes} bytes sha256 {shard.sha256}"
                )
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        self._evict(keep=path)
        return path

    def prefetch(self, shard: Shard) -> None:
        with self._lock:
            if shard.uri not in self._pending:
                self._pending[shard.uri] = (shard, self._pool.submit(self._fetch, shard))

    def get(self, shard: Shard) -> str:
        """Local path of the verified shard (downloaded now unless prefetched); pinned until `release`."""
        self.prefetch(shard)
        with self._lock:
            future = self._pending[shard.uri][1]
        try:
            path = future.result()
        except BaseException:
            with self._lock:
                self._pending.pop(shard.uri, None)
            raise
        with self._lock:
            # Pinned before it stops being pending: no moment in which an eviction may take it.
            self._pinned.add(path)
            self._pending.pop(shard.uri, None)
        return path

    def read(self, shard: Shard) -> ShardTable:
        """The shard's table (pinned until `release`). Another rank of the node evicting the file between
        download and open costs one more download."""
        for attempt in range(3):
            path = self.get(shard)
            try:
                return ShardTable.read(path, shard.uri)
            except FileNotFoundError:
                self.release(shard)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def release(self, shard: Shard) -> None:
        with self._lock:
            self._pinned.discard(self.local_path(shard))

    def _evict(self, keep: str) -> None:
        with self._evict_lock:
            with self._lock:
                # Prefetched files wait to be used: evicting them would only mean downloading them again.
                pinned = self._pinned | {keep} | {self.local_path(s) for s, _ in self._pending.values()}
            files = []
            for name in os.listdir(self.directory):
                path = os.path.join(self.directory, name)
                try:
                    stat = os.stat(path)
                except FileNotFoundError:  # evicted meanwhile by another rank of the node
                    continue
                if name.endswith(".arrow"):
                    files.append((stat.st_mtime, stat.st_size, path))
            total = sum(size for _, size, _ in files)
            for _, size, path in sorted(files):
                if total <= self.max_bytes:
                    break
                if path not in pinned:
                    # An open memory map survives the unlink; only a later reader downloads again.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    total -= size

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------------------- packing


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


def count_rows(cache: ShardCache, shard: Shard, max_length: int) -> tuple[int, WindowTokens]:
    """Packed rows of one shard and what they read of it (downloads it; the file stays in the cache for the
    first epoch)."""
    table = cache.read(shard)
    try:
        return len(best_fit_rows(table.lengths, max_length)), WindowTokens.of_table(table, max_length)
    finally:
        cache.release(shard)


# ---------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class StepBatches:
    """This rank's micro-batches of one optimizer step; `rows_after` is the number of rows consumed after it and
    `position` the data position there, as a checkpoint of that step stores it (`DataPlan.position`)."""

    step: int
    micro: list[PackedBatch]
    micro_ids: list[int]
    rows_after: int
    position: dict[str, int]


class StepLoader:
    """Yields `StepBatches` for steps start_step..end_step-1, packed ahead in a background thread."""

    def __init__(self, plan: DataPlan, cache: ShardCache, rows_per_step: int, micro_rows: int, rank: int,
                 world: int, start_step: int, end_step: int, prefetch_steps: int = 4, pin_memory: bool = False,
                 pad_token_id: int = 0) -> None:
        if rows_per_step % (micro_rows * world):
            raise ValueError(
                f"rows per step {rows_per_step} is not a multiple of micro_batch_rows {micro_rows} x world "
                f"size {world}"
            )
        self.plan, self.cache = plan, cache
        self.rows_per_step, self.micro_rows, self.rank, self.world = rows_per_step, micro_rows, rank, world
        self.start_step, self.end_step = start_step, end_step
        self.pin_memory, self.pad_token_id = pin_memory, pad_token_id
        self._tables: OrderedDict[int, ShardTable] = OrderedDict()
        self._rows: dict[tuple[int, int], list[list[int]]] = {}
        self._queue: queue.Queue[StepBatches | BaseException | None] = queue.Queue(maxsize=prefetch_steps)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- row materialisation

    def _table(self, shard_index: int) -> ShardTable:
        if shard_index not in self._tables:
            self._tables[shard_index] = self.cache.read(self.plan.shards[shard_index])
            # A step's rows span at most a few shards; older tables are dropped (and unpinned).
            while len(self._tables) > 2:
                old, _ = self._tables.popitem(last=False)
                self.cache.release(self.plan.shards[old])
                self._rows = {k: v for k, v in self._rows.items() if k[1] != old}
        self._tables.move_to_end(shard_index)
        return self._tables[shard_index]

    def row_documents(self, row: int) -> tuple[int, list[int]]:
        """(shard index, document indices) of global row `row`."""
        epoch, pos, in_shard = self.plan.locate(row)
        order = epoch_shard_order(len(self.plan.shards), self.plan.seed, epoch)
        shard_index = int(order[pos])
        if pos + 1 < len(order):
            self.cache.prefetch(self.plan.shards[int(order[pos + 1])])
        key = (epoch, shard_index)
        if key not in self._rows:
            table = self._table(shard_index)
            self._rows[key] = epoch_rows(table.lengths, self.plan.max_length, self.plan.seed, epoch, shard_index)
        return shard_index, self._rows[key][in_shard]

    def micro_batch(self, first_row: int) -> PackedBatch:
        rows = []
        for row in range(first_row, first_row + self.micro_rows):
            shard_index, docs = self.row_documents(row)
            table = self._table(shard_index)
            rows.append(pack_row([table.document(d) for d in docs], self.plan.max_length, self.pad_token_id))
        batch = stack_rows(rows)
        return batch.pin_memory() if self.pin_memory else batch

    def build(self, step: int) -> StepBatches:
        first = step * self.rows_per_step
        groups = self.rows_per_step // self.micro_rows
        mine = list(range(self.rank, groups, self.world))
        micro = [self.micro_batch(first + g * self.micro_rows) for g in mine]
        after = first + self.rows_per_step
        return StepBatches(step, micro, mine, after, self.plan.position(after))

    # -------------------------------------------------------------- background thread

    def _work(self) -> None:
        try:
            for step in range(self.start_step, self.end_step):
                item = self.build(step)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(None)
        except BaseException as err:  # handed to the consumer, which re-raises it in the main thread
            self._queue.put(err)

    def __iter__(self) -> StepLoader:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="step-loader", daemon=True)
            self._thread.start()
        return self

    def __next__(self) -> StepBatches:
        item = self._queue.get()
        if item is None:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.1)
                except queue.Empty:
                    pass
            self._thread = None
        for shard_index in self._tables:
            self.cache.release(self.plan.shards[shard_index])
        self._tables.clear()


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
        rows, counted = count_rows(cache, shards[i], max_length)
        mine[i] = [rows, *counted.as_list()]
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
