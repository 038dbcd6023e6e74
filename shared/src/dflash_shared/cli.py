"""The wrapper around every stage entrypoint: exit codes, one clear error line, SIGTERM handling.

    def main() -> NoReturn:
        run_stage_main("tokenize", lambda: run(parse_settings(TokenizeConfig)))

Whatever escapes `fn` becomes an exit status from `dflash_shared.exit_codes` (see `errors.exit_code_for`)
and exactly one ERROR line naming the stage, the exit code and the cause, with secrets redacted; the
traceback goes to DEBUG for unexpected errors, and to nobody for the expected ones (bad input, bad
config, unfit node), whose message is the whole story. SIGTERM and SIGINT raise `Preempted` in the main
thread so `finally` blocks and context managers commit or abort their work before the process exits 75.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any, NoReturn

from dflash_shared.errors import (
    BadInputError,
    Preempted,
    access_failure,
    describe_os_error,
    did_you_mean,
    exit_code_for,
)
from dflash_shared.exit_codes import ExitCode, describe
from dflash_shared.logs import logging_configured, redact, setup_logging

logger = logging.getLogger("dflash.cli")

# Kubernetes shows the content of this file in `kubectl describe pod` and the Job's status; the path is
# the kubelet default and only written when the container runtime has created it.
TERMINATION_LOG = os.environ.get("DFLASH_TERMINATION_LOG", "/dev/termination-log")
_EXPECTED = (ExitCode.USAGE, ExitCode.BAD_INPUT, ExitCode.ENVIRONMENT, ExitCode.PREEMPTED)


@contextlib.contextmanager
def preemption_handler(signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
    """Turn the first of `signals` into a `Preempted` exception in the main thread.

    Later signals are logged and ignored: the stage is already unwinding, and interrupting its cleanup
    (an upload being aborted, a checkpoint being written) would leave more behind, not less.
    """
    fired: list[str] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if fired:
            logger.warning("%s received again while stopping; still cleaning up", name)
            return
        fired.append(name)
        logger.warning("%s received: stopping at the next safe point, finished work stays committed", name)
        if _deferral.depth:
            _deferral.pending = name
            return
        raise Preempted(name)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class _Deferral:
    """How many `preemption_deferred` blocks the main thread is in, and the signal that arrived inside one."""

    depth = 0
    pending: str | None = None


_deferral = _Deferral()


@contextlib.contextmanager
def preemption_deferred() -> Iterator[None]:
    """Hold a preemption signal that arrives inside the block until the block ends, then raise `Preempted`.

    For calls into code whose state an exception raised at an arbitrary bytecode would corrupt: a vLLM
    engine interrupted between the frames of a multi-part message, or with an output dequeued but not yet
    processed, never answers again, so an engine kept in the process (a test, a later shard) would hang.
    Keep such blocks short: the pod's grace period runs while one finishes.
    """
    _deferral.depth += 1
    try:
        yield
    except BaseException:
        # The block failed on its own: that error unwinds the stage, and a held signal must not fire later
        # at some unrelated point.
        _deferral.pending = None
        raise
    finally:
        _deferral.depth -= 1
    if _deferral.depth == 0 and _deferral.pending is not None:
        name, _deferral.pending = _deferral.pending, None
        raise Preempted(name)


def _write_termination_log(text: str) -> None:
    if os.path.isfile(TERMINATION_LOG):
        with contextlib.suppress(OSError), open(TERMINATION_LOG, "w", encoding="utf-8") as fh:
            fh.write(text[:4000])


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (validation errors list each field once)."""
    pydantic_core: Any = sys.modules.get("pydantic_core")  # not imported unless a model was used
    if pydantic_core is not None and isinstance(exc, pydantic_core.ValidationError):
        problems = [
            f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']} (got {err.get('input')!r:.80})"
            for err in exc.errors()
        ]
        return f"invalid {exc.title}: " + "; ".join(problems)
    return " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _summary(exc: BaseException) -> str:
    """What went wrong in plain words: a refused local access says which path and why."""
    if isinstance(exc, OSError) and exc.strerror:  # "[Errno 13] Permission denied: '/x'" reads as code
        return describe_os_error(exc)
    text = one_line(exc)
    refused = access_failure(exc)
    return describe_os_error(refused) if refused is not None and not text else text


def _detail_lines(exc: BaseException) -> list[str]:
    """The lines of a plain multi-line message (the first is the headline); [] for a one-line message and for the
    messages `one_line` words itself (validation errors, access failures)."""
    pydantic_core: Any = sys.modules.get("pydantic_core")
    if pydantic_core is not None and isinstance(exc, pydantic_core.ValidationError):
        return []
    if isinstance(exc, OSError):
        return []
    lines = [line.rstrip() for line in str(exc).splitlines() if line.strip()]
    return lines if len(lines) > 1 else []


def report_failure(stage: str, exc: BaseException) -> ExitCode:
    """Log the failure as one line (plus details for bad input) and return its exit code."""
    code = exit_code_for(exc)
    summary = redact(_summary(exc)) or f"no message ({type(exc).__name__})"
    if code is ExitCode.PREEMPTED:
        logger.warning("%s stopped: %s; exit %s, a rerun resumes", stage, summary, describe(code))
    else:
        # The expected failures' messages are the whole story; anything else is a bug or a fault nobody
        # foresaw, whose traceback is at DEBUG level (a retry may pass, so the Job retries it).
        storage: Any = sys.modules.get("dflash_shared.storage")
        known = code in _EXPECTED or (storage is not None and isinstance(exc, storage.StorageError))
        kind = "" if known else "unexpected failure (traceback at DEBUG level): "
        details = _detail_lines(exc)
        headline = redact(details.pop(0)) if details else summary
        logger.error("%s failed, exit %s: %s%s", stage, describe(code), kind, headline)
        # A message of several lines (a fit refusal's plan table, the fixes one per line) keeps its lines: one
        # ERROR line each, indented below the headline, instead of one line thousands of characters long.
        for line in details:
            logger.error("  %s", redact(line))
    if isinstance(exc, BadInputError):
        for reason, count in sorted(exc.counts.items()):
            examples = "; ".join(exc.examples.get(reason, [])[:3])
            logger.error("  %s: %d record(s)%s", reason, count, f", e.g. {redact(examples)}" if examples else "")
    if code not in _EXPECTED:
        logger.debug("traceback of the failure above", exc_info=exc)
    _write_termination_log(f"exit {describe(code)}: {summary}")
    return code


def run_stage_main(stage: str, fn: Callable[[], int | None]) -> NoReturn:
    """Run a stage entrypoint and exit with its status; never returns.

    `fn` returns None or 0 for success, or an exit code of its own choosing (e.g. a preflight result).
    `SystemExit` from inside `fn` (e.g. `--help`) passes through unchanged.
    """
    if not logging_configured():
        # fn may reconfigure with shard/rank once it knows them; errors before that still get a format.
        setup_logging(stage)
    try:
        with preemption_handler():
            result = fn()
        code = ExitCode.OK if result is None else result
    except SystemExit:
        raise
    except BaseException as exc:  # the process boundary: everything is reported
        code = report_failure(stage, exc)
    logging.shutdown()
    sys.exit(int(code))


Command = Callable[[], int | None]

EXIT_CODES_LINE = ("exit codes: 0 done, 1 retry, 64 fix the configuration, 65 fix the input, "
                   "69 fix the node or its access, 75 stopped by a signal (a rerun resumes)")


def usage(prog: str, commands: Mapping[str, object], about: Mapping[str, str] | None = None,
          examples: Sequence[str] = ()) -> str:
    """The top-level help: one line per command, examples, and the exit codes a script can act on."""
    lines = [f"usage: {prog} {{{'|'.join(commands)}}} [--flag value ...]  (--help on each command)"]
    if about:
        width = max(len(name) for name in commands)
        lines += ["", "commands:", *(f"  {name:<{width}}  {about.get(name, '')}".rstrip() for name in commands)]
    if examples:
        lines += ["", "examples:", *(f"  {example}" for example in examples)]
    if about:
        lines += ["", f"`{prog} COMMAND --help` lists the command's flags and their DFLASH_* variables.",
                  EXIT_CODES_LINE]
    return "\n".join(lines)


def select_command(prog: str, commands: Mapping[str, Command], command: str,
                   about: Mapping[str, str] | None = None, examples: Sequence[str] = ()) -> Command:
    """The subcommand named `command`. `--help` prints the usage and exits 0; no or an unknown command exits 64.

    `about` gives each command's one-line description and `examples` whole command lines, both for --help.
    """
    text = usage(prog, commands, about, examples)
    if command in ("-h", "--help", "help"):
        print(text)
        sys.exit(0)
    if command not in commands:
        if command:
            print(f"{prog}: unknown command {command!r}{did_you_mean(command, list(commands))}", file=sys.stderr)
        print(text, file=sys.stderr)
        sys.exit(int(ExitCode.USAGE))
    return commands[command]
