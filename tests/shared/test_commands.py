"""The stage command table and its one entry (dflash_shared.commands): every reference of the three tables
resolves, and the entry parses once, resolves the shard once, checks before any work, skips a committed output,
and runs with the shard it resolved."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from dflash_shared.commands import StageCommand, StageProgram, execute, stage_main
from dflash_shared.errors import BadInputError
from dflash_shared.exit_codes import ExitCode
from dflash_shared.preflight import CheckError, Preflight
from dflash_shared.settings import StageSettings
from dflash_shared.storage import ObjectStore

TABLES = ("dflash_tokenize.commands", "dflash_generate.commands", "dflash_train.commands")


def _defines(reference: str) -> bool:
    """Whether the module a "module:name" reference names defines `name`, read from its source (a run function's
    module may need torch or vLLM, which this environment does not have)."""
    module, _, name = reference.partition(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    tree = ast.parse(Path(spec.origin).read_text())
    return any(getattr(node, "name", None) == name for node in tree.body)


@pytest.mark.parametrize("table", TABLES)
def test_every_reference_of_a_table_resolves(table: str) -> None:
    from dflash_shared.commands import load

    program = importlib.import_module(table).PROGRAM
    assert program.usage().startswith(f"usage: {program.prog} {{")
    for command in program.commands:
        assert issubclass(load(command.config), StageSettings), command.name
        for reference in (command.run, command.start_checks, command.wrapper, command.run_kwargs.get("build"),
                          command.shard if command.sharding == "workers" else None):
            if reference is not None:
                assert _defines(reference), f"{program.prog} {command.name}: {reference}"
        # Every command that does work checks first; preflight is the check.
        assert command.start_checks or command.name == "preflight", command.name


class Settings(StageSettings):
    model_config = SettingsConfigDict(env_prefix="DFLASH_FAKE_")

    output: str
    shard_index: int | None = None
    num_shards: int | None = None
    fail_check: bool = Field(default=False)


CALLS: list[tuple[str, Any]] = []


def fake_shard(config: Settings) -> tuple[int, int]:
    CALLS.append(("shard", None))
    return (config.shard_index or 0, config.num_shards or 1)


def fake_checks(config: Settings, store: ObjectStore) -> Preflight:
    CALLS.append(("checks", None))

    def check() -> str:
        if config.fail_check:
            raise CheckError("the input is bad", ExitCode.BAD_INPUT)
        return "fine"

    return Preflight("fake", store).add("input", check)


def fake_run(config: Settings, store: ObjectStore, shard: tuple[int, int], extra: str) -> str:
    CALLS.append(("run", (shard, extra)))
    return "done"


HERE = __name__
COMMAND = StageCommand(name="run", about="a fake stage", config=f"{HERE}:Settings", run=f"{HERE}:fake_run",
                       log_as="fake", sharding="workers", shard=f"{HERE}:fake_shard",
                       start_checks=f"{HERE}:fake_checks", run_kwargs={"extra": "x"})
PROGRAM = StageProgram(prog="dflash-fake", stage="fake", commands=(COMMAND,))


@pytest.fixture(autouse=True)
def _calls() -> None:
    CALLS.clear()


def test_the_entry_resolves_the_shard_once_checks_then_runs_with_it(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    out = str(tmp_path / "out")
    assert execute(PROGRAM, COMMAND, ["--output", out, "--shard-index", "2", "--num-shards", "4"]) is None
    assert CALLS == [("shard", None), ("checks", None), ("run", ((2, 4), "x"))]


def test_a_failing_start_check_stops_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="input: the input is bad"):
        execute(PROGRAM, COMMAND, ["--output", str(tmp_path / "out"), "--fail-check"])
    assert ("run", ((0, 1), "x")) not in CALLS and ("checks", None) in CALLS


def test_a_committed_output_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    caplog.set_level(logging.INFO)
    assert execute(PROGRAM, COMMAND, ["--output", str(out)]) is None
    assert [name for name, _ in CALLS] == ["shard", "checks"]
    assert "is committed, nothing to do" in caplog.text


def test_a_committed_output_made_with_other_settings_is_skipped_naming_them(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A Job started with other settings than its committed output was made with changes nothing, and says so:
    each setting the manifest records otherwise, and how to redo the stage. Where the process is (output, shard)
    is no setting of the output and is not named; nor is a setting the manifest does not record."""
    out = tmp_path / "out"
    out.mkdir()
    recorded = {"output": "elsewhere", "shard_index": 7, "fail_check": True}
    (out / "manifest.json").write_text(json.dumps({"producer": {"config": recorded}}))
    caplog.set_level(logging.INFO)
    assert execute(PROGRAM, COMMAND, ["--output", str(out), "--shard-index", "1"]) is None
    assert [name for name, _ in CALLS] == ["shard", "checks"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("fake: its committed output was made with other settings than this run's "
                                  "(fail_check true there, false now), and stays as it was")
    assert f"delete {out} and the later stages' outputs" in warnings[0]
    # The same settings: skipped without a word about them.
    (out / "manifest.json").write_text(json.dumps({"producer": {"config": {**recorded, "fail_check": False}}}))
    caplog.clear()
    assert execute(PROGRAM, COMMAND, ["--output", str(out)]) is None
    assert "nothing to do" in caplog.text and "other settings" not in caplog.text


def test_stage_main_exits_with_the_failures_code_and_one_error_line(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        stage_main(PROGRAM, ["run", "--output", str(tmp_path / "out"), "--fail-check"])
    assert done.value.code == 65
    assert "fake run failed, exit 65 (BAD_INPUT)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        stage_main(PROGRAM, ["run", "--no-such-flag"])
    assert done.value.code == 64


# Each stage command that reads a manifest, with its settings pointing at an input that does not exist: the start
# checks must refuse it (exit 65, naming the manifest) before the run function is even imported, and write nothing.
MISSING_INPUT = [
    ("dflash_generate.commands", "run", ["--input", "{missing}", "--output", "{out}", "--model", "m"]),
    ("dflash_generate.commands", "serve-check", ["--evaluation", "{missing}", "--target", "t", "--output", "{out}"]),
    ("dflash_train.commands", "run", ["--input", "{missing}", "--output", "{out}", "--target", "t"]),
    ("dflash_train.commands", "export", ["--drafter", "{missing}", "--output", "{out}", "--target", "t"]),
    ("dflash_train.commands", "evaluate", ["--drafter", "{missing}", "--prompts", "p", "--target", "t",
                                           "--output", "{out}"]),
]


@pytest.mark.parametrize(("table", "name", "args"), MISSING_INPUT, ids=[f"{t.split('.')[0]}-{n}"
                                                                       for t, n, _ in MISSING_INPUT])
def test_each_stage_command_refuses_a_missing_input_before_any_work(
        table: str, name: str, args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    program = importlib.import_module(table).PROGRAM
    command = program.commands[[c.name for c in program.commands].index(name)]
    loaded: list[str] = []
    import dflash_shared.commands as commands

    real_load = commands.load
    monkeypatch.setattr(commands, "load", lambda ref: loaded.append(ref) or real_load(ref))
    missing, out = tmp_path / "missing", tmp_path / "out"
    argv = [a.format(missing=missing, out=out) for a in args]
    with pytest.raises(BadInputError, match=rf"manifest {missing}/manifest\.json: cannot be read"):
        execute(program, command, argv)
    assert command.run not in loaded  # the run (and torch or vLLM with it) was never reached
    assert not any(p.is_file() for p in tmp_path.rglob("*"))  # the probe write was removed; nothing else written
