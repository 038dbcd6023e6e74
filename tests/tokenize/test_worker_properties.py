"""The tokenize worker under hostile completions lines (hypothesis): a verdict for every line, never a crash.

Lines come from tests.support.noise: CompletionRecord-shaped records right or with one fault at any depth,
odd token ids, damaged bytes. Both parsers (token_exact's array path and render's whole-record path) must
agree on which lines are records, and `process_batch` in either mode must return a kept sequence or a
rejection for each line, on the real Qwen3 vocabulary.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash_shared.quality import MALFORMED, GateCounts, QualityPolicy
from dflash_tokenize import worker
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.fast_exact import parse_lines
from tests.support.noise import PROPERTY, noisy_lines, with_crashers
from tests.support.qwen_assets import shared_tokenizer_dir
from tests.tokenize.stage_fixtures import completion, conversation, engine_like

lines_of_a_batch = st.lists(noisy_lines("completions"), min_size=1, max_size=6)
BASE = {"id": "c", "messages": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}]}


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat.from_dir(shared_tokenizer_dir("qwen3"))


def numbered(lines: list[bytes]) -> list[tuple[str, bytes]]:
    return [(f"shard:{i + 1}", line) for i, line in enumerate(lines)]


def check_rejections(rejected: list[tuple[str, str, str]]) -> None:
    """Each rejection names its line and a reason; what the stage's gate keeps of it is printable."""
    gate = GateCounts(examples_per_reason=len(rejected))
    for where, reason, detail in rejected:
        assert where.startswith("shard:") and reason and isinstance(detail, str)
        gate.observe(where, reason, detail)
    assert all(example.isprintable() for examples in gate.examples.values() for example in examples)


@PROPERTY
@with_crashers(BASE, wrap=lambda line: [line], name="lines")
@given(lines=lines_of_a_batch)
def test_both_parsers_give_every_line_a_verdict_and_agree(lines: list[bytes]) -> None:
    batch = numbered(lines)
    fast, fast_rejected = parse_lines(batch)
    whole, whole_rejected = worker._parse(batch)
    for parsed, rejected in ((fast, fast_rejected), (whole, whole_rejected)):
        assert len(parsed) + len(rejected) == len(batch)
        assert {reason for _, reason, _ in rejected} <= {MALFORMED}
        check_rejections(rejected)
    assert [item.where for item in fast] == [item.where for item in whole]
    assert [item.full_record() for item in fast] == [item.record for item in whole]


@pytest.mark.parametrize("mode", ["render", "token_exact"])
def test_process_batch_gives_every_line_a_verdict(chat: ChatFormat, mode: str) -> None:
    settings = worker.WorkerSettings("unused", mode, "final_turn", True, 512, "truncate",  # type: ignore[arg-type]
                                     QualityPolicy(max_bad_fraction=1.0))
    worker.init_worker(settings, single_threaded=False, chat=chat)
    make = engine_like if mode == "token_exact" else (lambda _chat, messages: completion(messages))
    good = [json.dumps(make(chat, conversation(i)).model_dump(mode="json", exclude_none=True)).encode()
            for i in range(2)]

    @PROPERTY
    @given(noise=lines_of_a_batch, at=st.integers(0, 6))
    def run(noise: list[bytes], at: int) -> None:
        lines = [*noise[:at], *good, *noise[at:]]
        result = worker.process_batch(numbered(lines))
        assert len(result.sequences) + len(result.rejected) == len(lines)
        check_rejections(result.rejected)
        # The good records are kept, whatever the faulty ones beside them (token_exact's spot check included).
        first = min(at, len(noise))
        assert not {where for where, _, _ in result.rejected} & {f"shard:{first + 1 + k}" for k in range(len(good))}

    run()
