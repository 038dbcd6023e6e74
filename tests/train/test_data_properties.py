"""The trainer's shard decoder under hostile Arrow files (hypothesis): the documents, or BadInputError.

A tokenized shard is checked against its manifest's sha256 before it is read, so a bad one was written bad
(a hand-made shard, another tool's, a bug). `ShardTable.read` must then say so (exit 65) instead of
crashing the packer or the embedding later: columns of any list or scalar type, nulls, negative ids, masks
past 0/1, row lengths that disagree, sliced and chunked arrays, files that are not Arrow at all.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash_shared.errors import BadInputError
from dflash_train.data.shards import ShardTable
from tests.support.noise import PROPERTY

_LIST_TYPES = [pa.list_(pa.int32()), pa.large_list(pa.int64()), pa.list_(pa.int8()), pa.list_(pa.uint16()),
               pa.list_(pa.bool_()), pa.list_(pa.float32()), pa.list_(pa.string()), pa.int32(), pa.string()]


def _values(kind: pa.DataType) -> st.SearchStrategy[Any]:
    """Values of an Arrow type (None included), mostly small non-negative integers for integer lists."""
    item = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else kind
    if pa.types.is_boolean(item):
        scalar: st.SearchStrategy[Any] = st.booleans()
    elif pa.types.is_integer(item):
        info = np.iinfo(item.to_pandas_dtype())
        scalar = st.one_of(st.integers(0, min(info.max, 151_000)), st.integers(int(info.min), int(info.max)))
    elif pa.types.is_floating(item):
        scalar = st.floats(width=32)
    else:
        scalar = st.text(max_size=3)
    scalar = st.one_of(scalar, scalar, scalar, st.none())
    if item is kind:
        return scalar
    return st.one_of(st.lists(scalar, max_size=5), st.lists(scalar, max_size=5), st.none())


@st.composite
def shard_tables(draw: st.DrawFn) -> tuple[pa.Table, bool]:
    """(table, whether it is a valid shard): often the tokenize stage's own schema and values, else anything."""
    rows = draw(st.integers(0, 5))
    valid = draw(st.booleans())
    if valid:
        ids = draw(st.lists(st.lists(st.integers(0, 151_000), max_size=6), min_size=rows, max_size=rows))
        masks = [draw(st.lists(st.integers(0, 1), min_size=len(d), max_size=len(d))) for d in ids]
        columns = {"input_ids": pa.array(ids, pa.list_(pa.int32())), "loss_mask": pa.array(masks, pa.list_(pa.int8())),
                   "length": pa.array([len(d) for d in ids], pa.int32())}
    else:
        columns = {}
        for name in ("input_ids", "loss_mask"):
            kind = draw(st.sampled_from(_LIST_TYPES))
            columns[name] = pa.array(draw(st.lists(_values(kind), min_size=rows, max_size=rows)), kind)
        lengths = [len(v) if v is not None else 0 for v in columns["input_ids"].to_pylist()] \
            if pa.types.is_list(columns["input_ids"].type) or pa.types.is_large_list(columns["input_ids"].type) \
            else [0] * rows
        columns["length"] = pa.array(draw(st.one_of(st.just(lengths), st.lists(
            st.one_of(st.none(), st.integers(-2, 9)), min_size=rows, max_size=rows))), pa.int32())
        for name in draw(st.lists(st.sampled_from(sorted(columns)), max_size=1)):
            del columns[name]
    table = pa.table(columns)
    if rows and draw(st.booleans()):  # a sliced table and several record batches, as other writers make them
        start = draw(st.integers(0, rows))
        table = pa.concat_tables([table.slice(0, start), table.slice(start)])
    return table, valid


def _write(table: pa.Table, path: str) -> None:
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2) or [pa.RecordBatch.from_pylist([], table.schema)]:
            writer.write_batch(batch)


@PROPERTY
@given(source=shard_tables())
def test_a_shard_decodes_to_its_documents_or_is_bad_input(source: tuple[pa.Table, bool]) -> None:
    table, valid = source
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "shard.arrow")
        _write(table, path)
        try:
            shard = ShardTable.read(path, "s3://b/shard.arrow")
        except BadInputError as err:
            assert not valid, err
            assert "s3://b/shard.arrow" in str(err)
            return
    offsets = shard.offsets
    assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0) and offsets[-1] == shard.ids.size == shard.mask.size
    assert (shard.ids >= 0).all() and np.isin(shard.mask, (0, 1)).all()
    assert len(shard) == table.num_rows
    documents = [shard.document(i) for i in range(len(shard))]
    if valid:
        assert documents == list(zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist(),
                                     strict=True))


@pytest.mark.parametrize("data", [b"", b"not arrow at all", b"\xff\xff\xff\xff\x00\x00\x00\x00garbage"])
def test_a_file_that_is_not_an_arrow_stream_is_bad_input(tmp_path: Any, data: bytes) -> None:
    path = tmp_path / "shard.arrow"
    path.write_bytes(data)
    with pytest.raises(BadInputError, match="shard s3://b/x.arrow"):
        ShardTable.read(str(path), "s3://b/x.arrow")
