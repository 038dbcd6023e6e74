"""The serving check's step-by-step comparison (dflash_generate.serve_steps), on hand-made traces."""

from __future__ import annotations

from dflash_generate.serve_steps import compare_steps, draft_positions, step_differences


def test_steps_draft_after_the_tokens_committed_before_them() -> None:
    # The prefill commits token 0; a step accepting n commits n + 1 tokens.
    assert draft_positions([2, 0, 7, 1]) == [1, 4, 5, 13]
    assert draft_positions([]) == []


def test_equal_traces_agree_on_every_step() -> None:
    steps = compare_steps(["a", "b"], [[2, 0, 7], [1]], [([2, 0, 7], [7, 7, 7]), ([1], None)], drafts=7,
                          max_step_mismatch_fraction=0.0)
    assert (steps.prompts, steps.offline_steps, steps.engine_steps, steps.differing, steps.first) == (2, 4, 4, 0, None)
    assert steps.failure() is None
    assert steps.summary() == "8/8 steps (offline 4, engine 4) of 2 prompts alike"


def test_a_differing_step_is_named_and_the_steps_until_both_meet_again_count_on_both_sides() -> None:
    # Offline drafts at 1, 4, 5, 13; the engine accepts 1 instead of 2 at its first step, so it drafts at 1, 3, 4,
    # 5, 13: it meets the offline loop again at 4 (same acceptance there and after).
    offline, engine = [2, 0, 7, 1], [1, 0, 0, 7, 1]
    differences, engine_only = step_differences(offline, engine, None, drafts=7)
    assert differences == [(0, 1, 1, 7)] and engine_only == 2  # its steps at 1 and 3
    steps = compare_steps(["p0", "p1"], [[3], offline], [([3], [7]), (engine, [7] * 5)], drafts=7,
                          max_step_mismatch_fraction=0.2)
    assert (steps.offline_steps, steps.engine_steps, steps.differing) == (5, 6, 3)
    assert steps.prompts_differing == ["p1"]
    assert steps.first is not None and steps.first.describe() == (
        "prompt p1 step 0 (at token 1): offline accepted 2, engine accepted 1 of 7 drafted")
    failure = steps.failure()
    assert failure is not None and (
        "differ from the offline loop's on 3/11 steps (27.3% > 20.0%; offline 5, engine 6) of 1/2 prompts decoded "
        "alike; first: prompt p1 step 0") in failure
    assert steps.model_copy(update={"max_step_mismatch_fraction": 0.3}).failure() is None


def test_an_engine_that_accepts_less_differs_on_each_of_its_extra_steps() -> None:
    # Offline accepts 7 twice (drafts at 1, 9); the engine accepts nothing (drafts at 1, 2, ..., 16).
    differences, engine_only = step_differences([7, 7], [0] * 16, None, drafts=7)
    assert [d[:3] for d in differences] == [(0, 1, 0), (1, 9, 0)] and engine_only == 16


def test_a_step_the_engine_did_not_take_or_drafted_short_differs() -> None:
    # The engine never drafts at offline position 4 (it accepted more at its first step), and drafted 3, not 7,
    # at position 5.
    differences, engine_only = step_differences([2, 0, 7], [3, 7], [7, 3], drafts=7)
    assert differences == [(0, 1, 3, 7), (1, 4, None, None), (2, 5, 7, 3)] and engine_only == 2
    steps = compare_steps(["x"], [[2, 0, 7]], [([3, 7], [7, 3])], drafts=7, max_step_mismatch_fraction=0.0)
    assert steps.first is not None and steps.first.engine_accepted == 3
    assert "the engine took no step there" in steps.first.model_copy(update={"engine_accepted": None}).describe()


def test_prompts_decoded_differently_are_not_compared() -> None:
    steps = compare_steps(["a", "b"], [[1, 1], [5]], [None, ([5], [7])], drafts=7, max_step_mismatch_fraction=0.0)
    assert (steps.prompts, steps.offline_steps, steps.differing) == (1, 1, 0)
    empty = compare_steps(["a"], [[1]], [None], drafts=7, max_step_mismatch_fraction=0.0)
    assert (empty.prompts, empty.steps, empty.fraction, empty.failure()) == (0, 0, 0.0, None)
