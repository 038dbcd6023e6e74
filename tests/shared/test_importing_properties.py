"""`import` under hostile input (hypothesis): every line is counted, no line crashes it, valid records survive.

Lines come from tests.support.noise: conversation records wrong at every level, damaged bytes, lone
surrogates, deep nesting, numbers no parser keeps. Each example is a whole `run_import` on a local store, so
what is checked is what a user gets: a manifest whose accounting balances (input = succeeded + failed +
skipped, one input per non-blank line), each valid record written exactly once, every line written readable
by the tokenize stage's parser, every example printable. Files that break part-way (truncated zstd/gzip)
keep the records before the break; a storage failure stays a storage failure.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import io
import json
import tempfile
from collections.abc import Iterator
from typing import Any, BinaryIO

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_shared.conversations import RecordError
from dflash_shared.errors import exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.importing import ImportSpec, _convert, run_import
from dflash_shared.jsonl import LineError, decode_line, encode_line, iter_lines
from dflash_shared.layouts import Layout
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Accounting, Kind, Producer
from dflash_shared.records import CompletionRecord, PromptRecord
from dflash_shared.storage import ObjectStore, StorageError, join
from tests.support.noise import (
    PROPERTY,
    known_crashers,
    no_fsync,  # noqa: F401 - the fixture pytestmark asks for
    noisy_lines,
    valid_record,
    with_crashers,
)

PRODUCER = Producer(stage="import")
VALID = 3
# A whole import per example (a run, its markers, its manifest) costs tens of milliseconds: fewer examples
# end to end, more on the per-line path below.
END_TO_END = settings(PROPERTY, max_examples=60)


pytestmark = pytest.mark.usefixtures("no_fsync")


def compress(data: bytes, codec: str | None) -> bytes:
    if codec is None:
        return data
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, codec) as stream:
        stream.write(data)
    return sink.getvalue().to_pybytes()


def import_files(files: dict[str, bytes], kind: Kind = Kind.completions,
                 store: ObjectStore | None = None) -> tuple[Accounting, list[bytes], str]:
    """Run the import over `files` in a fresh temp dir: (accounting, lines written, source prefix)."""
    store = store or ObjectStore()
    with tempfile.TemporaryDirectory() as root:
        source = join(root, "src")
        for name, data in files.items():
            store.write_bytes(join(source, name), data)
        out = join(root, "out")
        spec = ImportSpec(kind=kind, source_prefix=source, output_prefix=out, run_id="r", max_bad_fraction=1.0)
        assert run_import(store, spec, PRODUCER) is not None
        manifest = load_manifest(store, out, kind).manifest
        written = [line for shard in manifest.shards for _, line in iter_lines(store, shard.uri)]
        return manifest.accounting, written, source


def check_accounting(acc: Accounting, lines: int) -> None:
    assert acc.input_records == lines == acc.succeeded + acc.failed + acc.skipped
    assert sum(acc.failures_by_reason.values()) == acc.failed and sum(acc.skips_by_reason.values()) == acc.skipped
    for examples in acc.examples.values():
        assert all(example.isprintable() and len(example) <= 500 for example in examples), examples


def check_written(written: list[bytes], kind: Kind) -> None:
    """What import writes, the next stage reads: orjson (no surrogates, NaN or huge ints) and the record model."""
    model = CompletionRecord if kind is Kind.completions else PromptRecord
    for line in written:
        model.model_validate(orjson.loads(line))


def marker_counts(written: list[bytes]) -> list[int]:
    return [sum(f"⟦valid {k}⟧".encode() in line for line in written) for k in range(VALID)]


@st.composite
def jsonl_sources(draw: st.DrawFn) -> tuple[bytes, int]:
    """(file bytes, the non-blank line count): noise with the valid records spliced in at drawn places."""
    lines = draw(st.lists(noisy_lines(), max_size=8))
    for k in range(VALID):
        lines.insert(draw(st.integers(0, len(lines))), json.dumps(valid_record(k), ensure_ascii=k % 2 == 0).encode())
    data = b"\n".join(lines) + draw(st.sampled_from([b"\n", b"", b"\r\n"]))
    return data, sum(1 for line in data.split(b"\n") if line.strip())


@END_TO_END
@given(source=jsonl_sources(), codec=st.sampled_from([None, "zstd", "gzip"]),
       kind=st.sampled_from([Kind.completions, Kind.prompts]))
def test_every_jsonl_line_is_counted_and_every_valid_record_kept(source: tuple[bytes, int], codec: str | None,
                                                                 kind: Kind) -> None:
    data, lines = source
    suffix = {None: ".jsonl", "zstd": ".jsonl.zst", "gzip": ".jsonl.gz"}[codec]
    acc, written, _ = import_files({f"a{suffix}": compress(data, codec)}, kind)
    check_accounting(acc, lines)
    check_written(written, kind)
    assert marker_counts(written) == [1] * VALID
    assert "unreadable_file" not in acc.failures_by_reason


@settings(PROPERTY, max_examples=200)
@with_crashers(valid_record(0), kind=Kind.completions)
@given(line=noisy_lines(), kind=st.sampled_from([Kind.completions, Kind.prompts]))
def test_a_line_is_a_record_or_a_reason_never_an_exception(line: bytes, kind: Kind) -> None:
    """The per-line path alone, at more examples: decode, convert, encode as process_import does."""
    try:
        record = _convert(decode_line(line), "a.jsonl:1", kind, Layout())
        written = encode_line(record.model_dump(mode="json", exclude_none=True))
    except LineError as err:
        assert str(err).isprintable()
        return
    except RecordError as err:
        assert err.reason and str(err).isprintable()
        return
    check_written([written], kind)


@pytest.mark.parametrize("crasher", known_crashers(valid_record(VALID)), ids=range(10))
def test_each_known_crasher_is_one_malformed_record(crasher: bytes) -> None:
    """The lines that made `import` exit 1 (retryable) before: now one malformed record each, beside valid ones."""
    lines = [json.dumps(valid_record(k)).encode() for k in range(VALID)]
    acc, written, source = import_files({"a.jsonl": b"\n".join([lines[0], crasher, *lines[1:]]) + b"\n"})
    assert (acc.input_records, acc.succeeded, acc.failures_by_reason) == (VALID + 1, VALID, {"malformed_record": 1})
    (example,) = acc.examples["malformed_record"]
    assert example.startswith(f"{join(source, 'a.jsonl')}:2: ") and example.isprintable() and len(example) < 400
    assert marker_counts(written) == [1] * VALID


# ------------------------------------------------------------------------------------------- Parquet

# Columns of every Arrow type a user's file may hold beside the conversation, with values for them.
_EXTRA_COLUMNS: dict[str, tuple[pa.DataType, st.SearchStrategy[Any]]] = {
    "binary": (pa.binary(), st.binary(max_size=6)),
    "decimal": (pa.decimal128(9, 2), st.decimals(min_value=-1000, max_value=1000, places=2, allow_nan=False)),
    "timestamp": (pa.timestamp("us"), st.datetimes()),
    "date": (pa.date32(), st.dates()),
    "duration": (pa.duration("s"), st.timedeltas(min_value=datetime.timedelta(0),
                                                 max_value=datetime.timedelta(days=9))),
    "float": (pa.float64(), st.floats()),
    "uint64": (pa.uint64(), st.integers(0, 2**64 - 1)),
    "map": (pa.map_(pa.string(), pa.int64()), st.lists(st.tuples(st.text(max_size=3), st.integers(0, 9)),
                                                        max_size=2)),
    "list": (pa.list_(pa.float32()), st.lists(st.floats(width=32), max_size=3)),
}
_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
_arrow_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
_odd_messages = st.lists(st.fixed_dictionaries({"role": st.one_of(st.none(), _arrow_text),
                                                "content": st.one_of(st.none(), _arrow_text)}), max_size=3)


def _valid_messages(k: int) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in valid_record(k)["messages"]]


@st.composite
def parquet_sources(draw: st.DrawFn) -> tuple[bytes, int, list[int]]:
    """(Parquet bytes, rows, each valid record's expected count): valid and odd conversations, extra columns of
    any type, perhaps a row whose string is not UTF-8 (pyarrow refuses its whole batch), small row groups."""
    messages: list[Any] = draw(st.lists(st.one_of(st.none(), _odd_messages), max_size=6))
    labels: list[int | None] = [None] * len(messages)
    for k in range(VALID):
        at = draw(st.integers(0, len(messages)))
        messages.insert(at, _valid_messages(k))
        labels.insert(at, k)
    columns = {"messages": pa.array(messages, pa.list_(_MESSAGE))}
    for name in draw(st.lists(st.sampled_from(sorted(_EXTRA_COLUMNS)), max_size=3, unique=True)):
        kind, values = _EXTRA_COLUMNS[name]
        columns[f"x_{name}"] = pa.array(draw(st.lists(st.one_of(st.none(), values), min_size=len(messages),
                                                       max_size=len(messages))), kind)
    expected = [1] * VALID
    if draw(st.booleans()):  # a string column holding bytes that are not UTF-8 in one row: that row is lost
        bad = draw(st.integers(0, len(messages) - 1))
        raw = [b"\xff\xfe" if i == bad else b"fine" for i in range(len(messages))]
        columns["x_note"] = pa.array(raw, pa.binary()).view(pa.string())
        if labels[bad] is not None:
            expected[labels[bad]] = 0
    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink, row_group_size=draw(st.integers(1, 4)))
    return sink.getvalue(), len(messages), expected


@END_TO_END
@given(source=parquet_sources())
def test_every_parquet_row_is_counted_and_every_valid_row_kept(source: tuple[bytes, int, list[int]]) -> None:
    data, rows, expected = source
    acc, written, _ = import_files({"a.parquet": data})
    check_accounting(acc, rows)
    check_written(written, Kind.completions)
    assert marker_counts(written) == expected


def test_columns_the_importer_does_not_read_never_cost_a_row() -> None:
    rows = [{**valid_record(k), "score": float("nan"), "created": datetime.datetime(2024, 1, 2),
             "price": decimal.Decimal("1.50"), "image": b"\x89PNG\xff"} for k in range(VALID)]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    acc, written, _ = import_files({"a.parquet": sink.getvalue()})
    assert (acc.succeeded, acc.failed) == (VALID, 0)
    assert marker_counts(written) == [1] * VALID


# ------------------------------------------------------------------------------------------- broken files

_LINES = [json.dumps(valid_record(k)).encode() for k in range(300)]


@END_TO_END
@given(codec=st.sampled_from(["zstd", "gzip"]), cut=st.floats(0, 1))
def test_a_truncated_stream_keeps_the_records_before_the_break(codec: str, cut: float) -> None:
    whole = compress(b"\n".join(_LINES) + b"\n", codec)
    name = "a.jsonl.zst" if codec == "zstd" else "a.jsonl.gz"
    acc, written, source = import_files({name: whole[: int(len(whole) * cut)], "b.jsonl": _LINES[0] + b"\n"})
    assert acc.input_records == acc.succeeded + acc.failed + acc.skipped
    assert set(acc.failures_by_reason) <= {"unreadable_file"} and acc.failed <= 1
    kept = acc.succeeded - (1 if acc.skipped == 0 else 0)  # b.jsonl's copy of the first line: kept or duplicate
    # The records before the break are kept, in order; the break names the file and the line after them.
    assert [json.loads(line)["messages"][1] for line in written[:kept]] == [
        json.loads(line)["messages"][1] for line in _LINES[:kept]]
    if acc.failed:
        (example,) = acc.examples["unreadable_file"]
        assert example.startswith(f"{join(source, name)}:{kept + 1}: cannot be read after line {kept} (")


@pytest.mark.parametrize(("name", "data"), [
    ("a.jsonl.zst", b"not zstd at all" * 20),
    ("a.jsonl.gz", b"\x1f\x8b not gzip" * 20),
    ("a.parquet", b"PAR1 not parquet" * 20),
    ("a.parquet", b""),
])
def test_a_file_that_is_not_what_its_name_says_is_one_unreadable_record(name: str, data: bytes) -> None:
    acc, written, source = import_files({name: data, "b.jsonl": _LINES[0] + b"\n"})
    assert (acc.input_records, acc.succeeded, acc.failures_by_reason) == (2, 1, {"unreadable_file": 1})
    assert acc.examples["unreadable_file"][0].startswith(join(source, name))
    assert len(written) == 1


class _FailingReads(io.RawIOBase):
    """A storage stream whose reads past its first `good` bytes fail, as on a dropped connection."""

    def __init__(self, data: bytes, good: int) -> None:
        self._data, self._good, self._pos = data, good, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = {0: offset, 1: self._pos + offset, 2: len(self._data) + offset}[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        if self._pos + len(buffer) > self._good and self._pos < len(self._data):
            raise ConnectionResetError("connection reset by peer")
        chunk = self._data[self._pos : self._pos + len(buffer)]
        buffer[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


class _FlakyStore(ObjectStore):
    def __init__(self, good: int) -> None:
        super().__init__()
        self._good_bytes = good

    @contextlib.contextmanager
    def open_read(self, uri: str) -> Iterator[BinaryIO]:
        if "/src/a." not in uri:
            with super().open_read(uri) as handle:
                yield handle
            return
        with open(uri, "rb") as handle:
            data = handle.read()
        yield _FailingReads(data, min(self._good_bytes, len(data) // 2))  # type: ignore[misc]


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.zst", "a.parquet"])
def test_a_storage_failure_while_reading_stays_retryable(name: str) -> None:
    rows = [valid_record(k) for k in range(300)]
    if name == "a.parquet":
        sink = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), sink, row_group_size=50)
        data = sink.getvalue()
    else:
        data = compress(b"\n".join(json.dumps(r).encode() for r in rows) + b"\n",
                        "zstd" if name.endswith(".zst") else None)
    with pytest.raises(StorageError, match="connection reset") as err:
        import_files({name: data}, store=_FlakyStore(good=2000))
    assert exit_code_for(err.value) is ExitCode.RETRYABLE

