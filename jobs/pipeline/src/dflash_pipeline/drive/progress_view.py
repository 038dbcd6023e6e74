"""What the long stages report while they run, read back for `pipeline status` (`dflash_shared.progress_report`).

    train     <drafter>/progress.json: step/total, loss, tau, tokens/s, ETA, the last checkpoint
    generate  <completions>/_status/worker-*.json, one per worker: added up; the rate is their sum, the ETA
              the slowest worker's

Each report says how often it comes (`every_s`); one not renewed for three of those reads as stale (the pod is
gone, or hung), with the command that shows its log. Reports are read as plain JSON, so one written by another
version of a stage still shows what it has.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from dflash_pipeline.plan.run_plan import long_duration
from dflash_pipeline.run.layout import RunLayout
from dflash_shared.progress import human_count
from dflash_shared.progress_report import (
    DEFAULT_INTERVAL_S,
    GENERATE_STATUS_DIR,
    TRAIN_PROGRESS_NAME,
    parse_stamp,
    read_report,
)
from dflash_shared.storage import ObjectStore, join

_IO_THREADS = 16
# A report is stale once this many of its intervals have passed without a new one (plus a minute of slack).
STALE_INTERVALS = 3
_LIVE_STATES = ("starting", "generating", "training")


def _number(report: dict[str, Any], key: str) -> float | None:
    value = report.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def age_s(report: dict[str, Any], now: datetime) -> float | None:
    updated = parse_stamp(str(report.get("updated")))
    return None if updated is None else max((now - updated).total_seconds(), 0.0)


def freshness(reports: list[dict[str, Any]], now: datetime) -> str:
    """'updated 3 min ago', or the stale warning when the newest live report is older than its intervals."""
    ages = [(a, r) for r in reports if (a := age_s(r, now)) is not None]
    if not ages:
        return ""
    age, newest = min(ages, key=lambda item: item[0])
    every = _number(newest, "every_s") or DEFAULT_INTERVAL_S
    text = f"updated {long_duration(age)} ago"
    if str(newest.get("state")) in _LIVE_STATES and age > STALE_INTERVALS * every + 60:
        text += f" (stale: reports come every {long_duration(every)}; is its pod running? `pipeline logs` shows it)"
    return text


def format_train(report: dict[str, Any], now: datetime) -> str:
    """'training: step 1,234/10,000 (12%), loss 2.3100, tau 3.21, 45.6k tok/s, ETA 1.2 d; ...; updated 4 min ago'."""
    step, total = _number(report, "step"), _number(report, "total")
    parts = [str(report.get("state", "?"))]
    if step is not None and total:
        parts[0] += f": step {step:,.0f}/{total:,.0f} ({100 * step / total:.0f}%)"
    for key, label, fmt in (("loss", "loss", "{:.4f}"), ("tau", "tau", "{:.2f}")):
        value = _number(report, key)
        if value is not None:
            parts.append(f"{label} {fmt.format(value)}")
    rate = _number(report, "tokens_per_s")
    if rate is not None:
        parts.append(f"{human_count(rate)} tok/s")
    tokens = _number(report, "tokens")
    if tokens:
        parts.append(f"{human_count(tokens)} tokens")
    if report.get("state") == "training":
        parts.append(f"ETA {long_duration(_number(report, 'eta_s'))}")
    text = ", ".join(parts)
    checkpoint = report.get("last_checkpoint")
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("step"), int):
        text += f"; last checkpoint step {checkpoint['step']:,}"
    fresh = freshness([report], now)
    return text + (f"; {fresh}" if fresh else "")


def train_progress(store: ObjectStore, lay: RunLayout, now: datetime | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The train stage's line and its report ('' and none before the first report)."""
    uri = join(lay.drafter, TRAIN_PROGRESS_NAME)
    try:
        report = read_report(store, uri)
    except ValueError as err:
        return f"progress report unreadable ({err})", []
    if report is None:
        return "", []
    return format_train(report, now or datetime.now(UTC)), [report]


def format_generate(reports: list[dict[str, Any]], now: datetime) -> str:
    """'workers: 3 generating, 1 done (4 of 4 reporting); 9,800 tok/s, 1.2M tokens, ...; updated 2 min ago'."""
    by_state: dict[str, int] = {}
    for r in reports:
        by_state[str(r.get("state", "?"))] = by_state.get(str(r.get("state", "?")), 0) + 1
    workers = max((int(w) for r in reports if (w := _number(r, "workers")) is not None), default=len(reports))
    states = ", ".join(f"{n} {state}" for state, n in sorted(by_state.items()))
    text = f"workers: {states} ({len(reports)} of {workers} reporting)"
    generating = [r for r in reports if r.get("state") == "generating"]
    if generating:
        rate = sum(_number(r, "tokens_per_s") or 0.0 for r in generating)
        tokens = sum(_number(r, "output_tokens") or 0.0 for r in generating)
        done = sum(_number(r, "prompts_done") or 0.0 for r in generating)
        prompts = sum(_number(r, "prompts") or 0.0 for r in generating)
        etas = [e for r in generating if (e := _number(r, "eta_s")) is not None]
        text += (f"; now {human_count(rate)} tok/s, {human_count(tokens)} tokens, prompts {done:,.0f}/{prompts:,.0f}"
                 f" of the chunks they generate, ETA {long_duration(max(etas) if etas else None)} (slowest worker)")
    fresh = freshness(reports, now)
    return text + (f"; {fresh}" if fresh else "")


def generate_progress_reports(store: ObjectStore, lay: RunLayout,
                              now: datetime | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The generate workers' line and their reports ('' and none before any worker reported)."""
    uris = store.list(join(lay.completions, GENERATE_STATUS_DIR), suffix=".json")
    if not uris:
        return "", []

    def read(uri: str) -> dict[str, Any] | None:
        try:
            return read_report(store, uri)
        except ValueError:
            return None  # cut short or edited by hand: the others still count

    with ThreadPoolExecutor(max_workers=_IO_THREADS) as pool:
        reports = [r for r in pool.map(read, sorted(uris)) if r is not None]
    if not reports:
        return "", []
    return format_generate(reports, now or datetime.now(UTC)), reports
