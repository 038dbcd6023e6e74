"""Prompt checks, rendering, reasoning split and record building, against the real Qwen tokenizer.

These run without vLLM or torch: they pin down what the engine wrapper does around the engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from dflash_generate.completion import (
    RenderedPrompt,
    build_outcome,
    check_length,
    check_prompt,
    completion_text,
    render_prompt,
    split_reasoning,
)
from dflash_generate.engine import EngineConfig
from dflash_generate.sampling import SamplingConfig, default_sampling, qwen_non_thinking, qwen_thinking
from dflash_shared.quality import THINKING_UNCLOSED, QualityPolicy, classify
from dflash_shared.records import Message, PromptRecord, ToolCall, ToolCallFunction, record_id
from tests.support.qwen_assets import qwen_special_ids

IDS = qwen_special_ids("qwen3")


def prompt(*messages: Message, tools: tuple[dict[str, Any], ...] | None = None) -> PromptRecord:
    return PromptRecord(id=record_id(messages, tools), messages=messages, tools=tools, source="unit:1",
                        source_id="conv-7")


def user(text: str) -> Message:
    return Message(role="user", content=text)


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


# --- prompt checks -------------------------------------------------------------------------------


def test_empty_prompts_are_refused_with_their_id() -> None:
    for record in (prompt(), prompt(user("")), prompt(Message(role="system", content="  \n"), user(" "))):
        outcome = check_prompt(record)
        assert outcome is not None and outcome.failure == "empty_prompt"
        assert record.id in (outcome.detail or "")


def test_tool_call_without_text_is_not_empty() -> None:
    call = ToolCall(function=ToolCallFunction(name="lookup", arguments={"q": "x"}))
    record = prompt(Message(role="assistant", tool_calls=(call,)), Message(role="tool", content=""))
    assert check_prompt(record) is None


def test_prompt_ending_with_assistant_is_invalid() -> None:
    outcome = check_prompt(prompt(user("hi"), Message(role="assistant", content="hello")))
    assert outcome is not None and outcome.failure == "invalid_prompt"


def test_render_matches_the_chat_template(tok: Any) -> None:
    record = prompt(Message(role="system", content="Be brief."), user("What is 2+2?"))
    for thinking in (True, False):
        rendered = render_prompt(tok, record, thinking)
        assert isinstance(rendered, RenderedPrompt)
        expected = tok.apply_chat_template(
            [m.template_dict() for m in record.messages],
            add_generation_prompt=True,
            enable_thinking=thinking,
            tokenize=True,
            return_dict=False,
        )
        assert rendered.token_ids == expected
        # Our Qwen3-style template lets the model open its own think block.
        assert not rendered.opens_thinking
    off = render_prompt(tok, record, False)
    assert isinstance(off, RenderedPrompt) and off.text.endswith("<think>\n\n</think>\n\n")


def test_tools_reach_the_template_and_the_record(tok: Any) -> None:
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}}
    weather = {"type": "function",
               "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": parameters}}
    record = prompt(user("Weather in Paris?"), tools=(weather,))
    rendered = render_prompt(tok, record, False)
    assert isinstance(rendered, RenderedPrompt)
    expected = tok.apply_chat_template([m.template_dict() for m in record.messages], tools=[weather],
                                       add_generation_prompt=True, enable_thinking=False, tokenize=False)
    assert rendered.text == expected and '"get_weather"' in rendered.text
    outcome = build_outcome(rendered, prompt_token_ids=rendered.token_ids, completion_token_ids=[1], text="x",
                            finish_reason="length", enable_thinking=False, sampling={})
    assert outcome.record is not None and outcome.record.tools == (weather,)


def test_template_error_is_a_record_failure(tmp_path: Path, qwen3_tokenizer_dir: Path) -> None:
    # A tokenizer without a chat template (a base model) cannot render any conversation.
    config = json.loads((qwen3_tokenizer_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (tmp_path / name).write_bytes((qwen3_tokenizer_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    bare = AutoTokenizer.from_pretrained(tmp_path)
    record = prompt(user("hi"))
    outcome = render_prompt(bare, record, True)
    assert not isinstance(outcome, RenderedPrompt)
    assert outcome.failure == "template_error" and record.id in (outcome.detail or "")


def test_length_limit_leaves_room_for_one_token(tok: Any) -> None:
    rendered = render_prompt(tok, prompt(user("count " * 50)), True)
    assert isinstance(rendered, RenderedPrompt)
    n = len(rendered.token_ids)
    assert check_length(rendered, n + 1) is None
    outcome = check_length(rendered, n)
    assert outcome is not None and outcome.failure == "prompt_too_long"
    assert str(n) in (outcome.detail or "")


# --- reasoning split -----------------------------------------------------------------------------


def test_split_thinking_off_keeps_everything_as_content() -> None:
    text = "<think>\nx\n</think>\n\nanswer"
    split = split_reasoning(text, enable_thinking=False, prompt_opens_thinking=False)
    assert (split.reasoning, split.content, split.closed) == (None, text, None)


def test_split_model_opened_and_closed() -> None:
    split = split_reasoning(
        "<think>\nStep 1.\nStep 2.\n</think>\n\nThe answer is 4.",
        enable_thinking=True,
        prompt_opens_thinking=False,
    )
    assert (split.reasoning, split.content, split.closed) == ("Step 1.\nStep 2.", "The answer is 4.", True)


def test_split_prompt_opened_block() -> None:
    closed = split_reasoning("\nhmm\n</think>\n\nok", enable_thinking=True, prompt_opens_thinking=True)
    assert (closed.reasoning, closed.content, closed.closed) == ("hmm", "ok", True)
    # Never closed: kept raw as content, the opening marker the prompt wrote put back in front.
    cut = split_reasoning("\nstill thinking when the", enable_thinking=True, prompt_opens_thinking=True)
    assert (cut.reasoning, cut.content, cut.closed) == (None, "<think>\nstill thinking when the", False)


def test_split_unclosed_model_block_is_kept_raw() -> None:
    split = split_reasoning("<think>\nlong thought", enable_thinking=True, prompt_opens_thinking=False)
    assert (split.reasoning, split.content, split.closed) == (None, "<think>\nlong thought", False)


@pytest.mark.parametrize(
    ("text", "opened_by_prompt"), [("<think>\nI was still going", False), ("\nI was still going", True)]
)
def test_unclosed_thinking_is_what_the_shared_gate_calls_unclosed(
    tok: Any, text: str, opened_by_prompt: bool
) -> None:
    record = prompt(user("Think hard."))
    rendered = render_prompt(tok, record, True)
    assert isinstance(rendered, RenderedPrompt)
    if opened_by_prompt:  # a Qwen3.5-style template ends the generation prompt inside the block
        rendered = RenderedPrompt(record, rendered.messages, rendered.text + "<think>\n", rendered.token_ids)
    ids = tok.encode(text, add_special_tokens=False)
    outcome = build_outcome(
        rendered, prompt_token_ids=rendered.token_ids, completion_token_ids=ids, text=text,
        finish_reason="length", enable_thinking=True, sampling={},
    )
    assert outcome.record is not None and outcome.thinking_closed is False
    answer = outcome.record.final_assistant
    assert answer.reasoning_content is None and answer.content.startswith("<think>")
    reason = classify(content=answer.content, reasoning=answer.reasoning_content, finish_reason="stop",
                      thinking_requested=True, content_tokens=len(ids), policy=QualityPolicy())
    assert reason == THINKING_UNCLOSED


def test_split_direct_answer_in_thinking_mode() -> None:
    split = split_reasoning("Just 4.", enable_thinking=True, prompt_opens_thinking=False)
    assert (split.reasoning, split.content, split.closed) == (None, "Just 4.", None)


def test_split_empty_reasoning_is_empty_not_none() -> None:
    split = split_reasoning("<think>\n\n</think>\n\nhi", enable_thinking=True, prompt_opens_thinking=False)
    assert (split.reasoning, split.content, split.closed) == ("", "hi", True)


# --- decoding and records ------------------------------------------------------------------------


def test_completion_text_drops_only_the_stop_token(tok: Any) -> None:
    body = tok.encode("<think>\nplan\n</think>\n\nDone.", add_special_tokens=False)
    assert IDS["think_start"] in body and IDS["think_end"] in body
    stopped = completion_text(tok, [*body, IDS["im_end"]], "stop", None)
    assert stopped == "<think>\nplan\n</think>\n\nDone."
    # A length cut keeps every token; special tokens inside the text stay visible.
    cut = completion_text(tok, [*body, IDS["im_start"]], "length", None)
    assert cut == "<think>\nplan\n</think>\n\nDone.<|im_start|>"
    assert tok.encode(cut, add_special_tokens=False) == [*body, IDS["im_start"]]


def test_build_outcome_fills_every_field(tok: Any) -> None:
    record = prompt(user("What is 2+2?"))
    rendered = render_prompt(tok, record, True)
    assert isinstance(rendered, RenderedPrompt)
    completion = [*tok.encode("<think>\nadd\n</think>\n\n4", add_special_tokens=False), IDS["im_end"]]
    sampling = qwen_thinking().as_record_dict()
    outcome = build_outcome(
        rendered,
        prompt_token_ids=rendered.token_ids,
        completion_token_ids=completion,
        text=completion_text(tok, completion, "stop", None),
        finish_reason="stop",
        enable_thinking=True,
        sampling=sampling,
    )
    assert outcome.ok and outcome.thinking_closed is True and outcome.failure is None
    rec = outcome.record
    assert rec is not None
    assert rec.id == record.id and rec.source == "unit:1"
    assert rec.source_id == "conv-7"  # the user's own id survives generation, to join results back
    assert rec.messages[:-1] == record.messages
    assert rec.final_assistant == Message(role="assistant", content="4", reasoning_content="add")
    assert rec.prompt_token_ids == tuple(rendered.token_ids)
    assert rec.completion_token_ids == tuple(completion)
    assert (rec.finish_reason, rec.enable_thinking, rec.sampling) == ("stop", True, sampling)
    # The canonical re-rendering of the record reproduces what the model produced.
    full = tok.apply_chat_template([m.template_dict() for m in rec.messages], tokenize=True, return_dict=False)
    assert full[: len(rendered.token_ids)] == rendered.token_ids
    assert full[len(rendered.token_ids) :][: len(completion)] == completion


# --- configuration -------------------------------------------------------------------------------


def test_sampling_defaults_follow_qwen() -> None:
    assert default_sampling(True) == qwen_thinking()
    assert default_sampling(False) == qwen_non_thinking()
    think, plain = qwen_thinking(), qwen_non_thinking()
    assert (think.temperature, think.top_p, think.top_k, think.min_p) == (0.6, 0.95, 20, 0.0)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p) == (0.7, 0.8, 20, 0.0)


def test_sampling_overrides_are_validated() -> None:
    assert qwen_thinking().with_overrides(max_tokens=8).max_tokens == 8
    with pytest.raises(ValueError, match="top_p"):
        qwen_thinking().with_overrides(top_p=1.5)
    with pytest.raises(ValueError, match="temprature"):
        SamplingConfig.model_validate({**qwen_thinking().model_dump(), "temprature": 1.0})


def test_record_seed_is_stable_and_per_record() -> None:
    seeded = qwen_thinking().with_overrides(seed=7)
    assert qwen_thinking().record_seed("a") is None
    assert seeded.record_seed("a") == seeded.record_seed("a")
    assert seeded.record_seed("a") != seeded.record_seed("b")
    assert seeded.record_seed("a") != seeded.with_overrides(seed=8).record_seed("a")
    assert 0 <= (seeded.record_seed("a") or 0) < 2**31


def test_engine_config_maps_to_llm_arguments() -> None:
    config = EngineConfig(model="/m", max_model_len=4096, tensor_parallel_size=2, max_num_seqs=64)
    kwargs = config.llm_kwargs()
    assert kwargs["model"] == "/m" and kwargs["max_model_len"] == 4096
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["max_num_seqs"] == 64
    assert kwargs["dtype"] == "bfloat16"
    assert "max_num_seqs" not in EngineConfig(model="/m", max_model_len=8).llm_kwargs()
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(model="/m", max_model_len=1)


def test_package_imports_without_vllm() -> None:
    code = (
        "import sys, dflash_generate.engine, dflash_generate.__main__; "
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
