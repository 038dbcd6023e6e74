"""Regenerate the documentation's generated parts (`make docs`): the configuration reference from the stages'
pydantic models, the run file reference from `RunConfig` and its models, and the demo figures from the last
`make demo` runs.

Each part lives between its markers in whichever page holds it (README.md, docs/*.md, jobs/*/README.md): the
configuration reference in docs/configuration.md, the run file reference in docs/run-file.md, the speaking
target's demo figures in the README, the other targets' in docs/demo.md. A page is rewritten only where its
markers are, so moving a block to another page needs no change here.

Run in .venv; a stage whose config module cannot be imported there (it needs torch or vLLM) is documented
from the environment that has it by passing its module on the command line. The demo figures come from
`demo-output/last-run-<target>.json`, which `demo/run_demo.py` writes after each successful run (wall time, peak
memory, console and log line counts, the summary read from the manifests), so they are what the code produced,
never typed in. `--check` exits 1 when a page's configuration or run file reference is out of date or a generated
part is missing or doubled (the test suite runs it; the demo figures themselves depend on a run that CI does not
keep).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import types
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
DEMO_TARGETS = ("speaking", "qwen3", "qwen3_6")

# (heading, module, class): the order is the pipeline's.
CONFIGS = [
    ("import (`dflash-tokenize import`, `dflash-generate import`)", "dflash_shared.importing", "ImportConfig"),
    ("generate (`dflash-generate run`)", "dflash_generate.config", "GenerateConfig"),
    ("tokenize (`dflash-tokenize run`)", "dflash_tokenize.config", "TokenizeConfig"),
    ("train (`dflash-train run`)", "dflash_train.config", "TrainConfig"),
    ("export (`dflash-train export`)", "dflash_train.export.config", "ExportConfig"),
    ("evaluate (`dflash-train evaluate`)", "dflash_train.evaluate.config", "EvaluateConfig"),
    ("serve check (`dflash-generate serve-check`)", "dflash_generate.serve_check.config", "ServeCheckConfig"),
]


def reference() -> str:
    from dflash_shared.settings import settings_reference_markdown

    parts = [START, "", "Generated from the config models by `make docs`; do not edit by hand.", ""]
    for heading, module_name, class_name in CONFIGS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        config = getattr(module, class_name, None)
        if config is None:
            continue
        table = settings_reference_markdown(config)
        parts += [f"<details><summary>{heading}</summary>", "", table, "", "</details>", ""]
    parts.append(END)
    return "\n".join(parts)


RUN_START, RUN_END = "<!-- run-file-reference:start -->", "<!-- run-file-reference:end -->"
COMMANDS_START, COMMANDS_END = "<!-- stage-commands:start -->", "<!-- stage-commands:end -->"
# The stage CLIs' command tables (dflash_shared.commands), in the pipeline's order: the reference in
# docs/commands.md and the help each bin/ wrapper prints before its environment exists are written from them.
PROGRAMS = [("dflash_tokenize.commands", "bin/dflash-tokenize"), ("dflash_generate.commands", "bin/dflash-generate"),
            ("dflash_train.commands", "bin/dflash-train")]
_BIN_HELP = re.compile(r"(cat <<'EOF'\n)(.*?)(\nEOF\n)", re.S)


def _programs() -> list[tuple[Any, Path]]:
    return [(importlib.import_module(module).PROGRAM, REPO / wrapper) for module, wrapper in PROGRAMS]


def commands_reference() -> str:
    """Every stage command from its table: what it is for, its settings, how it shards, what it checks first."""
    from dflash_shared.commands import SHARDING

    rows = ["| command | what it is for | settings | shards | checks it starts with |", "|---|---|---|---|---|"]
    for program, _ in _programs():
        for c in program.commands:
            checks = "every check (it is the check)" if c.name == "preflight" else (
                f"`{c.start_checks.partition(':')[2]}` in `{c.start_checks.partition(':')[0]}`"
                if c.start_checks else "none")
            rows.append(f"| `{program.prog} {c.name}` | {c.about} | `{c.config.partition(':')[2]}` | "
                        f"{SHARDING[c.sharding]} | {checks} |")
    return "\n".join([COMMANDS_START, "", "Generated from the command tables (`dflash_<stage>/commands.py`) by "
                      "`make docs`; do not edit by hand.", "", *rows, "", COMMANDS_END])


def bin_help_stale(write: bool) -> list[Path]:
    """The bin/ wrappers whose built-in help differs from their table's usage (rewritten with `write`)."""
    stale = []
    for program, wrapper in _programs():
        text = wrapper.read_text()
        updated = _BIN_HELP.sub(lambda m: m.group(1) + program.usage() + m.group(3), text, count=1)  # noqa: B023
        if updated != text:
            stale.append(wrapper)
            if write:
                wrapper.write_text(updated)
    return stale

# (heading, module, class, note): the run file's tables, top level first, then each nested table in file order.
RUN_FILE_MODELS = [
    ("Top level", "dflash_pipeline.run.config", "RunConfig", ""),
    ("`[images]`", "dflash_pipeline.run.config", "ImageSettings", ""),
    ("`[target]`", "dflash_pipeline.run.config", "TargetModel", ""),
    ("`[source]`", "dflash_pipeline.run.config", "SourceData", ""),
    ("`[storage]`", "dflash_pipeline.run.config", "StorageAccess", ""),
    ("`[scheduling]`", "dflash_pipeline.run.config", "SchedulingSettings", ""),
    ("`[stages]`", "dflash_pipeline.run.config", "StagesSettings",
     "Each stage is a `[stages.<stage>]` table of the settings below; a stage's defaults (next table) are merged "
     "under what the run file sets."),
    ("`[stages.<stage>]`", "dflash_pipeline.run.config", "JobSettings",
     "The defaults here are those of a stage that `STAGE_DEFAULTS` leaves alone; each stage's own are below."),
    ("`tolerations` entries (`[[stages.<stage>.tolerations]]`)", "dflash_pipeline.run.config", "Toleration", ""),
    ("`[plan]`", "dflash_pipeline.run.plan_inputs", "PlanInputs", ""),
    ("`[pilot]`", "dflash_pipeline.run.pilot_settings", "PilotSettings", ""),
]


def _plain(annotation: Any) -> Any:
    """The annotation without its Annotated validators, whose text names functions by address."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _plain(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return Union[tuple(_plain(arg) for arg in get_args(annotation))]  # noqa: UP007 - built from a tuple
    return annotation


def _prose(text: str) -> str:
    """Text on one line, a `<name>` outside code escaped so that Markdown shows it rather than drops it."""
    pieces = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(piece if piece.startswith("`") else piece.replace("<", "&lt;") for piece in pieces)


def _model_table(model: type) -> str:
    from pydantic import BaseModel

    from dflash_shared.settings import _default_text, _type_name

    rows = ["| Field | Type | Default | Description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        annotation = field.annotation
        nested = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        default = "its table's defaults" if nested and not field.is_required() else _default_text(field)
        if model.__name__ == "StagesSettings":
            default = "`STAGE_DEFAULTS`, below"
        cells = [f"`{field.alias or name}`", f"`{_type_name(_plain(annotation))}`", default,
                 _prose(field.description or "")]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def _stage_defaults_table(defaults: dict[str, dict[str, object]]) -> str:
    rows = ["| Stage | Defaults |", "|---|---|"]
    for stage, values in defaults.items():
        cells = [f"`{stage}`", ", ".join(f"`{key} = {json.dumps(value)}`" for key, value in values.items())]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def run_file_reference() -> str:
    parts = [RUN_START, "", "Generated from `RunConfig` and its models by `make docs`; do not edit by hand.", ""]
    for heading, module_name, class_name, note in RUN_FILE_MODELS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        model = getattr(module, class_name)
        parts += [f"### {heading}", ""]
        if model.__doc__:
            parts += [_prose(model.__doc__.split("\n\n")[0]), ""]
        if note:
            parts += [note, ""]
        parts.append(_model_table(model))
        if class_name == "StagesSettings":
            parts += ["Per-stage defaults (`STAGE_DEFAULTS` in config.py):", "",
                      _stage_defaults_table(module.STAGE_DEFAULTS)]
    parts.append(RUN_END)
    return "\n".join(parts)


def demo_block(target: str, run: dict[str, object]) -> str:
    minutes, seconds = divmod(round(float(run["wall_s"])), 60)  # type: ignore[arg-type]
    lines = [
        f"<!-- demo-figures:{target}:start -->",
        f"Last run here (`{run['command']}`, written by `make docs` from `demo-output/last-run-{target}.json`): "
        f"{minutes} min {seconds:02d} s on {run['cpus']} CPU cores{_build_note(run)}, peak memory "
        f"{run['peak_rss_gib']:.1f} GiB "
        f"(all processes of the run), {run['console_lines']} console lines (the stages' full output, "
        f"{run['log_lines']:,} lines, is in `demo-output/logs/`):",
        "",
        "```",
        str(run["summary"]).rstrip(),
        "```",
        f"<!-- demo-figures:{target}:end -->",
    ]
    return "\n".join(lines)


def _build_note(run: dict[str, object]) -> str:
    """The target's one-time build, which the pipeline's wall time leaves out (the speaking target trains)."""
    build = run.get("target_build_s")
    return f" (plus {round(float(build))} s building the target the first time; cached after)" if build else ""  # type: ignore[arg-type]


def pages() -> list[Path]:
    """Every page that may hold a generated part, in a stable order."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("jobs/*/README.md"))]


def markers() -> list[tuple[str, str]]:
    """Each generated part's start and end marker; every part is in exactly one page."""
    demo = [(f"<!-- demo-figures:{t}:start -->", f"<!-- demo-figures:{t}:end -->") for t in DEMO_TARGETS]
    return [(START, END), (RUN_START, RUN_END), (COMMANDS_START, COMMANDS_END), *demo]


def misplaced(texts: dict[Path, str]) -> list[str]:
    """Generated parts that no page, or more than one, holds (with both markers, in order)."""
    problems = []
    for start, end in markers():
        holders = [path.relative_to(REPO).as_posix() for path, text in texts.items()
                   if re.search(re.escape(start) + ".*?" + re.escape(end), text, re.S)]
        if len(holders) != 1:
            problems.append(f"{start} is in {len(holders)} pages ({', '.join(holders) or 'none'}), not one")
    return problems


def fill_reference(text: str, table: str, start: str = START, end: str = END) -> str:
    return re.compile(re.escape(start) + ".*?" + re.escape(end), re.S).sub(lambda _: table, text)


def fill_references(text: str, table: str, run_table: str, commands_table: str) -> str:
    """The page with its stage configuration reference, run file reference and command reference current."""
    text = fill_reference(fill_reference(text, table), run_table, RUN_START, RUN_END)
    return fill_reference(text, commands_table, COMMANDS_START, COMMANDS_END)


def fill_demo_figures(text: str, out: Path) -> str:
    for target in DEMO_TARGETS:
        path = out / f"last-run-{target}.json"
        if not path.exists():
            continue
        run = json.loads(path.read_text())
        pattern = re.compile(re.escape(f"<!-- demo-figures:{target}:start -->") + ".*?"
                             + re.escape(f"<!-- demo-figures:{target}:end -->"), re.S)
        text = pattern.sub(lambda _: demo_block(target, run), text)  # noqa: B023 - used at once
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 if a generated part is out of date.")
    args = parser.parse_args()
    texts = {path: path.read_text() for path in pages()}
    problems = misplaced(texts)
    table, run_table, commands_table = reference(), run_file_reference(), commands_reference()
    stale = [path for path, text in texts.items() if fill_references(text, table, run_table, commands_table) != text]
    if args.check:
        problems += [f"{path.relative_to(REPO).as_posix()}: a configuration reference is out of date: run "
                     "`make docs`" for path in stale]
        problems += [f"{path.relative_to(REPO).as_posix()}: its help differs from its command table: run `make docs`"
                     for path in bin_help_stale(write=False)]
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    bin_help_stale(write=True)
    for path, text in texts.items():
        updated = fill_demo_figures(fill_references(text, table, run_table, commands_table), REPO / "demo-output")
        if updated != text:
            path.write_text(updated)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
