"""The array paths give the per-record paths' verdicts and sequences, line for line, on the real Qwen vocabulary.

token_exact: `fast_exact` against whole-record pydantic validation plus `masking.token_exact` (the path it
replaces), on good records and on every kind of odd id list. render: the worker's numpy-built loss mask
against the mask masking builds, for both mask policies.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import orjson
import pytest
from pydantic import ValidationError

from dflash_shared.quality import MALFORMED, QualityPolicy
from dflash_shared.records import CompletionRecord, Message
from dflash_tokenize import worker
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.fast_exact import ExactIds, malformed_detail, parse_lines, tokenize_exact
from dflash_tokenize.masking import MaskingError, Tokenized, token_exact, try_render_batch
from tests.tokenize.stage_fixtures import completion, conversation, engine_like


def line(record: CompletionRecord, **changes: object) -> bytes:
    data = record.model_dump(mode="json", exclude_none=True)
    data.update(changes)
    return json.dumps(data).encode()


def per_record(lines: list[tuple[str, bytes]], chat: ChatFormat, verify: int) -> tuple[list, list, list]:
    """The path fast_exact replaces: whole-record validation, token_exact, the same spot check."""
    parsed, rejected = [], []
    for where, raw in lines:
        try:
            parsed.append((where, CompletionRecord.model_validate(orjson.loads(raw))))
        except (orjson.JSONDecodeError, ValidationError) as err:
            rejected.append((where, MALFORMED, malformed_detail(err, raw)))
    out: list[Tokenized | MaskingError] = []
    for _, record in parsed:
        try:
            out.append(token_exact(record))
        except MaskingError as err:
            out.append(err)
    sample = [r for (_, r), t in zip(parsed, out, strict=True) if isinstance(t, Tokenized)][:verify]
    for checked in try_render_batch(sample, chat, enable_thinking=True, mask_policy="final_turn"):
        if isinstance(checked, MaskingError):
            out[next(i for i, (_, r) in enumerate(parsed) if r.id == checked.record_id)] = checked
    return parsed, out, rejected


def odd_lines(chat: ChatFormat) -> list[bytes]:
    good = [engine_like(chat, conversation(i)) for i in range(24)]
    prompt = list(good[0].prompt_token_ids or ())
    completion_ids = list(good[0].completion_token_ids or ())
    return [
        line(good[0], prompt_token_ids=prompt[:5] + [7] + prompt[6:]),  # spot check: not what the template gives
        line(good[1]),
        b"{this is not json",
        b"[1, 2, 3]",
        b'{"id": "x", "messages": "not a list"}',
        line(good[2], prompt_token_ids=[float(x) for x in prompt]),  # pydantic takes 1.0 as 1
        line(good[3], prompt_token_ids=[str(x) for x in prompt]),  # and "12" as 12
        line(good[4], prompt_token_ids=prompt[:-1] + [1.5]),  # but not 1.5
        line(good[5], completion_token_ids=completion_ids[:3] + [True] + completion_ids[4:]),  # True is 1
        line(good[6], prompt_token_ids=[True, False]),
        line(good[7], completion_token_ids=None),
        line(good[8], prompt_token_ids=None, completion_token_ids=["x"]),
        line(good[9], prompt_token_ids=None, completion_token_ids=[1.0]),
        line(good[10], surplus=1),
        line(good[11], prompt_token_ids=[]),
        line(good[12], completion_token_ids=[]),
        line(good[13], prompt_token_ids=[[1, 2]]),
        line(good[14], prompt_token_ids=[2**40]),  # kept as is by pydantic, beyond int32
        line(good[15], prompt_token_ids=[-5, *prompt]),
        line(good[16], prompt_token_ids="1,2,3"),
        line(good[17], enable_thinking="yes"),
        line(good[18], enable_thinking=1),
        line(good[19], finish_reason="length"),
        line(good[1]),  # a duplicate id
        *(line(r) for r in good[20:]),
    ]


@pytest.mark.parametrize("verify", [0, 4])
def test_fast_exact_matches_the_per_record_path(chat: ChatFormat, verify: int) -> None:
    lines = [(f"shard:{i + 1}", raw) for i, raw in enumerate(odd_lines(chat))]
    ref_parsed, ref_out, ref_rejected = per_record(lines, chat, verify)
    parsed, rejected = parse_lines(lines)
    out = tokenize_exact(parsed, chat, True, verify)
    # Not JSON, not an object, messages not a list, 1.5, "x", an unknown field, a nested list, a string.
    assert rejected == ref_rejected and len(rejected) == 8
    assert [item.where for item in parsed] == [where for where, _ in ref_parsed]
    fast_hits = 0
    for item, result, (_, ref_record), ref in zip(parsed, out, ref_parsed, ref_out, strict=True):
        record = item.record
        assert (record.id, record.finish_reason, record.enable_thinking, record.final_assistant) == (
            ref_record.id, ref_record.finish_reason, ref_record.enable_thinking, ref_record.final_assistant)
        assert item.full_record() == ref_record
        if isinstance(ref, MaskingError):
            assert isinstance(result, MaskingError) and (result.reason, str(result)) == (ref.reason, str(ref))
            continue
        assert not isinstance(result, MaskingError)
        if isinstance(result, ExactIds):
            fast_hits += 1
            assert np.concatenate((result.prompt, result.completion)).tolist() == ref.input_ids
            assert result.prompt.size == ref.prompt_len and result.prompt.dtype == np.int32
        else:
            assert result == ref
    assert fast_hits >= 8  # the plain records did take the array path
    if verify:
        assert isinstance(out[0], MaskingError) and out[0].reason == "prompt_ids_mismatch"


def test_odd_but_valid_ids_give_the_same_sequences(chat: ChatFormat, tok_dir: Path) -> None:
    """Ids written as 1.0 or "1" take the per-record path; the sequences they give are those of plain ints."""
    worker.init_worker(worker.WorkerSettings(str(tok_dir), "token_exact", "final_turn", True, 4096, "truncate",
                                             QualityPolicy()), single_threaded=False, chat=chat)
    record = engine_like(chat, conversation(3))
    prompt = list(record.prompt_token_ids or ())
    plain = worker.process_batch([("a:1", line(record))])
    for odd in ([float(x) for x in prompt], [str(x) for x in prompt]):
        other = worker.process_batch([("a:1", line(record, prompt_token_ids=odd))])
        assert other.sequences.input_ids.tolist() == plain.sequences.input_ids.tolist()
        assert other.sequences.loss_mask.tolist() == plain.sequences.loss_mask.tolist()
        assert other.sequences.offsets.tolist() == plain.sequences.offsets.tolist()
    assert len(plain.sequences) == 1 and not plain.rejected


@pytest.mark.parametrize("policy", ["final_turn", "all_turns"])
def test_render_mask_built_in_numpy_is_the_masking_mask(chat: ChatFormat, policy: str) -> None:
    first = conversation(1)
    multi = [*first, Message(role="user", content="And a second question?"),
             Message(role="assistant", reasoning_content="Think again.", content="A second answer, in full.")]
    records = [completion(conversation(i)) for i in range(4)] + [completion(multi)]
    results = try_render_batch(records, chat, enable_thinking=True, mask_policy=policy)  # type: ignore[arg-type]
    for result in results:
        assert isinstance(result, Tokenized)
        ids, mask, trained = worker._arrays(result)
        assert ids.tolist() == result.input_ids and mask.tolist() == result.loss_mask
        assert mask.dtype == np.int8 and ids.dtype == np.int32
        assert trained.tolist() == [t for t, m in zip(result.input_ids, result.loss_mask, strict=True) if m]
