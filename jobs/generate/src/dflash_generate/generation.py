"""One worker's share of the generate stage: its chunks through the engine, each committed as it finishes.

The engine is kept full across chunk boundaries (it is topped up as requests finish); a chunk is written
and receipted the moment its last prompt is resolved. The first completions are classified by the shared
quality rules: when most of the first `fail_fast_window` are degenerate (empty, missing the requested
thinking, repetitive, cut off before min_content_tokens), the worker stops with BadInputError before it
spends its GPU hours. A completion stopped at the budget (the training window's end) is not degenerate: each
chunk receipt counts it as truncated_by_budget, with the completion tokens inside the training window.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dflash_generate.chunks import Chunk, ChunkReceipt, PromptReader, Rejected, load_receipts, receipt_uri
from dflash_generate.completion import GenerationOutcome
from dflash_generate.engine import VllmEngine, engine_flavour
from dflash_generate.worker_status import WorkerStatus
from dflash_shared.errors import BadInputError, Preempted
from dflash_shared.jsonl import JsonlZstWriter
from dflash_shared.manifests import Accounting, SpecialTokens
from dflash_shared.progress import Progress, human_rate
from dflash_shared.progress_report import DEFAULT_INTERVAL_S
from dflash_shared.quality import EarlyDegenerateDetector, QualityPolicy, classify
from dflash_shared.records import CompletionRecord, PromptRecord
from dflash_shared.runner import ShardContext, ShardOutcome, merge_accounting
from dflash_shared.window import DEFAULT_TRAINING_WINDOW, completion_in_window

log = logging.getLogger(__name__)
EXAMPLES_PER_REASON = 5

EngineProvider = Callable[[], contextlib.AbstractContextManager[VllmEngine]]


@dataclass(frozen=True)
class WorkerPlan:
    """What a worker needs besides its chunks: the fixed settings of the run."""

    enable_thinking: bool
    sampling: Any  # dflash_generate.sampling.SamplingConfig
    max_inflight: int
    policy: QualityPolicy
    fail_fast_window: int
    fail_fast_max_bad_fraction: float
    special_tokens: SpecialTokens
    input_sha256: str
    settings_sha256: str
    gpus_per_engine: int
    # The window the completions are accounted against (tokens inside it, per chunk receipt).
    training_window: int = DEFAULT_TRAINING_WINDOW
    # Seconds between the worker's status reports in the store (`worker_status`).
    progress_every_s: float = DEFAULT_INTERVAL_S


class GenerationProgress(Progress):
    """The shared progress line, plus the output tokens per second of each GPU the engine uses (on the CPU
    build: of the engine process, which is what a CPU run compares)."""

    def __init__(self, total: int, desc: str, gpus: int, on_gpu: bool = True) -> None:
        super().__init__(total=total, unit="prompts", desc=desc)
        self.gpus = max(gpus, 1) if on_gpu else 1
        self.per = "per GPU" if on_gpu else "per CPU engine process"
        self._started = time.monotonic()

    def _per_gpu(self) -> str:
        elapsed = time.monotonic() - self._started
        rate = self.extra.get("output_tokens", 0) / elapsed / self.gpus if elapsed > 0 else 0.0
        return f", {human_rate(rate, 'tok')} {self.per}"

    def line(self, now: float | None = None) -> str:
        return super().line(now) + self._per_gpu()

    def summary(self, status: str = "done", reason: str = "") -> str:
        return super().summary(status, reason) + self._per_gpu()


def content_tokens(completion_ids: tuple[int, ...], special: SpecialTokens) -> int:
    """Answer tokens: after the last think-close token, end-of-turn excluded (as the tokenize stage counts)."""
    ids = list(completion_ids)
    if special.think_end is not None and special.think_end in ids:
        ids = ids[len(ids) - ids[::-1].index(special.think_end) :]
    return sum(1 for token in ids if token != special.end_of_turn)


def degenerate_reason(record: CompletionRecord, plan: WorkerPlan) -> str | None:
    answer = record.final_assistant
    completion = record.completion_token_ids or ()
    return classify(
        content=answer.content,
        reasoning=answer.reasoning_content,
        finish_reason=record.finish_reason,
        thinking_requested=plan.enable_thinking,
        content_tokens=content_tokens(completion, plan.special_tokens),
        policy=plan.policy,
        # Every "length" finish here is this engine's budget (max_new_tokens or the window's end).
        budget_cut=True,
        completion_tokens=len(completion),
    )


def is_truncated_by_budget(record: CompletionRecord, reason: str | None, plan: WorkerPlan) -> bool:
    """A completion stopped at the budget and kept for training (what `classify` let through)."""
    return record.finish_reason == "length" and reason is None and plan.policy.keep_truncated_by_budget


@dataclass
class ChunkState:
    """A pending chunk: which of its prompts are resolved, and how."""

    chunk: Chunk
    records: dict[int, CompletionRecord] = field(default_factory=dict)
    failures: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    degenerate: Counter[str] = field(default_factory=Counter)
    truncated_by_budget: int = 0
    resolved: int = 0
    read_done: bool = False
    committed: bool = False

    def _example(self, reason: str, text: str) -> None:
        kept = self.examples.setdefault(reason, [])
        if len(kept) < EXAMPLES_PER_REASON:
            kept.append(text)

    def reject(self, where: str, rejected: Rejected) -> None:
        (self.skips if rejected.skipped else self.failures)[rejected.reason] += 1
        self._example(rejected.reason, f"{where}: {rejected.detail}")
        self.resolved += 1

    def resolve(self, position: int, where: str, outcome: GenerationOutcome) -> None:
        if outcome.record is not None:
            self.records[position] = outcome.record
        else:
            reason = str(outcome.failure)
            self.failures[reason] += 1
            self._example(reason, f"{where}: {outcome.detail}")
        self.resolved += 1

    @property
    def complete(self) -> bool:
        return self.read_done and self.resolved == self.chunk.size and not self.committed

    def accounting(self) -> Accounting:
        return Accounting(
            input_records=self.chunk.size,
            succeeded=len(self.records),
            failed=sum(self.failures.values()),
            skipped=sum(self.skips.values()),
            failures_by_reason=dict(self.failures),
            skips_by_reason=dict(self.skips),
            examples=self.examples,
        )


class ChunkCommitter:
    """Writes a finished chunk's file and then its receipt (the commit point)."""

    def __init__(self, ctx: ShardContext, plan: WorkerPlan) -> None:
        self.ctx = ctx
        self.plan = plan
        self.receipts: dict[str, ChunkReceipt] = {}
        self._last = time.monotonic()

    def restart_clock(self) -> None:
        self._last = time.monotonic()

    def commit(self, state: ChunkState) -> ChunkReceipt:
        chunk, ctx = state.chunk, self.ctx
        ordered = [state.records[p] for p in sorted(state.records)]
        prompt_tokens = sum(len(r.prompt_token_ids or ()) for r in ordered)
        output_tokens = sum(len(r.completion_token_ids or ()) for r in ordered)
        window = self.plan.training_window
        in_window = sum(completion_in_window(len(r.prompt_token_ids or ()), len(r.completion_token_ids or ()),
                                             window) for r in ordered)
        shard = None
        if ordered:
            path = os.path.join(ctx.scratch_dir, chunk.data_name)
            with JsonlZstWriter(path) as writer:
                for record in ordered:
                    writer.write(record.model_dump(mode="json", exclude_none=True))
            shard = ctx.publish(path, chunk.data_name, len(ordered), tokens=prompt_tokens + output_tokens)
            os.unlink(path)
        now = time.monotonic()
        # Engine time is split at commits, so the sum over chunks is the time spent producing them.
        seconds, self._last = now - self._last, now
        receipt = ChunkReceipt(
            item=chunk.item,
            input_sha256=self.plan.input_sha256,
            settings_sha256=self.plan.settings_sha256,
            shard=shard,
            accounting=state.accounting(),
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            engine_seconds=round(seconds, 3),
            degenerate=dict(state.degenerate),
            truncated_by_budget=state.truncated_by_budget,
            training_window=window,
            output_tokens_in_window=in_window,
        )
        ctx.store.write_bytes(receipt_uri(ctx.output_prefix, chunk), receipt.model_dump_json(indent=2).encode())
        state.committed = True
        self.receipts[chunk.item] = receipt
        return receipt


def generate_chunks(
    ctx: ShardContext, plan: WorkerPlan, pending: list[Chunk], reader: PromptReader, engine_provider: EngineProvider,
    status: WorkerStatus | None = None,
) -> dict[str, ChunkReceipt]:
    """Generate `pending` chunks in order through one engine; returns their receipts. `status` gets the counts."""
    states = {chunk.item: ChunkState(chunk) for chunk in pending}
    committer = ChunkCommitter(ctx, plan)
    detector = EarlyDegenerateDetector(window=plan.fail_fast_window, max_bad_fraction=plan.fail_fast_max_bad_fraction)

    def requests() -> Iterator[tuple[tuple[str, int, str], PromptRecord]]:
        for chunk in pending:
            state = states[chunk.item]
            for position, (where, parsed) in enumerate(reader.read(chunk)):
                if isinstance(parsed, Rejected):
                    state.reject(where, parsed)
                    progress.update(1)
                else:
                    yield (chunk.item, position, where), parsed
            state.read_done = True
        reader.close()

    def commit_ready() -> None:
        for state in states.values():
            if state.complete:
                receipt = committer.commit(state)
                acc = receipt.accounting
                ctx.logger.info("committed %s: %d completions, %d failed, %d skipped, %d output tokens",
                                state.chunk.name, acc.succeeded, acc.failed, acc.skipped, receipt.output_tokens)
                if status is not None:
                    status.chunk_committed()

    with engine_provider() as engine:
        # Started after the engine, so rates and ETA measure generation, not model loading.
        progress = GenerationProgress(sum(c.size for c in pending), f"generate worker {ctx.index}",
                                      plan.gpus_per_engine, on_gpu=engine_flavour() == "cuda")
        committer.restart_clock()
        if status is not None:
            status.generating(progress.total or 0)
        stream = engine.stream(requests(), plan.enable_thinking, plan.sampling, plan.max_inflight)
        with progress, contextlib.closing(stream):
            for (item, position, where), outcome in stream:
                states[item].resolve(position, where, outcome)
                record = outcome.record
                tokens = len(record.completion_token_ids or ()) if record else 0
                if record is not None:
                    reason = degenerate_reason(record, plan)
                    if reason is not None:
                        states[item].degenerate[reason] += 1
                    elif is_truncated_by_budget(record, reason, plan):
                        states[item].truncated_by_budget += 1
                    detector.observe(f"prompt {record.id}", reason, f"{tokens} tokens, finish {record.finish_reason}")
                    verdict = detector.verdict()
                    if verdict is not None:
                        raise BadInputError(f"generate worker {ctx.index}: {verdict}", counts=dict(detector.counts.bad),
                                            examples=detector.counts.examples)
                progress.update(1, output_tokens=tokens)
                if status is not None:
                    status.update(progress.n, progress.extra.get("output_tokens", 0))
                commit_ready()
        commit_ready()  # chunks whose last lines never reached the engine
    left = [s.chunk.name for s in states.values() if not s.committed]
    if left:
        raise RuntimeError(f"generate worker {ctx.index}: chunks {left[:3]} were not completed")
    return committer.receipts


def check_degenerate(index: int, totals: Counter[str], max_fraction: float) -> None:
    """The whole worker's verdict: a pod with fewer prompts than the fail-fast window is judged here.

    Computed from the committed chunks' receipts, so a rerun that adopts them reaches the same verdict.
    """
    completions = totals.get("completions", 0)
    bad = {k.split(".", 1)[1]: n for k, n in totals.items() if k.startswith("degenerate.") and n}
    if completions and sum(bad.values()) / completions > max_fraction:
        raise BadInputError(
            f"generate worker {index}: {sum(bad.values())} of {completions} completions are degenerate "
            f"(limit {max_fraction:.0%}): {bad}",
            counts=bad,
        )


def window_totals(receipt: ChunkReceipt, window: int) -> dict[str, int]:
    """A receipt's budget cuts and in-window tokens for the worker's totals. A receipt committed before these
    were counted, or counted against another window (an accounting setting only, so the chunk was adopted),
    is tallied as `receipts_uncounted` instead: the manifest then leaves those figures unknown."""
    by_budget, in_window = receipt.truncated_by_budget, receipt.output_tokens_in_window
    if by_budget is None or in_window is None or receipt.training_window != window:
        return {"receipts_uncounted": 1}
    return {"truncated_by_budget": by_budget, "output_tokens_in_window": in_window}


def worker_totals(receipts: list[ChunkReceipt], window: int) -> Counter[str]:
    """Tokens, completions, degenerate completions by reason and window accounting over a worker's receipts."""
    totals: Counter[str] = Counter()
    for receipt in receipts:
        totals.update(prompt_tokens=receipt.prompt_tokens, output_tokens=receipt.output_tokens,
                      completions=receipt.accounting.succeeded)
        totals.update({f"degenerate.{reason}": n for reason, n in receipt.degenerate.items()})
        totals.update(window_totals(receipt, window))
    return totals


def process_shard(
    ctx: ShardContext, plan: WorkerPlan, chunks_by_item: dict[str, Chunk], reader: PromptReader,
    engine_provider: EngineProvider,
) -> ShardOutcome:
    """The runner's `process`: adopt committed chunks, generate the rest, sum up the worker's outcome."""
    chunks = [chunks_by_item[item] for item in ctx.items]
    receipts = load_receipts(ctx.store, ctx.output_prefix, chunks, plan.input_sha256, plan.settings_sha256)
    pending = [c for c in chunks if c.item not in receipts]
    ctx.logger.info("%d chunk(s), %d committed by an earlier attempt, %d to generate (%d prompts)", len(chunks),
                    len(receipts), len(pending), sum(c.size for c in pending))
    status = WorkerStatus(ctx.store, ctx.output_prefix, ctx.index, ctx.count, len(chunks), len(receipts),
                          plan.progress_every_s)
    try:
        if pending:
            receipts.update(generate_chunks(ctx, plan, pending, reader, engine_provider, status))
        ordered = [receipts[c.item] for c in chunks]
        totals = worker_totals(ordered, plan.training_window)
        check_degenerate(ctx.index, totals, plan.fail_fast_max_bad_fraction)
    except BaseException as err:
        status.finish("stopped" if isinstance(err, Preempted) else "failed")
        raise
    status.finish("done")
    engine_seconds = sum(r.engine_seconds for r in ordered)
    return ShardOutcome(
        shard_index=ctx.index,
        shard_count=ctx.count,
        # Chunk order is input order; chunk files may have been committed out of it.
        shards=sorted((r.shard for r in ordered if r.shard is not None), key=lambda s: s.uri),
        accounting=merge_accounting(r.accounting for r in ordered),
        totals={**totals, "engine_seconds": round(engine_seconds, 3), "chunks": len(chunks),
                "chunks_resumed": len(chunks) - len(pending)},
    )
