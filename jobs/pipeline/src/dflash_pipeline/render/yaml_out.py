"""A small YAML writer for Kubernetes objects (block style, stable order), so no YAML library is needed.

Only what manifests hold is supported: dicts with string keys, lists, strings, ints, floats, bools and
None. A string is written plain only when YAML cannot read it as anything else; otherwise it is
double-quoted with JSON escapes, which YAML reads back identically.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

# Plain scalars: start with a letter, '_' or '/', then only characters that never start YAML syntax.
_PLAIN = re.compile(r"^[A-Za-z_/][A-Za-z0-9_./-]*$")
# Words YAML 1.1 readers (PyYAML, and so many tools) take as booleans or null.
_RESERVED = frozenset({"y", "n", "yes", "no", "on", "off", "true", "false", "null"})


def scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value!r} into a manifest")
        return json.dumps(value)
    if isinstance(value, str):
        if _PLAIN.match(value) and value.lower() not in _RESERVED:
            return value
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot write a {type(value).__name__} into a manifest")


def _lines(node: Any, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str):
                raise TypeError(f"manifest keys must be strings, got {key!r}")
            if isinstance(value, dict | list) and value:
                out.append(f"{pad}{scalar(key)}:")
                out.extend(_lines(value, indent + 2))
            else:
                out.append(f"{pad}{scalar(key)}: {_inline(value)}")
        return out
    if isinstance(node, list):
        for item in node:
            if isinstance(item, dict | list) and item:
                inner = _lines(item, indent + 2)
                out.append(f"{pad}- {inner[0].lstrip()}")
                out.extend(inner[1:])
            else:
                out.append(f"{pad}- {_inline(item)}")
        return out
    return [pad + scalar(node)]


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return scalar(value)


def dump(doc: dict[str, Any]) -> str:
    """One document as block YAML, ending in a newline."""
    return "\n".join(_lines(doc, 0)) + "\n"


def dump_all(docs: Iterable[dict[str, Any]], header: Iterable[str] = ()) -> str:
    """Several documents separated by '---', after optional '# ' comment lines."""
    head = "".join(f"# {line}\n" if line else "#\n" for line in header)
    return head + "---\n".join(dump(doc) for doc in docs)
