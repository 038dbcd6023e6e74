"""Model locations: local directories, S3 prefixes (copied against a moto server) and hub ids."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash_generate.model_source import ModelFiles, ModelSource
from dflash_shared.errors import ConfigError
from dflash_shared.storage import ObjectStore, join


def test_locations_are_told_apart(tmp_path: Path) -> None:
    assert ModelSource.parse(str(tmp_path)).kind == "local"
    assert ModelSource.parse("s3://models/qwen3-8b/", "v1") == ModelSource("s3://models/qwen3-8b", "s3", "v1")
    assert ModelSource.parse("Qwen/Qwen3-8B").kind == "hub"
    for bad in (str(tmp_path / "missing"), "./Qwen/Qwen3-8B", "just-a-name"):
        with pytest.raises(ConfigError, match="is not a directory, an s3:// prefix or a hub model id"):
            ModelSource.parse(bad)
    # Two models never share a cache directory.
    a, b = ModelSource.parse("s3://m/a"), ModelSource.parse("s3://m/a", "rev2")
    assert a.cache_dir("/c") != b.cache_dir("/c")


def test_s3_model_is_copied_tokenizer_first(s3_bucket: str, store: ObjectStore, qwen3_tokenizer_dir: Path,
                                            tmp_path: Path) -> None:
    prefix = join(s3_bucket, "models", "tiny")
    weights = os.urandom(3 * 2**20)
    for path in qwen3_tokenizer_dir.iterdir():
        store.write_bytes(join(prefix, path.name), path.read_bytes())
    store.write_bytes(join(prefix, "config.json"), b'{"model_type": "qwen3"}')
    store.write_bytes(join(prefix, "model-00001-of-00002.safetensors"), weights)
    store.write_bytes(join(prefix, "model-00002-of-00002.safetensors"), weights[:1000])
    files = ModelFiles(ModelSource.parse(prefix), str(tmp_path / "cache"), store, workers=4)

    tok_dir = Path(files.tokenizer_dir())
    assert sorted(p.name for p in tok_dir.iterdir()) == sorted(
        [p.name for p in qwen3_tokenizer_dir.iterdir()] + ["config.json"])
    assert (tok_dir / "tokenizer.json").read_bytes() == (qwen3_tokenizer_dir / "tokenizer.json").read_bytes()

    model_dir = Path(files.model_dir())
    assert model_dir == tok_dir
    assert (model_dir / "model-00001-of-00002.safetensors").read_bytes() == weights
    stamp = (model_dir / "model-00001-of-00002.safetensors").stat().st_mtime_ns
    files.model_dir()  # a second attempt in the same pod copies nothing again
    assert (model_dir / "model-00001-of-00002.safetensors").stat().st_mtime_ns == stamp


def test_empty_s3_prefix_is_named(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    files = ModelFiles(ModelSource.parse(join(s3_bucket, "nothing")), str(tmp_path), store)
    with pytest.raises(ConfigError, match=f"model prefix {join(s3_bucket, 'nothing')} holds no objects"):
        files.tokenizer_dir()
