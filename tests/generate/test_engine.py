"""The vLLM engine wrapper against a real vLLM engine (CPU build) and each tiny random target.

The dense Qwen3 and the hybrid Qwen3.6 layout (Gated DeltaNet + gated attention, VL checkpoint with MTP
weights, a template whose generation prompt opens the think block). The session's engine of each
architecture (tests/generate/conftest.py) serves the module: starting one takes tens of seconds. The
expectations come from the tokenizer directory through transformers (chat template rendering, decoding),
independent of vLLM.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("vllm", reason="engine tests need the generate environment (.venv-generate)")


from dflash_generate.completion import RenderedPrompt, render_prompt  # noqa: E402
from dflash_generate.engine import VllmEngine  # noqa: E402
from dflash_generate.sampling import qwen_non_thinking, qwen_thinking  # noqa: E402
from dflash_shared.records import (  # noqa: E402
    CompletionRecord,
    Message,
    PromptRecord,
    ToolCall,
    ToolCallFunction,
    record_id,
)
from tests.generate.stage_support import MAX_MODEL_LEN, ONE_ARCH  # noqa: E402
from tests.support.qwen_assets import qwen_special_ids  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
# What the generation prompt of each architecture's template ends with in thinking mode: Qwen3.6's opens
# the think block itself, Qwen3's leaves it to the model.
OPENED = {"qwen3": "", "qwen3_6": "<think>\n"}


def prompt(*messages: Message) -> PromptRecord:
    return PromptRecord(id=record_id(messages), messages=messages, source="test")


def user(text: str) -> Message:
    return Message(role="user", content=text)


PROMPTS = [
    prompt(user("What is 2 + 2?")),
    prompt(Message(role="system", content="Answer in French."), user("Name a colour.")),
    prompt(
        user("Hi!"),
        Message(role="assistant", content="Hello.", reasoning_content="Greet back."),
        user("Écris un haïku sur la mer 🌊, s'il te plaît."),
    ),
    prompt(
        user("Weather in Paris?"),
        Message(
            role="assistant",
            tool_calls=(ToolCall(function=ToolCallFunction(name="weather", arguments={"city": "Paris"})),),
        ),
        Message(role="tool", content='{"temp_c": 11}'),
    ),
    prompt(user("用一句话解释光合作用。")),
]


@pytest.fixture(scope="module")
def stop_ids(target_arch: str) -> set[int]:
    ids = qwen_special_ids(target_arch)  # type: ignore[arg-type]
    return {ids["im_end"], ids["endoftext"]}


def expected_prompt_ids(hf_tok: Any, record: PromptRecord, thinking: bool) -> list[int]:
    return list(
        hf_tok.apply_chat_template(
            [m.template_dict() for m in record.messages],
            add_generation_prompt=True,
            enable_thinking=thinking,
            tokenize=True,
            return_dict=False,
        )
    )


def raw_text(hf_tok: Any, rec: CompletionRecord) -> str:
    """The completion decoded independently: every token but the end-of-turn the engine stopped on."""
    ids = list(rec.completion_token_ids or ())
    if rec.finish_reason == "stop":
        assert hf_tok.convert_ids_to_tokens(ids[-1]) in ("<|im_end|>", "<|endoftext|>")
        ids = ids[:-1]
    return str(hf_tok.decode(ids, skip_special_tokens=False))


def check_common(
    hf_tok: Any, prompts: list[PromptRecord], outcomes: list[Any], thinking: bool, max_tokens: int
) -> None:
    assert [o.prompt_id for o in outcomes] == [p.id for p in prompts]
    for p, outcome in zip(prompts, outcomes, strict=True):
        assert outcome.ok, outcome.detail
        rec = outcome.record
        assert rec.id == p.id and rec.messages[:-1] == p.messages and rec.source == p.source
        assert rec.final_assistant.role == "assistant"
        assert list(rec.prompt_token_ids) == expected_prompt_ids(hf_tok, p, thinking)
        assert rec.enable_thinking is thinking
        assert rec.finish_reason in ("stop", "length")
        n = len(rec.completion_token_ids)
        assert 1 <= n <= max_tokens
        assert rec.finish_reason == "stop" or n == max_tokens


def test_thinking_off(engine: VllmEngine, hf_tok: Any) -> None:
    sampling = qwen_non_thinking().with_overrides(max_tokens=24, seed=3)
    outcomes = engine.generate(PROMPTS, enable_thinking=False, sampling=sampling)
    check_common(hf_tok, PROMPTS, outcomes, thinking=False, max_tokens=24)
    for outcome in outcomes:
        rec = outcome.record
        assert rec.sampling == sampling.model_dump(mode="json")
        assert rec.final_assistant.reasoning_content is None and outcome.thinking_closed is None
        assert rec.final_assistant.content == raw_text(hf_tok, rec)
        # The prompt already carries the empty think block that switches thinking off.
        assert hf_tok.decode(list(rec.prompt_token_ids[-5:])).endswith("<think>\n\n</think>\n\n")
    # A random model must not end its turn at once, or these tests would check empty strings.
    assert sum(len(o.record.final_assistant.content) for o in outcomes) > 0


def test_thinking_on(engine: VllmEngine, hf_tok: Any, target_arch: str) -> None:
    sampling = qwen_thinking().with_overrides(max_tokens=24)
    outcomes = engine.generate(PROMPTS, enable_thinking=True, sampling=sampling)
    check_common(hf_tok, PROMPTS, outcomes, thinking=True, max_tokens=24)
    opened = OPENED[target_arch]
    for p, outcome in zip(PROMPTS, outcomes, strict=True):
        rec = outcome.record
        assert rec.sampling == sampling.model_dump(mode="json")
        msg, text = rec.final_assistant, raw_text(hf_tok, rec)
        if opened:  # the prompt opened the block: the model writes inside it
            assert outcome.thinking_closed is not None
        if not outcome.thinking_closed:  # no think block, or one never closed: the raw text is the content
            assert msg.reasoning_content is None
            # A block the prompt opened and the model never closed keeps its opening marker.
            assert msg.content == (opened.rstrip("\n") + text if opened else text)
            assert outcome.thinking_closed is None or msg.content.lstrip().startswith("<think>")
        else:
            head = r"\n*" if opened else r"\s*<think>\n*"
            pattern = head + re.escape(msg.reasoning_content or "") + r"\n*</think>\n*"
            assert re.fullmatch(pattern + re.escape(msg.content), text), text
        # Thinking on differs from off only in the think block: Qwen3's on-prompt leaves it to the model,
        # Qwen3.6's opens it; off pre-fills an empty one.
        on_text = hf_tok.decode(list(rec.prompt_token_ids))
        off_text = hf_tok.decode(expected_prompt_ids(hf_tok, p, False))
        assert on_text.endswith("<|im_start|>assistant\n" + opened)
        assert off_text == on_text.removesuffix(opened) + "<think>\n\n</think>\n\n"


@ONE_ARCH
def test_failures_are_counted_and_others_unaffected(engine: VllmEngine) -> None:
    too_long = prompt(user("lorem ipsum " * MAX_MODEL_LEN))
    batch = [
        PROMPTS[0],
        prompt(),
        too_long,
        PROMPTS[1],
        prompt(user("   ")),
        prompt(user("hi"), Message(role="assistant", content="hello")),
    ]
    sampling = qwen_thinking().with_overrides(max_tokens=8, seed=11)
    outcomes = engine.generate(batch, enable_thinking=True, sampling=sampling)
    assert [o.failure for o in outcomes] == [
        None,
        "empty_prompt",
        "prompt_too_long",
        None,
        "empty_prompt",
        "invalid_prompt",
    ]
    assert too_long.id in (outcomes[2].detail or "")
    # The good records come out exactly as when run without the failing ones.
    alone = engine.generate([PROMPTS[0], PROMPTS[1]], enable_thinking=True, sampling=sampling)
    assert [o.record for o in alone] == [outcomes[0].record, outcomes[3].record]


@ONE_ARCH
def test_engine_rejection_is_isolated_to_its_record(engine: VllmEngine) -> None:
    sampling = qwen_thinking().with_overrides(max_tokens=4)
    rendered = [engine.prepare(p, True) for p in PROMPTS[:3]]
    long_record = prompt(user("overflow " * MAX_MODEL_LEN))
    long_rendered = render_prompt(engine.tokenizer, long_record, True)
    assert all(isinstance(r, RenderedPrompt) for r in [*rendered, long_rendered])
    # Skip the local length check, so the engine itself must refuse this one.
    items = list(enumerate([rendered[0], rendered[1], long_rendered, rendered[2]]))
    results = dict(engine.stream_rendered(items, True, sampling))  # type: ignore[arg-type]
    assert sorted(results) == [0, 1, 2, 3]
    assert results[2].failure == "engine_error" and results[2].prompt_id == long_record.id
    assert re.search("maximum (context|model) length", results[2].detail or ""), results[2].detail
    assert all(results[i].ok for i in (0, 1, 3))
    # The engine keeps serving after the rejection.
    assert engine.generate([PROMPTS[0]], enable_thinking=False, sampling=sampling)[0].ok


@ONE_ARCH
def test_stream_keeps_at_most_max_inflight_requests(engine: VllmEngine) -> None:
    sampling = qwen_non_thinking().with_overrides(max_tokens=6, seed=5)
    keys = [f"k{i}" for i in range(12)]
    requests = ((key, PROMPTS[i % len(PROMPTS)]) for i, key in enumerate(keys))
    seen: list[str] = []
    for key, outcome in engine.stream(requests, False, sampling, max_inflight=3):
        assert outcome.ok
        seen.append(key)
        assert engine._llm.llm_engine.get_num_unfinished_requests() <= 3  # noqa: SLF001
    assert sorted(seen) == sorted(keys)
    # A consumer that stops early leaves nothing running in the engine.
    stream = engine.stream(((k, PROMPTS[0]) for k in keys), False, sampling, max_inflight=4)
    next(stream)
    stream.close()
    assert engine._llm.llm_engine.get_num_unfinished_requests() == 0  # noqa: SLF001


def test_max_tokens_one_gives_single_token_outputs(engine: VllmEngine, hf_tok: Any, stop_ids: set[int]) -> None:
    sampling = qwen_non_thinking().with_overrides(max_tokens=1)
    outcomes = engine.generate(PROMPTS, enable_thinking=False, sampling=sampling)
    for outcome in outcomes:
        rec = outcome.record
        assert len(rec.completion_token_ids) == 1
        token = rec.completion_token_ids[0]
        if token in stop_ids:
            assert rec.finish_reason == "stop" and rec.final_assistant.content == ""
        else:
            assert rec.finish_reason == "length"
            assert rec.final_assistant.content == hf_tok.decode([token], skip_special_tokens=False)
        assert len(rec.final_assistant.content) <= 32


def test_engine_runs_the_target_as_its_architecture_needs(engine: VllmEngine, target_arch: str) -> None:
    """The hybrid VL target on CPU: bf16, no prefix caching, text only, from its config.json; the dense one as asked.

    That the hybrid engine started at all says vLLM skipped the checkpoint's `mtp.*` and vision weights.
    """
    hybrid = target_arch == "qwen3_6"
    assert engine.target.hybrid is hybrid
    assert engine.target.family == ("qwen3_5" if hybrid else "qwen3")
    assert engine.config.dtype == "bfloat16"
    assert engine.config.enable_prefix_caching is (False if hybrid else None)
    assert engine.config.language_model_only is hybrid  # the VL checkpoint runs as a text model
    if hybrid:  # what the engine runs with, not only what it was asked
        assert engine._llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False  # noqa: SLF001
