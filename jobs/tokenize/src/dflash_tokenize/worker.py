"""One batch of completion lines -> tokenized sequences plus a verdict for every record.

This is what runs inside each tokenizer process. It is a pure function of its input (given the
settings), so the stage can fan batches out over processes and still write byte-identical shards.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import orjson

from dflash_shared.jsonl import printable
from dflash_shared.processes import die_with_parent
from dflash_shared.quality import MALFORMED, OVER_MAX_LENGTH, QualityPolicy, classify
from dflash_shared.records import CompletionRecord
from dflash_tokenize.arrow_shards import Sequences
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.fast_exact import ExactIds, Parsed, malformed_detail, parse_lines, tokenize_exact
from dflash_tokenize.masking import MaskingError, Tokenized, try_render_batch

# Powers of two up to 1M tokens: the manifest's length histogram buckets.
LENGTH_EDGES = [0] + [2**k for k in range(7, 21)]


def length_bucket(length: int) -> str:
    index = bisect.bisect_right(LENGTH_EDGES, length) - 1
    low = LENGTH_EDGES[index]
    high = LENGTH_EDGES[index + 1] - 1 if index + 1 < len(LENGTH_EDGES) else None
    return f"{low}-{high}" if high is not None else f"{low}+"


@dataclass(frozen=True)
class WorkerSettings:
    tokenizer_dir: str
    mode: Literal["token_exact", "render"]
    mask_policy: Literal["final_turn", "all_turns"]
    enable_thinking: bool
    max_length: int
    over_length: Literal["truncate", "drop"]
    policy: QualityPolicy
    # token_exact mode re-renders this many leading records of a batch to prove the ids match our template.
    verify_records: int = 4
    # Chat template variables besides enable_thinking (TokenizeConfig.template_kwargs).
    template_kwargs: dict[str, bool] = field(default_factory=dict)
    # The records' ids are the generate stage's own engine's (token_exact over its completions): a "length"
    # finish is that stage's budget, and such a record is kept (QualityPolicy.keep_truncated_by_budget). Not for
    # imports, whose limits are unknown, nor render mode, whose template would close the cut turn with an
    # end-of-turn token the target never produced.
    budget_cuts: bool = False


@dataclass
class BatchResult:
    sequences: Sequences
    # (where, reason, detail) of every rejected record, in input order.
    rejected: list[tuple[str, str, str]] = field(default_factory=list)
    truncated: int = 0
    histogram: dict[str, int] = field(default_factory=dict)
    truncated_by_budget: int = 0
    # Loss tokens of the kept records before the max_length cut.
    loss_tokens_before_truncation: int = 0
    # A few input lines per reason (KEPT: of kept records), on which a failing gate tries other settings.
    samples: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)


KEPT = ""
SAMPLES_PER_BATCH = 8  # the stage keeps up to SAMPLES_PER_REASON over its batches


def _samples(lines: list[tuple[str, bytes]], rejected: list[tuple[str, str, str]],
             kept: list[str]) -> dict[str, list[tuple[str, bytes]]]:
    raw = dict(lines)
    out: dict[str, list[tuple[str, bytes]]] = {}
    for where, reason in [*((w, r) for w, r, _ in rejected), *((w, KEPT) for w in kept)]:
        chosen = out.setdefault(reason, [])
        if len(chosen) < SAMPLES_PER_BATCH and where in raw:
            chosen.append((where, raw[where]))
    return out


_chat: ChatFormat | None = None
_settings: WorkerSettings | None = None


def init_worker(settings: WorkerSettings, single_threaded: bool, chat: ChatFormat | None = None,
                parent_pid: int | None = None) -> None:
    """Process initialiser: load the tokenizer once per process (or reuse the caller's, in-process).

    In a pool worker (`parent_pid` given) the worker first ties its life to the stage process's.
    """
    global _chat, _settings
    if parent_pid is not None:
        die_with_parent(parent_pid)
    if single_threaded:
        # Parallelism comes from the process pool; rayon threads inside each process would oversubscribe.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _chat = chat or ChatFormat.from_dir(settings.tokenizer_dir)
    _settings = settings


def _content_tokens(trained: np.ndarray, chat: ChatFormat) -> int:
    """Trained tokens after the last </think>, end-of-turn excluded: the length of the actual answer."""
    if chat.think_end_id is not None:
        ends = np.flatnonzero(trained == chat.think_end_id)
        if ends.size:
            trained = trained[ends[-1] + 1 :]
    return int(trained.size - np.count_nonzero(trained == chat.eot_id))


def _arrays(result: ExactIds | Tokenized) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids int32, loss_mask int8, the trained ids) of one tokenized record."""
    if isinstance(result, ExactIds):
        ids = np.concatenate((result.prompt, result.completion))
        split = result.prompt.size
    else:
        ids = result.ids_array if result.ids_array is not None else np.asarray(result.input_ids, dtype=np.int32)
        split = result.prompt_len
        if result.num_loss_tokens != ids.size - split:
            # Several trained spans (all_turns): the mask as masking built it.
            mask = np.asarray(result.loss_mask, dtype=np.int8)
            return ids, mask, ids[mask.astype(bool)]
    # Loss on exactly the tokens from `split` on (the final turn always runs to the end, so with no other
    # trained span the mask is this): built in numpy, not converted from a list of Python ints.
    mask = np.zeros(ids.size, dtype=np.int8)
    mask[split:] = 1
    return ids, mask, ids[split:]


def _parse(lines: list[tuple[str, bytes]]) -> tuple[list[Parsed], list[tuple[str, str, str]]]:
    parsed, rejected = [], []
    for where, line in lines:
        try:
            parsed.append(Parsed(where, CompletionRecord.model_validate(orjson.loads(line))))
        except MemoryError:
            raise
        except Exception as err:  # orjson's and pydantic's errors, and any other one line's values cause
            rejected.append((where, MALFORMED, malformed_detail(err, line)))
    return parsed, rejected


def _tokenize(lines: list[tuple[str, bytes]], chat: ChatFormat, s: WorkerSettings) -> tuple[
    list[Parsed], list[ExactIds | Tokenized | MaskingError], list[tuple[str, str, str]]
]:
    if s.mode == "render":
        parsed, rejected = _parse(lines)
        records = [item.record for item in parsed]
        rendered = try_render_batch(records, chat, enable_thinking=s.enable_thinking, mask_policy=s.mask_policy,
                                    template_kwargs=s.template_kwargs)
        return parsed, list(rendered), rejected
    parsed, rejected = parse_lines(lines)
    exact = tokenize_exact(parsed, chat, s.enable_thinking, s.verify_records, template_kwargs=s.template_kwargs)
    return parsed, exact, rejected


def process_batch(lines: list[tuple[str, bytes]]) -> BatchResult:
    assert _chat is not None and _settings is not None, "init_worker was not called"
    chat, s = _chat, _settings
    parsed, tokenized, rejected = _tokenize(lines, chat, s)
    order = {where: i for i, (where, _) in enumerate(lines)}

    kept_ids: list[str] = []
    kept_where: list[str] = []
    kept_source_ids: list[str | None] = []
    id_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    truncated = by_budget = loss_before = 0
    histogram: dict[str, int] = {}
    for item, result in zip(parsed, tokenized, strict=True):
        record, where = item.record, item.where
        if isinstance(result, MaskingError):
            rejected.append((where, result.reason, str(result)))
            continue
        ids, mask, trained = _arrays(result)
        answer = record.final_assistant
        thinking = s.enable_thinking if record.enable_thinking is None else record.enable_thinking
        reason = classify(
            content=answer.content,
            reasoning=answer.reasoning_content,
            finish_reason=record.finish_reason,
            thinking_requested=thinking,
            content_tokens=_content_tokens(trained, chat),
            policy=s.policy,
            budget_cut=s.budget_cuts,
            completion_tokens=int(trained.size),
        )
        cut_by_budget = reason is None and s.budget_cuts and record.finish_reason == "length"
        loss_tokens = int(trained.size)
        if reason is None and ids.size > s.max_length:
            if s.over_length == "drop" or not mask[: s.max_length].any():
                reason = OVER_MAX_LENGTH
            else:
                ids, mask = ids[: s.max_length], mask[: s.max_length]
                truncated += 1
        if reason is not None:
            origin = f" (from {printable(record.source)[:300]})" if record.source else ""
            rejected.append((where, reason, f"record {record.id}{origin}: {reason}, {ids.size} tokens"))
            continue
        by_budget += cut_by_budget
        loss_before += loss_tokens
        kept_ids.append(record.id)
        kept_where.append(where)
        kept_source_ids.append(record.source_id)
        id_parts.append(ids)
        mask_parts.append(mask)
        bucket = length_bucket(ids.size)
        histogram[bucket] = histogram.get(bucket, 0) + 1

    rejected.sort(key=lambda item: order.get(item[0], 0))
    lengths = np.fromiter((part.size for part in id_parts), dtype=np.int64, count=len(id_parts))
    offsets = np.zeros(len(id_parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    sequences = Sequences(
        ids=kept_ids,
        input_ids=np.concatenate(id_parts) if id_parts else np.zeros(0, np.int32),
        loss_mask=np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.int8),
        offsets=offsets,
        source_ids=kept_source_ids,
    )
    return BatchResult(sequences, rejected, truncated, histogram, by_budget, loss_before,
                       _samples(lines, rejected, kept_where))
