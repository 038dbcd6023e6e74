"""vLLM started and driven for the check: the plain, speculative and n-gram passes, the engine's counters, and
the teacher-forced comparison past near-ties."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from dflash_generate import context_k_norm
from dflash_generate.engine import EngineConfig, engine_flavour, only_dtype
from dflash_generate.ngram_baseline import BaselineAcceptance, NgramSettings, tokens_per_step
from dflash_generate.serve_check.config import ServeCheckConfig
from dflash_generate.serve_check.report import EngineAcceptance, Generated, SpeculativePass
from dflash_generate.target import TargetInfo, read_target
from dflash_shared.errors import BadInputError, ConfigError
from dflash_shared.evaluation_report import OfflineReport
from dflash_shared.lossless import (
    ENGINE_LOGPROBS,
    Comparing,
    Equivalence,
    NumericsPolicy,
    Parting,
    Step,
    first_difference,
    judge,
)
from dflash_shared.progress import Progress

log = logging.getLogger(__name__)
METRIC_PREFIX = "vllm:spec_decode_"


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


@contextlib.contextmanager
def started_engine(engine: EngineConfig, speculative: dict[str, Any] | None) -> Iterator[tuple[Any, float]]:
    """A vLLM `LLM` (with stats on, so spec-decode counters exist, per request too) and its start-up seconds.

    With a DFlash drafter, first checks that vLLM's engine processes will run the context-key norm self-test
    (context_k_norm.py: vLLM 0.32's CPU kernel normalises every layer's context keys with layer 0's k_norm)."""
    from vllm import LLM

    if speculative and speculative.get("method") == "dflash":
        context_k_norm.ensure_registered()
    began = time.monotonic()
    per_request: dict[str, Any] = {"per_request_spec_decode_metrics": "detailed"} if speculative else {}
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


def generate(llm: Any, report: OfflineReport, logprobs: int | None = None, label: str = "") -> list[Generated]:
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


def forced_comparison(llm: Any, report: OfflineReport, plain: list[Generated], speculative: list[Generated],
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
        comparing.add(out.top_logprobs or [None] * len(out.token_ids), partings[i])
    return comparing.result(), rounds


def generate_continuations(llm: Any, report: OfflineReport, prefixes: dict[int, list[int]]) -> dict[int, Generated]:
    """Greedy continuations (with top log-probabilities) of prompt i + prefixes[i], within the offline budget."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    order = sorted(prefixes)
    prompts = [TokensPrompt(prompt_token_ids=[*report.results[i].prompt_token_ids, *prefixes[i]]) for i in order]
    params = [SamplingParams(temperature=0.0, max_tokens=report.max_new_tokens - len(prefixes[i]),
                             stop_token_ids=report.stop_token_ids, detokenize=False, logprobs=ENGINE_LOGPROBS)
              for i in order]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {i: _generated(o) for i, o in zip(order, outs, strict=True)}


def speculative_pass(llm: Any, report: OfflineReport, plain: list[Generated],
                     policy: NumericsPolicy) -> SpeculativePass:
    """Generate the report's prompts with the speculative engine (counters read around it), then compare with
    the plain outputs, teacher-forced past near-ties."""
    before = spec_counters(llm.get_metrics())
    outputs = generate(llm, report, logprobs=ENGINE_LOGPROBS, label="speculative")
    acceptance = engine_acceptance(before, spec_counters(llm.get_metrics()))
    comparison, rounds = forced_comparison(llm, report, plain, outputs, policy)
    return SpeculativePass(acceptance=acceptance, outputs=outputs, comparison=comparison, forced_rounds=rounds)


def ngram_pass(llm: Any, report: OfflineReport, plain: list[Generated], settings: NgramSettings,
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


def engine_config(config: ServeCheckConfig, report: OfflineReport, target_dir: str) -> EngineConfig:
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


def speculative_config(export_dir: str, report: OfflineReport) -> dict[str, Any]:
    """vLLM's speculative_config for the export at the offline evaluation's block size."""
    return {"method": "dflash", "model": export_dir, "num_speculative_tokens": report.block_size - 1}
