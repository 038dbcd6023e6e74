"""JSON Lines shards, zstd-compressed, read and written as streams.

Compression goes through pyarrow's codecs so that the shared library needs no extra dependency, and the
torch-free tokenizer image reads exactly what the vLLM image wrote.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

import pyarrow as pa

from dflash_shared.storage import ObjectStore

JSONL_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.gz", ".json")


def codec_for(uri: str) -> str | None:
    if uri.endswith(".zst"):
        return "zstd"
    if uri.endswith(".gz"):
        return "gzip"
    return None


def iter_lines(store: ObjectStore, uri: str) -> Iterator[tuple[int, bytes]]:
    """Yield (line number from 1, raw line) of a possibly compressed JSONL object, streaming."""
    codec = codec_for(uri)
    with store.open_read(uri) as raw:
        stream: BinaryIO = raw
        if codec:
            stream = pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), codec)  # type: ignore[assignment]
        buffered = io.BufferedReader(stream, buffer_size=1 << 20) if codec else stream  # type: ignore[arg-type,type-var]
        for number, line in enumerate(buffered, start=1):
            stripped = line.strip()
            if stripped:
                yield number, stripped


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
        self._stream.write(encode_line(obj))
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
