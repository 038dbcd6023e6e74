"""The shared degenerate-output detector and bad-input gate."""

from __future__ import annotations

import pytest

from dflash_shared import quality
from dflash_shared.quality import EarlyDegenerateDetector, GateCounts, QualityPolicy, classify, gate_exceeded

POLICY = QualityPolicy(min_content_tokens=4)
GOOD_REASONING = "The user wants the sum of two numbers, so I add them and check the result twice."


def verdict(content: str, reasoning: str | None = GOOD_REASONING, finish: str | None = "stop",
            thinking: bool = True, tokens: int | None = 20) -> str | None:
    return classify(content=content, reasoning=reasoning, finish_reason=finish, thinking_requested=thinking,
                    content_tokens=tokens, policy=POLICY)


@pytest.mark.parametrize(
    "kwargs,reason",
    [
        ({"content": "The answer is 42."}, None),
        ({"content": "The answer is 42.", "reasoning": None, "thinking": False}, None),
        ({"content": "The answer is", "finish": "length"}, quality.TRUNCATED),
        ({"content": "<think>\nstill thinking when the budget ran out"}, quality.THINKING_UNCLOSED),
        ({"content": "The answer is 42.", "reasoning": None}, quality.THINKING_MISSING),
        ({"content": "The answer is 42.", "reasoning": "  \n"}, quality.THINKING_MISSING),
        ({"content": ""}, quality.EMPTY_RESPONSE),
        # An empty answer is empty whatever the thinking mode, with or without reasoning.
        ({"content": "", "reasoning": None}, quality.EMPTY_RESPONSE),
        ({"content": "", "reasoning": None, "thinking": False}, quality.EMPTY_RESPONSE),
        ({"content": " \n\t"}, quality.EMPTY_RESPONSE),
        ({"content": "Ok.", "tokens": 2}, quality.TOO_SHORT),
        ({"content": "the same sentence again. " * 40}, quality.REPETITIVE),
    ],
)
def test_classify(kwargs: dict, reason: str | None) -> None:
    assert verdict(**kwargs) == reason


def test_long_varied_text_is_not_repetitive() -> None:
    text = " ".join(f"step {i}: multiply {i * 7919 % 1000} by {i * 104729 % 997} and carry" for i in range(60))
    assert verdict(text, tokens=500) is None


def test_truncation_allowed_by_policy() -> None:
    lenient = QualityPolicy(allow_truncated=True)
    assert classify(content="partial answer here", reasoning="r" * 10, finish_reason="length",
                    thinking_requested=True, content_tokens=10, policy=lenient) is None


def test_gate_fails_the_origin_dataset() -> None:
    """87% of responses nearly empty (the dataset this project was born from) must fail the gate."""
    counts = GateCounts()
    for i in range(1000):
        empty = i % 100 < 87
        reason = verdict("ok" if empty else "A full and useful answer.", tokens=2 if empty else 30)
        counts.observe(f"rec-{i}", reason, "content has 2 tokens" if reason else "")
    assert counts.bad == {quality.TOO_SHORT: 870}
    assert gate_exceeded(counts, max_bad_fraction=0.05)
    report = counts.report()
    assert "870 of 1000 records are unusable (87.0%)" in report
    assert "e.g. rec-0: content has 2 tokens" in report
    assert len(counts.examples[quality.TOO_SHORT]) == 5


def test_gate_passes_below_threshold() -> None:
    counts = GateCounts()
    for i in range(100):
        counts.observe(f"r{i}", quality.EMPTY_RESPONSE if i < 5 else None)
    assert not gate_exceeded(counts, max_bad_fraction=0.05)
    counts.observe("r100", quality.EMPTY_RESPONSE)
    assert gate_exceeded(counts, max_bad_fraction=0.05)


def test_early_detector_decides_on_the_window_only() -> None:
    detector = EarlyDegenerateDetector(window=10, max_bad_fraction=0.5)
    for i in range(9):
        detector.observe(f"r{i}", quality.EMPTY_RESPONSE)
    assert detector.verdict() is None  # not decided before the window is full
    detector.observe("r9", None)
    message = detector.verdict()
    assert message is not None and "9 of 10 records are unusable" in message
    healthy = EarlyDegenerateDetector(window=10)
    for i in range(10):
        healthy.observe(f"r{i}", quality.EMPTY_RESPONSE if i < 3 else None)
    for i in range(100):  # later garbage is the gate's job, not the early detector's
        healthy.observe(f"late{i}", quality.EMPTY_RESPONSE)
    assert healthy.verdict() is None


def test_a_completion_stopped_at_the_generation_budget_is_kept() -> None:
    """The generate stage's own budget (the training window's end): a prefix of the target's answer, kept
    whatever its think block looks like; a loop that ran to the budget, or a cut before min_content_tokens
    tokens, is not."""
    def cut(content: str, reasoning: str | None = None, tokens: int = 900,
            policy: QualityPolicy = POLICY) -> str | None:
        return classify(content=content, reasoning=reasoning, finish_reason="length", thinking_requested=True,
                        content_tokens=0, policy=policy, budget_cut=True, completion_tokens=tokens)

    assert cut("<think>\nstill working through the cases when the window ended") is None
    assert cut("The answer starts here", reasoning=GOOD_REASONING) is None
    assert cut("<think>\nthe same sentence again. " + "the same sentence again. " * 40) == quality.REPETITIVE
    assert cut("<think>\nok", tokens=2) == quality.TRUNCATED
    # Off: rejected as before; and without budget_cut (an import's unknown limit) the old rule holds.
    assert cut("<think>\nstill working", policy=QualityPolicy(keep_truncated_by_budget=False)) == quality.TRUNCATED
    assert verdict("The answer is", finish="length") == quality.TRUNCATED
