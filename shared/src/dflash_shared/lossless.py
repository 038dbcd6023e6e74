"""One numerics policy for "greedy output with speculative decoding equals output without it".

Both the offline evaluation (`dflash-train evaluate`, the trainer's loop against transformers' greedy decoding)
and the serving check (`dflash-generate serve-check`, vLLM with and without the drafter) judge their two outputs
here, so "lossless" means the same thing in both images.

Why a policy at all: speculative decoding verifies B tokens in one forward pass where plain decoding runs one
token per pass, so the same logits are reduced in another order (and, in an engine, by other kernels: prefill-style
for verification, decode-style for plain steps). In float32 the difference is far below any margin between two
tokens and the outputs must be equal token for token. In bfloat16 (float16) a logit keeps 8 (11) significant bits:
at a logit of 16-32 one bfloat16 step is 0.125 nats, so two candidates within a step or two of each other can swap
places between the two runs, and that is rounding, not a wrong drafter or verifier.

The policy, in bfloat16/float16, at every position where the two outputs part:

* it is a rounding flip (a near-tie) only when BOTH runs show it in their OWN log-probabilities: each run's token
  is the best of its own distribution (margin >= 0) and the other run's token is within `tie_margin` nats of it
  (the offline loop reads it from the full distribution, the engine from its top `ENGINE_LOGPROBS`). A verifier
  that wrongly accepts a draft token shows it in its own log-probabilities: the token it committed is not its own
  best one (negative margin), however close the two are;
* after a near-tie the comparison goes on teacher-forced: the speculative side continues from the plain run's token
  (the offline loop commits it, the engine is asked again with the plain prefix), so every later position is still
  compared, not just the first parting of a prompt;
* the run's own numerics set how many near-tie partings rounding explains: rounding can part the two runs only where
  the plain run's own top two tokens are within `tie_margin` nats (a near-tie position; the plain run keeps its top
  log-probabilities at every position), and at most `max_near_tie_share` of those positions may part. A target with
  flat distributions (random weights, a large vocabulary) has many near-tie positions and gets a large allowance; a
  trained one, whose top token usually leads by nats, gets a small one. A verifier or drafter path whose logits are
  off by less than the margin flips near-ties far more often than rounding does (docs/numerics.md).

A parting that is not a near-tie fails the run, naming prompt, position, both tokens and both margins; forcing stops
for that prompt there (the run has failed already). In float32 no allowance applies: the first parting fails.

Pure Python (no torch): the serving check's image has no trainer and the trainer's has no engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field

# Dtypes whose rounding can swap near-tied tokens between a verification pass and a one-token step.
REDUCED_PRECISION = ("bfloat16", "float16")
# Log-probabilities the offline loop keeps per position on each side, beside the other side's token, which it
# reads from the full distribution: a rounding flip swaps the top two.
TOP_LOGPROBS = 2
# The engine returns only its top-k log-probabilities and the committed token's (vLLM: SamplingParams(logprobs=k),
# at most its `max_logprobs`, 20 by default), so a parting's margins can be judged only where each side's token is
# among the other side's k. On a flat distribution (a random-weight target, 40-50% of positions near-ties) three or
# more tokens can lie within the margin: with k = 2 a rounding flip among three was counted a real difference
# (seen on the random-weight Qwen3.6 fixture). The margins, not the rank, decide a near-tie.
ENGINE_LOGPROBS = 20
# Defaults (figures from `make bench-numerics` and the serving checks in docs/numerics.md). Margin:
# two bfloat16 steps at logits of 16-32 (a logit of a large model's head rounds to a step of 0.125-0.25 nats, and
# a reduction in another order moves it by a step or two); the near-ties measured here had margins of 0.0039 and
# 0.0078 nats. Share: rounding can part the runs only at the plain run's near-tie positions (its own top two within
# the margin), and there only where the two runs' logits move apart by more than that position's margin: with
# margins spread over [0, tie_margin] and moves of a step or two (0.008-0.016 nats at these logits), about 3-6% of
# them. Measured (`make bench-numerics`, 16 prompts x 48 tokens per target, bfloat16): 308 and 385 near-tie
# positions of 768 on the random-weight dense and Qwen3.6 targets (flat distributions: 40-50% of positions), 0 and
# 1 partings (0% and 0.26% of their near-ties). 25% leaves 4x the model's worst case and ~100x what was seen; the
# bound is a backstop, since a verifier that accepts wrong drafts fails on its first one anyway (its own
# log-probabilities rank the token it committed below the other run's).
DEFAULT_TIE_MARGIN = 0.25
DEFAULT_MAX_NEAR_TIE_SHARE = 0.25


class Step(NamedTuple):
    """One side's token at one position and that side's own log-probabilities there (token -> nats)."""

    token: int | None  # None: this side's output ended before the position
    logprobs: Mapping[int, float] | None


class Parting(BaseModel):
    """A position where the speculative and the plain output differ, judged under the policy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_id: str
    index: int = Field(description="Position in the completion (0 = first generated token).")
    speculative_token: int | None = Field(description="The speculative run's token; None: its output ended.")
    plain_token: int | None = Field(description="The plain run's token; None: its output ended.")
    speculative_margin: float | None = Field(
        description="Speculative run's own log-probability of its token minus that of the plain token (nats); "
        "negative: it committed a token its own distribution ranks lower; None: the plain token is not among "
        "its top log-probabilities (or either side ended).")
    plain_margin: float | None = Field(
        description="Plain run's own log-probability of its token minus that of the speculative token (nats); "
        "None: the speculative token is not among its top log-probabilities (or either side ended).")
    tie: bool = Field(description="A near-tie in both runs (rounding), counted, not failed.")

    def describe(self) -> str:
        spec = "end of output" if self.speculative_token is None else self.speculative_token
        plain = "end of output" if self.plain_token is None else self.plain_token
        return (f"prompt {self.prompt_id} at token {self.index}: speculative {spec}, plain {plain} "
                f"(speculative margin {_nats(self.speculative_margin)}, plain margin {_nats(self.plain_margin)})")


def _nats(margin: float | None) -> str:
    return "not in its top log-probabilities" if margin is None else f"{margin:.4g} nats"


class NumericsPolicy(BaseModel):
    """The allowances at one dtype (none in float32)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: str
    tie_margin: float | None = Field(description="Near-tie margin in nats; None: exact equality required.")
    max_near_tie_share: float = Field(
        description="Largest share of the plain run's near-tie positions (its own top two within tie_margin) that "
        "may part.")

    @classmethod
    def at(cls, dtype: str, tie_margin: float = DEFAULT_TIE_MARGIN,
           max_near_tie_share: float = DEFAULT_MAX_NEAR_TIE_SHARE) -> NumericsPolicy:
        if dtype in REDUCED_PRECISION:
            return cls(dtype=dtype, tie_margin=tie_margin, max_near_tie_share=max_near_tie_share)
        return cls(dtype=dtype, tie_margin=None, max_near_tie_share=0.0)

    def describe(self) -> str:
        if self.tie_margin is None:
            return f"{self.dtype}: exact equality required"
        return (f"{self.dtype}: near-ties in both runs within {self.tie_margin:g} nats allowed on up to "
                f"{self.max_near_tie_share:.0%} of the plain run's near-tie positions")

    def allowed_ties(self, near_tie_positions: int) -> int:
        """How many near-tie partings rounding explains over a run with this many near-tie positions.

        Rounded up: one flip is never more than rounding explains (a run with a single near-tie may flip it).
        """
        return math.ceil(self.max_near_tie_share * near_tie_positions - 1e-9)


class NumericsSettings(BaseModel):
    """The policy's two settings, as fields of a stage config (evaluate and serve-check share them)."""

    tie_margin: float = Field(
        default=DEFAULT_TIE_MARGIN, ge=0, description="bfloat16/float16: speculative and plain output may part only "
        "where both runs' own top two log-probabilities are within this many nats (rounding); float32 requires "
        "identical outputs (dflash_shared.lossless).",
    )
    max_near_tie_share: float = Field(
        default=DEFAULT_MAX_NEAR_TIE_SHARE, ge=0, le=1, description="bfloat16/float16: largest share of the plain "
        "run's near-tie positions (its own top two within tie_margin: the only places rounding can part the runs) "
        "that may part at near-ties.",
    )

    def numerics_policy(self, dtype: str) -> NumericsPolicy:
        return NumericsPolicy.at(dtype, self.tie_margin, self.max_near_tie_share)


def _margin(own: Step, other: Step) -> float | None:
    """own token's log-probability minus the other token's, in own's distribution; None when not both known."""
    if own.token is None or other.token is None or own.logprobs is None:
        return None
    if own.token not in own.logprobs or other.token not in own.logprobs:
        return None
    margin = own.logprobs[own.token] - own.logprobs[other.token]
    return margin if math.isfinite(margin) else None


def judge(prompt_id: str, index: int, speculative: Step, plain: Step, policy: NumericsPolicy) -> Parting:
    """A parting at `index` (the tokens differ), called a near-tie only when both runs' own margins allow it."""
    spec_margin, plain_margin = _margin(speculative, plain), _margin(plain, speculative)
    return Parting(prompt_id=prompt_id, index=index, speculative_token=speculative.token, plain_token=plain.token,
                   speculative_margin=spec_margin, plain_margin=plain_margin,
                   tie=judge_margins(spec_margin, plain_margin, policy))


def judge_margins(speculative_margin: float | None, plain_margin: float | None, policy: NumericsPolicy) -> bool:
    """A near-tie: both runs' own tokens are their best, the other's within the policy's margin."""
    limit = policy.tie_margin
    return (limit is not None and speculative_margin is not None and plain_margin is not None
            and 0 <= speculative_margin <= limit and 0 <= plain_margin <= limit)


def is_near_tie(logprobs: Mapping[int, float] | None, tie_margin: float) -> bool:
    """Whether one position's own top two log-probabilities are within `tie_margin` nats (unknown: no)."""
    if not logprobs or len(logprobs) < 2:
        return False
    best, second = sorted(logprobs.values(), reverse=True)[:2]
    return math.isfinite(best - second) and best - second <= tie_margin


def first_difference(speculative: Sequence[int], plain: Sequence[int]) -> int | None:
    """First index where the two token lists differ (a shorter list differs where it ends), or None."""
    at = next((i for i, (a, b) in enumerate(zip(speculative, plain, strict=False)) if a != b), None)
    if at is not None:
        return at
    return None if len(speculative) == len(plain) else min(len(speculative), len(plain))


class Equivalence(BaseModel):
    """Speculative against plain outputs over a run, teacher-forced past near-ties, under a policy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: NumericsPolicy
    prompts: int = Field(description="Prompts compared.")
    positions: int = Field(description="Positions compared: the plain outputs' tokens.")
    near_tie_positions: int = Field(
        default=0, description="Compared positions where the plain run's own top two are within tie_margin: the "
        "only places rounding can part the two runs (0 in float32, where none is allowed).")
    identical: int = Field(description="Prompts whose outputs are equal token for token.")
    partings: list[Parting] = Field(
        description="Every parting, in prompt order; after a parting that is not a near-tie a prompt is not "
        "compared further.")

    @property
    def ties(self) -> list[Parting]:
        return [p for p in self.partings if p.tie]

    @property
    def mismatches(self) -> list[Parting]:
        return [p for p in self.partings if not p.tie]

    @property
    def parted_fraction(self) -> float:
        """Near-tie partings per compared position (reported; the bound is on the near-tie positions)."""
        return len(self.ties) / self.positions if self.positions else 0.0

    @property
    def near_tie_share(self) -> float:
        """Near-tie partings per near-tie position of the plain run."""
        return len(self.ties) / self.near_tie_positions if self.near_tie_positions else 0.0

    def summary(self) -> str:
        return (f"{self.identical}/{self.prompts} prompts identical, {len(self.ties)} near-tie parting(s) at "
                f"{self.near_tie_positions} near-tie positions of {self.positions} ({self.near_tie_share:.1%}), "
                f"{len(self.mismatches)} difference(s); {self.policy.describe()}")

    def failure(self) -> str | None:
        """Why the outputs break the policy (naming the first offending parting), or None."""
        if self.mismatches:
            first = self.mismatches[0]
            margin = "" if self.policy.tie_margin is None else f", tie margin {self.policy.tie_margin:g} nats"
            return (f"greedy output with speculative decoding differs from output without it on "
                    f"{len({p.prompt_id for p in self.mismatches})}/{self.prompts} prompts "
                    f"({self.policy.describe()}); first: {first.describe()}{margin}; "
                    f"prompts {sorted({p.prompt_id for p in self.mismatches})[:3]}")
        allowed = self.policy.allowed_ties(self.near_tie_positions)
        if len(self.ties) > allowed:
            return (f"{len(self.ties)} of the plain run's {self.near_tie_positions} near-tie positions (of "
                    f"{self.positions} compared) part, more than the {allowed} rounding explains "
                    f"({self.policy.describe()}); first: {self.ties[0].describe()}")
        return None


class Comparing:
    """Collects one run's partings prompt by prompt; `result()` is the Equivalence."""

    def __init__(self, policy: NumericsPolicy) -> None:
        self.policy = policy
        self._prompts = self._positions = self._near_ties = self._identical = 0
        self._partings: list[Parting] = []

    def add(self, plain_logprobs: Sequence[Mapping[int, float] | None], partings: Sequence[Parting]) -> None:
        """One prompt: the plain output's own top log-probabilities, one entry per token, and the partings found
        along it."""
        self._prompts += 1
        self._positions += len(plain_logprobs)
        margin = self.policy.tie_margin
        if margin is not None:
            self._near_ties += sum(is_near_tie(step, margin) for step in plain_logprobs)
        self._identical += not partings
        self._partings.extend(partings)

    def result(self) -> Equivalence:
        return Equivalence(policy=self.policy, prompts=self._prompts, positions=self._positions,
                           near_tie_positions=self._near_ties, identical=self._identical,
                           partings=list(self._partings))
