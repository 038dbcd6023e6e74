"""`import`: external JSONL/Parquet conversations -> a prompts or completions manifest.

Users bring conversations made elsewhere (the origin case: 1,805 JSONL files, 902K records). Files under the
source prefix are sharded over workers like any stage input; each record is validated, given a content id,
de-duplicated, and written as `PromptRecord` or `CompletionRecord` lines. Every record is accounted for:
malformed ones are counted with their file and line, never silently dropped, and too many of them fail the
import instead of handing garbage to a GPU stage.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from dflash_shared.conversations import RecordError, parse_messages, parse_tools
from dflash_shared.errors import BadInputError
from dflash_shared.jsonl import JSONL_SUFFIXES, JsonlZstWriter, iter_lines
from dflash_shared.manifests import (
    Accounting,
    CompletionsSection,
    Kind,
    Manifest,
    Producer,
    PromptsSection,
)
from dflash_shared.quality import MALFORMED
from dflash_shared.records import CompletionRecord, Message, PromptRecord, record_id
from dflash_shared.runner import MergedOutcome, ShardContext, ShardOutcome, finalize, run_shard
from dflash_shared.settings import StageSettings
from dflash_shared.storage import ObjectStore

SOURCE_SUFFIXES = (*JSONL_SUFFIXES, ".parquet")
DUPLICATE = "duplicate"
EMPTY_PROMPT = "empty_prompt"
NO_FINAL_ASSISTANT = "no_final_assistant_turn"
RECORDS_PER_PART = 50_000


class ImportConfig(StageSettings):
    """`<stage> import`: external conversations -> a prompts (generate) or completions (tokenize) manifest."""

    model_config = SettingsConfigDict(env_prefix="DFLASH_IMPORT_")

    source: str = Field(description="Prefix holding .jsonl(.zst|.gz) or .parquet conversation files.")
    output: str = Field(description="Prefix to write the manifest and its JSONL shards to.")
    run_id: str = Field(default="import", description="Run id recorded in the manifest.")
    max_bad_fraction: float = Field(default=0.05, ge=0, le=1, description="Fail above this unusable fraction.")
    shard_index: int | None = Field(default=None, description="This worker's shard (JOB_COMPLETION_INDEX).")
    num_shards: int | None = Field(default=None, description="Worker count (DFLASH_NUM_SHARDS or 1).")

    def spec(self, kind: Kind) -> ImportSpec:
        return ImportSpec(kind, self.source, self.output, self.run_id, self.max_bad_fraction)


@dataclass(frozen=True)
class ImportSpec:
    kind: Kind  # Kind.prompts or Kind.completions
    source_prefix: str
    output_prefix: str
    run_id: str
    max_bad_fraction: float = 0.05


def iter_source(store: ObjectStore, uri: str) -> Iterator[tuple[str, Any]]:
    """(file:line or file#row, parsed object or a RecordError) for every record of one source file."""
    if uri.endswith(".parquet"):
        with store.open_read(uri) as handle:
            table = pq.ParquetFile(handle)
            row = 0
            for batch in table.iter_batches(batch_size=4096):
                for obj in batch.to_pylist():
                    yield f"{uri}#{row}", obj
                    row += 1
        return
    for number, line in iter_lines(store, uri):
        try:
            yield f"{uri}:{number}", json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            yield f"{uri}:{number}", RecordError(MALFORMED, f"not valid JSON ({err.__class__.__name__}: {err})")


def to_prompt(messages: list[Message], source: str, tools: tuple[dict[str, Any], ...] | None) -> PromptRecord:
    # The last assistant turn (if any) is what the target will regenerate, so it is not part of the prompt.
    while messages and messages[-1].role == "assistant":
        messages = messages[:-1]
    if not any(m.role == "user" and m.content.strip() for m in messages):
        raise RecordError(EMPTY_PROMPT, "no user message with text")
    return PromptRecord(id=record_id(messages, tools), messages=tuple(messages), tools=tools, source=source)


def to_completion(
    messages: list[Message], source: str, tools: tuple[dict[str, Any], ...] | None
) -> CompletionRecord:
    if messages[-1].role != "assistant":
        raise RecordError(NO_FINAL_ASSISTANT, f"last message is from {messages[-1].role!r}, not the assistant")
    prompt = messages[:-1]
    if not any(m.role == "user" and m.content.strip() for m in prompt):
        raise RecordError(EMPTY_PROMPT, "no user message with text before the assistant turn")
    return CompletionRecord(id=record_id(prompt, tools), messages=tuple(messages), tools=tools, source=source)


@dataclass
class _Tally:
    input_records: int = 0
    succeeded: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def reject(self, counter: Counter[str], reason: str, where: str, message: str) -> None:
        counter[reason] += 1
        kept = self.examples.setdefault(reason, [])
        if len(kept) < 5:
            kept.append(f"{where}: {message}")

    def accounting(self) -> Accounting:
        return Accounting(
            input_records=self.input_records,
            succeeded=self.succeeded,
            failed=sum(self.failures.values()),
            skipped=sum(self.skips.values()),
            failures_by_reason=dict(self.failures),
            skips_by_reason=dict(self.skips),
            examples=self.examples,
        )


def process_import(ctx: ShardContext, spec: ImportSpec) -> ShardOutcome:
    convert = to_prompt if spec.kind is Kind.prompts else to_completion
    tally = _Tally()
    seen: set[str] = set()
    part, writer = 0, None

    def roll() -> None:
        nonlocal part, writer
        if writer is None:
            return
        writer.close()
        path = os.path.join(ctx.scratch_dir, ctx.part_name(part, ".jsonl.zst"))
        ctx.publish(path, os.path.basename(path), records=writer.records)
        os.unlink(path)
        part, writer = part + 1, None

    for uri in ctx.items:
        for where, obj in iter_source(ctx.store, uri):
            tally.input_records += 1
            try:
                if isinstance(obj, RecordError):
                    raise obj
                record = convert(parse_messages(obj), where, parse_tools(obj))
            except RecordError as err:
                tally.reject(tally.failures, err.reason, where, str(err))
                continue
            if record.id in seen:
                tally.reject(tally.skips, DUPLICATE, where, f"same content as an earlier record ({record.id})")
                continue
            seen.add(record.id)
            if writer is None:
                writer = JsonlZstWriter(os.path.join(ctx.scratch_dir, ctx.part_name(part, ".jsonl.zst")))
            writer.write(record.model_dump(mode="json", exclude_none=True))
            tally.succeeded += 1
            if writer.records >= RECORDS_PER_PART:
                roll()
        ctx.logger.info("read %s (%d records so far)", uri, tally.input_records)
    roll()
    accounting = tally.accounting()
    if accounting.input_records and accounting.failed / accounting.input_records > spec.max_bad_fraction:
        raise BadInputError(
            f"{accounting.failed} of {accounting.input_records} records in shard {ctx.index} are unusable "
            f"(limit {spec.max_bad_fraction:.0%}): {accounting.failures_by_reason}; e.g. "
            + "; ".join(ex for exs in accounting.examples.values() for ex in exs[:2]),
            counts=accounting.failures_by_reason,
            examples=accounting.examples,
        )
    return ctx.outcome(accounting, totals={"duplicates": accounting.skips_by_reason.get(DUPLICATE, 0)})


def build_import_manifest(spec: ImportSpec, producer: Producer, merged: MergedOutcome) -> Manifest:
    section: PromptsSection | CompletionsSection
    if spec.kind is Kind.prompts:
        section = PromptsSection(sources=[spec.source_prefix], duplicates=int(merged.totals.get("duplicates", 0)))
    else:
        section = CompletionsSection(target=None, has_token_ids=False)
    return Manifest(
        kind=spec.kind,
        run_id=spec.run_id,
        producer=producer,
        shards=merged.shards,
        accounting=merged.accounting,
        section=section,
    )


def list_sources(store: ObjectStore, prefix: str) -> list[str]:
    sources = [uri for uri in store.list(prefix) if uri.endswith(SOURCE_SUFFIXES)]
    if not sources:
        raise BadInputError(f"no {', '.join(SOURCE_SUFFIXES)} files under {prefix}")
    return sources


def run_import(
    store: ObjectStore, spec: ImportSpec, producer: Producer, index: int = 0, count: int = 1
) -> str | None:
    """Import this worker's share of the source files; the last worker to finish writes the manifest."""
    sources = list_sources(store, spec.source_prefix)
    run_shard(
        f"import-{spec.kind.value}",
        store,
        spec.output_prefix,
        sources,
        index,
        count,
        lambda ctx: process_import(ctx, spec),
    )
    return finalize(store, spec.output_prefix, count, lambda merged: build_import_manifest(spec, producer, merged))


def import_command(argv: list[str], kind: Kind, prog: str, packages: list[str]) -> None:
    """The `import` subcommand of a stage CLI: parse ImportConfig, import this worker's share."""
    # Imported here: the CLI helpers pull in logging setup that library users of this module do not need.
    from dflash_shared.logs import setup_logging
    from dflash_shared.provenance import producer
    from dflash_shared.runner import resolve_shard
    from dflash_shared.settings import parse_settings, public_dict

    config = parse_settings(ImportConfig, argv, prog=prog)
    index, count = resolve_shard(config.shard_index, config.num_shards)
    setup_logging("import", shard=index)
    made = producer("import", public_dict(config), packages)
    run_import(ObjectStore(), config.spec(kind), made, index, count)
