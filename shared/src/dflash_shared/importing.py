"""`import`: external JSONL/Parquet conversations or Hugging Face datasets -> a prompts or completions manifest.

Users bring conversations made elsewhere (the origin case: 1,805 JSONL files, 902K records). The source's work
items (its files, a dataset's Arrow files or row ranges, a stage output's shards: see import_sources) are
sharded over workers like any stage input; each record is mapped from its chat layout (layouts), validated,
given a content id, de-duplicated by content and by its own id (kept as `source_id`), and written as
`PromptRecord` or `CompletionRecord` lines. A stage output of the same kind (another run's completions, say)
is copied record by record as it is, engine token ids and target identity included, and named as the
import's input, so tokenize uses its token ids exactly as a run that generated them would.
Every record is accounted for: malformed ones are counted with their file and line, never silently dropped, and
too many of them fail the import instead of handing garbage to a GPU stage.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import heapq
import json
import logging
import math
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict

from dflash_shared.conversations import RecordError, parse_finish_reason, parse_messages, parse_tools
from dflash_shared.dataset_sources import is_dataset_item, is_hub_source, iter_dataset_item
from dflash_shared.errors import BadInputError, ConfigError
from dflash_shared.exit_codes import ExitCode
from dflash_shared.import_sources import ImportSource, Stripe, parse_stripe, resolve_source, stripe_items
from dflash_shared.jsonl import (
    JsonlZstWriter,
    LineError,
    StorageReads,
    UnreadableFileError,
    decode_line,
    encode_line,
    excerpt,
    iter_lines,
    printable,
)
from dflash_shared.layouts import Layout
from dflash_shared.manifest_io import LoadedManifest
from dflash_shared.manifests import (
    Accounting,
    CompletionsSection,
    Kind,
    Manifest,
    Producer,
    PromptsSection,
)
from dflash_shared.preflight import CheckError, Preflight
from dflash_shared.quality import MALFORMED, fix_hints
from dflash_shared.records import CompletionRecord, Message, PromptRecord, record_id
from dflash_shared.runner import (
    MergedOutcome,
    ShardContext,
    ShardOutcome,
    assign,
    assign_all_to_first,
    finalize,
    run_shard,
)
from dflash_shared.settings import StageSettings, env_prefix
from dflash_shared.stage_identity import StageIdentity
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, StorageError, is_s3, join

DUPLICATE = "duplicate"
# Another record with the same source id came first: ids must name one conversation each.
DUPLICATE_ID = "duplicate_id"
# Records left out by `sample_records` (a pilot's sample of the user's own prompts).
SAMPLED_OUT = "sampled_out"
EMPTY_PROMPT = "empty_prompt"
NO_FINAL_ASSISTANT = "no_final_assistant_turn"
# A file that stops decoding part-way (truncated or corrupt zstd/gzip, not Parquet): its rest is one record.
UNREADABLE_FILE = "unreadable_file"
# Prompts counted with the target's tokenizer (`tokenizer`): too long for generate, or refused by the template.
PROMPT_TOO_LONG = "prompt_too_long"
TEMPLATE_REFUSED = "chat_template_refused"
RECORDS_PER_PART = 50_000
log = logging.getLogger(__name__)


class ImportConfig(StageSettings):
    """
    `<stage> import`: external conversations -> a prompts (generate) or completions (tokenize) manifest.

    example:
      dflash-tokenize import --source chats/ --output store/completions
      dflash-generate import --source hf://org/prompts@main:train --output store/prompts
    """

    model_config = SettingsConfigDict(env_prefix="DFLASH_IMPORT_")

    source: str = Field(
        description="Where the conversations are: a .jsonl(.zst|.gz) or .parquet file or a prefix (local or s3://) "
        "of them (.json files are not read), a stage's output prefix or manifest.json (prompts or completions, read "
        "through its manifest; one of the import's kind is copied as it is, token ids included), a folder written "
        "by datasets' save_to_disk (one split), or a Hub dataset hf://org/name[/config]@revision[:split] (split "
        "'train' by default; needs the datasets package; a token is read from HF_TOKEN)."
    )
    output: str = Field(description="Prefix to write the manifest and its JSONL shards to.")
    run_id: str = Field(default="import", description="Run id recorded in the manifest.")
    max_bad_fraction: float = Field(default=0.05, ge=0, le=1, description="Fail above this unusable fraction.")
    shard_index: int | None = Field(default=None, description="This worker's shard (JOB_COMPLETION_INDEX).")
    num_shards: int | None = Field(default=None, description="Worker count (DFLASH_NUM_SHARDS or 1).")
    on_duplicate_id: Literal["keep_first", "refuse"] = Field(
        default="keep_first",
        description="A record whose source id repeats an earlier record's, with other content: keep_first skips "
        "it (reason duplicate_id), refuse counts it as a failure (so max_bad_fraction applies). Ids are compared "
        "within one worker's share of the source (its files, stripes of a file or row ranges): run one worker to "
        "check a whole source.",
    )
    id_field: str = Field(
        default="id", description="Field holding the record's own id, kept as source_id (a string, number or "
        "boolean, as a string; null or absent: none)."
    )
    messages_field: str | None = Field(
        default=None, description="Field holding the list of turns (OpenAI role/content or ShareGPT from/value); "
        "default: messages, else conversations, else a prompt/response pair."
    )
    prompt_field: str | None = Field(
        default=None, description="Field holding the user prompt of a prompt/response pair; default: the first of "
        "prompt/response, instruction/output (Alpaca's input appended), question/answer that a record has."
    )
    response_field: str | None = Field(
        default=None, description="With prompt_field: the field holding the answer (absent or null: none)."
    )
    system_field: str | None = Field(
        default=None, description="Field holding the system prompt of a prompt/response pair (default: system)."
    )
    sample_records: int | None = Field(
        default=None, ge=1,
        description="Keep only this many records, chosen by a hash of each record's content id over the whole "
        "source: the same sample whatever the file order or shard count (shard 0 reads every record; the other "
        "shards have nothing to do); the rest are counted as skipped (sampled_out). Fewer usable records than "
        "this fail the import (exit 64). A pilot run's sample of the full run's source; None keeps every record.",
    )

    tokenizer: str | None = Field(
        default=None,
        description="Prompts only: the target model's directory, local or s3:// (only its tokenizer files are "
        "read). Each prompt is rendered with its chat template and counted: the manifest records the prompts' "
        "tokens, which `plan` reads in place of an estimate. The pipeline sets it to target.uri.",
    )
    enable_thinking: bool = Field(
        default=True, description="With tokenizer: the thinking mode the prompts are rendered in (generate's)."
    )
    max_prompt_tokens: int | None = Field(
        default=None, ge=1,
        description="With tokenizer: a prompt of more tokens is unusable (prompt_too_long), counted at import "
        "instead of at generate. The pipeline sets it to generate's max_model_len - 1.",
    )

    @model_validator(mode="after")
    def _one_layout(self) -> ImportConfig:
        if self.max_prompt_tokens is not None and self.tokenizer is None:
            raise ValueError("max_prompt_tokens is set without tokenizer: prompts are counted with the target's "
                             "tokenizer; set tokenizer to the target model's directory")
        if self.response_field is not None and self.prompt_field is None:
            raise ValueError("response_field is set without prompt_field; set both")
        if self.messages_field is not None and self.prompt_field is not None:
            raise ValueError("messages_field and prompt_field are both set; a source has one layout")
        return self

    def spec(self, kind: Kind) -> ImportSpec:
        layout = Layout(self.id_field, self.messages_field, self.prompt_field, self.response_field, self.system_field)
        if self.tokenizer is not None and kind is not Kind.prompts:
            raise ConfigError("tokenizer counts prompts; an import of completions is counted by the tokenize stage: "
                              "leave --tokenizer out")
        counting = (PromptCounting(self.tokenizer, self.enable_thinking, self.max_prompt_tokens)
                    if self.tokenizer is not None else None)
        return ImportSpec(kind, self.source, self.output, self.run_id, self.max_bad_fraction, self.on_duplicate_id,
                          layout, self.sample_records, counting)


@dataclass(frozen=True)
class PromptCounting:
    """How an import of prompts counts their tokens: the target's tokenizer and thinking mode, and the limit."""

    tokenizer: str  # the target model's directory, local or s3://
    enable_thinking: bool = True
    max_prompt_tokens: int | None = None


@dataclass(frozen=True)
class ImportSpec:
    kind: Kind  # Kind.prompts or Kind.completions
    source_prefix: str
    output_prefix: str
    run_id: str
    max_bad_fraction: float = 0.05
    on_duplicate_id: Literal["keep_first", "refuse"] = "keep_first"
    layout: Layout = field(default_factory=Layout)
    sample_records: int | None = None  # the whole import's sample, drawn by shard 0 over every record
    counting: PromptCounting | None = None  # prompts only: count each one's tokens with the target's tokenizer


def sample_key(record_id: str) -> bytes:
    """The order a sample is drawn in: the lowest keys are kept. A hash of the content id, so the sample is
    the same whatever the files' order or sharding, and unrelated to the held-out split's hash."""
    return hashlib.sha256(f"dflash-sample:{record_id}".encode()).digest()


class _Sample:
    """The `size` records of lowest `sample_key` seen so far (a bounded max-heap), the rest counted out."""

    def __init__(self, size: int) -> None:
        self.size = size
        # (inverted key, arrival, line, where): heap[0] holds the largest key
        self._heap: list[tuple[bytes, int, bytes, str]] = []
        self.arrivals = 0

    def offer(self, record_id: str, line: bytes, where: str) -> bool:
        """Take the record; False when it (or the record it displaced) falls out of the sample."""
        inverted = bytes(255 - b for b in sample_key(record_id))
        self.arrivals += 1
        if len(self._heap) < self.size:
            heapq.heappush(self._heap, (inverted, self.arrivals, line, where))
            return True
        if inverted > self._heap[0][0]:
            heapq.heapreplace(self._heap, (inverted, self.arrivals, line, where))
        return False

    def by_key(self) -> list[tuple[int, bytes, str]]:
        """The candidates (arrival, line, where), lowest key first."""
        return [(arrival, line, where) for _, arrival, line, where in sorted(self._heap, reverse=True)]


# Candidates a sample keeps beyond its size when prompts are counted: the prompts are counted only once drawn (a
# pilot's import reads the whole source, and counting every prompt would cost it minutes), and a drawn prompt that
# is too long gives its place to the next candidate.
SAMPLE_SPARE = 0.05


def _parquet_rows(batch: Any) -> Iterator[Any]:
    """The batch's rows as Python objects; a row pyarrow cannot convert (a string that is not UTF-8)
    becomes a RecordError without costing the others of its batch."""
    try:
        yield from batch.to_pylist()
        return
    except Exception:  # sorted out row by row below
        pass
    for i in range(batch.num_rows):
        try:
            yield batch.slice(i, 1).to_pylist()[0]
        except Exception as err:  # one row's values, counted
            yield RecordError(MALFORMED, f"row cannot be read ({type(err).__name__}: {excerpt(str(err))})")


def _jsonable(value: Any) -> Any:
    """An Arrow value as JSON holds it, the way pandas' to_json writes one: NaN and infinities as null, dates
    and times as ISO text, decimals as text, binary as its UTF-8 text (null when it is no text: an image).
    A column the importer never reads (a timestamp, a score, an image) must not cost the row."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):  # tuples: the (key, value) pairs of a map column
        return [_jsonable(item) for item in value]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | datetime.timedelta):
        return str(value)
    raise TypeError(f"a {type(value).__name__} value has no JSON form")


def _json_row(row: Any) -> Any:
    """A Parquet or dataset row as the JSON value a JSONL line would hold, through the same checks."""
    if isinstance(row, RecordError):
        return row
    try:
        return decode_line(json.dumps(_jsonable(row), ensure_ascii=False, allow_nan=False))
    except LineError as err:
        return RecordError(MALFORMED, str(err))
    except (TypeError, ValueError, RecursionError) as err:
        return RecordError(MALFORMED, f"row is not JSON ({type(err).__name__}: {excerpt(str(err))})")


def _iter_parquet(store: ObjectStore, stripe: Stripe) -> Iterator[tuple[str, Any]]:
    uri, row = stripe.uri, 0
    with store.open_read(uri) as handle:
        source = StorageReads(handle, uri)
        try:
            batches = pq.ParquetFile(source).iter_batches(batch_size=4096)
            for batch in batches:
                rows = batch.num_rows
                mine = [r for r in range(rows) if stripe.holds_row(row + r)]
                if len(mine) < rows:  # only this stripe's rows are converted
                    batch = batch.take(pa.array(mine, pa.int64()))
                for offset, obj in zip(mine, _parquet_rows(batch), strict=True):
                    yield f"{uri}#{row + offset}", _json_row(obj)
                row += rows
        except StorageError:
            raise
        except (OSError, ValueError) as err:  # pyarrow: not Parquet, a corrupt page or footer
            source.raise_failure()
            if stripe.first:
                detail = printable(str(err))[:200]
                yield f"{uri}#{row}", RecordError(
                    UNREADABLE_FILE, f"cannot be read after row {row} ({type(err).__name__}: {detail})")


def iter_source(store: ObjectStore, stripe: Stripe) -> Iterator[tuple[str, Any]]:
    """(file:line or file#row, parsed object or a RecordError) for every record of one stripe of a source file.

    A file that stops decoding part-way yields the records before that point and then one UNREADABLE_FILE
    error (in its first stripe only); a storage failure is raised (retryable), never counted against the data.
    """
    if stripe.uri.endswith(".parquet"):
        yield from _iter_parquet(store, stripe)
        return
    try:
        for number, line in iter_lines(store, stripe.uri):
            if not stripe.holds_line(line):
                continue
            try:
                yield f"{stripe.uri}:{number}", decode_line(line)
            except LineError as err:
                yield f"{stripe.uri}:{number}", RecordError(MALFORMED, str(err))
    except UnreadableFileError as err:
        if stripe.first:
            yield f"{stripe.uri}:{err.line + 1}", RecordError(UNREADABLE_FILE, err.detail)


def iter_item(store: ObjectStore, item: str) -> Iterator[tuple[str, Any]]:
    """(where, object or RecordError) for one work item: a source file or a stripe of one, a saved dataset's
    Arrow file, or a Hub row range; dataset rows pass the same row checks as Parquet rows."""
    if not is_dataset_item(item):
        yield from iter_source(store, parse_stripe(item))
        return
    for where, row in iter_dataset_item(store, item, _parquet_rows):
        yield where, _json_row(row)


def to_prompt(
    messages: list[Message], source: str, tools: tuple[dict[str, Any], ...] | None, source_id: str | None = None
) -> PromptRecord:
    # The last assistant turn (if any) is what the target will regenerate, so it is not part of the prompt.
    while messages and messages[-1].role == "assistant":
        messages = messages[:-1]
    if not any(m.role == "user" and m.content.strip() for m in messages):
        raise RecordError(EMPTY_PROMPT, "no user message with text")
    return PromptRecord(
        id=record_id(messages, tools), messages=tuple(messages), tools=tools, source=source, source_id=source_id
    )


def to_completion(
    messages: list[Message], source: str, tools: tuple[dict[str, Any], ...] | None, finish_reason: str | None = None,
    source_id: str | None = None,
) -> CompletionRecord:
    if messages[-1].role != "assistant":
        raise RecordError(NO_FINAL_ASSISTANT, f"last message is from {messages[-1].role!r}, not the assistant")
    prompt = messages[:-1]
    if not any(m.role == "user" and m.content.strip() for m in prompt):
        raise RecordError(EMPTY_PROMPT, "no user message with text before the assistant turn")
    # The source's finish_reason goes to the quality gate like the engine's: a "length" answer is truncated.
    return CompletionRecord(id=record_id(prompt, tools), messages=tuple(messages), tools=tools, source=source,
                            finish_reason=finish_reason, source_id=source_id)


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
            # Printable and valid Unicode whatever the data held: examples go into logs and the manifest.
            kept.append(printable(f"{where}: {message}")[:500])

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


def _stage_record(obj: Any, where: str, kind: Kind, origin: Kind) -> PromptRecord | CompletionRecord:
    """A record of a stage output (`origin`), copied as it is when the kinds agree, else made a prompt."""
    model = CompletionRecord if origin is Kind.completions else PromptRecord
    try:
        record = model.model_validate(obj)
    except ValidationError as err:
        first = err.errors()[0]
        field_name = ".".join(str(p) for p in first["loc"]) or "record"
        raise RecordError(MALFORMED, f"not a {origin.value} record ({field_name}: {first['msg']})") from None
    if origin is kind:
        return record
    # A completions output imported as prompts: its answers are what the target regenerates.
    return to_prompt(list(record.messages), where, record.tools, record.source_id)


def _convert(obj: Any, where: str, kind: Kind, layout: Layout, origin: Kind | None = None
             ) -> PromptRecord | CompletionRecord:
    if isinstance(obj, RecordError):
        raise obj
    if origin is not None:
        return _stage_record(obj, where, kind, origin)
    obj, source_id = layout.conversation(obj)
    messages, tools = parse_messages(obj), parse_tools(obj)
    if kind is Kind.prompts:
        return to_prompt(messages, where, tools, source_id)
    return to_completion(messages, where, tools, finish_reason=parse_finish_reason(obj), source_id=source_id)


def _item_records(store: ObjectStore, item: str, origin: Kind | None) -> Iterator[tuple[str, Any]]:
    """iter_item; a shard a stage's manifest lists but the store lacks is that input's fault (exit 65), not a
    failure a retry heals."""
    try:
        yield from iter_item(store, item)
    except ObjectNotFoundError:
        if origin is None:
            raise
        raise BadInputError(f"{item}, a shard of the source's {origin.value} manifest, is missing: the output was "
                            "changed after its manifest was written") from None


def _completion_tokens(line: bytes) -> int:
    """Engine tokens of an encoded completion record (0 for imported ones): a copied output's output_tokens."""
    return len(json.loads(line).get("completion_token_ids") or ())


def process_import(ctx: ShardContext, spec: ImportSpec, origin: Kind | None = None) -> ShardOutcome:
    """Import this shard's items; `origin` is the kind of the stage output they are the shards of, if any."""
    tally = _Tally()
    output_tokens = 0
    seen: set[str] = set()
    seen_ids: set[str] = set()  # source ids; memory grows with the shard, like `seen`
    id_counter = tally.failures if spec.on_duplicate_id == "refuse" else tally.skips
    unexpected = 0
    part, writer = 0, None
    # One worker reads every record when sampling (`run_import`); the sample's lines wait in memory until it has.
    counter = _PromptCounter(spec.counting, ctx) if spec.counting is not None else None
    sample = None
    if spec.sample_records is not None:
        spare = math.ceil(SAMPLE_SPARE * spec.sample_records) + 8 if counter is not None else 0
        sample = _Sample(spec.sample_records + spare)
    prompt_tokens = longest = 0

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
        for where, obj in _item_records(ctx.store, uri, origin):
            tally.input_records += 1
            try:
                record = _convert(obj, where, spec.kind, spec.layout, origin)
                line = encode_line(record.model_dump(mode="json", exclude_none=True))
            except RecordError as err:
                tally.reject(tally.failures, err.reason, where, str(err))
                continue
            except MemoryError:
                raise
            except Exception as err:  # one record's values only: no IO happens in this block
                # A record no check above foresaw must cost that record, not the import (and a retry).
                unexpected += 1
                log.warning("%s: unexpected %s converting a record", where, type(err).__name__,
                            exc_info=unexpected <= 3)
                tally.reject(tally.failures, MALFORMED, where, f"unusable record ({type(err).__name__}: "
                             f"{excerpt(str(err))})")
                continue
            source_id, repeated = record.source_id, record.source_id in seen_ids
            if source_id is not None:
                seen_ids.add(source_id)
            if record.id in seen:
                tally.reject(tally.skips, DUPLICATE, where, f"same content as an earlier record ({record.id})")
                continue
            if repeated:  # new content (else it was a duplicate above) under an id already taken
                tally.reject(id_counter, DUPLICATE_ID, where, f"id {source_id!r} was used by an earlier record "
                             "with other content")
                continue
            seen.add(record.id)
            if sample is not None:  # counted once drawn, below
                if not sample.offer(record.id, line, where):
                    tally.skips[SAMPLED_OUT] += 1
                continue
            tokens = 0
            if counter is not None:
                try:
                    tokens = counter.count(record)
                except RecordError as err:
                    tally.reject(tally.failures, err.reason, where, str(err))
                    continue
            if writer is None:
                writer = JsonlZstWriter(os.path.join(ctx.scratch_dir, ctx.part_name(part, ".jsonl.zst")))
            writer.write_line(line)
            tally.succeeded += 1
            prompt_tokens, longest = prompt_tokens + tokens, max(longest, tokens)
            if isinstance(record, CompletionRecord):
                output_tokens += len(record.completion_token_ids or ())
            if writer.records >= RECORDS_PER_PART:
                roll()
        ctx.logger.info("read %s (%d records so far)", uri, tally.input_records)
    if sample is not None:
        drawn: list[tuple[int, bytes, int]] = []  # (arrival, line, prompt tokens), lowest key first
        for arrival, line, where in sample.by_key():
            if len(drawn) == spec.sample_records:
                tally.skips[SAMPLED_OUT] += 1  # a spare the sample did not need
                continue
            tokens = 0
            if counter is not None:
                try:
                    tokens = counter.count(PromptRecord.model_validate_json(line))
                except RecordError as err:
                    tally.reject(tally.failures, err.reason, where, str(err))
                    continue
            drawn.append((arrival, line, tokens))
        for _, line, tokens in sorted(drawn):  # in the order they were read
            if writer is None:
                writer = JsonlZstWriter(os.path.join(ctx.scratch_dir, ctx.part_name(part, ".jsonl.zst")))
            writer.write_line(line)
            tally.succeeded += 1
            prompt_tokens, longest = prompt_tokens + tokens, max(longest, tokens)
            if spec.kind is Kind.completions:
                output_tokens += _completion_tokens(line)
        ctx.logger.info("sample: kept %d of %d usable records (sample_records %d)",
                        tally.succeeded, tally.succeeded + tally.skips[SAMPLED_OUT], spec.sample_records)
    roll()
    accounting = tally.accounting()
    # The bad-record limit is judged on the whole import when it commits (`check_unusable`): a worker's share says
    # little (one file of several, a range of records), and the same input must pass or fail on any shard count.
    # The worker's own counts ride in its outcome, keyed by shard, so the verdict can show them.
    shard = f"shard-{ctx.index:05d}"
    counted = {"prompt_tokens": prompt_tokens, f"{LONGEST_KEY}{shard}": longest} if counter is not None else {}
    return ctx.outcome(accounting, totals={"duplicates": accounting.skips_by_reason.get(DUPLICATE, 0),
                                           "output_tokens": output_tokens,
                                           f"{UNUSABLE_KEY}{shard}": accounting.failed,
                                           f"{READ_KEY}{shard}": accounting.input_records, **counted})


# Outcome totals naming one worker's unusable and read records (`process_import`), for `check_unusable`'s message,
# and its longest prompt (outcome totals are summed, so a maximum is kept per worker).
UNUSABLE_KEY, READ_KEY, LONGEST_KEY = "unusable.", "read.", "longest_prompt."


class _PromptCounter:
    """Each prompt's tokens under the target's chat template and thinking mode (dflash_shared.chat_render)."""

    def __init__(self, counting: PromptCounting, ctx: ShardContext) -> None:
        from dflash_shared.chat_render import ChatRenderer, fetch_tokenizer

        self.limit = counting.max_prompt_tokens
        self.render = ChatRenderer(fetch_tokenizer(ctx.store, counting.tokenizer, ctx.scratch_dir),
                                   counting.enable_thinking)

    def count(self, record: PromptRecord | CompletionRecord) -> int:
        try:
            tokens = len(self.render(record.messages, record.tools))
        except Exception as err:  # the template's own refusal (a jinja raise_exception), of this record only
            raise RecordError(TEMPLATE_REFUSED, f"the target's chat template refuses it ({type(err).__name__}: "
                              f"{excerpt(str(err))})") from None
        if self.limit is not None and tokens > self.limit:
            raise RecordError(PROMPT_TOO_LONG, f"prompt of {tokens:,} tokens, more than max_prompt_tokens "
                              f"{self.limit:,} (generate's max_model_len leaves no room to answer it)")
        return tokens


def check_unusable(spec: ImportSpec, merged: MergedOutcome) -> None:
    """The import's bad-record limit over all of its records: BadInputError naming the counts by reason, each
    worker's share and examples (failures first), and what would change the verdict."""
    accounting = merged.accounting
    if not accounting.input_records or accounting.failed / accounting.input_records <= spec.max_bad_fraction:
        return
    reasons = ", ".join(f"{n:,} {reason}" for reason, n in sorted(accounting.failures_by_reason.items(),
                                                                 key=lambda kv: -kv[1]))
    workers = [(key.removeprefix(UNUSABLE_KEY), int(n), int(merged.totals.get(READ_KEY + key.removeprefix(
        UNUSABLE_KEY), 0))) for key, n in sorted(merged.totals.items()) if key.startswith(UNUSABLE_KEY)]
    shares = "; ".join(f"{shard} {bad:,} of {read:,}" for shard, bad, read in workers)
    failures = [ex for reason in accounting.failures_by_reason for ex in accounting.examples.get(reason, [])[:2]]
    raise BadInputError(
        f"{accounting.failed:,} of {accounting.input_records:,} records of the import are unusable "
        f"({accounting.failed / accounting.input_records:.1%}, more than max_bad_fraction "
        f"{spec.max_bad_fraction:.0%}): {reasons}. By worker: {shares}. For example: " + "; ".join(failures)
        + ".\n" + fix_hints([], env_prefix(ImportConfig), ImportConfig.model_fields, [], accounting.failed,
                            accounting.input_records)
        + "\nThe import's output holds no manifest: after changing the data or the limit, clear it "
          "(`dflash-pipeline restart --config RUN.toml --stage import`) and run the import again.",
        counts=accounting.failures_by_reason,
        examples=accounting.examples,
    )


def check_sample(spec: ImportSpec, merged: MergedOutcome) -> None:
    """A sample that kept fewer records than `sample_records` asked for: ConfigError (exit 64) naming how many the
    source holds, so a pilot never runs on fewer prompts than its counts were planned for."""
    wanted, accounting = spec.sample_records, merged.accounting
    if wanted is None or accounting.succeeded >= wanted:
        return
    left_out = ", ".join(f"{n:,} {reason}" for reason, n in sorted({**accounting.failures_by_reason,
                                                                    **accounting.skips_by_reason}.items()))
    raise ConfigError(
        f"the sample kept {accounting.succeeded:,} records, fewer than sample_records {wanted:,}: the source "
        f"holds only {accounting.succeeded:,} usable records of the {accounting.input_records:,} read"
        + (f" ({left_out})" if left_out else "") + f". Ask for at most {accounting.succeeded:,} (a pilot: "
        "[pilot] prompts in the run file), or import a larger source. The import's output holds no manifest: "
        "clear it (`dflash-pipeline restart --config RUN.toml --stage import`) before running it again."
    )


def _copied_section(origin: CompletionsSection, merged: MergedOutcome) -> CompletionsSection:
    """A copied completions output's section: its target, token ids and sampling, counts of what was copied.

    The window counts and the throughput belong to the generation that made the records, over all of them;
    they are left out rather than restated for a share of them (a sample, records left out as duplicates).
    """
    return origin.model_copy(update={
        "output_tokens": int(merged.totals.get("output_tokens", 0)), "throughput": {}, "truncated_by_budget": None,
        "output_tokens_in_window": None, "window_fraction": None,
    })


def build_import_manifest(spec: ImportSpec, producer: Producer, merged: MergedOutcome,
                          origin: LoadedManifest | None = None) -> Manifest:
    """The import's manifest; one read through a stage's manifest (`origin`) names it as its input."""
    section: PromptsSection | CompletionsSection
    copied = origin.manifest.section if origin is not None else None
    if spec.kind is Kind.prompts:
        longest = [int(n) for key, n in merged.totals.items() if key.startswith(LONGEST_KEY)]
        counted = spec.counting is not None
        section = PromptsSection(sources=[spec.source_prefix], duplicates=int(merged.totals.get("duplicates", 0)),
                                 prompt_tokens=int(merged.totals.get("prompt_tokens", 0)) if counted else None,
                                 longest_prompt_tokens=max(longest, default=0) if counted else None)
    elif isinstance(copied, CompletionsSection):
        section = _copied_section(copied, merged)
    else:
        section = CompletionsSection(target=None, has_token_ids=False)
    return Manifest(
        kind=spec.kind,
        run_id=spec.run_id,
        producer=producer,
        inputs=[origin.as_input()] if origin is not None else [],
        shards=merged.shards,
        accounting=merged.accounting,
        section=section,
    )


def list_sources(store: ObjectStore, prefix: str, kind: Kind = Kind.completions) -> list[str]:
    """The work items of a source (see import_sources): its files, a stage output's shards, a saved dataset's
    Arrow files, or a Hub dataset's row ranges."""
    return resolve_source(store, prefix, kind).items


def run_import(
    store: ObjectStore, spec: ImportSpec, producer: Producer, index: int = 0, count: int = 1,
    identity: StageIdentity | None = None,
) -> str | None:
    """Import this worker's share of the source; the last worker to finish writes the manifest.

    With `identity` (the settings this worker runs with) a shard refuses to add to an output made with others.
    """
    source: ImportSource = resolve_source(store, spec.source_prefix, spec.kind)
    origin = source.origin.manifest.kind if source.origin is not None else None
    if spec.sample_records is None:
        # Files cut into stripes where there are fewer files than workers, so every worker has records to read.
        items, share = stripe_items(source.items, count), assign
    else:
        # A sample is the records of lowest key over the whole source: one worker reads them all, so the sample is
        # the same whatever the shard count (the others finish at once, with nothing to read).
        items, share = source.items, assign_all_to_first
    run_shard(
        f"import-{spec.kind.value}",
        store,
        spec.output_prefix,
        items,
        index,
        count,
        lambda ctx: process_import(ctx, spec, origin),
        identity=identity,
        share=share,
    )

    def build(merged: MergedOutcome) -> Manifest:
        check_unusable(spec, merged)
        check_sample(spec, merged)
        return build_import_manifest(spec, producer, merged, source.origin)

    return finalize(store, spec.output_prefix, count, build, identity=identity)


def import_share(config: ImportConfig, store: ObjectStore, kind: Kind, packages: list[str],
                 shard: tuple[int, int] = (0, 1)) -> str | None:
    """The `import` command of a stage CLI (dflash_shared.commands): this worker's share into a `kind` output,
    recorded as made by `packages` (the image's own)."""
    from dflash_shared.provenance import producer
    from dflash_shared.settings import public_dict
    from dflash_shared.stage_identity import stage_identity

    made = producer("import", public_dict(config), packages)
    index, count = shard
    return run_import(store, config.spec(kind), made, index, count, identity=stage_identity(config))


def start_checks(config: ImportConfig, store: ObjectStore) -> Preflight:
    """What `import` checks before it reads a record: storage access, the source's path, a writable output."""
    checks = Preflight("import", store)
    s3_uris = [uri for uri in (config.source, config.output) if is_s3(uri)]
    if s3_uris:
        checks.credentials(s3_uris[0])

    def source() -> str:
        # A path that is not there is a typo in the settings; an empty folder is the input's problem (65).
        if is_hub_source(config.source) or is_s3(config.source):
            return f"{config.source}: checked when listed"
        if not os.path.exists(config.source):
            raise CheckError(f"source {config.source} does not exist: check --source", ExitCode.USAGE)
        if not os.access(config.source, os.R_OK):
            raise CheckError(f"source {config.source} cannot be read by this user", ExitCode.ENVIRONMENT)
        return f"{config.source} exists"

    def tokenizer() -> str:
        # A tokenizer that is not there would otherwise fail every shard after its source was listed.
        location = str(config.tokenizer)
        found = (checks.store.exists(join(location, "tokenizer.json")) if is_s3(location)
                 else os.path.isfile(os.path.join(location, "tokenizer.json")))
        if not found:
            raise CheckError(f"tokenizer {location} holds no tokenizer.json: point --tokenizer at the target "
                             "model's directory", ExitCode.USAGE)
        return f"{location} has tokenizer.json"

    checks.add("source", source)
    if config.tokenizer is not None:
        checks.add("tokenizer", tokenizer)
    return checks.storage_write(config.output)
