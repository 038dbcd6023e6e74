"""The tokenizer image's CLI, `dflash-tokenize`, as a command table (dflash_shared.commands)."""

from __future__ import annotations

from dflash_shared.commands import StageCommand, StageProgram
from dflash_shared.manifests import Kind

PROGRAM = StageProgram(
    prog="dflash-tokenize",
    stage="tokenize",
    commands=(
        StageCommand(
            name="import", log_as="import", sharding="workers",
            about="read conversations (JSONL, Parquet, a saved or Hub dataset) into a completions manifest",
            config="dflash_shared.importing:ImportConfig", run="dflash_shared.importing:import_share",
            run_kwargs={"kind": Kind.completions, "packages": ["dflash-tokenize"]},
            start_checks="dflash_shared.importing:start_checks"),
        StageCommand(
            name="preflight", log_as="tokenize", output=None,
            about="check storage, the tokenizer, the input manifest and disk before a run; exit 0, 64, 65 or 69",
            config="dflash_tokenize.config:TokenizeConfig", run="dflash_shared.commands:run_preflight",
            run_kwargs={"build": "dflash_tokenize.checks:build_preflight"}),
        StageCommand(
            name="run", log_as="tokenize", sharding="workers",
            about="tokenize completions into loss-masked Arrow shards and a tokenized manifest",
            config="dflash_tokenize.config:TokenizeConfig", run="dflash_tokenize.stage:run",
            start_checks="dflash_tokenize.checks:start_checks"),
    ),
    examples=(
        "dflash-tokenize import --source chats/ --output store/completions",
        "dflash-tokenize run --input store/completions --output store/tokenized --tokenizer models/Qwen3-8B",
    ),
)
