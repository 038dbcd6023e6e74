"""A local model folder as `stage-model` uploads it: which files, whether they make a loadable model, their sha256.

The checks are the ones a stage would otherwise fail on hours later, on a GPU node: no config.json, no weights, a
shard the safetensors index names but the folder lacks, and weights that are not safetensors at all (a Git LFS
pointer left by a clone without `git lfs`, a file cut short by an interrupted download). Each reads a header, never
the weights; hashing reads every byte once, several files at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dflash_shared.errors import ConfigError
from dflash_shared.progress import Progress

log = logging.getLogger(__name__)

_CHUNK = 8 * 2**20
# safetensors refuses headers above 100 MB; a larger length is a file that is not safetensors.
_MAX_HEADER = 100 * 2**20
_LFS_POINTER = b"version https://git-lfs"


@dataclass(frozen=True)
class LocalFile:
    """One file of the folder: its path relative to the folder (with '/'), size and, once hashed, sha256."""

    name: str
    size: int
    sha256: str = ""


def scan_model_dir(directory: str, exclude: Collection[str] = ()) -> list[LocalFile]:
    """The files to stage from `directory`, sorted, after checking that they make a model; ConfigError if not.

    Hidden files and folders are left out: `.git`, the `.cache` that `huggingface-cli download --local-dir`
    writes, the marker a finished copy leaves. So are the top-level names in `exclude` (the listings).
    """
    if not os.path.isdir(directory):
        raise ConfigError(f"--from {directory} is not a directory")
    files: list[LocalFile] = []
    for dirpath, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, directory).replace(os.sep, "/")
            if name.startswith(".") or rel in exclude or not os.path.isfile(path):
                continue
            files.append(LocalFile(rel, os.path.getsize(path)))
    _check_model(directory, {f.name: f.size for f in files})
    return files


def _check_model(directory: str, sizes: dict[str, int]) -> None:
    if "config.json" not in sizes:
        raise ConfigError(f"--from {directory} has no config.json: not a model directory")
    try:
        config = json.loads(_read(directory, "config.json"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{directory}/config.json is not JSON: {err}") from err
    if not isinstance(config, dict):
        raise ConfigError(f"{directory}/config.json is not a JSON object")
    weights = sorted(name for name in sizes if name.endswith(".safetensors"))
    if not weights:
        bins = [name for name in sizes if name.endswith((".bin", ".pt", ".pth"))]
        hint = f" (it has {bins[0]}: the stages load safetensors only)" if bins else ""
        raise ConfigError(f"--from {directory} has no *.safetensors weights{hint}")
    for index in sorted(name for name in sizes if name.endswith(".safetensors.index.json")):
        _check_index(directory, index, sizes)
    for name in weights:
        _check_safetensors(directory, name, sizes[name])
    if "tokenizer.json" not in sizes:
        log.warning("%s has no tokenizer.json: the tokenize and generate stages need one", directory)
    if "chat_template.jinja" not in sizes and '"chat_template"' not in _read(directory, "tokenizer_config.json"):
        log.warning("%s has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json): "
                    "the stages need one", directory)


def _read(directory: str, name: str) -> str:
    """A small text file of the folder, '' when absent."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _check_index(directory: str, index: str, sizes: dict[str, int]) -> None:
    try:
        weight_map = json.loads(_read(directory, index)).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise ConfigError(f"{directory}/{index} is not a safetensors index: {err}") from err
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{directory}/{index} has no weight_map")
    base = os.path.dirname(index)
    shards = sorted({os.path.join(base, str(shard)).replace(os.sep, "/") for shard in weight_map.values()})
    missing = [shard for shard in shards if shard not in sizes]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"{directory}/{index} names {len(shards)} shard(s), {len(missing)} missing from the "
                          f"folder: {', '.join(missing[:3])}{more} (an unfinished download?)")


def _check_safetensors(directory: str, name: str, size: int) -> None:
    """The header parses and describes exactly `size` bytes, as safetensors' own loader requires."""
    path = os.path.join(directory, name)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if head + fh.read(len(_LFS_POINTER) - 8) == _LFS_POINTER:
            raise ConfigError(f"{path} is a Git LFS pointer, not the weights: run `git lfs pull` in {directory}")
        fh.seek(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(size - 8, _MAX_HEADER):
            raise ConfigError(f"{path} is not a safetensors file ({size} bytes, no valid header)")
        try:
            header = json.loads(fh.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"{path} is not a safetensors file: its header is not JSON ({err})") from err
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is not a safetensors file: its header is not a JSON object")
    ends = [entry.get("data_offsets", [0, 0])[1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict)]
    expected = 8 + length + max(ends, default=0)
    if expected != size:
        raise ConfigError(f"{path} has {size:,} bytes but its header describes {expected:,} (cut short by an "
                          "interrupted download?)")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)  # hashlib releases the GIL on large buffers: threads hash in parallel
    return digest.hexdigest()


def hash_files(directory: str, files: list[LocalFile], workers: int) -> list[LocalFile]:
    """The same files with their sha256, several hashed at once; a progress line now and then, a total at the end."""
    with Progress(sum(f.size for f in files), "bytes", f"hashing {directory}") as progress, \
            ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(_sha256, os.path.join(directory, f.name)) for f in files]
        hashed = []
        for f, future in zip(files, futures, strict=True):
            hashed.append(LocalFile(f.name, f.size, future.result()))
            progress.update(f.size)
    return hashed
