"""Regenerate the documentation's generated parts (`make docs`): the configuration reference from the stages'
pydantic models, and the demo figures from the last `make demo` runs.

Each part lives between its markers in whichever page holds it (README.md, docs/*.md, jobs/*/README.md): the
configuration reference in docs/configuration.md, the speaking target's demo figures in the README, the other
targets' in docs/demo.md. A page is rewritten only where its markers are, so moving a block to another page
needs no change here.

Run in .venv; a stage whose config module cannot be imported there (it needs torch or vLLM) is documented
from the environment that has it by passing its module on the command line. The demo figures come from
`demo-output/last-run-<target>.json`, which `demo/run_demo.py` writes after each successful run (wall time, peak
memory, console and log line counts, the summary read from the manifests), so they are what the code produced,
never typed in. `--check` exits 1 when a page's configuration reference is out of date or a generated part is
missing or doubled (the test suite runs it; the demo figures themselves depend on a run that CI does not keep).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

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
    ("serve check (`dflash-generate serve-check`)", "dflash_generate.serve_check", "ServeCheckConfig"),
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
    return [(START, END), *demo]


def misplaced(texts: dict[Path, str]) -> list[str]:
    """Generated parts that no page, or more than one, holds (with both markers, in order)."""
    problems = []
    for start, end in markers():
        holders = [path.relative_to(REPO).as_posix() for path, text in texts.items()
                   if re.search(re.escape(start) + ".*?" + re.escape(end), text, re.S)]
        if len(holders) != 1:
            problems.append(f"{start} is in {len(holders)} pages ({', '.join(holders) or 'none'}), not one")
    return problems


def fill_reference(text: str, table: str) -> str:
    return re.compile(re.escape(START) + ".*?" + re.escape(END), re.S).sub(lambda _: table, text)


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
    table = reference()
    stale = [path for path, text in texts.items() if fill_reference(text, table) != text]
    if args.check:
        problems += [f"{path.relative_to(REPO).as_posix()}: the configuration reference is out of date: run "
                     "`make docs`" for path in stale]
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    for path, text in texts.items():
        updated = fill_demo_figures(fill_reference(text, table), REPO / "demo-output")
        if updated != text:
            path.write_text(updated)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
