"""The target's identity as every stage computes it: tokenizer and chat-template hashes of a model directory.

The generate stage (vLLM image) and the tokenize stage (torch-free image) must arrive at the same hashes
for the same model directory, or the cross-stage compatibility check would cry wolf. Both call these.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash_shared.errors import ConfigError


class TargetFilesError(ConfigError):
    """A model or tokenizer directory lacks what the stages need (tokenizer.json, a chat template).

    A configured path to fix, so USAGE (64) unless a stage says otherwise.
    """


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tokenizer_json_bytes(directory: str | Path) -> bytes:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise TargetFilesError(f"{directory}: tokenizer.json not found")
    return path.read_bytes()


def tokenizer_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def read_chat_template(directory: str | Path, config: Mapping[str, Any] | None = None) -> str:
    """The chat template of a tokenizer directory, found where transformers looks for it."""
    directory = Path(directory)
    # A separate chat_template.jinja takes priority over the config entry, as in transformers.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = (tokenizer_config(directory) if config is None else config).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise TargetFilesError(
            f"{directory}: no chat template (neither chat_template.jinja nor a 'chat_template' string "
            "or 'default' entry in tokenizer_config.json)"
        )
    return template


def tokenizer_sha256(directory: str | Path) -> str:
    return sha256_bytes(tokenizer_json_bytes(directory))


def chat_template_sha256(directory: str | Path) -> str:
    return sha256_bytes(read_chat_template(directory).encode("utf-8"))
