"""dflash-train: `preflight` the node, `run` (or resume) the training; `export` and `evaluate` a drafter.

Launch `run` with torchrun for several GPUs. Each command imports only what it needs, so `--help` and
configuration errors answer before torch loads.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from dflash_shared.cli import run_stage_main, select_command
from dflash_shared.settings import parse_settings

STAGE = "train"
ABOUT = {
    "preflight": "check GPUs, storage, the tokenized input and the target before training; exit 0, 64, 65 or 69",
    "run": "train (or resume) a drafter on tokenized shards; torchrun for several GPUs",
    "export": "write a trained checkpoint as a drafter directory vLLM loads",
    "evaluate": "measure a drafter's acceptance on held-out prompts against its target",
}
EXAMPLES = (
    "dflash-train run --input store/tokenized --output store/drafter --target models/Qwen3-8B",
    "dflash-train export --drafter store/drafter --output store/export --target models/Qwen3-8B",
)

def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    command, rest = (args[0], args[1:]) if args else ("", [])

    def preflight() -> int:
        from dflash_train.checks import build_preflight
        from dflash_train.config import TrainConfig

        return build_preflight(parse_settings(TrainConfig, rest, prog="dflash-train preflight")).run()

    def run_() -> None:
        from dflash_train.config import TrainConfig
        from dflash_train.parallel.gang import rank_exit
        from dflash_train.stage import run

        # Under torchrun: a peer's failure exits 75, and the pod's entrypoint learns each rank's code.
        with rank_exit():
            run(parse_settings(TrainConfig, rest, prog="dflash-train run"))

    def export() -> None:
        from dflash_train.export.stage import export_command

        export_command(rest)

    def evaluate() -> None:
        from dflash_train.evaluate.stage import evaluate_command

        evaluate_command(rest)

    commands = {"preflight": preflight, "run": run_, "export": export, "evaluate": evaluate}
    chosen = select_command("dflash-train", commands, command, ABOUT, EXAMPLES)
    run_stage_main(f"{STAGE} {command}", chosen)


if __name__ == "__main__":
    main()
