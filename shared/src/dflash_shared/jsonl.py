"""JSON Lines shards, zstd-compressed, read and written as streams.

Compression goes through pyarrow's codecs so that the shared library needs no extra dependency, and the
torch-free tokenizer image reads exactly what the vLLM image wrote.

Reading tells two failures apart: a stream that cannot be decompressed (truncated, corrupt, not the codec
its name says) is bad input (`UnreadableFileError`, naming the file and the last line read), while a read
the storage itself failed stays a `StorageError`, which a retry may cure. `decode_line` is the one JSON
decoder for lines from outside the pipeline: it refuses what `json.loads` accepts but no later stage can
use, so a bad line is counted where it was read, never a crash further on.
"""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

import pyarrow as pa

from dflash_shared.errors import BadInputError
from dflash_shared.storage import ObjectStore, StorageError

JSONL_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.gz", ".json")
# Deeper than this is no conversation or tool schema; orjson (the tokenize stage's reader) stops at 1024
# and Python's own json recursion near 1000.
MAX_DEPTH = 100
# A JSON escape of a UTF-16 surrogate half: only lines holding one unpaired can decode to a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# The integers orjson reads exactly (larger ones it turns into floats).
_INT_RANGE = (-(2**63), 2**64 - 1)


def codec_for(uri: str) -> str | None:
    if uri.endswith(".zst"):
        return "zstd"
    if uri.endswith(".gz"):
        return "gzip"
    return None


def excerpt(data: bytes | str, limit: int = 80, start: int = 0) -> str:
    """A short, printable quote of untrusted text for logs and manifests: repr-escaped, truncated."""
    begin = max(0, start)
    if isinstance(data, bytes):
        # 4 bytes per character at most: enough bytes for `limit` characters, never the whole line.
        text = data[begin : begin + 4 * limit].decode("utf-8", "backslashreplace")
        more = len(data) > begin + 4 * limit or len(text) > limit
    else:
        text = data[begin : begin + limit + 1]
        more = len(text) > limit
    quoted = repr(text[:limit])
    if len(quoted) > limit + 24:  # escapes can grow the quote; keep it a glance, not a dump
        quoted = quoted[: limit + 20] + "'"
    return ("..." if begin else "") + quoted + ("..." if more else "")


def printable(text: str) -> str:
    """`text` with every character a terminal or a UTF-8 writer could choke on (control characters, lone
    surrogates, bidirectional overrides) written as its escape; for messages that quote untrusted data."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class LineError(ValueError):
    """A line that is not one JSON value the later stages can read; the message says why, with an excerpt."""


class UnreadableFileError(BadInputError):
    """A file whose bytes cannot be decoded past some point; `line` is the last line read whole (0: none)."""

    def __init__(self, uri: str, line: int, cause: BaseException | None = None, detail: str | None = None) -> None:
        self.uri, self.line = uri, line
        self.detail = detail or f"cannot be read after line {line} ({printable(str(cause))[:200]})"
        super().__init__(f"{uri} {self.detail}")


def utf16_kind(start: bytes) -> str | None:
    """'UTF-16 little-endian' when the first bytes of a text file look like UTF-16, else None.

    Windows tools (PowerShell's `>`, Notepad's "Unicode") write UTF-16; read as UTF-8 every line of it
    fails on its own, which says nothing about the cause. A byte-order mark decides; without one, text that
    is mostly ASCII has a zero byte beside each character, after it (little-endian) or before it (big).
    """
    if start.startswith(b"\xff\xfe"):
        return "UTF-16 little-endian (it starts with that byte-order mark)"
    if start.startswith(b"\xfe\xff"):
        return "UTF-16 big-endian (it starts with that byte-order mark)"
    head = start[:64]
    if len(head) < 8:
        return None
    odd_zeros, even_zeros = head[1::2].count(0), head[0::2].count(0)
    if odd_zeros >= len(head) // 4 and even_zeros == 0:
        return "UTF-16 little-endian"
    if even_zeros >= len(head) // 4 and odd_zeros == 0:
        return "UTF-16 big-endian"
    return None


def _reject_constant(name: str) -> Any:
    raise LineError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise LineError(f"number {excerpt(text, 24)} is out of the float range")
    return value


def _bounded_int(text: str) -> int:
    # Checked by length first: int() of a many-thousand-digit string is slow, and refused past 4300 digits.
    value = int(text) if len(text) <= 21 else None
    if value is None or not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
        raise LineError(f"integer {excerpt(text, 24)} is out of the 64-bit range")
    return value


def _too_deep(obj: Any) -> bool:
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def _unpaired_surrogate_escape(text: str) -> bool:
    """Whether `text` escapes a surrogate half outside a high-low pair. Pairs are common (json.dumps escapes
    every emoji as one), so they are told apart here, cheaply, before any costlier check; an escaped
    backslash before "ud800" may answer True, which the check after it sorts out."""
    pending = -1  # end of a high half still waiting for its low half
    for match in _SURROGATE_ESCAPE.finditer(text):
        low = match.group()[3] in "cdefCDEF"
        if pending != -1:
            if not low or match.start() != pending:  # the waiting high half has no low one
                return True
            pending = -1
        elif low:  # a low half without a high one
            return True
        else:
            pending = match.end()
    return pending != -1


def decode_line(line: bytes | str) -> Any:
    """One JSON line -> its value; LineError (a clear reason and a safe excerpt) for anything unusable.

    Beyond `json.loads`: the text must be UTF-8 (a leading byte-order mark is allowed), and hold no lone
    UTF-16 surrogate (which no UTF-8 writer or tokenizer accepts), no NaN or Infinity, no integer past
    64 bits and no nesting deeper than MAX_DEPTH.
    """
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
    except UnicodeDecodeError as err:
        raise LineError(f"not valid UTF-8 ({err.reason} at byte {err.start}): "
                        f"{excerpt(line, start=err.start - 20)}") from None
    text = text.removeprefix("\ufeff")
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except LineError as err:
        raise LineError(f"{err}: {excerpt(text)}") from None
    except json.JSONDecodeError as err:
        raise LineError(f"not valid JSON ({err.msg} at column {err.colno}): "
                        f"{excerpt(text, start=err.pos - 20)}") from None
    except RecursionError:
        raise LineError(f"nested deeper than {MAX_DEPTH} levels: {excerpt(text)}") from None
    if isinstance(obj, dict | list) and text.count("[") + text.count("{") > MAX_DEPTH and _too_deep(obj):
        raise LineError(f"nested deeper than {MAX_DEPTH} levels: {excerpt(text)}")
    if _unpaired_surrogate_escape(text):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as err:
            raise LineError(f"a string holds a lone surrogate ({err.object[err.start]!r}), which is not Unicode: "
                            f"{excerpt(text)}") from None
    return obj


class StorageReads(io.RawIOBase):
    """The raw object stream, each failed read re-raised as a StorageError and kept in `failure`.

    What fails beneath a decoder (zstd, gzip, Parquet) is storage, which a retry may cure; what the decoder
    raises by itself is the file's bytes. pyarrow does not always pass a Python exception through (its
    Parquet footer read reports a failed read as missing magic bytes), so a caller that catches a decoder
    error asks `failure` whether storage failed underneath.
    """

    def __init__(self, raw: BinaryIO, uri: str) -> None:
        super().__init__()
        self._raw, self._uri = raw, uri
        self.failure: StorageError | None = None

    def _failed(self, err: Exception) -> StorageError:
        if not isinstance(err, StorageError):
            err = StorageError(f"reading {self._uri} failed: {type(err).__name__}: {err}", uri=self._uri)
        self.failure = err
        return err

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._raw.seekable()

    def readinto(self, buffer: Any) -> int:
        try:
            return self._raw.readinto(buffer)  # type: ignore[attr-defined,no-any-return]
        except Exception as err:
            raise self._failed(err) from err

    def read(self, size: int = -1) -> bytes:
        try:
            return self._raw.read(size)
        except Exception as err:
            raise self._failed(err) from err

    def seek(self, offset: int, whence: int = 0) -> int:
        try:
            return self._raw.seek(offset, whence)
        except Exception as err:
            raise self._failed(err) from err

    def tell(self) -> int:
        return self._raw.tell()

    def raise_failure(self) -> None:
        """Raise the storage failure seen underneath, if any (call it where a decoder error is caught)."""
        if self.failure is not None:
            raise self.failure


def iter_lines(store: ObjectStore, uri: str) -> Iterator[tuple[int, bytes]]:
    """Yield (line number from 1, raw line) of a possibly compressed JSONL object, streaming.

    Raises UnreadableFileError (bad input) where the bytes stop decoding, after the lines read before it,
    and StorageError where the storage fails.
    """
    codec = codec_for(uri)
    number = 0
    with store.open_read(uri) as raw:
        source = StorageReads(raw, uri)
        stream: Any = pa.CompressedInputStream(pa.PythonFile(source, mode="r"), codec) if codec else source
        # Reads of 64 KiB: a stream that breaks takes the lines of the read that broke with it, so a small
        # read keeps nearly all lines before the break (and is no slower than 1 MiB ones).
        buffered = io.BufferedReader(stream, buffer_size=1 << 16)
        try:
            for number, line in enumerate(buffered, start=1):
                kind = utf16_kind(line) if number == 1 else None
                if kind is not None:
                    name = uri.rsplit("/", 1)[-1]
                    source_encoding = "UTF-16" if "byte-order mark" in kind else kind.replace(" little-endian", "LE")
                    source_encoding = source_encoding.replace(" big-endian", "BE")
                    convert = f"iconv -f {source_encoding} -t UTF-8 {name} > {name}.tmp && mv {name}.tmp {name}"
                    raise UnreadableFileError(uri, 0, detail=f"is not UTF-8: it looks like {kind}; convert it, "
                                              f"e.g. {convert}")
                stripped = line.strip()
                if stripped:
                    yield number, stripped
        except (StorageError, UnreadableFileError):
            raise
        except (OSError, ValueError) as err:  # pyarrow's codec errors (ArrowIOError, ArrowInvalid)
            source.raise_failure()
            raise UnreadableFileError(uri, number, err) from err


def encode_line(obj: Any) -> bytes:
    """One canonical line: stable key order is what makes reruns byte-identical."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode("utf-8") + b"\n"


class JsonlZstWriter:
    """Write lines to a local zstd-compressed file (published to the store by the runner afterwards)."""

    def __init__(self, path: str, level: int = 3) -> None:
        self._sink = pa.OSFile(path, "wb")
        self._stream = pa.CompressedOutputStream(self._sink, "zstd")
        self.records = 0
        del level  # pyarrow's stream API uses the codec's default level; kept for a stable signature

    def write(self, obj: Any) -> None:
        self.write_line(encode_line(obj))

    def write_line(self, line: bytes) -> None:
        """One line already made by `encode_line` (for callers that must encode before they commit)."""
        self._stream.write(line)
        self.records += 1

    def write_all(self, objs: Iterable[Any]) -> None:
        for obj in objs:
            self.write(obj)

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> JsonlZstWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
