"""Resuming an interrupted tokenize shard from the files it had published, with the same bytes as one run.

A shard streams its input lines (positions 0..N-1, every line counted, bad ones included) through fixed
batches and two rolling writers, training and held-out, each of which publishes a file when it passes the
target size, always at the end of a batch. With every published file goes a progress record (see
`ShardContext.published_before`) holding the running sums at that batch end (`State`).

On a rerun each writer keeps its longest run of verified files from part 0; the resume point R is the
latest end among them, and the sums restart from the state recorded there. Batches that end at or before R
are not tokenised again, except the lines the other writer still lacks (those past its own last file that
are destined to it, by the held-out split of their id): these are tokenised, batch by batch as before, so
that its open file receives the same record batches as in an uninterrupted run, and are not counted twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from dflash_shared.quality import GateCounts
from dflash_shared.runner import FileProgress
from dflash_tokenize import split

SPLITS: tuple[split.Split, ...] = ("train", "heldout")


@dataclass
class State:
    """The running sums of one shard at a batch end: what its accounting is built from."""

    position: int = 0
    gate: GateCounts = field(default_factory=GateCounts)
    totals: Counter[str] = field(default_factory=Counter)
    histogram: Counter[str] = field(default_factory=Counter)

    def to_json(self) -> dict[str, Any]:
        return {"position": self.position, "seen": self.gate.seen, "bad": dict(self.gate.bad),
                "examples": self.gate.examples, "totals": dict(self.totals), "histogram": dict(self.histogram)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> State:
        gate = GateCounts(seen=int(data["seen"]), bad=Counter(data["bad"]),
                          examples={k: list(v) for k, v in data["examples"].items()})
        return cls(int(data["position"]), gate, Counter(data["totals"]), Counter(data["histogram"]))


def _part(uri: str) -> int:
    # "part-00003-0007.arrow" -> 7: the writer's own file number.
    return int(uri.rsplit("/", 1)[-1].split(".", 1)[0].rsplit("-", 1)[-1])


@dataclass
class Plan:
    """Where a shard resumes: the files it reuses, each writer's next part and end, the sums at R."""

    reused: list[FileProgress] = field(default_factory=list)
    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    ends: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    state: State = field(default_factory=State)

    @property
    def position(self) -> int:
        return self.state.position

    def needed(self, lines: list[tuple[str, bytes]], start: int, fraction: float) -> tuple[str | None, list]:
        """(the writer that lacks records, its lines) of a batch at `start` that ends at or before R."""
        behind = next((name for name in SPLITS if self.ends[name] < self.position), None)
        if behind is None:
            return None, []
        wanted = []
        for offset, (where, line) in enumerate(lines):
            if start + offset < self.ends[behind]:
                continue
            try:
                record_id = orjson.loads(line).get("id")
            except (orjson.JSONDecodeError, AttributeError):
                continue  # rejected as malformed, counted in the state already
            if isinstance(record_id, str) and split.is_heldout(record_id, fraction) == (behind == "heldout"):
                wanted.append((where, line))
        return behind, wanted


def plan(records: list[FileProgress]) -> Plan:
    """The resume plan from the verified progress records of an interrupted run (none: start afresh)."""
    out = Plan()
    for name in SPLITS:
        mine = sorted((r for r in records if (r.shard.split or "train") == name), key=lambda r: _part(r.shard.uri))
        kept: list[FileProgress] = []
        for number, record in enumerate(mine):
            if _part(record.shard.uri) != number:
                break  # only the unbroken run from part 0: a file after a missing one cannot be reused in order
            kept.append(record)
        if kept:
            out.parts[name] = len(kept)
            out.ends[name] = int(kept[-1].checkpoint["position"])
            out.reused += kept
    if out.reused:
        latest = max(out.reused, key=lambda r: int(r.checkpoint["position"]))
        out.state = State.from_json(latest.checkpoint)
        out.reused.sort(key=order_key)
    return out


def order_key(record: FileProgress) -> tuple[int, int]:
    """The publishing order of an uninterrupted run: by batch end, training file before held-out."""
    return int(record.checkpoint["position"]), SPLITS.index(record.shard.split or "train")
