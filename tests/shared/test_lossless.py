"""The numerics policy of "identical output" (dflash_shared.lossless) on constructed partings.

Log-probabilities are given as each run returns them (its top two plus its own token). Margins are steps of
bfloat16 logits: 0.125 nats is one step at a logit of 16-32. The bound on near-tie partings is a share of the plain
run's own near-tie positions (its top two within the tie margin), so a flat target gets more than a peaked one.
"""

from __future__ import annotations

import pytest

from dflash_shared.lossless import (
    ENGINE_LOGPROBS,
    Comparing,
    NumericsPolicy,
    Step,
    first_difference,
    is_near_tie,
    judge,
)

BF16 = NumericsPolicy.at("bfloat16", tie_margin=0.25, max_near_tie_share=0.25)
FP32 = NumericsPolicy.at("float32", tie_margin=0.25, max_near_tie_share=0.25)
# A plain run's own top two at one position: within the margin (a near-tie position) or leading by nats.
NEAR = {7: -0.70, 9: -0.80}
CLEAR = {7: -0.05, 9: -3.00}


def test_float32_allows_nothing_and_reduced_precision_takes_the_allowances() -> None:
    assert FP32.tie_margin is None and FP32.max_near_tie_share == 0
    assert NumericsPolicy.at("float16", 0.1, 0.5) == NumericsPolicy(dtype="float16", tie_margin=0.1,
                                                                    max_near_tie_share=0.5)
    assert BF16.describe() == ("bfloat16: near-ties in both runs within 0.25 nats allowed on up to 25% of the plain "
                               "run's near-tie positions")


def test_a_near_tie_position_is_one_whose_own_top_two_are_within_the_margin() -> None:
    assert is_near_tie(NEAR, 0.25) and not is_near_tie(CLEAR, 0.25)
    # vLLM adds the sampled token to the top two: the top two are still the two largest.
    assert is_near_tie({7: -0.7, 9: -0.8, 3: -5.0}, 0.25) and not is_near_tie({7: -0.7, 3: -5.0, 9: -1.2}, 0.25)
    assert not any(is_near_tie(lp, 0.25) for lp in (None, {}, {7: -0.1}, {7: -0.1, 9: float("-inf")}))


def test_the_allowance_is_a_share_of_the_near_tie_positions_rounded_up() -> None:
    assert [BF16.allowed_ties(n) for n in (0, 1, 4, 5, 8, 40)] == [0, 1, 1, 2, 2, 10]
    assert FP32.allowed_ties(40) == 0


def test_a_rounding_flip_is_a_near_tie_in_both_runs() -> None:
    # Each run's token is its own best; the other's is one bf16 step behind in both.
    parting = judge("p", 7, Step(9, {9: -0.700, 7: -0.825}), Step(7, {7: -0.690, 9: -0.815}), BF16)
    assert parting.tie and parting.index == 7
    assert parting.speculative_margin == pytest.approx(0.125) and parting.plain_margin == pytest.approx(0.125)
    assert not judge("p", 7, Step(9, {9: -0.700, 7: -0.825}), Step(7, {7: -0.690, 9: -0.815}), FP32).tie


def test_a_rounding_flip_among_three_near_tied_tokens_is_judged_from_the_engines_top_log_probabilities() -> None:
    """A flat distribution (a random-weight target) can hold three tokens within the margin: the speculative run
    ranks a third token between its own and the plain one. Its top two miss the plain token, so the flip cannot be
    judged from them and reads as a difference; the engine's top ENGINE_LOGPROBS hold it, and the margins decide."""
    speculative = {9: -1.00, 4: -1.05, 7: -1.10, 2: -4.0}
    plain = Step(7, {7: -1.000, 9: -1.008, 4: -1.02})

    def top(logprobs: dict[int, float], k: int) -> dict[int, float]:
        return dict(sorted(logprobs.items(), key=lambda kv: -kv[1])[:k])

    assert not judge("p", 1, Step(9, top(speculative, 2)), plain, BF16).tie  # plain's 7 is third: unknown
    parting = judge("p", 1, Step(9, top(speculative, ENGINE_LOGPROBS)), plain, BF16)
    assert parting.tie and parting.speculative_margin == pytest.approx(0.10)
    # A third token further than the margin is still a difference, with as many log-probabilities as the engine has.
    far = {9: -1.00, 4: -1.05, 7: -1.40}
    assert not judge("p", 1, Step(9, top(far, ENGINE_LOGPROBS)), plain, BF16).tie


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


def _run(policy: NumericsPolicy, partings_per_prompt: list[list[object]], length: int = 100,
         near_ties: int = 4) -> object:
    """Each prompt: `length` plain positions, the first `near_ties` of them near-ties."""
    comparing = Comparing(policy)
    for partings in partings_per_prompt:
        comparing.add([NEAR] * near_ties + [CLEAR] * (length - near_ties), partings)  # type: ignore[arg-type]
    return comparing.result()


def test_near_ties_pass_up_to_their_share_of_the_plain_runs_near_tie_positions() -> None:
    tie = judge("a", 4, Step(9, {9: -0.7, 7: -0.8}), Step(7, {7: -0.7, 9: -0.8}), BF16)
    one = _run(BF16, [[tie], [], [], []])  # 1 parting at 16 near-tie positions, 4 allowed
    assert one.failure() is None and one.identical == 3 and one.positions == 400  # type: ignore[attr-defined]
    assert one.near_tie_positions == 16  # type: ignore[attr-defined]
    assert one.summary().startswith(  # type: ignore[attr-defined]
        "3/4 prompts identical, 1 near-tie parting(s) at 16 near-tie positions of 400 (6.2%)")
    many = [[tie, tie.model_copy(update={"index": 9})], [tie.model_copy(update={"prompt_id": "b"})]]
    assert _run(BF16, many, near_ties=6).failure() is None  # type: ignore[attr-defined]  # 3 of 12: 3 allowed
    assert _run(BF16, many).failure() == (  # type: ignore[attr-defined]
        "3 of the plain run's 8 near-tie positions (of 200 compared) part, more than the 2 rounding explains "
        "(bfloat16: near-ties in both runs within 0.25 nats allowed on up to 25% of the plain run's near-tie "
        "positions); first: prompt a at token 4: speculative 9, plain 7 (speculative margin 0.1 nats, plain margin "
        "0.1 nats)")


def test_a_flat_target_gets_the_allowance_its_own_near_ties_give() -> None:
    """The issue's run: 3 near-tie partings over 192 positions (1.6%: refused by a fixed share of positions),
    on a random-weight target whose flat distributions make most positions near-ties."""
    tie = judge("a", 4, Step(9, {9: -0.7, 7: -0.8}), Step(7, {7: -0.7, 9: -0.8}), BF16)
    flat = _run(BF16, [[tie, tie.model_copy(update={"index": 20})], [tie], [], [], [], []], length=32, near_ties=20)
    assert flat.positions == 192 and flat.near_tie_positions == 120 and flat.failure() is None  # type: ignore[attr-defined]
    peaked = _run(BF16, [[tie, tie.model_copy(update={"index": 20})], [tie], [], [], [], []], length=32, near_ties=1)
    assert peaked.failure().startswith("3 of the plain run's 6 near-tie positions")  # type: ignore[attr-defined]


def test_a_difference_fails_naming_prompt_position_tokens_and_both_margins() -> None:
    tie = judge("a", 4, Step(9, {9: -0.7, 7: -0.8}), Step(7, {7: -0.7, 9: -0.8}), BF16)
    wrong = judge("b", 12, Step(5, {6: -0.5, 5: -0.6}), Step(6, {6: -0.5, 5: -0.6}), BF16)
    result = _run(BF16, [[tie], [wrong], []])
    assert [p.prompt_id for p in result.mismatches] == ["b"]  # type: ignore[attr-defined]
    assert result.failure() == (  # type: ignore[attr-defined]
        "greedy output with speculative decoding differs from output without it on 1/3 prompts (bfloat16: near-ties "
        "in both runs within 0.25 nats allowed on up to 25% of the plain run's near-tie positions); first: prompt b "
        "at token 12: "
        "speculative 5, plain 6 (speculative margin -0.1 nats, plain margin 0.1 nats), tie margin 0.25 nats; "
        "prompts ['b']")
    exact = _run(FP32, [[judge("a", 4, Step(9, {9: -0.7, 7: -0.8}), Step(7, {7: -0.7, 9: -0.8}), FP32)]])
    assert exact.failure().startswith(  # type: ignore[attr-defined]
        "greedy output with speculative decoding differs from output without it on 1/1 prompts (float32: exact "
        "equality required); first: prompt a at token 4")
