"""The trainer image's CLI, `dflash-train`, as a command table (dflash_shared.commands): names only, so `--help`
and a wrong flag answer before torch loads."""

from __future__ import annotations

from dflash_shared.commands import StageCommand, StageProgram, preflight_command

PROGRAM = StageProgram(
    prog="dflash-train",
    stage="train",
    commands=(
        preflight_command(
            "train", "dflash_train.config:TrainConfig", "dflash_train.checks:build_preflight",
            "check GPUs, storage, the tokenized input and the target before training; exit 0, 64, 65 or 69"),
        StageCommand(
            name="run", log_as="train", sharding="ranks",
            about="train (or resume) a drafter on tokenized shards; torchrun for several GPUs",
            config="dflash_train.config:TrainConfig", run="dflash_train.stage:run",
            start_checks="dflash_train.checks:build_preflight",
            # Under torchrun: a peer's failure exits 75, and the pod's entrypoint learns each rank's code.
            wrapper="dflash_train.parallel.gang:rank_exit"),
        StageCommand(
            name="export", log_as="export",
            about="write a trained checkpoint as a drafter directory vLLM loads",
            config="dflash_train.export.config:ExportConfig", run="dflash_train.export.stage:run_export",
            start_checks="dflash_train.checks:export_start_checks"),
        StageCommand(
            name="evaluate", log_as="evaluate",
            about="measure a drafter's acceptance on held-out prompts against its target",
            config="dflash_train.evaluate.config:EvaluateConfig", run="dflash_train.evaluate.stage:run",
            start_checks="dflash_train.checks:evaluate_start_checks"),
    ),
    examples=(
        "dflash-train run --input store/tokenized --output store/drafter --target models/Qwen3-8B",
        "dflash-train export --drafter store/drafter --output store/export --target models/Qwen3-8B",
    ),
)
