"""A stage pod's log, kept in the store while the pod runs and after its Job (and so the pod) is deleted.

    python -m dflash_shared.pod_log -- COMMAND [ARGS...]

runs COMMAND with its stdout and stderr passed through unchanged (what `kubectl logs` shows) and copied to a
local file, which is uploaded to `$DFLASH_LOG_PREFIX/$POD_NAME.log` every `$DFLASH_LOG_UPLOAD_S` seconds
(default 300) and once more when COMMAND exits, ending with a line that gives its exit status and the
termination message the stage left (`dflash_shared.cli`). Each image entrypoint runs itself under this when
the stage Job sets DFLASH_LOG_PREFIX (docker/*/entrypoint.sh), so every stage image is covered, and every
torchrun rank of a pod too (their output is torchrun's, which is the entrypoint's).

SIGTERM, SIGINT and SIGHUP are passed to COMMAND, which decides how to stop; the exit status is COMMAND's own
(128 + N when signal N ended it), so a Job's podFailurePolicy sees the codes it always did. A failed upload
is a warning on stderr: the copy in the store is for people, never a reason for the pod to fail. A log over
`MAX_LOG_BYTES` is uploaded as its head and its tail, the middle left out and said so.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import IO, NoReturn

from dflash_shared.exit_codes import ExitCode, describe
from dflash_shared.storage import ObjectStore, join

PREFIX_ENV = "DFLASH_LOG_PREFIX"
INTERVAL_ENV = "DFLASH_LOG_UPLOAD_S"
POD_NAME_ENV = "POD_NAME"
# Set for COMMAND, so an entrypoint that runs itself under this does so once.
ACTIVE_ENV = "DFLASH_POD_LOG"
DEFAULT_INTERVAL_S = 300.0
MAX_LOG_BYTES = 64 * 2**20
HEAD_BYTES = 4 * 2**20
_READ = 64 * 1024
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def log_bytes(path: str, max_bytes: int = MAX_LOG_BYTES, head: int = HEAD_BYTES) -> bytes:
    """The file, or its first `head` and last bytes with a line saying how much is left out between them."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if size <= max_bytes:
            return fh.read()
        first = fh.read(head)
        tail = max_bytes - head
        fh.seek(size - tail)
        last = fh.read()
    note = f"\n[... {size - head - tail:,} bytes left out: the store keeps the first and last part of a long log ...]\n"
    return first + note.encode() + last


class LogShipper:
    """Uploads a growing local file to `uri` every `interval_s` on a daemon thread, and once more at `close`."""

    def __init__(self, store: ObjectStore, path: str, uri: str, interval_s: float = DEFAULT_INTERVAL_S,
                 warn: Callable[[str], None] | None = None) -> None:
        self.store, self.path, self.uri, self.interval_s = store, path, uri, interval_s
        self._warn = warn or (lambda text: print(f"pod-log: {text}", file=sys.stderr, flush=True))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._warned = False

    def start(self) -> LogShipper:
        self._thread = threading.Thread(target=self._loop, name="log upload", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.upload()

    def upload(self) -> bool:
        """One upload of the file as it is now; False (and a warning, the first time) when it failed."""
        with self._lock:
            try:
                if os.path.isfile(self.path):
                    self.store.write_bytes(self.uri, log_bytes(self.path))
                return True
            except Exception as err:  # noqa: BLE001 - the log copy never fails the pod
                if not self._warned:
                    self._warn(f"cannot copy the log to {self.uri} ({err}); trying again later")
                    self._warned = True
                return False

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stop the periodic uploads and upload once more; True when the last upload succeeded."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.upload()


def exit_line(command: list[str], code: int, message: str) -> str:
    """The last line of a kept log: how the command ended, and why, in the stage's words."""
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name} (exit {128 - code})"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited {describe(code)}"
    text = f"pod-log: {os.path.basename(command[0])} {how}"
    return text + (f": {message}" if message else "")


def termination_message() -> str:
    """What the stage wrote to the termination log (the reason Kubernetes shows), on one line."""
    from dflash_shared.cli import TERMINATION_LOG

    try:
        with open(TERMINATION_LOG, encoding="utf-8", errors="replace") as fh:
            return " | ".join(line.strip() for line in fh.read().splitlines() if line.strip())
    except OSError:
        return ""


def _tee(source: IO[bytes], sink: IO[bytes], log: IO[bytes], lock: threading.Lock) -> None:
    """Copy `source` to `sink` (this process's own stream) and to the log file, chunk by chunk."""
    fd = source.fileno()
    while True:
        try:
            chunk = os.read(fd, _READ)
        except OSError:
            return
        if not chunk:
            return
        try:
            sink.write(chunk)
            sink.flush()
        except OSError:
            pass  # nobody reads this process's stream any more; the file still gets the output
        with lock:
            log.write(chunk)
            log.flush()


def _interval() -> float:
    try:
        value = float(os.environ.get(INTERVAL_ENV) or DEFAULT_INTERVAL_S)
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


def run(command: list[str], uri: str) -> int:
    """Run `command` with its output kept at `uri` (see the module docstring); returns its exit status."""
    env = {**os.environ, ACTIVE_ENV: "1"}
    fd, path = tempfile.mkstemp(prefix="pod-log-", suffix=".log")
    log = os.fdopen(fd, "wb")
    lock = threading.Lock()
    try:
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as err:
        print(f"pod-log: cannot run {command[0]}: {err}", file=sys.stderr)
        return 127
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    assert child.stdout is not None and child.stderr is not None
    tees = [threading.Thread(target=_tee, args=(stream, out, log, lock), daemon=True)
            for stream, out in ((child.stdout, sys.stdout.buffer), (child.stderr, sys.stderr.buffer))]
    for tee in tees:
        tee.start()
    shipper = LogShipper(ObjectStore(), path, uri, _interval()).start()
    code = child.wait()
    # A process COMMAND left behind may hold the pipes open: the log is complete enough after a few seconds.
    for tee in tees:
        tee.join(5.0)
    line = exit_line(command, code, termination_message() if code != 0 else "")
    with lock:
        log.write(line.encode() + b"\n")
        log.flush()
    print(line, file=sys.stderr, flush=True)
    shipper.close()
    log.close()
    os.unlink(path)
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> NoReturn:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m dflash_shared.pod_log -- COMMAND [ARGS...]", file=sys.stderr)
        sys.exit(int(ExitCode.USAGE))
    prefix = os.environ.get(PREFIX_ENV)
    if not prefix:
        # Nowhere to keep the log: run the command as it is.
        os.execvpe(args[0], args, {**os.environ, ACTIVE_ENV: "1"})
    pod = os.environ.get(POD_NAME_ENV) or socket.gethostname()
    sys.exit(run(args, join(prefix, f"{pod}.log")))


if __name__ == "__main__":
    main()
