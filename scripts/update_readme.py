"""Regenerate the README's configuration reference from the stages' pydantic models (`make docs`).

Run in .venv; a stage whose config module cannot be imported there (it needs torch or vLLM) is documented
from the environment that has it by passing its module on the command line. `--check` exits 1 when the
README is out of date (the test suite runs it).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"

# (heading, module, class): the order is the pipeline's.
CONFIGS = [
    ("import (`dflash-tokenize import`, `dflash-generate import`)", "dflash_shared.importing", "ImportConfig"),
    ("generate (`dflash-generate run`)", "dflash_generate.config", "GenerateConfig"),
    ("tokenize (`dflash-tokenize run`)", "dflash_tokenize.config", "TokenizeConfig"),
    ("train (`dflash-train run`)", "dflash_train.config", "TrainConfig"),
    ("export (`dflash-train export`)", "dflash_train.evaluate_config", "ExportConfig"),
    ("evaluate (`dflash-train evaluate`)", "dflash_train.evaluate_config", "EvaluateConfig"),
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 if the README is out of date.")
    args = parser.parse_args()
    text = README.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    updated = pattern.sub(lambda _: reference(), text)
    if args.check:
        if updated != text:
            print("README.md configuration reference is out of date: run `make docs`", file=sys.stderr)
            return 1
        return 0
    README.write_text(updated)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
