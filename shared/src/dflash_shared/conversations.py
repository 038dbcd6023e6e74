"""Turn external conversation records (OpenAI-style `messages`) into validated `Message` lists.

External data comes with the assistant's reasoning either in a `reasoning_content` field or inline between
think markers in `content`; both become `reasoning_content` here, so every later stage sees one shape. An
unclosed think block is kept verbatim in `content` (markers included) so the quality gate can count it
instead of the importer guessing where the thinking stopped.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from dflash_shared.quality import MALFORMED, THINK_CLOSE, THINK_OPEN
from dflash_shared.records import Message

# Field spellings seen in public chat datasets, mapped to ours.
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant"}
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


class RecordError(ValueError):
    """A record that cannot be used; `reason` is the accounting key."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


def split_inline_thinking(content: str) -> tuple[str | None, str]:
    """'<think>r</think>answer' -> ('r', 'answer'); unclosed blocks are left intact for the gate."""
    if THINK_CLOSE not in content:
        return None, content
    head, _, answer = content.partition(THINK_CLOSE)
    reasoning = head.split(THINK_OPEN, 1)[-1]
    return reasoning.strip("\n"), answer.lstrip("\n")


def _message(raw: Any, index: int) -> Message:
    if not isinstance(raw, dict):
        raise RecordError(MALFORMED, f"message {index} is a {type(raw).__name__}, not an object")
    role = raw.get("role", raw.get("from"))
    role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    content = raw.get("content", raw.get("value"))
    if isinstance(content, list):  # OpenAI content parts: keep the text parts, in order
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise RecordError(MALFORMED, f"message {index} content is a {type(content).__name__}, not text")
    reasoning = next((raw[k] for k in _REASONING_KEYS if isinstance(raw.get(k), str)), None)
    if role == "assistant" and reasoning is None:
        reasoning, content = split_inline_thinking(content)
    fields = {
        "role": role,
        "content": content,
        "reasoning_content": reasoning if role == "assistant" else None,
        "tool_calls": raw.get("tool_calls") or None,
        "tool_call_id": raw.get("tool_call_id"),
        "name": raw.get("name"),
    }
    try:
        return Message.model_validate(fields)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise RecordError(MALFORMED, f"message {index} field {where}: {first['msg']}") from err


def parse_messages(obj: Any) -> list[Message]:
    """Validate one external record's conversation; raises RecordError with the reason to count."""
    if not isinstance(obj, dict):
        raise RecordError(MALFORMED, f"record is a {type(obj).__name__}, not an object")
    raw_messages = obj.get("messages", obj.get("conversations"))
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RecordError(MALFORMED, "record has no 'messages' list")
    return [_message(raw, i) for i, raw in enumerate(raw_messages)]


def parse_tools(obj: dict[str, Any]) -> tuple[dict[str, Any], ...] | None:
    """The record's tool definitions, when it offers any (rendered into the system prompt by templates)."""
    tools = obj.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RecordError(MALFORMED, "'tools' is not a list of objects")
    return tuple(tools)
