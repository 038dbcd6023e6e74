"""dflash-train: `preflight` the node, `run` (or resume) the training; `export` and `evaluate` a drafter.

Launch `run` with torchrun for several GPUs. The commands are the table in dflash_train.commands; each imports
only what it needs when it runs, so `--help` and configuration errors answer before torch loads.
"""

from __future__ import annotations

from typing import NoReturn

from dflash_shared.commands import stage_main
from dflash_train.commands import PROGRAM


def main(argv: list[str] | None = None) -> NoReturn:
    stage_main(PROGRAM, argv)


if __name__ == "__main__":
    main()
