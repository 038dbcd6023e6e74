"""`bench/bench_quality.py --prompts FILE`: a bad prompts file is named by file and line, nothing is guessed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench():  # bench/ is not a package: load the script as a module (its heavy imports are inside functions)
    spec = importlib.util.spec_from_file_location("bench_quality", REPO / "bench" / "bench_quality.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are defined
    spec.loader.exec_module(module)
    return module


def test_prompts_are_read_as_conversations_without_the_answers(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "old answer"}]}) + "\n\n"
                    + json.dumps({"prompt": "why?"}) + "\n" + json.dumps({"prompt": "third"}) + "\n")
    assert _bench().prompts_from_file(path, 2) == [[{"role": "user", "content": "hi"}],
                                                   [{"role": "user", "content": "why?"}]]


@pytest.mark.parametrize(("content", "message"), [
    ('{"prompt": "a"}\n{"prompt": \n', "prompts.jsonl:2: not a JSON record"),
    ('{"text": "a"}\n', "prompts.jsonl:1: expected 'messages' or 'prompt'"),
    ('["a"]\n', "prompts.jsonl:1: expected a JSON object"),
    ("\n", "prompts.jsonl: no prompts"),
])
def test_a_bad_prompts_file_names_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        _bench().prompts_from_file(path, 10)
