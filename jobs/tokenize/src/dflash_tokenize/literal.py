"""Control-token strings inside message text: encode them as the plain text they are.

A user who types "<|im_end|>" or "<think>" has written text, not a turn boundary; encoding it as the
control token would both mislead the model and shift the loss mask. Which strings count:
- in system, user and tool messages and in tool definitions: every added token's string;
- in assistant messages: only the tokens flagged "special". Engines drop special tokens from the text
  they return, so a special token's string in an answer was written out piece by piece; the plain added
  tokens (<think>, <tool_call>, ...) are kept in returned text and were emitted as single tokens.

How the template's own control tokens are told apart from those in the text: the conversation is
rendered a second time with the first character of every such string replaced by a private-use
character. Templates copy message text without looking inside it, so both renderings have the same
length and differ only at those characters; every control-token string left in the second rendering
came from the template. The text between those is encoded with no added-token matching at all, and
a text piece that spans the end of the generation prompt is encoded as two (the engine encodes the
prompt on its own; see masking.py).
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

if TYPE_CHECKING:
    from dflash_tokenize.chat import ChatFormat

# Private-use characters: no tokenizer gives them meaning, and real text almost never holds them.
_MARK_CANDIDATES = "\ue000\ue001\ue002\ue003\uf8fe\uf8ff"


def _strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _strings(value)


def _pattern_for(chat: ChatFormat, message: dict[str, Any]) -> re.Pattern[str]:
    return chat.special_token_pattern if message.get("role") == "assistant" else chat.added_token_pattern


@functools.lru_cache(maxsize=8)
def _bytes_pattern(pattern: re.Pattern[str]) -> re.Pattern[bytes]:
    return re.compile(pattern.pattern.encode("utf-8"))


def _holds(pattern: re.Pattern[str], objs: Sequence[Any], json_safe: bool) -> bool:
    """Whether a string anywhere in `objs` contains a match of `pattern`."""
    if json_safe:
        # One C-speed serialisation, searched as UTF-8: JSON leaves these token strings intact and adds
        # no text that could complete one (they hold no quote, backslash or control character).
        try:
            return _bytes_pattern(pattern).search(orjson.dumps(objs)) is not None
        except TypeError:
            pass  # a value orjson does not take (a non-string key, a huge int): search string by string
    return pattern.search("\0".join(_strings(list(objs)))) is not None


def has_literal_specials(
    chat: ChatFormat, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> bool:
    """True when some message or tool text holds a control-token string that must stay text."""
    safe = chat.added_tokens_json_safe
    assistant = [m for m in messages if m.get("role") == "assistant"]
    other: list[Any] = [m for m in messages if m.get("role") != "assistant"]
    other.extend(tools or [])
    return _holds(chat.added_token_pattern, other, safe) or _holds(chat.special_token_pattern, assistant, safe)


def _neutralize(obj: Any, pattern: re.Pattern[str], mark: str) -> Any:
    if isinstance(obj, str):
        return pattern.sub(lambda m: mark + m.group(0)[1:], obj)
    if isinstance(obj, dict):
        return {_neutralize(k, pattern, mark): _neutralize(v, pattern, mark) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_neutralize(v, pattern, mark) for v in obj)
    return obj


@dataclass(slots=True)
class LiteralEncoding:
    """Ids of a rendered conversation with per-token char offsets, built piece by piece."""

    text_len: int
    scan_text: str  # the rendering with text look-alikes defused: safe to search for control strings
    ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    def token_at(self, boundary: int) -> int | tuple[int, int]:
        """Index of the token starting exactly at `boundary`, or the (start, end) of one straddling it."""
        if boundary >= self.text_len:
            return len(self.ids)
        i = bisect.bisect_left(self.starts, boundary)
        if i > 0 and self.ends[i - 1] > boundary:
            return (self.starts[i - 1], self.ends[i - 1])
        if i == len(self.ids) or self.starts[i] != boundary:
            return (boundary, boundary)
        return i


class LiteralItem(NamedTuple):
    """One rendered conversation to encode, with what its rendering was made from."""

    messages: Sequence[dict[str, Any]]
    tools: Sequence[dict[str, Any]] | None
    thinking: bool | None
    text: str
    prompt_chars: int  # where the generation prompt ends: always a token boundary
    template_kwargs: Mapping[str, Any]


@dataclass(slots=True)
class _Plan:
    encoding: LiteralEncoding
    # (char offset, control id or None for a text piece, index into the text-piece batch)
    segments: list[tuple[int, int | None, int]]
    ends: list[int]


def _plan(chat: ChatFormat, item: LiteralItem, pieces: list[str]) -> _Plan | str:
    messages, tools, thinking, text, cut, template_kwargs = item
    mark = next((c for c in _MARK_CANDIDATES if c not in text), None)
    if mark is None:
        return "the text holds every private-use marker character; cannot locate literal control tokens"
    defused = [_neutralize(m, _pattern_for(chat, m), mark) for m in messages]
    defused_tools = _neutralize(list(tools), chat.added_token_pattern, mark) if tools else None
    scan = chat.render_dicts(defused, enable_thinking=thinking, tools=defused_tools, **template_kwargs)
    if len(scan) != len(text):
        return (
            "the chat template treats message text containing control-token strings differently from "
            f"the same text with those strings defused ({len(text)} vs {len(scan)} chars)"
        )
    restored = list(scan)
    for m in re.finditer(re.escape(mark), scan):
        restored[m.start()] = text[m.start()]
        if not chat.added_token_pattern.match(text, m.start()):
            return f"defused char {m.start()} does not start a control-token string in the rendered text"
    if "".join(restored) != text:
        return "the chat template changed message text around control-token strings"

    segments: list[tuple[int, int | None, int]] = []
    ends: list[int] = []

    def text_piece(start: int, stop: int) -> None:
        for a, b in ((start, cut), (cut, stop)) if start < cut < stop else ((start, stop),):
            segments.append((a, None, len(pieces)))
            pieces.append(text[a:b])
            ends.append(b)

    pos = 0
    for m in chat.added_token_pattern.finditer(scan):
        if m.start() > pos:
            text_piece(pos, m.start())
        segments.append((m.start(), chat.added_tokens[m.group(0)], -1))
        ends.append(m.end())
        pos = m.end()
    if pos < len(text):
        text_piece(pos, len(text))
    return _Plan(LiteralEncoding(len(text), scan), segments, ends)


def encode_literal_batch(chat: ChatFormat, items: Sequence[LiteralItem]) -> list[LiteralEncoding | str]:
    """Encode rendered conversations, their control-token look-alikes as text.

    Returns per item its encoding, or a string saying why literal control tokens could not be located.
    All text pieces of all items go to the tokenizer in one batch call.
    """
    pieces: list[str] = []
    plans = [_plan(chat, item, pieces) for item in items]
    encodings = chat.encode_plain_batch(pieces) if pieces else []
    out: list[LiteralEncoding | str] = []
    for plan in plans:
        if isinstance(plan, str):
            out.append(plan)
            continue
        enc = plan.encoding
        for (offset, control_id, piece), end in zip(plan.segments, plan.ends, strict=True):
            if control_id is not None:
                enc.ids.append(control_id)
                enc.starts.append(offset)
                enc.ends.append(end)
                continue
            piece_enc = encodings[piece]
            enc.ids.extend(piece_enc.ids)
            for start, stop in piece_enc.offsets:
                enc.starts.append(start + offset)
                enc.ends.append(stop + offset)
        out.append(enc)
    return out
