"""Hypothesis strategies for hostile input: conversation records wrong at every level, and byte noise.

Every reader of user data (import, generate's prompt reader, tokenize's line parser) must count what these
make, never raise on it. The records follow the shapes the readers know (OpenAI messages with content
parts, reasoning and tool calls, ShareGPT turns, tools, finish reasons), each field right or replaced by any
JSON value; the text mixes arbitrary code points with the ones that break naive code (lone surrogates,
control characters, bidirectional overrides, think markers). A line is such a record's JSON, then perhaps
cut, spliced with raw bytes or escapes, nested past every limit or given a number no parser keeps.

The properties themselves live beside each reader's tests.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, settings
from hypothesis import strategies as st

# Deterministic and quick: CI runs the same examples every time, a few seconds per property.
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TRICKY_TEXT = ["\ud800", "\udfff", "\ud83d", "\udc00\ud800", "\x00", "\x1b[31m", "\u202e", "\ufeff", "\r",
               "<think>", "</think>", "<|im_end|>", "\\", '"', "\n", "🎉", "熱"]
# Pieces spliced into a line's bytes: escapes of lone surrogates, surrogates and bytes that are not UTF-8,
# the non-JSON numbers Python's json accepts, a NUL, a stray quote or bracket.
TRICKY_BYTES = [b"\\ud800", b"\\udc00\\ud800", b"\\uDFFF", b"\xed\xa0\x80", b"\xff", b"\xc3", b"\xe2\x82",
                b"NaN", b"Infinity", b"-Infinity", b"\x00", b"\\u0000", b'"', b"]", b"{", b"\\", b"\r"]

_SURROGATE_BYTES = [b"\\ud800", b"\\udfff", b"\xed\xa0\x80", b"\\udc00\\ud800"]
_SURROGATES = [t for t in TRICKY_TEXT if any(0xD800 <= ord(c) <= 0xDFFF for c in t)]
# Text that survives decoding (any code point but a surrogate, and the tricky pieces that are Unicode) ...
clean_text = st.lists(st.one_of(st.text(st.characters(exclude_categories=("Cs",)), max_size=4),
                                st.sampled_from([t for t in TRICKY_TEXT if t not in _SURROGATES])),
                      max_size=4).map("".join)
# ... and text that does not: a lone surrogate in it (a fault's value; records' own text is clean_text).
wild_text = st.tuples(clean_text, st.sampled_from(_SURROGATES), clean_text).map("".join)
_clean_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
                           st.floats(allow_nan=False, allow_infinity=False), clean_text)
_wild_scalars = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(), wild_text)


def _json(scalars: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                         st.dictionaries(clean_text, kids, max_size=3)),
                        max_leaves=10)


# Any JSON value, mostly one that decodes (so that the fault it stands for reaches the record's checks),
# sometimes with a NaN, a huge integer or a lone surrogate in it.
json_values: st.SearchStrategy[Any] = st.one_of(_json(_clean_scalars), _json(_clean_scalars), _json(_clean_scalars),
                                                _json(st.one_of(_clean_scalars, _wild_scalars)))


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The field's right shape most of the time, any JSON value otherwise."""
    return st.one_of(valid, valid, valid, json_values)


def _same(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return valid


roles = st.sampled_from(["system", "user", "assistant", "tool", "human", "gpt", "model", "bot", "USER", ""])
finish_reasons = st.sampled_from(["stop", "length", "max_tokens", "tool_calls", "LENGTH"])


def _record_shapes(field: Callable[[st.SearchStrategy[Any]], st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Conversation records whose every field goes through `field` (_same: right shapes; maybe: messy)."""
    content_parts = st.lists(field(st.fixed_dictionaries({"type": st.just("text"), "text": field(clean_text)})),
                             max_size=3)
    tool_call = st.fixed_dictionaries({
        "type": field(st.just("function")),
        "function": field(st.fixed_dictionaries({
            "name": field(clean_text),
            "arguments": field(st.one_of(clean_text, st.dictionaries(clean_text, json_values, max_size=2))),
        })),
    }, optional={"id": field(clean_text)})

    def message(role: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
        return st.fixed_dictionaries({
            "role": field(role),
            "content": field(st.one_of(clean_text, content_parts)),
        }, optional={
            "reasoning_content": field(clean_text),
            "thinking": field(clean_text),
            "tool_calls": field(st.lists(field(tool_call), max_size=2)),
            "tool_call_id": field(clean_text),
            "name": field(clean_text),
            "finish_reason": field(finish_reasons),
        })

    # Any turns, then a user turn and an assistant turn: the shape a record must end with to be kept.
    messages = st.tuples(st.lists(field(message(roles)), max_size=2), message(st.just("user")),
                         message(st.just("assistant"))).map(lambda t: [*t[0], t[1], t[2]])
    turn = st.fixed_dictionaries({"from": field(roles), "value": field(clean_text)})
    return st.one_of(
        st.fixed_dictionaries({"messages": field(messages)}, optional={
            "tools": field(st.lists(field(st.dictionaries(clean_text, json_values, max_size=2)), max_size=2)),
            "finish_reason": field(finish_reasons),
            "choices": field(st.lists(st.fixed_dictionaries({"finish_reason": field(finish_reasons)}), max_size=1)),
            "id": field(st.one_of(clean_text, st.integers())),
        }),
        st.fixed_dictionaries({"conversations": field(st.lists(field(turn), min_size=1, max_size=4))}),
    )


_valid_shapes = _record_shapes(_same)
_messy_shapes = _record_shapes(maybe)


@st.composite
def one_fault(draw: st.DrawFn, valid: st.SearchStrategy[Any]) -> Any:
    """A record of the right shape with exactly one value, at any depth, replaced by any JSON value: a fault
    that no earlier check can mask, wherever it is."""
    record = draw(valid)
    slots: dict[int, list[tuple[Any, Any]]] = {}

    def walk(node: Any, depth: int) -> None:
        for key, child in node.items() if isinstance(node, dict) else enumerate(node):
            slots.setdefault(depth, []).append((node, key))
            if isinstance(child, dict | list):
                walk(child, depth + 1)

    walk(record, 0)
    # A depth first, then a slot there: deep fields (a content part's text, a tool call's arguments) are
    # few among many shallow ones, and as likely to hold the fault.
    depth = draw(st.sampled_from(sorted(slots)))
    container, key = draw(st.sampled_from(slots[depth]))
    container[key] = draw(json_values)
    return record


# Deferred: the composed strategies' own repr runs to megabytes, and hypothesis would build it per test.
records: st.SearchStrategy[Any] = st.deferred(
    lambda: st.one_of(*[one_fault(_valid_shapes)] * 3, _valid_shapes, _messy_shapes, json_values))


# CompletionRecord lines as a hand-made or damaged completions shard holds them: the record model's fields,
# messages of the Message model, token ids of every odd kind.
_message_model = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool"]),
    "content": clean_text,
}, optional={
    "reasoning_content": clean_text,
    "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries({
        "name": clean_text, "arguments": st.one_of(clean_text, st.dictionaries(clean_text, clean_text, max_size=2)),
    })}), max_size=1),
    "name": clean_text,
})
_token_ids = st.lists(st.one_of(st.integers(0, 151_000), st.integers(0, 151_000), st.integers(-5, 2**40),
                                st.booleans(), st.floats(0, 10)), max_size=12)
_completion_shapes = st.fixed_dictionaries({
    "id": clean_text,
    "messages": st.tuples(st.lists(_message_model, max_size=2), _message_model.map(lambda m: {**m, "role": "user"}),
                          _message_model.map(lambda m: {**m, "role": "assistant"})).map(lambda t: [*t[0], t[1], t[2]]),
}, optional={
    "prompt_token_ids": _token_ids,
    "completion_token_ids": _token_ids,
    "finish_reason": finish_reasons,
    "enable_thinking": st.booleans(),
    "tools": st.lists(st.dictionaries(clean_text, json_values, max_size=2), max_size=1),
    "source": clean_text,
})
completion_records: st.SearchStrategy[Any] = st.deferred(
    lambda: st.one_of(*[one_fault(_completion_shapes)] * 2, _completion_shapes, json_values))
# PromptRecord lines, as a prompts shard holds them: a conversation that ends with a user turn.
_prompt_shapes = st.fixed_dictionaries({
    "id": clean_text,
    "messages": st.tuples(st.lists(_message_model, max_size=2), _message_model.map(lambda m: {**m, "role": "user"})
                          ).map(lambda t: [*t[0], t[1]]),
}, optional={
    "tools": st.lists(st.dictionaries(clean_text, json_values, max_size=2), max_size=1),
    "source": clean_text,
    "source_id": clean_text,
})
prompt_records: st.SearchStrategy[Any] = st.deferred(
    lambda: st.one_of(*[one_fault(_prompt_shapes)] * 2, _prompt_shapes, json_values))


@st.composite
def noisy_lines(draw: st.DrawFn, values: str = "conversations") -> bytes:
    """One line (no newline in it) holding a drawn record's JSON, perhaps damaged on purpose; `values` says
    which records: external "conversations" (import's input), "prompts" (generate's) or "completions"
    (tokenize's)."""
    obj = draw({"conversations": records, "prompts": prompt_records, "completions": completion_records}[values])
    rendered = json.dumps(obj, ensure_ascii=draw(st.booleans()))
    # surrogatepass: a lone surrogate in a string becomes the (invalid) UTF-8 bytes a careless writer emits.
    data = rendered.encode("utf-8", "surrogatepass")
    # Undamaged about half the time: the record's own faults need lines that parse to be reached.
    damage = draw(st.sampled_from(["none"] * 6 + ["cut", "splice", "bytes", "surrogate", "deep", "deep_inside",
                                                  "number"]))
    starts = [m.end() for m in re.finditer(rb'": "', data)]  # where string values begin
    if damage == "surrogate" and starts:  # a lone surrogate inside a string value: valid JSON, not Unicode
        at = draw(st.sampled_from(starts))
        data = data[:at] + draw(st.sampled_from(_SURROGATE_BYTES)) + data[at:]
    elif damage == "cut" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "splice":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from(TRICKY_BYTES)) + data[at:]
    elif damage == "bytes":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=6)) + data[at:]
    elif damage == "deep":
        depth = draw(st.sampled_from([99, 101, 1000, 5000]))
        data = b"[" * depth + data + b"]" * depth
    elif damage == "deep_inside":
        depth = draw(st.sampled_from([98, 150, 990, 3000]))
        data = (b'{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"}],"tools":[{"p":'
                + b"[" * depth + b"]" * depth + b"}]}")
    elif damage == "number":
        number = draw(st.sampled_from([b"1" * 30, b"9" * 5000, b"-" + b"9" * 20, b"1e400", b"-1e999", b"NaN"]))
        data = (b'{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"}],"tools":[{"n":'
                + number + b"}]}")
    return data.replace(b"\n", b" ")


def valid_record(k: int) -> dict[str, Any]:
    """A record every reader must keep, marked so that its output can be found and counted."""
    return {"messages": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": f"Question ⟦valid {k}⟧: what is {k} squared?"},
        {"role": "assistant", "content": f"<think>\n{k} times {k}\n</think>\n\nIt is {k * k}."},
    ]}


def known_crashers(base: dict[str, Any]) -> list[bytes]:
    """Lines that crashed a reader before it was hardened, each `base` (a valid record with a user turn)
    with one fault: for `@example`s, so every run tries them whatever the random draws."""
    good = json.dumps(base).encode()
    user = next(m for m in base["messages"] if m.get("role") == "user")
    quoted = json.dumps(user["content"]).encode()

    def user_text(raw: bytes) -> bytes:
        return good.replace(quoted, b'"x' + raw + b'"', 1)

    def tool_value(raw: bytes) -> bytes:
        return json.dumps({**base, "tools": [{"n": 1}]}).encode().replace(b'"n": 1', b'"n": ' + raw)

    parts = {**base, "messages": [{**m, "content": [{"type": "text", "text": 5}]} if m is user else m
                                  for m in base["messages"]]}
    return [
        user_text(b"\\ud800"),            # a lone surrogate, escaped
        user_text(b"\xed\xa0\x80"),      # a lone surrogate as the (invalid) UTF-8 bytes careless writers emit
        user_text(b"\\udfff\\ud800"),   # a surrogate pair in the wrong order
        tool_value(b"9" * 5000),            # past Python's 4300-digit int limit
        tool_value(b"1" * 30),              # past 64 bits
        tool_value(b"NaN"),
        tool_value(b"1e400"),
        tool_value(b"[" * 5000 + b"]" * 5000),  # past the recursion limit
        tool_value(b"[" * 500 + b"]" * 500),    # parsed, but past what a later json.dumps can serialise
        json.dumps(parts).encode(),         # a content part whose text is a number
    ]


def with_crashers(base: dict[str, Any], wrap: Callable[[bytes], Any] = lambda line: line, name: str = "line",
                  **fixed: Any) -> Callable[[Any], Any]:
    """Decorator: a hypothesis `@example` per known crasher built on `base`, passed as `name` (through
    `wrap`), with `fixed` for the test's other arguments."""
    def decorate(test: Any) -> Any:
        for line in known_crashers(base):
            test = example(**{name: wrap(line)}, **fixed)(test)
        return test
    return decorate


@pytest.fixture(scope="module")
def no_fsync() -> Iterator[None]:
    """Durability is not under test in the property tests, and fsync is most of a small shard's time on a
    shared disk. Modules opt in with `pytestmark = pytest.mark.usefixtures("no_fsync")` and the import."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", lambda fd: None)
        yield
