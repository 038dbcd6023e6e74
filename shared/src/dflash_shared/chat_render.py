"""A conversation's prompt as the target sees it: its chat template and thinking mode, rendered to token ids.

Used where a prompt is counted or decoded before any engine runs: `import` counts each prompt's tokens (so the
plan reads measured prompt lengths and an over-long prompt is refused at import, not on 64 GPUs at generate),
and evaluate decodes held-out prompts. Rendered to text and then encoded without added specials, which is what
the generate stage and the engines do. transformers loads on first use, so importing this module needs no
tokenizer library; only the tokenizer's small files are read, never the weights.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from dflash_shared.errors import ConfigError
from dflash_shared.records import Message
from dflash_shared.storage import ObjectStore, is_s3, join

# Only the small files of a model directory: a tokenizer never needs the weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "config.json")


def fetch_tokenizer(store: ObjectStore, location: str, scratch: str) -> str:
    """A local directory with the tokenizer files of `location` (copied from S3 into `scratch` when needed)."""
    if not is_s3(location):
        return location
    local = os.path.join(scratch, "tokenizer")
    os.makedirs(local, exist_ok=True)
    for name in TOKENIZER_FILES:
        uri = join(location, name)
        if store.exists(uri):
            store.download_to(uri, os.path.join(local, name))
    if not os.path.exists(os.path.join(local, "tokenizer.json")):
        raise ConfigError(f"no tokenizer.json under {location}: point --tokenizer at the target model's directory")
    return local


class ChatRenderer:
    """Prompt token ids of a conversation under the target's chat template (the tokenizer loads on first use)."""

    def __init__(self, tokenizer_dir: str, enable_thinking: bool) -> None:
        self.tokenizer_dir, self.enable_thinking = tokenizer_dir, enable_thinking
        self._tokenizer: Any = None

    def __call__(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        text = self._tokenizer.apply_chat_template(
            [m.template_dict() for m in messages], tools=list(tools) if tools else None, tokenize=False,
            add_generation_prompt=True, enable_thinking=self.enable_thinking,
        )
        return list(self._tokenizer.encode(text, add_special_tokens=False))
