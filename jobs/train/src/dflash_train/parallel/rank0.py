"""Work that rank 0 does for every rank: which node holds it, and a read done there and shared with all
(torch-free: the stage calls it before choosing the parallelism)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from dflash_train.parallel.distributed import DistEnv

T = TypeVar("T")


def holds_rank0(env: DistEnv) -> bool:
    """Whether this node runs global rank 0: torchrun numbers a node's ranks consecutively from its first,
    so rank 0's node is the one whose ranks equal their local ranks (always true on one node)."""
    return bool(env.rank == env.local_rank)


def on_rank0(env: DistEnv, read: Callable[[], T]) -> T:
    """`read()` called on rank 0 only, its result on every rank; an error there is raised on every rank
    (the same exception, so the exit code is the same) instead of leaving the others waiting."""
    if not env.distributed:
        return read()
    result: tuple[T | None, BaseException | None] = (None, None)
    if env.is_main:
        try:
            result = (read(), None)
        except Exception as err:  # re-raised below, on every rank
            result = (None, err)
    value, error = env.broadcast_object(result)
    if error is not None:
        raise error
    return value  # type: ignore[no-any-return]
