"""Copying a model from an s3:// prefix to local disk: the one place every stage does it.

Engines and `from_pretrained` read weights from local files only, so the generate, train and evaluate
stages copy the target (or the small files that identify it) into their scratch first. Objects are
copied many at once and each copy is checked against the object's size; a file already there with the
right size is kept, so a retried pod resumes a copy instead of starting over. `fetch_model` also leaves a
marker once the folder is whole, so a second call in the same scratch costs one stat.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_shared.errors import ConfigError
from dflash_shared.storage import ObjectStore, is_s3

log = logging.getLogger(__name__)

# The small files that identify a target (tokenizer and template hashes) and let a stage build its
# tokenizer or an empty model skeleton: what a worker or rank that never reads the weights copies.
IDENTITY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
)
# Written into a folder `fetch_model` finished copying.
COMPLETE_MARKER = ".dflash-complete"


def s3_objects(store: ObjectStore, prefix: str) -> list[tuple[str, str]]:
    """(uri, path relative to the prefix) of every object under a model prefix; ConfigError when none."""
    base = prefix.rstrip("/")
    objects = [(uri, uri[len(base) + 1:]) for uri in store.list(base)]
    if not objects:
        raise ConfigError(f"model prefix {prefix} holds no objects")
    return objects


def copy_objects(store: ObjectStore, objects: list[tuple[str, str]], dest: str, workers: int) -> int:
    """Copy (uri, relative path) objects into `dest` in parallel; returns the bytes copied.

    A file already in `dest` with the object's size is kept (a previous attempt copied it), and a copy of
    another size than the object's is an error rather than a truncated model.
    """
    uris = [uri for uri, _ in objects]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        sizes = dict(zip(uris, pool.map(store.size, uris), strict=True))

    def copy(item: tuple[str, str]) -> int:
        uri, rel = item
        local = os.path.join(dest, rel)
        if os.path.isfile(local) and os.path.getsize(local) == sizes[uri]:
            return 0
        os.makedirs(os.path.dirname(local), exist_ok=True)
        store.download_to(uri, local)
        if os.path.getsize(local) != sizes[uri]:
            raise OSError(f"copy of {uri} to {local} has {os.path.getsize(local)} bytes, expected {sizes[uri]}")
        return sizes[uri]

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return sum(pool.map(copy, objects))


def s3_model_bytes(store: ObjectStore, prefix: str) -> int:
    """Total size of a model prefix (what the disk preflight needs room for)."""
    uris = [uri for uri, _ in s3_objects(store, prefix)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        return sum(pool.map(store.size, uris))


def fetch_model(store: ObjectStore, location: str, scratch: str, workers: int = 8,
                only: Collection[str] | None = None) -> str:
    """A local directory holding the model at `location`: the directory itself when it is local, else a copy
    under `scratch` (one folder per location, and per subset when `only` names the files to copy)."""
    if not is_s3(location):
        if not os.path.isdir(location):
            raise ConfigError(f"target {location} is not a directory")
        return location
    location = location.rstrip("/")  # one folder for "s3://b/m" and "s3://b/m/"
    name = hashlib.sha256(location.encode()).hexdigest()[:16]
    if only is not None:
        name += "-" + hashlib.sha256("\n".join(sorted(only)).encode()).hexdigest()[:8]
    local = os.path.join(scratch, f"target-{name}")
    if os.path.isfile(os.path.join(local, COMPLETE_MARKER)):
        return local
    objects = [(uri, rel) for uri, rel in s3_objects(store, location) if only is None or rel in only]
    if not objects:
        raise ConfigError(f"target {location} holds none of {sorted(only or ())}")
    copied = copy_objects(store, objects, local, workers)
    Path(local, COMPLETE_MARKER).write_text(location + "\n", encoding="utf-8")
    log.info("copied target %s (%d files, %.2f GiB) to %s", location, len(objects), copied / 2**30, local)
    return local
