"""dflash-generate: `import` conversations as prompts, `preflight` the node, `run` the stage, and
`serve-check` an exported drafter in the engine (dflash_generate.serve_check)."""

from __future__ import annotations

import sys
from typing import NoReturn

from dflash_generate.checks import build_preflight
from dflash_generate.config import GenerateConfig
from dflash_generate.serve_check.stage import serve_check_command
from dflash_generate.stage import STAGE, run, worker_shard
from dflash_shared.cli import run_stage_main, select_command
from dflash_shared.importing import import_command
from dflash_shared.logs import setup_logging
from dflash_shared.manifests import Kind
from dflash_shared.settings import parse_settings

ABOUT = {
    "import": "read conversations (JSONL, Parquet, a saved or Hub dataset) into a prompts manifest",
    "preflight": "check the engine stack, GPUs, /dev/shm, storage and the input before a run; exit 0, 64, 65 or 69",
    "run": "generate the target's completions of the prompts with vLLM",
    "serve-check": "load an exported drafter in vLLM beside its target and measure acceptance",
}
EXAMPLES = (
    "dflash-generate import --source prompts/ --output store/prompts",
    "dflash-generate run --input store/prompts --output store/completions --model models/Qwen3-8B",
)


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    command, rest = (args[0], args[1:]) if args else ("", [])

    def import_() -> None:
        import_command(rest, Kind.prompts, "dflash-generate import", ["dflash-generate"])

    def preflight() -> int:
        config = parse_settings(GenerateConfig, rest, prog="dflash-generate preflight")
        return build_preflight(config).run()

    def run_() -> None:
        config = parse_settings(GenerateConfig, rest, prog="dflash-generate run")
        index, _ = worker_shard(config)
        setup_logging(STAGE, shard=index)
        run(config)

    commands = {"import": import_, "preflight": preflight, "run": run_,
                "serve-check": lambda: serve_check_command(rest)}
    chosen = select_command("dflash-generate", commands, command, ABOUT, EXAMPLES)
    run_stage_main(f"{STAGE} {command}", chosen)


if __name__ == "__main__":
    main()
