"""Stage entrypoints: `--help` answers with exit 0, a missing or misspelt command with 64 and the nearest name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash_shared.cli import select_command

COMMANDS = {"import": lambda: None, "preflight": lambda: 0, "run": lambda: None}


@pytest.mark.parametrize("word", ["--help", "-h", "help"])
def test_help_prints_the_usage_and_exits_0(word: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        select_command("dflash-tokenize", COMMANDS, word)
    assert done.value.code == 0
    assert "usage: dflash-tokenize {import|preflight|run}" in capsys.readouterr().out


def test_a_misspelt_command_exits_64_naming_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        select_command("dflash-tokenize", COMMANDS, "rnu")
    assert done.value.code == 64
    assert "unknown command 'rnu' (did you mean run?)" in capsys.readouterr().err


def test_no_command_exits_64_with_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        select_command("dflash-tokenize", COMMANDS, "")
    assert done.value.code == 64 and "usage:" in capsys.readouterr().err
    assert select_command("dflash-tokenize", COMMANDS, "preflight")() == 0


def test_the_installed_entrypoint_answers_help() -> None:
    done = subprocess.run([sys.executable, "-m", "dflash_tokenize", "--help"], capture_output=True, text=True,
                          check=False, timeout=60)
    assert done.returncode == 0 and "{import|import-prompts|preflight|run}" in done.stdout
