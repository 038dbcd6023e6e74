"""Hugging Face datasets and chat layouts as import sources, on datasets built in the test (no network)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest

from dflash_shared import dataset_sources
from dflash_shared.conversations import RecordError
from dflash_shared.dataset_sources import HubDataset, load_hub, parse_hub_source
from dflash_shared.errors import BadInputError, ConfigError, exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.importing import ImportConfig, import_share, list_sources, run_import
from dflash_shared.jsonl import iter_lines
from dflash_shared.layouts import Layout
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind, Producer
from dflash_shared.records import CompletionRecord, PromptRecord
from dflash_shared.runner import config_shard
from dflash_shared.settings import parse_settings
from dflash_shared.storage import ObjectStore, join

PRODUCER = Producer(stage="import")


def chat(i: int) -> dict[str, Any]:
    return {"id": f"c{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                        {"role": "assistant", "content": f"It is {2 * i}."}]}


def sharegpt(i: int) -> dict[str, Any]:
    return {"id": i, "conversations": [{"from": "system", "value": "Be brief."},
                                       {"from": "human", "value": f"Name {i}"},
                                       {"from": "gpt", "value": f"Name {i}."}]}


def imported(store: ObjectStore, out: str, kind: Kind = Kind.completions) -> tuple[Any, list[Any]]:
    loaded = load_manifest(store, out, kind)
    model = PromptRecord if kind is Kind.prompts else CompletionRecord
    records = [model.model_validate_json(line) for shard in loaded.manifest.shards
               for _, line in iter_lines(store, shard.uri)]
    return loaded.manifest.accounting, records


def run(store: ObjectStore, source: str, out: str, kind: Kind = Kind.completions, index: int = 0, count: int = 1,
        **fields: Any) -> str | None:
    spec = ImportConfig(source=source, output=out, run_id="r", **fields).spec(kind)
    return run_import(store, spec, PRODUCER, index, count)


def quiet_datasets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """datasets' cache in the test's folder, and the Hub offline: a test that reached it would fail."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    datasets.disable_progress_bars()


# --- layouts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"prompt": "P", "response": "R", "system": "S"}, [("system", "S"), ("user", "P"), ("assistant", "R")]),
        ({"instruction": "Sum", "input": "1 2", "output": "3"}, [("user", "Sum\n\n1 2"), ("assistant", "3")]),
        ({"instruction": "Sum", "input": "", "output": "3"}, [("user", "Sum"), ("assistant", "3")]),
        ({"question": "Q?", "answer": None}, [("user", "Q?")]),  # a prompt without its answer
    ],
)
def test_pair_layouts_become_turns(row: dict[str, Any], expected: list[tuple[str, str]]) -> None:
    obj, source_id = Layout().conversation({**row, "id": 3})
    assert [(t["role"], t["content"]) for t in obj["messages"]] == expected and source_id == "3"


def test_configured_fields_win_over_recognised_ones() -> None:
    layout = Layout(id_field="uid", prompt_field="q", response_field="a", system_field="sys")
    obj, source_id = layout.conversation({"uid": False, "q": "Q", "a": "A", "sys": "S", "prompt": "ignored",
                                          "messages": [{"role": "user", "content": "ignored too"}]})
    assert [t["content"] for t in obj["messages"]] == ["S", "Q", "A"] and source_id == "false"
    obj, _ = Layout(messages_field="turns").conversation({"turns": [{"role": "user", "content": "T"}]})
    assert obj["messages"] == [{"role": "user", "content": "T"}]
    with pytest.raises(RecordError, match="no 'q' column"):
        layout.conversation({"prompt": "P"})
    with pytest.raises(RecordError, match="column 'prompt' is a int, not text"):
        Layout().conversation({"prompt": 5, "response": "R"})


# --- a folder written by save_to_disk, and a folder of Parquet files ----------------------------


def copy_tree(store: ObjectStore, local: Path, prefix: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            store.write_bytes(join(prefix, str(path.relative_to(local))), path.read_bytes())


def test_saved_dataset_on_both_backends(tmp_path: Path, storage_root: str, store: ObjectStore,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_datasets(monkeypatch, tmp_path)
    robot = {"id": "c50", "messages": [{"role": "robot", "content": "beep"}]}  # malformed: no such role
    rows = [chat(i) for i in range(30)] + [chat(3), {**chat(40), "id": "c5"}, robot]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), max_shard_size="2KB")
    (tmp_path / "saved" / "cache-0123456789abcdef.arrow").write_bytes(b"left by .map(): not part of the data")
    source = join(storage_root, "saved")
    copy_tree(store, tmp_path / "saved", source)
    files = list_sources(store, source)
    assert len(files) > 1 and all("/data-" in f for f in files)  # state.json's files only, in its order
    run(store, source, join(storage_root, "out"), max_bad_fraction=0.1)
    acc, records = imported(store, join(storage_root, "out"))
    assert (acc.succeeded, acc.skips_by_reason, acc.failures_by_reason) == (
        30, {"duplicate": 1, "duplicate_id": 1}, {"malformed_record": 1})
    assert [r.source_id for r in records] == [f"c{i}" for i in range(30)]
    # Each record names the Arrow file and its row there.
    assert records[0].source == f"{files[0]}#0"
    first_of_second = sum(1 for r in records if r.source and r.source.startswith(files[0] + "#"))
    assert records[first_of_second].source == f"{files[1]}#0"


def test_saved_dataset_dict_names_its_splits(tmp_path: Path, store: ObjectStore,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_datasets(monkeypatch, tmp_path)
    split = datasets.Dataset.from_list([chat(0)])
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(BadInputError, match=r"splits \['train', 'test'\]: point the source at one split's folder"):
        list_sources(store, str(tmp_path / "dict"))
    assert run(store, str(tmp_path / "dict" / "test"), str(tmp_path / "out")) is not None


def test_parquet_folder_in_sharegpt_layout(tmp_path: Path, store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_datasets(monkeypatch, tmp_path)
    folder = tmp_path / "parquet" / "data"
    folder.mkdir(parents=True)
    for part in range(2):
        rows = [sharegpt(i) for i in range(part * 5, part * 5 + 5)]
        datasets.Dataset.from_list(rows).to_parquet(str(folder / f"train-{part:05d}-of-00002.parquet"))
    run(store, str(tmp_path / "parquet"), str(tmp_path / "out"), kind=Kind.prompts)
    _, records = imported(store, str(tmp_path / "out"), Kind.prompts)
    assert [r.source_id for r in records] == [str(i) for i in range(10)]
    assert [m.role for m in records[0].messages] == ["system", "user"]  # the answer is what generate writes
    assert records[6].source == f"{folder / 'train-00001-of-00002.parquet'}#1"


def test_prompt_response_columns_by_name(tmp_path: Path, store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_datasets(monkeypatch, tmp_path)
    rows = [{"uid": 100 + i, "query": f"Why {i}?", "reply": f"Because {i}.", "prompt": "not this one"}
            for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    run(store, str(tmp_path / "saved"), str(tmp_path / "out"), id_field="uid", prompt_field="query",
        response_field="reply")
    _, records = imported(store, str(tmp_path / "out"))
    assert [(r.source_id, r.messages[0].content, r.final_assistant.content) for r in records][:2] == [
        ("100", "Why 0?", "Because 0."), ("101", "Why 1?", "Because 1.")]


# --- the Hub -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("hf://org/name@v1.0:test", HubDataset("org/name", "v1.0", "test")),
        ("hf://org/name@0123abcd", HubDataset("org/name", "0123abcd", "train")),
        ("hf://org/name/en@refs/pr/3:train_sft", HubDataset("org/name", "refs/pr/3", "train_sft", "en")),
    ],
)
def test_hub_sources_parse(source: str, expected: HubDataset) -> None:
    assert parse_hub_source(source) == expected
    assert parse_hub_source(expected.uri) == expected


@pytest.mark.parametrize("source", ["hf://org/name", "hf://org/name:train", "hf://name@v1", "hf://org/name@v1:a:b"])
def test_malformed_hub_sources_say_the_form(source: str) -> None:
    with pytest.raises(ConfigError, match=r"hf://org/name\[/config\]@revision\[:split\]"):
        parse_hub_source(source)


def test_hub_dataset_is_loaded_pinned_with_the_token_and_sharded(
    tmp_path: Path, store: ObjectStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    quiet_datasets(monkeypatch, tmp_path)
    # A folder named like the repo: datasets reads it in place of the Hub; only the download is left out.
    repo = tmp_path / "hub" / "org" / "name" / "data"
    repo.mkdir(parents=True)
    datasets.Dataset.from_list([chat(i) for i in range(7)]).to_parquet(str(repo / "train-00000-of-00001.parquet"))
    monkeypatch.chdir(tmp_path / "hub")
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    real = datasets.load_dataset

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    monkeypatch.setattr(dataset_sources, "ROWS_PER_ITEM", 3)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    load_hub.cache_clear()
    out = str(tmp_path / "out")
    source = "hf://org/name@v1.0:train"
    assert list_sources(store, source) == [
        f"{source}#rows-000000000000-000000000003", f"{source}#rows-000000000003-000000000006",
        f"{source}#rows-000000000006-000000000007"]
    assert run(store, source, out, index=0, count=2) is None
    load_hub.cache_clear()  # the second worker is another process, started by the CLI
    caplog.set_level(logging.INFO)
    config = parse_settings(ImportConfig, ["--source", source, "--output", out, "--run-id", "r", "--shard-index", "1",
                                           "--num-shards", "2"])
    import_share(config, store, Kind.completions, ["dflash-shared"], config_shard(config))
    load_hub.cache_clear()
    assert calls[0] == (("org/name", None), {"revision": "v1.0", "split": "train", "token": "hf_not_a_real_token"})
    assert len(calls) == 2  # once per worker: listing and reading share the load
    _, records = imported(store, out)
    # Worker 0 read rows 0-2 and 6, worker 1 rows 3-5; each record names its row in the split.
    assert [r.source for r in records] == [f"{source}#{i}" for i in (0, 1, 2, 6, 3, 4, 5)]
    assert [r.source_id for r in records] == [f"c{i}" for i in (0, 1, 2, 6, 3, 4, 5)]
    # The manifest records the resolved config, which has no token field; no file and no log line has it.
    manifest = json.loads(store.read_bytes(join(out, "manifest.json")))
    assert manifest["producer"]["config"]["source"] == source
    assert b"hf_not_a_real_token" not in b"".join(store.read_bytes(uri) for uri in store.list(out))
    assert "hf_not_a_real_token" not in caplog.text and "rows-000000000003" in caplog.text


def test_hub_source_without_datasets_says_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ImportError
    load_hub.cache_clear()
    with pytest.raises(ConfigError, match=r"install datasets \(pip install datasets\)"):
        list_sources(ObjectStore(), "hf://org/name@v1")


@pytest.mark.parametrize("error", ["DatasetNotFoundError", "RevisionNotFoundError", "ValueError"])
def test_a_hub_dataset_that_does_not_exist_is_a_configuration_mistake(
        monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    """A misnamed dataset, revision or split used to exit 1 (a Job retried it); a network failure still may."""
    kind = ValueError if error == "ValueError" else type(error, (Exception,), {})

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise kind('Unknown split "tain". Should be one of ["train"].')

    monkeypatch.setattr(datasets, "load_dataset", missing)
    load_hub.cache_clear()
    with pytest.raises(ConfigError, match=r"source hf://org/name@v1:tain: .*check the dataset's name") as err:
        list_sources(ObjectStore(), "hf://org/name@v1:tain")
    assert exit_code_for(err.value) is ExitCode.USAGE
    load_hub.cache_clear()


def test_a_hub_that_cannot_be_reached_is_not_blamed_on_the_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("Couldn't reach 'org/name' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    load_hub.cache_clear()
    with pytest.raises(ConnectionError):
        list_sources(ObjectStore(), "hf://org/name@v1")
    load_hub.cache_clear()
