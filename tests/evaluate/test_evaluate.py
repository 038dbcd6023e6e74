"""`dflash-train evaluate`: offline acceptance on held-out prompts, the manifest it commits, and its gate."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from dflash_shared.evaluation_report import OfflineReport
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_shared.storage import ObjectStore, join
from dflash_train.__main__ import main as train_main
from dflash_train.evaluate.stage import training_accuracies


def _report(run: Any) -> OfflineReport:
    loaded = load_manifest(run.store, run.evaluation, Kind.evaluation)  # re-hashes the report shard
    (shard,) = loaded.manifest.shards
    return OfflineReport.model_validate_json(run.store.read_bytes(shard.uri))


def test_trained_drafter_clearly_beats_an_untrained_one(offline_run: Any) -> None:
    report = _report(offline_run)
    trained, untrained = report.trained, report.untrained
    assert untrained is not None and untrained.prompts == 2 and trained.prompts == 16
    assert untrained.tau < 1.2  # random drafts are (almost) never accepted
    assert trained.tau > 2.5 and trained.tau > untrained.tau + 1.5
    assert trained.tokens_per_target_forward > 2 * untrained.tokens_per_target_forward


def test_manifest_holds_the_offline_numbers(offline_run: Any) -> None:
    loaded = load_manifest(offline_run.store, offline_run.evaluation, Kind.evaluation)
    section = loaded.manifest.section
    report = _report(offline_run)
    assert section.engine_tau is None  # the serving check fills it
    assert section.tau == report.trained.tau and section.tau_untrained == report.untrained.tau
    assert section.acceptance_per_position == report.trained.acceptance_per_position
    assert len(section.acceptance_per_position) == report.block_size - 1 == 7
    assert section.tau_histogram == report.trained.tau_histogram
    assert sum(section.tau_histogram.values()) == report.trained.steps
    kinds = [i.kind for i in loaded.manifest.inputs]
    assert kinds == [Kind.drafter, Kind.tokenized]
    # The default split of the run's tokenized data: held out of training.
    assert section.prompt_split == report.prompt_split == "heldout"
    # The prompt set's tau beside it; its unusable line is a failed record, named by file and line.
    mixed = report.prompt_sets["mixed"]
    assert section.metrics == {"tau_mixed": mixed.acceptance.tau, "prompts_mixed": 3, "bad_lines_mixed": 1}
    assert mixed.acceptance.prompts == 3 and mixed.acceptance.tau > 1
    acc = loaded.manifest.accounting
    assert (acc.succeeded, acc.failed, acc.failures_by_reason) == (16 + 3, 1, {"bad_prompt_line": 1})
    assert mixed.bad_lines == acc.examples["bad_prompt_line"] and mixed.bad_lines[0].startswith(f"{mixed.uri}:3: ")
    assert loaded.manifest.run_id == "eval-test"


def test_report_matches_its_per_prompt_results(offline_run: Any, heldout_prompts: list[list[int]]) -> None:
    report = _report(offline_run)
    assert report.dtype == "float32" and report.block_size == 7 + 1 and report.max_new_tokens == 64
    assert report.lossless_checked == 2 and report.lossless_mismatches == []
    assert report.lossless is not None and report.lossless.policy.tie_margin is None  # float32: exact
    # Short prompts and 64 new tokens: every step drafted within the first 4K of context.
    assert list(report.trained.by_position) == ["0-4K"]
    assert report.trained.by_position["0-4K"].steps == report.trained.steps
    assert report.trained.by_position["0-4K"].tau == pytest.approx(report.trained.tau)
    steps = [n for r in report.results for n in r.accepted]
    assert report.trained.tau == pytest.approx(1 + sum(steps) / len(steps))
    # Exactly the held-out shard's prompts (the train shard beside it holds others), in order.
    assert [r.prompt_token_ids for r in report.results] == heldout_prompts
    for r in report.results:
        assert 1 + sum(n + 1 for n in r.accepted) >= len(r.output_token_ids) == 64


def test_training_accuracies_are_reported_beside(offline_run: Any) -> None:
    report = _report(offline_run)
    logged = json.loads((offline_run.checkpoint / "metrics.json").read_text())
    assert report.training_acceptance_per_position == [logged[f"acc_{k}"] for k in range(1, 8)]
    assert report.training_expected_tau is not None and report.training_expected_tau > 1
    assert training_accuracies({"acc_2": 0.5, "acc_1": 0.9, "loss": 3.0, "tau": 2.0}) == [0.9, 0.5]


def test_rerun_is_a_no_op(offline_run: Any) -> None:
    from dflash_train.evaluate.config import EvaluateConfig
    from dflash_train.evaluate.stage import run

    before = offline_run.store.read_bytes(join(offline_run.evaluation, "manifest.json"))
    # Nothing is loaded or decoded: the committed manifest short-circuits the run.
    run(EvaluateConfig(drafter=offline_run.export, prompts=offline_run.prompts, target="/nonexistent",
                       output=offline_run.evaluation), offline_run.store)
    assert offline_run.store.read_bytes(join(offline_run.evaluation, "manifest.json")) == before


def test_tau_below_the_gate_exits_65_with_the_numbers(offline_run: Any, tiny_target_dir: Path, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    out = str(tmp_path / "gated")
    argv = ["--drafter", offline_run.export, "--prompts", offline_run.prompts, "--target", str(tiny_target_dir),
            "--output", out, "--preset", "debug", "--num-prompts", "2", "--max-new-tokens", "16",
            "--baseline-prompts", "0", "--lossless-prompts", "0", "--min-tau", "50"]
    caplog.set_level(logging.ERROR)
    with pytest.raises(SystemExit) as exit_info:
        train_main(["evaluate", *argv])  # the `dflash-train evaluate` entry point
    assert exit_info.value.code == 65
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "offline acceptance length tau" in message and "below min_tau 50.0" in message
    assert "per position" in message and "training accuracies" in message
    assert not (tmp_path / "gated" / "manifest.json").exists()  # nothing committed
    assert json.loads((tmp_path / "gated" / "evaluation.json").read_text())["trained"]["prompts"] == 2


def test_prompts_of_another_template_are_refused(offline_run: Any, tiny_target_dir: Path, tmp_path: Path) -> None:
    """Held-out data rendered with another chat template is refused before any model loads."""
    from dflash_shared.manifest_io import ManifestError
    from dflash_shared.manifests import Accounting, CompletionsSection, Manifest, Producer
    from dflash_train.evaluate.config import EvaluateConfig
    from dflash_train.evaluate.stage import run
    from tests.evaluate.eval_fixtures import target_identity

    store = ObjectStore()
    other = target_identity(tiny_target_dir).model_copy(update={"chat_template_sha256": "0" * 64})
    prefix = str(tmp_path / "completions")
    manifest = Manifest(kind=Kind.completions, run_id="x", producer=Producer(stage="generate"),
                        accounting=Accounting(input_records=0, succeeded=0, failed=0, skipped=0),
                        section=CompletionsSection(target=other, has_token_ids=True))
    store.write_bytes(join(prefix, "manifest.json"), manifest.to_json())
    with pytest.raises(ManifestError, match="chat_template_sha256"):
        run(EvaluateConfig(drafter=offline_run.export, prompts=prefix, target=str(tiny_target_dir),
                           output=str(tmp_path / "eval")), offline_run.store)


def test_prompts_from_completions_and_tokenized_records(tmp_path: Path, tiny_target_dir: Path) -> None:
    """Completions give their recorded prompt ids, tokenized rows everything before the first trained token
    (of the held-out split unless the train split is asked for); skipped and refused records are accounted
    for by reason."""
    import pyarrow as pa

    from dflash_shared.errors import BadInputError
    from dflash_shared.manifest_io import load_manifest as load
    from dflash_shared.manifests import (
        Accounting,
        CompletionsSection,
        HeldoutSplit,
        Manifest,
        Producer,
        Shard,
        TokenizedSection,
    )
    from dflash_shared.records import CompletionRecord, Message
    from dflash_train.evaluate.config import EvaluateConfig
    from dflash_train.evaluate.prompts import ChatRenderer, PromptSource, pick_prompts, prompt_split
    from tests.evaluate.eval_fixtures import target_identity

    store = ObjectStore()
    ident = target_identity(tiny_target_dir)
    user, answer = Message(role="user", content="hi"), Message(role="assistant", content="ok")
    records = [CompletionRecord(id=f"c{i}", messages=(user, answer), prompt_token_ids=tuple(range(1, 2 + i * 3)),
                                completion_token_ids=(5, 6)) for i in range(4)]
    comp = str(tmp_path / "completions")
    data = "".join(r.model_dump_json() + "\n" for r in records).encode()
    store.write_bytes(join(comp, "part-0.jsonl"), data)
    shard = Shard(uri=join(comp, "part-0.jsonl"), bytes=len(data), sha256=store.sha256(join(comp, "part-0.jsonl")),
                  records=4)
    accounting = Accounting(input_records=4, succeeded=4, failed=0, skipped=0)
    store.write_bytes(join(comp, "manifest.json"), Manifest(
        kind=Kind.completions, run_id="r", producer=Producer(stage="generate"), shards=[shard], accounting=accounting,
        section=CompletionsSection(target=ident, has_token_ids=True)).to_json())
    config = EvaluateConfig(drafter="d", prompts=comp, target="t", output="o", skip_prompts=1, max_prompt_tokens=6,
                            num_prompts=5)
    render = ChatRenderer(str(tiny_target_dir), False)
    completions = load(store, comp, Kind.completions)
    assert prompt_split(completions, "heldout") == "all"  # only tokenized data is split
    picked, acc = pick_prompts(PromptSource(store, completions, render), config)
    assert picked == [("c1", [1, 2, 3, 4])]
    assert acc.skips_by_reason == {"before_start": 1, "too_long": 2} and acc.examples["too_long"] == ["c2", "c3"]

    def arrow_shard(name: str, split: str, rows: dict[str, list]) -> Shard:
        batch = pa.RecordBatch.from_pydict(rows)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        store.write_bytes(join(tok, name), sink.getvalue().to_pybytes())
        return Shard(uri=join(tok, name), bytes=store.size(join(tok, name)), sha256=store.sha256(join(tok, name)),
                     records=len(rows["id"]), split=split)  # type: ignore[arg-type]

    def tokenized(shards: list[Shard], heldout: int) -> Any:
        split = HeldoutSplit(fraction=0.5, min_records=0, input_records=3, effective_fraction=0.5, records=heldout,
                             tokens=3 * heldout, loss_tokens=heldout)
        store.write_bytes(join(tok, "manifest.json"), Manifest(
            kind=Kind.tokenized, run_id="r", producer=Producer(stage="tokenize"), shards=shards,
            accounting=Accounting(input_records=3, succeeded=3, failed=0, skipped=0),
            section=TokenizedSection(target=ident, mode="token_exact", mask_policy="final_turn", max_length=8,
                                     total_tokens=9, loss_tokens=5, heldout=split)).to_json())
        return load(store, tok, Kind.tokenized)

    tok = str(tmp_path / "tokenized")
    train = arrow_shard("part-0.arrow", "train", {"id": ["t0", "t1"], "input_ids": [[7, 8, 9, 10], [11, 12]],
                                                  "loss_mask": [[0, 0, 1, 1], [1, 1]]})
    held = arrow_shard("heldout/part-0.arrow", "heldout", {"id": ["h0"], "input_ids": [[3, 4, 5]],
                                                           "loss_mask": [[0, 0, 1]]})
    loaded = tokenized([train, held], heldout=1)
    config = EvaluateConfig(drafter="d", prompts=tok, target="t", output="o")
    assert config.split == "heldout" and prompt_split(loaded, config.split) == "heldout"
    picked, acc = pick_prompts(PromptSource(store, loaded, render, "heldout"), config)
    assert picked == [("h0", [3, 4])] and acc.succeeded == 1
    picked, acc = pick_prompts(PromptSource(store, loaded, render, "train"), config)
    assert picked == [("t0", [7, 8])] and acc.skips_by_reason == {"empty_prompt": 1}
    # Data tokenized without a split has nothing held out: refused, with the ways out named.
    with pytest.raises(BadInputError, match="holds no held-out records.*--split train"):
        prompt_split(tokenized([train], heldout=0), "heldout")


def test_tau_by_context_position_buckets_each_step_where_it_drafted() -> None:
    from types import SimpleNamespace

    from dflash_train.evaluate.acceptance import bucket_name, by_position

    # Prompt of 4090 tokens: the prefill commits token 4091; steps draft at 4091 (accepts 3), 4095 (accepts 1),
    # then 4097 (accepts 0), which is past 4096.
    result = SimpleNamespace(accepted=[3, 1, 0])
    buckets = by_position([result], [4090], 4096)
    assert {k: (b.steps, b.tau) for k, b in buckets.items()} == {"0-4K": (2, 3.0), "4K-8K": (1, 1.0)}
    assert [bucket_name(p, 4096) for p in (0, 4095, 4096, 9000)] == ["0-4K", "0-4K", "4K-8K", "8K-12K"]
    assert bucket_name(150, 100) == "100-200"
