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
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any, NoReturn

from dflash_shared.errors import BadInputError, Preempted, did_you_mean, exit_code_for
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
        raise Preempted(name)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


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


def report_failure(stage: str, exc: BaseException) -> ExitCode:
    """Log the failure as one line (plus details for bad input) and return its exit code."""
    code = exit_code_for(exc)
    summary = redact(one_line(exc)) or type(exc).__name__
    if code is ExitCode.PREEMPTED:
        logger.warning("%s stopped: %s; exit %s, a rerun resumes", stage, summary, describe(code))
    else:
        kind = "" if code in _EXPECTED else f"{type(exc).__name__}: "
        logger.error("%s failed, exit %s: %s%s", stage, describe(code), kind, summary)
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


def select_command(prog: str, commands: Mapping[str, Command], command: str) -> Command:
    """The subcommand named `command`. `--help` prints the usage and exits 0; no or an unknown command exits 64."""
    usage = f"usage: {prog} {{{'|'.join(commands)}}} [--flag value ...]  (--help on each command)"
    if command in ("-h", "--help", "help"):
        print(usage)
        sys.exit(0)
    if command not in commands:
        if command:
            print(f"{prog}: unknown command {command!r}{did_you_mean(command, list(commands))}", file=sys.stderr)
        print(usage, file=sys.stderr)
        sys.exit(int(ExitCode.USAGE))
    return commands[command]
