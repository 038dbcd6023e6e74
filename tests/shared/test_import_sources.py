"""`import` sources as users have them: a single file, a stage's output prefix read through its manifest, another
run's completions copied with their token ids, and the mistakes among them named with exit 64 (never 1)."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_shared.errors import BadInputError, ConfigError, exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.importing import ImportSpec, run_import
from dflash_shared.jsonl import iter_lines
from dflash_shared.manifest_io import load_manifest, manifest_uri
from dflash_shared.manifests import CompletionsSection, Kind, Producer, SpecialTokens, TargetIdentity
from dflash_shared.records import CompletionRecord, Message, PromptRecord, record_id
from dflash_shared.storage import ObjectStore, join
from tests.support.jsonl_manifests import write_jsonl_manifest

REPO = Path(__file__).resolve().parents[2]
PRODUCER = Producer(stage="import")
TARGET = TargetIdentity(model_id="Qwen/Qwen3-8B", tokenizer_sha256="t" * 64, chat_template_sha256="c" * 64,
                        enable_thinking=True, special_tokens=SpecialTokens(end_of_turn=7))


def chat(i: int) -> dict[str, object]:
    return {"id": i, "messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                  {"role": "assistant", "content": f"It is {2 * i}."}]}


def jsonl(n: int) -> bytes:
    return b"".join(json.dumps(chat(i)).encode() + b"\n" for i in range(n))


def records(store: ObjectStore, prefix: str, kind: Kind, model: type) -> list:
    loaded = load_manifest(store, prefix, kind)
    return [model.model_validate_json(line) for shard in loaded.manifest.shards
            for _, line in iter_lines(store, shard.uri)]


def imported(store: ObjectStore, source: str, out: str, kind: Kind = Kind.completions) -> str:
    assert run_import(store, ImportSpec(kind=kind, source_prefix=source, output_prefix=out, run_id="r"), PRODUCER)
    return out


@pytest.mark.parametrize("name", ["my-prompts.jsonl", "my-prompts.jsonl.gz", "my-prompts.parquet"])
def test_a_single_file_is_a_source(storage_root: str, store: ObjectStore, name: str) -> None:
    source = join(storage_root, "in", name)
    data = jsonl(5)
    if name.endswith(".gz"):
        data = gzip.compress(data)
    elif name.endswith(".parquet"):
        sink = io.BytesIO()
        pq.write_table(pa.Table.from_pylist([{**chat(i), "id": str(i)} for i in range(5)]), sink)
        data = sink.getvalue()
    store.write_bytes(source, data)
    store.write_bytes(join(storage_root, "in", "other.jsonl"), jsonl(3))  # beside it, not part of the source
    out = imported(store, source, join(storage_root, "completions"))
    got = records(store, out, Kind.completions, CompletionRecord)
    assert [r.source_id for r in got] == [str(i) for i in range(5)]
    assert all(r.source and r.source.startswith(source) for r in got)


def test_a_missing_or_unreadable_file_is_a_configuration_mistake(storage_root: str, store: ObjectStore) -> None:
    out = join(storage_root, "out")
    with pytest.raises(ConfigError, match="does not exist: check --source") as missing:
        imported(store, join(storage_root, "typo.jsonl"), out)
    assert exit_code_for(missing.value) is ExitCode.USAGE
    store.write_bytes(join(storage_root, "alpaca.json"), json.dumps([chat(1), chat(2)]).encode())
    with pytest.raises(ConfigError, match=r"a \.json file is one JSON document.*jq -c"):
        imported(store, join(storage_root, "alpaca.json"), out)
    store.write_bytes(join(storage_root, "data.csv"), b"a,b\n")
    with pytest.raises(ConfigError, match="is a file import cannot read"):
        imported(store, join(storage_root, "data.csv"), out)


def test_json_files_in_a_prefix_are_not_read(storage_root: str, store: ObjectStore) -> None:
    folder = join(storage_root, "chats")
    store.write_bytes(join(folder, "notes.json"), b'{"not": "a conversation"}')
    with pytest.raises(BadInputError, match=r"1 \.json file\(s\) were not read"):
        imported(store, folder, join(storage_root, "out"))
    store.write_bytes(join(folder, "a.jsonl"), jsonl(4))
    out = imported(store, folder, join(storage_root, "out"))
    assert load_manifest(store, out, Kind.completions).manifest.accounting.input_records == 4


def test_a_stage_prefix_is_read_through_its_manifest(storage_root: str, store: ObjectStore) -> None:
    """Another import's output as a source: its data shards, never its manifest.json or _markers/ (which used to
    be read as 123 malformed records of 125), and the new manifest names the old one by sha256."""
    store.write_bytes(join(storage_root, "chats", "a.jsonl"), jsonl(6))
    first = imported(store, join(storage_root, "chats"), join(storage_root, "run1", "completions"))
    for n, source in enumerate((first, manifest_uri(first))):
        out = imported(store, source, join(storage_root, f"run{n + 2}", "completions"))
        loaded = load_manifest(store, out, Kind.completions)
        assert loaded.manifest.accounting.failed == 0 and loaded.manifest.accounting.succeeded == 6
        origin = load_manifest(store, first, Kind.completions)
        assert [(i.uri, i.sha256, i.kind) for i in loaded.manifest.inputs] == [
            (origin.uri, origin.sha256, Kind.completions)]
        assert records(store, out, Kind.completions, CompletionRecord) == records(
            store, first, Kind.completions, CompletionRecord)


def generated(n: int) -> list[CompletionRecord]:
    out = []
    for i in range(n):
        messages = (Message(role="user", content=f"Question {i}?"), Message(role="assistant", content=f"Answer {i}."))
        out.append(CompletionRecord(id=record_id(messages[:1]), messages=messages, prompt_token_ids=(1, 2, i),
                                    completion_token_ids=(3, 4, 5, 7), finish_reason="stop", enable_thinking=True,
                                    source=f"chats.jsonl:{i + 1}", source_id=f"user-{i}"))
    return out


def test_another_runs_completions_are_copied_with_their_token_ids(storage_root: str, store: ObjectStore) -> None:
    """The way to retrain on existing completions: `[source] kind = "completions"`, uri = their prefix. Each
    record is copied as the engine wrote it (token ids, finish reason, source id), the section keeps the target
    identity, so tokenize runs token_exact and checks the tokenizer against it, and lineage names the source."""
    section = CompletionsSection(target=TARGET, has_token_ids=True, sampling={"temperature": 0.6},
                                 max_new_tokens=64, max_model_len=128, output_tokens=999,
                                 throughput={"engine_seconds": 9.0}, training_window=128)
    source = write_jsonl_manifest(store, join(storage_root, "run1", "completions"), generated(10),
                                  kind=Kind.completions, producer="generate", section=section, shards=2)
    out = imported(store, source, join(storage_root, "run2", "completions"))
    loaded = load_manifest(store, out, Kind.completions)
    copied = loaded.manifest.section
    assert isinstance(copied, CompletionsSection)
    assert copied.target == TARGET and copied.has_token_ids and copied.sampling == {"temperature": 0.6}
    assert copied.output_tokens == 40 and copied.throughput == {}  # the copy's own count, not the engine's time
    assert sorted(records(store, out, Kind.completions, CompletionRecord), key=lambda r: r.id) == sorted(
        generated(10), key=lambda r: r.id)
    assert loaded.manifest.inputs[0].uri == manifest_uri(source)

    # As prompts (regenerating with a new target), the answers go and the user's ids stay.
    prompts = imported(store, source, join(storage_root, "run3", "prompts"), kind=Kind.prompts)
    got = records(store, prompts, Kind.prompts, PromptRecord)
    assert sorted(r.source_id for r in got) == sorted(f"user-{i}" for i in range(10))
    assert all(r.messages[-1].role == "user" for r in got)


def test_sources_that_hold_no_conversations_are_refused(storage_root: str, store: ObjectStore) -> None:
    store.write_bytes(join(storage_root, "chats", "a.jsonl"), jsonl(3))
    prompts = imported(store, join(storage_root, "chats"), join(storage_root, "prompts"), kind=Kind.prompts)
    with pytest.raises(ConfigError, match="is a prompts manifest, whose records have no answers"):
        imported(store, prompts, join(storage_root, "out"))
    # A stage that has not finished: markers but no manifest yet.
    unfinished = join(storage_root, "unfinished")
    store.write_bytes(join(unfinished, "data", "part-00000-0000.jsonl.zst"), b"")
    store.write_bytes(join(unfinished, "_markers", "shard-00000-of-00002.json"), b"{}")
    with pytest.raises(BadInputError, match="has not finished"):
        imported(store, unfinished, join(storage_root, "out"))
    # A shard its manifest lists but the store lacks: that input's fault (65), not a failure a retry heals (1).
    completions = imported(store, join(storage_root, "chats"), join(storage_root, "completions"))
    store.delete(load_manifest(store, completions, Kind.completions).manifest.shards[0].uri)
    with pytest.raises(BadInputError, match="a shard of the source's completions manifest, is missing"):
        imported(store, completions, join(storage_root, "copy"))


@pytest.mark.slow
def test_the_command_imports_a_single_file_locally_and_from_s3(tmp_path: Path, s3_bucket: str,
                                                              store: ObjectStore) -> None:
    """Used to exit 1 (RETRYABLE: "not a directory") locally and 65 ("no .jsonl ... files under") on S3."""
    local = tmp_path / "my-prompts.jsonl"
    local.write_bytes(jsonl(5))
    remote = join(s3_bucket, "my-prompts.jsonl")
    store.write_bytes(remote, jsonl(5))
    for source, out in ((str(local), str(tmp_path / "out")), (remote, join(s3_bucket, "runs", "r", "completions"))):
        proc = subprocess.run([sys.executable, "-m", "dflash_tokenize", "import", "--source", source, "--output", out],
                              capture_output=True, text=True, cwd=REPO, env=os.environ.copy(), timeout=120,
                              check=False)
        assert proc.returncode == 0, proc.stderr
        assert "left out nothing: 5 of 5 records kept" in proc.stderr


def test_openai_text_parts_are_joined_with_a_newline_and_sharegpt_roles_are_read() -> None:
    """As vLLM's chat server joins a message's text parts for a string template ("What is in" + "this log?" must
    not become "What is inthis log?"); ShareGPT's role names are aliases, an unknown role is malformed."""
    from dflash_shared.conversations import RecordError, parse_messages

    parts = [{"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "text", "text": "this log?"}]
    (user, answer) = parse_messages({"messages": [{"role": "human", "content": parts},
                                                  {"role": "gpt", "content": "Nothing."}]})
    assert (user.role, user.content) == ("user", "What is in\nthis log?")
    assert answer.role == "assistant"
    with pytest.raises(RecordError, match="role"):
        parse_messages({"messages": [{"role": "narrator", "content": "x"}]})
