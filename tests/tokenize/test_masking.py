"""Loss-mask exactness on the real Qwen vocabularies.

Expected ids are built independently of the code under test: a test lists the pieces the chat
template emits (control tokens by their published ids, text encoded by plain tiktoken over Qwen's rank
file) with the mask bit each piece must get, and the result must match token by token.
"""

from __future__ import annotations

import unicodedata

import pytest

from dflash_shared.records import CompletionRecord, Message, ToolCall, ToolCallFunction
from dflash_tokenize import masking
from dflash_tokenize.masking import MaskingError
from tests.support.chat_references import (
    PUBLISHED_IDS,
    C,
    expected_sequence,
    hf_tokenizer,
    qwen_chat,
)
from tests.support.qwen_assets import VOCABS

IM_S, IM_E, THINK, THINK_END = C("<|im_start|>"), C("<|im_end|>"), C("<think>"), C("</think>")
TOOL_CALL, TOOL_CALL_END = C("<tool_call>"), C("</tool_call>")
TOOL_RESP, TOOL_RESP_END = C("<tool_response>"), C("</tool_response>")


@pytest.fixture(scope="session", params=VOCABS)
def vocab(request: pytest.FixtureRequest) -> str:
    return request.param


def _record(*messages: Message, rid: str = "rec-1", **kwargs: object) -> CompletionRecord:
    return CompletionRecord(id=rid, messages=messages, **kwargs)


def user_turn(text: str) -> list:
    return [(IM_S, 0), (f"user\n{text}", 0), (IM_E, 0), ("\n", 0)]


def system_turn(text: str) -> list:
    return [(IM_S, 0), (f"system\n{text}", 0), (IM_E, 0), ("\n", 0)]


def thinking_answer(reasoning: str, answer: str, bit: int = 1) -> list:
    """An assistant turn that shows its think block; `bit` is the mask of everything after the header."""
    return [
        (IM_S, 0),
        ("assistant\n", 0),
        (THINK, bit),
        (f"\n{reasoning}\n", bit),
        (THINK_END, bit),
        (f"\n\n{answer}", bit),
        (IM_E, bit),
        ("\n", 0),
    ]


def plain_answer(answer: str, bit: int = 1) -> list:
    return [(IM_S, 0), ("assistant\n", 0), (answer, bit), (IM_E, bit), ("\n", 0)]


def assert_matches(vocab: str, out: masking.Tokenized, pieces: list) -> None:
    # The sequence ends at the final end-of-turn token: the template's trailing line break is dropped.
    assert pieces[-2:] == [(IM_E, 1), ("\n", 0)]
    ids, mask = expected_sequence(vocab, pieces[:-1])
    chat = qwen_chat(vocab)
    for pos, (got, want) in enumerate(zip(out.input_ids, ids, strict=False)):
        assert got == want, f"id {pos}: got {got} {chat.decode([got])!r}, want {want} {chat.decode([want])!r}"
    assert len(out.input_ids) == len(ids)
    assert out.loss_mask == mask, _mask_diff(chat, out.input_ids, out.loss_mask, mask)
    assert out.num_loss_tokens == sum(mask)
    # prompt_len is where the final turn's trained run starts.
    final_start = len(mask) - 1 - mask[::-1].index(1)
    while final_start > 0 and mask[final_start - 1]:
        final_start -= 1
    assert out.prompt_len == final_start


def _mask_diff(chat: object, ids: list[int], got: list[int], want: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return f"mask differs at {at}: token {chat.decode(ids[at : at + 1])!r}, got {got[at : at + 3]}"


def masked_text(vocab: str, out: masking.Tokenized) -> str:
    return qwen_chat(vocab).decode([i for i, m in zip(out.input_ids, out.loss_mask, strict=True) if m])


SYSTEM = Message(role="system", content="You are a careful assistant.")


# ---- single turn -----------------------------------------------------------------------------------


def test_single_turn_thinking_on(vocab: str) -> None:
    rec = _record(
        SYSTEM,
        Message(role="user", content="What is 2+2?"),
        Message(role="assistant", content="It is 4.", reasoning_content="Two plus two makes four."),
        enable_thinking=True,
    )
    out = masking.render(rec, qwen_chat(vocab))
    pieces = (
        system_turn(SYSTEM.content)
        + user_turn("What is 2+2?")
        + thinking_answer("Two plus two makes four.", "It is 4.")
    )
    assert_matches(vocab, out, pieces)
    assert masked_text(vocab, out) == "<think>\nTwo plus two makes four.\n</think>\n\nIt is 4.<|im_end|>"
    assert not out.literal_path


def test_single_turn_thinking_off(vocab: str) -> None:
    rec = _record(Message(role="user", content="Name a colour."), Message(role="assistant", content="Blue."))
    out = masking.render(rec, qwen_chat(vocab), enable_thinking=False)
    # The empty think block is part of the generation prompt, so it is never trained.
    pieces = user_turn("Name a colour.") + [
        (IM_S, 0),
        ("assistant\n", 0),
        (THINK, 0),
        ("\n\n", 0),
        (THINK_END, 0),
        ("\n\n", 0),
        ("Blue.", 1),
        (IM_E, 1),
        ("\n", 0),
    ]
    assert_matches(vocab, out, pieces)
    assert masked_text(vocab, out) == "Blue.<|im_end|>"


def test_empty_thinking_with_thinking_on(vocab: str) -> None:
    rec = _record(
        Message(role="user", content="Say hi."),
        Message(role="assistant", content="Hi!", reasoning_content=""),
        enable_thinking=True,
    )
    out = masking.render(rec, qwen_chat(vocab))
    pieces = user_turn("Say hi.") + [
        (IM_S, 0),
        ("assistant\n", 0),
        (THINK, 1),
        ("\n\n", 1),
        (THINK_END, 1),
        ("\n\nHi!", 1),
        (IM_E, 1),
        ("\n", 0),
    ]
    assert_matches(vocab, out, pieces)
    assert masked_text(vocab, out) == "<think>\n\n</think>\n\nHi!<|im_end|>"


def test_inline_think_in_content_is_parsed(vocab: str) -> None:
    rec = _record(
        Message(role="user", content="Why?"),
        Message(role="assistant", content="<think>\nBecause.\n</think>\n\nThat is why."),
    )
    out = masking.render(rec, qwen_chat(vocab))
    assert_matches(vocab, out, user_turn("Why?") + thinking_answer("Because.", "That is why."))


# ---- multi-turn -----------------------------------------------------------------------------------

MULTI = (
    SYSTEM,
    Message(role="user", content="Pick a number."),
    Message(role="assistant", content="Seven.", reasoning_content="Any number will do."),
    Message(role="user", content="Double it."),
    Message(role="assistant", content="Fourteen.", reasoning_content="Seven times two."),
)


@pytest.mark.parametrize("policy", ["final_turn", "all_turns"])
def test_multi_turn(vocab: str, policy: str) -> None:
    out = masking.render(_record(*MULTI), qwen_chat(vocab), enable_thinking=True, mask_policy=policy)
    history_bit = 1 if policy == "all_turns" else 0
    # The first answer came before the last user query: its reasoning is not rendered.
    pieces = (
        system_turn(SYSTEM.content)
        + user_turn("Pick a number.")
        + plain_answer("Seven.", history_bit)
        + user_turn("Double it.")
        + thinking_answer("Seven times two.", "Fourteen.")
    )
    assert_matches(vocab, out, pieces)


# ---- tools -----------------------------------------------------------------------------------------

WEATHER = ToolCall(id="call-1", function=ToolCallFunction(name="get_weather", arguments={"city": "Paris"}))
TIME = ToolCall(function=ToolCallFunction(name="get_time", arguments='{"tz": "CET"}'))
TOOLS_CONVO = (
    SYSTEM,
    Message(role="user", content="Weather and time in Paris?"),
    Message(role="assistant", content="", reasoning_content="I need two tools.", tool_calls=(WEATHER, TIME)),
    Message(role="tool", content="18C, sunny", tool_call_id="call-1"),
    Message(role="tool", content="14:05"),
    Message(role="assistant", content="Let me also check tomorrow.", tool_calls=(WEATHER,)),
    Message(role="tool", content="20C"),
    Message(role="assistant", content="Sunny, 18C, 14:05; 20C tomorrow.", reasoning_content="Summarise."),
)


def _tool_call_pieces(name: str, args_json: str, bit: int) -> list:
    return [(TOOL_CALL, bit), (f'\n{{"name": "{name}", "arguments": {args_json}}}\n', bit), (TOOL_CALL_END, bit)]


@pytest.mark.parametrize("policy", ["final_turn", "all_turns"])
def test_tool_calls_and_responses(vocab: str, policy: str) -> None:
    out = masking.render(_record(*TOOLS_CONVO), qwen_chat(vocab), enable_thinking=True, mask_policy=policy)
    b = 1 if policy == "all_turns" else 0
    pieces = system_turn(SYSTEM.content) + user_turn("Weather and time in Paris?")
    # Turns after the last user query keep their reasoning; an empty reasoning shows no think block.
    pieces += [(IM_S, 0), ("assistant\n", 0), (THINK, b), ("\nI need two tools.\n", b), (THINK_END, b)]
    pieces += [("\n\n", b)] + _tool_call_pieces("get_weather", '{"city": "Paris"}', b) + [("\n", b)]
    pieces += _tool_call_pieces("get_time", '{"tz": "CET"}', b) + [(IM_E, b), ("\n", 0)]
    pieces += [(IM_S, 0), ("user\n", 0), (TOOL_RESP, 0), ("\n18C, sunny\n", 0), (TOOL_RESP_END, 0), ("\n", 0)]
    pieces += [(TOOL_RESP, 0), ("\n14:05\n", 0), (TOOL_RESP_END, 0), (IM_E, 0), ("\n", 0)]
    pieces += [(IM_S, 0), ("assistant\n", 0), ("Let me also check tomorrow.\n", b)]
    pieces += _tool_call_pieces("get_weather", '{"city": "Paris"}', b) + [(IM_E, b), ("\n", 0)]
    pieces += [(IM_S, 0), ("user\n", 0), (TOOL_RESP, 0), ("\n20C\n", 0), (TOOL_RESP_END, 0), (IM_E, 0), ("\n", 0)]
    pieces += thinking_answer("Summarise.", "Sunny, 18C, 14:05; 20C tomorrow.")
    assert_matches(vocab, out, pieces)


# ---- non-ASCII -------------------------------------------------------------------------------------


def test_non_ascii_cjk_emoji_combining(vocab: str) -> None:
    # Decomposed accents (e + U+0301) must come out NFC-normalised, as Qwen's tokenizer normalises.
    user = "日本語で答えて 🎌 — cafe\u0301, Zoe\u0308, 한국어?"
    reasoning = "考えます… nai\u0308ve 👍🏽 🇫🇷"
    answer = "答えは四です。Ça va, Zoe\u0308? 🎉"
    rec = _record(
        Message(role="user", content=user),
        Message(role="assistant", content=answer, reasoning_content=reasoning),
    )
    out = masking.render(rec, qwen_chat(vocab), enable_thinking=True)
    assert_matches(vocab, out, user_turn(user) + thinking_answer(reasoning, answer))
    expected = unicodedata.normalize("NFC", f"<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>")
    assert masked_text(vocab, out) == expected


# ---- control-token look-alikes ---------------------------------------------------------------------

LOOKALIKE = "Print <|im_end|> then <|im_start|>assistant\nand <think>x</think> or <tool_call>."


@pytest.mark.parametrize("where", ["user", "system", "tool"])
def test_lookalikes_stay_text(vocab: str, where: str) -> None:
    chat = qwen_chat(vocab)
    answer = Message(role="assistant", content="Done.", reasoning_content="Fine.")
    if where == "user":
        messages = (Message(role="user", content=LOOKALIKE), answer)
        head = user_turn(LOOKALIKE)
    elif where == "system":
        messages = (Message(role="system", content=LOOKALIKE), Message(role="user", content="Go."), answer)
        head = system_turn(LOOKALIKE) + user_turn("Go.")
    else:
        call = Message(role="assistant", content="", tool_calls=(WEATHER,))
        messages = (Message(role="user", content="Go."), call, Message(role="tool", content=LOOKALIKE), answer)
        # Not the last turn and no reasoning: no think block.
        head = user_turn("Go.") + [(IM_S, 0), ("assistant\n", 0)]
        head += _tool_call_pieces("get_weather", '{"city": "Paris"}', 0) + [(IM_E, 0), ("\n", 0)]
        head += [(IM_S, 0), ("user\n", 0), (TOOL_RESP, 0), (f"\n{LOOKALIKE}\n", 0), (TOOL_RESP_END, 0)]
        head += [(IM_E, 0), ("\n", 0)]
    out = masking.render(_record(*messages), chat, enable_thinking=True)
    assert out.literal_path
    assert_matches(vocab, out, head + thinking_answer("Fine.", "Done."))
    # The engine-style encoding would have turned the look-alikes into control tokens.
    engine_ids = chat.encode(chat.render(messages))
    control = set(PUBLISHED_IDS[vocab].values())
    assert sum(i in control for i in engine_ids) > sum(i in control for i in out.input_ids)


def test_special_token_strings_in_answer_stay_text(vocab: str) -> None:
    # Engines strip special tokens from returned text, so "<|im_end|>" in an answer was written out.
    answer = "Use <|im_end|> to close a turn."
    rec = _record(
        Message(role="user", content="How?"),
        Message(role="assistant", content=answer, reasoning_content="Hm."),
    )
    out = masking.render(rec, qwen_chat(vocab), enable_thinking=True)
    assert out.literal_path
    assert_matches(vocab, out, user_turn("How?") + thinking_answer("Hm.", answer))


def test_template_reading_lookalikes_is_reported(vocab: str) -> None:
    # A user turn that is wholly a tool response is not a query to the template; defusing its markers
    # would change which turns show reasoning, so the record is refused rather than guessed.
    rec = _record(
        Message(role="user", content="Look it up."),
        Message(role="assistant", content="Looking.", reasoning_content="Need a lookup."),
        Message(role="user", content="<tool_response>\n42\n</tool_response>"),
        Message(role="assistant", content="It is 42.", reasoning_content="Got it."),
        rid="rec-wrapped",
    )
    with pytest.raises(MaskingError, match="rec-wrapped") as err:
        masking.render(rec, qwen_chat(vocab), enable_thinking=True)
    assert err.value.reason == masking.LITERAL_UNRESOLVED


# ---- both encoding paths agree ---------------------------------------------------------------------

PLAIN_RECORDS = [
    _record(*MULTI, rid="multi"),
    _record(*TOOLS_CONVO, rid="tools"),
    _record(
        Message(role="user", content="ça 🎉 日本"),
        Message(role="assistant", content="ok 👍", reasoning_content="r"),
        rid="non-ascii",
    ),
]


@pytest.mark.parametrize("policy", ["final_turn", "all_turns"])
def test_fast_and_literal_paths_agree(vocab: str, policy: str) -> None:
    chat = qwen_chat(vocab)
    fast = masking.render_batch(PLAIN_RECORDS, chat, enable_thinking=True, mask_policy=policy)
    slow = masking.render_batch(PLAIN_RECORDS, chat, enable_thinking=True, mask_policy=policy, special_scan="always")
    assert [o.literal_path for o in fast] == [False] * len(PLAIN_RECORDS)
    assert [o.literal_path for o in slow] == [True] * len(PLAIN_RECORDS)
    for a, b in zip(fast, slow, strict=True):
        assert (a.input_ids, a.loss_mask, a.prompt_len) == (b.input_ids, b.loss_mask, b.prompt_len)


# ---- token_exact and render agree --------------------------------------------------------------------


def _engine_record(vocab: str, messages: tuple[Message, ...], thinking: bool) -> CompletionRecord:
    """A record as the generate stage writes it: ids from transformers' tokenizer, as an engine gets them."""
    hf = hf_tokenizer(vocab)
    dicts = [m.template_dict() for m in messages]
    prompt_ids = hf.apply_chat_template(
        dicts[:-1], add_generation_prompt=True, enable_thinking=thinking, tokenize=True, return_dict=False
    )
    final = messages[-1]
    text = final.content + "<|im_end|>"
    if thinking:
        text = f"<think>\n{final.reasoning_content or ''}\n</think>\n\n{text}"
    completion_ids = hf.encode(text, add_special_tokens=False)
    return CompletionRecord(
        id="engine",
        messages=messages,
        prompt_token_ids=tuple(prompt_ids),
        completion_token_ids=tuple(completion_ids),
        enable_thinking=thinking,
        finish_reason="stop",
    )


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("convo", ["single", "multi", "tools", "non_ascii"])
def test_token_exact_and_render_agree(vocab: str, thinking: bool, convo: str) -> None:
    final = Message(role="assistant", content="Answer: 4 ✓", reasoning_content="Count." if thinking else None)
    messages = {
        "single": (SYSTEM, Message(role="user", content="2+2?"), final),
        "multi": (*MULTI[:-1], final),
        "tools": (*TOOLS_CONVO[:-1], final),
        "non_ascii": (Message(role="user", content="cafe\u0301 日本 🎌"), final),
    }[convo]
    rec = _engine_record(vocab, messages, thinking)
    exact = masking.token_exact(rec)
    rendered = masking.render(rec, qwen_chat(vocab))  # also checks the prompt ids against the engine's
    assert exact.input_ids == rendered.input_ids
    assert exact.loss_mask == rendered.loss_mask
    assert exact.prompt_len == rendered.prompt_len == len(rec.prompt_token_ids)


def test_token_exact_uses_engine_ids_verbatim() -> None:
    rec = _record(
        Message(role="user", content="x"),
        Message(role="assistant", content="y"),
        prompt_token_ids=(5, 6, 7),
        completion_token_ids=(8, 9),
    )
    out = masking.token_exact(rec)
    assert (out.input_ids, out.loss_mask) == ([5, 6, 7, 8, 9], [0, 0, 0, 1, 1])
    assert (out.prompt_len, out.num_loss_tokens) == (3, 2)
    with pytest.raises(MaskingError, match="rec-1") as err:
        masking.token_exact(_record(Message(role="user", content="x"), Message(role="assistant", content="y")))
    assert err.value.reason == masking.MISSING_TOKEN_IDS


# ---- errors name the record --------------------------------------------------------------------------


def test_prompt_id_mismatch_names_record_and_position(vocab: str) -> None:
    messages = (Message(role="user", content="Hello there"), Message(role="assistant", content="Hi"))
    rec = _engine_record(vocab, messages, thinking=False)
    ids = list(rec.prompt_token_ids)
    ids[4] = ids[4] + 1
    bad = rec.model_copy(update={"prompt_token_ids": tuple(ids), "id": "rec-drift"})
    with pytest.raises(MaskingError, match=r"rec-drift.*first at position 4") as err:
        masking.render(bad, qwen_chat(vocab))
    assert err.value.reason == masking.PROMPT_MISMATCH


def test_reasoning_with_thinking_off_is_not_a_prefix(vocab: str) -> None:
    rec = _record(
        Message(role="user", content="Q"), Message(role="assistant", content="A", reasoning_content="R"), rid="rec-x"
    )
    with pytest.raises(MaskingError, match="rec-x") as err:
        masking.render(rec, qwen_chat(vocab), enable_thinking=False)
    assert err.value.reason == masking.NOT_PREFIX


def test_token_straddling_a_span_is_refused(vocab: str) -> None:
    # A history answer starting with a line break merges with the header's "\n" into one token.
    rec = _record(
        Message(role="user", content="a"),
        Message(role="assistant", content="\nb"),
        Message(role="user", content="c"),
        Message(role="assistant", content="d"),
        rid="rec-straddle",
    )
    chat = qwen_chat(vocab)
    assert masking.render(rec, chat, mask_policy="final_turn").num_loss_tokens > 0
    with pytest.raises(MaskingError, match="rec-straddle") as err:
        masking.render(rec, chat, mask_policy="all_turns")
    assert err.value.reason == masking.TOKEN_STRADDLES


def test_batch_returns_errors_in_place(vocab: str) -> None:
    good = _record(Message(role="user", content="Q"), Message(role="assistant", content="A"), rid="good")
    no_answer = _record(Message(role="user", content="Q"), rid="no-answer")
    results = masking.try_render_batch([good, no_answer, good], qwen_chat(vocab), enable_thinking=True)
    assert isinstance(results[0], masking.Tokenized) and isinstance(results[2], masking.Tokenized)
    assert isinstance(results[1], MaskingError) and results[1].reason == masking.NO_FINAL_ASSISTANT
    assert results[0].input_ids == results[2].input_ids
