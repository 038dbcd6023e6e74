"""The batches of each optimizer step, in the run's data order (`dflash_train.data.plan`), packed ahead in a
background thread while the current step trains.

Step s consumes global rows [s*R, (s+1)*R) (R = rows per step); they form R/m micro-batches of m rows, and
rank r trains micro-batches r, r+world, r+2*world, ... ("every world-th packed batch").
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass

from dflash_train.data.batch import PackedBatch, pack_row, stack_rows
from dflash_train.data.plan import DataPlan, epoch_rows, epoch_shard_order
from dflash_train.data.shards import ShardCache, ShardTable


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
