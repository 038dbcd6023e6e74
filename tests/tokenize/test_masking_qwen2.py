"""Loss masks on Qwen2.5's vocabulary and template, token by token: a family with no thinking mode.

Its template writes a default system prompt where a conversation has none, never a think block, and its
vocabulary has no think or tool-response tokens (they are plain text there); the loss still covers exactly the
assistant's tokens and its end of turn.
"""

from __future__ import annotations

import pytest

from dflash_shared.records import Message, ToolCall, ToolCallFunction
from dflash_tokenize import masking
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.masking import MaskingError
from tests.support.chat_references import C, qwen_chat
from tests.tokenize.test_masking import (
    IM_E,
    IM_S,
    Pieces,
    _record,
    assert_matches,
    masked_text,
    plain_answer,
    system_turn,
    user_turn,
)

DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
TOOL_CALL, TOOL_CALL_END = C("<tool_call>"), C("</tool_call>")
WEATHER = ToolCall(id="call-1", function=ToolCallFunction(name="get_weather", arguments={"city": "Paris"}))


def chat():  # type: ignore[no-untyped-def]
    return qwen_chat("qwen2", "qwen2")


@pytest.mark.parametrize("thinking", [None, True, False])
def test_a_single_turn_trains_the_answer_under_the_default_system_prompt(thinking: bool | None) -> None:
    """The template ignores enable_thinking: every mode renders and masks alike."""
    rec = _record(Message(role="user", content="Name a colour."), Message(role="assistant", content="Blue."))
    out = masking.render(rec, chat(), enable_thinking=thinking)
    pieces = system_turn(DEFAULT_SYSTEM) + user_turn("Name a colour.") + plain_answer("Blue.")
    assert_matches("qwen2", out, pieces, chat())


@pytest.mark.parametrize("policy", ["final_turn", "all_turns"])
def test_tool_calls_and_their_results_are_masked_as_the_template_writes_them(policy: str) -> None:
    rec = _record(
        Message(role="system", content="Be brief."),
        Message(role="user", content="Weather in Paris?"),
        Message(role="assistant", content="Checking.", tool_calls=(WEATHER,)),
        Message(role="tool", content="18C", tool_call_id="call-1"),
        Message(role="assistant", content="18C in Paris."),
    )
    out = masking.render(rec, chat(), mask_policy=policy)
    b = 1 if policy == "all_turns" else 0
    call = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    pieces: Pieces = system_turn("Be brief.") + user_turn("Weather in Paris?")
    pieces += [(IM_S, 0), ("assistant\n", 0), ("Checking.\n", b), (TOOL_CALL, b), (call, b), (TOOL_CALL_END, b),
               (IM_E, b), ("\n", 0)]
    # <tool_response> is text in Qwen2.5's vocabulary.
    pieces += [(IM_S, 0), ("user\n<tool_response>\n18C\n</tool_response>", 0), (IM_E, 0), ("\n", 0)]
    pieces += plain_answer("18C in Paris.")
    assert_matches("qwen2", out, pieces, chat())


def test_an_answer_with_reasoning_is_refused_by_name() -> None:
    """The template drops reasoning, so a record that has some cannot be trained as it was said: an error naming
    it (the stage counts it and its hints name the thinking mode), never a silently shortened answer."""
    rec = _record(Message(role="user", content="Q"), Message(role="assistant", content="A", reasoning_content="R"),
                  rid="rec-reasoned")
    for thinking in (None, False):
        with pytest.raises(MaskingError, match="rec-reasoned: the chat template does not render") as err:
            masking.render(rec, chat(), enable_thinking=thinking)
        assert err.value.reason == masking.REASONING_DROPPED
    # Where the template renders it (Qwen3, thinking on), the same record trains, reasoning included.
    trained = masking.render(rec, qwen_chat("qwen3"), enable_thinking=True)
    assert masked_text(qwen_chat("qwen3"), trained) == "<think>\nR\n</think>\n\nA<|im_end|>"


def test_an_inline_think_block_the_template_cuts_is_refused_by_name() -> None:
    """A template that cuts an inline think block from the final turn (as thinking models built on Qwen2, such as QwQ,
    do: `content.split('</think>')[-1]`) would train the answer alone; Qwen2.5's, which renders the content as it is,
    keeps the block as text and trains it."""
    rec = _record(Message(role="user", content="Q"),
                  Message(role="assistant", content="<think>\nStep by step.\n</think>\n\nA"), rid="rec-inline")
    base = chat()
    cutting = ChatFormat(
        base.tokenizer.to_str().encode(),
        "{%- for m in messages %}{{- '<|im_start|>' ~ m.role ~ '\\n' -}}"
        "{{- (m.content.split('</think>')[-1].lstrip('\\n') if m.role == 'assistant' else m.content) -}}"
        "{{- '<|im_end|>\\n' -}}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' -}}{%- endif %}",
    )
    with pytest.raises(MaskingError, match="rec-inline: the chat template does not render") as err:
        masking.render(rec, cutting)
    assert err.value.reason == masking.REASONING_DROPPED
    kept = masking.render(rec, base)
    assert masked_text(base, kept) == "<think>\nStep by step.\n</think>\n\nA<|im_end|>"
