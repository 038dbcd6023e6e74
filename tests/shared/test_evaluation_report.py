"""`evaluation.json` is one schema shared by the evaluate stage (writer) and the serving check (reader), strict on
both sides: what one writes the other reads whole, and a report of another shape is refused naming the file."""

from __future__ import annotations

import json

import pytest

from dflash_shared.errors import BadInputError
from dflash_shared.evaluation_report import Acceptance, OfflineReport, PromptResult, parse_report


def _report() -> OfflineReport:
    acceptance = Acceptance(tau=2.0, steps=2, accepted_tokens=2, acceptance_per_position=[1.0, 0.0],
                            tau_histogram={"1": 1, "3": 1}, generated_tokens=6, target_forwards=3,
                            tokens_per_target_forward=2.0, prompts=1)
    return OfflineReport(block_size=4, max_new_tokens=8, stop_token_ids=[2], dtype="float32", drafter_export="x",
                         prompt_split="heldout", trained=acceptance, untrained=None,
                         training_acceptance_per_position=[], training_expected_tau=None, lossless_checked=1,
                         lossless_mismatches=[],
                         results=[PromptResult(id="p0", prompt_token_ids=[1, 5], output_token_ids=[7, 8, 2],
                                               accepted=[2, 0])])


def test_what_evaluate_writes_the_serving_check_reads_whole() -> None:
    report = _report()
    assert parse_report("s3://b/evaluation.json", report.model_dump_json().encode()) == report


@pytest.mark.parametrize("change", ["extra field", "missing field", "wrong type"])
def test_a_report_of_another_shape_is_refused_naming_the_file_and_field(change: str) -> None:
    data = json.loads(_report().model_dump_json())
    if change == "extra field":
        data["results"][0]["drafted"] = [3, 3]
    elif change == "missing field":
        del data["stop_token_ids"]
    else:
        data["block_size"] = "four"
    field = {"extra field": "results.0.drafted", "missing field": "stop_token_ids", "wrong type": "block_size"}
    with pytest.raises(BadInputError, match=rf"s3://b/run/evaluation\.json is not an evaluation report .*"
                                            rf"{field[change]}"):
        parse_report("s3://b/run/evaluation.json", json.dumps(data).encode())
