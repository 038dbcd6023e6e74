"""One batch of completion lines -> tokenized sequences plus a verdict for every record.

This is what runs inside each tokenizer process. It is a pure function of its input (given the
settings), so the stage can fan batches out over processes and still write byte-identical shards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import orjson
from pydantic import ValidationError

from dflash_shared.quality import MALFORMED, OVER_MAX_LENGTH, QualityPolicy, classify
from dflash_shared.records import CompletionRecord
from dflash_tokenize.arrow_shards import Sequences
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.masking import MaskingError, Tokenized, token_exact, try_render_batch

# Powers of two up to 1M tokens: the manifest's length histogram buckets.
LENGTH_EDGES = [0] + [2**k for k in range(7, 21)]


def length_bucket(length: int) -> str:
    index = int(np.searchsorted(LENGTH_EDGES, length, side="right")) - 1
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


@dataclass
class BatchResult:
    sequences: Sequences
    # (where, reason, detail) of every rejected record, in input order.
    rejected: list[tuple[str, str, str]] = field(default_factory=list)
    truncated: int = 0
    histogram: dict[str, int] = field(default_factory=dict)


_chat: ChatFormat | None = None
_settings: WorkerSettings | None = None


def init_worker(settings: WorkerSettings, single_threaded: bool, chat: ChatFormat | None = None) -> None:
    """Process initialiser: load the tokenizer once per process (or reuse the caller's, in-process)."""
    global _chat, _settings
    if single_threaded:
        # Parallelism comes from the process pool; rayon threads inside each process would oversubscribe.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _chat = chat or ChatFormat.from_dir(settings.tokenizer_dir)
    _settings = settings


def _content_tokens(ids: np.ndarray, mask: np.ndarray, chat: ChatFormat) -> int:
    """Trained tokens after the last </think>, end-of-turn excluded: the length of the actual answer."""
    trained = ids[mask.astype(bool)]
    if chat.think_end_id is not None:
        ends = np.flatnonzero(trained == chat.think_end_id)
        if ends.size:
            trained = trained[ends[-1] + 1 :]
    return int(trained.size - np.count_nonzero(trained == chat.eot_id))


def _parse(lines: list[tuple[str, bytes]]) -> tuple[list[tuple[str, CompletionRecord]], list[tuple[str, str, str]]]:
    parsed, rejected = [], []
    for where, line in lines:
        try:
            parsed.append((where, CompletionRecord.model_validate(orjson.loads(line))))
        except (orjson.JSONDecodeError, ValidationError) as err:
            detail = str(err).splitlines()[0] if isinstance(err, orjson.JSONDecodeError) else (
                f"{err.error_count()} schema error(s), first: {err.errors()[0]['loc']}: {err.errors()[0]['msg']}"
            )
            rejected.append((where, MALFORMED, detail))
    return parsed, rejected


def _tokenize(records: list[CompletionRecord], chat: ChatFormat, s: WorkerSettings) -> list[Tokenized | MaskingError]:
    if s.mode == "render":
        return try_render_batch(records, chat, enable_thinking=s.enable_thinking, mask_policy=s.mask_policy)
    out: list[Tokenized | MaskingError] = []
    for record in records:
        try:
            out.append(token_exact(record))
        except MaskingError as err:
            out.append(err)
    # Spot check: the template we were given must render the prompt to the very ids the engine saw;
    # if not, the tokenizer or template differs from the generator's and every record is suspect.
    sample = [r for r, t in zip(records, out, strict=True) if isinstance(t, Tokenized)][: s.verify_records]
    for checked in try_render_batch(sample, chat, enable_thinking=s.enable_thinking, mask_policy="final_turn"):
        if isinstance(checked, MaskingError):
            index = next(i for i, r in enumerate(records) if r.id == checked.record_id)
            out[index] = checked
    return out


def process_batch(lines: list[tuple[str, bytes]]) -> BatchResult:
    assert _chat is not None and _settings is not None, "init_worker was not called"
    chat, s = _chat, _settings
    parsed, rejected = _parse(lines)
    order = {where: i for i, (where, _) in enumerate(lines)}
    tokenized = _tokenize([r for _, r in parsed], chat, s)

    kept_ids: list[str] = []
    id_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    truncated = 0
    histogram: dict[str, int] = {}
    for (where, record), result in zip(parsed, tokenized, strict=True):
        label = f"record {record.id}"
        if isinstance(result, MaskingError):
            rejected.append((where, result.reason, str(result)))
            continue
        ids = np.asarray(result.input_ids, dtype=np.int32)
        mask = np.asarray(result.loss_mask, dtype=np.int8)
        answer = record.final_assistant
        thinking = s.enable_thinking if record.enable_thinking is None else record.enable_thinking
        reason = classify(
            content=answer.content,
            reasoning=answer.reasoning_content,
            finish_reason=record.finish_reason,
            thinking_requested=thinking,
            content_tokens=_content_tokens(ids, mask, chat),
            policy=s.policy,
        )
        if reason is None and ids.size > s.max_length:
            if s.over_length == "drop" or not mask[: s.max_length].any():
                reason = OVER_MAX_LENGTH
            else:
                ids, mask = ids[: s.max_length], mask[: s.max_length]
                truncated += 1
        if reason is not None:
            rejected.append((where, reason, f"{label}: {reason}, {ids.size} tokens"))
            continue
        kept_ids.append(record.id)
        id_parts.append(ids)
        mask_parts.append(mask)
        bucket = length_bucket(ids.size)
        histogram[bucket] = histogram.get(bucket, 0) + 1

    rejected.sort(key=lambda item: order.get(item[0], 0))
    lengths = np.fromiter((part.size for part in id_parts), dtype=np.int64, count=len(id_parts))
    sequences = Sequences(
        ids=kept_ids,
        input_ids=np.concatenate(id_parts) if id_parts else np.zeros(0, np.int32),
        loss_mask=np.concatenate(mask_parts) if mask_parts else np.zeros(0, np.int8),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    )
    return BatchResult(sequences, rejected, truncated, histogram)
