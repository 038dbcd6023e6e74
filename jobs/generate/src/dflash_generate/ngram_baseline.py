"""The speculation a user would run instead of training a drafter: vLLM's n-gram prompt lookup.

It needs no training: each step it looks for the last `prompt_lookup_min..max` tokens earlier in the prompt
or output and drafts what followed them. The serving check can measure it on the same prompts, in the same
engine settings, beside the trained drafter (`ngram_baseline`), so a run's evaluation says how much training
bought over the free alternative.

Two figures, because vLLM's counters count a draft only on steps that drafted something: engine tau
(1 + accepted / drafts, vLLM's own) flatters a method that often proposes nothing, as n-gram does without a
match. Tokens per step counts every target step, the prefill's (which emits each prompt's first token) too:
each step emits its accepted tokens plus one, so the steps are output tokens - accepted tokens, and at least
drafts + prompts (every drafting step, and each prompt's prefill). The larger of the two is the count: for a
drafter that drafts on every step (DFlash) drafts + prompts is exact, where the first undercounts because the
counters also count tokens accepted past a stop or the token budget and then dropped; for n-gram the first
can undercount by those dropped tokens too, at most one draft's worth per prompt.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class NgramSettings(BaseModel):
    """vLLM's `ngram` speculative method settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_speculative_tokens: int = Field(default=3, ge=1, description="Tokens drafted per step.")
    prompt_lookup_min: int = Field(default=1, ge=1, description="Shortest suffix matched against the context.")
    prompt_lookup_max: int = Field(default=4, ge=1, description="Longest suffix matched against the context.")

    def speculative_config(self) -> dict[str, Any]:
        return {"method": "ngram", **self.model_dump()}

    def label(self) -> str:
        return (f"min {self.prompt_lookup_min} max {self.prompt_lookup_max}, "
                f"{self.num_speculative_tokens} drafted")


def tokens_per_step(output_tokens: int, accepted_tokens: int, drafts: int, prompts: int) -> float:
    """Output tokens per target step, steps that drafted nothing and the prefills included (module docstring)."""
    steps = max(output_tokens - accepted_tokens, drafts + prompts)
    return output_tokens / steps if steps > 0 else 0.0


class BaselineAcceptance(BaseModel):
    """What the n-gram engine did on the serving check's prompts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    settings: NgramSettings
    tau: float = Field(description="1 + accepted / drafts (vLLM's counters: drafting steps only).")
    drafts: int = Field(description="Steps that drafted at least one token.")
    accepted_tokens: int = Field(description="Draft tokens the target accepted.")
    output_tokens: int = Field(description="Tokens generated over all prompts.")
    tokens_per_step: float = Field(
        description="output_tokens / max(output_tokens - accepted_tokens, drafts + prompts): every step counted.")
    outputs_identical: int = Field(description="Prompts whose output equals plain decoding's.")
