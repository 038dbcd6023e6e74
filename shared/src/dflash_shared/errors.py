"""Exception types a stage raises on purpose, and the one mapping from exceptions to exit codes.

Code deep inside a stage raises what it knows (bad input, bad config, unfit node); only the entrypoint
wrapper (`dflash_shared.cli.run_stage_main`) turns that into a process exit status, via `exit_code_for`.
"""

from __future__ import annotations

import difflib
import errno
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from dflash_shared.exit_codes import ExitCode


class BadInputError(ValueError):
    """The input data cannot be used: a rerun on the same input would fail the same way.

    `counts` (reason -> records) and `examples` (reason -> a few record ids or messages) let the error
    line say how much of the input is affected and where to look, without dumping the data.
    """

    def __init__(
        self,
        message: str,
        counts: Mapping[str, int] | None = None,
        examples: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.counts: dict[str, int] = dict(counts or {})
        self.examples: dict[str, list[str]] = {k: list(v) for k, v in (examples or {}).items()}


def did_you_mean(name: str, valid: Sequence[str]) -> str:
    """' (did you mean X?)' for the valid name nearest to a misspelt `name`, or '' when none is close."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class ConfigError(ValueError):
    """The configuration or command line is invalid; the message names the flag or field."""


class PreflightError(RuntimeError):
    """The node or its access is unfit for the stage (no GPU, disk, credentials, ...)."""


class Preempted(BaseException):
    """Raised from the SIGTERM handler so the stage unwinds through its `finally` blocks to a checkpoint.

    A BaseException, like KeyboardInterrupt, so that `except Exception` blocks in a stage or a library
    do not swallow it and carry on working after the scheduler asked the pod to stop.
    """

    def __init__(self, signal_name: str = "SIGTERM") -> None:
        super().__init__(f"{signal_name} received")
        self.signal_name = signal_name


def _is(exc: BaseException | None, module: str, name: str) -> bool:
    # Looked up instead of imported: an exception of a class whose module was never imported cannot
    # exist, and entrypoints that fail early (--help, a config typo) then do not pay for boto3 or pydantic.
    mod: Any = sys.modules.get(module)
    return mod is not None and isinstance(exc, getattr(mod, name))


def _environment_storage_failure(exc: BaseException) -> bool:
    """True when `exc`, or an exception it was raised from, is a StorageError no retry can heal."""
    seen: BaseException | None = exc
    for _ in range(16):  # cause chains are short; the bound guards against cycles
        if seen is None:
            return False
        if _is(seen, "dflash_shared.storage", "StorageError") and getattr(seen, "is_environment", False):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# A local path this process may not use: no retry of the same command on the same node heals these (an
# operator fixes a mount, a permission or frees disk), so they are ENVIRONMENT like refused S3 access.
ACCESS_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT})


def access_failure(exc: BaseException) -> OSError | None:
    """The OSError of a refused local access in `exc` or the exceptions it was raised from, else None."""
    seen: BaseException | None = exc
    for _ in range(16):  # cause chains are short; the bound guards against cycles
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in ACCESS_ERRNOS:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def describe_os_error(err: OSError) -> str:
    """'cannot use /out/data: permission denied' (never the class name nor the errno number)."""
    reason = (err.strerror or str(err) or "refused").lower()
    paths = [str(p) for p in (err.filename, err.filename2) if p is not None]
    return f"cannot use {' -> '.join(paths)}: {reason}" if paths else reason


def exit_code_for(exc: BaseException) -> ExitCode:
    """The exit status for an exception that reached the entrypoint (the table in `dflash_shared.exit_codes`)."""
    if isinstance(exc, Preempted):
        return ExitCode.PREEMPTED
    if _environment_storage_failure(exc) or access_failure(exc) is not None:
        # Missing or refused credentials, a missing bucket, an endpoint nobody answers on, a local path that
        # may not be read or written: ENVIRONMENT in `run` exactly as in `preflight`, so the Job's policy
        # treats them alike.
        return ExitCode.ENVIRONMENT
    if _is(exc, "dflash_shared.manifest_io", "ManifestError"):
        # A manifest that could not be read because storage failed (network, throttling) is a transient
        # failure, not bad input; an absent manifest or an absent shard is bad input.
        cause = exc.__cause__
        if _is(cause, "dflash_shared.storage", "StorageError") and not _is(
            cause, "dflash_shared.storage", "ObjectNotFoundError"
        ):
            return ExitCode.RETRYABLE
        return ExitCode.BAD_INPUT
    if isinstance(exc, BadInputError):
        return ExitCode.BAD_INPUT
    if isinstance(exc, ConfigError) or _is(exc, "pydantic_core", "ValidationError"):
        return ExitCode.USAGE
    if isinstance(exc, PreflightError):
        return ExitCode.ENVIRONMENT
    return ExitCode.RETRYABLE
