"""Copying a model to local disk (dflash_shared.model_copy) against a real S3 endpoint (moto server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash_shared.errors import ConfigError
from dflash_shared.model_copy import COMPLETE_MARKER, IDENTITY_FILES, copy_objects, fetch_model, s3_objects
from dflash_shared.storage import ObjectStore, join


def _model(store: ObjectStore, prefix: str) -> dict[str, bytes]:
    files = {name: f"{name} of the model".encode() for name in IDENTITY_FILES}
    files["model.safetensors"] = os.urandom(2**20)
    files["sub/extra.json"] = b"{}"
    for name, data in files.items():
        store.write_bytes(join(prefix, name), data)
    return files


def test_a_local_directory_is_used_where_it_is(tmp_path: Path, store: ObjectStore) -> None:
    assert fetch_model(store, str(tmp_path), str(tmp_path / "scratch")) == str(tmp_path)
    with pytest.raises(ConfigError, match="is not a directory"):
        fetch_model(store, str(tmp_path / "missing"), str(tmp_path / "scratch"))


def test_an_s3_model_is_copied_whole_once(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    prefix = join(s3_bucket, "models", "tiny")
    files = _model(store, prefix)
    local = Path(fetch_model(store, prefix + "/", str(tmp_path), workers=3))
    assert {str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()} == {*files, COMPLETE_MARKER}
    assert all((local / name).read_bytes() == data for name, data in files.items())
    # The marker makes a second call free: a file removed behind its back is not fetched again.
    (local / "model.safetensors").unlink()
    assert fetch_model(store, prefix, str(tmp_path)) == str(local)
    assert not (local / "model.safetensors").exists()


def test_a_subset_gets_its_own_folder(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    prefix = join(s3_bucket, "models", "tiny")
    _model(store, prefix)
    small = Path(fetch_model(store, prefix, str(tmp_path), only=IDENTITY_FILES))
    whole = Path(fetch_model(store, prefix, str(tmp_path)))
    assert small != whole
    assert sorted(p.name for p in small.iterdir()) == sorted([*IDENTITY_FILES, COMPLETE_MARKER])
    with pytest.raises(ConfigError, match="holds none of"):
        fetch_model(store, prefix, str(tmp_path), only=("missing.bin",))


def test_an_empty_prefix_is_named(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"model prefix {join(s3_bucket, 'none')} holds no objects"):
        fetch_model(store, join(s3_bucket, "none"), str(tmp_path))


def test_a_copy_resumes_and_a_short_copy_is_refused(s3_bucket: str, store: ObjectStore, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = join(s3_bucket, "models", "tiny")
    files = _model(store, prefix)
    objects = s3_objects(store, prefix)
    dest = tmp_path / "dest"
    assert copy_objects(store, objects, str(dest), workers=2) == sum(map(len, files.values()))
    # A retried pod keeps what is already there with the right size.
    assert copy_objects(store, objects, str(dest), workers=2) == 0

    def short_download(uri: str, path: str) -> None:
        Path(path).write_bytes(b"cut")

    (dest / "model.safetensors").unlink()
    monkeypatch.setattr(store, "download_to", short_download)
    with pytest.raises(OSError, match=r"model.safetensors .* has 3 bytes, expected 1048576"):
        copy_objects(store, objects, str(dest), workers=2)
