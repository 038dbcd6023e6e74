"""The serving check's output policy on constructed outputs: exact in float32, near-ties allowed in bfloat16.

Each case is a pair of token sequences (speculative, plain) and the plain run's top two log-probabilities per
position, as vLLM returns them with SamplingParams(logprobs=2). The margins are steps of bfloat16 logits (0.125 is
one step at a logit of 16-32).
"""

from __future__ import annotations

import pytest

from dflash_generate.serve_equivalence import Decoded, OutputPolicy, compare, first_parting

BF16 = OutputPolicy.at("bfloat16", tie_margin=0.25, max_tie_fraction=0.25)
FP32 = OutputPolicy.at("float32", tie_margin=0.25, max_tie_fraction=0.25)


def top(*rows: dict[int, float]) -> list[dict[int, float]]:
    return list(rows)


# Plain output 5 6 9 10: at index 2 the plain run's top two are 9 (-0.700) and 7 (-0.825), one bf16 step apart.
PLAIN = [5, 6, 9, 10]
PLAIN_TOP = top({5: -0.1, 3: -4.0}, {6: -0.2, 2: -3.0}, {9: -0.700, 7: -0.825}, {10: -0.3, 11: -2.0})
NEAR_TIE = Decoded("near", [5, 6, 7, 1, 2], PLAIN, PLAIN_TOP)  # parts at the near-tie; what follows differs freely
SAME = Decoded("same", PLAIN, PLAIN, PLAIN_TOP)


def test_identical_outputs_pass_at_every_dtype() -> None:
    for policy in (BF16, FP32):
        result = compare([SAME, SAME._replace(prompt_id="b")], policy)
        assert (result.prompts, result.identical, result.partings, result.failure()) == (2, 2, [], None)


def test_a_parting_at_a_near_tie_passes_in_bfloat16_and_fails_in_float32() -> None:
    parting = first_parting(NEAR_TIE, BF16.tie_margin)
    assert parting is not None
    assert (parting.index, parting.speculative_token, parting.plain_token, parting.tie) == (2, 7, 9, True)
    assert parting.margin == pytest.approx(0.125)
    result = compare([NEAR_TIE, *[SAME._replace(prompt_id=f"s{i}") for i in range(3)]], BF16)
    assert result.failure() is None and [p.prompt_id for p in result.ties] == ["near"] and result.identical == 3
    exact = compare([NEAR_TIE, SAME], FP32)
    assert exact.policy.tie_margin is None and exact.ties == [] and len(exact.mismatches) == 1
    assert exact.failure() == (
        "greedy output with speculative decoding differs from output without it on 1/2 prompts (float32: exact "
        "equality required); first: prompt near at token 2: speculative 7, plain 9 (plain run's margin 0.125 nats); "
        "prompts ['near']")


def test_a_parting_beyond_the_margin_names_prompt_position_tokens_and_margin() -> None:
    wide = Decoded("wide", [5, 6, 7], PLAIN, top(*PLAIN_TOP[:2], {9: -0.2, 7: -1.9}, PLAIN_TOP[3]))
    result = compare([SAME, wide, NEAR_TIE._replace(prompt_id="later")], BF16)
    assert [p.prompt_id for p in result.mismatches] == ["wide"] and [p.prompt_id for p in result.ties] == ["later"]
    assert result.failure() == (
        "greedy output with speculative decoding differs from output without it on 1/3 prompts (bfloat16: partings "
        "at near-ties within 0.25 nats allowed on up to 25% of prompts); first: prompt wide at token 2: speculative "
        "7, plain 9 (plain run's margin 1.7 nats) > tie margin 0.25; prompts ['wide']")


def test_a_token_outside_the_plain_top_two_or_an_early_end_is_a_difference() -> None:
    outside = first_parting(Decoded("x", [5, 6, 8], PLAIN, PLAIN_TOP), BF16.tie_margin)
    assert outside is not None and outside.margin is None and not outside.tie
    assert "the speculative token is not among the plain run's top log-probabilities" in outside.describe()
    early = first_parting(Decoded("short", [5, 6], PLAIN, PLAIN_TOP), BF16.tie_margin)
    assert early is not None and (early.index, early.speculative_token, early.plain_token) == (2, None, 9)
    assert early.describe() == "prompt short at token 2: speculative end of output, plain 9 (one output ends there)"
    no_logprobs = first_parting(NEAR_TIE._replace(plain_top_logprobs=None), BF16.tie_margin)
    assert no_logprobs is not None and no_logprobs.margin is None and not no_logprobs.tie


def test_more_near_ties_than_the_bound_fail() -> None:
    ties = [NEAR_TIE._replace(prompt_id=f"t{i}") for i in range(2)]
    same = [SAME._replace(prompt_id=f"s{i}") for i in range(6)]
    assert compare([*ties, *same], BF16).failure() is None  # 2/8 = 25%: at the bound
    failure = compare([*ties, *same[:2]], BF16).failure()
    assert failure == ("2/4 prompts part at near-ties, more than the 25% rounding explains (bfloat16: partings at "
                       "near-ties within 0.25 nats allowed on up to 25% of prompts); first: prompt t0 at token 2: "
                       "speculative 7, plain 9 (plain run's margin 0.125 nats)")


def test_the_policy_follows_the_engine_dtype() -> None:
    assert OutputPolicy.at("float16", 0.1, 0.5).tie_margin == 0.1
    assert OutputPolicy.at("float32", 0.1, 0.5).model_dump() == {"dtype": "float32", "tie_margin": None,
                                                                 "max_tie_fraction": 0.0}
    zero = OutputPolicy.at("bfloat16", 0.0, 1.0)  # 0 nats: only an exact tie of the two log-probabilities
    exact_tie = Decoded("e", [7], [9], [{9: -0.5, 7: -0.5}])
    assert compare([exact_tie], zero).failure() is None
    assert compare([NEAR_TIE], zero).failure() is not None
