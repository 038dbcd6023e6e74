"""The storage failures every stage's `run` must answer with ENVIRONMENT (69), as `preflight` does.

Each case is a change to the environment a stage process gets (or a bucket that does not exist); the
stage suites run their own command under each case and assert the exit code and one error line.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

ENVIRONMENT = 69
CASES = ("no_credentials", "unreachable_endpoint", "missing_bucket")


def _closed_port() -> int:
    # Bound then released: nothing listens there for the few seconds a test needs it.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def case_env(case: str) -> dict[str, str]:
    """The process environment for `case`, derived from the test session's (moto) environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    if case == "no_credentials":
        env.pop("AWS_ACCESS_KEY_ID", None)
        env.pop("AWS_SECRET_ACCESS_KEY", None)
    elif case == "unreachable_endpoint":
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{_closed_port()}"
        env["AWS_MAX_ATTEMPTS"] = "2"  # the verdict is the same after 8 attempts, only later
    return env


def bucket_for(case: str, bucket: str) -> str:
    """The bucket the stage is pointed at: a real one, except in the missing-bucket case."""
    return "s3://no-such-bucket-dflash-exit-policy" if case == "missing_bucket" else bucket


def run_case(argv: list[str], case: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=case_env(case), cwd=cwd,
                          check=False)


def assert_environment_exit(proc: subprocess.CompletedProcess[str], case: str) -> None:
    assert proc.returncode == ENVIRONMENT, f"{case}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "exit 69 (ENVIRONMENT)" in errors[0], proc.stderr[-3000:]
