"""Scratch directories: a killed run's is removed by the next run of the same stage, a live one's never."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflash_shared.scratch import OWNER_FILE, clean_stale, make_scratch


def test_a_dead_owners_scratch_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    # A process that makes its scratch and dies without cleaning up, as kill -9 leaves it.
    code = f"from dflash_shared.scratch import make_scratch; print(make_scratch('dflash-demo-', {str(tmp_path)!r}))"
    dead = Path(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout.strip())
    (dead / "part.arrow").write_bytes(b"x" * 1000)
    mine = make_scratch("dflash-demo-", str(tmp_path))  # cleans first, then makes its own
    assert not dead.exists() and Path(mine).is_dir()
    assert json.loads((Path(mine) / OWNER_FILE).read_text())["pid"] == os.getpid()
    # Another stage's directory, and one without an owner record, are left alone.
    other = Path(make_scratch("dflash-other-", str(tmp_path)))
    unowned = tmp_path / "dflash-demo-unowned"
    unowned.mkdir()
    assert clean_stale("dflash-demo-", str(tmp_path)) == 0
    assert Path(mine).is_dir() and other.is_dir() and unowned.is_dir()
