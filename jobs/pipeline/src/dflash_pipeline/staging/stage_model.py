"""`stage-model`: a target model's folder into the object store, each file verified, a rerun resuming.

    python -m dflash_pipeline stage-model --from /models/Qwen3.6-27B --to s3://bucket/models/Qwen3.6-27B
    python -m dflash_pipeline stage-model --config my-run.toml --from /models/Qwen3.6-27B

The folder is checked first (`model_dir`: config.json, safetensors weights and their index), then the destination
is listed, which is where missing credentials or an endpoint nobody answers on show up, before any byte is hashed.
Every local file is hashed (sha256), uploaded through `ObjectStore.upload_from` (multipart on S3) and read back:
the stored object's size (a HEAD) and sha256 (streamed back) must be the local file's, or the command fails.

Reading back is what every store supports. S3's own SHA256 checksum is not used: for a multipart upload S3 records
a checksum of the parts' checksums, which depends on the part boundaries rather than the file, and S3-compatible
test servers (moto) store whatever checksum the client sends without checking it.

Resuming: each verified file is recorded (with the store's version tag) in a partial listing, and the listing
`dflash-model-files.json` is written last, as the commit point. A rerun keeps a stored object without reading it
when a record gives its sha256 and the object still has that size and tag; any other object of the right size is
read back and kept only if its sha256 matches; the rest is uploaded again.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_pipeline.run.endpoint import run_store
from dflash_pipeline.staging.model_dir import LocalFile, hash_files, scan_model_dir
from dflash_pipeline.staging.model_listing import (
    LISTING_NAME,
    PARTIAL_NAME,
    FileRecord,
    Listing,
    differences,
    read_listing,
)
from dflash_shared.errors import BadInputError, ConfigError
from dflash_shared.exit_codes import ExitCode
from dflash_shared.model_copy import fetch_model
from dflash_shared.progress import Progress, human_duration
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, StorageError, is_s3, join

if TYPE_CHECKING:
    from dflash_pipeline.run.config import RunConfig

log = logging.getLogger(__name__)
_OURS = frozenset({LISTING_NAME, PARTIAL_NAME})


@dataclass(frozen=True)
class StageResult:
    """What one staging did: every file is verified at `destination` once it returns."""

    destination: str
    files: int
    total_bytes: int
    uploaded: list[str]
    uploaded_bytes: int
    seconds: float


def _size(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 100_000 else f"{n:,} bytes"


def _rate(n: int, seconds: float) -> str:
    return f"{n / 1e6 / seconds:,.1f} MB/s" if seconds > 0 else "- MB/s"


def _took(n: int, seconds: float) -> str:
    """' in 2.9 s (69.3 MB/s)'; nothing for small files, whose time is the round trip, not the transfer."""
    return f" in {seconds:.1f} s ({_rate(n, seconds)})" if n >= 2**20 else ""


def _examples(items: list[str]) -> str:
    return "; ".join(items[:3]) + (f"; and {len(items) - 3} more" if len(items) > 3 else "")


class _Stager:
    """Stages the files of one folder to one prefix; `run` from one thread, `stage_file` from many."""

    def __init__(self, store: ObjectStore, directory: str, dest: str, known: dict[str, FileRecord],
                 partial: Listing) -> None:
        self.store = store
        self.directory = directory
        self.dest = dest
        self.known = known
        self.partial = partial
        self.partial_written = False
        # Set at the first failure (or a signal): files not yet begun are left for the rerun.
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def _record(self, record: FileRecord) -> None:
        """Note a file verified just now in the partial listing, so an interruption does not lose the check."""
        with self._lock:
            self.partial.files[record.name] = record
            self.store.write_bytes(join(self.dest, PARTIAL_NAME), self.partial.to_bytes())
            self.partial_written = True

    def stage_file(self, f: LocalFile, present: bool) -> tuple[FileRecord, bool] | None:
        """Make the object at dest/name hold exactly the local file; (its record, whether it was uploaded).

        None when the staging stopped before this file began.
        """
        if self.stop.is_set():
            return None
        try:
            return self._stage_file(f, present)
        except BaseException:
            self.stop.set()
            raise

    def _stage_file(self, f: LocalFile, present: bool) -> tuple[FileRecord, bool]:
        uri = join(self.dest, f.name)
        size, etag = -1, ""
        if present:
            try:
                size, etag = self.store.stat(uri)
            except ObjectNotFoundError:  # deleted since the prefix was listed
                present = False
        if present:
            record = self.known.get(f.name)
            if size == f.size and record is not None and (record.size, record.sha256, record.etag) == (
                    f.size, f.sha256, etag):
                log.info("kept %s: %s, already stored and verified (its sha256 recorded, the object unchanged)",
                         f.name, _size(f.size))
                return FileRecord(f.name, f.size, f.sha256, etag), False
            if size == f.size:
                start = time.monotonic()
                stored = self.store.sha256(uri)
                if stored == f.sha256:
                    log.info("kept %s: %s, already stored, read back%s: sha256 matches", f.name, _size(f.size),
                             _took(f.size, time.monotonic() - start))
                    kept = FileRecord(f.name, f.size, f.sha256, etag)
                    self._record(kept)
                    return kept, False
                log.warning("%s: the stored object has sha256 %s, the local file %s: uploading it again", f.name,
                            stored, f.sha256)
            else:
                log.warning("%s: the stored object has %s, the local file %s: uploading it again", f.name,
                            _size(size), _size(f.size))
        record = self._upload(f, uri)
        self._record(record)
        return record, True

    def _upload(self, f: LocalFile, uri: str) -> FileRecord:
        start = time.monotonic()
        self.store.upload_from(os.path.join(self.directory, f.name), uri)
        uploaded_s = time.monotonic() - start
        size, etag = self.store.stat(uri)
        if size != f.size:
            raise StorageError(f"{uri} holds {size:,} bytes after the upload of {f.name}, expected {f.size:,}", uri=uri)
        start = time.monotonic()
        stored = self.store.sha256(uri)
        read_s = time.monotonic() - start
        if stored != f.sha256:
            raise StorageError(f"{uri} has sha256 {stored} after the upload, the local file {f.sha256} (did "
                               f"{f.name} change while it was staged?)", uri=uri)
        log.info("uploaded %s: %s%s, read back%s: size and sha256 match", f.name, _size(f.size),
                 _took(f.size, uploaded_s), _took(f.size, read_s))
        return FileRecord(f.name, f.size, f.sha256, etag)


def _local_listing(directory: str) -> Listing | None:
    """The listing inside the source folder (one `fetch_model` copied along with a staged model), if any."""
    path = os.path.join(directory, LISTING_NAME)
    return Listing.from_bytes(Path(path).read_bytes(), path) if os.path.isfile(path) else None


def _check_destination(dest: str, directory: str, committed: Listing | None, local: dict[str, FileRecord],
                       foreign: list[str], replace: bool, hashed: bool = True) -> bool:
    """Refuse a prefix holding another model unless `replace`; True when the prefix holds one (to be replaced)."""
    differ = differences(committed, local, hashed) if committed is not None else []
    if replace or not (differ or foreign):
        return bool(differ or foreign)
    if differ and committed is not None:
        raise ConfigError(f"{dest} holds another model: its {LISTING_NAME} (staged from {committed.source or '?'} "
                          f"at {committed.written_at or '?'}) differs from {directory}: {_examples(differ)}; stage "
                          "to another --to, or pass --replace to overwrite it")
    raise ConfigError(f"{dest} already holds {len(foreign)} object(s) that are not files of {directory}: "
                      f"{_examples(foreign)}; stage to another --to, or pass --replace to delete them")


def stage_model_dir(store: ObjectStore, directory: str, destination: str, *, source: str | None = None,
                    workers: int = 4, replace: bool = False) -> StageResult:
    """Stage the model folder `directory` at the prefix `destination`; `source` is what the listing names."""
    dest = destination.rstrip("/")
    files = scan_model_dir(directory, exclude=_OURS)
    # Listed before anything is hashed: credentials or an endpoint that fail do so now, not after an hour.
    present = {uri[len(dest) + 1:] for uri in store.list(dest)}
    committed = read_listing(store, join(dest, LISTING_NAME)) if LISTING_NAME in present else None
    partial = read_listing(store, join(dest, PARTIAL_NAME)) if PARTIAL_NAME in present else None
    foreign = sorted(present - {f.name for f in files} - _OURS)
    # Names and sizes first: another model at the prefix is refused before an hour of hashing, not after.
    _check_destination(dest, directory, committed, {f.name: FileRecord(f.name, f.size, "") for f in files}, foreign,
                       replace, hashed=False)
    files = hash_files(directory, files, workers)
    local = {f.name: FileRecord(f.name, f.size, f.sha256) for f in files}
    expected = _local_listing(directory)
    if expected is not None and (bad := differences(expected, local)):
        raise BadInputError(f"{directory} does not match its own {LISTING_NAME}: {_examples(bad)}")
    replacing = _check_destination(dest, directory, committed, local, foreign, replace)
    if replacing and committed is not None:
        # Decommitted first: while it is being replaced the prefix must not claim to hold a whole model.
        store.delete(join(dest, LISTING_NAME))
        log.warning("replacing the model staged at %s from %s", dest, committed.source or "?")
    # The partial records are the newer where both have one (a repair of a committed model was interrupted).
    known = {**(committed.files if committed else {}), **(partial.files if partial else {})}
    known = {name: r for name, r in known.items() if name in local and r.sha256 == local[name].sha256}
    stager = _Stager(store, directory, dest, known, Listing(source or directory, dict(known)))
    total = sum(f.size for f in files)
    log.info("staging %d files (%s) from %s to %s", len(files), _size(total), directory, dest)
    start = time.monotonic()
    records, uploaded = _stage_all(stager, files, present, workers, total)
    seconds = time.monotonic() - start
    for name in foreign:  # only reached with replace
        store.delete(join(dest, name))
        log.info("deleted %s: not a file of %s", name, directory)
    listing = Listing(source or directory, records)
    if committed is not None and not replacing and committed.files == records:
        written = "unchanged"  # a rerun that found everything in place writes nothing
    else:
        store.write_bytes(join(dest, LISTING_NAME), listing.to_bytes())
        written = "written"
    if stager.partial_written or partial is not None:
        store.delete(join(dest, PARTIAL_NAME))
    sent = sum(records[name].size for name in uploaded)
    log.info("staged %s: %d files (%s) verified in %s; %d uploaded (%s, %s with the read-back), %d already there; "
             "listing %s %s", dest, len(files), _size(total), human_duration(seconds), len(uploaded),
             _size(sent), _rate(sent, seconds), len(files) - len(uploaded), LISTING_NAME, written)
    return StageResult(dest, len(files), total, sorted(uploaded), sent, seconds)


def _stage_all(stager: _Stager, files: Iterable[LocalFile], present: set[str], workers: int,
               total: int) -> tuple[dict[str, FileRecord], list[str]]:
    """Stage every file, `workers` at once; the first failure stops files not yet started and is raised."""
    records: dict[str, FileRecord] = {}
    uploaded: list[str] = []
    with Progress(total, "bytes", f"staging {stager.dest}") as progress, \
            ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures: list[Future[tuple[FileRecord, bool] | None]] = [
            pool.submit(stager.stage_file, f, f.name in present) for f in files]
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    staged = future.result()
                    if staged is None:
                        continue  # stopped: the failure that stopped it is raised from its own future
                    record, sent = staged
                    records[record.name] = record
                    if sent:
                        uploaded.append(record.name)
                    progress.update(record.size)
        except BaseException:
            stager.stop.set()
            for future in pending:
                future.cancel()
            raise
    return records, uploaded


def run_stage_model(source: str, to: str | None, run_file: Path | None, *, workers: int = 4, replace: bool = False,
                    scratch: str | None = None) -> int:
    """The `stage-model` command: resolve --to and the endpoint, copy an s3:// --from to scratch, stage, report."""
    run: RunConfig | None = None
    if run_file is not None:
        from dflash_pipeline.run.config import load_run_config

        run = load_run_config(run_file)
    dest = (to or (run.target.uri if run is not None else "")).rstrip("/")
    if not dest:
        raise ConfigError("stage-model: give --to s3://.../models/NAME, or --config with the run's target.uri")
    if run is not None and dest != run.target.uri.rstrip("/"):
        log.warning("--to %s is not the run file's target.uri (%s)", dest, run.target.uri)
    if workers < 1:
        raise ConfigError(f"--workers {workers}: give at least 1")
    store = run_store(run, run_file, [dest, source])
    if source.rstrip("/") == dest or (not is_s3(source) and not is_s3(dest)
                                      and os.path.realpath(source) == os.path.realpath(dest)):
        raise ConfigError(f"--from and --to are both {dest}")
    directory = source
    if is_s3(source):
        try:
            directory = fetch_model(store, source, scratch or tempfile.gettempdir(), workers)
        except ConfigError as err:  # "holds no objects": name the flag
            raise ConfigError(f"--from {source}: {err}") from err
        except ObjectNotFoundError as err:
            raise ConfigError(f"--from {source}: {err}") from err
    result = stage_model_dir(store, directory, dest, source=source, workers=workers, replace=replace)
    if directory != source:
        shutil.rmtree(directory, ignore_errors=True)  # the scratch copy; kept on failure so a rerun resumes it
    print(f"staged {result.files} files ({_size(result.total_bytes)}) at {result.destination}: "
          f"{len(result.uploaded)} uploaded, {result.files - len(result.uploaded)} already there")
    return ExitCode.OK
