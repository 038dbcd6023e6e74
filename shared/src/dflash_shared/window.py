"""The training window: the one record length the generate, tokenize and train stages agree on.

Training reads at most `max_length` tokens of a record (prompt included); every token past that is paid for
in generation and never read by a step. So the window is one figure shared by the stages: tokenize cuts at
it, train packs rows of it, and generate stops each completion where the window ends (its per-prompt budget
is min(max_new_tokens, window - prompt tokens)). A completion stopped there (finish_reason "length") is a
prefix of the target's own answer, exactly the tokens a window would have read of the whole answer: it is
kept and counted as `truncated_by_budget`, not rejected.

Each manifest from generate to train records the tokens generated, the tokens inside the window, and their
ratio (`window_fraction`); `pipeline plan` prints the same ratio before a run is submitted and warns when
more than `MAX_UNREAD_FRACTION` of the generated tokens would lie past the window.
"""

from __future__ import annotations

# The default training window (TokenizeConfig.max_length, GenerateConfig.training_window). SpecForge's DFlash
# recipes train at 2,048; 4,096 holds a prompt of ~700 tokens and a completion of ~3,400. A longer window is
# a choice with a memory cost (`dflash_train.training.memory_plan`, bench/bench_memory_plan.py --windows).
DEFAULT_TRAINING_WINDOW = 4096
# The share of generated tokens a run may pay for that no training window reads, before the plan warns.
MAX_UNREAD_FRACTION = 0.10


def completion_in_window(prompt_tokens: int, completion_tokens: int, window: int) -> int:
    """Completion tokens a window of `window` tokens reads of one record: the rest of the window after the
    prompt, at most the whole completion (a prompt as long as the window leaves none)."""
    return min(completion_tokens, max(0, window - prompt_tokens))


def window_fraction(in_window: int | None, total: int | None) -> float | None:
    """in_window / total, rounded for a manifest; None when either is unknown, 1.0 for nothing generated."""
    if in_window is None or total is None:
        return None
    return round(in_window / total, 6) if total else 1.0
