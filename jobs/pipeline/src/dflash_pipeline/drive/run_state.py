"""The run driver's view of a run, written to `<root>/<run_id>/driver/state.json` after every change.

Storage says what a stage has committed (its manifest, its shard markers); only the driver knows what it
has asked the cluster for: which Job it created or adopted, whether that Job is still waiting for its
input, running, or failed and why. `pipeline status` reads this file beside the manifests, so a user sees
"failed: train-0 BackoffLimitExceeded, exit 65" without cluster access.

The file is rewritten whole (an atomic write: readers see the old or the new state, never half) and is
advisory: the driver rebuilds its decisions from storage and the cluster on every start, never from here.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_pipeline.run.layout import layout
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, join

SCHEMA_VERSION: Literal[1] = 1
DRIVER_FOLDER = "driver"
STATE_NAME = "state.json"

StageStateName = Literal["waiting", "created", "running", "succeeded", "failed", "skipped"]
# States after which the driver does nothing more for a stage in this run.
FINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "skipped"})


def utc_now() -> datetime:
    return datetime.now(UTC)


class StageState(BaseModel):
    """Where one stage stands as the driver sees it."""

    model_config = ConfigDict(extra="forbid")

    state: StageStateName = Field(
        description="waiting: input manifest not there yet; created: Job(s) created (or adopted), no pod "
        "running yet (Kueue may hold them); running: a pod is active; succeeded: output manifest committed; "
        "failed: a Job failed (see reason); skipped: output manifest was committed before this driver ran."
    )
    job: str | None = Field(default=None, description="Name of the stage's Job (or JobSet), once created.")
    reason: str | None = Field(
        default=None,
        description="Why the stage is in this state: the missing input while waiting, the Job's failure "
        "reason (condition reason/message, failed container's exit code and termination message) when failed.",
    )
    updated: datetime = Field(default_factory=utc_now, description="When this stage's entry last changed (UTC).")


class RunState(BaseModel):
    """The whole file: one entry per stage of the run, upstream first."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_version: Literal[1] = Field(
        default=SCHEMA_VERSION, alias="schema", description="Version of this file's layout."
    )
    updated: datetime = Field(default_factory=utc_now, description="When the file was last written (UTC).")
    stages: dict[str, StageState] = Field(default_factory=dict, description="Stage name -> its state.")

    def set(self, stage: str, state: StageStateName, *, job: str | None = None, reason: str | None = None) -> bool:
        """Record a stage's state; True when anything changed (the caller then writes the file)."""
        old = self.stages.get(stage)
        job = job if job is not None else (old.job if old else None)
        if old is not None and (old.state, old.job, old.reason) == (state, job, reason):
            return False
        now = utc_now()
        self.stages[stage] = StageState(state=state, job=job, reason=reason, updated=now)
        self.updated = now
        return True

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True, indent=2).encode() + b"\n"


def state_uri(root: str, run_id: str) -> str:
    """`<root>/<run_id>/driver/state.json`."""
    return join(layout(root, run_id).folder(DRIVER_FOLDER), STATE_NAME)


def read_run_state(store: ObjectStore, root: str, run_id: str) -> RunState | None:
    """The driver's last written state, or None when no driver has run (a local run, or not applied yet).

    A file that does not parse raises pydantic's ValidationError: it is written only by the driver, so an
    unreadable one is a version mismatch worth showing, not something to hide as "no driver".
    """
    try:
        data = store.read_bytes(state_uri(root, run_id))
    except ObjectNotFoundError:
        return None
    return RunState.model_validate_json(data)


def write_run_state(store: ObjectStore, root: str, run_id: str, state: RunState) -> None:
    store.write_bytes(state_uri(root, run_id), state.to_json())
