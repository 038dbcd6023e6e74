"""A tiny stage run by the runner tests as separate processes (one per shard, like pods of an Indexed Job).

Its items are synthetic names; each shard writes its kept items as several deterministic parts (files and
in-memory bytes alternately), accounts for failed and skipped items, and can pause after a given part
until a signal file appears, so a test can kill it with a shard half-written. A barrier lets several
workers call finalize together. The last stdout line is a JSON summary for the test to read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from dflash_shared.manifests import Accounting, Kind, Manifest, Producer, PromptsSection
from dflash_shared.runner import MergedOutcome, ShardContext, ShardOutcome, finalize, run_shard
from dflash_shared.storage import ObjectStore

STAGE = "runner-test"
FIXED_TIME = datetime(2026, 1, 1, tzinfo=UTC)


def make_items(n: int, seed: int = 0) -> list[str]:
    """n unique item names in a seed-dependent order (the runner must not care about the order)."""
    items = [f"item-{i:04d}" for i in range(n)]
    random.Random(seed).shuffle(items)
    return items


def fate(item: str) -> str:
    """What happens to an item: 'bad-input' (failed), 'duplicate' (skipped) or 'kept'."""
    number = int(item.split("-")[1])
    if number % 7 == 3:
        return "bad-input"
    if number % 11 == 5:
        return "duplicate"
    return "kept"


def part_bytes(items: list[str]) -> bytes:
    line = "".join(f"{item}\t{hashlib.sha256(item.encode()).hexdigest()}\n" for item in items)
    return line.encode() * 20


def make_process(
    parts: int, pause_after: int | None = None, control: Path | None = None
) -> Callable[[ShardContext], ShardOutcome]:
    def process(ctx: ShardContext) -> ShardOutcome:
        kept = [i for i in ctx.items if fate(i) == "kept"]
        failures: dict[str, int] = {}
        skips: dict[str, int] = {}
        examples: dict[str, list[str]] = {}
        for item in ctx.items:
            reason = fate(item)
            if reason != "kept":
                bucket = failures if reason == "bad-input" else skips
                bucket[reason] = bucket.get(reason, 0) + 1
                examples.setdefault(reason, []).append(f"{item}: {reason}")
        size = -(-len(kept) // parts) if kept else 1
        lengths: dict[str, int] = {}
        for k in range(parts):
            group = kept[k * size : (k + 1) * size]
            data = part_bytes(group)
            name = ctx.part_name(k, ".tsv")
            tokens = sum(len(i) for i in group)
            if k % 2 == 0:
                local = Path(ctx.scratch_dir) / name
                local.write_bytes(data)
                ctx.publish(local, name, records=len(group), tokens=tokens)
            else:
                ctx.publish(data, name, records=len(group), tokens=tokens)
            lengths[f"{len(group)}"] = lengths.get(f"{len(group)}", 0) + 1
            if pause_after == k and control is not None:
                (control / f"published-{ctx.index}-{k}").touch()
                deadline = time.monotonic() + 60
                while not (control / "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
        accounting = Accounting(
            input_records=len(ctx.items),
            succeeded=len(kept),
            failed=sum(failures.values()),
            skipped=sum(skips.values()),
            failures_by_reason=failures,
            skips_by_reason=skips,
            examples=examples,
        )
        return ctx.outcome(
            accounting,
            totals={"tokens": sum(len(i) for i in kept), "mean_weight": 0.5},
            histograms={"records_per_part": lengths},
        )

    return process


def build_manifest(merged: MergedOutcome) -> Manifest:
    return Manifest(
        kind=Kind.prompts,
        run_id="runner-test",
        created_at=FIXED_TIME,
        producer=Producer(stage=STAGE, config={"shards": merged.shard_count}),
        shards=merged.shards,
        accounting=merged.accounting,
        section=PromptsSection(sources=["synthetic"], duplicates=merged.accounting.skips_by_reason.get("duplicate", 0)),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--items", type=int, default=60)
    parser.add_argument("--parts", type=int, default=3)
    parser.add_argument("--pause-after", type=int, default=None)
    parser.add_argument("--control", type=Path, default=None)
    parser.add_argument("--barrier", type=int, default=0, help="wait for this many workers before finalize")
    parser.add_argument("--no-finalize", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    store = ObjectStore()
    calls: list[int] = []
    inner = make_process(args.parts, args.pause_after, args.control)

    def process(ctx: ShardContext) -> ShardOutcome:
        calls.append(ctx.index)
        return inner(ctx)

    items = make_items(args.items, seed=args.index)
    run_shard(STAGE, store, args.prefix, items, args.index, args.count, process)
    manifest = None
    if args.barrier and args.control is not None:
        # Lines the workers up so that several of them race to write the manifest.
        (args.control / f"done-{args.index}").touch()
        deadline = time.monotonic() + 60
        while len(list(args.control.glob("done-*"))) < args.barrier and time.monotonic() < deadline:
            time.sleep(0.02)
    if not args.no_finalize:
        manifest = finalize(store, args.prefix, args.count, build_manifest)
    print(json.dumps({"processed": bool(calls), "manifest": manifest}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
