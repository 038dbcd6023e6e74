"""JSON Lines reading: the line decoder's refusals, safe excerpts, and file-level failures told from storage ones."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pyarrow as pa
import pytest

from dflash_shared.errors import BadInputError, exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.jsonl import (
    MAX_DEPTH,
    LineError,
    StorageReads,
    UnreadableFileError,
    decode_line,
    excerpt,
    iter_lines,
    printable,
    utf16_kind,
)
from dflash_shared.storage import ObjectStore, StorageError


@pytest.mark.parametrize(("line", "why"), [
    (b'{"a": "x\\ud800"}', "lone surrogate"),
    (b'{"a": "x\\udc00\\ud800"}', "lone surrogate"),
    (b'{"a": "x\xed\xa0\x80"}', "not valid UTF-8"),
    (b'{"a": "\xff"}', "not valid UTF-8"),
    (b'{"a": NaN}', "NaN is not a JSON number"),
    (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"a": 1e400}', "out of the float range"),
    (b'{"a": ' + b"9" * 5000 + b"}", "out of the 64-bit range"),
    (b'{"a": 18446744073709551616}', "out of the 64-bit range"),
    (b"[" * 5000 + b"]" * 5000, f"nested deeper than {MAX_DEPTH} levels"),
    (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), f"nested deeper than {MAX_DEPTH} levels"),
    (b'{"a": 1', "not valid JSON"),
])
def test_decode_line_refuses_what_no_later_stage_can_use(line: bytes, why: str) -> None:
    with pytest.raises(LineError, match=why) as err:
        decode_line(line)
    assert str(err.value).isprintable() and len(str(err.value)) < 300


@pytest.mark.parametrize("line", [
    b'\xef\xbb\xbf{"a": 1}',  # a byte-order mark
    b'{"a": "\\ud83c\\udf89 \xf0\x9f\x8e\x89"}',  # a surrogate pair, escaped, and the same emoji as UTF-8
    b'{"a": 18446744073709551615, "b": -9223372036854775808, "c": 1.5e300}',
    b"[" * MAX_DEPTH + b"]" * MAX_DEPTH,
    b'{"a": "\\\\ud800 is a backslash and text"}',
])
def test_decode_line_takes_what_json_means(line: bytes) -> None:
    assert decode_line(line) == json.loads(line.decode("utf-8-sig"))


def test_excerpts_and_messages_are_short_and_printable() -> None:
    hostile = "\x1b[31mred\x00\u202e\ud800" + "x" * 500
    for quoted in (excerpt(hostile), excerpt(hostile.encode("utf-8", "surrogatepass")), printable(hostile)):
        assert quoted.isprintable()
    assert len(excerpt(hostile)) < 120 and excerpt(hostile).endswith("...")
    assert excerpt(b"abc") == "'abc'" and printable("plain text") == "plain text"


def zst(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as stream:
        stream.write(data)
    return sink.getvalue().to_pybytes()


def test_a_truncated_stream_is_bad_input_after_the_lines_before_it(tmp_path: Path) -> None:
    # Digests do not compress: half of the file is many reads, most of them whole.
    data = zst(b"".join(b'{"n": "%s"}\n' % hashlib.sha256(b"%d" % i).hexdigest().encode() for i in range(20_000)))
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(data[: len(data) // 2])
    read = []
    with pytest.raises(UnreadableFileError) as err:
        read.extend(n for n, _ in iter_lines(ObjectStore(), str(path)))
    assert read == list(range(1, len(read) + 1)) and read and err.value.line == read[-1]
    assert isinstance(err.value, BadInputError) and exit_code_for(err.value) is ExitCode.BAD_INPUT
    assert f"cannot be read after line {read[-1]}" in str(err.value)


class _Broken(io.RawIOBase):
    def readable(self) -> bool:
        return True

    def readinto(self, buffer: object) -> int:
        raise TimeoutError("read timed out")


def test_a_failed_read_beneath_the_decoder_is_a_storage_error() -> None:
    reads = StorageReads(_Broken(), "s3://b/a.jsonl.zst")  # type: ignore[arg-type]
    stream = pa.CompressedInputStream(pa.PythonFile(reads, mode="r"), "zstd")
    with pytest.raises(StorageError, match="reading s3://b/a.jsonl.zst failed: TimeoutError") as err:
        stream.read(10)
    assert reads.failure is err.value and exit_code_for(err.value) is ExitCode.RETRYABLE


@pytest.mark.parametrize(("encoding", "named"), [
    ("utf-16", "UTF-16 little-endian (it starts with that byte-order mark)"),
    ("utf-16-le", "UTF-16 little-endian"),
    ("utf-16-be", "UTF-16 big-endian"),
])
def test_a_utf16_file_is_named_as_such(encoding: str, named: str, tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes('{"messages": [{"role": "user", "content": "Hi"}]}\n{"x": 1}\n'.encode(encoding))
    with pytest.raises(UnreadableFileError) as err:
        list(iter_lines(ObjectStore(), str(path)))
    assert f"is not UTF-8: it looks like {named}; convert it, e.g. iconv -f " in err.value.detail
    assert utf16_kind('{"a": "ü"}\n'.encode()) is None  # UTF-8 with non-ASCII text is not mistaken for it
