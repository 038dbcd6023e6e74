"""Command-line entry point of the train stage (`dflash-train`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run the train stage; the trainer loop is not wired in yet, so this exits with an error."""
    del argv
    print("dflash-train: the trainer entry point is not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
