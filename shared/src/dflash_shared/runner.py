"""Sharded, resumable execution of a stage over a sorted list of items.

A stage lists its input items (files, object URIs, ...); each of ``count`` workers (the pods of a
Kubernetes Indexed Job) processes ``sorted(items)[index::count]``. All progress lives in the output prefix:

    <prefix>/data/...                               shard files, each one an atomic put
    <prefix>/_markers/shard-00003-of-00008.json     written after every file of shard 3
    <prefix>/manifest.json                          written once, after all markers: the commit point

A worker that crashed or was preempted is simply run again: finished shards are skipped by their marker and
an unfinished one is redone from the start, rewriting byte-identical files because ``process`` must be
deterministic given its items. Whichever worker finds every marker present merges them into the stage
manifest. Readers only follow the manifest, so they never see a partial shard.

Every marker records the settings its shard ran with (`stage_identity`): a shard started under other settings
than a marker of the prefix refuses before it processes an item, and the merge refuses markers that disagree,
so an output holds the work of one configuration.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflash_shared.errors import ConfigError
from dflash_shared.manifest_io import write_manifest
from dflash_shared.manifests import MANIFEST_NAME, Accounting, Manifest, Shard
from dflash_shared.scratch import make_scratch
from dflash_shared.stage_identity import StageIdentity, refuse_changed
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, join

logger = logging.getLogger(__name__)

INDEX_ENV = "JOB_COMPLETION_INDEX"
COUNT_ENV = "DFLASH_NUM_SHARDS"
DATA_DIR = "data"
MARKERS_DIR = "_markers"
# One small record per published file of an unfinished shard, so that a rerun can reuse the file (see
# ShardContext.published_before); removed once the shard's marker is written.
PROGRESS_DIR = "_progress"
MAX_EXAMPLES_PER_REASON = 5
_MARKER_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})\.json$")
_HASH_CHUNK = 8 * 2**20
# Marker reads and shard HEADs are latency-bound on S3; a small pool turns 1,000 round trips into seconds.
_IO_THREADS = 16


class ShardingError(ConfigError):
    """The shard settings or the state of the output prefix forbid this run; retrying will not help."""


# ---------------------------------------------------------------------------------------- assignment


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ShardingError(f"environment variable {name}={raw!r} is not an integer") from None


def resolve_shard(cli_index: int | None, cli_count: int | None) -> tuple[int, int]:
    """(index, count) from the command line, else JOB_COMPLETION_INDEX / DFLASH_NUM_SHARDS, else (0, 1)."""
    index, index_from = (cli_index, "the command line") if cli_index is not None else (_env_int(INDEX_ENV), INDEX_ENV)
    count, count_from = (cli_count, "the command line") if cli_count is not None else (_env_int(COUNT_ENV), COUNT_ENV)
    if count is None:
        count, count_from = 1, f"the default (no shard count on the command line, {COUNT_ENV} unset)"
    if count < 1:
        raise ShardingError(f"shard count {count} (from {count_from}) must be at least 1")
    if index is None:
        if count > 1:
            raise ShardingError(
                f"shard count is {count} (from {count_from}) but no shard index was given: pass one on the "
                f"command line or set {INDEX_ENV} (a Kubernetes Indexed Job sets it for each pod)"
            )
        return 0, 1
    if not 0 <= index < count:
        raise ShardingError(
            f"shard index {index} (from {index_from}) is out of range for {count} shards (from {count_from}); "
            f"valid indices are 0..{count - 1}"
        )
    return index, count


def config_shard(config: Any) -> tuple[int, int]:
    """(index, count) of a stage config with shard_index / num_shards fields (resolve_shard's sources)."""
    return resolve_shard(config.shard_index, config.num_shards)


def _checked_order(items: Sequence[str], index: int, count: int) -> list[str]:
    if count < 1 or not 0 <= index < count:
        raise ShardingError(f"shard index {index} is out of range for {count} shards")
    ordered = sorted(items)
    for prev, item in itertools.pairwise(ordered):
        # A duplicate could land on two shards and be processed twice.
        if prev == item:
            raise ShardingError(f"item {item!r} is listed more than once; every item must be unique")
    return ordered


def assign(items: Sequence[str], index: int, count: int) -> list[str]:
    """This shard's items: ``sorted(items)[index::count]``, independent of the listing order."""
    return _checked_order(items, index, count)[index::count]


def assign_all_to_first(items: Sequence[str], index: int, count: int) -> list[str]:
    """Every item to shard 0, none to the others: for work that must see all of its input in one place (an
    import's sample, drawn over every record whatever the shard count)."""
    ordered = _checked_order(items, index, count)
    return ordered if index == 0 else []


# ---------------------------------------------------------------------------------------- outcomes


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _OutcomeBody(_Frozen):
    shards: list[Shard] = Field(default_factory=list, description="Published shard files, in reading order.")
    accounting: Accounting = Field(description="Where every input record went (examples included).")
    totals: dict[str, int | float] = Field(
        default_factory=dict, description="Stage-specific sums (e.g. tokens, loss_tokens); summed on merge."
    )
    histograms: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="Named histograms, bucket -> count; summed bucket-wise on merge."
    )


class ShardOutcome(_OutcomeBody):
    """What one shard produced; recorded in its marker and merged into the stage manifest."""

    shard_index: int = Field(ge=0, description="Index of the shard (0-based).")
    shard_count: int = Field(ge=1, description="Number of shards in the run.")

    @model_validator(mode="after")
    def _index_in_range(self) -> ShardOutcome:
        if self.shard_index >= self.shard_count:
            raise ValueError(f"shard_index {self.shard_index} is out of range for {self.shard_count} shards")
        return self


class MergedOutcome(_OutcomeBody):
    """Every shard's outcome combined: what a stage builds its manifest from."""

    shard_count: int = Field(ge=1, description="Number of shards merged.")


def merge_accounting(parts: Iterable[Accounting]) -> Accounting:
    """Sum counts and per-reason counts; keep the first few examples per reason, in shard order."""
    total = {"input_records": 0, "succeeded": 0, "failed": 0, "skipped": 0}
    failures: dict[str, int] = {}
    skips: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    for part in parts:
        for key in total:
            total[key] += getattr(part, key)
        for source, target in ((part.failures_by_reason, failures), (part.skips_by_reason, skips)):
            for reason, n in source.items():
                target[reason] = target.get(reason, 0) + n
        for reason, found in part.examples.items():
            kept = examples.setdefault(reason, [])
            kept.extend(found[: MAX_EXAMPLES_PER_REASON - len(kept)])
    return Accounting(failures_by_reason=failures, skips_by_reason=skips, examples=examples, **total)


def merge_outcomes(outcomes: Iterable[ShardOutcome]) -> MergedOutcome:
    """Combine shard outcomes: shards concatenated in shard order, accounting/totals/histograms summed."""
    ordered = sorted(outcomes, key=lambda o: o.shard_index)
    if not ordered:
        raise ShardingError("no shard outcomes to merge")
    count = ordered[0].shard_count
    owner: dict[str, int] = {}
    for prev, cur in itertools.pairwise(ordered):
        if prev.shard_index == cur.shard_index:
            raise ShardingError(f"shard {cur.shard_index} appears twice among the outcomes to merge")
    totals: dict[str, int | float] = {}
    histograms: dict[str, dict[str, int]] = {}
    for out in ordered:
        if out.shard_count != count:
            raise ShardingError(
                f"cannot merge shard {out.shard_index} of a {out.shard_count}-shard run with a {count}-shard run"
            )
        for shard in out.shards:
            if shard.uri in owner:
                raise ShardingError(
                    f"shard file {shard.uri} is listed by shard {owner[shard.uri]} and by shard {out.shard_index}"
                )
            owner[shard.uri] = out.shard_index
        for key, value in out.totals.items():
            totals[key] = totals.get(key, 0) + value
        for name, buckets in out.histograms.items():
            merged = histograms.setdefault(name, {})
            for bucket, n in buckets.items():
                merged[bucket] = merged.get(bucket, 0) + n
    return MergedOutcome(
        shard_count=count,
        shards=[s for out in ordered for s in out.shards],
        accounting=merge_accounting(o.accounting for o in ordered),
        totals=totals,
        histograms=histograms,
    )


class ShardMarker(_Frozen):
    """The completion marker of one shard; it carries the outcome so the merge needs no other reads."""

    marker_version: Literal[1] = Field(default=1, description="Marker format version.")
    stage: str = Field(description="Stage that produced the shard.")
    item_count: int = Field(ge=0, description="Items assigned to the shard.")
    items_sha256: str = Field(description="sha256 of the JSON list of the assigned items, in order.")
    outcome: ShardOutcome = Field(description="What the shard produced.")
    identity: StageIdentity | None = Field(
        default=None, description="The settings and image the shard ran with; None in markers made before they "
        "were recorded, which are not compared.")


class FileProgress(_Frozen):
    """Written right after a file of an unfinished shard is published: enough to trust and reuse it."""

    items_sha256: str = Field(description="sha256 of the shard's assigned items (as in its marker).")
    fingerprint: str = Field(description="The stage's digest of everything else the file's bytes depend on.")
    shard: Shard = Field(description="The published file: URI, size, sha256, records.")
    checkpoint: dict[str, Any] = Field(default_factory=dict, description="The stage's state when it was published.")


def marker_uri(output_prefix: str, index: int, count: int) -> str:
    return join(output_prefix, MARKERS_DIR, f"shard-{index:05d}-of-{count:05d}.json")


def _items_digest(items: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(items), ensure_ascii=False).encode("utf-8")).hexdigest()


def left_out_line(accounting: Accounting) -> str:
    """What a run left out, by reason, with one example location each: the line every successful run prints.

    'left out 1 of 40 records: malformed_record 1 (e.g. /data/a.jsonl:17: not JSON)'; the manifest keeps more
    examples, but an operator should not have to open it to learn that something was dropped.
    """
    reasons: dict[str, int] = dict(accounting.failures_by_reason)
    for reason, n in accounting.skips_by_reason.items():
        reasons[reason] = reasons.get(reason, 0) + n
    if not reasons:
        return f"left out nothing: {accounting.succeeded:,} of {accounting.input_records:,} records kept"
    parts = []
    for reason, n in sorted(reasons.items(), key=lambda item: (-item[1], item[0])):
        example = (accounting.examples.get(reason) or [""])[0]
        shown = example if len(example) <= 160 else example[:157] + "..."
        parts.append(f"{reason} {n:,}" + (f" (e.g. {shown})" if shown else ""))
    left = accounting.failed + accounting.skipped
    return f"left out {left:,} of {accounting.input_records:,} records: " + "; ".join(parts)


# ---------------------------------------------------------------------------------------- context


class _ShardLog(logging.LoggerAdapter[logging.Logger]):
    """Prefixes every message with the stage and shard so interleaved pod logs stay readable."""

    def __init__(self, base: logging.Logger, label: str) -> None:
        super().__init__(base, {"shard": label})
        self.label = label

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"[{self.label}] {msg}", kwargs


def _hash_file(path: str) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _check_name(name: str) -> None:
    parts = name.split("/")
    if not name or "\\" in name or any(p in ("", ".", "..") for p in parts) or parts[-1].startswith("."):
        raise ShardingError(
            f"invalid shard file name {name!r}: use a relative name without '..' or a leading dot, "
            "such as 'part-00003-0000.parquet'"
        )


@dataclass
class ShardContext:
    """Everything a stage's ``process`` function gets: its items, where to write, and a scratch dir."""

    stage: str
    index: int
    count: int
    items: list[str]
    output_prefix: str
    store: ObjectStore
    scratch_dir: str
    logger: logging.LoggerAdapter[logging.Logger]
    published: list[Shard] = field(default_factory=list)
    # What a published file's bytes depend on: the items (by digest) and the stage's own fingerprint.
    items_sha256: str = ""
    fingerprint: str = ""

    def progress_prefix(self) -> str:
        return join(self.output_prefix, PROGRESS_DIR, f"shard-{self.index:05d}-of-{self.count:05d}")

    def shard_uri(self, name: str) -> str:
        _check_name(name)
        return join(self.output_prefix, DATA_DIR, name)

    def part_name(self, part: int, suffix: str) -> str:
        """A file name unique to this shard and part, e.g. ``part-00003-0001.parquet``."""
        return f"{self.part_prefix}{part:04d}{suffix}"

    @property
    def part_prefix(self) -> str:
        """The start of every file name this shard publishes (`part_name`)."""
        return f"part-{self.index:05d}-"

    def publish(
        self, source: str | os.PathLike[str] | bytes, name: str, records: int, tokens: int | None = None,
        split: Literal["train", "heldout"] | None = None, checkpoint: Mapping[str, Any] | None = None,
    ) -> Shard:
        """Atomically upload a local file (path) or ``bytes`` as ``data/<name>`` and describe it.

        Size and sha256 come from the local bytes, so publishing never re-downloads the object. `split`
        marks tokenized shards as training or held-out data. With `checkpoint` (the stage's state once this
        file is complete, JSON-ready) a progress record is written, and a rerun may reuse the file.
        """
        uri = self.shard_uri(name)
        if any(s.uri == uri for s in self.published):
            raise ShardingError(f"shard {self.index} published {uri} twice; give every file its own name")
        if isinstance(source, bytes | bytearray | memoryview):
            data = bytes(source)
            size, digest = len(data), hashlib.sha256(data).hexdigest()
            self.store.write_bytes(uri, data)
        else:
            path = os.fspath(source)
            size, digest = _hash_file(path)
            self.store.upload_from(path, uri)
        shard = Shard(uri=uri, bytes=size, sha256=digest, records=records, tokens=tokens, split=split)
        self.published.append(shard)
        if checkpoint is not None:
            # After the file: a crash in between leaves a file without a record, which a rerun rewrites.
            record = FileProgress(items_sha256=self.items_sha256, fingerprint=self.fingerprint, shard=shard,
                                  checkpoint=dict(checkpoint))
            self.store.write_bytes(join(self.progress_prefix(), name.replace("/", "--") + ".json"),
                                   record.model_dump_json().encode("utf-8"))
        self.logger.info("published %s (%d records, %d bytes)", uri, records, size)
        return shard

    def published_before(self) -> list[FileProgress]:
        """The files an interrupted run of this shard published and recorded, each checked against its
        recorded size and sha256, with the same items and fingerprint; the others are left to be rewritten."""
        found = []
        for uri in self.store.list(self.progress_prefix(), ".json"):
            try:
                record = FileProgress.model_validate_json(self.store.read_bytes(uri))
            except ValidationError:
                self.logger.warning("ignoring %s: not a progress record", uri)
                continue
            if (record.items_sha256, record.fingerprint) != (self.items_sha256, self.fingerprint):
                continue  # made with other items or settings: its file will be rewritten
            found.append(record)

        def verified(record: FileProgress) -> bool:
            shard = record.shard
            try:
                return self.store.size(shard.uri) == shard.bytes and self.store.sha256(shard.uri) == shard.sha256
            except ObjectNotFoundError:
                return False

        with ThreadPoolExecutor(max_workers=_IO_THREADS) as pool:
            checks = list(pool.map(verified, found))
        return [record for record, ok in zip(found, checks, strict=True) if ok]

    def reuse(self, shard: Shard) -> None:
        """List a file published by an earlier run of this shard as published by this one."""
        self.published.append(shard)

    def clear_progress(self) -> None:
        """Once the shard's marker holds its outcome: its progress records go, and so do the temp files that writes
        of this shard killed mid-way left (its progress records', its parts', its marker's): no other worker
        writes those."""
        for uri in self.store.list(self.progress_prefix()):
            self.store.delete(uri)
        marker = marker_uri(self.output_prefix, self.index, self.count).rsplit("/", 1)[-1]
        abandoned = sum(self.store.remove_abandoned_writes(folder, start) for folder, start in (
            (self.progress_prefix(), ""), (join(self.output_prefix, DATA_DIR), self.part_prefix),
            (join(self.output_prefix, MARKERS_DIR), marker)))
        if abandoned:
            self.logger.info("removed %d temp file(s) that interrupted writes of this shard left", abandoned)

    def outcome(
        self,
        accounting: Accounting,
        totals: dict[str, int | float] | None = None,
        histograms: dict[str, dict[str, int]] | None = None,
    ) -> ShardOutcome:
        """The outcome of this shard listing every file it published, in publishing order."""
        return ShardOutcome(
            shard_index=self.index,
            shard_count=self.count,
            shards=list(self.published),
            accounting=accounting,
            totals=dict(totals or {}),
            histograms={k: dict(v) for k, v in (histograms or {}).items()},
        )


# ---------------------------------------------------------------------------------------- prefix state


def _scan_markers(store: ObjectStore, output_prefix: str, count: int) -> dict[int, str]:
    """Index -> URI of this sharding's markers; refuses a prefix holding another sharding's markers."""
    found: dict[int, str] = {}
    for uri in store.list(join(output_prefix, MARKERS_DIR)):
        match = _MARKER_RE.match(uri.rsplit("/", 1)[-1])
        if match is None:
            logger.warning("ignoring %s: not a shard marker name", uri)
            continue
        idx, cnt = int(match.group(1)), int(match.group(2))
        if cnt != count:
            raise ShardingError(
                f"{output_prefix} holds marker {uri} of a {cnt}-shard run, but this run uses {count} shards; "
                f"refusing to mix shardings: rerun with {cnt} shards or write to a new output prefix"
            )
        if idx >= count:
            raise ShardingError(f"marker {uri} names shard {idx}, out of range for {count} shards")
        found[idx] = uri
    return found


def _read_marker(store: ObjectStore, uri: str, index: int, count: int) -> ShardMarker:
    try:
        marker = ShardMarker.model_validate_json(store.read_bytes(uri))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "document"
        raise ShardingError(
            f"marker {uri} is unreadable ({where}: {first['msg']}); delete it to redo that shard"
        ) from err
    if (marker.outcome.shard_index, marker.outcome.shard_count) != (index, count):
        raise ShardingError(
            f"marker {uri} records shard {marker.outcome.shard_index} of {marker.outcome.shard_count}, "
            f"not shard {index} of {count}"
        )
    return marker


def _check_outcome(outcome: object, ctx: ShardContext) -> ShardOutcome:
    where = f"{ctx.stage} shard {ctx.index}/{ctx.count}"
    if not isinstance(outcome, ShardOutcome):
        raise TypeError(f"{where}: process returned {type(outcome).__name__}, expected a ShardOutcome")
    if (outcome.shard_index, outcome.shard_count) != (ctx.index, ctx.count):
        raise ShardingError(
            f"{where}: process returned the outcome of shard {outcome.shard_index} of {outcome.shard_count}"
        )
    data_prefix = join(ctx.output_prefix, DATA_DIR) + "/"
    listed = set()
    for shard in outcome.shards:
        if not shard.uri.startswith(data_prefix):
            raise ShardingError(f"{where}: shard file {shard.uri} is outside {data_prefix}")
        if shard.uri in listed:
            raise ShardingError(f"{where}: shard file {shard.uri} is listed twice in the outcome")
        listed.add(shard.uri)
    unlisted = [s.uri for s in ctx.published if s.uri not in listed]
    if unlisted:
        # Such a file would sit in the prefix without any manifest naming it.
        raise ShardingError(f"{where}: published {unlisted[0]} but did not list it in the outcome")
    return outcome


# ---------------------------------------------------------------------------------------- one configuration


def restart_hint(stage: str, output_prefix: str) -> str:
    """How to start a stage's output over under new settings (the second way out of a settings refusal)."""
    pipeline_stage = "import" if stage.startswith("import") else stage
    return (f"delete {output_prefix} (in a pipeline run: `python -m dflash_pipeline restart --config RUN.toml "
            f"--stage {pipeline_stage}`, which deletes the later stages' outputs too), or write to a new output "
            "prefix (a new run_id)")


def _check_identity(marker: ShardMarker, uri: str, identity: StageIdentity, stage: str, output_prefix: str) -> None:
    name = uri.rsplit("/", 1)[-1]
    refuse_changed(marker.identity, identity, f"{output_prefix} (marker {name}) was made with other settings of the "
                   f"{stage} stage", restart_hint(stage, output_prefix))


def _agreed_identity(loaded: Sequence[ShardMarker], output_prefix: str) -> StageIdentity | None:
    """The one identity the markers record (None: none records one); refuses markers that disagree, which
    shards started together under different settings leave, since each found no marker to compare with."""
    recorded = [(i, m.identity) for i, m in enumerate(loaded) if m.identity is not None]
    if not recorded:
        return None
    first_index, first = recorded[0]
    for index, other in recorded[1:]:
        if other.sha256 != first.sha256:
            try:
                refuse_changed(first, other, f"the shards of {output_prefix} ran with different settings, so they "
                               "cannot be merged into one manifest",
                               restart_hint(loaded[0].stage, output_prefix),
                               labels=(f"in shard {first_index}", f"in shard {index}"))
            except ConfigError as err:
                raise ShardingError(str(err)) from err
    return first


# ---------------------------------------------------------------------------------------- run / finalize


def run_shard(
    stage: str,
    store: ObjectStore,
    output_prefix: str,
    items: Sequence[str],
    index: int,
    count: int,
    process: Callable[[ShardContext], ShardOutcome],
    *,
    scratch_root: str | None = None,
    fingerprint: str = "",
    identity: StageIdentity | None = None,
    share: Callable[[Sequence[str], int, int], list[str]] = assign,
) -> ShardOutcome:
    """Run shard ``index`` of ``count`` over ``share(items, index, count)`` (default `assign`) unless it is
    already done.

    ``items`` is the full listing of the stage's inputs. The marker is written after ``process`` returns,
    i.e. after every file it published; a crash before that leaves the shard to be redone by a rerun. With
    ``identity`` (the stage's settings and image) the shard refuses to start, before any item is processed,
    when a marker of the prefix was written under another one (its own marker, else the lowest shard's: the
    markers agree with each other, or `finalize` refuses them).
    """
    log = _ShardLog(logger, f"{stage} shard {index}/{count}")
    assigned = share(items, index, count)
    digest = _items_digest(assigned)
    markers = _scan_markers(store, output_prefix, count)
    own = marker_uri(output_prefix, index, count)
    manifest = join(output_prefix, MANIFEST_NAME)
    complete = store.exists(manifest)
    own_marker = _read_marker(store, own, index, count) if index in markers else None
    if identity is not None and markers:
        first = min(markers)
        reference = own_marker or _read_marker(store, markers[first], first, count)
        _check_identity(reference, own if own_marker else markers[first], identity, stage, output_prefix)
    if complete and index not in markers:
        raise ShardingError(
            f"{manifest} exists but marker {own} is missing: the prefix was changed after the stage "
            "completed; write to a new output prefix"
        )
    if own_marker is not None:
        marker = own_marker
        if marker.stage != stage:
            raise ShardingError(f"marker {own} was written by stage {marker.stage!r}, not {stage!r}")
        if marker.items_sha256 != digest:
            changed = (
                f"marker {own} was written for {marker.item_count} items (sha256 {marker.items_sha256[:12]}), "
                f"but {len(assigned)} items (sha256 {digest[:12]}) are assigned now: the input listing changed"
            )
            if not complete:
                raise ShardingError(f"{changed}; refusing to mix inputs, write to a new output prefix")
            log.warning("%s since the stage completed", changed)
        if complete:
            log.info("stage complete (%s exists), nothing to do", manifest)
        else:
            log.info("shard already complete (%s), skipping", own)
        log.info("%s", left_out_line(marker.outcome.accounting))
        return marker.outcome

    log.info("processing %d of %d items", len(assigned), len(items))
    scratch = make_scratch(f"dflash-{stage}-{index:05d}-", scratch_root)
    try:
        ctx = ShardContext(stage, index, count, assigned, output_prefix, store, scratch, log,
                           items_sha256=digest, fingerprint=fingerprint)
        outcome = _check_outcome(process(ctx), ctx)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    marker = ShardMarker(stage=stage, item_count=len(assigned), items_sha256=digest, outcome=outcome,
                         identity=identity)
    store.write_bytes(own, marker.model_dump_json(indent=2).encode("utf-8"))
    ctx.clear_progress()  # the marker holds all of it now
    records = sum(s.records for s in outcome.shards)
    log.info("shard complete: %d records in %d files, marker %s", records, len(outcome.shards), own)
    log.info("%s", left_out_line(outcome.accounting))
    return outcome


def _check_present(store: ObjectStore, shards: Sequence[Shard]) -> None:
    def check(shard: Shard) -> None:
        try:
            size = store.size(shard.uri)
        except ObjectNotFoundError:
            raise ShardingError(f"shard file {shard.uri} recorded in a marker is missing") from None
        if size != shard.bytes:
            raise ShardingError(f"shard file {shard.uri} has {size} bytes, its marker records {shard.bytes}")

    with ThreadPoolExecutor(max_workers=_IO_THREADS) as pool:
        list(pool.map(check, shards))


def finalize(
    store: ObjectStore,
    output_prefix: str,
    count: int,
    build_manifest: Callable[[MergedOutcome], Manifest],
    identity: StageIdentity | None = None,
) -> str | None:
    """Write the stage manifest once every shard is marked complete; returns its URI, or None if not yet.

    Safe to call from every worker as it ends: the manifest is created with put_if_absent, so exactly one
    of several workers finishing together writes it and the others log that it was already written. The
    markers must record one identity, this worker's (`identity`) where given; the manifest's producer records
    its digest.
    """
    log = _ShardLog(logger, f"finalize {output_prefix}")
    manifest = join(output_prefix, MANIFEST_NAME)
    markers = _scan_markers(store, output_prefix, count)
    if len(markers) < count:
        missing = sorted(set(range(count)) - set(markers))
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        log.info("%d/%d shards complete; waiting on shard(s) %s for the manifest", len(markers), count, shown)
        return None
    if store.exists(manifest):
        log.info("manifest %s was already written by another worker; nothing to do", manifest)
        return manifest

    with ThreadPoolExecutor(max_workers=_IO_THREADS) as pool:
        loaded = list(pool.map(lambda i: _read_marker(store, markers[i], i, count), range(count)))
    stages = sorted({m.stage for m in loaded})
    if len(stages) > 1:
        raise ShardingError(f"{output_prefix} holds markers of several stages {stages}; refusing to merge them")
    agreed = _agreed_identity(loaded, output_prefix)
    if identity is not None:
        refuse_changed(agreed, identity, f"{output_prefix} was made with other settings of the {stages[0]} stage",
                       restart_hint(stages[0], output_prefix))
    merged = merge_outcomes(m.outcome for m in loaded)
    _check_present(store, merged.shards)
    built = build_manifest(merged)
    if agreed is not None:
        built = built.model_copy(update={"producer": built.producer.model_copy(
            update={"settings_sha256": agreed.sha256})})
    expected = {s.uri for s in merged.shards}
    got = [s.uri for s in built.shards]
    if len(got) != len(set(got)) or set(got) != expected:
        extra, lacking = sorted(set(got) - expected), sorted(expected - set(got))
        raise ShardingError(
            f"the manifest built for {output_prefix} must list every shard file exactly once "
            f"(not listed: {lacking[:3]}, unknown: {extra[:3]}, duplicated: {len(got) - len(set(got))})"
        )
    stray = [u for u in store.list(join(output_prefix, DATA_DIR)) if u not in expected]
    if stray:
        # Harmless to readers (they follow the manifest) but a sign that a rerun was not deterministic.
        log.warning("%d object(s) under %s/ are in no shard outcome, e.g. %s", len(stray), DATA_DIR, stray[0])
    uri, created = write_manifest(store, output_prefix, built)
    if created:
        log.info("wrote manifest %s (%d shards, %d records)", uri, len(built.shards), built.total_records)
        if count > 1:  # a single shard's worker has said it already
            log.info("all shards: %s", left_out_line(built.accounting))
    else:
        log.info("manifest %s was already written by another worker; nothing to do", uri)
    return uri
