"""Every hint a failed gate gives is applied as a user would, and must change the verdict.

Each case writes completions whose records fail for one reason, runs the stage, takes the setting the
error message offers, reruns with it, and checks that the stage then passes. Cases where a setting would
make things worse check that it is not offered.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflash_shared.errors import BadInputError
from dflash_shared.records import Message
from dflash_shared.storage import ObjectStore
from dflash_tokenize.config import TokenizeConfig
from dflash_tokenize.stage import run
from tests.support.qwen_assets import shared_tokenizer_dir
from tests.tokenize.stage_fixtures import completion, conversation, write_completions

HINT = re.compile(r"set --([a-z-]+) (\S+) / ")
LIMIT = re.compile(r"accept this share of unusable records: --max-bad-fraction (\S+) / ")


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return shared_tokenizer_dir("qwen3")


def config(src: str, out: str, tok: Path, **kw: Any) -> TokenizeConfig:
    kw.setdefault("heldout_fraction", 0)
    return TokenizeConfig(input=src, output=out, tokenizer=str(tok), workers=1, **kw)


def failure(cfg: TokenizeConfig, store: ObjectStore) -> str:
    with pytest.raises(BadInputError) as err:
        run(cfg, store)
    return str(err.value)


def typed(value: str) -> Any:
    """A flag's value as the config field takes it (the CLI does the same conversion)."""
    if value in ("true", "false"):
        return value == "true"
    return float(value) if "." in value else int(value)


def offered(message: str) -> dict[str, Any]:
    return {flag.replace("-", "_"): typed(value) for flag, value in HINT.findall(message)}


def without_thinking(i: int) -> list[Message]:
    return conversation(i, thinking=False)


def cut_off(i: int) -> Any:
    return completion(conversation(i), finish_reason="length")


def looping(i: int) -> list[Message]:
    return conversation(i, answer="the same sentence again and again. " * 40)


def terse(i: int) -> list[Message]:
    return conversation(i, answer="Ok.")


def long(i: int) -> list[Message]:
    return conversation(i, answer=" ".join(f"word{i}-{j}" for j in range(300)))


def as_record(make: Callable[[int], Any]) -> Callable[[int], Any]:
    def record(i: int) -> Any:
        made = make(i)
        return made if not isinstance(made, list) else completion(made)
    return record


# reason -> (records that fail for it, settings of the first run, the setting the hint must name)
CASES: dict[str, tuple[Callable[[int], Any], dict[str, Any], str]] = {
    "thinking_missing": (as_record(without_thinking), {}, "enable_thinking"),
    "template_not_prefix": (as_record(conversation), {"enable_thinking": False}, "enable_thinking"),
    "truncated": (as_record(cut_off), {}, "allow_truncated"),
    "repetitive": (as_record(looping), {}, "reject_repetitive"),
    "too_short": (as_record(terse), {}, "min_content_tokens"),
    "over_max_length": (as_record(long), {"max_length": 256, "over_length": "drop"}, "max_length"),
}


@pytest.mark.parametrize("reason", list(CASES))
def test_each_hint_changes_the_verdict(reason: str, tmp_path: Path, store: ObjectStore, tok_dir: Path) -> None:
    make, settings, field = CASES[reason]
    src = write_completions(store, str(tmp_path / "c"), [make(i) for i in range(10)])
    message = failure(config(src, str(tmp_path / "t1"), tok_dir, **settings), store)
    assert f"{reason}: 10 (100.0%)" in message
    hints = offered(message)
    assert field in hints, message
    assert "max_bad_fraction" not in hints  # every record is bad: accepting them is no way out
    run(config(src, str(tmp_path / "t2"), tok_dir, **{**settings, field: hints[field]}), store)


@pytest.mark.parametrize("thinking", [True, False])
def test_an_empty_answer_is_empty_in_every_thinking_mode(thinking: bool, tmp_path: Path, store: ObjectStore,
                                                         tok_dir: Path) -> None:
    records = [completion(conversation(i, thinking=False, answer="")) for i in range(10)]
    src = write_completions(store, str(tmp_path / "c"), records)
    message = failure(config(src, str(tmp_path / "t"), tok_dir, enable_thinking=thinking), store)
    assert "empty_response: 10" in message and "thinking_missing" not in message
    assert offered(message) == {}
    assert "No setting makes most of these records usable" in message


def test_a_setting_that_would_break_the_good_records_is_not_offered(tmp_path: Path, store: ObjectStore,
                                                                    tok_dir: Path) -> None:
    # 18 records that think and 2 that do not: thinking off would rescue the 2 and break the 18.
    records = [completion(conversation(i, thinking=i >= 2)) for i in range(20)]
    src = write_completions(store, str(tmp_path / "c"), records)
    message = failure(config(src, str(tmp_path / "t1"), tok_dir), store)
    assert "thinking_missing: 2 (10.0%)" in message
    assert "enable_thinking" not in offered(message), message
    # What is offered instead is the limit this input needs, and it passes.
    (limit,) = LIMIT.findall(message)
    assert limit == "0.10"
    run(config(src, str(tmp_path / "t2"), tok_dir, max_bad_fraction=float(limit)), store)


def test_the_issue_s_import_gets_the_right_reason_and_a_working_hint(tmp_path: Path, store: ObjectStore,
                                                                     tok_dir: Path) -> None:
    # Nine answers that think and one empty answer: the empty one is what is wrong, not the thinking mode.
    records = [completion(conversation(i)) for i in range(9)]
    records.append(completion(conversation(9, thinking=False, answer="")))
    src = write_completions(store, str(tmp_path / "c"), records)
    message = failure(config(src, str(tmp_path / "t1"), tok_dir), store)
    assert "empty_response: 1" in message and "thinking_missing" not in message
    assert "enable_thinking" not in message
    assert message.count("\n- ") == 1  # the one alternative, listed in full
    (limit,) = LIMIT.findall(message)
    run(config(src, str(tmp_path / "t2"), tok_dir, max_bad_fraction=float(limit)), store)
