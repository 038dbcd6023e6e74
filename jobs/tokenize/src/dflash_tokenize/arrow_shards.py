"""Tokenized Arrow shards: what the trainer streams.

Each shard is an Arrow IPC *stream* file, the format `datasets.Dataset.from_file` memory-maps, and which
`pyarrow.ipc.open_stream` reads directly. Files roll over at a target size (100-500 MB by default) so the
trainer can stream and cache them one at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa

SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("length", pa.int32(), nullable=False),
        pa.field("loss_tokens", pa.int32(), nullable=False),
        # The conversation's id in the user's own data (null when it had none): joins rows back to it.
        pa.field("source_id", pa.string(), nullable=True),
    ],
    metadata={b"dflash.format": b"tokenized.v1"},
)


@dataclass
class Sequences:
    """A batch of tokenized sequences as flat arrays plus offsets (no per-token Python objects)."""

    ids: list[str]
    input_ids: np.ndarray  # int32, all sequences concatenated
    loss_mask: np.ndarray  # int8, same length
    offsets: np.ndarray  # int64, len(ids) + 1
    source_ids: list[str | None] | None = None  # the records' source_id, in order; None: all null

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int32)

    def loss_tokens(self) -> np.ndarray:
        cumulative = np.concatenate([[0], np.cumsum(self.loss_mask, dtype=np.int64)])
        return (cumulative[self.offsets[1:]] - cumulative[self.offsets[:-1]]).astype(np.int32)

    def take(self, rows: np.ndarray) -> Sequences:
        """The sequences at `rows`, in that order; every per-record field (a list or array of one value per
        sequence) is selected alike, the per-token arrays are gathered by their offsets."""
        rows = np.asarray(rows, dtype=np.int64)
        starts, lengths = self.offsets[rows], self.offsets[rows + 1] - self.offsets[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # Token k of the result comes from position starts[row] + (k - offsets[row]) of this batch.
        tokens = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        selected: dict[str, object] = {"input_ids": self.input_ids[tokens], "loss_mask": self.loss_mask[tokens],
                                       "offsets": offsets}
        for field in fields(self):
            if field.name not in selected:
                value = getattr(self, field.name)
                if value is not None:  # an optional column left unset stays unset
                    value = [value[i] for i in rows] if isinstance(value, list) else value[rows]
                selected[field.name] = value
        return Sequences(**selected)  # type: ignore[arg-type]

    def to_record_batch(self) -> pa.RecordBatch:
        offsets = _numeric(self.offsets, pa.int32())
        return pa.RecordBatch.from_arrays(
            [
                _strings(self.ids),
                pa.ListArray.from_arrays(offsets, _numeric(self.input_ids, pa.int32())),
                pa.ListArray.from_arrays(offsets, _numeric(self.loss_mask, pa.int8())),
                _numeric(self.lengths, pa.int32()),
                _numeric(self.loss_tokens(), pa.int32()),
                _strings(self.source_ids if self.source_ids is not None else [None] * len(self.ids)),
            ],
            schema=SCHEMA,
        )


def _strings(values: Sequence[str | None]) -> pa.Array:
    """A string array built from buffers (pa.array() would import pandas); None items become nulls."""
    encoded = [b"" if value is None else value.encode("utf-8") for value in values]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    data = pa.py_buffer(b"".join(encoded))
    valid = np.fromiter((value is not None for value in values), dtype=bool, count=len(values))
    nulls = len(values) - int(valid.sum())
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    return pa.Array.from_buffers(pa.string(), len(encoded), [bitmap, pa.py_buffer(offsets), data], null_count=nulls)


_NUMPY_TYPES = {pa.int32(): np.int32, pa.int8(): np.int8}


def _numeric(values: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    """Zero-copy numpy -> Arrow (pa.array() would also import pandas when it is installed: seconds)."""
    array = np.ascontiguousarray(values, dtype=_NUMPY_TYPES[arrow_type])
    return pa.Array.from_buffers(arrow_type, len(array), [None, pa.py_buffer(array)])


@dataclass
class FinishedFile:
    path: str
    records: int
    tokens: int
    loss_tokens: int


class RollingArrowWriter:
    """Writes record batches into numbered local files, closing one when it passes `target_bytes`.

    `on_finished` gets each closed file (the stage publishes it to the store and deletes it), so local
    disk holds at most one shard at a time whatever the input size.
    """

    def __init__(
        self, directory: str, name_for: Callable[[int], str], target_bytes: int,
        on_finished: Callable[[FinishedFile], None], first_part: int = 0,
    ) -> None:
        self._directory = directory
        self._name_for = name_for
        self._target_bytes = target_bytes
        self._on_finished = on_finished
        self._part = first_part  # a resumed shard continues after the files it reuses
        self._sink: pa.NativeFile | None = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._current: FinishedFile | None = None

    def write(self, batch: Sequences) -> None:
        if not len(batch):
            return
        if self._writer is None:
            path = os.path.join(self._directory, self._name_for(self._part))
            self._sink = pa.OSFile(path, "wb")
            self._writer = pa.ipc.new_stream(self._sink, SCHEMA)
            self._current = FinishedFile(path, 0, 0, 0)
        assert self._current is not None and self._sink is not None
        self._writer.write_batch(batch.to_record_batch())
        self._current.records += len(batch)
        self._current.tokens += int(batch.offsets[-1] - batch.offsets[0])
        self._current.loss_tokens += int(batch.loss_mask.sum(dtype=np.int64))
        if self._sink.tell() >= self._target_bytes:
            self.close_current()

    def close_current(self) -> None:
        if self._writer is None:
            return
        assert self._current is not None and self._sink is not None
        self._writer.close()
        self._sink.close()
        finished, self._writer, self._sink, self._current = self._current, None, None, None
        self._part += 1
        self._on_finished(finished)


def read_shard(path_or_buffer: str | pa.Buffer) -> pa.Table:
    """Read one shard back (used by tests and the trainer's loader)."""
    source = pa.memory_map(path_or_buffer) if isinstance(path_or_buffer, str) else pa.BufferReader(path_or_buffer)
    with pa.ipc.open_stream(source) as reader:
        return reader.read_all()
