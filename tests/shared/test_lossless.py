"""The numerics policy of "identical output" (dflash_shared.lossless) on constructed partings.

Log-probabilities are given as each run returns them (its top two plus its own token). Margins are steps of
bfloat16 logits: 0.125 nats is one step at a logit of 16-32.
"""

from __future__ import annotations

import pytest

from dflash_shared.lossless import (
    Comparing,
    NumericsPolicy,
    Step,
    first_difference,
    judge,
)

BF16 = NumericsPolicy.at("bfloat16", tie_margin=0.25, max_parted_fraction=0.01)
FP32 = NumericsPolicy.at("float32", tie_margin=0.25, max_parted_fraction=0.01)


def test_float32_allows_nothing_and_reduced_precision_takes_the_allowances() -> None:
    assert FP32.tie_margin is None and FP32.max_parted_fraction == 0
    assert NumericsPolicy.at("float16", 0.1, 0.02) == NumericsPolicy(dtype="float16", tie_margin=0.1,
                                                                     max_parted_fraction=0.02)
    assert BF16.describe() == "bfloat16: near-ties in both runs within 0.25 nats allowed on up to 1.00% of positions"


def test_a_rounding_flip_is_a_near_tie_in_both_runs() -> None:
    # Each run's token is its own best; the other's is one bf16 step behind in both.
    parting = judge("p", 7, Step(9, {9: -0.700, 7: -0.825}), Step(7, {7: -0.690, 9: -0.815}), BF16)
    assert parting.tie and parting.index == 7
    assert parting.speculative_margin == pytest.approx(0.125) and parting.plain_margin == pytest.approx(0.125)
    assert not judge("p", 7, Step(9, {9: -0.700, 7: -0.825}), Step(7, {7: -0.690, 9: -0.815}), FP32).tie


def test_a_token_the_speculative_run_itself_ranks_lower_is_a_difference_however_close() -> None:
    """What a verifier that accepts wrong drafts at near-ties leaves: its own distribution prefers the plain token."""
    parting = judge("p", 3, Step(9, {7: -0.70, 9: -0.75}), Step(7, {7: -0.70, 9: -0.75}), BF16)
    assert not parting.tie
    assert parting.speculative_margin == pytest.approx(-0.05) and parting.plain_margin == pytest.approx(0.05)
    assert "speculative margin -0.05 nats, plain margin 0.05 nats" in parting.describe()


def test_a_near_tie_seen_by_one_run_only_is_a_difference() -> None:
    wide_in_plain = judge("p", 1, Step(9, {9: -0.7, 7: -0.8}), Step(7, {7: -0.1, 9: -2.0}), BF16)
    absent = judge("p", 1, Step(9, {9: -0.7, 7: -0.8}), Step(7, {7: -0.1, 3: -2.0}), BF16)
    no_logprobs = judge("p", 1, Step(9, None), Step(7, {7: -0.1, 9: -0.2}), BF16)
    ended = judge("p", 1, Step(None, None), Step(7, {7: -0.1, 9: -0.2}), BF16)
    assert not any(p.tie for p in (wide_in_plain, absent, no_logprobs, ended))
    assert wide_in_plain.plain_margin == pytest.approx(1.9)
    assert absent.plain_margin is None and "not in its top log-probabilities" in absent.describe()
    assert ended.describe().startswith("prompt p at token 1: speculative end of output, plain 7")


def test_first_difference_counts_an_early_end() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3, 4], [1, 2, 3]) == 3


def _run(policy: NumericsPolicy, partings_per_prompt: list[list[object]], length: int = 100) -> object:
    comparing = Comparing(policy)
    for partings in partings_per_prompt:
        comparing.add(length, partings)  # type: ignore[arg-type]
    return comparing.result()


def test_near_ties_pass_up_to_the_bound_of_parted_positions() -> None:
    tie = judge("a", 4, Step(9, {9: -0.7, 7: -0.8}), Step(7, {7: -0.7, 9: -0.8}), BF16)
    one = _run(BF16, [[tie], [], [], []])  # 1 of 400 positions = 0.25%
    assert one.failure() is None and one.identical == 3 and one.positions == 400  # type: ignore[attr-defined]
    assert one.summary().startswith("3/4 prompts identical, 1 near-tie parting(s) over 400 positions")  # type: ignore[attr-defined]
    many = _run(BF16, [[tie, tie.model_copy(update={"index": 9})], [tie.model_copy(update={"prompt_id": "b"})]])
    assert many.failure() == (  # type: ignore[attr-defined]
        "3 of 200 positions (1.500%) part at near-ties, more than the 1.00% rounding explains (bfloat16: near-ties "
        "in both runs within 0.25 nats allowed on up to 1.00% of positions); first: prompt a at token 4: "
        "speculative 9, plain 7 (speculative margin 0.1 nats, plain margin 0.1 nats)")


def test_a_difference_fails_naming_prompt_position_tokens_and_both_margins() -> None:
    tie = judge("a", 4, Step(9, {9: -0.7, 7: -0.8}), Step(7, {7: -0.7, 9: -0.8}), BF16)
    wrong = judge("b", 12, Step(5, {6: -0.5, 5: -0.6}), Step(6, {6: -0.5, 5: -0.6}), BF16)
    result = _run(BF16, [[tie], [wrong], []])
    assert [p.prompt_id for p in result.mismatches] == ["b"]  # type: ignore[attr-defined]
    assert result.failure() == (  # type: ignore[attr-defined]
        "greedy output with speculative decoding differs from output without it on 1/3 prompts (bfloat16: near-ties "
        "in both runs within 0.25 nats allowed on up to 1.00% of positions); first: prompt b at token 12: "
        "speculative 5, plain 6 (speculative margin -0.1 nats, plain margin 0.1 nats), tie margin 0.25 nats; "
        "prompts ['b']")
    exact = _run(FP32, [[judge("a", 4, Step(9, {9: -0.7, 7: -0.8}), Step(7, {7: -0.7, 9: -0.8}), FP32)]])
    assert exact.failure().startswith(  # type: ignore[attr-defined]
        "greedy output with speculative decoding differs from output without it on 1/1 prompts (float32: exact "
        "equality required); first: prompt a at token 4")
