"""The README's generated parts are current, and the commands it tells a newcomer to run exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_config_reference_is_current() -> None:
    proc = subprocess.run([sys.executable, "scripts/update_readme.py", "--check"], cwd=REPO,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_make_target_named_in_the_readme_exists() -> None:
    readme = (REPO / "README.md").read_text()
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-zA-Z0-9_-]+):", makefile, re.M))
    # A command is `make x` in backticks or at the start of a line in a code block; prose may say "make targets".
    named = set(re.findall(r"(?:^|`)make ([a-z][a-z0-9-]*)", readme, re.M))
    assert named, "the README names no make targets"
    assert named <= targets, f"README names make targets that do not exist: {sorted(named - targets)}"
