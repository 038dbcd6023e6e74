"""Command-line entry point of the generate stage (`dflash-generate`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point; the sharded runner is wired in by the stage runner module."""
    del argv
    print("dflash-generate: the stage runner is not wired in yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
