"""The tokenizer image's CLI, `dflash-tokenize`, as a command table (dflash_shared.commands)."""

from __future__ import annotations

from dflash_shared.commands import StageCommand, StageProgram, import_command, preflight_command
from dflash_shared.manifests import Kind

PROGRAM = StageProgram(
    prog="dflash-tokenize",
    stage="tokenize",
    commands=(
        import_command(Kind.completions, "dflash-tokenize"),
        import_command(Kind.prompts, "dflash-tokenize", name="import-prompts"),
        preflight_command(
            "tokenize", "dflash_tokenize.config:TokenizeConfig", "dflash_tokenize.checks:build_preflight",
            "check storage, the tokenizer, the input manifest and disk before a run; exit 0, 64, 65 or 69"),
        StageCommand(
            name="run", log_as="tokenize", sharding="workers",
            about="tokenize completions into loss-masked Arrow shards and a tokenized manifest",
            config="dflash_tokenize.config:TokenizeConfig", run="dflash_tokenize.stage:run",
            start_checks="dflash_tokenize.checks:build_preflight"),
    ),
    examples=(
        "dflash-tokenize import --source chats/ --output store/completions",
        "dflash-tokenize import-prompts --source prompts/ --output store/prompts --tokenizer models/Qwen3-8B",
        "dflash-tokenize run --input store/completions --output store/tokenized --tokenizer models/Qwen3-8B",
    ),
)
