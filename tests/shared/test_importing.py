"""`import`: external conversations -> prompts/completions manifests, with every record accounted for."""

from __future__ import annotations

import hashlib
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_shared.errors import BadInputError, ConfigError
from dflash_shared.importing import ImportConfig, ImportSpec, run_import
from dflash_shared.jsonl import iter_lines
from dflash_shared.layouts import Layout
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind, Producer
from dflash_shared.records import CompletionRecord, Message, PromptRecord
from dflash_shared.storage import ObjectStore, join

PRODUCER = Producer(stage="import")


def conversation(i: int, answer: str | None = None) -> dict:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": f"What is {i} + {i}?"},
    ]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def jsonl(objs: list) -> bytes:
    return b"".join((o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n" for o in objs)


def parquet(rows: list[dict]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


@pytest.fixture
def source(storage_root: str, store: ObjectStore) -> str:
    prefix = join(storage_root, "external")
    store.write_bytes(
        join(prefix, "a.jsonl"),
        jsonl(
            [conversation(i, f"<think>\nadd {i} and {i}\n</think>\n\nIt is {2 * i}.") for i in range(40)]
            + [b"{truncated json", conversation(3, "<think>\nadd 3 and 3\n</think>\n\nIt is 6.")]
        ),
    )
    rows = [
        {"messages": [{"role": "user", "content": f"Name {i}"},
                      {"role": "assistant", "content": f"Name {i}", "reasoning_content": "easy"}]}
        for i in range(10)
    ]
    store.write_bytes(join(prefix, "b.parquet"), parquet(rows))
    store.write_bytes(join(prefix, "notes.txt"), b"not a source file, ignored")
    return prefix


def read_records(store: ObjectStore, manifest_uri_prefix: str, kind: Kind, model: type) -> list:
    loaded = load_manifest(store, manifest_uri_prefix, kind)
    return [
        model.model_validate_json(line)
        for shard in loaded.manifest.shards
        for _, line in iter_lines(store, shard.uri)
    ]


def test_import_completions(storage_root: str, store: ObjectStore, source: str) -> None:
    out = join(storage_root, "completions")
    spec = ImportSpec(kind=Kind.completions, source_prefix=source, output_prefix=out, run_id="r1")
    assert run_import(store, spec, PRODUCER) is not None
    manifest = load_manifest(store, out, Kind.completions).manifest
    acc = manifest.accounting
    assert (acc.input_records, acc.succeeded, acc.failed, acc.skipped) == (52, 50, 1, 1)
    assert acc.failures_by_reason == {"malformed_record": 1}
    assert acc.skips_by_reason == {"duplicate": 1}
    assert "a.jsonl:41" in acc.examples["malformed_record"][0]
    records = read_records(store, out, Kind.completions, CompletionRecord)
    assert len(records) == 50 == manifest.total_records
    first = records[0]
    assert first.final_assistant.reasoning_content == "add 0 and 0"
    assert first.final_assistant.content == "It is 0."
    assert records[-1].final_assistant.reasoning_content == "easy"  # parquet's explicit field kept
    assert len({r.id for r in records}) == 50


def test_import_prompts_drops_the_final_assistant_turn(storage_root: str, store: ObjectStore, source: str) -> None:
    out = join(storage_root, "prompts")
    spec = ImportSpec(kind=Kind.prompts, source_prefix=source, output_prefix=out, run_id="r1")
    run_import(store, spec, PRODUCER)
    records = read_records(store, out, Kind.prompts, PromptRecord)
    assert len(records) == 50
    assert all(r.messages[-1].role == "user" for r in records)
    manifest = load_manifest(store, out, Kind.prompts).manifest
    assert manifest.section.duplicates == 1  # type: ignore[union-attr]


def test_import_rerun_is_a_no_op_with_identical_output(storage_root: str, store: ObjectStore, source: str) -> None:
    out = join(storage_root, "completions")
    spec = ImportSpec(kind=Kind.completions, source_prefix=source, output_prefix=out, run_id="r1")
    run_import(store, spec, PRODUCER)
    before = {uri: store.read_bytes(uri) for uri in store.list(out)}
    run_import(store, spec, PRODUCER)
    assert {uri: store.read_bytes(uri) for uri in store.list(out)} == before


def test_import_sharded_over_workers(storage_root: str, store: ObjectStore, source: str) -> None:
    out = join(storage_root, "completions")
    spec = ImportSpec(kind=Kind.completions, source_prefix=source, output_prefix=out, run_id="r1")
    assert run_import(store, spec, PRODUCER, index=0, count=2) is None  # manifest waits for shard 1
    assert run_import(store, spec, PRODUCER, index=1, count=2) is not None
    assert load_manifest(store, out, Kind.completions).manifest.accounting.input_records == 52


def test_too_much_bad_input_fails_the_import(tmp_path, store: ObjectStore) -> None:  # type: ignore[no-untyped-def]
    prefix = str(tmp_path / "external")
    bad = [b"not json"] * 3 + [{"messages": []}] * 3 + [conversation(i) for i in range(4)]
    store.write_bytes(join(prefix, "x.jsonl"), jsonl(bad))
    spec = ImportSpec(kind=Kind.completions, source_prefix=prefix, output_prefix=str(tmp_path / "out"), run_id="r")
    with pytest.raises(BadInputError, match="10 of 10 records of the import are unusable") as err:
        run_import(store, spec, PRODUCER)
    assert err.value.counts == {"malformed_record": 6, "no_final_assistant_turn": 4}
    assert "6 malformed_record, 4 no_final_assistant_turn. By worker: shard-00000 10 of 10." in str(err.value)
    assert not store.exists(join(str(tmp_path / "out"), "manifest.json"))


def test_the_bad_record_limit_is_judged_on_the_whole_import_whatever_the_shard_count(tmp_path, store: ObjectStore,
                                                                                     ) -> None:  # type: ignore[no-untyped-def]
    """6 bad records in 60 pass a 10% limit on one worker and on four alike (one file each: three clean, one with
    all the bad records, which alone would be 6 of 15)."""
    prefix = str(tmp_path / "external")
    good = [conversation(i, answer=str(2 * i)) for i in range(54)]
    for n in range(3):
        store.write_bytes(join(prefix, f"clean-{n}.jsonl"), jsonl(good[15 * n : 15 * n + 15]))
    store.write_bytes(join(prefix, "mixed.jsonl"), jsonl([b"not json"] * 6 + good[45:]))
    for workers in (1, 4):
        out = str(tmp_path / f"out-{workers}")
        spec = ImportSpec(kind=Kind.completions, source_prefix=prefix, output_prefix=out, run_id="r",
                          max_bad_fraction=0.10)
        done = [run_import(store, spec, PRODUCER, index=i, count=workers) for i in range(workers)]
        assert done[-1] is not None, workers
        accounting = load_manifest(store, out, Kind.completions).manifest.accounting
        assert (accounting.input_records, accounting.failed) == (60, 6)
    strict = ImportSpec(kind=Kind.completions, source_prefix=prefix, output_prefix=str(tmp_path / "strict"),
                        run_id="r", max_bad_fraction=0.05)
    for i in range(3):
        run_import(store, strict, PRODUCER, index=i, count=4)
    with pytest.raises(BadInputError, match=r"6 of 60 records of the import are unusable \(10.0%") as err:
        run_import(store, strict, PRODUCER, index=3, count=4)
    assert "By worker: " in str(err.value) and "6 of 15" in str(err.value)


def test_no_source_files_is_bad_input(tmp_path, store: ObjectStore) -> None:  # type: ignore[no-untyped-def]
    spec = ImportSpec(kind=Kind.prompts, source_prefix=str(tmp_path), output_prefix=str(tmp_path / "o"), run_id="r")
    with pytest.raises(BadInputError, match="no .jsonl"):
        run_import(store, spec, PRODUCER)


# --- the source's own ids --------------------------------------------------------------------------


def with_id(record_id: object, i: int, answer: str = "Fine.") -> dict:
    return {"id": record_id, **conversation(i, answer)}


def import_local(tmp_path, store: ObjectStore, records: list, kind: Kind = Kind.completions,  # type: ignore[no-untyped-def]
                 **spec: object) -> tuple:
    prefix, out = str(tmp_path / "external"), str(tmp_path / f"out-{kind.value}")
    store.write_bytes(join(prefix, "x.jsonl"), jsonl(records))
    model = PromptRecord if kind is Kind.prompts else CompletionRecord
    run_import(store, ImportSpec(kind=kind, source_prefix=prefix, output_prefix=out, run_id="r", **spec),  # type: ignore[arg-type]
               PRODUCER)
    return load_manifest(store, out, kind).manifest.accounting, read_records(store, out, kind, model)


@pytest.mark.parametrize("kind", [Kind.completions, Kind.prompts])
def test_source_ids_of_every_scalar_type_become_strings(tmp_path, store: ObjectStore, kind: Kind) -> None:  # type: ignore[no-untyped-def]
    ids = ["conv-a", 7, 2.5, True, None, -0.0, 2**63 - 1]
    records = [with_id(value, i) for i, value in enumerate(ids)] + [conversation(50, "no id at all")]
    malformed = [with_id({"nested": 1}, 90), with_id([1, 2], 91), with_id("", 92)]
    acc, got = import_local(tmp_path, store, records + malformed, kind, max_bad_fraction=0.5)
    assert [r.source_id for r in got] == ["conv-a", "7", "2.5", "true", None, "-0.0", "9223372036854775807", None]
    assert acc.failures_by_reason == {"malformed_record": 3}
    assert "'id' is a dict, not a string or number" in acc.examples["malformed_record"][0]
    assert "'id' is a list" in acc.examples["malformed_record"][1]


def test_a_repeated_id_with_other_content_keeps_the_first(tmp_path, store: ObjectStore) -> None:  # type: ignore[no-untyped-def]
    records = [
        with_id("a", 1),
        with_id("a", 2),          # same id, other prompt: duplicate_id
        with_id("b", 3),
        with_id("b", 3),          # same id, same content: an ordinary duplicate
        with_id("c", 1),          # content of "a" again under a new id: a duplicate, and "c" is now taken
        with_id("c", 4),          # "c" with new content: duplicate_id
        with_id(5, 5),
        with_id("5", 6),          # 5 and "5" are one id once written as a string
    ]
    acc, got = import_local(tmp_path, store, records)
    assert [(r.source_id, r.messages[1].content) for r in got] == [
        ("a", "What is 1 + 1?"), ("b", "What is 3 + 3?"), ("5", "What is 5 + 5?")]
    assert acc.skips_by_reason == {"duplicate_id": 3, "duplicate": 2} and acc.failed == 0
    assert "id 'a' was used by an earlier record with other content" in acc.examples["duplicate_id"][0]
    assert acc.examples["duplicate_id"][0].startswith(join(str(tmp_path / "external"), "x.jsonl") + ":2: ")


def test_refuse_mode_counts_repeated_ids_as_failures(tmp_path, store: ObjectStore) -> None:  # type: ignore[no-untyped-def]
    records = [with_id(i % 8, i) for i in range(10)]  # ids 0 and 1 come back with other content
    acc, got = import_local(tmp_path, store, records, on_duplicate_id="refuse", max_bad_fraction=0.25)
    assert len(got) == 8 and acc.failures_by_reason == {"duplicate_id": 2} and acc.skipped == 0
    with pytest.raises(BadInputError, match="2 of 10 records") as err:
        import_local(tmp_path / "strict", store, records, on_duplicate_id="refuse", max_bad_fraction=0.1)
    assert err.value.counts == {"duplicate_id": 2}


def test_import_config_builds_the_spec_it_documents() -> None:
    config = ImportConfig(source="s", output="o", on_duplicate_id="refuse", id_field="uuid",
                          prompt_field="question", response_field="answer")
    spec = config.spec(Kind.completions)
    assert spec.on_duplicate_id == "refuse"
    assert spec.layout == Layout(id_field="uuid", prompt_field="question", response_field="answer")
    with pytest.raises(ValueError, match="response_field is set without prompt_field"):
        ImportConfig(source="s", output="o", response_field="answer")
    with pytest.raises(ValueError, match="one layout"):
        ImportConfig(source="s", output="o", messages_field="turns", prompt_field="q")


def _sampled(tmp_path, store: ObjectStore, records: list, files: int, count: int, sample: int | None,  # type: ignore[no-untyped-def]
             name: str) -> tuple:
    """Import `records` spread over `files` files with `count` workers, keeping a sample of `sample`."""
    prefix, out = str(tmp_path / f"src-{name}"), str(tmp_path / f"out-{name}")
    for f in range(files):
        store.write_bytes(join(prefix, f"part-{f}.jsonl"), jsonl(records[f::files]))
    spec = ImportSpec(kind=Kind.prompts, source_prefix=prefix, output_prefix=out, run_id="r", sample_records=sample)
    for index in range(count):
        run_import(store, spec, PRODUCER, index=index, count=count)
    manifest = load_manifest(store, out, Kind.prompts).manifest
    return manifest.accounting, {r.id for r in read_records(store, out, Kind.prompts, PromptRecord)}


def test_a_sample_is_drawn_by_content_hash_whatever_the_files_and_counted(tmp_path, store: ObjectStore) -> None:  # type: ignore[no-untyped-def]
    from dflash_shared.importing import sample_key

    records = [conversation(i) for i in range(120)]
    _, every = _sampled(tmp_path, store, records, files=1, count=1, sample=None, name="all")
    acc, kept = _sampled(tmp_path, store, records, files=1, count=1, sample=16, name="one")
    # The 16 records of lowest key, the rest counted as skipped: nothing vanishes from the accounting.
    assert kept == set(sorted(every, key=sample_key)[:16])
    assert acc.input_records == 120 and acc.succeeded == 16 and acc.skips_by_reason == {"sampled_out": 104}
    # The same sample from the files in another order and split.
    _, again = _sampled(tmp_path, store, records[::-1], files=3, count=1, sample=16, name="reordered")
    assert again == kept
    # Any number of workers draw the same sample: one of them reads every record, still counting each.
    for files, count in ((4, 2), (1, 3)):
        acc2, split = _sampled(tmp_path, store, records, files=files, count=count, sample=16, name=f"{files}-{count}")
        assert split == kept and acc2.succeeded == 16 and acc2.skipped == 104


def test_a_sample_larger_than_the_source_fails_naming_what_it_holds(tmp_path, store: ObjectStore) -> None:  # type: ignore[no-untyped-def]
    records = [conversation(i) for i in range(30)] + [conversation(3), b"not json"]
    with pytest.raises(ConfigError, match="the sample kept 30 records, fewer than sample_records 40") as err:
        _sampled(tmp_path, store, records, files=1, count=2, sample=40, name="short")
    assert "30 usable records of the 32 read (1 duplicate, 1 malformed_record)" in str(err.value)
    assert not store.exists(join(str(tmp_path / "out-short"), "manifest.json"))


def _import_with(store: ObjectStore, source: str, out: str, workers: int) -> tuple:
    spec = ImportSpec(kind=Kind.completions, source_prefix=source, output_prefix=out, run_id="r")
    outcomes = [run_import(store, spec, PRODUCER, index=i, count=workers) for i in range(workers)]
    assert outcomes[-1] is not None
    manifest = load_manifest(store, out, Kind.completions).manifest
    return manifest, sorted(r.source for r in read_records(store, out, Kind.completions, CompletionRecord))


@pytest.mark.parametrize("layout", ["jsonl", "parquet", "jsonl.zst"])
def test_one_file_is_striped_over_every_worker_with_the_same_records_as_one_worker(  # type: ignore[no-untyped-def]
        tmp_path, store: ObjectStore, layout: str, caplog) -> None:
    import zstandard

    rows = [conversation(i, answer=str(2 * i)) for i in range(90)]
    if layout == "parquet":
        payload = parquet(rows)
    else:
        # Repeated lines and a malformed one: each is counted once, in whichever stripe it falls.
        payload = jsonl([*rows, rows[5], rows[5], b"{broken"])
        if layout == "jsonl.zst":
            payload = zstandard.ZstdCompressor().compress(payload)
    source = str(tmp_path / f"one.{layout}")
    store.write_bytes(source, payload)
    alone, records = _import_with(store, source, str(tmp_path / "alone"), 1)
    caplog.set_level("INFO")
    striped, striped_records = _import_with(store, source, str(tmp_path / "striped"), 4)
    assert striped_records == records and striped.accounting == alone.accounting
    # Every worker had a stripe of the file and wrote records from it.
    assert "processing 0 of" not in caplog.text
    assert sorted(caplog.text.count(f"shard {i}/4] processing 1 of 4 items") for i in range(4)) == [1, 1, 1, 1]
    assert len(striped.shards) == 4 and all(shard.records > 0 for shard in striped.shards)
    if layout != "parquet":
        assert alone.accounting.skips_by_reason == {"duplicate": 2}
        assert alone.accounting.failures_by_reason == {"malformed_record": 1}


def test_a_truncated_file_is_counted_once_whatever_the_stripes(tmp_path, store: ObjectStore) -> None:  # type: ignore[no-untyped-def]
    import zstandard

    # Digests do not compress, so half of the file holds many whole reads of records before the break.
    rows = [conversation(i, answer=hashlib.sha256(b"%d" % i).hexdigest()) for i in range(4000)]
    whole = zstandard.ZstdCompressor().compress(jsonl(rows))
    source = str(tmp_path / "cut.jsonl.zst")
    store.write_bytes(source, whole[: len(whole) // 2])
    alone, _ = _import_with(store, source, str(tmp_path / "alone"), 1)
    striped, _ = _import_with(store, source, str(tmp_path / "striped"), 3)
    assert striped.accounting.failures_by_reason == alone.accounting.failures_by_reason == {"unreadable_file": 1}
    assert striped.accounting.input_records == alone.accounting.input_records > 1000


@pytest.mark.parametrize("vocab", ["qwen3", "qwen3_6"])
def test_prompts_are_counted_with_the_targets_template_and_an_over_long_one_is_refused(  # type: ignore[no-untyped-def]
        tmp_path, store: ObjectStore, vocab: str) -> None:
    """Each prompt's tokens as generate renders it (chat template, thinking mode, generation prompt): summed in the
    manifest, the longest kept, and a prompt over max_prompt_tokens refused at import with its count."""
    from dflash_shared.chat_render import ChatRenderer
    from dflash_shared.importing import ImportConfig
    from dflash_shared.manifests import PromptsSection
    from tests.support.qwen_assets import shared_tokenizer_dir

    tokenizer = str(shared_tokenizer_dir(vocab))  # type: ignore[arg-type]
    long_question = "why " * 300
    records = [conversation(i) for i in range(40)] + [{"messages": [{"role": "user", "content": long_question}]}]
    store.write_bytes(str(tmp_path / "prompts.jsonl"), jsonl(records))
    render = ChatRenderer(tokenizer, enable_thinking=True)
    expected = [len(render([Message(**m) for m in r["messages"]], None)) for r in records[:40]]
    too_long = len(render([Message(role="user", content=long_question)], None))
    assert max(expected) < 100 < too_long
    config = ImportConfig(source=str(tmp_path / "prompts.jsonl"), output=str(tmp_path / "out"), run_id="r",
                          tokenizer=tokenizer, max_prompt_tokens=100)
    for index in range(2):  # striped over two workers: the counts are the whole import's
        run_import(store, config.spec(Kind.prompts), PRODUCER, index=index, count=2)
    manifest = load_manifest(store, str(tmp_path / "out"), Kind.prompts).manifest
    assert isinstance(manifest.section, PromptsSection)
    assert (manifest.section.prompt_tokens, manifest.section.longest_prompt_tokens) == (sum(expected), max(expected))
    assert manifest.accounting.failures_by_reason == {"prompt_too_long": 1}
    assert f"prompt of {too_long:,} tokens, more than max_prompt_tokens 100" in \
        manifest.accounting.examples["prompt_too_long"][0]
    with pytest.raises(ValueError, match="max_prompt_tokens is set without tokenizer"):
        ImportConfig(source="s", output="o", max_prompt_tokens=100)
    with pytest.raises(ConfigError, match="leave --tokenizer out"):
        config.spec(Kind.completions)


def test_a_counted_sample_counts_only_the_prompts_it_draws_and_replaces_a_too_long_one(  # type: ignore[no-untyped-def]
        tmp_path, store: ObjectStore) -> None:
    """A pilot's sample reads every record but counts only the drawn prompts (counting every one would cost the
    pilot's single import pod minutes on a large source); a drawn prompt that is too long gives its place to the
    next candidate, and is counted as a failure."""
    from dflash_shared.importing import ImportConfig, sample_key
    from tests.support.qwen_assets import shared_tokenizer_dir

    records = [conversation(i) for i in range(60)]

    def lengthened(record: dict, times: int) -> dict:
        return {"messages": [record["messages"][0],
                             {"role": "user", "content": record["messages"][1]["content"] * times}]}

    # One record made too long such that its new content has the lowest key of all: the first the sample draws.
    for times in range(60, 200):
        keys = [sample_key(_id_of(r)) for r in records]
        longest_first = min(range(60), key=lambda i: sample_key(_id_of(lengthened(records[i], times))))
        if sample_key(_id_of(lengthened(records[longest_first], times))) < min(
                k for i, k in enumerate(keys) if i != longest_first):
            break
    else:
        raise AssertionError("no lengthening gives a record the lowest key")
    long_records = [lengthened(r, times) if i == longest_first else r for i, r in enumerate(records)]
    store.write_bytes(str(tmp_path / "long.jsonl"), jsonl(long_records))
    counted = ImportConfig(source=str(tmp_path / "long.jsonl"), output=str(tmp_path / "counted"), run_id="r",
                           sample_records=8, tokenizer=str(shared_tokenizer_dir("qwen3")), max_prompt_tokens=120)
    run_import(store, counted.spec(Kind.prompts), PRODUCER)
    manifest = load_manifest(store, str(tmp_path / "counted"), Kind.prompts).manifest
    acc = manifest.accounting
    assert (acc.succeeded, acc.failures_by_reason, acc.input_records) == (8, {"prompt_too_long": 1}, 60)
    assert acc.skips_by_reason == {"sampled_out": 51}
    assert manifest.section.prompt_tokens is not None and manifest.section.longest_prompt_tokens <= 120  # type: ignore[union-attr]


def _id_of(record: dict) -> str:
    from dflash_shared.importing import to_prompt

    return to_prompt([Message(**m) for m in record["messages"]], "x", None).id
