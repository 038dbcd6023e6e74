"""`stage-model` (dflash_pipeline.staging.stage_model) against a real S3 endpoint (the moto server of
tests/conftest.py).

A tiny model folder is made per test: config.json, two safetensors shards (one above the 5 MiB part size, so its
upload is multipart) with their index, tokenizer.json and a chat template.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from dflash_pipeline.run.config import read_run_file
from dflash_pipeline.staging.model_listing import LISTING_NAME, PARTIAL_NAME
from dflash_pipeline.staging.stage_model import run_stage_model, stage_model_dir
from dflash_shared.errors import BadInputError, ConfigError, exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.model_copy import COMPLETE_MARKER, fetch_model
from dflash_shared.storage import ObjectStore, StorageError, join
from tests.pipeline.k8s_support import EXAMPLE_RUN, REPO_ROOT

PART = 5 * 2**20
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
NAMES = sorted(["config.json", *SHARDS, "model.safetensors.index.json", "tokenizer.json", "chat_template.jinja"])


def _safetensors(name: str, raw: bytes) -> bytes:
    header = json.dumps({name: {"dtype": "U8", "shape": [len(raw)], "data_offsets": [0, len(raw)]}}).encode()
    return len(header).to_bytes(8, "little") + header + raw


def _model_dir(root: Path, name: str = "tiny") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
    (folder / SHARDS[0]).write_bytes(_safetensors("a.weight", os.urandom(300_000)))
    (folder / SHARDS[1]).write_bytes(_safetensors("b.weight", os.urandom(PART + 2**20)))
    weight_map = {"a.weight": SHARDS[0], "b.weight": SHARDS[1]}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {}}')
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (folder / ".cache").mkdir()  # what `huggingface-cli download --local-dir` leaves: not part of the model
    (folder / ".cache" / "state").write_text("x")
    return folder


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def store(moto_endpoint: str) -> ObjectStore:
    """The smallest part size S3 allows, so the larger shard goes up in two parts."""
    return ObjectStore(part_size=PART)


def _spy(monkeypatch: pytest.MonkeyPatch, store: ObjectStore, *methods: str) -> list[tuple[str, str]]:
    """Record (method, last path segment) of each call to `methods` of the store."""
    calls: list[tuple[str, str]] = []
    for method in methods:
        real = getattr(store, method)

        def spy(*args: Any, _real: Any = real, _method: str = method) -> Any:
            uri = args[1] if _method == "upload_from" else args[0]
            calls.append((_method, uri.rsplit("/", 1)[-1]))
            return _real(*args)

        monkeypatch.setattr(store, method, spy)
    return calls


def _stored(store: ObjectStore, dest: str) -> list[str]:
    return [uri[len(dest) + 1:] for uri in store.list(dest)]


def test_staging_uploads_every_file_then_the_listing_and_a_rerun_skips_them(
        s3_bucket: str, store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    folder = _model_dir(tmp_path)
    dest = join(s3_bucket, "models", "tiny")
    calls = _spy(monkeypatch, store, "upload_from", "write_bytes", "sha256")
    result = stage_model_dir(store, str(folder), dest + "/", workers=3)
    assert result.uploaded == NAMES and result.files == len(NAMES)
    assert result.total_bytes == sum((folder / n).stat().st_size for n in NAMES)
    assert _stored(store, dest) == sorted([*NAMES, LISTING_NAME])  # no hidden file, no partial listing left
    # Every file was read back; the listing is the last write, after every upload.
    assert sorted(name for op, name in calls if op == "sha256") == NAMES
    assert calls[-1] == ("write_bytes", LISTING_NAME)
    listing = json.loads(store.read_bytes(join(dest, LISTING_NAME)))
    assert listing["source"] == str(folder) and listing["written_at"].endswith("Z")
    assert {f["name"]: (f["size"], f["sha256"]) for f in listing["files"]} == {
        n: ((folder / n).stat().st_size, _sha(folder / n)) for n in NAMES}
    assert all(f"uploaded {name}: " in caplog.text for name in NAMES)
    assert "MB/s" in caplog.text and f"staged {dest}: 6 files" in caplog.text

    calls.clear()
    caplog.clear()
    again = stage_model_dir(store, str(folder), dest, workers=3)
    assert again.uploaded == [] and again.uploaded_bytes == 0
    assert calls == []  # nothing uploaded, read back or rewritten: the listing vouches for every object
    assert all(f"kept {name}: " in caplog.text for name in NAMES)
    assert "already stored and verified" in caplog.text and "6 already there; listing" in caplog.text
    assert "dflash-model-files.json unchanged" in caplog.text


def test_a_corrupted_object_of_the_same_size_is_found_and_uploaded_again(
        s3_bucket: str, store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = _model_dir(tmp_path)
    dest = join(s3_bucket, "models", "tiny")
    stage_model_dir(store, str(folder), dest)
    bucket, key = dest[len("s3://"):].split("/", 1)
    size = (folder / SHARDS[1]).stat().st_size
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{key}/{SHARDS[1]}", Body=os.urandom(size))
    assert store.size(join(dest, SHARDS[1])) == size

    caplog.set_level(logging.INFO)
    result = stage_model_dir(store, str(folder), dest)
    assert result.uploaded == [SHARDS[1]]
    assert f"{SHARDS[1]}: the stored object has sha256" in caplog.text and "uploading it again" in caplog.text
    assert store.sha256(join(dest, SHARDS[1])) == _sha(folder / SHARDS[1])


def _fail_third_upload(monkeypatch: pytest.MonkeyPatch, store: ObjectStore) -> None:
    """The S3 client (below the storage layer) fails the third upload, as a dropped connection would."""
    real = store.client.upload_file
    count = [0]

    def upload_file(*args: Any, **kwargs: Any) -> None:
        count[0] += 1
        if count[0] == 3:
            response: Any = {"Error": {"Code": "InternalError", "Message": "we encountered an internal error"},
                             "ResponseMetadata": {"HTTPStatusCode": 500}}
            raise ClientError(response, "UploadPart")
        real(*args, **kwargs)

    monkeypatch.setattr(store.client, "upload_file", upload_file)


def test_an_interrupted_staging_resumes_with_what_it_had_verified(
        s3_bucket: str, store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    folder = _model_dir(tmp_path)
    dest = join(s3_bucket, "models", "tiny")
    with monkeypatch.context() as patch:
        _fail_third_upload(patch, store)
        with pytest.raises(StorageError, match="InternalError"):
            stage_model_dir(store, str(folder), dest, workers=1)
    # Not committed: no listing, the two verified files recorded in the partial one.
    assert _stored(store, dest) == sorted([*NAMES[:2], PARTIAL_NAME])
    partial = json.loads(store.read_bytes(join(dest, PARTIAL_NAME)))
    assert [f["name"] for f in partial["files"]] == NAMES[:2]

    caplog.set_level(logging.INFO)
    calls = _spy(monkeypatch, store, "sha256")
    result = stage_model_dir(store, str(folder), dest, workers=1)
    assert result.uploaded == NAMES[2:]
    assert sorted(name for _, name in calls) == NAMES[2:]  # the recorded two are trusted, not read again
    assert all(f"kept {name}: " in caplog.text for name in NAMES[:2])
    assert _stored(store, dest) == sorted([*NAMES, LISTING_NAME])


def test_stored_files_without_a_record_are_read_back_before_they_are_kept(
        s3_bucket: str, store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = _model_dir(tmp_path)
    dest = join(s3_bucket, "models", "tiny")
    for name in NAMES[:3]:  # a subset copied by other means, no listing at all
        store.upload_from(str(folder / name), join(dest, name))
    caplog.set_level(logging.INFO)
    result = stage_model_dir(store, str(folder), dest)
    assert result.uploaded == NAMES[3:]
    assert all(f"kept {name}: " in caplog.text for name in NAMES[:3])
    assert "already stored, read back: sha256 matches" in caplog.text


def test_the_staged_prefix_fetches_back_to_the_same_files(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    folder = _model_dir(tmp_path)
    dest = join(s3_bucket, "models", "tiny")
    stage_model_dir(store, str(folder), dest)
    local = Path(fetch_model(store, dest, str(tmp_path / "scratch")))
    fetched = {str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()}
    assert fetched == {*NAMES, LISTING_NAME, COMPLETE_MARKER}
    assert all((local / name).read_bytes() == (folder / name).read_bytes() for name in NAMES)


def test_store_to_store_copies_and_checks_the_source_listing(s3_bucket: str, store: ObjectStore,
                                                            tmp_path: Path) -> None:
    folder = _model_dir(tmp_path)
    first, second = join(s3_bucket, "models", "a"), join(s3_bucket, "models", "b")
    stage_model_dir(store, str(folder), first)
    assert run_stage_model(first, second, None, scratch=str(tmp_path / "scratch")) == ExitCode.OK
    assert _stored(store, second) == sorted([*NAMES, LISTING_NAME])
    assert json.loads(store.read_bytes(join(second, LISTING_NAME)))["source"] == first
    assert not any((tmp_path / "scratch").iterdir())  # the scratch copy is removed once staged

    # A source object that no longer matches its own listing is refused, not copied on.
    bucket, key = first[len("s3://"):].split("/", 1)
    boto3.client("s3").put_object(Bucket=bucket, Key=f"{key}/tokenizer.json",
                                  Body=b"x" * (folder / "tokenizer.json").stat().st_size)
    with pytest.raises(BadInputError, match="does not match its own dflash-model-files.json: tokenizer.json"):
        run_stage_model(first, join(s3_bucket, "models", "c"), None, scratch=str(tmp_path / "scratch"))


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: (d / "config.json").unlink(), "has no config.json: not a model directory"),
    (lambda d: [(d / s).unlink() for s in SHARDS], r"has no \*.safetensors weights"),
    (lambda d: (d / SHARDS[1]).unlink(), r"names 2 shard\(s\), 1 missing from the folder: model-00002-of-00002"),
    (lambda d: (d / SHARDS[0]).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n"),
     "is a Git LFS pointer"),
    (lambda d: (d / SHARDS[0]).write_bytes((d / SHARDS[0]).read_bytes()[:-10]), "cut short"),
])
def test_a_folder_that_is_not_a_whole_model_is_refused(s3_bucket: str, store: ObjectStore, tmp_path: Path,
                                                       damage: Any, message: str) -> None:
    folder = _model_dir(tmp_path)
    damage(folder)
    with pytest.raises(ConfigError, match=message):
        stage_model_dir(store, str(folder), join(s3_bucket, "models", "tiny"))
    assert store.list(s3_bucket) == []


def test_another_model_at_the_destination_is_refused_unless_replaced(s3_bucket: str, store: ObjectStore,
                                                                    tmp_path: Path) -> None:
    first, second = _model_dir(tmp_path, "first"), _model_dir(tmp_path, "second")
    dest = join(s3_bucket, "models", "tiny")
    stage_model_dir(store, str(first), dest)
    with pytest.raises(ConfigError, match=f"{dest} holds another model: its dflash-model-files.json .*differs"):
        stage_model_dir(store, str(second), dest)
    (second / "extra.txt").write_text("more")
    (second / "tokenizer.json").unlink()
    result = stage_model_dir(store, str(second), dest, replace=True)
    assert "chat_template.jinja" not in result.uploaded  # the same bytes in both: kept, not uploaded again
    assert _stored(store, dest) == sorted([*(n for n in NAMES if n != "tokenizer.json"), "extra.txt", LISTING_NAME])
    assert json.loads(store.read_bytes(join(dest, LISTING_NAME)))["source"] == str(second)

    # Objects nobody listed are another model's too.
    other = join(s3_bucket, "models", "other")
    store.write_bytes(join(other, "pytorch_model.bin"), b"weights")
    with pytest.raises(ConfigError, match="already holds 1 object.*pytorch_model.bin.*--replace"):
        stage_model_dir(store, str(first), other)


def _run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dflash_pipeline", "stage-model", *args], capture_output=True,
                          text=True, env=env, cwd=REPO_ROOT, timeout=120, check=False)


def test_the_command_refuses_a_folder_without_config_json(s3_bucket: str, tmp_path: Path) -> None:
    folder = _model_dir(tmp_path)
    (folder / "config.json").unlink()
    proc = _run_cli(["--from", str(folder), "--to", join(s3_bucket, "models", "tiny")], {**os.environ})
    assert proc.returncode == ExitCode.USAGE == 64, proc.stderr
    assert f"exit 64 (USAGE): --from {folder} has no config.json" in proc.stderr


def test_the_command_takes_destination_and_endpoint_from_the_run_file(s3_bucket: str, moto_endpoint: str,
                                                                      tmp_path: Path) -> None:
    folder = _model_dir(tmp_path)
    data = read_run_file(EXAMPLE_RUN)
    dest = join(s3_bucket, "models", "tiny")
    data["target"]["uri"] = dest
    data["storage"]["endpoint_url"] = moto_endpoint
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps(data), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    proc = _run_cli(["--config", str(run_file), "--from", str(folder)], env)
    assert proc.returncode == 0, proc.stderr
    assert f"S3 endpoint: {moto_endpoint} (from storage.endpoint_url of {run_file})" in proc.stderr
    assert "staged 6 files" in proc.stdout and dest in proc.stdout
    assert sorted(_stored(ObjectStore(), dest)) == sorted([*NAMES, LISTING_NAME])


def test_no_endpoint_and_no_credentials_are_the_storage_errors_named(
        s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model_dir(tmp_path)
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with monkeypatch.context() as patch:
        patch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        with pytest.raises(StorageError, match="S3 list_objects_v2 failed") as err:
            stage_model_dir(ObjectStore(max_attempts=1), str(folder), join(s3_bucket, "models", "tiny"))
    assert err.value.code == "EndpointConnectionError" and exit_code_for(err.value) is ExitCode.ENVIRONMENT
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageError, match="no S3 credentials found") as err:
        stage_model_dir(ObjectStore(max_attempts=1), str(folder), join(s3_bucket, "models", "tiny"))
    assert exit_code_for(err.value) is ExitCode.ENVIRONMENT
