"""The pod's data-parallel launcher with real child processes (no engine: the children fail or sleep)."""

from __future__ import annotations

import os
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
    """Two engine processes of pod 1 of 2 are workers 2 and 3 of 4; a missing input fails both with 65."""
    for key in list(os.environ):
        if key.startswith("DFLASH_GENERATE_"):
            monkeypatch.delenv(key)
    config = GenerateConfig(input=str(tmp_path / "no-prompts"), output=str(tmp_path / "out"), model="org/model",
                            data_parallel_size=2, shard_index=1, num_shards=2, min_shm_gib=0)
    with pytest.raises(BadInputError, match="engine process 0 exited 65.*engine process 1 exited 65"):
        run(config, ObjectStore())
    err = capfd.readouterr().err
    assert "[generate shard=2]" in err and "[generate shard=3]" in err
    assert err.count("cannot be read") >= 2  # each child names the missing manifest
