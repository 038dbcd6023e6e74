"""Turn external conversation records (OpenAI-style `messages`) into validated `Message` lists.

External data comes with the assistant's reasoning either in a `reasoning_content` field or inline between
think markers in `content`; both become `reasoning_content` here, so every later stage sees one shape. An
unclosed think block is kept verbatim in `content` (markers included) so the quality gate can count it
instead of the importer guessing where the thinking stopped. A source's `finish_reason` is kept too: the
quality gate rejects an imported answer that stopped at its length limit as it does a generated one.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from dflash_shared.quality import MALFORMED, THINK_CLOSE, THINK_OPEN
from dflash_shared.records import Message

# Field spellings seen in public chat datasets, mapped to ours.
_ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant", "bot": "assistant"}
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
# finish_reason values that mean "stopped at the token limit", as other APIs spell it; ours is "length".
_LENGTH_REASONS = {"length", "max_tokens"}


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


def _text_parts(parts: list[Any], index: int) -> str:
    texts = []
    for number, part in enumerate(parts):
        text = part.get("text") if isinstance(part, dict) else None
        if text is None:  # an image, audio or other non-text part
            continue
        if not isinstance(text, str):
            raise RecordError(MALFORMED, f"message {index} content part {number} text is a {type(text).__name__}, "
                                         "not text")
        texts.append(text)
    # As vLLM's chat server joins text parts for a string-content template: the target's own rendering of them.
    return "\n".join(texts)


def _message(raw: Any, index: int) -> Message:
    if not isinstance(raw, dict):
        raise RecordError(MALFORMED, f"message {index} is a {type(raw).__name__}, not an object")
    role = raw.get("role", raw.get("from"))
    role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
    content = raw.get("content", raw.get("value"))
    if isinstance(content, list):  # OpenAI content parts: keep the text parts, in order
        content = _text_parts(content, index)
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


def parse_finish_reason(obj: dict[str, Any]) -> str | None:
    """Why the final answer stopped, as the source says: a top-level `finish_reason`, one on the final
    message, or an OpenAI response's `choices[0].finish_reason`; "max_tokens" is read as "length"."""
    raw_messages = obj.get("messages", obj.get("conversations"))
    last = raw_messages[-1] if isinstance(raw_messages, list) and raw_messages else None
    choices = obj.get("choices")
    first_choice = choices[0] if isinstance(choices, list) and choices else None
    places = (obj, last, first_choice)
    reason = next((p["finish_reason"] for p in places if isinstance(p, dict) and p.get("finish_reason") is not None),
                  None)
    if reason is None:
        return None
    if not isinstance(reason, str):
        raise RecordError(MALFORMED, f"finish_reason is a {type(reason).__name__}, not text")
    return "length" if reason.lower() in _LENGTH_REASONS else reason
