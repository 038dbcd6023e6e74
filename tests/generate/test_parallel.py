"""The pod's data-parallel launcher with real child processes (no engine: the children fail or sleep)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_generate.config import GenerateConfig
from dflash_generate.parallel import raise_for_exit_codes, supervise
from dflash_generate.stage import run
from dflash_shared.errors import BadInputError, ConfigError, Preempted, PreflightError
from dflash_shared.storage import ObjectStore

PY = sys.executable


def test_a_fatal_failure_stops_the_other_engines() -> None:
    started = time.monotonic()
    codes = supervise(
        [([PY, "-c", "import sys, time; time.sleep(0.3); sys.exit(65)"], dict(os.environ)),
         ([PY, "-c", "import time; time.sleep(120)"], dict(os.environ))],
        poll_s=0.05,
    )
    assert codes[0] == 65 and codes[1] != 0  # the sleeper was stopped, not waited for
    assert time.monotonic() - started < 30
    with pytest.raises(BadInputError, match=r"engine process 0 exited 65 \(BAD_INPUT\)"):
        raise_for_exit_codes(codes)


def test_exit_codes_map_to_the_pods_exit_code() -> None:
    raise_for_exit_codes([0, 0])
    cases = [([0, 64], ConfigError), ([75, 65], BadInputError), ([75, 75], Preempted), ([69, 75], PreflightError),
             ([1, 75], RuntimeError), ([-9, 0], RuntimeError)]
    for codes, kind in cases:
        with pytest.raises(kind):
            raise_for_exit_codes(codes)


def test_each_engine_process_runs_its_own_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    """Two engine processes of pod 1 of 2 are workers 2 and 3 of 4; a missing input fails the pod with 65."""
    for key in list(os.environ):
        if key.startswith("DFLASH_GENERATE_"):
            monkeypatch.delenv(key)
    config = GenerateConfig(input=str(tmp_path / "no-prompts"), output=str(tmp_path / "out"), model="org/model",
                            data_parallel_size=2, shard_index=1, num_shards=2, min_shm_gib=0)
    with pytest.raises(BadInputError) as failure:
        run(config, ObjectStore())
    # The child that meets the missing manifest first exits 65 and the supervisor stops the other, which
    # exits 75 then, or 65 if it got there too: both are named, at least one with 65.
    message = str(failure.value)
    assert "engine process 0 exited" in message and "engine process 1 exited" in message
    assert "exited 65 (BAD_INPUT)" in message
    err = capfd.readouterr().err
    shards = set(re.findall(r"\[generate shard=(\d+)\]", err))
    assert shards and shards <= {"2", "3"}, err  # workers 2 and 3 of 4, never the pod's own index
    failing = set(re.findall(r"\[generate shard=(\d+)\][^\n]*cannot be read", err))
    assert failing and failing <= {"2", "3"}, err  # a child names the missing manifest


def test_engine_processes_die_with_a_killed_pod_process() -> None:
    psutil = pytest.importorskip("psutil")
    sleeper = "[([sys.executable, '-c', 'import time; time.sleep(120)'], dict(os.environ))]"
    parent = subprocess.Popen([PY, "-c", f"import os, sys; from dflash_generate.parallel import supervise; "
                               f"supervise({sleeper})"])
    pod = psutil.Process(parent.pid)
    deadline = time.monotonic() + 60
    while not pod.children() and time.monotonic() < deadline:
        time.sleep(0.05)
    engines = pod.children()
    assert engines, "the engine process did not start"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    _, alive = psutil.wait_procs(engines, timeout=15)
    assert not alive, f"engine processes outlived the killed pod process: {[p.pid for p in alive]}"
