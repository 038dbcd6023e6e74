"""dflash-generate: `import` conversations as prompts, `preflight` the node, `run` the stage, and
`serve-check` an exported drafter in the engine; the commands are the table in dflash_generate.commands."""

from __future__ import annotations

from typing import NoReturn

from dflash_generate.commands import PROGRAM
from dflash_shared.commands import stage_main


def main(argv: list[str] | None = None) -> NoReturn:
    stage_main(PROGRAM, argv)


if __name__ == "__main__":
    main()
