"""SIGTERM handling (dflash_shared.cli): the signal raises `Preempted` in the main thread, except inside a
`preemption_deferred` block, which finishes first and raises it as it ends."""

from __future__ import annotations

import os
import signal

import pytest

from dflash_shared.cli import preemption_deferred, preemption_handler
from dflash_shared.errors import Preempted


def test_a_signal_raises_preempted_where_it_lands() -> None:
    reached: list[str] = []
    with pytest.raises(Preempted, match="SIGTERM"), preemption_handler():
        os.kill(os.getpid(), signal.SIGTERM)
        reached.append("after the signal")
    assert reached == []


def test_a_signal_inside_a_deferred_block_is_raised_when_the_block_ends() -> None:
    reached: list[str] = []
    with pytest.raises(Preempted, match="SIGTERM"), preemption_handler():
        with preemption_deferred():
            with preemption_deferred():  # nested: raised once, by the outermost block
                os.kill(os.getpid(), signal.SIGTERM)
                reached.append("inner block finished")
            reached.append("outer block finished")
        reached.append("after the blocks")
    assert reached == ["inner block finished", "outer block finished"]


def test_a_block_that_fails_on_its_own_drops_the_held_signal() -> None:
    with preemption_handler():
        with pytest.raises(ValueError, match="engine failed"), preemption_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            raise ValueError("engine failed")
        with preemption_deferred():  # the dropped signal does not fire at a later, unrelated block
            pass


def test_without_a_signal_a_deferred_block_changes_nothing() -> None:
    with preemption_handler(), preemption_deferred():
        value = 1
    assert value == 1

