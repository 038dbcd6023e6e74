"""`python -m dflash_shared.pod_log`: a command's output passed through and kept in the store, while it runs and
after, with its exit status and termination message; signals passed on; the image entrypoints run under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_shared.pod_log import log_bytes
from dflash_shared.storage import ObjectStore, join

REPO_ROOT = Path(__file__).resolve().parents[2]


def wrapped(command: list[str]) -> list[str]:
    return [sys.executable, "-m", "dflash_shared.pod_log", "--", *command]


def pod_env(prefix: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "DFLASH_LOG_PREFIX": prefix, "POD_NAME": "dflash-r-train-0-x7k2p",
           "DFLASH_TERMINATION_LOG": str(tmp_path / "termination-log"), "TMPDIR": str(tmp_path), **extra}
    env.pop("DFLASH_POD_LOG", None)
    return env


def test_a_failed_command_keeps_its_output_exit_status_and_termination_message(s3_bucket: str, store: ObjectStore,
                                                                             tmp_path: Path) -> None:
    (tmp_path / "termination-log").write_text("")  # the kubelet creates the file; the stage fills it
    script = ('echo "to stdout"; echo "to stderr" >&2; '
              'echo "exit 65 (BAD_INPUT): quality gate: 812 of 1,000 records" > "$DFLASH_TERMINATION_LOG"; exit 65')
    prefix = join(s3_bucket, "runs", "r", "logs", "train")
    proc = subprocess.run(wrapped(["sh", "-c", script]), env=pod_env(prefix, tmp_path),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 65
    assert proc.stdout == "to stdout\n"  # passed through as it was: what `kubectl logs` shows
    last = "pod-log: sh exited 65 (BAD_INPUT): exit 65 (BAD_INPUT): quality gate: 812 of 1,000 records"
    assert proc.stderr.splitlines() == ["to stderr", last]
    kept = store.read_bytes(join(prefix, "dflash-r-train-0-x7k2p.log")).decode()
    assert sorted(kept.splitlines()[:2]) == ["to stderr", "to stdout"] and kept.splitlines()[-1] == last
    assert not list(tmp_path.glob("pod-log-*"))  # the local copy is gone with the process


def test_the_log_is_kept_while_the_command_runs_and_a_signal_is_passed_on(tmp_path: Path) -> None:
    prefix = str(tmp_path / "logs" / "generate")
    script = 'trap "echo stopping; exit 75" TERM; echo started; while :; do sleep 0.05; done'
    proc = subprocess.Popen(wrapped(["sh", "-c", script]),
                            env=pod_env(prefix, tmp_path, DFLASH_LOG_UPLOAD_S="0.2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kept = Path(prefix) / "dflash-r-train-0-x7k2p.log"
    deadline = time.monotonic() + 30
    while not (kept.exists() and "started" in kept.read_text()):
        assert time.monotonic() < deadline, "the log was not copied while the command ran"
        assert proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 75  # the command's own code, as podFailurePolicy expects it
    assert out == "started\nstopping\n"
    assert kept.read_text().splitlines()[-1] == "pod-log: sh exited 75 (PREEMPTED)"


def test_a_store_that_refuses_the_copy_never_fails_the_pod(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the log folder would be")
    prefix = str(blocked / "train")
    proc = subprocess.run(wrapped(["sh", "-c", "echo done"]), env=pod_env(prefix, tmp_path),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout == "done\n"
    assert f"pod-log: cannot copy the log to {prefix}/dflash-r-train-0-x7k2p.log" in proc.stderr


def test_a_long_log_is_kept_as_its_head_and_tail(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    path.write_bytes(b"a" * 100 + b"b" * 100 + b"c" * 100)
    kept = log_bytes(str(path), max_bytes=120, head=50)
    assert kept.startswith(b"a" * 50 + b"\n[... 180 bytes left out") and kept.endswith(b"c" * 70)
    assert log_bytes(str(path), max_bytes=300) == path.read_bytes()


@pytest.mark.parametrize("image", ["tokenizer", "generator", "trainer"])
def test_each_entrypoint_runs_itself_under_the_log_keeper_once(image: str, tmp_path: Path) -> None:
    # The image's PATH: its virtualenv, where python has dflash_shared; the stage command is a stand-in here.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("dflash-tokenize", "dflash-generate", "dflash-train"):
        (bin_dir / name).write_text('#!/bin/sh\necho "$0 $* (DFLASH_POD_LOG=$DFLASH_POD_LOG)"\n')
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    prefix = str(tmp_path / "logs" / image)
    env = pod_env(prefix, tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}")
    command = {"tokenizer": "import", "generator": "import", "trainer": "export"}[image]
    proc = subprocess.run(["sh", str(REPO_ROOT / "docker" / image / "entrypoint.sh"), command, "--x", "1"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    stage = {"tokenizer": "dflash-tokenize", "generator": "dflash-generate", "trainer": "dflash-train"}[image]
    assert proc.stdout == f"{bin_dir}/{stage} {command} --x 1 (DFLASH_POD_LOG=1)\n"
    kept = (Path(prefix) / "dflash-r-train-0-x7k2p.log").read_text()
    assert kept.startswith(proc.stdout) and kept.rstrip().endswith("exited 0 (OK)")
