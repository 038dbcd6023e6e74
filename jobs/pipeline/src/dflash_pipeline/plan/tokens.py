"""Tokens per record as `pipeline plan` assumes them: what is generated, and what a training window reads.

The assumption, stated once so every figure can be checked by hand: a prompt has its mean length P; the target's
answer, were no budget to stop it, is exponential with mean `answer_mean` (thinking-mode lengths are skewed to
the right: most answers are short, a few run for tens of thousands of tokens); the engine stops it at the
prompt's budget b = min(max_new_tokens, context - P). So per record

    generated     E[min(X, b)]          = a (1 - exp(-b / a))
    in window     E[min(X, b, W - P)]   = a (1 - exp(-min(b, W - P) / a))
    trained       min(P, W) + in window    (tokens a row of W reads: tokenize and train cut the rest)
    cut by budget P(X > b)              = exp(-b / a)

with a = answer_mean and W the training window. Capped to the window (the default), the context is W and b <= W - P:
nothing generated lies past the window. A measured mean (an earlier run's manifest) is the mean *under that
run's budget*; `answer_mean_for` turns it back into the uncut mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RecordTokens:
    """One record's expected tokens under the plan's assumption (see the module docstring)."""

    prompt: float  # P, mean prompt tokens
    answer_mean: float  # a, mean answer tokens when no budget stops it
    max_new_tokens: float
    context: float  # the engine's max_model_len: prompt + completion never exceed it
    window: float  # W, tokens per record a training row reads

    @property
    def budget(self) -> float:
        """b: the most completion tokens this prompt can get."""
        return max(0.0, min(self.max_new_tokens, self.context - self.prompt))

    def _cut_mean(self, at: float) -> float:
        """E[min(X, at)] for X exponential with mean a."""
        return self.answer_mean * -math.expm1(-max(at, 0.0) / self.answer_mean)

    @property
    def generated(self) -> float:
        return self._cut_mean(self.budget)

    @property
    def generated_in_window(self) -> float:
        return self._cut_mean(min(self.budget, self.window - self.prompt))

    @property
    def length(self) -> float:
        """Prompt + completion: what tokenize reads of the record."""
        return self.prompt + self.generated

    @property
    def trained(self) -> float:
        """Tokens of the record a training row reads."""
        return min(self.prompt, self.window) + self.generated_in_window

    @property
    def truncated_by_budget(self) -> float:
        """Share of completions the budget stops."""
        return math.exp(-self.budget / self.answer_mean) if self.budget > 0 else 1.0

    @property
    def unread_fraction(self) -> float:
        """Share of the generated tokens that no training row reads."""
        return 1.0 - self.generated_in_window / self.generated if self.generated > 0 else 0.0


def answer_mean_for(mean_generated: float, budget: float) -> float:
    """The uncut mean a whose budget-cut mean a (1 - exp(-budget / a)) is `mean_generated` (bisection; the cut
    mean grows with a). A mean at or above the budget (every answer cut) has no finite a: 100 x budget stands in."""
    if budget <= 0 or mean_generated >= budget:
        return 100.0 * max(budget, 1.0)
    low, high = mean_generated, 100.0 * budget
    for _ in range(100):
        mid = (low + high) / 2
        if mid * -math.expm1(-budget / mid) < mean_generated:
            low = mid
        else:
            high = mid
    return (low + high) / 2
