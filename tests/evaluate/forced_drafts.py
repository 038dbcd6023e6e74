"""A stand-in for the offline loop's `propose` that drafts a chosen outcome: the target's own continuation, wrong at
one slot. The lossless tests of every target family force a rejection where they want it with it."""

from __future__ import annotations

from typing import Any


def forced_drafts(reference: list[int], wrong_at: int, mask_id: int) -> Any:
    """A `propose` stand-in that drafts the target's own continuation with one wrong token at `wrong_at`."""
    state = {"committed": 1}

    def propose(drafter: Any, target: Any, context: Any, last_token: int, block_size: int) -> list[int]:
        del drafter, target, context, last_token
        start = state["committed"]
        draft = list(reference[start : start + block_size - 1])
        draft += [mask_id] * (block_size - 1 - len(draft))
        if wrong_at < len(draft):
            draft[wrong_at] = mask_id  # never the target's argmax here: a rejection at exactly this slot
        state["committed"] = start + min(wrong_at, block_size - 1) + 1
        return draft

    return propose
