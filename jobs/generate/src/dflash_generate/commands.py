"""The generator image's CLI, `dflash-generate`, as a command table (dflash_shared.commands): names only, so
reading it imports neither vLLM nor torch."""

from __future__ import annotations

from dflash_shared.commands import StageCommand, StageProgram, import_command, preflight_command
from dflash_shared.manifests import Kind

PROGRAM = StageProgram(
    prog="dflash-generate",
    stage="generate",
    commands=(
        import_command(Kind.prompts, "dflash-generate"),
        preflight_command(
            "generate", "dflash_generate.config:GenerateConfig", "dflash_generate.checks:build_preflight",
            "check the engine stack, GPUs, /dev/shm, storage and the input before a run; exit 0, 64, 65 or 69"),
        StageCommand(
            name="run", log_as="generate", sharding="workers", shard="dflash_generate.stage:worker_shard",
            about="generate the target's completions of the prompts with vLLM",
            config="dflash_generate.config:GenerateConfig", run="dflash_generate.stage:run",
            start_checks="dflash_generate.checks:build_preflight",
            # Each worker of a pod records its own engine's rank; the manifest holds the last one's.
            per_process=("data_parallel_rank",)),
        StageCommand(
            name="serve-check", log_as="serve-check",
            about="load an exported drafter in vLLM beside its target and measure acceptance",
            config="dflash_generate.serve_check.config:ServeCheckConfig", run="dflash_generate.serve_check.stage:run",
            start_checks="dflash_generate.serve_check.stage:start_checks"),
    ),
    examples=(
        "dflash-generate import --source prompts/ --output store/prompts",
        "dflash-generate run --input store/prompts --output store/completions --model models/Qwen3-8B",
    ),
)
