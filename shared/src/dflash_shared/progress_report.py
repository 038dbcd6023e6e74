"""Where a long stage stands, as small JSON objects in its output prefix, rewritten every few minutes.

A stage that runs for days writes its progress beside its output, so `pipeline status` shows it from the store
alone, with no cluster access and no log reading:

    <drafter>/progress.json                      train (rank 0): step/total, loss, tau, tokens/s, ETA, checkpoint
    <completions>/_status/worker-00003.json      generate, one per worker: chunks, prompts, tokens, rate, ETA

`BackgroundWriter` writes on a thread of its own, so a slow or failing store never holds up a training step or
the engine: the loop hands over the newest payload and goes on. A payload still waiting when a newer one comes
is replaced (only the newest matters); a failed write is one warning, and the next report tries again.
`Every` says when a report is due. Each object carries `updated` (UTC), so a reader can tell a stalled
stage from a slow one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from dflash_shared.storage import ObjectNotFoundError, ObjectStore

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# Between reports: often enough to follow a run of days, rare enough to cost nothing (one small PUT).
DEFAULT_INTERVAL_S = 300.0
TRAIN_PROGRESS_NAME = "progress.json"
GENERATE_STATUS_DIR = "_status"


def utc_stamp(now: float | None = None) -> str:
    """'2026-11-30T05:10:00Z' (seconds), the time format of every report."""
    moment = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_stamp(text: str) -> datetime | None:
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except (TypeError, ValueError):
        return None


def worker_status_name(index: int) -> str:
    return f"worker-{index:05d}.json"


class Every:
    """True from `due()` once per `interval_s` (the first call is due, so a report comes early)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"report interval {interval_s} s must be positive")
        self.interval_s, self._clock = interval_s, clock
        self._last: float | None = None

    def due(self) -> bool:
        now = self._clock()
        if self._last is not None and now - self._last < self.interval_s:
            return False
        self._last = now
        return True


class BackgroundWriter:
    """Runs the newest submitted job on one daemon thread; `close` runs what is pending and stops."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._cond = threading.Condition()
        self._pending: Callable[[], None] | None = None
        self._closing = False
        self._busy = False
        self._thread: threading.Thread | None = None
        self.failures = 0

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing being written: a caller whose payload is costly to make checks first."""
        with self._cond:
            return self._pending is None and not self._busy

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job`, replacing one not started yet; returns at once."""
        with self._cond:
            if self._closing:
                return
            self._pending = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"report {self.what}", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                job, self._pending = self._pending, None
                if job is None:
                    return
                self._busy = True
            try:
                job()
            except Exception as err:  # noqa: BLE001 - a report never stops the stage
                self.failures += 1
                log.warning("%s: could not write (%s); the stage goes on, the next report tries again", self.what, err)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def close(self, timeout_s: float = 60.0) -> None:
        """Run the pending job (if any) and stop, waiting at most `timeout_s`."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("%s: the last report is still being written after %.0f s; leaving it", self.what,
                            timeout_s)


def write_report(store: ObjectStore, uri: str, payload: dict[str, Any]) -> None:
    store.write_bytes(uri, json.dumps(payload, indent=1, sort_keys=True).encode() + b"\n")


def read_report(store: ObjectStore, uri: str) -> dict[str, Any] | None:
    """The report at `uri`; None when there is none. Raises ValueError when it does not parse as an object."""
    try:
        data = json.loads(store.read_bytes(uri))
    except ObjectNotFoundError:
        return None
    except UnicodeDecodeError as err:
        raise ValueError(f"{uri} is not JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{uri} is not a JSON object")
    return data
