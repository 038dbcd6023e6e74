"""Hugging Face datasets as `import` sources: a Hub dataset, or a folder written by `save_to_disk`.

A source is listed as work items that the import shards over workers like files, and each item yields
(where, row) pairs that go through the same layout mapping, parser, gate and de-duplication as JSONL lines:

    hf://org/name[/config]@revision[:split]   a Hub dataset (split `train` by default); items are row
                                              ranges, rows are `hf://org/name@revision:split#row`
    <folder> holding state.json               a saved Dataset (local or s3://); items are its Arrow files
                                              in state.json's order, rows are `<file>.arrow#row`

A folder of Parquet files needs nothing here: `.parquet` is a source file suffix of its own.

The Hub needs the `datasets` package, imported only when a Hub source is used (the stage images do not
ship it: `pip install datasets`, or save the dataset to disk with it elsewhere and import the folder). The
revision is required, so every worker and every rerun reads the same rows. A token comes from HF_TOKEN and
is handed to `datasets` only: it is not a config field, so it never reaches a log line or a manifest.
Every worker loads the whole dataset (the Hub's files are cached per machine) and reads its row ranges.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from dflash_shared.errors import BadInputError, ConfigError
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, join

HUB_SCHEME = "hf://"
SAVED_STATE = "state.json"
SAVED_DICT = "dataset_dict.json"
TOKEN_ENV = "HF_TOKEN"
# Rows per Hub work item: the unit of sharding, as a file is for file sources.
ROWS_PER_ITEM = 50_000
_BATCH_ROWS = 4096
_ROW_DIGITS = 12  # work items are sorted as strings: zero padding keeps them in row order
_HUB_RE = re.compile(
    r"^hf://(?P<repo>[^/@:#]+/[^/@:#]+)(?:/(?P<config>[^/@:#]+))?@(?P<revision>[^:#]+)(?::(?P<split>[^:#/]+))?$"
)
_ITEM_RE = re.compile(r"^(?P<dataset>hf://.+)#rows-(?P<start>\d+)-(?P<end>\d+)$")


@dataclass(frozen=True)
class HubDataset:
    """A Hub dataset split at a pinned revision."""

    repo: str  # org/name
    revision: str  # commit, tag or branch
    split: str = "train"
    config: str | None = None  # the dataset's configuration (subset), when it has several

    @property
    def uri(self) -> str:
        config = f"/{self.config}" if self.config else ""
        return f"{HUB_SCHEME}{self.repo}{config}@{self.revision}:{self.split}"


def is_hub_source(source: str) -> bool:
    return source.startswith(HUB_SCHEME)


def parse_hub_source(source: str) -> HubDataset:
    """`hf://org/name[/config]@revision[:split]` -> HubDataset; a ConfigError names the expected form."""
    match = _HUB_RE.match(source)
    if match is None:
        pinned = "" if "@" in source else " (the revision is required: a commit or tag, so reruns read the same rows)"
        raise ConfigError(f"{source!r} is not a Hub dataset source hf://org/name[/config]@revision[:split]{pinned}")
    return HubDataset(match["repo"], match["revision"], match["split"] or "train", match["config"])


def _datasets() -> Any:
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(
            "a Hub dataset source needs the 'datasets' package, which this environment lacks: install datasets "
            "(pip install datasets), or save the dataset with save_to_disk elsewhere and import that folder"
        ) from None
    return datasets


# What `datasets` and `huggingface_hub` raise for a name, revision, config or split the Hub does not have: the
# source is misnamed (exit 64), where a network failure (any other error) may pass on a retry.
_NOT_ON_THE_HUB = frozenset({"DatasetNotFoundError", "RepositoryNotFoundError", "RevisionNotFoundError",
                             "EntryNotFoundError"})


@functools.lru_cache(maxsize=2)  # listing and reading in one worker load the dataset once
def load_hub(dataset: HubDataset) -> Any:
    """The split as a `datasets.Dataset` (downloaded into the Hugging Face cache on first use)."""
    token = os.environ.get(TOKEN_ENV) or None
    datasets = _datasets()
    try:
        return datasets.load_dataset(
            dataset.repo, dataset.config, revision=dataset.revision, split=dataset.split, token=token
        )
    except Exception as err:
        # datasets says ValueError for a config or split the dataset lacks ("Unknown split", "BuilderConfig").
        if type(err).__name__ in _NOT_ON_THE_HUB or type(err) is ValueError:
            raise ConfigError(f"source {dataset.uri}: {err} (check the dataset's name, revision, config and split; "
                              f"a private or gated dataset also needs {TOKEN_ENV})") from err
        raise


def hub_items(dataset: HubDataset) -> list[str]:
    """Row ranges of the split, ROWS_PER_ITEM each: the work items of a Hub source."""
    rows = len(load_hub(dataset))
    if not rows:
        raise BadInputError(f"{dataset.uri} has no rows")
    return [
        f"{dataset.uri}#rows-{start:0{_ROW_DIGITS}d}-{min(start + ROWS_PER_ITEM, rows):0{_ROW_DIGITS}d}"
        for start in range(0, rows, ROWS_PER_ITEM)
    ]


def saved_dataset_files(store: ObjectStore, prefix: str) -> list[str] | None:
    """The Arrow files of a `save_to_disk` folder in their order, or None when `prefix` is not one."""
    try:
        state = json.loads(store.read_bytes(join(prefix, SAVED_STATE)))
    except ObjectNotFoundError:
        state = None
    if state is None:
        if store.exists(join(prefix, SAVED_DICT)):
            splits = json.loads(store.read_bytes(join(prefix, SAVED_DICT))).get("splits", [])
            raise BadInputError(
                f"{prefix} is a saved DatasetDict with splits {splits}: point the source at one split's folder, "
                f"e.g. {join(prefix, splits[0] if splits else 'train')}"
            )
        return None
    # Only the files state.json names: `.map()` on a loaded dataset leaves cache-*.arrow files beside them.
    files = [join(prefix, entry["filename"]) for entry in state.get("_data_files", [])]
    if not files:
        raise BadInputError(f"{join(prefix, SAVED_STATE)} names no data files")
    return files


def is_dataset_item(item: str) -> bool:
    return is_hub_source(item) or item.endswith(".arrow")


def iter_dataset_item(
    store: ObjectStore, item: str, rows: Callable[[Any], Iterator[Any]]
) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of one work item: a saved dataset's Arrow file or a Hub row range.

    `rows` turns an Arrow batch into its rows (the importer's, which keeps an unreadable row to itself).
    """
    match = _ITEM_RE.match(item)
    if match is None:
        with store.open_read(item) as handle, pa.ipc.open_stream(handle) as reader:
            row = 0
            for batch in reader:
                for obj in rows(batch):
                    yield f"{item}#{row}", obj
                    row += 1
        return
    dataset = parse_hub_source(match["dataset"])
    table = load_hub(dataset).with_format("arrow")
    start, end = int(match["start"]), int(match["end"])
    for first in range(start, end, _BATCH_ROWS):
        for offset, obj in enumerate(rows(table[first : min(first + _BATCH_ROWS, end)])):
            yield f"{dataset.uri}#{first + offset}", obj
