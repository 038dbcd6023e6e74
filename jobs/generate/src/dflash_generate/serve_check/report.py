"""`serve-check.json`: the engine's acceptance and outputs against the offline evaluation, and the judgments
over them (tau gap, per-step comparison)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_generate.ngram_baseline import BaselineAcceptance, tokens_per_step
from dflash_generate.serve_check.config import ServeCheckConfig
from dflash_generate.serve_steps import StepComparison, compare_steps
from dflash_shared.evaluation_report import OfflineReport
from dflash_shared.lossless import Equivalence


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
    learnability: ServeCheckReport | None = Field(
        default=None, description="The learnability gate's drafter on its memorised prompts, checked the same way.")
    min_acceptance: float | None = Field(
        default=None, description="Learnability gate: least share of drafted tokens the engine must accept.")

    @property
    def engine_acceptance_rate(self) -> float:
        """Drafted tokens the engine accepted, over drafted tokens."""
        return self.engine.accepted_tokens / self.engine.draft_tokens if self.engine.draft_tokens else 0.0


class SpeculativePass(BaseModel):
    """What the speculative engine did: its acceptance counters, outputs and their comparison with plain."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    acceptance: EngineAcceptance
    outputs: list[Generated]
    comparison: Equivalence
    forced_rounds: int


def relative_gap(offline_tau: float, engine_tau: float) -> float:
    return abs(engine_tau - offline_tau) / offline_tau


def matched_acceptance(report: OfflineReport, spec: list[Generated]) -> MatchedAcceptance:
    """Offline vs engine acceptance over the prompts the engine decoded exactly as the offline loop did."""
    pairs = [(r.accepted, g.accepted or []) for r, g in zip(report.results, spec, strict=True)
             if r.output_token_ids == g.token_ids]
    if not pairs or not any(steps for _, steps in pairs):
        return MatchedAcceptance(prompts=len(pairs), offline_tau=None, engine_tau=None, relative_gap=None)
    offline = 1.0 + sum(sum(o) for o, _ in pairs) / sum(len(o) for o, _ in pairs)
    engine = 1.0 + sum(sum(e) for _, e in pairs) / sum(len(e) for _, e in pairs)
    return MatchedAcceptance(prompts=len(pairs), offline_tau=offline, engine_tau=engine,
                             relative_gap=relative_gap(offline, engine))


def step_comparison(report: OfflineReport, spec: list[Generated], max_fraction: float) -> StepComparison:
    """Each prompt the engine decoded as the offline loop did, step by step (serve_steps.py)."""
    engine = [(g.accepted or [], g.drafted) if r.output_token_ids == g.token_ids else None
              for r, g in zip(report.results, spec, strict=True)]
    return compare_steps([r.id for r in report.results], [r.accepted for r in report.results], engine,
                         report.block_size - 1, max_fraction)


def check_report(config: ServeCheckConfig, report: OfflineReport, dtype: str, served: SpeculativePass,
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
