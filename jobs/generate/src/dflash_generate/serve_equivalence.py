"""When greedy output with speculative decoding counts as identical to output without it.

Speculative decoding is lossless up to hardware numerics: the engine verifies B drafted tokens in one forward
pass, where the plain engine decodes one token per pass, so the same logits are reduced in another order. In
float32 the difference is far below any margin between two tokens, and the outputs must be equal token for
token. In bfloat16 (and float16) a logit is rounded to 8 (11) significant bits: at a logit of 16-32 one bf16
step is 0.125 nats, so two candidates within a step or two of each other can swap places when the reduction
order changes, and from there on the two texts legitimately differ. The policy, per prompt:

* the outputs are equal, or
* they are equal up to their first parting, and there the plain engine's own log-probability of its token exceeds
  that of the speculative run's token by at most `tie_margin` nats (the plain run is asked for its top two
  log-probabilities, so a speculative token outside them is a real difference): a near-tie, counted, not failed.
  Nothing after a parting is compared: the two runs continue from different prefixes.

and over the run: at most `max_tie_fraction` of the prompts may part at a near-tie (rounding flips a rare near-tie;
a drafter or engine bug that nudges logits shows up as many of them). In float32 neither allowance applies.
A failure names the first parting that broke the policy: prompt id, token index, both tokens and the margin.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

# Dtypes whose rounding can swap near-tied tokens between a verification pass and a one-token step.
REDUCED_PRECISION = ("bfloat16", "float16")


class Decoded(NamedTuple):
    """One prompt's two greedy outputs, and the plain run's top log-probabilities per position."""

    prompt_id: str
    speculative: Sequence[int]
    plain: Sequence[int]
    plain_top_logprobs: Sequence[Mapping[int, float]] | None


class Parting(BaseModel):
    """Where a prompt's two outputs first differ."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_id: str
    index: int = Field(description="Position in the completion (0 = first generated token).")
    speculative_token: int | None = Field(description="The speculative run's token there; None: its output ended.")
    plain_token: int | None = Field(description="The plain run's token there; None: its output ended.")
    margin: float | None = Field(description="Plain run's log-probability of its token minus that of the speculative "
                                 "token (nats); None when the latter is not among its top log-probabilities.")
    tie: bool = Field(description="Counted as a near-tie under the policy (rounding), not a difference.")

    def describe(self) -> str:
        spec = "end of output" if self.speculative_token is None else self.speculative_token
        plain = "end of output" if self.plain_token is None else self.plain_token
        if self.margin is None:
            why = ("one output ends there" if None in (self.speculative_token, self.plain_token)
                   else "the speculative token is not among the plain run's top log-probabilities")
        else:
            why = f"plain run's margin {self.margin:.4g} nats"
        return f"prompt {self.prompt_id} at token {self.index}: speculative {spec}, plain {plain} ({why})"


class OutputPolicy(BaseModel):
    """The allowances at one engine dtype (none in float32)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: str
    tie_margin: float | None = Field(description="Near-tie margin in nats; None: exact equality required.")
    max_tie_fraction: float = Field(description="Largest share of prompts that may part at a near-tie.")

    @classmethod
    def at(cls, dtype: str, tie_margin: float, max_tie_fraction: float) -> OutputPolicy:
        if dtype in REDUCED_PRECISION:
            return cls(dtype=dtype, tie_margin=tie_margin, max_tie_fraction=max_tie_fraction)
        return cls(dtype=dtype, tie_margin=None, max_tie_fraction=0.0)

    def describe(self) -> str:
        if self.tie_margin is None:
            return f"{self.dtype}: exact equality required"
        return (f"{self.dtype}: partings at near-ties within {self.tie_margin:g} nats allowed on up to "
                f"{self.max_tie_fraction:.0%} of prompts")


class OutputComparison(BaseModel):
    """Speculative against plain outputs over a run, under a policy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: OutputPolicy
    prompts: int
    identical: int = Field(description="Prompts whose two outputs are equal token for token.")
    partings: list[Parting] = Field(description="First parting of every prompt whose outputs differ, in prompt order.")

    @property
    def ties(self) -> list[Parting]:
        return [p for p in self.partings if p.tie]

    @property
    def mismatches(self) -> list[Parting]:
        return [p for p in self.partings if not p.tie]

    def failure(self) -> str | None:
        """Why the outputs break the policy (naming the first offending parting), or None."""
        if self.mismatches:
            first = self.mismatches[0]
            allowed = "" if self.policy.tie_margin is None else f" > tie margin {self.policy.tie_margin:g}"
            return (f"greedy output with speculative decoding differs from output without it on "
                    f"{len(self.mismatches)}/{self.prompts} prompts ({self.policy.describe()}); first: "
                    f"{first.describe()}{allowed if first.margin is not None else ''}; "
                    f"prompts {[p.prompt_id for p in self.mismatches[:3]]}")
        ties = self.ties
        if self.prompts and len(ties) > self.policy.max_tie_fraction * self.prompts:
            return (f"{len(ties)}/{self.prompts} prompts part at near-ties, more than the "
                    f"{self.policy.max_tie_fraction:.0%} rounding explains ({self.policy.describe()}); first: "
                    f"{ties[0].describe()}")
        return None


def first_parting(decoded: Decoded, tie_margin: float | None) -> Parting | None:
    """The first position where the two outputs differ (None when equal), with the plain run's margin there."""
    spec, plain = decoded.speculative, decoded.plain
    at = next((i for i, (a, b) in enumerate(zip(spec, plain, strict=False)) if a != b), min(len(spec), len(plain)))
    if at == len(spec) == len(plain):
        return None
    spec_token = spec[at] if at < len(spec) else None
    plain_token = plain[at] if at < len(plain) else None
    margin = None
    top = decoded.plain_top_logprobs
    if spec_token is not None and plain_token is not None and top is not None and at < len(top):
        if spec_token in top[at] and plain_token in top[at]:
            margin = top[at][plain_token] - top[at][spec_token]
    tie = margin is not None and tie_margin is not None and math.isfinite(margin) and margin <= tie_margin
    return Parting(prompt_id=decoded.prompt_id, index=at, speculative_token=spec_token, plain_token=plain_token,
                   margin=margin, tie=tie)


def compare(decoded: Iterable[Decoded], policy: OutputPolicy) -> OutputComparison:
    """Every prompt's first parting under the policy; `failure()` of the result says whether the run passes."""
    prompts = identical = 0
    partings = []
    for one in decoded:
        prompts += 1
        parting = first_parting(one, policy.tie_margin)
        if parting is None:
            identical += 1
        else:
            partings.append(parting)
    return OutputComparison(policy=policy, prompts=prompts, identical=identical, partings=partings)
