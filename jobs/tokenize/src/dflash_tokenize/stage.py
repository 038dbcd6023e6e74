"""The tokenize stage: a completions manifest in, loss-masked Arrow shards and a tokenized manifest out.

Per worker (one Kubernetes Indexed Job pod): resolve the input manifest and check it against the target's
tokenizer and template, take this worker's completion shards, stream their lines in batches through a pool
of tokenizer processes (order kept, so output is byte-identical whatever the pool size), set the records
whose id hashes into the held-out split apart (`split`: their own Arrow files under data/heldout/, which
training never reads), gate the result on the bad-record fraction, publish rolling Arrow files, mark the
shard done; the last worker to finish writes the manifest.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dflash_shared.chat_render import fetch_tokenizer
from dflash_shared.errors import BadInputError
from dflash_shared.jsonl import iter_lines
from dflash_shared.manifest_io import LoadedManifest, check_compatible, load_manifest
from dflash_shared.manifests import (
    Accounting,
    CompletionsSection,
    HeldoutSplit,
    Kind,
    Manifest,
    Shard,
    SpecialTokens,
    TargetIdentity,
    TokenizedSection,
)
from dflash_shared.progress import Progress
from dflash_shared.provenance import producer
from dflash_shared.quality import fix_hints, gate_exceeded
from dflash_shared.runner import MergedOutcome, ShardContext, ShardOutcome, finalize, resolve_shard, run_shard
from dflash_shared.scratch import make_scratch
from dflash_shared.settings import env_prefix, public_dict
from dflash_shared.stage_identity import StageIdentity, stage_identity
from dflash_shared.storage import ObjectStore
from dflash_shared.window import window_fraction
from dflash_tokenize import hints, resume, split, worker
from dflash_tokenize.arrow_shards import FinishedFile, RollingArrowWriter, Sequences
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.config import TokenizeConfig

log = logging.getLogger(__name__)
STAGE = "tokenize"
# Records per reason (and kept ones) a failed gate tries other settings on: enough for "most", seconds of work.
SAMPLES_PER_REASON = 32
PACKAGES = ["dflash-tokenize", "tokenizers", "transformers", "pyarrow", "pydantic"]


def embedding_rows(directory: str, chat: ChatFormat) -> int:
    """Rows of the target's embedding: its config's vocab_size (often past the tokenizer's last id, as in
    Qwen3, whose DFlash mask token 151669 is such a row), else the tokenizer's size."""
    path = os.path.join(directory, "config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            vocab = json.load(handle).get("vocab_size")
        if isinstance(vocab, int):
            return vocab
    return int(chat.tokenizer.get_vocab_size())


@dataclass(frozen=True)
class Resolved:
    """Everything decided before work starts: checked input, effective mode and thinking, target identity."""

    config: TokenizeConfig
    source: LoadedManifest[CompletionsSection]
    tokenizer_dir: str
    chat: ChatFormat
    mode: str
    enable_thinking: bool
    target: TargetIdentity
    # The share of records held out (split.effective_fraction over the input manifest's record count).
    heldout_fraction: float

    def worker_settings(self) -> worker.WorkerSettings:
        return worker.WorkerSettings(
            tokenizer_dir=self.tokenizer_dir,
            mode=self.mode,  # type: ignore[arg-type]
            mask_policy=self.config.mask_policy,
            enable_thinking=self.enable_thinking,
            max_length=self.config.max_length,
            over_length=self.config.over_length,
            policy=self.config.quality_policy(),
            template_kwargs=self.config.template_kwargs(),
            budget_cuts=self.budget_cuts,
        )

    @property
    def budget_cuts(self) -> bool:
        """Whether a "length" finish is the generate stage's own budget (see worker.WorkerSettings)."""
        return self.mode == "token_exact" and self.source.section.target is not None


def open_source(store: ObjectStore, config: TokenizeConfig, chat: ChatFormat,
                ) -> tuple[LoadedManifest[CompletionsSection], bool]:
    """Load the completions manifest and check it was made with this tokenizer, template and thinking mode.

    Returns the manifest and the effective thinking mode. Each worker re-hashes the input shards it
    downloads (fetch_verified), so shards are not re-hashed here.
    """
    source = load_manifest(store, config.input, Kind.completions, verify=False)
    generated = source.section.target
    enable_thinking = config.enable_thinking
    if enable_thinking is None:
        enable_thinking = generated.enable_thinking if generated else True
    if generated is not None:
        # The pitfall that collapses served acceptance: data made with one template, trained with another.
        check_compatible(source.uri, source.manifest, {
            "target.tokenizer_sha256": chat.tokenizer_sha256,
            "target.chat_template_sha256": chat.chat_template_sha256,
            "target.enable_thinking": enable_thinking,
        })
    return source, enable_thinking


def resolve(config: TokenizeConfig, store: ObjectStore, scratch: str) -> Resolved:
    tokenizer_dir = fetch_tokenizer(store, config.tokenizer, scratch)
    chat = ChatFormat.from_dir(tokenizer_dir)
    source, enable_thinking = open_source(store, config, chat)
    section = source.section
    generated = section.target
    mode = config.mode
    if mode == "auto":
        mode = "token_exact" if section.has_token_ids else "render"
    if mode == "token_exact" and not section.has_token_ids:
        raise BadInputError(f"{source.uri} has no token ids (imported data?): use --mode render")
    rows = embedding_rows(tokenizer_dir, chat)
    if config.mask_token_id is not None and not 0 <= config.mask_token_id < rows:
        raise BadInputError(f"mask_token_id {config.mask_token_id} is not a row of the target's {rows} embeddings")
    target = TargetIdentity(
        model_id=config.model_id or (generated.model_id if generated else config.tokenizer),
        revision=config.model_revision or (generated.revision if generated else None),
        tokenizer_sha256=chat.tokenizer_sha256,
        chat_template_sha256=chat.chat_template_sha256,
        enable_thinking=enable_thinking,
        special_tokens=SpecialTokens(
            end_of_turn=chat.eot_id,
            think_start=chat.think_start_id,
            think_end=chat.think_end_id,
            mask=config.mask_token_id,
        ),
    )
    heldout = split.effective_fraction(config.heldout_fraction, config.heldout_min_records,
                                       source.manifest.total_records)
    return Resolved(config, source, tokenizer_dir, chat, mode, enable_thinking, target, heldout)


def fetch_verified(store: ObjectStore, shard: Shard, scratch: str) -> str:
    """Download one input shard and check it against its manifest entry before a byte of it is used."""
    local = os.path.join(scratch, "in-" + hashlib.sha256(shard.uri.encode()).hexdigest()[:16] + "-" +
                         os.path.basename(shard.uri))
    store.download_to(shard.uri, local)
    size, digest = os.path.getsize(local), store.sha256(local)
    if (size, digest) != (shard.bytes, shard.sha256):
        raise BadInputError(f"input shard {shard.uri} does not match its manifest: {size} bytes sha256 {digest}, "
                            f"expected {shard.bytes} bytes sha256 {shard.sha256}")
    return local


def prefetched(store: ObjectStore, shards: list[Shard], scratch: str, ahead: int = 2) -> Iterator[tuple[Shard, str]]:
    """Input shards downloaded in parallel, `ahead` of the one being tokenised; each deleted after use."""
    with ThreadPoolExecutor(max_workers=ahead) as pool:
        pending: deque[tuple[Shard, Future[str]]] = deque()
        queue = iter(shards)
        for shard in queue:
            pending.append((shard, pool.submit(fetch_verified, store, shard, scratch)))
            if len(pending) > ahead:
                break
        while pending:
            shard, future = pending.popleft()
            next_shard = next(queue, None)
            if next_shard is not None:
                pending.append((next_shard, pool.submit(fetch_verified, store, next_shard, scratch)))
            local = future.result()
            try:
                yield shard, local
            finally:
                # Gone already when the stage stopped on a signal and removed its scratch before this
                # generator was closed: nothing left to delete, and nothing to report.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(local)


def line_batches(
    store: ObjectStore, shards: list[Shard], scratch: str, size: int
) -> Iterator[list[tuple[str, bytes]]]:
    batch: list[tuple[str, bytes]] = []
    for shard, local in prefetched(store, shards, scratch):
        for number, line in iter_lines(store, local):
            batch.append((f"{shard.uri}:{number}", line))
            if len(batch) >= size:
                yield batch
                batch = []
    if batch:
        yield batch


def ordered_map(resolved: Resolved, workers: int, batches: Iterator[Any]) -> Iterator[worker.BatchResult]:
    """process_batch over batches in input order, with at most 2 batches per process in flight (bounded RAM)."""
    settings = resolved.worker_settings()
    if workers <= 1:
        worker.init_worker(settings, single_threaded=False, chat=resolved.chat)
        yield from map(worker.process_batch, batches)
        return
    # Forked workers inherit the tokenizer already loaded here (copy-on-write) instead of each parsing
    # tokenizer.json again, a second of CPU and hundreds of MB apiece; elsewhere each loads its own.
    fork = "fork" in multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork") if fork else None
    chat = resolved.chat if fork else None
    with ProcessPoolExecutor(workers, mp_context=context, initializer=worker.init_worker,
                             initargs=(settings, True, chat, os.getpid())) as pool:
        # Start the workers before reading starts its download threads: a fork copies only the calling
        # thread, and a lock another thread held at that instant would stay locked in the child. The
        # inherited objects are frozen for the fork so that the workers' garbage collections neither
        # walk them nor copy their pages; the parent thaws its own at once.
        gc.freeze()
        try:
            pool.submit(int).result()
        finally:
            gc.unfreeze()
        pending: deque[Future[worker.BatchResult]] = deque()
        for batch in batches:
            pending.append(pool.submit(worker.process_batch, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _count(state: resume.State, result: worker.BatchResult, heldout: Sequences, end: int) -> None:
    """Add one batch's verdicts and sums to the shard's running state, which now stands at `end`."""
    state.position = end
    state.totals.update(heldout_records=len(heldout), heldout_tokens=int(heldout.offsets[-1]),
                        heldout_loss_tokens=int(heldout.loss_mask.sum()))
    for where, reason, detail in result.rejected:
        state.gate.observe(where, reason, detail)
    kept = len(result.sequences)
    state.gate.observe_good(kept)
    state.totals.update(tokens=int(result.sequences.offsets[-1]), loss_tokens=int(result.sequences.loss_mask.sum()),
                        sequences=kept, truncated_to_max_length=result.truncated,
                        truncated_by_budget=result.truncated_by_budget,
                        loss_tokens_before_truncation=result.loss_tokens_before_truncation)
    state.histogram.update(result.histogram)


def _resumed(batches: Iterator[list[tuple[str, bytes]]], plan: resume.Plan, fraction: float,
             meta: deque[tuple[str | None, int]]) -> Iterator[list[tuple[str, bytes]]]:
    """The batches still to tokenise; `meta` gets (None, end) for each new one, (writer, end) for each replayed."""
    end = 0
    for lines in batches:
        start, end = end, end + len(lines)
        if end > plan.position:
            meta.append((None, end))
            yield lines
            continue
        behind, needed = plan.needed(lines, start, fraction)
        if needed:
            meta.append((behind, end))
            yield needed


def process_shard(ctx: ShardContext, resolved: Resolved) -> ShardOutcome:
    config = resolved.config
    plan = resume.plan(ctx.published_before())
    for record in plan.reused:
        ctx.reuse(record.shard)
    if plan.reused:
        ctx.logger.info("reusing %d file(s) published before the interruption (sizes and sha256 verified); "
                        "resuming after input record %d", len(plan.reused), plan.position)
    state = plan.state
    order = {record.shard.uri: resume.order_key(record) for record in plan.reused}
    samples: dict[str, list[tuple[str, bytes]]] = {}  # input lines the gate's hints are tried on
    replaying = [False]

    def writer_for(part: split.Split) -> RollingArrowWriter:
        # Held-out files go to data/heldout/, under the same part names as the training files beside them.
        folder = "heldout/" if part == "heldout" else ""
        local = os.path.join(ctx.scratch_dir, part)
        os.makedirs(local, exist_ok=True)

        def publish(finished: FinishedFile) -> None:
            # A file completed while replaying has no state of its own to record: a rerun rewrites it.
            checkpoint = None if replaying[0] else state.to_json()
            shard = ctx.publish(finished.path, folder + os.path.basename(finished.path), finished.records,
                                tokens=finished.tokens, split=part, checkpoint=checkpoint)
            order[shard.uri] = (state.position, resume.SPLITS.index(part))
            os.unlink(finished.path)

        return RollingArrowWriter(local, lambda p: ctx.part_name(p, ".arrow"), config.shard_bytes, publish,
                                  first_part=plan.parts[part])

    writers = {"train": writer_for("train"), "heldout": writer_for("heldout")}
    workers = config.workers or len(os.sched_getaffinity(0))
    by_uri = {shard.uri: shard for shard in resolved.source.manifest.shards}
    meta: deque[tuple[str | None, int]] = deque()
    batches = _resumed(line_batches(ctx.store, [by_uri[uri] for uri in ctx.items], ctx.scratch_dir,
                                         config.batch_records), plan, resolved.heldout_fraction, meta)
    # Every line of this shard's files is one record (bad ones included), so the manifest's counts give the total.
    total = sum(by_uri[uri].records for uri in ctx.items) - plan.position
    with Progress(total=total, unit="records", desc=f"tokenize shard {ctx.index}") as progress:
        for result in ordered_map(resolved, workers, batches):
            behind, end = meta.popleft()
            train, heldout = split.partition(result.sequences, resolved.heldout_fraction)
            if behind is not None:  # records a reused file's writer already has are not written nor counted
                replaying[0] = True
                writers[behind].write(train if behind == "train" else heldout)
                replaying[0] = False
                continue
            _count(state, result, heldout, end)
            for reason, lines in result.samples.items():
                chosen = samples.setdefault(reason, [])
                chosen.extend(lines[: SAMPLES_PER_REASON - len(chosen)])
            writers["train"].write(train)
            writers["heldout"].write(heldout)
            progress.update(len(result.sequences) + len(result.rejected), tokens=int(result.sequences.offsets[-1]))
    for each in writers.values():
        each.close_current()
    ctx.published.sort(key=lambda shard: order[shard.uri])
    gate = state.gate
    if gate_exceeded(gate, config.max_bad_fraction):
        computed = hints.suggest(resolved.worker_settings(), resolved.chat, samples, resolved.source.section,
                                 config.max_bad_fraction)
        raise BadInputError(
            f"tokenize shard {ctx.index}: too much bad input (limit {config.max_bad_fraction:.0%}). " + gate.report()
            + "\n" + fix_hints([h.reason for h in computed], env_prefix(TokenizeConfig), TokenizeConfig.model_fields,
                               computed, gate.bad_total, gate.seen),
            counts=dict(gate.bad),
            examples=gate.examples,
        )
    accounting = Accounting(
        input_records=gate.seen,
        succeeded=gate.seen - gate.bad_total,
        failed=gate.bad_total,
        skipped=0,
        failures_by_reason=dict(gate.bad),
        examples=gate.examples,
    )
    return ctx.outcome(accounting, totals=dict(state.totals), histograms={"length": dict(state.histogram)})


def build_manifest(resolved: Resolved, merged: MergedOutcome) -> Manifest:
    config = resolved.config
    acc = merged.accounting
    if acc.input_records and acc.failed / acc.input_records > config.max_bad_fraction:
        raise BadInputError(
            f"tokenize: {acc.failed} of {acc.input_records} records unusable: {acc.failures_by_reason}\n"
            + fix_hints([], env_prefix(TokenizeConfig), TokenizeConfig.model_fields, [], acc.failed, acc.input_records))
    loss_tokens = int(merged.totals.get("loss_tokens", 0))
    loss_before = int(merged.totals.get("loss_tokens_before_truncation", 0))
    return Manifest(
        kind=Kind.tokenized,
        run_id=config.run_id or resolved.source.manifest.run_id,
        producer=producer(STAGE, public_dict(config), PACKAGES),
        inputs=[resolved.source.as_input()],
        shards=merged.shards,
        accounting=acc,
        section=TokenizedSection(
            target=resolved.target,
            mode=resolved.mode,  # type: ignore[arg-type]
            mask_policy=config.mask_policy,
            max_length=config.max_length,
            total_tokens=int(merged.totals.get("tokens", 0)),
            loss_tokens=loss_tokens,
            length_histogram=merged.histograms.get("length", {}),
            truncated_by_budget=int(merged.totals.get("truncated_by_budget", 0)),
            truncated_to_max_length=int(merged.totals.get("truncated_to_max_length", 0)),
            loss_tokens_before_truncation=loss_before,
            window_fraction=window_fraction(loss_tokens, loss_before),
            heldout=HeldoutSplit(
                fraction=config.heldout_fraction,
                min_records=config.heldout_min_records,
                input_records=resolved.source.manifest.total_records,
                effective_fraction=resolved.heldout_fraction,
                records=int(merged.totals.get("heldout_records", 0)),
                tokens=int(merged.totals.get("heldout_tokens", 0)),
                loss_tokens=int(merged.totals.get("heldout_loss_tokens", 0)),
            ),
        ),
    )


# Settings that change how the work is spread over processes or disks, never a byte of the output: a shard may
# reuse files published under other values, and the shards of one output may run with other values.
_NOT_IN_OUTPUT = ("workers", "scratch_dir", "disk_need_gib")


def settings_identity(config: TokenizeConfig) -> StageIdentity:
    """The settings every shard of one tokenized output must share (see dflash_shared.stage_identity)."""
    return stage_identity(config, exclude=_NOT_IN_OUTPUT)


def fingerprint(resolved: Resolved) -> str:
    """What the bytes of a shard's files depend on besides its items: a rerun reuses files only if it matches."""
    settings = {k: v for k, v in public_dict(resolved.config).items() if k not in _NOT_IN_OUTPUT}
    effective = {"mode": resolved.mode, "thinking": resolved.enable_thinking, "heldout": resolved.heldout_fraction,
                 "target": resolved.target.model_dump(mode="json"), "settings": settings}
    return hashlib.sha256(json.dumps(effective, sort_keys=True).encode("utf-8")).hexdigest()


def run(config: TokenizeConfig, store: ObjectStore | None = None, shard: tuple[int, int] | None = None) -> str | None:
    """Run this worker's shard (`shard`: (index, count) as the CLI entry resolved it, default from the config and
    the environment); returns the manifest URI once the last shard is done."""
    store = store or ObjectStore()
    index, count = shard or resolve_shard(config.shard_index, config.num_shards)
    scratch = make_scratch("dflash-tokenize-", config.scratch_dir)  # removes what killed runs left behind
    try:
        resolved = resolve(config, store, scratch)
        items = [shard.uri for shard in resolved.source.manifest.shards]
        log.info("mode %s, thinking %s, template variables %s, %d completion shards, worker %d/%d, held-out "
                 "fraction %.4f of %d input records", resolved.mode, resolved.enable_thinking,
                 config.template_kwargs() or "default", len(items), index, count, resolved.heldout_fraction,
                 resolved.source.manifest.total_records)
        made_with = settings_identity(config)
        run_shard(STAGE, store, config.output, items, index, count, lambda ctx: process_shard(ctx, resolved),
                  scratch_root=scratch, fingerprint=fingerprint(resolved), identity=made_with)
        return finalize(store, config.output, count, lambda merged: build_manifest(resolved, merged),
                        identity=made_with)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
