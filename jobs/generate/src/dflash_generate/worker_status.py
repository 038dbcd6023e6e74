"""Where one generate worker stands, written to `<output>/_status/worker-XXXXX.json` while it runs.

A chunk receipt is written only when a chunk is complete, which at scale is hours apart; this report comes
every `progress_every_s` seconds (default 5 minutes) with the worker's chunks (committed, resumed, planned),
prompts resolved of those it is generating, output tokens, the rate and an ETA for this worker. `pipeline
status` adds the workers up: the stage's rate is their sum, its ETA the slowest worker's. Written through
`dflash_shared.progress_report.BackgroundWriter`, so a slow store never holds up the engine; the last report
(done, stopped or failed) is written before the worker exits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dflash_shared.progress_report import (
    GENERATE_STATUS_DIR,
    SCHEMA_VERSION,
    BackgroundWriter,
    Every,
    utc_stamp,
    worker_status_name,
    write_report,
)
from dflash_shared.storage import ObjectStore, join


def status_uri(output_prefix: str, index: int) -> str:
    return join(output_prefix, GENERATE_STATUS_DIR, worker_status_name(index))


class WorkerStatus:
    """The report of one worker: counts fed by the generation loop, written when due and at the end."""

    def __init__(self, store: ObjectStore, output_prefix: str, index: int, count: int, chunks: int,
                 chunks_resumed: int, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.uri, self.index, self.count = store, status_uri(output_prefix, index), index, count
        self.chunks, self.chunks_resumed, self.chunks_committed = chunks, chunks_resumed, chunks_resumed
        self.state = "starting"
        self.prompts = self.prompts_done = self.output_tokens = 0
        self._clock = clock
        self._started: float | None = None
        self._due, self.every_s = Every(interval_s, clock), interval_s
        self._writer = BackgroundWriter(f"generate worker {index} status report")

    def generating(self, prompts: int) -> None:
        """The engine is up and `prompts` prompts are to be generated: the clock of the rate starts."""
        self.state, self.prompts, self._started = "generating", prompts, self._clock()
        self._writer.submit(self._job(self.record()))

    def update(self, prompts_done: int, output_tokens: int) -> None:
        self.prompts_done, self.output_tokens = prompts_done, output_tokens
        if self._writer.idle and self._due.due():
            self._writer.submit(self._job(self.record()))

    def chunk_committed(self) -> None:
        self.chunks_committed += 1

    def record(self) -> dict[str, Any]:
        elapsed = self._clock() - self._started if self._started is not None else 0.0
        rate = self.output_tokens / elapsed if elapsed > 0 else None
        per_prompt = elapsed / self.prompts_done if self.prompts_done else None
        eta = (self.prompts - self.prompts_done) * per_prompt if per_prompt is not None else None
        return {"schema": SCHEMA_VERSION, "stage": "generate", "state": self.state, "worker": self.index,
                "workers": self.count, "chunks": self.chunks, "chunks_committed": self.chunks_committed,
                "chunks_resumed": self.chunks_resumed, "prompts": self.prompts, "prompts_done": self.prompts_done,
                "output_tokens": self.output_tokens,
                "tokens_per_s": None if rate is None else round(rate, 3),
                "eta_s": None if eta is None or self.state != "generating" else round(eta, 1),
                "every_s": self.every_s, "updated": utc_stamp()}

    def _job(self, record: dict[str, Any]) -> Callable[[], None]:
        return lambda: write_report(self.store, self.uri, record)

    def finish(self, state: str) -> None:
        """The last report (done, stopped or failed), written before this returns (a minute at most)."""
        self.state = state
        self._writer.submit(self._job(self.record()))
        self._writer.close()
