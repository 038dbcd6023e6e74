"""User prompt sets: one prompt a line in each benchmark's shape, rendered with the target's template, bad lines
counted by file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_shared.records import Message, record_id
from dflash_shared.storage import ObjectStore
from dflash_train.evaluate.config import EvaluateConfig
from dflash_train.evaluate.prompts import BAD_LINE, ChatRenderer, PromptSetSource, conversation, pick_prompts
from tests.evaluate import eval_fixtures as ef

USER = [Message(role="user", content="What is 2 + 2?")]


@pytest.mark.parametrize("line", [
    {"question": "What is 2 + 2?", "answer": "#### 4"},                       # GSM8K
    {"problem": "What is 2 + 2?", "solution": "4", "level": "Level 1"},       # MATH500
    {"task_id": "HumanEval/0", "prompt": "What is 2 + 2?", "entry_point": "f"},  # HumanEval
    {"question_id": 81, "category": "math", "turns": ["What is 2 + 2?", "And 3 + 3?"]},  # MT-Bench: first turn
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]},
])
def test_each_style_gives_one_user_turn(line: dict) -> None:
    assert conversation(line) == (USER, None)


def test_messages_keep_system_turns_and_tools() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    messages, got = conversation({"messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Add 2 and 2."}], "tools": tools})
    assert [m.role for m in messages] == ["system", "user"] and got == tuple(tools)


def test_bad_lines_are_counted_with_file_and_line(tmp_path: Path) -> None:
    lines = [json.dumps({"question": "What is 2 + 2?"}), "{not json", json.dumps(["a", "list"]),
             json.dumps({"turns": []}), json.dumps({"question": "  "}), json.dumps({"title": "no prompt"}),
             json.dumps({"messages": [{"role": "assistant", "content": "only an answer"}]}),
             json.dumps({"problem": "And 3 + 3?"})]
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n")
    source = PromptSetSource(ObjectStore(), "mixed", str(path), lambda messages, tools: [len(messages[-1].content)])
    picked, acc = pick_prompts(source, EvaluateConfig(drafter="d", prompts="p", target="t", output="o"))
    assert picked == [(record_id(USER), [14]), (record_id([Message(role="user", content="And 3 + 3?")]), [10])]
    assert [bad.split(": ", 1)[0] for bad in source.bad] == [f"{path}:{n}" for n in range(2, 8)]
    assert "none of 'messages', 'turns'" in source.bad[4]
    assert (acc.input_records, acc.succeeded, acc.failed, acc.failures_by_reason) == (8, 2, 6, {BAD_LINE: 6})


def test_prompts_are_rendered_with_the_target_template(tiny_target_dir: Path) -> None:
    """As the engine renders them: the chat template, thinking off, no added special tokens."""
    render = ChatRenderer(str(tiny_target_dir), enable_thinking=False)
    text = ef.question(3)
    assert render([Message(role="user", content=text)], None) == ef.chat_prompts(tiny_target_dir, [text])[0]


def test_set_names_must_make_metric_keys() -> None:
    assert EvaluateConfig(drafter="d", prompts="p", target="t", output="o",
                          prompt_sets={"gsm8k": "/a.jsonl", "mt-bench.v1": "s3://b/m.jsonl"}).prompt_sets
    with pytest.raises(ValueError, match="prompt set name 'gsm 8k'"):
        EvaluateConfig(drafter="d", prompts="p", target="t", output="o", prompt_sets={"gsm 8k": "/a.jsonl"})
