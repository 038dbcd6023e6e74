"""A rank's failure, classified for the gang it belongs to, and its exit status left for its pod.

The ranks of a multi-node run are one process group: when one of them stops, the collective its peers
are in fails. Those peers did nothing wrong, so their exit must not count as a failure of their pod:

- a rank whose own work failed exits with its own code (65 bad input, 64 bad config, 1 anything else);
- a rank whose collective or rendezvous failed because a peer is gone exits 75 (PREEMPTED): the whole
  gang stops and resumes from the last checkpoint, and the Job's podFailurePolicy does not count it;
- a rank told to stop (SIGTERM: its own pod was preempted, or a peer's was and the ranks agreed at a step
  boundary) writes its checkpoint and exits 75 as before.

torchrun itself exits 1 whenever a worker failed, whatever the worker's code, so each rank also writes its
exit status to a file of its own (`RANK_EXITS_ENV` names the folder; the trainer image's entrypoint
creates it per pod and reads it once torchrun is done, see docker/trainer/entrypoint.sh).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from dflash_shared.errors import Preempted, exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.logs import redact

log = logging.getLogger(__name__)

RANK_EXITS_ENV = "DFLASH_RANK_EXITS"
# Gloo reports a vanished peer as a plain RuntimeError raised from its TCP transport.
_GLOO_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "gloo/transport/tcp")

# Failures no rerun can heal: the pod keeps their code so that the Job fails at once.
DETERMINISTIC = (ExitCode.USAGE, ExitCode.BAD_INPUT)


class PeerLost(Preempted):
    """A collective or the rendezvous failed because another rank of the gang stopped or vanished."""

    def __init__(self, cause: BaseException) -> None:
        BaseException.__init__(self, f"the process group failed, a peer rank is gone ({type(cause).__name__}: "
                                     f"{str(cause).splitlines()[0][:200] if str(cause) else ''})")
        self.signal_name = "peer lost"


def _is_torch_distributed_error(exc: BaseException) -> bool:
    # Looked up rather than imported: without torch.distributed loaded no such error can exist.
    dist: Any = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None)
    return dist_error is not None and isinstance(exc, dist_error)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or during (cause chains are short; 16 guards cycles)."""
    seen: BaseException | None = exc
    for _ in range(16):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is a failed collective, store or rendezvous.

    NCCL and the c10d store raise torch.distributed.DistError subclasses (DistBackendError,
    DistNetworkError, DistStoreError); gloo raises RuntimeError from its transport.
    """
    return any(_is_torch_distributed_error(seen) or (
        type(seen) is RuntimeError and any(mark in str(seen) for mark in _GLOO_PEER_GONE)) for seen in _chain(exc))


def write_rank_exit(code: int, summary: str) -> None:
    """Leave this rank's exit status in the pod's folder (a no-op outside the trainer image's torchrun)."""
    folder = os.environ.get(RANK_EXITS_ENV, "")
    if not folder:
        return
    rank = os.environ.get("RANK", "0")
    try:
        with open(os.path.join(folder, f"rank-{rank}"), "w", encoding="utf-8") as fh:
            fh.write(f"{code} {redact(summary)[:300]}\n")
    except OSError as err:  # the pod then falls back to torchrun's status; never hide the real failure
        log.warning("could not record this rank's exit status in %s: %s", folder, err)


def classify(exc: BaseException) -> BaseException:
    """The exception this rank exits with: its own deterministic error if it had one, PeerLost when its
    failure came from the process group, else `exc` itself."""
    if isinstance(exc, Preempted):
        return exc
    # The rank's own bad input or config wins even when tearing the process group down failed after it.
    own = next((seen for seen in _chain(exc) if exit_code_for(seen) in DETERMINISTIC), None)
    if own is not None:
        return own
    return PeerLost(exc) if is_peer_failure(exc) else exc


@contextlib.contextmanager
def rank_exit() -> Iterator[None]:
    """Around a rank's run: a peer's failure becomes PeerLost (exit 75), and the exit status is recorded."""
    try:
        yield
    except SystemExit:
        raise
    except BaseException as exc:
        final = classify(exc)
        text = str(final)
        write_rank_exit(int(exit_code_for(final)), text.splitlines()[0] if text else type(final).__name__)
        if final is exc:
            raise
        raise final from exc
