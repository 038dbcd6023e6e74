"""Tests for dflash_shared.storage against a temp directory and a real moto S3 server."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import pytest

from dflash_shared.storage import (
    ObjectNotFoundError,
    ObjectStore,
    StorageError,
    is_s3,
    join,
)

MIB = 2**20
SECRET = "SentinelSecretKey0123456789abcdefDoNotLeak"
TOKEN = "SentinelSessionToken9876543210DoNotLeak"


def _bucket_of(uri: str) -> str:
    return uri[len("s3://") :].split("/", 1)[0]


def _open_uploads(endpoint: str, uri: str) -> list[str]:
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    uploads = client.list_multipart_uploads(Bucket=_bucket_of(uri)).get("Uploads", [])
    return [upload["Key"] for upload in uploads]


def test_join_and_is_s3() -> None:
    assert join("s3://b/p/", "/a/", "b//c") == "s3://b/p/a/b/c"
    assert join("s3://b", "k") == "s3://b/k"
    assert join("/tmp/x/", "y", "z.bin") == "/tmp/x/y/z.bin"
    assert join("rel", "/abs-looking") == "rel/abs-looking"
    assert join("/", "etc") == "/etc"
    assert join("s3://b/p") == "s3://b/p"
    assert is_s3("s3://b/k") and not is_s3("/data/s3://x") and not is_s3("rel/path")


def test_store_survives_pickling(storage_root: str, store: ObjectStore) -> None:
    uri = join(storage_root, "p.bin")
    store.write_bytes(uri, b"before")  # the original has a live client now
    copy = pickle.loads(pickle.dumps(store))
    assert copy.read_bytes(uri) == b"before" and copy.part_size == store.part_size


def test_round_trip(storage_root: str, store: ObjectStore) -> None:
    uri = join(storage_root, "a", "b", "blob.bin")
    store.write_bytes(uri, b"hello")
    assert store.read_bytes(uri) == b"hello"
    with store.open_write(uri) as fh:
        fh.write(b"second ")
        fh.write(b"version")
    with store.open_read(uri) as fh:
        assert fh.read(6) == b"second"
        assert fh.read() == b" version"
    assert store.size(uri) == len(b"second version")


def test_list_is_sorted_recursive_and_filtered(
    storage_root: str, store: ObjectStore
) -> None:
    names = ["z.parquet", "a/2.parquet", "a/1.parquet", "a/b/c.json", "m.parquet"]
    for name in names:
        store.write_bytes(join(storage_root, "data", name), name.encode())
    # A sibling sharing the string prefix is not "below" data/.
    store.write_bytes(join(storage_root, "data2", "x.parquet"), b"x")
    everything = store.list(join(storage_root, "data"))
    assert everything == sorted(join(storage_root, "data", n) for n in names)
    parquet = store.list(join(storage_root, "data") + "/", suffix=".parquet")
    assert parquet == sorted(
        join(storage_root, "data", n) for n in names if n.endswith(".parquet")
    )
    assert store.list(join(storage_root, "nothing-here")) == []


def test_list_past_one_page(storage_root: str, store: ObjectStore) -> None:
    # More keys than one page holds proves the listing follows continuations. S3's pages hold at most 1000
    # keys (the default); pages of 100 prove the same with a quarter of the objects to write.
    paged = ObjectStore(page_size=100)
    uris = [
        join(storage_root, "many", f"{i % 7}", f"obj-{i:05d}.bin") for i in range(250)
    ]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda u: store.write_bytes(u, b"."), uris))
    assert paged.list(join(storage_root, "many")) == sorted(uris)
    assert len(paged.list(join(storage_root, "many", "3"))) == len(
        [u for u in uris if "/3/" in u]
    )


def test_exists_size_delete(storage_root: str, store: ObjectStore) -> None:
    uri = join(storage_root, "obj.bin")
    assert not store.exists(uri)
    with pytest.raises(ObjectNotFoundError, match="obj.bin"):
        store.size(uri)
    with pytest.raises(FileNotFoundError):
        store.read_bytes(uri)
    with pytest.raises(FileNotFoundError):
        store.sha256(uri)
    store.delete(uri)  # absent: no error
    store.write_bytes(uri, b"12345")
    assert store.exists(uri) and store.size(uri) == 5
    store.delete(uri)
    assert not store.exists(uri)
    assert store.list(storage_root) == []


def test_put_if_absent_exactly_once(storage_root: str, store: ObjectStore) -> None:
    for round_no in range(3):
        uri = join(storage_root, "locks", f"claim-{round_no}")
        gate = threading.Barrier(8)

        def claim(worker: int, uri: str = uri, gate: threading.Barrier = gate) -> bool:
            gate.wait()
            return store.put_if_absent(uri, f"worker-{worker}".encode())

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(claim, range(8)))
        assert sum(results) == 1, results
        assert store.read_bytes(uri) == f"worker-{results.index(True)}".encode()
        assert store.put_if_absent(uri, b"late") is False
    assert store.list(join(storage_root, "locks")) == [
        join(storage_root, "locks", f"claim-{i}") for i in range(3)
    ]


def test_sha256_streams_whole_object(storage_root: str, store: ObjectStore) -> None:
    data = os.urandom(9 * MIB + 17)  # more than one read chunk
    uri = join(storage_root, "digest.bin")
    store.write_bytes(uri, data)
    assert store.sha256(uri) == hashlib.sha256(data).hexdigest()


def test_upload_and_download(storage_root: str, tmp_path: Path) -> None:
    store = ObjectStore(part_size=5 * MIB)
    src = tmp_path / "src.bin"
    data = os.urandom(
        12 * MIB + 3
    )  # above part_size: a parallel multipart transfer on S3
    src.write_bytes(data)
    uri = join(storage_root, "up", "file.bin")
    store.upload_from(str(src), uri)
    assert store.size(uri) == len(data)
    dest = tmp_path / "down" / "nested" / "file.bin"
    store.download_to(uri, str(dest))
    assert dest.read_bytes() == data
    assert os.listdir(dest.parent) == ["file.bin"]  # no temp file left behind
    with pytest.raises(ObjectNotFoundError, match="missing.bin"):
        store.download_to(
            join(storage_root, "missing.bin"), str(tmp_path / "never.bin")
        )
    assert not (tmp_path / "never.bin").exists()
    with pytest.raises(StorageError, match="not a file"):
        store.upload_from(str(tmp_path / "absent.bin"), uri)


def test_large_open_write_is_multipart(s3_bucket: str, moto_endpoint: str) -> None:
    store = ObjectStore(part_size=5 * MIB)
    uri = join(s3_bucket, "big", "fifty.bin")
    block = os.urandom(MIB)
    total = 50 * 10**6
    digest = hashlib.sha256()
    with store.open_write(uri) as fh:
        written = 0
        while written < total:
            piece = block[: min(len(block), total - written)]
            fh.write(piece)
            digest.update(piece)
            written += len(piece)
        assert not store.exists(uri), "object must stay invisible until the block exits"
    head = boto3.client("s3", endpoint_url=moto_endpoint).head_object(
        Bucket=_bucket_of(uri), Key="big/fifty.bin"
    )
    # A multipart ETag is "<md5 of part md5s>-<part count>"; 50 MB in 5 MiB parts is 10 parts.
    assert head["ETag"].strip('"').endswith("-10")
    assert store.size(uri) == total
    assert store.sha256(uri) == digest.hexdigest()
    with store.open_read(uri) as fh:
        fh.seek(total - 10)
        assert fh.read() == block[(total - 10) % MIB : (total % MIB) or MIB]


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_failed_open_write_leaves_nothing(
    storage_root: str, moto_endpoint: str, exc_type: type[BaseException]
) -> None:
    store = ObjectStore(part_size=5 * MIB)
    uri = join(storage_root, "out", "shard.bin")
    keep = join(storage_root, "out", "kept.bin")
    store.write_bytes(keep, b"old")
    for target in (uri, keep):
        with pytest.raises(exc_type), store.open_write(target) as fh:
            fh.write(
                os.urandom(6 * MIB)
            )  # past one part, so S3 has an upload part stored
            raise exc_type("writer died")
    assert not store.exists(uri)
    assert store.read_bytes(keep) == b"old"
    assert store.list(storage_root) == [keep]
    if is_s3(storage_root):
        assert _open_uploads(moto_endpoint, storage_root) == []
    else:
        assert sorted(os.listdir(join(storage_root, "out"))) == ["kept.bin"]


def test_local_temp_files_hidden_from_listing(tmp_path: Path) -> None:
    store = ObjectStore()
    root = str(tmp_path / "r")
    with store.open_write(join(root, "x.bin")) as fh:
        fh.write(b"partial")
        assert store.list(root) == []  # the temp file exists but is not an object yet
        assert len(os.listdir(root)) == 1
    assert store.list(root) == [join(root, "x.bin")]


def test_missing_credentials(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    uri = join(s3_bucket, "k.bin")
    store = ObjectStore(max_attempts=1)
    for call in (lambda: store.read_bytes(uri), lambda: store.write_bytes(uri, b"x")):
        with pytest.raises(StorageError, match="no S3 credentials found") as info:
            call()
        assert uri in str(info.value) and "AWS_ACCESS_KEY_ID" in str(info.value)


def test_no_such_bucket(
    moto_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    # botocore's own DEBUG output prints the canonical request, session-token header included, so
    # the token is checked at INFO; the secret key is checked at DEBUG in the test below.
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    store = ObjectStore()
    uri = f"s3://absent-{uuid.uuid4().hex[:12]}/dir/k.bin"
    calls = {
        "read": lambda: store.read_bytes(uri),
        "exists": lambda: store.exists(uri),
        "size": lambda: store.size(uri),
        "list": lambda: store.list(uri),
        "write": lambda: store.write_bytes(uri, b"x"),
        "put_if_absent": lambda: store.put_if_absent(uri, b"x"),
        "open_read": lambda: store.open_read(uri).__enter__(),
        "open_write": lambda: store.open_write(uri).__enter__(),
        "download": lambda: store.download_to(uri, str(tmp_path / "d.bin")),
        "upload": lambda: store.upload_from(__file__, uri),
        "sha256": lambda: store.sha256(uri),
        "delete": lambda: store.delete(uri),
    }
    for name, call in calls.items():
        with pytest.raises(StorageError) as info:
            call()
        message = str(info.value)
        assert info.value.code == "NoSuchBucket", (name, message)
        assert uri.rsplit("/", 2)[0] in message, (name, message)
        assert SECRET not in message and TOKEN not in message
    assert SECRET not in caplog.text and TOKEN not in caplog.text


def _reset_auth(endpoint: str, count: bytes) -> dict[str, str]:
    # A form content type (urllib's default) would make the server parse the body away.
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=count,
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.loads(response.read()))


@contextlib.contextmanager
def _moto_auth(endpoint: str) -> Iterator[None]:
    """Make the moto server check signatures and IAM permissions until the block ends."""
    previous = _reset_auth(endpoint, b"0")["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"]
    try:
        yield
    finally:
        _reset_auth(endpoint, previous.encode())


def test_denied_errors_name_uri_and_hide_secret(
    s3_bucket: str,
    moto_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uri = join(s3_bucket, "private", "k.bin")
    ObjectStore().write_bytes(uri, b"data")
    iam = boto3.client("iam", endpoint_url=moto_endpoint, region_name="us-east-1")
    user = f"no-perms-{uuid.uuid4().hex[:8]}"
    iam.create_user(UserName=user)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    caplog.set_level(logging.DEBUG)
    with _moto_auth(moto_endpoint):
        # A real identity without permissions: the server answers AccessDenied.
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        denied = ObjectStore(max_attempts=1)
        errors = []
        for call in (
            lambda: denied.read_bytes(uri),
            lambda: denied.write_bytes(uri, b"x"),
        ):
            with pytest.raises(StorageError) as info:
                call()
            assert info.value.code == "AccessDenied" and uri in str(info.value)
            errors.append(info.value)
        # The right key id with a wrong, recognisable secret: the signature check fails.
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        forged = ObjectStore(max_attempts=1)
        with pytest.raises(StorageError) as info:
            forged.read_bytes(uri)
        assert info.value.code == "SignatureDoesNotMatch" and uri in str(info.value)
        errors.append(info.value)
    for err in errors:
        for text in (str(err), repr(err)):
            assert SECRET not in text and key["SecretAccessKey"] not in text
    assert SECRET not in caplog.text and key["SecretAccessKey"] not in caplog.text
