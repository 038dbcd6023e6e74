"""What `import` reads: the work items of a source, as users name it.

A source is one of:

- a single file: `.jsonl`, `.jsonl.zst`, `.jsonl.gz` or `.parquet` (local, or one S3 object);
- a stage's output prefix, or its `manifest.json`: a prompts or completions manifest of this or another run,
  read through the manifest (its shards, never the manifest itself nor the `_markers/` beside it); the
  import's manifest names it among its inputs, by URI and sha256;
- a folder written by datasets' `save_to_disk` (its Arrow files), or a Hub dataset (row ranges);
- a prefix of such files, searched recursively; other files are ignored.

Workers share a source's items. Where a source has fewer files than workers (the common case: one JSONL file
of all prompts), each file is cut into stripes (`stripe_items`), one work item each, so N workers all work: a
stripe's worker reads the whole file but decodes, validates and writes only its stripe's records, which is most
of an import's cost. A JSONL record belongs to the stripe its line's bytes hash to, so lines repeated within a
file meet in one worker and are de-duplicated as with one worker; a Parquet row to the stripe of its row number.

`.json` files are not read: a `.json` file is one JSON document (often a list of records, as Alpaca's
alpaca_data.json), which read as JSON lines would yield nothing but malformed records, and the JSON objects
beside a stage's data (its manifest, shard markers, progress records) are not conversations either.

A source that cannot be what it names (a missing file, a file of another type, a manifest of data that holds no
conversations) is a configuration mistake: ConfigError, exit 64. A source that holds no usable data (an empty
folder, a stage that has not finished) is the input's: BadInputError, exit 65.
"""

from __future__ import annotations

import hashlib
import math
import os
import zlib
from dataclasses import dataclass
from typing import Any

from dflash_shared.dataset_sources import (
    hub_items,
    is_dataset_item,
    is_hub_source,
    parse_hub_source,
    saved_dataset_files,
)
from dflash_shared.errors import BadInputError, ConfigError
from dflash_shared.manifest_io import LoadedManifest, parse_manifest
from dflash_shared.manifests import MANIFEST_NAME, Kind
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, is_s3, join

SOURCE_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.gz", ".parquet")
# The folders the runner keeps beside a stage's data while the stage runs (runner.MARKERS_DIR, PROGRESS_DIR).
_RUNNER_FOLDERS = ("/_markers/", "/_progress/")
# A stripe's work item: the file's URI, this mark, then "<stripe>/<stripes>" (`stripe_items`).
STRIPE_MARK = "#stripe="


@dataclass(frozen=True)
class ImportSource:
    """The work items of a source; `origin` is the stage manifest they were read through, if any."""

    items: list[str]
    origin: LoadedManifest[Any] | None = None


def _read_through_manifest(store: ObjectStore, uri: str, kind: Kind) -> ImportSource:
    """The shards of a stage output's manifest, checked to hold conversations this import can use."""
    raw = store.read_bytes(uri)
    loaded: LoadedManifest[Any] = LoadedManifest(uri=uri, sha256=hashlib.sha256(raw).hexdigest(),
                                                 manifest=parse_manifest(uri, raw))
    found = loaded.manifest.kind
    if found not in (Kind.prompts, Kind.completions):
        raise ConfigError(f"source {uri} is a {found.value} manifest, which holds no conversations: import reads "
                          "a prompts or completions manifest (or conversation files)")
    if found is Kind.prompts and kind is Kind.completions:
        raise ConfigError(f"source {uri} is a prompts manifest, whose records have no answers to train on: import "
                          "it as prompts (a run with source.kind = \"prompts\" generates the answers), or name a "
                          "completions manifest")
    if not loaded.manifest.shards:
        raise BadInputError(f"source {uri} lists no shards: the stage that wrote it kept no records")
    return ImportSource([shard.uri for shard in loaded.manifest.shards], loaded)


def _is_file(store: ObjectStore, source: str) -> bool:
    if not is_s3(source):
        return os.path.isfile(source)
    # A trailing slash names a folder (and consoles make "folder/" placeholder objects).
    return not source.endswith("/") and store.exists(source)


def _unreadable_file(source: str) -> ConfigError:
    hint = ""
    if source.endswith(".json"):
        hint = (" (a .json file is one JSON document, not one record per line: convert it, e.g. `jq -c '.[]' "
                "data.json > data.jsonl` for a list of records)")
    elif source.endswith(".arrow"):
        hint = " (for a dataset saved with save_to_disk, name its folder)"
    return ConfigError(f"source {source} is a file import cannot read{hint}: import reads "
                       f"{', '.join(SOURCE_SUFFIXES)} files, a folder or prefix of them, a saved dataset folder, a "
                       "stage's output prefix or a hf:// dataset")


def resolve_source(store: ObjectStore, source: str, kind: Kind) -> ImportSource:
    """The work items of `source` for an import of `kind` (see the module docstring for what a source is)."""
    if is_hub_source(source):
        return ImportSource(hub_items(parse_hub_source(source)))
    if source.rsplit("/", 1)[-1] == MANIFEST_NAME:
        try:
            return _read_through_manifest(store, source, kind)
        except ObjectNotFoundError:
            raise ConfigError(f"source {source} does not exist: check --source") from None
    if _is_file(store, source):
        if not source.endswith(SOURCE_SUFFIXES):
            raise _unreadable_file(source)
        return ImportSource([source])
    manifest = join(source, MANIFEST_NAME)
    if store.exists(manifest):
        return _read_through_manifest(store, manifest, kind)
    saved = saved_dataset_files(store, source)
    if saved is not None:
        return ImportSource(saved)
    listed = store.list(source)
    if any(folder in uri for uri in listed for folder in _RUNNER_FOLDERS):
        raise BadInputError(f"source {source} is the output of a stage that has not finished (shard markers, no "
                            f"{MANIFEST_NAME}): import it once its manifest is written")
    files = [uri for uri in listed if uri.endswith(SOURCE_SUFFIXES)]
    if files:
        return ImportSource(files)
    if not listed and source.endswith((*SOURCE_SUFFIXES, ".json")):
        raise ConfigError(f"source {source} does not exist: check --source")
    skipped = sum(1 for uri in listed if uri.endswith(".json"))
    note = (f" ({skipped} .json file(s) were not read: a .json file is one JSON document, not one record per "
            "line; convert them to .jsonl)" if skipped else "")
    raise BadInputError(f"no {', '.join(SOURCE_SUFFIXES)} files under {source}{note}")


@dataclass(frozen=True)
class Stripe:
    """One of `count` stripes of a file (`index` from 0); the whole file is stripe 0 of 1."""

    uri: str
    index: int = 0
    count: int = 1

    def holds_line(self, line: bytes) -> bool:
        # crc32: cheap next to decoding the record, and the same on every worker and run.
        return self.count == 1 or zlib.crc32(line) % self.count == self.index

    def holds_row(self, row: int) -> bool:
        return row % self.count == self.index

    @property
    def first(self) -> bool:
        """The stripe that owns what belongs to no record (a file that stops decoding), so it counts once."""
        return self.index == 0


def stripe_items(items: list[str], workers: int) -> list[str]:
    """`items` with each file cut into as many stripes as it takes for every worker to have an item, when there
    are fewer items than workers; dataset items (Arrow files, Hub row ranges) are kept whole."""
    files = [item for item in items if not is_dataset_item(item)]
    if workers <= len(items) or not files:
        return items
    cuts = math.ceil((workers - (len(items) - len(files))) / len(files))
    if cuts <= 1:
        return items
    return [item if is_dataset_item(item) else f"{item}{STRIPE_MARK}{k}/{cuts}"
            for item in items for k in (range(cuts) if not is_dataset_item(item) else (0,))]


def parse_stripe(item: str) -> Stripe:
    """The stripe a work item names (`stripe_items`); a plain file's URI is its one stripe."""
    uri, mark, spec = item.rpartition(STRIPE_MARK)
    if not mark:
        return Stripe(item)
    index, _, count = spec.partition("/")
    return Stripe(uri, int(index), int(count))
