"""The tokenized shards on this node: downloaded once into a bounded LRU cache (content-addressed, shared by the
ranks of a node), checked against the manifest's sha256, prefetched ahead of use, and read as flat arrays.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dflash_shared.errors import BadInputError
from dflash_shared.manifests import Shard
from dflash_shared.storage import ObjectStore

_COLUMNS = ("input_ids", "loss_mask", "length")


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
