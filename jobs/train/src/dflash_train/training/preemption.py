"""A stop requested by SIGTERM/SIGINT, taken at a step boundary: the training loop never stops inside a step.

The signal only sets a flag; at the next step boundary all ranks agree (one all-reduce, `DistEnv.any`) to stop, save
a checkpoint and raise `Preempted`, so the process exits 75 with nothing lost. A kill -9 loses the steps since the
last periodic checkpoint and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)


@contextlib.contextmanager
def deferred_stop() -> Iterator[threading.Event]:
    """SIGTERM/SIGINT set the returned event instead of interrupting a step (main thread only)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, _frame: object) -> None:
        if not stop.is_set():
            log.warning("%s received: stopping after this step with a checkpoint", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
