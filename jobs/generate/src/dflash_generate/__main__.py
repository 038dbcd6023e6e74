"""dflash-generate: `import` conversations as prompts, `preflight` the node, `run` the stage, and
`serve-check` an exported drafter in the engine (dflash_generate.serve_check)."""

from __future__ import annotations

import sys
from typing import NoReturn

from dflash_generate.checks import build_preflight
from dflash_generate.config import GenerateConfig
from dflash_generate.serve_check import serve_check_command
from dflash_generate.stage import STAGE, run, worker_shard
from dflash_shared.cli import run_stage_main, select_command
from dflash_shared.importing import ImportConfig, run_import
from dflash_shared.logs import setup_logging
from dflash_shared.manifests import Kind
from dflash_shared.provenance import producer
from dflash_shared.runner import resolve_shard
from dflash_shared.settings import parse_settings, public_dict
from dflash_shared.storage import ObjectStore


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    command, rest = (args[0], args[1:]) if args else ("", [])

    def import_() -> None:
        config = parse_settings(ImportConfig, rest, prog="dflash-generate import")
        index, count = resolve_shard(config.shard_index, config.num_shards)
        setup_logging("import", shard=index)
        made = producer("import", public_dict(config), ["dflash-generate"])
        run_import(ObjectStore(), config.spec(Kind.prompts), made, index, count)

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
    chosen = select_command("dflash-generate", commands, command)
    run_stage_main(f"{STAGE} {command}", chosen)


if __name__ == "__main__":
    main()
