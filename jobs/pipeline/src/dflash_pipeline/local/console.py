"""What a person running the pipeline on this machine sees: the stages, their progress and their verdicts.

Each stage process writes everything (its own log lines, the engine's log, library warnings, download bars) to
a log file per stage and shard, whose path is printed. The console gets only the project's own log lines (the
stage format, see `dflash_shared.logs`), and of those the ones a person acts on: warnings and errors,
progress and training steps, preflight verdicts, committed manifests. On a terminal the progress lines share
one live line (rate and ETA, rewritten in place); elsewhere one every ten seconds. `--verbose` passes every line
through, as a pod's log does. When a stage fails, the last lines of its log are shown with the log's path.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

# The stage format: "2026-11-30T05:10:00Z INFO [tokenize shard=3] dflash_tokenize.stage: message".
_OWN_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:]+Z (?P<level>[A-Z]+) \[[^\]]*\] (?P<logger>[\w.]+): (?P<message>.*)$")
# Loggers whose lines report progress: one live line on a terminal.
_PROGRESS_LOGGERS = frozenset({"dflash.progress", "dflash_train.training.metrics"})
_PROGRESS_MESSAGE = re.compile(r"^(progress |step \d+/\d+)")
# Informational lines of the project that a person watching wants (the rest stay in the log file).
_WANTED_INFO = re.compile(
    r"(check\(s\) passed|wrote manifest|^done |^stage |tau |checkpoint step \d+ saved|committed by an earlier attempt)"
)
TAIL_LINES = 30
PROGRESS_EVERY_S = 10.0


def classify(line: str) -> str:
    """'progress', 'show' or 'log' (file only) for one line of a stage's output."""
    own = _OWN_LINE.match(line)
    if own is None:
        return "log"
    if own["level"] in ("ERROR", "CRITICAL"):
        return "show"
    if own["level"] == "WARNING":
        # Libraries log through the stage format too (vLLM: "Triton is installed, but ..."): their warnings
        # are the engine's business and stay in the log; the project's own warnings are for the person.
        return "show" if own["logger"].startswith("dflash") else "log"
    if own["logger"] in _PROGRESS_LOGGERS and _PROGRESS_MESSAGE.match(own["message"]):
        return "progress"
    return "show" if _WANTED_INFO.search(own["message"]) else "log"


class Console:
    """Echoes the chosen lines of stage output to `stream` (stderr, like the stages' own logs), keeping a live
    progress line on a terminal; stdout stays free for results (the demo's summary)."""

    def __init__(self, stream: TextIO | None = None, verbose: bool = False, is_tty: bool | None = None,
                 transcript: Path | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.verbose = verbose
        self.is_tty = is_tty if is_tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self._live_width = 0
        self._live_text = ""
        self._last_progress = -PROGRESS_EVERY_S
        self.lines_shown = 0
        # What the person saw, line by line (a live line as it last read): kept beside the stage logs.
        self.transcript = transcript

    def _record(self, text: str) -> None:
        if self.transcript is not None:
            self.transcript.parent.mkdir(parents=True, exist_ok=True)
            with open(self.transcript, "a", encoding="utf-8") as fh:
                fh.write(text + "\n")

    def _end_live(self) -> None:
        if self._live_width:
            self.stream.write("\n")
            self._record(self._live_text)
            self._live_width = 0

    def say(self, text: str) -> None:
        """A line of the pipeline's own (stage started, finished, log path)."""
        self._end_live()
        self.stream.write(text + "\n")
        self.stream.flush()
        self._record(text)
        self.lines_shown += 1

    def feed(self, line: str) -> None:
        kind = "show" if self.verbose else classify(line)
        if kind == "log":
            return
        if kind == "progress" and self.is_tty:
            message = _OWN_LINE.match(line)
            text = message["message"] if message else line
            self.stream.write("\r" + text.ljust(self._live_width))
            self.stream.flush()
            if not self._live_width:
                self.lines_shown += 1
            self._live_width, self._live_text = len(text), text
            return
        if kind == "progress":
            # Off a terminal, one progress line per PROGRESS_EVERY_S (a training step a second would flood it).
            now = time.monotonic()
            if now - self._last_progress < PROGRESS_EVERY_S:
                return
            self._last_progress = now
        self.say(line)

    def close(self) -> None:
        self._end_live()


def run_logged(command: Sequence[str], env: Mapping[str, str], cwd: Path, log_path: Path, console: Console) -> int:
    """Run `command` with its stdout and stderr appended to `log_path`, echoing lines through `console`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with open(log_path, "a", encoding="utf-8") as log, subprocess.Popen(
        list(command), env=dict(env), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, encoding="utf-8", errors="replace", bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            log.write(raw)
            # Download bars and live lines of libraries rewrite themselves with '\r': keep the last state.
            line = raw.rstrip("\n").rsplit("\r", 1)[-1]
            tail.append(line)
            console.feed(line)
        code = proc.wait()
    console.close()
    if code != 0 and not console.verbose:
        console.say(f"--- last {len(tail)} lines of {log_path} ---")
        for line in tail:
            console.say(line)
    return code
