"""Stage inputs for tests: JSONL.zst shards plus their manifest, written the way the producing stage writes them.

The lines are written as they are given (raw bytes for a malformed line, the same record twice for a
duplicate), so a test can put exactly the bad input it wants in front of the stage under test.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pyarrow as pa
from pydantic import BaseModel

from dflash_shared.jsonl import encode_line
from dflash_shared.manifests import Accounting, Kind, Manifest, Producer, Shard
from dflash_shared.storage import ObjectStore, join


def zst(lines: Sequence[bytes]) -> bytes:
    """The lines as one zstd-compressed JSONL object."""
    sink = pa.BufferOutputStream()
    stream = pa.CompressedOutputStream(sink, "zstd")
    for line in lines:
        stream.write(line)
    stream.close()
    return sink.getvalue().to_pybytes()


def write_jsonl_manifest(
    store: ObjectStore, prefix: str, records: Sequence[BaseModel | bytes], *, kind: Kind, producer: str,
    section: BaseModel, shards: int = 1,
) -> str:
    """A `kind` manifest over `shards` JSONL.zst files (records dealt round-robin); returns the prefix."""
    lines = [r + b"\n" if isinstance(r, bytes) else encode_line(r.model_dump(mode="json", exclude_none=True))
             for r in records]
    written = []
    for index in range(shards):
        part = lines[index::shards]
        data = zst(part)
        uri = join(prefix, "data", f"part-{index:05d}-0000.jsonl.zst")
        store.write_bytes(uri, data)
        written.append(Shard(uri=uri, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), records=len(part)))
    manifest = Manifest(
        kind=kind,
        run_id="test-run",
        producer=Producer(stage=producer),
        shards=written,
        accounting=Accounting(input_records=len(lines), succeeded=len(lines), failed=0, skipped=0),
        section=section,  # type: ignore[arg-type]
    )
    store.write_bytes(join(prefix, "manifest.json"), manifest.to_json())
    return prefix
