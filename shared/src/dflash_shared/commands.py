"""The stage command table, and the one entry every stage CLI goes through.

Each image's CLI (`dflash-generate`, `dflash-tokenize`, `dflash-train`) is a `StageProgram`: its commands, each
with what it is for, its config model, its run function, how it shards and its start checks. The table names
code by "module:attribute" strings, imported only when that command runs: `--help` and a wrong flag answer before
torch or vLLM load, and the table itself can be read by the documentation generator and the bin/ wrappers' help
in an environment that has neither.

`stage_main` is the entry (datatrove's executor does the same in one place):
1. parse the command's config (flags, then DFLASH_* variables) once;
2. resolve its shard once (an Indexed Job's worker, or a torchrun rank) and set up logging once, with it;
3. run the command's checks, the one list its `preflight` runs too (imports, GPUs, credentials, the input
   manifest, a probe write under the output, disk, the model's files), each logged, failing before any work with
   the exit code of its kind (64, 65, 69);
4. skip an output already committed (its manifest exists: a rerun of a finished stage does nothing);
5. run, with the shard it resolved; inside `run_stage_main`, which turns whatever escapes into one error line
   and an exit code (dflash_shared.cli).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

from dflash_shared.cli import run_stage_main, select_command, usage

Sharding = Literal["none", "workers", "ranks"]
SHARDING = {
    "none": "one process",
    "workers": "one shard per pod of an Indexed Job (--shard-index/--num-shards or JOB_COMPLETION_INDEX)",
    "ranks": "torchrun ranks (RANK, WORLD_SIZE), one process group",
}


def load(reference: str) -> Any:
    """The attribute a "module:attribute" reference names, its module imported now."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class StageCommand:
    """One subcommand of a stage CLI."""

    name: str
    about: str  # one line for --help and the command reference
    config: str  # module:Class of its StageSettings model
    # module:function, called as run(config, store, **run_kwargs), plus shard=(index, count) when sharded by workers
    run: str
    log_as: str  # the stage name its log lines carry
    sharding: Sharding = "none"
    shard: str = "dflash_shared.runner:config_shard"  # module:function(config) -> (index, count), for "workers"
    # module:function(config, store) -> Preflight: the command's one list of checks, run before any work (a stage's
    # `preflight` command runs the same list and exits)
    start_checks: str | None = None
    output: str | None = "output"  # config field of the output prefix whose manifest means done (None: no skip)
    # Settings that differ between the processes of one output by design (besides stage_identity.NOT_SETTINGS): not
    # compared with what its committed manifest records
    per_process: tuple[str, ...] = ()
    wrapper: str | None = None  # module:context manager around the whole command
    run_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StageProgram:
    """A stage image's CLI: its program name, its commands in --help order, and example command lines."""

    prog: str
    stage: str  # the image's stage, first word of every error line ("train export failed, exit ...")
    commands: tuple[StageCommand, ...]
    examples: tuple[str, ...] = ()

    @property
    def about(self) -> dict[str, str]:
        return {c.name: c.about for c in self.commands}

    def usage(self) -> str:
        return usage(self.prog, self.about, self.about, self.examples)


def _shard(command: StageCommand, config: Any) -> tuple[tuple[int, int] | None, int | None]:
    """(worker shard, torchrun rank) of this process, each None where the command does not shard so."""
    if command.sharding == "workers":
        index, count = load(command.shard)(config)
        return (index, count), None
    if command.sharding == "ranks":
        return None, int(os.environ.get("RANK", "0"))
    return None, None


def execute(program: StageProgram, command: StageCommand, argv: Sequence[str]) -> int | None:
    """Steps 1-5 of the module docstring for one command; returns the run's exit code (None: done)."""
    # The wrapper (the train ranks' exit classification) sees every failure of the command, a bad flag included.
    with load(command.wrapper)() if command.wrapper else contextlib.nullcontext():
        return _execute(program, command, argv)


def _execute(program: StageProgram, command: StageCommand, argv: Sequence[str]) -> int | None:
    from dflash_shared.logs import setup_logging
    from dflash_shared.manifest_io import committed
    from dflash_shared.settings import parse_settings, public_dict
    from dflash_shared.stage_identity import NOT_SETTINGS
    from dflash_shared.storage import ObjectStore

    config = parse_settings(load(command.config), list(argv), prog=f"{program.prog} {command.name}")
    shard, rank = _shard(command, config)
    setup_logging(command.log_as, shard=None if shard is None else shard[0], rank=rank)
    store = ObjectStore()
    if command.start_checks is not None:
        # Before any work: each passed check logged as `preflight` logs it, the failures in the one error line.
        load(command.start_checks)(config, store).check(fold_failures=True)
    if command.output is not None:
        left_out = NOT_SETTINGS | set(command.per_process)
        given = {k: v for k, v in public_dict(config).items() if k not in left_out}
        if committed(store, getattr(config, command.output), command.log_as, given):
            return None
    kwargs = dict(command.run_kwargs, **({"shard": shard} if shard is not None else {}))
    result = load(command.run)(config, store, **kwargs)
    # A run function returns what it committed (a URI, or None) or an exit code of its own (a preflight's).
    return result if isinstance(result, int) else None


def stage_main(program: StageProgram, argv: Sequence[str] | None = None) -> NoReturn:
    """The entry of a stage CLI: select the command, then `execute` it inside `run_stage_main`."""
    args = list(sys.argv[1:] if argv is None else argv)
    name, rest = (args[0], args[1:]) if args else ("", [])
    commands: dict[str, Callable[[], int | None]] = {
        c.name: functools.partial(execute, program, c, rest) for c in program.commands}
    chosen = select_command(program.prog, commands, name, program.about, program.examples)
    run_stage_main(f"{program.stage} {name}", chosen)


def run_preflight(config: Any, store: Any, build: str) -> int:
    """The `preflight` command of a stage: its checks built by `build` ("module:function(config, store)"), all
    run, one line each; the exit code of the worst failure (0, 64, 65 or 69)."""
    return int(load(build)(config, store).run())


def import_command(kind: Any, package: str, name: str = "import") -> StageCommand:
    """An import command: conversations into a `kind` output (completions for tokenize, prompts for generate),
    recorded as made by the image's `package`. The tokenizer image carries both kinds (`import`, `import-prompts`):
    import needs neither torch nor vLLM, so the pipeline runs it there."""
    return StageCommand(
        name=name, log_as="import", sharding="workers",
        about=f"read conversations (JSONL, Parquet, a saved or Hub dataset) into a {kind.value} manifest",
        config="dflash_shared.importing:ImportConfig", run="dflash_shared.importing:import_share",
        run_kwargs={"kind": kind, "packages": [package]}, start_checks="dflash_shared.importing:start_checks")


def preflight_command(stage: str, config: str, build: str, about: str) -> StageCommand:
    """A stage's `preflight` command: the checks `build` ("module:function(config, store)") assembles, the same
    list its `run` starts with, run alone (there is no output to skip and nothing to check first: it is the
    check)."""
    return StageCommand(name="preflight", log_as=stage, output=None, about=about, config=config,
                        run="dflash_shared.commands:run_preflight", run_kwargs={"build": build})
