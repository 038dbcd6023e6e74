"""Progress reporting that suits both a person at a terminal and a cluster's log collector.

On a TTY, `Progress` keeps one live line (rewritten with '\\r') with rate and ETA. Anywhere else it logs
one structured line every `interval_s` seconds, which stays readable when 1,000 pods share a log
store, and always a final summary line::

    progress tokenize: 12,345/100,000 records (12.3%), 45.6 krec/s, tokens 1.2M (78 k/s), ETA 0:03:12
    done tokenize: 100,000 records in 0:00:02, 50 krec/s, tokens 9.8M (4.9 M/s)

Extra counters (tokens, bytes, failures) ride along with `update(n, tokens=...)`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self, TextIO

logger = logging.getLogger("dflash.progress")

# Short forms keep rates compact ("45.6 krec/s"); other units are used as given.
_SHORT_UNITS = {"records": "rec", "tokens": "tok", "bytes": "B", "sequences": "seq", "prompts": "prompt"}
_TTY_REFRESH_S = 0.2
INTERVAL_ENV = "DFLASH_PROGRESS_INTERVAL_S"


def _si(value: float) -> tuple[str, str]:
    """Number and SI prefix: 45600 -> ('45.6', 'k'), 78000 -> ('78', 'k'), 950 -> ('950', '')."""
    prefix, scale = next(
        ((p, s) for p, s in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)) if abs(value) >= s), ("", 1.0)
    )
    value /= scale
    # Three significant digits at most, without trailing zeros: 45.6, 78, 1.2, 950.
    decimals = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    digits = f"{value:.{decimals}f}"
    if "." in digits:
        digits = digits.rstrip("0").rstrip(".")
    return digits, prefix


def human_count(value: float) -> str:
    """1234567 -> '1.2M' (extra counters, where exact digits do not matter)."""
    if abs(value) < 1000:
        return f"{value:,.0f}"
    digits, prefix = _si(value)
    return f"{digits}{prefix}"


def human_rate(per_s: float, unit: str = "") -> str:
    """45600, 'rec' -> '45.6 krec/s'; 78000, '' -> '78 k/s'."""
    digits, prefix = _si(per_s)
    return f"{digits} {prefix}{unit}/s"


def human_duration(seconds: float) -> str:
    """192 -> '0:03:12'."""
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Progress:
    """Counts work units and reports them; use as a context manager so the summary is always written.

    `is_tty` defaults to whether `stream` (stderr) is a terminal; `clock` is injectable for tests.
    `enabled=False` turns it into a silent counter (e.g. on ranks other than 0).
    """

    def __init__(
        self,
        total: int | None,
        unit: str,
        desc: str,
        interval_s: float | None = None,
        *,
        stream: TextIO | None = None,
        is_tty: bool | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.unit = unit
        self.desc = desc
        # 30 s suits a log store shared by many pods; a person watching a local run wants it sooner.
        self.interval_s = interval_s if interval_s is not None else float(os.environ.get(INTERVAL_ENV) or 30.0)
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = is_tty if is_tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled
        self._clock = clock
        self.n = 0
        self.extra: dict[str, int] = {}
        self._start = clock()
        self._last_report = self._start
        self._closed = False
        self._tty_width = 0

    # ------------------------------------------------------------------ counting

    def update(self, n: int = 1, **extra_counts: int) -> None:
        """Add `n` units and any extra counters (e.g. tokens=1234); reports when it is time to."""
        self.n += n
        for name, value in extra_counts.items():
            self.extra[name] = self.extra.get(name, 0) + value
        if not self.enabled:
            return
        now = self._clock()
        due = _TTY_REFRESH_S if self.is_tty else self.interval_s
        if now - self._last_report >= due:
            self._last_report = now
            self._emit(self.line(now))

    # ------------------------------------------------------------------ text

    @property
    def short_unit(self) -> str:
        return _SHORT_UNITS.get(self.unit, self.unit)

    def _extras(self, elapsed: float) -> str:
        parts = []
        for name, value in self.extra.items():
            rate = human_rate(value / elapsed) if elapsed > 0 else "- /s"
            parts.append(f", {name} {human_count(value)} ({rate})")
        return "".join(parts)

    def line(self, now: float | None = None) -> str:
        """The current progress line (without the live-line control characters)."""
        elapsed = (now if now is not None else self._clock()) - self._start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        if self.total:
            done = f"{self.n:,}/{self.total:,} {self.unit} ({100.0 * self.n / self.total:.1f}%)"
        else:
            done = f"{self.n:,} {self.unit}"
        text = f"progress {self.desc}: {done}, {human_rate(rate, self.short_unit)}{self._extras(elapsed)}"
        if self.total:
            left = self.total - self.n
            eta = human_duration(left / rate) if rate > 0 else "?"
            text += f", ETA {eta}"
        return text

    def summary(self, status: str = "done", reason: str = "") -> str:
        elapsed = self._clock() - self._start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        total = f"/{self.total:,}" if self.total is not None and self.total != self.n else ""
        return (
            f"{status} {self.desc}: {self.n:,}{total} {self.unit} in {human_duration(elapsed)}, "
            f"{human_rate(rate, self.short_unit)}{self._extras(elapsed)}{f' ({reason})' if reason else ''}"
        )

    # ------------------------------------------------------------------ output

    def _emit(self, text: str) -> None:
        if self.is_tty:
            # Pad to the previous width so a shorter line fully overwrites a longer one.
            self.stream.write("\r" + text.ljust(self._tty_width))
            self.stream.flush()
            self._tty_width = len(text)
        else:
            logger.info(text)

    def close(self, status: str = "done", reason: str = "") -> None:
        """Write the summary line once (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        if self.is_tty and self._tty_width:
            self.stream.write("\r" + self.line().ljust(self._tty_width) + "\n")
            self.stream.flush()
        logger.info(self.summary(status, reason))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            # In words: the error line that follows says what went wrong in full.
            signal_name = getattr(exc, "signal_name", None)
            self.close("stopped", f"{signal_name} received" if signal_name else "by the error below")
