"""Where a run stands, read from its storage alone (no cluster access needed).

A stage is complete when its prefix holds manifest.json; before that its shard markers
(`_markers/shard-XXXXX-of-NNNNN.json`, each carrying the shard's outcome) say how many shards are done
and how their records were accounted for. A generate shard runs for days at scale, so inside a running
generate stage the chunk receipts (`_chunks/*.json`, each chunk's commit record) give the progress: chunks
committed of those planned, the generation rate and an ETA; the workers' own reports (`progress_view`) add
what they are doing between receipts. A running train stage shows its progress report (step, loss, tau,
tokens/s, ETA, last checkpoint). Where the run driver runs (a cluster), its `driver/state.json` adds what only
it knows: a stage's Job state and, for a failed one, the reason, which the table shows as `failed` with the
exit class and the command that continues the run (`resume`). `format_status` prints one line per stage, then
the progress, failures and skips by reason.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from dflash_pipeline.drive.progress_view import generate_progress_reports, train_progress
from dflash_pipeline.drive.run_state import read_run_state
from dflash_pipeline.plan.run_plan import long_duration
from dflash_pipeline.run.config import RunConfig
from dflash_pipeline.run.layout import RunLayout, layout
from dflash_pipeline.run.stages import GENERATE, TRAIN, plan, stage_values
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifest_io import ManifestError, parse_manifest
from dflash_shared.manifests import MANIFEST_NAME, Accounting, Kind
from dflash_shared.runner import MARKERS_DIR, ShardMarker, merge_accounting
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, StorageError, join

_MARKER = re.compile(r"shard-(\d{5})-of-(\d{5})\.json$")
_IO_THREADS = 16
# The exit code in a failure reason: the pod's container ("exited 65 (BAD_INPUT)") or the Job's condition.
_EXIT = re.compile(r"(?:exited|exit code) (\d+)")
# What each exit code says about the failure, and so what to do before the run continues.
_EXIT_CLASSES = {
    int(ExitCode.USAGE): "the configuration is wrong (no retry can pass): fix the run file",
    int(ExitCode.BAD_INPUT): "the input failed a check (no retry can pass): fix the input, or the setting the "
                             "message names",
    int(ExitCode.ENVIRONMENT): "the node or its access is unfit, on every retry: the GPUs, the disk, the "
                               "credentials or the image",
    int(ExitCode.RETRYABLE): "an unexpected or transient failure, on every retry: the log says which",
    int(ExitCode.PREEMPTED): "stopped by a signal on every retry",
    137: "killed (SIGKILL): out of memory, or stopped past its grace period",
}


@dataclass
class StageStatus:
    """The state of one stage's output prefix."""

    stage: str
    kind: str
    prefix: str
    state: str  # complete | in progress | not started | invalid
    shards_done: int = 0
    shard_count: int = 0
    records: int = 0
    input_records: int = 0
    failed: int = 0
    skipped: int = 0
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    skips_by_reason: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    detail: str = ""
    progress: str = ""
    driver_state: str | None = None
    driver_reason: str | None = None
    live: str = ""  # what the stage's own progress reports say (train, generate's workers)
    reports: list[dict[str, Any]] = field(default_factory=list)
    failure: dict[str, Any] | None = None  # the failed Job: exit code and class, message, the next command

    @property
    def shown_state(self) -> str:
        """The table's state: the storage's, unless the driver knows better (a failed or running Job)."""
        if self.state in ("complete", "invalid"):
            return self.state
        if self.driver_state == "failed":
            return "failed"
        if self.state == "not started" and self.driver_state in ("created", "running"):
            return "queued" if self.driver_state == "created" else "running"
        return self.state

    def account(self, accounting: Accounting) -> None:
        self.input_records = accounting.input_records
        self.failed = accounting.failed
        self.skipped = accounting.skipped
        self.failures_by_reason = dict(sorted(accounting.failures_by_reason.items()))
        self.skips_by_reason = dict(sorted(accounting.skips_by_reason.items()))
        self.examples = {k: list(v) for k, v in sorted(accounting.examples.items())}

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "shown_state": self.shown_state}


def stage_status(store: ObjectStore, stage: str, kind: Kind, prefix: str, expected_shards: int) -> StageStatus:
    """Read one stage's prefix: its manifest if written, else its shard markers."""
    status = StageStatus(stage=stage, kind=kind.value, prefix=prefix, state="not started",
                         shard_count=expected_shards)
    uri = join(prefix, MANIFEST_NAME)
    try:
        manifest = parse_manifest(uri, store.read_bytes(uri))
    except ObjectNotFoundError:
        manifest = None
    except ManifestError as err:
        status.state, status.detail = "invalid", str(err)
        return status
    if manifest is not None:
        if manifest.kind != kind:
            status.state, status.detail = "invalid", f"{uri} is a {manifest.kind.value} manifest, not {kind.value}"
            return status
        status.state = "complete"
        status.shards_done = status.shard_count = expected_shards
        status.records = manifest.total_records
        status.account(manifest.accounting)
        status.detail = f"{len(manifest.shards)} file(s), written {manifest.created_at:%Y-%m-%d %H:%M} UTC"
        return status

    found = [m for m in map(_MARKER.search, store.list(join(prefix, MARKERS_DIR))) if m is not None]
    markers = [m.string for m in found]
    counts = {int(m.group(2)) for m in found}
    if len(counts) > 1:
        status.state, status.detail = "invalid", f"markers of several shard counts {sorted(counts)} under {prefix}"
        return status
    if counts and counts != {expected_shards}:
        status.detail = f"markers are of a {counts.pop()}-shard run, the run config says {expected_shards}"
    if not markers:
        return status

    def read(uri: str) -> ShardMarker:
        return ShardMarker.model_validate_json(store.read_bytes(uri))

    try:
        with ThreadPoolExecutor(max_workers=_IO_THREADS) as pool:
            loaded = list(pool.map(read, markers))
    except ValidationError as err:
        status.state, status.detail = "invalid", f"unreadable shard marker under {prefix}: {err.errors()[0]['msg']}"
        return status
    status.state = "in progress"
    status.shards_done = len(loaded)
    status.records = sum(s.records for m in loaded for s in m.outcome.shards)
    status.account(merge_accounting(m.outcome.accounting for m in loaded))
    return status


def run_status(run: RunConfig, store: ObjectStore) -> list[StageStatus]:
    """The status of every stage of the run, upstream first."""
    lay = layout(run.root, run.run_id)
    out = []
    for stage in plan(run):
        shards = run.stages.for_stage(stage.name).shards
        try:
            status = stage_status(store, stage.name, stage.output_kind, stage.output_prefix(lay), shards)
            if stage.name == GENERATE.name and status.state != "complete":
                status.progress = generate_progress(run, store, lay, shards)
                status.live, status.reports = generate_progress_reports(store, lay)
            if stage.name == TRAIN.name and status.state != "complete":
                status.live, status.reports = train_progress(store, lay)
            out.append(status)
        except StorageError as err:
            # One failure for the whole run: a store that cannot be read for one stage cannot for the others,
            # and a table of "unknown" rows would read as a run that has not started.
            raise StorageError(f"cannot read the run's storage at {lay.run_prefix}: {err}", uri=err.uri,
                               code=err.code) from err
    _add_driver_state(run, store, out)
    return out


def _add_driver_state(run: RunConfig, store: ObjectStore, statuses: list[StageStatus]) -> None:
    try:
        state = read_run_state(store, run.root, run.run_id)
    except ValidationError as err:
        statuses[0].detail = f"the run driver's state file does not parse: {err.errors()[0]['msg']}"
        return
    if state is None:
        return
    for status in statuses:
        entry = state.stages.get(status.stage)
        if entry is not None:
            status.driver_state, status.driver_reason = entry.state, entry.reason
            if entry.state == "failed" and status.state != "complete":
                status.failure = failure_view(entry.reason, entry.job)


def failure_view(reason: str | None, job: str | None) -> dict[str, Any]:
    """A failed stage for people: its exit code and what that code means (`dflash_shared.exit_codes`)."""
    codes = [int(m) for m in _EXIT.findall(reason or "")]
    code = codes[-1] if codes else None
    if code is None:
        meaning = "no exit code: the Job itself failed (its deadline, a lost node, an eviction; the reason says)"
    elif code in _EXIT_CLASSES:
        meaning = _EXIT_CLASSES[code]
    elif code > 128:
        meaning = f"killed by signal {code - 128}"
    else:
        meaning = "a failure of the stage's own: the log says which"
    return {"job": job, "exit_code": code, "exit_class": meaning, "message": reason or "no reason given"}


def next_commands(run: RunConfig, stage: str, run_file: str) -> list[str]:
    """What to run after a stage failed: read its log, fix the cause, resume (the failed Jobs go, the rest stays)."""
    cli = f"python -m dflash_pipeline {{}} --config {run_file}" + (" --pilot" if run.pilot_of is not None else "")
    return [f"{cli.format('logs')} {stage}", cli.format("resume")]


def generate_progress(run: RunConfig, store: ObjectStore, lay: RunLayout, shards: int) -> str:
    """'12/40 chunks committed (30%), 2,450 tok/s over 4 engines, ETA 3.1 h', from the receipts in storage.

    The planned chunks are the generate stage's own split of the prompts manifest (`plan_chunks`, chunk_records
    per chunk, file by file). Receipts are read as plain JSON (output_tokens, engine_seconds), so one written by
    another version of the stage still counts. The rate is per engine-second, so it holds however long the pods
    have queued; the ETA assumes the stage's `shards` engines run at once.
    """
    prompts_uri = lay.manifest(Kind.prompts)
    try:
        prompts = parse_manifest(prompts_uri, store.read_bytes(prompts_uri))
    except (ObjectNotFoundError, ManifestError):
        return ""
    chunk_records = int(stage_values(run, GENERATE)["chunk_records"])
    # The generate package is importable once stage_values has read its config.
    from dflash_generate.chunks import CHUNKS_DIR, plan_chunks

    planned = len(plan_chunks(prompts.shards, chunk_records))
    receipts = store.list(join(lay.completions, CHUNKS_DIR), suffix=".json")
    if not receipts:
        return f"0/{planned} chunks committed"
    def read(uri: str) -> dict[str, Any] | None:
        # A receipt cut short or rewritten by hand is named below, not allowed to stop the whole status.
        try:
            receipt = json.loads(store.read_bytes(uri))
            return receipt if isinstance(receipt, dict) else None
        except (ValueError, UnicodeDecodeError):
            return None

    with ThreadPoolExecutor(max_workers=_IO_THREADS) as pool:
        parsed = dict(zip(receipts, pool.map(read, receipts), strict=True))
    loaded = [r for r in parsed.values() if r is not None]
    unreadable = sorted(uri for uri, r in parsed.items() if r is None)
    tokens = sum(int(r.get("output_tokens", 0)) for r in loaded)
    seconds = sum(float(r.get("engine_seconds", 0.0)) for r in loaded)
    done = len(loaded)
    text = f"{done}/{planned} chunks committed ({100 * done / max(planned, 1):.0f}%)"
    if unreadable:
        text += f", {len(unreadable)} unreadable receipt(s) not counted (first: {unreadable[0]})"
    if seconds > 0:
        engines = max(1, min(shards, planned))
        rate = tokens / seconds * engines
        remaining = max(planned - done, 0) * seconds / done / engines
        text += f", {rate:,.0f} tok/s over {engines} engine(s), ETA {long_duration(remaining)}"
    return text


def format_status(run: RunConfig, statuses: list[StageStatus], run_file: str = "RUN.toml") -> str:
    """A table of the stages, then progress, a failed stage's cause and next commands, failures and skips by
    reason with a few examples. `run_file` is the run file as the user named it, for the commands shown."""
    rows = [("stage", "state", "shards", "records", "failed", "skipped", "prefix")]
    for s in statuses:
        rows.append((s.stage, s.shown_state, f"{s.shards_done}/{s.shard_count}", f"{s.records:,}", f"{s.failed:,}",
                     f"{s.skipped:,}", s.prefix))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"run {run.run_id} ({layout(run.root, run.run_id).run_prefix})"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    for s in statuses:
        if s.detail:
            lines.append(f"{s.stage}: {s.detail}")
        if s.progress:
            lines.append(f"{s.stage}: {s.progress}")
        if s.live:
            lines.append(f"{s.stage}: {s.live}")
        if s.failure is not None:
            code = s.failure["exit_code"]
            lines.append(f"{s.stage}: FAILED (Job {s.failure['job']}): {s.failure['message']}")
            lines.append(f"{s.stage}: " + (f"exit {code}: " if code is not None else "") + s.failure["exit_class"])
            first, resume = next_commands(run, s.stage, run_file)
            lines.append(f"{s.stage}: next: read the log (`{first}`), fix the cause, then `{resume}`: it deletes "
                         "the failed Jobs and applies the run again; committed work is kept")
        elif s.driver_state is not None and s.driver_state != "succeeded":
            lines.append(f"{s.stage}: driver: {s.driver_state}" + (f": {s.driver_reason}" if s.driver_reason else ""))
        for title, reasons in (("failed", s.failures_by_reason), ("skipped", s.skips_by_reason)):
            for reason, n in reasons.items():
                example = s.examples.get(reason, [""])[0]
                lines.append(f"{s.stage}: {title} {reason}: {n:,}" + (f" (e.g. {example})" if example else ""))
    return "\n".join(lines) + "\n"
