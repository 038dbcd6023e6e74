"""The tokenize stage end to end on the real Qwen vocabularies: modes, gate, accounting, storage backends."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from dflash_shared.errors import BadInputError
from dflash_shared.importing import ImportSpec, run_import
from dflash_shared.manifest_io import ManifestError, load_manifest
from dflash_shared.manifests import Kind, Producer, TokenizedSection
from dflash_shared.records import CompletionRecord, Message
from dflash_shared.storage import ObjectStore, join
from dflash_tokenize.arrow_shards import read_shard
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.config import TokenizeConfig
from dflash_tokenize.stage import run
from tests.support.qwen_assets import shared_tokenizer_dir
from tests.tokenize.stage_fixtures import completion, conversation, engine_like, target_for, write_completions


def config(src: str, out: str, tok: Path | str, **kw: object) -> TokenizeConfig:
    # No held-out split unless a test asks for one: these tests read every record back in input order.
    kw.setdefault("heldout_fraction", 0)
    return TokenizeConfig(input=src, output=out, tokenizer=str(tok), workers=1, **kw)  # type: ignore[arg-type]


def rows(store: ObjectStore, out: str) -> list[dict]:
    manifest = load_manifest(store, out, Kind.tokenized).manifest
    table_rows: list[dict] = []
    for shard in manifest.shards:
        local = store.read_bytes(shard.uri)
        import pyarrow as pa

        table_rows += read_shard(pa.py_buffer(local)).to_pylist()
    return table_rows


def test_render_mode_on_both_backends(storage_root: str, store: ObjectStore, tok_dir: Path, chat: ChatFormat) -> None:
    records = [completion(conversation(i)) for i in range(30)]
    src = write_completions(store, join(storage_root, "completions"), records, shards=3)
    out = join(storage_root, "tokenized")
    uri = run(config(src, out, tok_dir, num_shards=1), store)
    assert uri == join(out, "manifest.json")
    loaded = load_manifest(store, out, Kind.tokenized)
    m = loaded.manifest
    section = m.section
    assert isinstance(section, TokenizedSection)
    assert section.mode == "render" and section.target.enable_thinking is True
    assert section.target.tokenizer_sha256 == chat.tokenizer_sha256
    assert m.accounting.input_records == 30 and m.accounting.succeeded == 30
    assert m.inputs[0].uri == join(src, "manifest.json")
    assert m.inputs[0].sha256 == load_manifest(store, src, Kind.completions).sha256  # lineage
    got = rows(store, out)
    # Input order kept: shard by shard, line by line.
    assert [r["id"] for r in got] == [r.id for k in range(3) for r in records[k::3]]
    for row in got:
        ids, mask = np.array(row["input_ids"]), np.array(row["loss_mask"])
        trained = chat.decode(ids[mask == 1].tolist())
        assert trained.startswith("<think>\n") and trained.endswith("<|im_end|>")
        assert row["length"] == len(ids) and row["loss_tokens"] == int(mask.sum())
    assert section.total_tokens == sum(r["length"] for r in got)
    assert section.loss_tokens == sum(r["loss_tokens"] for r in got)
    assert sum(section.length_histogram.values()) == 30


def test_token_exact_mode_matches_render_mode(tmp_path: Path, store: ObjectStore, tok_dir: Path,
                                              chat: ChatFormat) -> None:
    records = [engine_like(chat, conversation(i)) for i in range(12)]
    src = write_completions(store, str(tmp_path / "c"), records, target=target_for(chat))
    exact = run(config(src, str(tmp_path / "exact"), tok_dir), store)
    rendered = run(config(src, str(tmp_path / "render"), tok_dir, mode="render"), store)
    assert exact and rendered
    m = load_manifest(store, str(tmp_path / "exact"), Kind.tokenized).manifest
    assert m.section.mode == "token_exact"  # type: ignore[union-attr]
    a, b = rows(store, str(tmp_path / "exact")), rows(store, str(tmp_path / "render"))
    for record, ra, rb in zip(records, a, b, strict=True):
        assert ra["input_ids"] == list(record.prompt_token_ids) + list(record.completion_token_ids)  # type: ignore[operator]
        # Render mode adds the newline after <|im_end|> (never trained); otherwise identical.
        assert rb["input_ids"][: len(ra["input_ids"])] == ra["input_ids"]
        assert rb["loss_mask"][: len(ra["loss_mask"])] == ra["loss_mask"]


def test_qwen3_6_token_exact_and_render_agree(tmp_path: Path, store: ObjectStore) -> None:
    # The Qwen3.6 template's generation prompt ends with "<think>\n": the engine's completion starts
    # inside the think block. Multi-turn prompts depend on preserve_thinking, which must be set alike.
    tok = shared_tokenizer_dir("qwen3_6")
    chat = ChatFormat.from_dir(tok)
    preserve = True
    kwargs = {"preserve_thinking": preserve}
    multi = [*conversation(1), Message(role="user", content="And a second question?"),
             Message(role="assistant", reasoning_content="Think again.", content="A second answer, in full.")]
    # An empty reasoning (in the spot-checked head of the batch) is the gate's to reject, as for Qwen3.
    convos = [multi, conversation(2, reasoning=""), *(conversation(i) for i in range(3, 9))]
    records = [engine_like(chat, c, template_kwargs=kwargs) for c in convos]
    src = write_completions(store, str(tmp_path / "c"), records, target=target_for(chat))
    for mode in ("token_exact", "render"):
        out = str(tmp_path / mode)
        assert run(config(src, out, tok, mode=mode, preserve_thinking=preserve, max_bad_fraction=0.2), store)
        manifest = load_manifest(store, out, Kind.tokenized).manifest
        assert manifest.accounting.succeeded == len(records) - 1
        assert manifest.accounting.failures_by_reason == {"thinking_missing": 1}
        assert manifest.producer.config["preserve_thinking"] == preserve  # recorded with the resolved config
    kept = [r for r in records if r.final_assistant.reasoning_content]
    a, b = rows(store, str(tmp_path / "token_exact")), rows(store, str(tmp_path / "render"))
    for record, ra, rb in zip(kept, a, b, strict=True):
        assert ra["input_ids"] == list(record.prompt_token_ids) + list(record.completion_token_ids)  # type: ignore[operator]
        assert (rb["input_ids"], rb["loss_mask"]) == (ra["input_ids"], ra["loss_mask"])
        trained = chat.decode(np.array(ra["input_ids"])[np.array(ra["loss_mask"]) == 1].tolist())
        # The prompt's "<think>\n" is not trained; the reasoning, "</think>" and the answer are.
        assert "<think>" not in trained and "\n</think>\n\n" in trained and trained.endswith("<|im_end|>")
    # Unset, the spot check renders with the template's default, which drops the first turn's reasoning.
    with pytest.raises(BadInputError, match="prompt_ids_mismatch"):
        run(config(src, str(tmp_path / "default"), tok, max_bad_fraction=0.2), store)


def test_shards_load_with_datasets(tmp_path: Path, store: ObjectStore, tok_dir: Path) -> None:
    src = write_completions(store, str(tmp_path / "c"), [completion(conversation(i)) for i in range(8)])
    run(config(src, str(tmp_path / "t"), tok_dir), store)
    shard = load_manifest(store, str(tmp_path / "t"), Kind.tokenized).manifest.shards[0]
    ds = datasets.Dataset.from_file(shard.uri)
    assert len(ds) == 8 and set(ds.column_names) >= {"input_ids", "loss_mask", "length"}


def bad_records(chat: ChatFormat) -> list:
    long_answer = " ".join(f"word{i}" for i in range(3000))
    return [
        b"{this is not json",                                                     # malformed_record
        b'{"id": "x", "messages": "not a list"}',                                 # malformed_record
        completion(conversation(100, answer="")),                                 # empty_response
        completion(conversation(101, answer="Ok.")),                              # too_short
        completion(conversation(102, thinking=False)),                            # thinking_missing
        completion(conversation(103, thinking=False, answer="<think>\nI was still going")),  # thinking_unclosed
        completion(conversation(104), finish_reason="length"),                    # truncated
        completion(conversation(105, answer=long_answer)),                        # over max length
    ]


def test_every_bad_input_kind_is_counted_and_the_rest_kept(tmp_path: Path, store: ObjectStore, tok_dir: Path,
                                                            chat: ChatFormat) -> None:
    good = [completion(conversation(i)) for i in range(200)]
    src = write_completions(store, str(tmp_path / "c"), good[:100] + bad_records(chat) + good[100:])
    out = str(tmp_path / "t")
    run(config(src, out, tok_dir, max_length=1024, over_length="drop"), store)
    m = load_manifest(store, out, Kind.tokenized).manifest
    assert m.accounting.failures_by_reason == {
        "malformed_record": 2, "empty_response": 1, "too_short": 1, "thinking_missing": 1,
        "thinking_unclosed": 1, "truncated": 1, "over_max_length": 1,
    }
    assert m.accounting.succeeded == 200 and m.accounting.input_records == 208
    assert [r["id"] for r in rows(store, out)] == [r.id for r in good]
    # Each example names the file and line of the bad record.
    assert m.accounting.examples["malformed_record"][0].startswith(
        join(str(tmp_path / "c"), "data", "part-00000-0000.jsonl.zst:101: "))
    assert "empty_response" in m.accounting.examples["empty_response"][0]


def test_over_length_truncates_by_default(tmp_path: Path, store: ObjectStore, tok_dir: Path) -> None:
    long_answer = " ".join(f"word{i}" for i in range(3000))
    src = write_completions(store, str(tmp_path / "c"), [completion(conversation(1, answer=long_answer))])
    run(config(src, str(tmp_path / "t"), tok_dir, max_length=512), store)
    (row,) = rows(store, str(tmp_path / "t"))
    assert row["length"] == 512 and row["loss_tokens"] > 0


def test_the_origin_dataset_fails_the_gate(tmp_path: Path, store: ObjectStore, tok_dir: Path) -> None:
    """87% of responses nearly empty: the stage must fail with a report, and write no manifest."""
    records = [completion(conversation(i, answer="Ok." if i % 100 < 87 else None)) for i in range(200)]
    src = write_completions(store, str(tmp_path / "c"), records)
    with pytest.raises(BadInputError, match=r"174 of 200 records are unusable \(87.0%\)") as err:
        run(config(src, str(tmp_path / "t"), tok_dir), store)
    assert err.value.counts == {"too_short": 174}
    assert "e.g." in str(err.value)
    assert not store.exists(join(str(tmp_path / "t"), "manifest.json"))


def test_mismatched_tokenizer_is_refused(tmp_path: Path, store: ObjectStore, tok_dir: Path, chat: ChatFormat) -> None:
    other = target_for(chat).model_copy(update={"tokenizer_sha256": "0" * 64})
    records = [engine_like(chat, conversation(i)) for i in range(3)]
    src = write_completions(store, str(tmp_path / "c"), records, target=other)
    with pytest.raises(ManifestError, match="target.tokenizer_sha256") as err:
        run(config(src, str(tmp_path / "t"), tok_dir), store)
    assert err.value.field == "target.tokenizer_sha256"


def test_thinking_mode_mismatch_is_refused(tmp_path: Path, store: ObjectStore, tok_dir: Path,
                                           chat: ChatFormat) -> None:
    records = [engine_like(chat, conversation(i)) for i in range(3)]
    src = write_completions(store, str(tmp_path / "c"), records, target=target_for(chat, thinking=True))
    with pytest.raises(ManifestError, match="target.enable_thinking"):
        run(config(src, str(tmp_path / "t"), tok_dir, enable_thinking=False), store)


def test_corrupted_input_shard_is_refused(tmp_path: Path, store: ObjectStore, tok_dir: Path) -> None:
    src = write_completions(store, str(tmp_path / "c"), [completion(conversation(i)) for i in range(5)])
    shard = load_manifest(store, src, Kind.completions).manifest.shards[0]
    data = bytearray(store.read_bytes(shard.uri))
    data[-3] ^= 0x55
    store.delete(shard.uri)
    store.write_bytes(shard.uri, bytes(data))
    with pytest.raises(BadInputError, match="does not match its manifest"):
        run(config(src, str(tmp_path / "t"), tok_dir), store)


def test_process_pool_output_is_identical(tmp_path: Path, store: ObjectStore, tok_dir: Path) -> None:
    records = [completion(conversation(i)) for i in range(120)]
    src = write_completions(store, str(tmp_path / "c"), records, shards=2)
    one = str(tmp_path / "one")
    two = str(tmp_path / "two")
    run(config(src, one, tok_dir, batch_records=16, heldout_fraction=0.1), store)
    run(TokenizeConfig(input=src, output=two, tokenizer=str(tok_dir), workers=2, batch_records=16,
                       heldout_fraction=0.1), store)
    files_one = sorted(u for u in store.list(one) if "/data/" in u)
    files_two = sorted(u for u in store.list(two) if "/data/" in u)
    assert [store.read_bytes(u) for u in files_one] == [store.read_bytes(u) for u in files_two]
    assert any("/data/heldout/" in u for u in files_one)  # the held-out files too


def test_mask_token_must_be_an_embedding_row(tmp_path: Path, store: ObjectStore, tok_dir: Path) -> None:
    """Qwen3's DFlash mask token (151669) lies past the tokenizer's last id but inside the embedding."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tok_dir, model)
    src = write_completions(store, str(tmp_path / "c"), [completion(conversation(i)) for i in range(3)])
    with pytest.raises(BadInputError, match="mask_token_id 151669 is not a row of the target's 151669 embeddings"):
        run(config(src, str(tmp_path / "t1"), model, mask_token_id=151669), store)
    (model / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    run(config(src, str(tmp_path / "t2"), model, mask_token_id=151669), store)
    manifest = load_manifest(store, str(tmp_path / "t2"), Kind.tokenized).manifest
    assert manifest.section.target.special_tokens.mask == 151669  # type: ignore[union-attr]


def test_source_ids_reach_the_shards(tmp_path: Path, store: ObjectStore, tok_dir: Path) -> None:
    """Imported conversations keep the user's ids through tokenize, held-out rows too: rows join back."""
    ids: list[object] = [f"conv-{i}" if i % 3 else i for i in range(12)] + [None]
    lines = [{"messages": [m.template_dict() for m in conversation(i)], **({"id": v} if v is not None else {})}
             for i, v in enumerate(ids)]
    source = str(tmp_path / "external")
    store.write_bytes(join(source, "chats.jsonl"), b"".join(json.dumps(line).encode() + b"\n" for line in lines))
    imported = str(tmp_path / "c")
    run_import(store, ImportSpec(Kind.completions, source, imported, "r"), Producer(stage="import"))
    out = str(tmp_path / "t")
    run(config(imported, out, tok_dir, heldout_fraction=0.5), store)
    manifest = load_manifest(store, out, Kind.tokenized).manifest
    assert {s.split for s in manifest.shards} == {"train", "heldout"}
    got = {row["source_id"] for row in rows(store, out)}
    assert got == {None if v is None else str(v) for v in ids}
    # The nullable column loads with datasets beside the trainer's columns.
    ds = datasets.Dataset.from_file(manifest.shards[0].uri)
    assert ds.features["source_id"].dtype == "string"


def test_source_ids_in_token_exact_mode(tmp_path: Path, store: ObjectStore, tok_dir: Path, chat: ChatFormat) -> None:
    # Generated completions carry their prompt's source_id; the array-speed parser keeps it like pydantic.
    records = [engine_like(chat, conversation(i), source_id=f"row-{i}" if i else None) for i in range(4)]
    src = write_completions(store, str(tmp_path / "c"), records, target=target_for(chat))
    run(config(src, str(tmp_path / "t"), tok_dir), store)
    assert [r["source_id"] for r in rows(store, str(tmp_path / "t"))] == [None, "row-1", "row-2", "row-3"]


def budget_cut(chat: ChatFormat, i: int, keep: int) -> CompletionRecord:
    """An engine record the generate stage stopped at its budget `keep` tokens into the thinking, stored as the
    engine wrapper stores an unclosed think block (raw text, opening marker included, as content)."""
    whole = engine_like(chat, conversation(i, reasoning=" ".join(f"step {k} of the plan" for k in range(60))))
    ids = whole.completion_token_ids[:keep]  # type: ignore[index]
    messages = (*whole.messages[:-1], Message(role="assistant", content=chat.decode(list(ids))))
    return whole.model_copy(update={"messages": messages, "completion_token_ids": ids, "finish_reason": "length"})


def test_completions_stopped_at_the_budget_are_kept_and_counted(tmp_path: Path, store: ObjectStore, tok_dir: Path,
                                                                chat: ChatFormat) -> None:
    """token_exact over the generate stage's output: a completion cut at the budget (the training window's end)
    is the target's own prefix, trained as it is (no end-of-turn added) and counted as truncated_by_budget; the
    manifest says which share of the completions' tokens the max_length window holds."""
    good = [engine_like(chat, conversation(i)) for i in range(6)]
    cut = [budget_cut(chat, i, keep=40) for i in range(6, 9)]
    assert all(chat.think_end_id not in r.completion_token_ids for r in cut)  # type: ignore[operator]
    src = write_completions(store, str(tmp_path / "c"), good + cut, target=target_for(chat))
    out = str(tmp_path / "t")
    run(config(src, out, tok_dir), store)
    m = load_manifest(store, out, Kind.tokenized).manifest
    section = m.section
    assert isinstance(section, TokenizedSection)
    assert (m.accounting.succeeded, m.accounting.failed, section.truncated_by_budget) == (9, 0, 3)
    kept = {r["id"]: r for r in rows(store, out)}
    for record in cut:
        assert kept[record.id]["input_ids"] == [*record.prompt_token_ids, *record.completion_token_ids]  # type: ignore[misc]
    completions = sum(len(r.completion_token_ids) for r in good + cut)  # type: ignore[arg-type]
    assert section.loss_tokens_before_truncation == section.loss_tokens == completions
    assert (section.truncated_to_max_length, section.window_fraction) == (0, 1.0)
    # A window shorter than the records: the cut tails are counted, and the share the window holds.
    short = str(tmp_path / "short")
    run(config(src, short, tok_dir, max_length=60), store)
    cut_section = load_manifest(store, short, Kind.tokenized).manifest.section
    assert isinstance(cut_section, TokenizedSection)
    assert cut_section.truncated_to_max_length == 9 and cut_section.loss_tokens_before_truncation == completions
    assert cut_section.window_fraction == pytest.approx(cut_section.loss_tokens / completions, abs=1e-6)
    assert cut_section.window_fraction is not None and cut_section.window_fraction < 1
    # Turned off, or in render mode (whose template would close the cut turn), they are rejected as truncated.
    for other, kwargs in (("off", {"keep_truncated_by_budget": False}), ("render", {"mode": "render"})):
        run(config(src, str(tmp_path / other), tok_dir, max_bad_fraction=1.0, **kwargs), store)
        rejected = load_manifest(store, str(tmp_path / other), Kind.tokenized).manifest
        assert rejected.accounting.failures_by_reason == {"truncated": 3}
        assert rejected.section.truncated_by_budget == 0  # type: ignore[union-attr]
