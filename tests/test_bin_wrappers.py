"""bin/ wrappers: each runs its entry point in its own environment, and says which make target builds a missing one.

The --help checks use the real environments (a wrapper whose environment is not built here is skipped); the
others run a wrapper copied into a temporary checkout layout, with a stand-in python that echoes its arguments.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENVIRONMENT_EXIT = 69  # dflash_shared.exit_codes.ExitCode.ENVIRONMENT

# wrapper -> (environment, the stamp its build writes last, make target, module)
WRAPPERS = {
    "dflash-pipeline": (".venv", ".stamp", "venv", "dflash_pipeline"),
    "dflash-tokenize": (".venv", ".stamp", "venv", "dflash_tokenize"),
    "dflash-generate": (".venv-generate", ".dflash-inputs.sha256", "venv-generate", "dflash_generate"),
    "dflash-train": (".venv-train", ".dflash-inputs.sha256", "venv-train", "dflash_train"),
}
ECHO_PYTHON = '#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n'


def run(argv: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def fake_checkout(tmp_path: Path, name: str, *, python: bool, stamp: bool) -> Path:
    """A checkout holding only bin/NAME and, as asked, its environment's python (an echo script) and stamp."""
    venv, stamp_name, _, _ = WRAPPERS[name]
    (tmp_path / "bin").mkdir(parents=True)
    shutil.copy2(REPO / "bin" / name, tmp_path / "bin" / name)
    if python:
        exe = tmp_path / venv / "bin" / "python"
        exe.parent.mkdir(parents=True)
        exe.write_text(ECHO_PYTHON)
        exe.chmod(0o755)
    if stamp:
        (tmp_path / venv).mkdir(exist_ok=True)
        (tmp_path / venv / stamp_name).touch()
    return tmp_path / "bin" / name


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_help_runs_in_the_real_environment(name: str, tmp_path: Path) -> None:
    venv, stamp, target, _ = WRAPPERS[name]
    if not (REPO / venv / stamp).is_file():
        pytest.skip(f"{venv} is not built here (make {target})")
    proc = run([REPO / "bin" / name, "--help"], cwd=tmp_path)  # from another directory
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower()


@pytest.mark.parametrize("name", sorted(WRAPPERS))
@pytest.mark.parametrize("python", [False, True], ids=["no-environment", "unfinished"])
def test_a_missing_environment_names_its_make_target(name: str, python: bool, tmp_path: Path) -> None:
    venv, _, target, _ = WRAPPERS[name]
    wrapper = fake_checkout(tmp_path, name, python=python, stamp=False)
    proc = run([wrapper, "run", "--input", "x"], cwd=tmp_path)
    assert proc.returncode == ENVIRONMENT_EXIT
    assert proc.stdout == ""
    assert f"run `make {target}` first" in proc.stderr
    assert str(tmp_path / venv) in proc.stderr


def commands_of(help_text: str) -> list[str]:
    """The command names a --help lists: under 'commands:' (indented 2) or argparse's subcommands (indented 4)."""
    names, inside = [], False
    for line in help_text.splitlines():
        if line.strip() in ("commands:", "positional arguments:"):
            inside = True
        elif inside and not line.strip() and names:
            break
        elif inside and len(line) - len(line.lstrip()) in (2, 4) and not line.lstrip().startswith("{"):
            names.append(line.split()[0])  # continuation lines of a description are indented further
    return names


@pytest.mark.parametrize("name", sorted(WRAPPERS))
@pytest.mark.parametrize("word", ["--help", "-h", "help"])
def test_help_lists_the_commands_without_the_environment(name: str, word: str, tmp_path: Path) -> None:
    venv, _, target, _ = WRAPPERS[name]
    wrapper = fake_checkout(tmp_path, name, python=False, stamp=False)
    proc = run([wrapper, word], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {name} ")
    assert len(commands_of(proc.stdout)) >= 3 and "examples:" in proc.stdout
    assert f"run `make {target}` (in {tmp_path}) before running a command" in proc.stderr


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_the_help_without_the_environment_lists_what_the_command_has(name: str, tmp_path: Path) -> None:
    venv, stamp, target, _ = WRAPPERS[name]
    if not (REPO / venv / stamp).is_file():
        pytest.skip(f"{venv} is not built here (make {target})")
    offline = run([fake_checkout(tmp_path, name, python=False, stamp=False), "--help"], cwd=tmp_path).stdout
    real = run([REPO / "bin" / name, "--help"], cwd=tmp_path).stdout
    assert sorted(commands_of(offline)) == sorted(commands_of(real)), (offline, real)


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_arguments_pass_through_unchanged(name: str, tmp_path: Path) -> None:
    module = WRAPPERS[name][3]
    wrapper = fake_checkout(tmp_path, name, python=True, stamp=True)
    args = ["run", "--config", "a b.toml", "", "--flag=$HOME", "*"]
    proc = run([wrapper, *args], cwd=tmp_path / "bin")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == ["-m", module, *args]


def test_a_symlink_finds_the_checkout(tmp_path: Path) -> None:
    wrapper = fake_checkout(tmp_path / "checkout", "dflash-train", python=True, stamp=True)
    link_dir = tmp_path / "local" / "bin"
    link_dir.mkdir(parents=True)
    # A relative link to a relative link, as `ln -s ../x` makes.
    (tmp_path / "local" / "dflash-train").symlink_to(os.path.relpath(wrapper, tmp_path / "local"))
    (link_dir / "dflash-train").symlink_to("../dflash-train")
    proc = run([link_dir / "dflash-train", "status"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:-1] == ["-m", "dflash_train", "status"]
