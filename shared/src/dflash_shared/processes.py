"""Child processes that never outlive the stage process that started them.

A stage killed with SIGKILL (the OOM killer, `kill -9`, a node agent) runs no cleanup, so its worker processes
would be re-parented to PID 1 and keep their memory (hundreds of MB per tokenize worker) until someone finds
them. On Linux the kernel can deliver a signal to a process when its parent exits (PR_SET_PDEATHSIG); every
worker asks for SIGKILL that way as it starts. Workers also drop the parent's signal handlers: the stage's
SIGTERM handler raises `Preempted` to unwind the stage, which inside a pool worker only kept it alive.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Call first thing in a child: SIGKILL it when `parent_pid` exits, and restore plain signal handling.

    SIGINT is ignored: a Ctrl-C reaches the whole process group, and the parent, which handles it, stops its
    workers itself; a KeyboardInterrupt traceback from each worker would only bury its message.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died between the fork and the prctl call: then nobody would send the signal.
    if os.getppid() != parent_pid:
        os._exit(1)


def die_with_this_process() -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child dies when the calling process does."""
    parent = os.getpid()
    return lambda: die_with_parent(parent)
