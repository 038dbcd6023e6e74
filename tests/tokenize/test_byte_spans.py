"""Token positions from byte lengths: the same answers as the tokenizer's offsets, on the real Qwen vocabularies
(each with its own family's chat template)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dflash_shared.records import CompletionRecord, Message, ToolCall, ToolCallFunction
from dflash_tokenize import masking
from dflash_tokenize.byte_spans import BytePositions
from dflash_tokenize.chat import ChatFormat
from tests.support.qwen_assets import VOCABS, shared_tokenizer_dir

TEXTS = [
    "plain ASCII text, with  two spaces and\n\nline breaks\n",
    "日本語で答えて 🎌 — Ça va? 한국어 🇫🇷 👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nx\n</think>\n\ny<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module", params=VOCABS)
def chat(request: pytest.FixtureRequest) -> ChatFormat:
    return ChatFormat.from_dir(shared_tokenizer_dir(request.param))


def offsets_answer(chat: ChatFormat, text: str, char: int) -> int | None:
    """What the offsets path says: the token starting exactly at `char` (the count at the end), else None."""
    enc = chat.encode_batch([text])[0]
    if char >= len(text):
        return len(enc.ids)
    index = enc.char_to_token(char)
    if index is None:
        return None
    span = enc.token_to_chars(index)
    return index if span is not None and span[0] == char else None


@pytest.mark.parametrize("text", TEXTS)
def test_every_character_position_agrees_with_offsets(chat: ChatFormat, text: str) -> None:
    lengths = chat.token_byte_lengths
    assert lengths is not None, "Qwen's tokenizer is byte-level BPE"
    ids = chat.encode_batch_ids([text])[0]
    assert ids == chat.encode(text)
    positions = BytePositions(text, np.asarray(ids, dtype=np.int64), lengths)
    assert positions.valid
    got = [positions.token_at(c) for c in range(len(text) + 1)]
    assert got == [offsets_answer(chat, text, c) for c in range(len(text) + 1)]


def test_text_the_tokenizer_changed_is_not_vouched_for(chat: ChatFormat) -> None:
    lengths = chat.token_byte_lengths
    assert lengths is not None
    decomposed = "cafe\u0301"  # NFC turns e + U+0301 into one character: one byte fewer
    ids = chat.encode_batch_ids([decomposed])[0]
    assert not BytePositions(decomposed, np.asarray(ids, dtype=np.int64), lengths).valid


def records() -> list[CompletionRecord]:
    call = ToolCall(function=ToolCallFunction(name="weather", arguments={"city": "Zürich"}))
    return [
        CompletionRecord(id="single", messages=(Message(role="user", content="2+2?"),
                                                Message(role="assistant", content="4", reasoning_content="add"))),
        # Qwen3.6 template: "<think>\n" ends the prompt and "\n</think>" follows, one "\n\n" token in the
        # text's own encoding; the byte path re-encodes prompt and completion apart, without offsets.
        CompletionRecord(id="empty-reasoning", messages=(Message(role="user", content="Hi"),
                                                         Message(role="assistant", content="Hello.",
                                                                 reasoning_content=""))),
        CompletionRecord(id="multi", messages=(
            Message(role="system", content="Be brief."), Message(role="user", content="日本語?"),
            Message(role="assistant", content="はい 🎌"), Message(role="user", content="More"),
            Message(role="assistant", content="Ça va 👍🏽", reasoning_content="think\n\nmore"))),
        CompletionRecord(id="tools", messages=(
            Message(role="user", content="Weather?"), Message(role="assistant", content="", tool_calls=(call,)),
            Message(role="tool", content="18C"), Message(role="assistant", content="Sunny, 18C."))),
        CompletionRecord(id="non-nfc", messages=(Message(role="user", content="cafe\u0301"),
                                                 Message(role="assistant", content="Zoe\u0308"))),
        CompletionRecord(id="straddle", messages=(
            Message(role="user", content="a"), Message(role="assistant", content="\nb"),
            Message(role="user", content="c"), Message(role="assistant", content="d"))),
    ]


@pytest.mark.parametrize("policy", ["final_turn", "all_turns"])
def test_byte_path_and_offsets_path_give_the_same_results(chat: ChatFormat, policy: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    offsets_encoded: list[str] = []
    encode_batch = chat.encode_batch

    def counting(texts: Any) -> Any:
        offsets_encoded.extend(texts)
        return encode_batch(texts)

    monkeypatch.setattr(chat, "encode_batch", counting)
    assert chat.token_byte_lengths is not None  # built, so that even a small batch takes the byte path
    by_bytes = masking.try_render_batch(records(), chat, enable_thinking=True, mask_policy=policy)
    # Only the records the byte positions cannot vouch for went through the offsets path (as whole
    # renderings; a record may then be encoded again as prompt and completion).
    fell_back = {"non-nfc"} | ({"straddle"} if policy == "all_turns" else set())
    whole = [t for t in offsets_encoded if t.startswith("<|im_start|>") and t.endswith("<|im_end|>\n")]
    assert len(whole) == len(fell_back)

    monkeypatch.setitem(chat.__dict__, "token_byte_lengths", None)  # offsets for every record
    offsets_encoded.clear()
    by_offsets = masking.try_render_batch(records(), chat, enable_thinking=True, mask_policy=policy)
    whole = [t for t in offsets_encoded if t.startswith("<|im_start|>") and t.endswith("<|im_end|>\n")]
    # Qwen2.5's template renders no reasoning: the records that have some are refused before anything is encoded.
    refused = {r.record_id for r in by_offsets
               if isinstance(r, masking.MaskingError) and r.reason == masking.REASONING_DROPPED}
    assert refused == ({"single", "multi"} if chat.think_start_id is None else set())
    assert len(whole) == len(records()) - len(refused)
    for fast, slow in zip(by_bytes, by_offsets, strict=True):
        if isinstance(slow, masking.MaskingError):
            assert isinstance(fast, masking.MaskingError) and (fast.reason, str(fast)) == (slow.reason, str(slow))
        else:
            assert fast == slow
    assert sum(isinstance(r, masking.MaskingError) for r in by_bytes) == (policy == "all_turns") + len(refused)
