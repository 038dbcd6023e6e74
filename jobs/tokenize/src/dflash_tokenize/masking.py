"""Completion records -> (input_ids, loss_mask): the pure core of the tokenize stage.

Two modes:
- `token_exact`: the engine's own ids, prompt then completion; loss on the completion. Nothing is
  re-tokenised, so the drafter trains on exactly the sequences the target produced.
- `render`: the model's chat template renders the conversation and the tokenizer encodes it; loss on
  the assistant tokens only. Used for imported conversations (no ids) and multi-turn masks.

The sequence ends with the final turn's end-of-turn token. The loss mask of an assistant turn covers
its thinking (with the think markers), its answer, its tool calls and its end-of-turn token; never the
role header, never the line break after end-of-turn, never system, user or tool text. Spans are found
on the rendered text and mapped to tokens; a token that straddles a span boundary is an error, never
silently half-masked.

The final turn is trained from the end of the generation prompt on: what the template pre-fills there
(Qwen3's empty think block with thinking off, Qwen3.5/3.6's opening `<think>\n` with thinking on) is
prompt, as it is for the engine. The engine encodes that prompt on its own, so the final turn's start
is always a token boundary: when the text's own encoding puts a token across it (Qwen3.6's
`<think>\n` + `\n</think>` of an empty reasoning is one "\n\n" token), prompt and completion are
encoded separately, as token_exact mode has them. Earlier turns (`all_turns`) are trained from their
role header on, as the conversation text holds them.

User, system and tool text that contains a control-token string ("<|im_end|>" typed by a user) is
encoded as plain text (see `literal.py`); for everything else the whole text is encoded in one batch
call, which keeps the stage near the tokenizer's raw speed; with a byte-level tokenizer the call skips
offset tracking and token positions come from the ids' byte lengths (see `byte_spans.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from tokenizers import Encoding

from dflash_shared.conversations import split_inline_thinking
from dflash_shared.records import CompletionRecord
from dflash_tokenize.byte_spans import BytePositions, text_is_as_encoded
from dflash_tokenize.chat import ChatFormat, message_dict
from dflash_tokenize.literal import (
    LiteralEncoding,
    LiteralItem,
    encode_literal_batch,
    has_literal_specials,
)

MaskPolicy = Literal["final_turn", "all_turns"]
SpecialScan = Literal["auto", "always"]


class MaskingError(ValueError):
    """A record that cannot be turned into a trustworthy (input_ids, loss_mask) pair.

    `reason` is a short stable code for counting (the quality gate counts records per reason);
    the message names the record and says what differed and where.
    """

    def __init__(self, record_id: str, reason: str, detail: str) -> None:
        super().__init__(f"record {record_id}: {detail}")
        self.record_id = record_id
        self.reason = reason


# Reason codes.
MISSING_TOKEN_IDS = "missing_token_ids"
NO_FINAL_ASSISTANT = "no_final_assistant"
NOT_PREFIX = "template_not_prefix"
NO_END_OF_TURN = "no_end_of_turn"
TOKEN_STRADDLES = "token_straddles_span"
PROMPT_MISMATCH = "prompt_ids_mismatch"
LITERAL_UNRESOLVED = "literal_specials_unresolved"
# The chat template raised on the record (its own raise_exception, or a value it cannot handle).
TEMPLATE_REFUSED = "template_refused"
# The final answer has reasoning (its own field, or a think block inline in its content) that the rendered
# conversation leaves out (a template without a thinking mode, such as Qwen2.5's, or one that cuts an inline think
# block from the final turn): training would silently drop it.
REASONING_DROPPED = "reasoning_not_rendered"


@dataclass(frozen=True, slots=True)
class Tokenized:
    """One training sequence before truncation and packing."""

    record_id: str
    input_ids: list[int]
    loss_mask: list[int]  # 0/1 per token, same length as input_ids
    prompt_len: int  # tokens before the final assistant turn's first trained token
    num_loss_tokens: int
    mode: Literal["token_exact", "render"]
    literal_path: bool = False  # True when control-token look-alikes were encoded as plain text
    # The same ids as int32 where the byte path already made that array (saves converting them twice).
    ids_array: np.ndarray | None = field(default=None, compare=False, repr=False)


def token_exact(record: CompletionRecord) -> Tokenized:
    """The engine's prompt and completion ids as they are; loss on every completion id."""
    if record.prompt_token_ids is None or record.completion_token_ids is None:
        raise MaskingError(
            record.id, MISSING_TOKEN_IDS, "token_exact mode needs prompt_token_ids and completion_token_ids"
        )
    prompt, completion = record.prompt_token_ids, record.completion_token_ids
    return Tokenized(
        record_id=record.id,
        input_ids=[*prompt, *completion],
        loss_mask=[0] * len(prompt) + [1] * len(completion),
        prompt_len=len(prompt),
        num_loss_tokens=len(completion),
        mode="token_exact",
    )


@dataclass(slots=True)
class _Rendered:
    record: CompletionRecord
    dicts: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    thinking: bool | None
    text: str
    prompt_chars: int
    literal: bool
    template_kwargs: Mapping[str, Any]


def _render_one(
    record: CompletionRecord,
    chat: ChatFormat,
    enable_thinking: bool | None,
    scan: SpecialScan,
    template_kwargs: Mapping[str, Any],
) -> _Rendered:
    if not record.messages or record.messages[-1].role != "assistant":
        raise MaskingError(record.id, NO_FINAL_ASSISTANT, "the last message is not an assistant turn")
    thinking = record.enable_thinking if enable_thinking is None else enable_thinking
    # The record contract may carry tool definitions; older records have none.
    tools = getattr(record, "tools", None)
    tools = [dict(t) for t in tools] if tools else None
    dicts = [message_dict(m) for m in record.messages]
    try:
        full = chat.render_dicts(dicts, enable_thinking=thinking, tools=tools, **template_kwargs)
        prompt = chat.render_dicts(
            dicts[:-1], add_generation_prompt=True, enable_thinking=thinking, tools=tools, **template_kwargs
        )
    except MemoryError:
        raise
    except Exception as err:
        # Real templates raise_exception on conversations they refuse (a system turn after the first): the
        # record's fault, counted, never a crash of the whole batch.
        raise MaskingError(record.id, TEMPLATE_REFUSED,
                           f"the chat template refuses it ({type(err).__name__}: {str(err)[:200]})") from err
    if not full.startswith(prompt):
        at = next((i for i, (a, b) in enumerate(zip(prompt, full, strict=False)) if a != b), len(full))
        raise MaskingError(
            record.id,
            NOT_PREFIX,
            f"the generation prompt is not a prefix of the rendered conversation (they differ at char {at}: "
            f"prompt {prompt[at : at + 40]!r} vs conversation {full[at : at + 40]!r}): reasoning given "
            "with thinking disabled, or a template that rewrites earlier turns once the answer is present",
        )
    reasoning = _final_reasoning(record)
    if reasoning and reasoning not in full[len(prompt):]:
        raise MaskingError(
            record.id,
            REASONING_DROPPED,
            f"the chat template does not render the final answer's reasoning ({len(reasoning)} characters), which "
            "would then never be trained: a target without a thinking mode, given answers from one that thinks",
        )
    literal = scan == "always" or has_literal_specials(chat, dicts, tools)
    return _Rendered(record, dicts, tools, thinking, full, len(prompt), literal, template_kwargs)


def _final_reasoning(record: CompletionRecord) -> str:
    """The final answer's reasoning, stripped: its `reasoning_content`, else a think block inline in its content."""
    final = record.messages[-1]
    return (final.reasoning_content or split_inline_thinking(final.content)[0] or "").strip()


def _char_spans(item: _Rendered, scan_text: str, chat: ChatFormat, policy: MaskPolicy) -> list[tuple[int, int]]:
    """Character spans of the trained assistant text, in order."""
    eot, prompt_end = chat.end_of_turn, item.prompt_chars
    spans: list[tuple[int, int]] = []
    if policy == "all_turns":
        header = chat.assistant_header
        pos = scan_text.find(header)
        while 0 <= pos < prompt_end:
            start = pos + len(header)
            close = scan_text.find(eot, start)
            if close < 0 or close + len(eot) > prompt_end:
                break  # the final turn's header: its span starts after the generation prompt
            spans.append((start, close + len(eot)))
            pos = scan_text.find(header, close)
    close = scan_text.find(eot, prompt_end)
    if close < 0:
        raise MaskingError(
            item.record.id, NO_END_OF_TURN, f"no {eot!r} after the final assistant turn in the rendered text"
        )
    spans.append((prompt_end, close + len(eot)))
    return spans


def _straddle(item: _Rendered, boundary: int, start: int, end: int) -> MaskingError:
    text = item.text
    return MaskingError(
        item.record.id,
        TOKEN_STRADDLES,
        f"a token covering chars {start}..{end} ({text[start:end]!r}) straddles the assistant span boundary "
        f"at char {boundary} ({text[max(0, boundary - 20) : boundary]!r} | {text[boundary : boundary + 20]!r})",
    )


def _fast_token_index(item: _Rendered, enc: Encoding, n_tokens: int, boundary: int) -> int:
    """Index of the token starting exactly at char `boundary` (n_tokens at the end of the text)."""
    if boundary >= len(item.text):
        return n_tokens
    index = enc.char_to_token(boundary)
    if index is None:
        raise _straddle(item, boundary, boundary, boundary)
    span = enc.token_to_chars(index)
    start, end = span if span is not None else (boundary, boundary)
    if start != boundary:
        raise _straddle(item, boundary, start, end)
    return int(index)


def _check_prompt(item: _Rendered, ids: list[int], prompt_len: int, chat: ChatFormat) -> None:
    expected = item.record.prompt_token_ids
    if expected is None or tuple(ids[:prompt_len]) == expected:
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(ids[:prompt_len], expected, strict=False)) if a != b),
        min(prompt_len, len(expected)),
    )

    def show(seq: Sequence[int]) -> str:
        return repr(chat.decode(seq[at : at + 8])) if at < len(seq) else "<end>"

    raise MaskingError(
        item.record.id,
        PROMPT_MISMATCH,
        f"the rendered prompt ({prompt_len} tokens) differs from the engine's prompt_token_ids "
        f"({len(expected)} tokens) first at position {at}: rendered {ids[at : at + 8]} {show(ids)}, "
        f"engine {list(expected[at : at + 8])} {show(expected)}",
    )


def _assemble(
    item: _Rendered,
    ids: list[int],
    token_spans: list[tuple[int, int]],
    chat: ChatFormat,
    ids_array: np.ndarray | None = None,
) -> Tokenized:
    prompt_len, end = token_spans[-1]
    _check_prompt(item, ids, prompt_len, chat)
    # What a template writes after the final end-of-turn (Qwen: a line break) was never generated;
    # ending there makes render mode produce the same sequence as token_exact mode.
    del ids[end:]
    mask = [0] * len(ids)
    trained = 0
    for a, b in token_spans:
        mask[a:b] = [1] * (b - a)
        trained += b - a
    return Tokenized(
        record_id=item.record.id,
        input_ids=ids,
        loss_mask=mask,
        prompt_len=prompt_len,
        num_loss_tokens=trained,
        mode="render",
        literal_path=item.literal,
        ids_array=None if ids_array is None else ids_array[:end],
    )


def _starts_a_token(enc: Encoding, text_len: int, boundary: int) -> bool:
    if boundary >= text_len:
        return True
    index = enc.char_to_token(boundary)
    span = enc.token_to_chars(index) if index is not None else None
    return span is not None and span[0] == boundary


def _encode_split(item: _Rendered, chat: ChatFormat) -> LiteralEncoding:
    """The generation prompt and the completion encoded on their own, as the engine has them."""
    cut = item.prompt_chars
    out = LiteralEncoding(len(item.text), item.text)
    for enc, shift in zip(chat.encode_batch([item.text[:cut], item.text[cut:]]), (0, cut), strict=True):
        out.ids.extend(enc.ids)
        out.starts.extend(start + shift for start, _ in enc.offsets)
        out.ends.extend(end + shift for _, end in enc.offsets)
    return out


def _finish_fast(item: _Rendered, enc: Encoding, chat: ChatFormat, policy: MaskPolicy) -> Tokenized:
    ids = enc.ids
    n = len(ids)
    if not _starts_a_token(enc, len(item.text), item.prompt_chars):
        return _finish_literal(item, _encode_split(item, chat), chat, policy)
    spans = _char_spans(item, item.text, chat, policy)
    token_spans = [(_fast_token_index(item, enc, n, a), _fast_token_index(item, enc, n, b)) for a, b in spans]
    return _assemble(item, ids, token_spans, chat)


def _finish_by_bytes(
    item: _Rendered, ids: list[int], lengths: np.ndarray, chat: ChatFormat, policy: MaskPolicy
) -> Tokenized | None:
    """`_finish_fast` from ids alone; None when the byte positions cannot vouch for every boundary."""
    array = np.asarray(ids, dtype=np.int32)
    positions = BytePositions(item.text, array, lengths)
    if not positions.valid:
        return None
    if positions.token_at(item.prompt_chars) is None:
        # A token across the generation prompt's end: encode prompt and completion apart (see above).
        cut = item.prompt_chars
        head, tail = chat.encode_batch_ids([item.text[:cut], item.text[cut:]])
        ids = head + tail
        array = np.asarray(ids, dtype=np.int32)
        positions = BytePositions(item.text, array, lengths)
        if not positions.valid:
            return None
    token_spans = []
    for a, b in _char_spans(item, item.text, chat, policy):
        start, end = positions.token_at(a), positions.token_at(b)
        if start is None or end is None:
            return None  # a straddling token: the offsets path names it
        token_spans.append((start, end))
    return _assemble(item, ids, token_spans, chat, array)


def _encode_fast_records(
    fast: list[tuple[int, _Rendered]], chat: ChatFormat, policy: MaskPolicy, results: list[Any]
) -> None:
    """Encode and mask the records without control-token look-alikes, into `results` by position."""
    lengths = chat.byte_lengths_for(len(fast))
    by_offsets = fast
    if lengths is not None:
        by_offsets = []
        for (i, item), ids in zip(fast, chat.encode_batch_ids([item.text for _, item in fast]), strict=True):
            done: Tokenized | MaskingError | None = None
            if text_is_as_encoded(chat.tokenizer, item.text):
                try:
                    done = _finish_by_bytes(item, ids, lengths, chat, policy)
                except MaskingError as err:
                    done = err
            if done is None:
                by_offsets.append((i, item))  # encoded again, with offsets
            else:
                results[i] = done
    encodings = chat.encode_batch([item.text for _, item in by_offsets]) if by_offsets else []
    for (i, item), enc in zip(by_offsets, encodings, strict=True):
        try:
            results[i] = _finish_fast(item, enc, chat, policy)
        except MaskingError as err:
            results[i] = err


def _finish_literal(item: _Rendered, lit: LiteralEncoding, chat: ChatFormat, policy: MaskPolicy) -> Tokenized:
    """Spans to tokens over an encoding built piece by piece (the literal path's, or `_encode_split`'s)."""
    spans = _char_spans(item, lit.scan_text, chat, policy)

    def index(boundary: int) -> int:
        found = lit.token_at(boundary)
        if isinstance(found, tuple):
            raise _straddle(item, boundary, *found)
        return found

    token_spans = [(index(a), index(b)) for a, b in spans]
    return _assemble(item, lit.ids, token_spans, chat)


def try_render_batch(
    records: Sequence[CompletionRecord],
    chat: ChatFormat,
    *,
    enable_thinking: bool | None = None,
    mask_policy: MaskPolicy = "final_turn",
    special_scan: SpecialScan = "auto",
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[Tokenized | MaskingError]:
    """Render and encode many records with one batch call; a failing record yields its MaskingError.

    `enable_thinking` overrides each record's own setting when given. `special_scan="always"` sends
    every record through the literal-text path (slower; used to verify both paths agree).
    `template_kwargs` are further chat template variables (Qwen3.6's `preserve_thinking`).
    """
    kwargs = dict(template_kwargs or {})
    results: list[Tokenized | MaskingError | None] = [None] * len(records)
    fast: list[tuple[int, _Rendered]] = []
    literal: list[tuple[int, _Rendered]] = []
    for i, record in enumerate(records):
        try:
            item = _render_one(record, chat, enable_thinking, special_scan, kwargs)
        except MaskingError as err:
            results[i] = err
            continue
        (literal if item.literal else fast).append((i, item))

    if fast:
        _encode_fast_records(fast, chat, mask_policy, results)

    if literal:
        lit_encodings = encode_literal_batch(chat, [
            LiteralItem(it.dicts, it.tools, it.thinking, it.text, it.prompt_chars, it.template_kwargs)
            for _, it in literal
        ])
        for (i, item), lit in zip(literal, lit_encodings, strict=True):
            try:
                if isinstance(lit, str):
                    raise MaskingError(item.record.id, LITERAL_UNRESOLVED, lit)
                results[i] = _finish_literal(item, lit, chat, mask_policy)
            except MaskingError as err:
                results[i] = err
    done = [r for r in results if r is not None]
    assert len(done) == len(records), "every record yields a result or an error"
    return done


def render_batch(
    records: Sequence[CompletionRecord],
    chat: ChatFormat,
    *,
    enable_thinking: bool | None = None,
    mask_policy: MaskPolicy = "final_turn",
    special_scan: SpecialScan = "auto",
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[Tokenized]:
    """Like `try_render_batch`, raising the first record's MaskingError instead of returning it."""
    out: list[Tokenized] = []
    for result in try_render_batch(
        records, chat, enable_thinking=enable_thinking, mask_policy=mask_policy, special_scan=special_scan,
        template_kwargs=template_kwargs,
    ):
        if isinstance(result, MaskingError):
            raise result
        out.append(result)
    return out


def render(
    record: CompletionRecord,
    chat: ChatFormat,
    *,
    enable_thinking: bool | None = None,
    mask_policy: MaskPolicy = "final_turn",
    special_scan: SpecialScan = "auto",
    template_kwargs: Mapping[str, Any] | None = None,
) -> Tokenized:
    """Render mode for one record (see `try_render_batch`)."""
    return render_batch(
        [record], chat, enable_thinking=enable_thinking, mask_policy=mask_policy, special_scan=special_scan,
        template_kwargs=template_kwargs,
    )[0]
