"""The offline speculative loop: lossless against the target's own greedy decoding, acceptance counted right."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dflash_train.evaluate.acceptance import summarize
from dflash_train.evaluate.speculate import greedy_reference, propose, speculative_generate
from tests.evaluate import eval_fixtures as ef

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def references(target_model: Any, heldout_prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy decoding of the first three held-out prompts."""
    return [greedy_reference(target_model, p, NEW_TOKENS, ef.STOP_IDS) for p in heldout_prompts[:3]]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("which", ["trained", "untrained"])
def test_output_is_the_targets_greedy_output(which: str, block_size: int, request: pytest.FixtureRequest,
                                            hooked_target: Any, heldout_prompts: list[list[int]],
                                            references: list[list[int]]) -> None:
    drafter = request.getfixturevalue(f"{which}_drafter")
    accepted = 0
    for prompt, reference in zip(heldout_prompts[:3], references, strict=True):
        result = speculative_generate(drafter, hooked_target, prompt, NEW_TOKENS, ef.STOP_IDS, block_size)
        assert result.tokens == reference
        assert all(0 <= n <= block_size - 1 for n in result.accepted)
        accepted += sum(result.accepted)
    if which == "trained":
        assert accepted > 0  # drafts were accepted, so the comparison covers committed draft tokens
    else:
        assert accepted <= 2  # a random drafter almost never guesses right: the bonus path is covered


def test_stop_token_inside_an_accepted_draft_ends_the_output(trained_drafter: Any, hooked_target: Any,
                                                             target_model: Any, tiny_target_dir: Any,
                                                             heldout_prompts: list[list[int]]) -> None:
    """A stop id reached in the middle of a block ends the output there, as plain greedy decoding does."""
    # A token the target first produces some way into its answer (the cached held-out answers say which).
    answers = ef.target_answers(tiny_target_dir, heldout_prompts)
    index, stop, at = next((i, tok, ans.index(tok)) for i, ans in enumerate(answers) for tok in ans
                           if 3 <= ans.index(tok) < 48)
    expected = greedy_reference(target_model, heldout_prompts[index], 64, [stop])
    result = speculative_generate(trained_drafter, hooked_target, heldout_prompts[index], 64, [stop], 8)
    assert result.tokens == expected
    assert len(expected) == at + 1 and expected[-1] == stop
    assert sum(result.accepted) > 0


def test_counts_add_up(trained_drafter: Any, hooked_target: Any, heldout_prompts: list[list[int]]) -> None:
    """Every step commits accepted + 1 tokens after the prefill's one; tau is the pooled mean of them."""
    results = [speculative_generate(trained_drafter, hooked_target, p, NEW_TOKENS, (), 8) for p in heldout_prompts[:3]]
    for r in results:
        assert r.target_forwards == 1 + len(r.accepted)
        committed = 1 + sum(r.acceptance_lengths)
        # The last step may commit past the budget; the output is cut there.
        assert len(r.tokens) == NEW_TOKENS <= committed < NEW_TOKENS + 8
    summary = summarize(results, 8)
    lengths = [t for r in results for t in r.acceptance_lengths]
    assert summary.tau == pytest.approx(sum(lengths) / len(lengths))
    assert summary.steps == len(lengths) == sum(summary.tau_histogram.values())
    assert summary.acceptance_per_position[0] == pytest.approx(sum(t >= 2 for t in lengths) / len(lengths))
    assert summary.acceptance_per_position == sorted(summary.acceptance_per_position, reverse=True)
    assert summary.tokens_per_target_forward == pytest.approx(3 * NEW_TOKENS / summary.target_forwards)


def test_acceptance_recounted_from_the_output(trained_drafter: Any, hooked_target: Any,
                                              heldout_prompts: list[list[int]]) -> None:
    """Replay each step without the loop's cache: fresh target features of the committed prefix, one drafter
    pass, and count how far the drafts match the final output. It must equal what the loop counted."""
    block = 8
    prompt, result = next((p, r) for p in heldout_prompts
                          if sum((r := speculative_generate(trained_drafter, hooked_target, p, NEW_TOKENS, (),
                                                            block)).accepted) > 0)
    committed = 1  # tokens of the output committed before the step (the prefill's first token)
    recount = []
    for _ in result.accepted:
        prefix = torch.tensor(prompt + result.tokens[: committed - 1])
        _, features = hooked_target.forward(prefix, hooked_target.new_cache())
        draft = propose(trained_drafter, hooked_target, features, result.tokens[committed - 1], block)
        following = result.tokens[committed:]
        n = 0
        while n < len(draft) and n < len(following) and draft[n] == following[n]:
            n += 1
        recount.append(n)
        committed += n + 1
    # The final step's drafts can run past the cut output; compare where the output covers them.
    assert recount[:-1] == result.accepted[:-1]
    assert recount[-1] <= result.accepted[-1]
    assert sum(result.accepted) > 0


def test_refuses_a_drafter_for_other_layers(trained_drafter: Any, target_model: Any) -> None:
    from dflash_train.evaluate.speculate import HookedTarget

    other = HookedTarget(target_model, [0, 1])
    try:
        with pytest.raises(ValueError, match=r"drafter reads target layers \[1, 2\], the target hooks \[0, 1\]"):
            speculative_generate(trained_drafter, other, [1, 2, 3], 4)
    finally:
        other.close()


@pytest.mark.parametrize("at", [0, 5])
def test_compared_with_a_reference_the_loop_is_teacher_forced_past_a_near_tie(
        at: int, trained_drafter: Any, hooked_target: Any, target_model: Any,
        heldout_prompts: list[list[int]]) -> None:
    """A reference that takes the target's runner-up token at position `at` (as a bfloat16 rounding flip would):
    the loop records one near-tie there, commits the reference's token, and then decodes exactly the
    reference's continuation, every later position compared."""
    from dflash_shared.lossless import NumericsPolicy
    from dflash_train.evaluate.speculate import Reference, greedy_with_logprobs

    prompt = heldout_prompts[0]
    plain = greedy_with_logprobs(target_model, prompt, NEW_TOKENS, ef.STOP_IDS)
    runner_up = sorted(plain.logprobs[at], key=plain.logprobs[at].__getitem__)[0]
    assert runner_up != plain.tokens[at]
    tail = greedy_with_logprobs(target_model, [*prompt, *plain.tokens[:at], runner_up], NEW_TOKENS - at - 1,
                                ef.STOP_IDS)
    flipped = {runner_up: plain.logprobs[at][plain.tokens[at]], plain.tokens[at]: plain.logprobs[at][runner_up]}
    reference = Reference(tokens=[*plain.tokens[:at], runner_up, *tail.tokens],
                          logprobs=[*plain.logprobs[:at], flipped, *tail.logprobs])
    wide = NumericsPolicy(dtype="bfloat16", tie_margin=100.0, max_near_tie_share=1.0)
    result = speculative_generate(trained_drafter, hooked_target, prompt, NEW_TOKENS, ef.STOP_IDS, 8,
                                  reference=reference, policy=wide, prompt_id="p0")
    assert result.tokens == reference.tokens
    (parting,) = result.partings
    assert (parting.index, parting.speculative_token, parting.plain_token, parting.tie) == (
        at, plain.tokens[at], runner_up, True)
    assert parting.speculative_margin is not None and parting.speculative_margin > 0
    # The same reference under float32's policy: a difference, and the loop decodes on by its own argmax.
    exact = speculative_generate(trained_drafter, hooked_target, prompt, NEW_TOKENS, ef.STOP_IDS, 8,
                                 reference=reference, policy=NumericsPolicy.at("float32"), prompt_id="p0")
    assert exact.tokens == plain.tokens and [p.tie for p in exact.partings] == [False]


def test_a_parting_outside_the_kept_log_probabilities_is_judged_from_the_whole_distributions(
        trained_drafter: Any, hooked_target: Any, target_model: Any, heldout_prompts: list[list[int]]) -> None:
    """The plain run kept only its own top log-probabilities, which miss the speculative run's token: without the
    whole distributions the parting counts as a difference; replaying the plain run's logits there gives both
    margins, and the rounding flip is judged a near-tie, as it is."""
    import dataclasses

    import torch

    from dflash_shared.lossless import NumericsPolicy
    from dflash_train.evaluate.speculate import Reference, greedy_with_logprobs

    at = 3
    prompt = heldout_prompts[0]
    plain = greedy_with_logprobs(target_model, prompt, NEW_TOKENS, ef.STOP_IDS)
    best = plain.tokens[at]
    runner_up = sorted(plain.logprobs[at], key=plain.logprobs[at].__getitem__)[0]
    tail = greedy_with_logprobs(target_model, [*prompt, *plain.tokens[:at], runner_up], NEW_TOKENS - at - 1,
                                ef.STOP_IDS)
    # The plain side of a rounding flip: its runner-up became its best; its kept list misses the other token.
    assert plain.replay is not None
    row = plain.replay(at)
    swapped = row.clone()
    swapped[best], swapped[runner_up] = row[runner_up], row[best]
    kept = {runner_up: float(torch.log_softmax(swapped, -1)[runner_up])}
    reference = Reference(tokens=[*plain.tokens[:at], runner_up, *tail.tokens],
                          logprobs=[*plain.logprobs[:at], kept, *tail.logprobs])
    wide = NumericsPolicy(dtype="bfloat16", tie_margin=100.0, max_near_tie_share=1.0)

    def parting(ref: Reference) -> Any:
        result = speculative_generate(trained_drafter, hooked_target, prompt, NEW_TOKENS, ef.STOP_IDS, 8,
                                      reference=ref, policy=wide, prompt_id="p0")
        return result.partings[0]

    blind = parting(reference)
    assert (blind.index, blind.plain_margin, blind.tie) == (at, None, False)
    replay = plain.replay
    assert replay is not None
    judged = parting(dataclasses.replace(reference, replay=lambda index: swapped if index == at else replay(index)))
    assert judged.index == at and judged.tie
    assert judged.plain_margin is not None and judged.plain_margin > 0
    assert judged.speculative_margin is not None and judged.speculative_margin > 0
