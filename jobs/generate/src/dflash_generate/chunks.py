"""Chunks: the generate stage's unit of work and of resumption.

Every prompts shard is cut into chunks of `chunk_records` consecutive records; the chunks of all shards are
the runner's items, so work spreads evenly over pods however few shards the import wrote. A chunk's
completions become one zstd JSONL file, `data/chunk-<file>-<first record>.jsonl.zst`, followed by a
receipt, `_chunks/chunk-<file>-<first record>.json`, holding the file's checksum and the chunk's
accounting. The receipt is the chunk's commit point: a rerun adopts every chunk that has one and generates
only the others, so a preempted pod loses the chunks it had not finished, never the ones it had.

A prompt whose id appeared earlier in the same prompts shard is skipped as a duplicate. That rule looks
only at the shard, never at which pod reads it, so the outcome is the same for any number of pods.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_shared.errors import BadInputError
from dflash_shared.jsonl import LineError, decode_line, excerpt, iter_lines, printable
from dflash_shared.manifests import Accounting, Shard
from dflash_shared.quality import MALFORMED
from dflash_shared.records import PromptRecord
from dflash_shared.runner import ShardingError
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, join

log = logging.getLogger(__name__)

CHUNKS_DIR = "_chunks"
DUPLICATE = "duplicate"
_IO_THREADS = 16


@dataclass(frozen=True)
class Chunk:
    """Records [first, end) of the prompts shard `uri`, the `file_index`-th shard of the manifest."""

    uri: str
    file_index: int
    first: int
    end: int

    @property
    def item(self) -> str:
        """The runner item: the input URI in it means another prompts set can never match a marker."""
        return f"{self.uri}#{self.first:09d}-{self.end:09d}"

    @property
    def name(self) -> str:
        return f"chunk-{self.file_index:05d}-{self.first:09d}"

    @property
    def data_name(self) -> str:
        return f"{self.name}.jsonl.zst"

    @property
    def size(self) -> int:
        return self.end - self.first


def plan_chunks(shards: list[Shard], chunk_records: int) -> list[Chunk]:
    """Every chunk of every prompts shard, in reading order."""
    return [
        Chunk(shard.uri, index, first, min(first + chunk_records, shard.records))
        for index, shard in enumerate(shards)
        for first in range(0, shard.records, chunk_records)
    ]


# ------------------------------------------------------------------------------------------ receipts


class ChunkReceipt(BaseModel):
    """The commit record of one chunk: what it produced and how every one of its prompts was accounted for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    receipt_version: Literal[1] = Field(default=1, description="Receipt format version.")
    item: str = Field(description="The chunk's runner item (input shard URI and record range).")
    input_sha256: str = Field(description="sha256 of the prompts manifest the chunk was read from.")
    settings_sha256: str = Field(description="sha256 of the settings that shape completions (target, sampling).")
    shard: Shard | None = Field(description="The completions file; None when no prompt of the chunk succeeded.")
    accounting: Accounting = Field(description="Where each prompt of the chunk went.")
    prompt_tokens: int = Field(ge=0, description="Prompt tokens of the completions written.")
    output_tokens: int = Field(ge=0, description="Completion tokens generated for the completions written.")
    engine_seconds: float = Field(ge=0, description="Engine wall time attributed to the chunk.")
    degenerate: dict[str, int] = Field(
        default_factory=dict, description="Completions written that the quality gate will reject, per reason."
    )
    truncated_by_budget: int | None = Field(
        default=None, ge=0, description="Completions stopped at the budget and kept; None in receipts made before "
        "they were counted."
    )
    training_window: int | None = Field(
        default=None, description="The window output_tokens_in_window was counted against."
    )
    output_tokens_in_window: int | None = Field(
        default=None, ge=0, description="Completion tokens inside the training window (prompt + completion)."
    )


def receipt_uri(output_prefix: str, chunk: Chunk) -> str:
    return join(output_prefix, CHUNKS_DIR, f"{chunk.name}.json")


def load_receipts(
    store: ObjectStore, output_prefix: str, chunks: list[Chunk], input_sha256: str, settings_sha256: str
) -> dict[str, ChunkReceipt]:
    """Receipts of `chunks` already committed under the prefix, each checked against this run and its file."""
    listed = set(store.list(join(output_prefix, CHUNKS_DIR)))
    wanted = [c for c in chunks if receipt_uri(output_prefix, c) in listed]

    def load(chunk: Chunk) -> tuple[str, ChunkReceipt | None]:
        uri = receipt_uri(output_prefix, chunk)
        try:
            receipt = ChunkReceipt.model_validate_json(store.read_bytes(uri))
        except ValidationError as err:
            raise ShardingError(f"chunk receipt {uri} is unreadable ({err.errors()[0]['msg']}); delete it to "
                                "redo that chunk") from err
        if receipt.item != chunk.item:
            raise ShardingError(f"chunk receipt {uri} is for {receipt.item}, not {chunk.item}")
        if receipt.input_sha256 != input_sha256:
            raise ShardingError(f"chunk receipt {uri} was made from another prompts manifest (sha256 "
                                f"{receipt.input_sha256[:12]}, now {input_sha256[:12]}); write to a new output prefix")
        if receipt.settings_sha256 != settings_sha256:
            raise ShardingError(f"chunk receipt {uri} was made with other generation settings (target, thinking "
                                "mode, sampling or lengths changed); restore them or write to a new output prefix")
        if receipt.shard is not None:
            try:
                size = store.size(receipt.shard.uri)
            except ObjectNotFoundError:
                size = -1
            if size != receipt.shard.bytes:
                log.warning("chunk %s: %s is missing or changed; generating the chunk again", chunk.name,
                            receipt.shard.uri)
                return chunk.item, None
        return chunk.item, receipt

    with ThreadPoolExecutor(max_workers=_IO_THREADS) as pool:
        return {item: r for item, r in pool.map(load, wanted) if r is not None}


# ------------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class Rejected:
    """A prompt line that does not reach the engine: failed (malformed) or skipped (duplicate)."""

    reason: str
    detail: str
    skipped: bool


def parse_prompt(line: bytes) -> PromptRecord | Rejected:
    """One prompts line -> its record, or why it is malformed (with a quote of it); never an exception,
    so no value in a line can stop the stage."""
    try:
        return PromptRecord.model_validate(decode_line(line))
    except LineError as err:  # not JSON, or JSON no tokenizer can take (lone surrogates, NaN, ...)
        return Rejected(MALFORMED, str(err), skipped=False)
    except ValidationError as err:
        first = err.errors()[0]
        where = printable(".".join(str(p) for p in first["loc"]) or "record")
        return Rejected(MALFORMED, f"not a prompt record ({where}: {first['msg']}): {excerpt(line)}", skipped=False)
    except MemoryError:
        raise
    except Exception as err:  # unforeseen: it costs this line, not the stage
        return Rejected(MALFORMED, f"unusable prompt line ({type(err).__name__}: {excerpt(str(err))}): "
                                   f"{excerpt(line)}", skipped=False)


@dataclass
class _OpenShard:
    shard: Shard
    local: str
    lines: Iterator[tuple[int, bytes]]
    position: int = 0
    seen: set[str] = field(default_factory=set)


class PromptReader:
    """Reads chunks from the prompts shards, downloading (and verifying) each shard once per worker.

    Chunks of one shard must be read in ascending order; the lines before a chunk are still parsed, for
    the ids a duplicate is recognised by.
    """

    def __init__(self, store: ObjectStore, shards: list[Shard], scratch_dir: str) -> None:
        self.store = store
        self.shards = {shard.uri: shard for shard in shards}
        self.scratch_dir = scratch_dir
        self._open: _OpenShard | None = None

    def _fetch(self, shard: Shard) -> str:
        # The original name ends the local one: its suffix says how the lines are compressed.
        digest = hashlib.sha256(shard.uri.encode()).hexdigest()[:16]
        local = os.path.join(self.scratch_dir, f"prompts-{digest}-{os.path.basename(shard.uri)}")
        self.store.download_to(shard.uri, local)
        size, digest = os.path.getsize(local), self.store.sha256(local)
        if (size, digest) != (shard.bytes, shard.sha256):
            os.unlink(local)
            raise BadInputError(f"prompts shard {shard.uri} does not match its manifest: {size} bytes sha256 "
                                f"{digest}, expected {shard.bytes} bytes sha256 {shard.sha256}")
        return local

    def _shard_state(self, uri: str) -> _OpenShard:
        if self._open is not None and self._open.shard.uri == uri:
            return self._open
        self.close()
        shard = self.shards[uri]
        local = self._fetch(shard)
        self._open = _OpenShard(shard, local, iter_lines(self.store, local))
        return self._open

    def _next(self, state: _OpenShard) -> tuple[str, PromptRecord | Rejected]:
        try:
            number, line = next(state.lines)
        except StopIteration:
            raise BadInputError(f"prompts shard {state.shard.uri} ends after {state.position} records; its "
                                f"manifest says {state.shard.records}") from None
        state.position += 1
        parsed = parse_prompt(line)
        if isinstance(parsed, PromptRecord):
            if parsed.id in state.seen:
                parsed = Rejected(DUPLICATE, f"prompt id {parsed.id} appeared earlier in the shard", skipped=True)
            else:
                state.seen.add(parsed.id)
        return f"{state.shard.uri}:{number}", parsed

    def read(self, chunk: Chunk) -> Iterator[tuple[str, PromptRecord | Rejected]]:
        """(file:line, record or rejection) for every record of the chunk, in order."""
        state = self._shard_state(chunk.uri)
        if chunk.first < state.position:
            raise RuntimeError(f"chunk {chunk.name} read after a later chunk of {chunk.uri}")
        while state.position < chunk.first:
            self._next(state)
        while state.position < chunk.end:
            yield self._next(state)
        if chunk.end == state.shard.records and next(state.lines, None) is not None:
            raise BadInputError(f"prompts shard {chunk.uri} holds more than the {chunk.end} records its manifest "
                                "says")

    def close(self) -> None:
        if self._open is not None:
            close = getattr(self._open.lines, "close", None)
            if close is not None:
                close()
            os.unlink(self._open.local)
            self._open = None
