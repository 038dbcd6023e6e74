"""Loss-mask exactness on the real Qwen vocabularies, with the Qwen3 and the Qwen3.5/3.6 chat templates.

Expected ids are built independently of the code under test: a test lists the pieces the chat
template emits (control tokens by their published ids, text encoded by plain tiktoken over Qwen's rank
file) with the mask bit each piece must get, and the result must match token by token. Where the two
template families differ (the Qwen3.6 generation prompt opens the think block, its tool calls are
XML-style, every assistant turn after the last query shows a think block), `Case` says how.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

import pytest

from dflash_shared.records import CompletionRecord, Message, ToolCall, ToolCallFunction
from dflash_tokenize import masking
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.masking import MaskingError
from tests.support.chat_references import (
    PUBLISHED_IDS,
    C,
    expected_sequence,
    hf_tokenizer,
    qwen_chat,
)

IM_S, IM_E, THINK, THINK_END = C("<|im_start|>"), C("<|im_end|>"), C("<think>"), C("</think>")
TOOL_CALL, TOOL_CALL_END = C("<tool_call>"), C("</tool_call>")
TOOL_RESP, TOOL_RESP_END = C("<tool_response>"), C("</tool_response>")

Pieces = list[tuple[Any, int]]


@dataclass(frozen=True)
class Case:
    """A vocabulary with a chat template family, and the pieces that family emits."""

    vocab: str
    template: str

    def __str__(self) -> str:
        return f"{self.vocab}-ids-{self.template}-template"

    @property
    def chat(self) -> ChatFormat:
        return qwen_chat(self.vocab, self.template)

    @property
    def opens_think(self) -> bool:
        """Whether the generation prompt (thinking on) ends inside an opened think block."""
        return self.template == "qwen3_6"

    def final_think_answer(self, reasoning: str, answer: str) -> Pieces:
        """The final assistant turn with its think block, trained from the end of the generation prompt."""
        if self.opens_think:  # "<think>\n" belongs to the prompt, the engine never generated it
            think = [(THINK, 0), ("\n", 0), (f"{reasoning}\n", 1)]
        else:
            think = [(THINK, 1), (f"\n{reasoning}\n", 1)]
        return [(IM_S, 0), ("assistant\n", 0), *think, (THINK_END, 1), (f"\n\n{answer}", 1), (IM_E, 1), ("\n", 0)]

    def history_think(self, reasoning: str | None, bit: int) -> Pieces:
        """The think block of an earlier assistant turn after the last user query ([] when not shown)."""
        if reasoning is None and not self.opens_think:
            return []  # Qwen3 shows one only for the final turn or when there is reasoning
        return [(THINK, bit), (f"\n{reasoning or ''}\n", bit), (THINK_END, bit), ("\n\n", bit)]

    def tool_call(self, name: str, args: dict[str, Any] | str, bit: int) -> Pieces:
        if self.template == "qwen3":
            args_json = args if isinstance(args, str) else _json(args)
            body = f'\n{{"name": "{name}", "arguments": {args_json}}}\n'
        elif isinstance(args, str):
            body = f"\n<function={name}>\n{args}\n</function>\n"
        else:
            params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
            body = f"\n<function={name}>\n{params}</function>\n"
        return [(TOOL_CALL, bit), (body, bit), (TOOL_CALL_END, bit)]

    @property
    def call_separator(self) -> str:
        """What the template writes between an answer (or a previous call) and a tool call."""
        return "\n" if self.template == "qwen3" else "\n\n"


def _json(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)


# Each vocabulary with its own family's template, and the cross pairings (cheap: same assets).
NATIVE = [Case("qwen3", "qwen3"), Case("qwen3_6", "qwen3_6")]
CROSS = [Case("qwen3", "qwen3_6"), Case("qwen3_6", "qwen3")]
QWEN3_6_TEMPLATE = [Case("qwen3", "qwen3_6"), Case("qwen3_6", "qwen3_6")]


@pytest.fixture(scope="session", params=NATIVE + CROSS, ids=str)
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


@pytest.fixture(scope="session", params=NATIVE, ids=str)
def native(request: pytest.FixtureRequest) -> Case:
    return request.param


def _record(*messages: Message, rid: str = "rec-1", **kwargs: object) -> CompletionRecord:
    return CompletionRecord(id=rid, messages=messages, **kwargs)


def user_turn(text: str) -> Pieces:
    return [(IM_S, 0), (f"user\n{text}", 0), (IM_E, 0), ("\n", 0)]


def system_turn(text: str) -> Pieces:
    return [(IM_S, 0), (f"system\n{text}", 0), (IM_E, 0), ("\n", 0)]


def tool_turn(*results: str) -> Pieces:
    pieces: Pieces = [(IM_S, 0), ("user", 0)]
    for text in results:
        pieces += [("\n", 0), (TOOL_RESP, 0), (f"\n{text}\n", 0), (TOOL_RESP_END, 0)]
    return pieces + [(IM_E, 0), ("\n", 0)]


def history_answer(reasoning: str, answer: str, bit: int) -> Pieces:
    """An earlier assistant turn that shows its think block; `bit` is the mask of all after the header."""
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


def plain_answer(answer: str, bit: int = 1) -> Pieces:
    return [(IM_S, 0), ("assistant\n", 0), (answer, bit), (IM_E, bit), ("\n", 0)]


_CONTROL = re.compile("|".join(map(re.escape, sorted(PUBLISHED_IDS["qwen3"], key=len, reverse=True))))


def template_text(text: str, bit: int) -> Pieces:
    """Text the template writes itself, its control-token strings as control tokens."""
    pieces: Pieces = []
    pos = 0
    for m in _CONTROL.finditer(text):
        if m.start() > pos:
            pieces.append((text[pos : m.start()], bit))
        pieces.append((C(m.group(0)), bit))
        pos = m.end()
    if pos < len(text):
        pieces.append((text[pos:], bit))
    return pieces


def assert_matches(vocab: str, out: masking.Tokenized, pieces: Pieces, chat: ChatFormat | None = None) -> None:
    # The sequence ends at the final end-of-turn token: the template's trailing line break is dropped.
    assert pieces[-2:] == [(IM_E, 1), ("\n", 0)]
    ids, mask = expected_sequence(vocab, pieces[:-1])
    chat = chat or qwen_chat(vocab)
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


def _mask_diff(chat: ChatFormat, ids: list[int], got: list[int], want: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return f"mask differs at {at}: token {chat.decode(ids[at : at + 1])!r}, got {got[at : at + 3]}"


def masked_text(chat: ChatFormat, out: masking.Tokenized) -> str:
    return chat.decode([i for i, m in zip(out.input_ids, out.loss_mask, strict=True) if m])


def final_trained(case: Case, reasoning: str, answer: str) -> str:
    """What the loss covers of a final turn with a think block."""
    opened = "" if case.opens_think else "<think>\n"
    return f"{opened}{reasoning}\n</think>\n\n{answer}<|im_end|>"


SYSTEM = Message(role="system", content="You are a careful assistant.")


# ---- single turn -----------------------------------------------------------------------------------


def test_single_turn_thinking_on(case: Case) -> None:
    rec = _record(
        SYSTEM,
        Message(role="user", content="What is 2+2?"),
        Message(role="assistant", content="It is 4.", reasoning_content="Two plus two makes four."),
        enable_thinking=True,
    )
    out = masking.render(rec, case.chat)
    pieces = (
        system_turn(SYSTEM.content)
        + user_turn("What is 2+2?")
        + case.final_think_answer("Two plus two makes four.", "It is 4.")
    )
    assert_matches(case.vocab, out, pieces, case.chat)
    assert masked_text(case.chat, out) == final_trained(case, "Two plus two makes four.", "It is 4.")
    assert not out.literal_path


def test_single_turn_thinking_off(case: Case) -> None:
    rec = _record(Message(role="user", content="Name a colour."), Message(role="assistant", content="Blue."))
    out = masking.render(rec, case.chat, enable_thinking=False)
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
    assert_matches(case.vocab, out, pieces, case.chat)
    assert masked_text(case.chat, out) == "Blue.<|im_end|>"


@pytest.mark.parametrize("reasoning", ["", None], ids=["empty", "none"])
def test_empty_thinking_with_thinking_on(case: Case, reasoning: str | None) -> None:
    rec = _record(
        Message(role="user", content="Say hi."),
        Message(role="assistant", content="Hi!", reasoning_content=reasoning),
        enable_thinking=True,
    )
    out = masking.render(rec, case.chat)
    if case.opens_think:
        # The text holds "<think>\n\n</think>", whose "\n\n" is one token across the prompt's end; the
        # engine encodes its prompt on its own, so the sequence has the prompt's "\n", then the answer's.
        think = [(THINK, 0), ("\n", 0), ("\n", 1)]
    else:
        think = [(THINK, 1), ("\n\n", 1)]
    pieces = user_turn("Say hi.") + [
        (IM_S, 0), ("assistant\n", 0), *think, (THINK_END, 1), ("\n\nHi!", 1), (IM_E, 1), ("\n", 0),
    ]
    assert_matches(case.vocab, out, pieces, case.chat)
    assert masked_text(case.chat, out) == final_trained(case, "", "Hi!")


def test_inline_think_in_content_is_parsed(case: Case) -> None:
    rec = _record(
        Message(role="user", content="Why?"),
        Message(role="assistant", content="<think>\nBecause.\n</think>\n\nThat is why."),
    )
    out = masking.render(rec, case.chat)
    assert_matches(case.vocab, out, user_turn("Why?") + case.final_think_answer("Because.", "That is why."), case.chat)


# ---- multi-turn -----------------------------------------------------------------------------------

MULTI = (
    SYSTEM,
    Message(role="user", content="Pick a number."),
    Message(role="assistant", content="Seven.", reasoning_content="Any number will do."),
    Message(role="user", content="Double it."),
    Message(role="assistant", content="Fourteen.", reasoning_content="Seven times two."),
)


@pytest.mark.parametrize("policy", ["final_turn", "all_turns"])
def test_multi_turn(case: Case, policy: str) -> None:
    out = masking.render(_record(*MULTI), case.chat, enable_thinking=True, mask_policy=policy)
    history_bit = 1 if policy == "all_turns" else 0
    # The first answer came before the last user query: its reasoning is not rendered.
    pieces = (
        system_turn(SYSTEM.content)
        + user_turn("Pick a number.")
        + plain_answer("Seven.", history_bit)
        + user_turn("Double it.")
        + case.final_think_answer("Seven times two.", "Fourteen.")
    )
    assert_matches(case.vocab, out, pieces, case.chat)


@pytest.mark.parametrize("preserve", [True, False])
@pytest.mark.parametrize("policy", ["final_turn", "all_turns"])
def test_multi_turn_preserve_thinking(policy: str, preserve: bool) -> None:
    case = Case("qwen3_6", "qwen3_6")
    kwargs = {"preserve_thinking": preserve}
    out = masking.render(_record(*MULTI), case.chat, enable_thinking=True, mask_policy=policy, template_kwargs=kwargs)
    bit = 1 if policy == "all_turns" else 0
    # preserve_thinking keeps the reasoning of turns before the last query; without it, it is dropped.
    first = history_answer("Any number will do.", "Seven.", bit) if preserve else plain_answer("Seven.", bit)
    pieces = (
        system_turn(SYSTEM.content)
        + user_turn("Pick a number.")
        + first
        + user_turn("Double it.")
        + case.final_think_answer("Seven times two.", "Fourteen.")
    )
    assert_matches(case.vocab, out, pieces, case.chat)
    # The literal path renders with the same variables (else its second rendering would not line up).
    slow = masking.render(_record(*MULTI), case.chat, enable_thinking=True, mask_policy=policy,
                          template_kwargs=kwargs, special_scan="always")
    assert (slow.input_ids, slow.loss_mask) == (out.input_ids, out.loss_mask)
    # The Qwen3 template has no such variable: the same rendering either way.
    qwen3 = Case("qwen3_6", "qwen3").chat
    plain = masking.render(_record(*MULTI), qwen3, enable_thinking=True, mask_policy=policy)
    assert masking.render(_record(*MULTI), qwen3, enable_thinking=True, mask_policy=policy,
                          template_kwargs=kwargs) == plain


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


@pytest.mark.parametrize("policy", ["final_turn", "all_turns"])
def test_tool_calls_and_responses(case: Case, policy: str) -> None:
    out = masking.render(_record(*TOOLS_CONVO), case.chat, enable_thinking=True, mask_policy=policy)
    b = 1 if policy == "all_turns" else 0
    sep = case.call_separator
    pieces = system_turn(SYSTEM.content) + user_turn("Weather and time in Paris?")
    # Turns after the last user query keep their reasoning (Qwen3: an empty one shows no think block).
    pieces += [(IM_S, 0), ("assistant\n", 0), *case.history_think("I need two tools.", b)]
    pieces += case.tool_call("get_weather", {"city": "Paris"}, b) + [(sep, b)]
    pieces += case.tool_call("get_time", '{"tz": "CET"}', b) + [(IM_E, b), ("\n", 0)]
    pieces += tool_turn("18C, sunny", "14:05")
    pieces += [(IM_S, 0), ("assistant\n", 0), *case.history_think(None, b), (f"Let me also check tomorrow.{sep}", b)]
    pieces += case.tool_call("get_weather", {"city": "Paris"}, b) + [(IM_E, b), ("\n", 0)]
    pieces += tool_turn("20C")
    pieces += case.final_think_answer("Summarise.", "Sunny, 18C, 14:05; 20C tomorrow.")
    assert_matches(case.vocab, out, pieces, case.chat)


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.mark.parametrize("policy", ["final_turn", "all_turns"])
def test_tool_catalogue_and_final_tool_call(native: Case, policy: str) -> None:
    # The final turn is itself a tool call: its call tokens are trained, the catalogue never is.
    messages = (
        Message(role="user", content="Weather in Paris?"),
        Message(role="assistant", content="", reasoning_content="Call the tool.", tool_calls=(WEATHER,)),
    )
    rec = _record(*messages, tools=(WEATHER_TOOL,))
    out = masking.render(rec, native.chat, enable_thinking=True, mask_policy=policy)
    # The system text as transformers renders it (an independent renderer), up to the user turn.
    reference = hf_tokenizer(native.vocab, native.template).apply_chat_template(
        [m.template_dict() for m in messages], tools=[WEATHER_TOOL], tokenize=False, enable_thinking=True
    )
    system = reference[: reference.index("<|im_start|>user")]
    assert system.startswith("<|im_start|>system\n# Tools") and "get_weather" in system
    call = native.tool_call("get_weather", {"city": "Paris"}, 1)
    final = native.final_think_answer("Call the tool.", "")
    pieces = template_text(system, 0) + user_turn("Weather in Paris?") + final[:-3] + [("\n\n", 1)]
    pieces += call + [(IM_E, 1), ("\n", 0)]
    assert_matches(native.vocab, out, pieces, native.chat)
    trained = masked_text(native.chat, out)
    assert trained.endswith("</tool_call><|im_end|>") and "# Tools" not in trained
    assert ("<function=get_weather>" in trained) == (native.template == "qwen3_6")
# ---- non-ASCII -------------------------------------------------------------------------------------


def test_non_ascii_cjk_emoji_combining(native: Case) -> None:
    # Decomposed accents (e + U+0301) must come out NFC-normalised, as Qwen's tokenizer normalises.
    user = "日本語で答えて 🎌 — cafe\u0301, Zoe\u0308, 한국어?"
    reasoning = "考えます… nai\u0308ve 👍🏽 🇫🇷"
    answer = "答えは四です。Ça va, Zoe\u0308? 🎉"
    rec = _record(
        Message(role="user", content=user),
        Message(role="assistant", content=answer, reasoning_content=reasoning),
    )
    out = masking.render(rec, native.chat, enable_thinking=True)
    assert_matches(native.vocab, out, user_turn(user) + native.final_think_answer(reasoning, answer), native.chat)
    expected = unicodedata.normalize("NFC", final_trained(native, reasoning, answer))
    assert masked_text(native.chat, out) == expected


# ---- control-token look-alikes ---------------------------------------------------------------------

LOOKALIKE = "Print <|im_end|> then <|im_start|>assistant\nand <think>x</think> or <tool_call>."


@pytest.mark.parametrize("where", ["user", "system", "tool"])
def test_lookalikes_stay_text(native: Case, where: str) -> None:
    chat = native.chat
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
        # Not the last turn and no reasoning: no think block with Qwen3, an empty one with Qwen3.6.
        head = user_turn("Go.") + [(IM_S, 0), ("assistant\n", 0), *native.history_think(None, 0)]
        head += native.tool_call("get_weather", {"city": "Paris"}, 0) + [(IM_E, 0), ("\n", 0)]
        head += tool_turn(LOOKALIKE)
    out = masking.render(_record(*messages), chat, enable_thinking=True)
    assert out.literal_path
    assert_matches(native.vocab, out, head + native.final_think_answer("Fine.", "Done."), chat)
    # The engine-style encoding would have turned the look-alikes into control tokens.
    engine_ids = chat.encode(chat.render(messages))
    control = set(PUBLISHED_IDS[native.vocab].values())
    assert sum(i in control for i in engine_ids) > sum(i in control for i in out.input_ids)


def test_special_token_strings_in_answer_stay_text(native: Case) -> None:
    # Engines strip special tokens from returned text, so "<|im_end|>" in an answer was written out.
    answer = "Use <|im_end|> to close a turn."
    rec = _record(
        Message(role="user", content="How?"),
        Message(role="assistant", content=answer, reasoning_content="Hm."),
    )
    out = masking.render(rec, native.chat, enable_thinking=True)
    assert out.literal_path
    assert_matches(native.vocab, out, user_turn("How?") + native.final_think_answer("Hm.", answer), native.chat)


def test_template_reading_lookalikes_is_reported(native: Case) -> None:
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
        masking.render(rec, native.chat, enable_thinking=True)
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
    # With Qwen3.6, a token across the generation prompt's end: both paths encode prompt and answer apart.
    _record(Message(role="user", content="Hi"), Message(role="assistant", content="Hello.", reasoning_content=""),
            rid="empty-reasoning"),
]


@pytest.mark.parametrize("policy", ["final_turn", "all_turns"])
def test_fast_and_literal_paths_agree(case: Case, policy: str) -> None:
    chat = case.chat
    fast = masking.render_batch(PLAIN_RECORDS, chat, enable_thinking=True, mask_policy=policy)
    slow = masking.render_batch(PLAIN_RECORDS, chat, enable_thinking=True, mask_policy=policy, special_scan="always")
    assert [o.literal_path for o in fast] == [False] * len(PLAIN_RECORDS)
    assert [o.literal_path for o in slow] == [True] * len(PLAIN_RECORDS)
    for a, b in zip(fast, slow, strict=True):
        assert (a.input_ids, a.loss_mask, a.prompt_len) == (b.input_ids, b.loss_mask, b.prompt_len)


# ---- token_exact and render agree --------------------------------------------------------------------


def _engine_record(case: Case, messages: tuple[Message, ...], thinking: bool, **kwargs: Any) -> CompletionRecord:
    """A record as the generate stage writes it: ids from transformers' tokenizer, as an engine gets them.

    The completion is what the model generates after the prompt: with a template whose generation
    prompt opens the think block, the reasoning comes first and no <think> is generated.
    """
    hf = hf_tokenizer(case.vocab, case.template)
    dicts = [m.template_dict() for m in messages]
    prompt_ids = hf.apply_chat_template(
        dicts[:-1], add_generation_prompt=True, enable_thinking=thinking, tokenize=True, return_dict=False, **kwargs
    )
    final = messages[-1]
    text = final.content + "<|im_end|>"
    if thinking:
        text = f"{final.reasoning_content or ''}\n</think>\n\n{text}"
        if not case.opens_think:
            text = "<think>\n" + text
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
@pytest.mark.parametrize("convo", ["single", "multi", "tools", "non_ascii", "empty_reasoning"])
def test_token_exact_and_render_agree(case: Case, thinking: bool, convo: str) -> None:
    reasoning = ("" if convo == "empty_reasoning" else "Count.") if thinking else None
    final = Message(role="assistant", content="Answer: 4 ✓", reasoning_content=reasoning)
    messages = {
        "single": (SYSTEM, Message(role="user", content="2+2?"), final),
        "multi": (*MULTI[:-1], final),
        "tools": (*TOOLS_CONVO[:-1], final),
        "non_ascii": (Message(role="user", content="cafe\u0301 日本 🎌"), final),
        "empty_reasoning": (Message(role="user", content="2+2?"), final),
    }[convo]
    rec = _engine_record(case, messages, thinking)
    exact = masking.token_exact(rec)
    rendered = masking.render(rec, case.chat)  # also checks the prompt ids against the engine's
    assert exact.input_ids == rendered.input_ids
    assert exact.loss_mask == rendered.loss_mask
    assert exact.prompt_len == rendered.prompt_len == len(rec.prompt_token_ids)


@pytest.mark.parametrize("preserve", [True, False])
def test_token_exact_and_render_agree_with_preserve_thinking(preserve: bool) -> None:
    case = Case("qwen3_6", "qwen3_6")
    final = Message(role="assistant", content="Twenty-eight.", reasoning_content="Fourteen times two.")
    messages = (*MULTI, Message(role="user", content="Double it again."), final)
    rec = _engine_record(case, messages, True, preserve_thinking=preserve)
    kwargs = {"preserve_thinking": preserve}
    rendered = masking.render(rec, case.chat, template_kwargs=kwargs)
    exact = masking.token_exact(rec)
    assert (exact.input_ids, exact.loss_mask) == (rendered.input_ids, rendered.loss_mask)
    # Rendering with the other setting gives another prompt, which the engine's ids expose.
    with pytest.raises(MaskingError) as err:
        masking.render(rec, case.chat, template_kwargs={"preserve_thinking": not preserve})
    assert err.value.reason == masking.PROMPT_MISMATCH


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


def test_prompt_id_mismatch_names_record_and_position(native: Case) -> None:
    messages = (Message(role="user", content="Hello there"), Message(role="assistant", content="Hi"))
    rec = _engine_record(native, messages, thinking=False)
    ids = list(rec.prompt_token_ids)
    ids[4] = ids[4] + 1
    bad = rec.model_copy(update={"prompt_token_ids": tuple(ids), "id": "rec-drift"})
    with pytest.raises(MaskingError, match=r"rec-drift.*first at position 4") as err:
        masking.render(bad, native.chat)
    assert err.value.reason == masking.PROMPT_MISMATCH


def test_reasoning_with_thinking_off_is_not_a_prefix(native: Case) -> None:
    rec = _record(
        Message(role="user", content="Q"), Message(role="assistant", content="A", reasoning_content="R"), rid="rec-x"
    )
    with pytest.raises(MaskingError, match="rec-x") as err:
        masking.render(rec, native.chat, enable_thinking=False)
    assert err.value.reason == masking.NOT_PREFIX


def test_token_straddling_a_span_is_refused(native: Case) -> None:
    # A history answer starting with a line break merges with the header's "\n" into one token.
    rec = _record(
        Message(role="user", content="a"),
        Message(role="assistant", content="\nb"),
        Message(role="user", content="c"),
        Message(role="assistant", content="d"),
        rid="rec-straddle",
    )
    chat = native.chat
    assert masking.render(rec, chat, mask_policy="final_turn").num_loss_tokens > 0
    with pytest.raises(MaskingError, match="rec-straddle") as err:
        masking.render(rec, chat, mask_policy="all_turns")
    assert err.value.reason == masking.TOKEN_STRADDLES


def test_batch_returns_errors_in_place(native: Case) -> None:
    good = _record(Message(role="user", content="Q"), Message(role="assistant", content="A"), rid="good")
    no_answer = _record(Message(role="user", content="Q"), rid="no-answer")
    results = masking.try_render_batch([good, no_answer, good], native.chat, enable_thinking=True)
    assert isinstance(results[0], masking.Tokenized) and isinstance(results[2], masking.Tokenized)
    assert isinstance(results[1], MaskingError) and results[1].reason == masking.NO_FINAL_ASSISTANT
    assert results[0].input_ids == results[2].input_ids


def test_a_record_the_template_refuses_is_an_error_in_place(native: Case) -> None:
    # Real templates raise_exception on conversations they refuse (Qwen's "System message must be at the
    # beginning."): that record's MaskingError, never an exception that stops the batch.
    base = native.chat
    refusing = ChatFormat(
        base.tokenizer.to_str().encode(),
        "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be at the beginning.') }}{%- endif %}{%- endfor %}"
        + base.chat_template,
        base.template_tokens,
    )
    good = _record(Message(role="user", content="Q"), Message(role="assistant", content="A"), rid="good")
    late_system = _record(Message(role="user", content="Q"), Message(role="system", content="Be brief."),
                          Message(role="assistant", content="A"), rid="late-system")
    results = masking.try_render_batch([good, late_system, good], refusing, enable_thinking=True)
    assert isinstance(results[0], masking.Tokenized) and isinstance(results[2], masking.Tokenized)
    assert isinstance(results[1], MaskingError) and results[1].reason == masking.TEMPLATE_REFUSED
    assert "System message must be at the beginning." in str(results[1])
