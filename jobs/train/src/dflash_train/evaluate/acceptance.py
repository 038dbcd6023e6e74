"""Acceptance statistics of speculative runs: tau, acceptance per drafted position, the tau histogram, and tau
by context position. Read by the evaluation (`evaluate.stage`) and the learnability gate (`evaluate.learnability`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from dflash_shared.evaluation_report import Acceptance, PositionBucket


def bucket_name(position: int, width: int) -> str:
    """'0-4K', '4K-8K', ... for width 4096 (plain token counts for widths that are not multiples of 1024)."""
    lo, hi = position // width * width, (position // width + 1) * width

    def k(n: int) -> str:
        return "0" if n == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)

    return f"{k(lo)}-{k(hi)}"


def by_position(results: Sequence[Any], prompt_lengths: Sequence[int], width: int) -> dict[str, PositionBucket]:
    """Acceptance per context-length bucket: a step drafts at (prompt + tokens committed before it)."""
    steps: dict[int, list[int]] = {}
    for result, prompt_length in zip(results, prompt_lengths, strict=True):
        position = prompt_length + 1  # the prefill commits the first token
        for n in result.accepted:
            steps.setdefault(position // width, []).append(n)
            position += n + 1
    return {bucket_name(b * width, width): PositionBucket(tau=1.0 + sum(ns) / len(ns), steps=len(ns))
            for b, ns in sorted(steps.items())}


def summarize(results: Sequence[Any], block_size: int, prompt_lengths: Sequence[int] | None = None,
              bucket_tokens: int = 4096) -> Acceptance:
    """Acceptance statistics of SpeculativeResults (or anything with tokens/accepted/target_forwards); with the
    prompts' lengths also by context position."""
    accepted = [n for r in results for n in r.accepted]
    steps = len(accepted)
    generated = sum(len(r.tokens) for r in results)
    forwards = sum(r.target_forwards for r in results)
    per_position = [sum(n >= k for n in accepted) / steps if steps else 0.0 for k in range(1, block_size)]
    histogram = Counter(n + 1 for n in accepted)
    return Acceptance(
        tau=1.0 + sum(accepted) / steps if steps else 1.0,
        steps=steps,
        accepted_tokens=sum(accepted),
        acceptance_per_position=per_position,
        tau_histogram={str(k): histogram[k] for k in sorted(histogram)},
        generated_tokens=generated,
        target_forwards=forwards,
        tokens_per_target_forward=generated / forwards if forwards else 0.0,
        prompts=len(results),
        by_position={} if prompt_lengths is None else by_position(results, prompt_lengths, bucket_tokens),
    )
