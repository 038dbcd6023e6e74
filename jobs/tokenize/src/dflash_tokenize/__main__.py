"""dflash-tokenize: `import` external conversations, `preflight` the node, `run` the stage."""

from __future__ import annotations

import sys
from typing import NoReturn

from dflash_shared.cli import run_stage_main, select_command
from dflash_shared.importing import import_command
from dflash_shared.logs import setup_logging
from dflash_shared.manifests import Kind
from dflash_shared.runner import resolve_shard
from dflash_shared.settings import parse_settings
from dflash_shared.storage import ObjectStore
from dflash_tokenize.checks import build_preflight, start_checks
from dflash_tokenize.config import TokenizeConfig
from dflash_tokenize.stage import STAGE, run

ABOUT = {
    "import": "read conversations (JSONL, Parquet, a saved or Hub dataset) into a completions manifest",
    "preflight": "check storage, the tokenizer, the input manifest and disk before a run; exit 0, 64, 65 or 69",
    "run": "tokenize completions into loss-masked Arrow shards and a tokenized manifest",
}
EXAMPLES = (
    "dflash-tokenize import --source chats/ --output store/completions",
    "dflash-tokenize run --input store/completions --output store/tokenized --tokenizer models/Qwen3-8B",
)


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    command, rest = (args[0], args[1:]) if args else ("", [])

    def import_() -> None:
        import_command(rest, Kind.completions, "dflash-tokenize import", ["dflash-tokenize"])

    def preflight() -> int:
        config = parse_settings(TokenizeConfig, rest, prog="dflash-tokenize preflight")
        return build_preflight(config).run()

    def run_() -> None:
        config = parse_settings(TokenizeConfig, rest, prog="dflash-tokenize run")
        index, _ = resolve_shard(config.shard_index, config.num_shards)
        setup_logging(STAGE, shard=index)
        store = ObjectStore()
        start_checks(config, store).check(quiet=True)  # before a record is read
        run(config, store)

    commands = {"import": import_, "preflight": preflight, "run": run_}
    chosen = select_command("dflash-tokenize", commands, command, ABOUT, EXAMPLES)
    run_stage_main(f"{STAGE} {command}", chosen)


if __name__ == "__main__":
    main()
