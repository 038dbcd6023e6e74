"""Export the JSON Schema of every manifest kind (`make schemas`), for readers outside Python."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from dflash_shared.manifests import SCHEMA_VERSION, SECTION_TYPES, Kind, Manifest


def kind_model(kind: Kind) -> type[BaseModel]:
    """The envelope narrowed to one kind: its `kind` and `section` fields admit that kind only."""
    section_type: Any = SECTION_TYPES[kind]
    kind_type: Any = Literal[kind]
    return create_model(
        f"{kind.value.capitalize()}Manifest",
        __base__=Manifest,
        kind=(kind_type, Field(description="What the prefix holds.")),
        section=(section_type, Field(description="The kind-specific part.")),
    )


def export(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in Kind:
        path = out_dir / f"{kind.value}.v{SCHEMA_VERSION}.schema.json"
        schema = kind_model(kind).model_json_schema()
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for path in export(Path(args[0] if args else "schemas")):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
