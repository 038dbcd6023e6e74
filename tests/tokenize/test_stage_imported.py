"""One gate for every source: imported completions meet the quality gate exactly as generated ones do.

The path users take, on a local store: their JSONL goes through `import` (completions), then the tokenize
stage (render mode, thinking on, the real Qwen3 vocabulary). Each degenerate kind of answer must be counted
under its reason in the tokenized manifest, with the user's own file and line in the example, and a source
that says an answer stopped at its length limit (`finish_reason: "length"` at the top, on the final
message, in OpenAI's `choices`, or as "max_tokens") is truncated, never trained on. One import and one
tokenize run serve every test here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash_shared.importing import ImportSpec, run_import
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Accounting, Kind, Producer
from dflash_shared.storage import ObjectStore, join
from dflash_tokenize.config import TokenizeConfig
from dflash_tokenize.stage import run
from tests.support.qwen_assets import shared_tokenizer_dir


def record(i: int, answer: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"Question {i}: tell me about the number {i}."},
                         {"role": "assistant", "content": answer}], **extra}


def thought(answer: str) -> str:
    return f"<think>\nThe user asks about a number; say something true.\n</think>\n\n{answer}"


GOOD_ANSWER = thought("It is a whole number, neither very large nor very small, and it has a successor.")
LOOP = "the cat sat on the mat and " * 40
# Line number in the user's file -> (the record, the reason the gate must give it; None: kept).
SOURCE: dict[int, tuple[dict[str, Any], str | None]] = {
    1: (record(1, GOOD_ANSWER), None),
    2: (record(2, GOOD_ANSWER, finish_reason="stop"), None),
    3: (record(3, GOOD_ANSWER, finish_reason="length"), "truncated"),
    4: ({"messages": [*record(4, "")["messages"][:1],
                      {"role": "assistant", "content": GOOD_ANSWER, "finish_reason": "length"}]}, "truncated"),
    5: (record(5, GOOD_ANSWER, choices=[{"finish_reason": "length"}]), "truncated"),
    6: (record(6, GOOD_ANSWER, finish_reason="max_tokens"), "truncated"),
    7: (record(7, "<think>\nI was still thinking when the answer was cut"), "thinking_unclosed"),
    8: (record(8, "It is a whole number with a successor, said without any thinking first."), "thinking_missing"),
    9: (record(9, thought("")), "empty_response"),
    10: (record(10, thought("Ok.")), "too_short"),
    11: (record(11, thought(LOOP)), "repetitive"),
    12: (record(12, GOOD_ANSWER.replace("whole", "natural")), None),
}
REASONS = sorted({reason for _, reason in SOURCE.values() if reason})


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Accounting, str]:
    """(the tokenized manifest's accounting, the user's source file) after import and tokenize."""
    root = str(tmp_path_factory.mktemp("imported-gate"))
    store = ObjectStore()
    source = join(root, "external", "chats.jsonl")
    store.write_bytes(source, b"".join(json.dumps(obj).encode() + b"\n" for obj, _ in SOURCE.values()))
    completions = join(root, "completions")
    run_import(store, ImportSpec(kind=Kind.completions, source_prefix=join(root, "external"),
                                 output_prefix=completions, run_id="r"), Producer(stage="import"))
    tokenized = join(root, "tokenized")
    tokenizer: Path = shared_tokenizer_dir("qwen3")
    run(TokenizeConfig(input=completions, output=tokenized, tokenizer=str(tokenizer), workers=1,
                       heldout_fraction=0, max_bad_fraction=1.0), store)
    return load_manifest(store, tokenized, Kind.tokenized).manifest.accounting, source


def test_every_imported_record_is_accounted_for(imported: tuple[Accounting, str]) -> None:
    acc, _ = imported
    expected = {reason: sum(r == reason for _, r in SOURCE.values()) for reason in REASONS}
    assert acc.failures_by_reason == expected
    assert (acc.input_records, acc.succeeded) == (len(SOURCE), sum(r is None for _, r in SOURCE.values()))


@pytest.mark.parametrize("reason", REASONS)
def test_each_reason_names_the_users_file_and_line(imported: tuple[Accounting, str], reason: str) -> None:
    acc, source = imported
    lines = [line for line, (_, r) in SOURCE.items() if r == reason]
    examples = acc.examples[reason]
    assert len(examples) == len(lines)
    for line, example in zip(lines, examples, strict=True):
        assert f"(from {source}:{line})" in example and f": {reason}, " in example, example
