"""dflash-tokenize: `import` external conversations, `preflight` the node, `run` the stage; the commands are the
table in dflash_tokenize.commands."""

from __future__ import annotations

from typing import NoReturn

from dflash_shared.commands import stage_main
from dflash_tokenize.commands import PROGRAM


def main(argv: list[str] | None = None) -> NoReturn:
    stage_main(PROGRAM, argv)


if __name__ == "__main__":
    main()
