"""The run driver: create each stage's Job once its input is committed, watch it, stop the run when one fails.

The stages form a chain (each reads its upstream's manifest), so one pass over them, upstream first,
decides everything:

    output manifest committed        -> succeeded (or skipped: done before this driver saw it); next stage
    Job exists, failed               -> stop: exit 65 naming the stage, the Job's reason, the pod's exit
    Job exists, still going          -> wait (an existing Job is adopted, never created twice)
    Job exists, its pod cannot start -> stop after `stuck_after_s` (an image that does not pull, a missing Secret,
                                        no node for its selector: waiting longer would not help)
    no Job, input manifest committed -> create the Job from its template
    no Job, input not there yet      -> wait

Storage and cluster are the only state, so a driver that restarts, or a rerun after a fix (`pipeline resume`:
the failed Jobs deleted, this driver's too, and the run applied again), picks up where the run is. Between passes it
sleeps `poll_s`, doubling up to `max_poll_s` while nothing changes. A storage error no retry can heal (403,
no such bucket, an endpoint nobody answers on) exits 69 at once; transient ones are retried. After every
change it writes `<root>/<run_id>/driver/state.json` (`run_state`) for `pipeline status`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from dflash_pipeline.drive.kube import Cluster, ClusterUnavailableError, JobView, StageTemplate, owner_reference
from dflash_pipeline.drive.run_state import RunState, StageStateName, write_run_state
from dflash_pipeline.render.driver_objects import PILOT_RUN_KEY
from dflash_shared.errors import BadInputError, ConfigError
from dflash_shared.exit_codes import ExitCode
from dflash_shared.storage import ObjectStore, StorageError

logger = logging.getLogger("dflash.pipeline.driver")


class StageFailedError(BadInputError):
    """A stage Job failed: nothing downstream may start until it is fixed (exit 65, the driver Job fails)."""


class RunDriver:
    """Drives the stage templates of one run through to the last stage's manifest."""

    def __init__(
        self,
        cluster: Cluster,
        store: ObjectStore,
        root: str,
        run_id: str,
        *,
        poll_s: float = 15.0,
        max_poll_s: float = 300.0,
        sleep: Callable[[float], None] = time.sleep,
        run_object: str | None = None,
        stuck_after_s: float = 600.0,
    ) -> None:
        if stuck_after_s < 0:
            raise ConfigError(f"--stuck-after-seconds {stuck_after_s} must be 0 or more")
        if not 0 < poll_s <= max_poll_s:
            raise ConfigError(f"poll interval {poll_s} s must be positive and at most the maximum {max_poll_s} s")
        self.cluster, self.store, self.root, self.run_id = cluster, store, root, run_id
        self.poll_s, self.max_poll_s, self.sleep = poll_s, max_poll_s, sleep
        self.run_object = run_object
        # A pod that cannot start (image, Secret, no node) fails its stage after this long (kube.pod_stuck).
        self.stuck_after_s = stuck_after_s
        self.state = RunState()
        # The run object's ownerReference, read once at the start: every Job created carries it.
        self._owner: dict[str, Any] | None = None
        # Stages whose Job this driver has seen unfinished (or created): their manifest means "succeeded".
        self._watched: set[str] = set()
        # When this driver created each stage's Job (epoch seconds): a pilot's report measures stages from there.
        self._started: dict[str, float] = {}
        self._pilot: str | None = None

    def run(self) -> int:
        """Drive the run to its end: 0 when every stage's output is committed; raises on a failed stage."""
        templates = self.cluster.templates(self.run_id)
        if not templates:
            raise ConfigError(
                f"no stage templates of run {self.run_id!r} in namespace {self.cluster.namespace}: apply the run's "
                "kustomization (or `python -m dflash_pipeline submit`) that holds this driver"
            )
        body = self.cluster.run_object(self.run_id, self.run_object)
        self._owner = owner_reference({"apiVersion": "v1", "kind": "ConfigMap", **body})
        self._pilot = (body.get("data") or {}).get(PILOT_RUN_KEY)
        logger.info("driving run %s: %s", self.run_id, " -> ".join(t.stage for t in templates))
        for t in templates:
            reason = f"input {t.input_manifest} not committed yet" if t.input_manifest else None
            self.state.set(t.stage, "waiting", reason=reason)
        self._save()
        delay = self.poll_s
        while True:
            try:
                done, changed = self.step(templates)
            except ClusterUnavailableError as err:
                logger.warning("cluster unavailable, retrying: %s", err)
                done, changed = False, False
            except StorageError as err:
                if err.is_environment:
                    raise
                logger.warning("storage unavailable, retrying: %s", err)
                done, changed = False, False
            if changed:
                self._save()
            if done:
                logger.info("run %s complete: every stage's output is committed", self.run_id)
                if self._pilot is not None:
                    self._write_pilot_report(self._pilot)
                return ExitCode.OK
            delay = self.poll_s if changed else min(delay * 2, self.max_poll_s)
            self.sleep(delay)

    def step(self, templates: list[StageTemplate]) -> tuple[bool, bool]:
        """One pass, upstream first: (every stage done, anything changed)."""
        changed = False
        for t in templates:
            entry = self.state.stages.get(t.stage)
            if entry is not None and entry.state in ("succeeded", "skipped"):
                continue
            if self.store.exists(t.output_manifest):
                changed |= self._finished(t)
                continue
            job = self.cluster.job(t.job_name)
            if job is None:
                return False, self._start(t, templates) or changed
            if t.stage not in self._watched:
                logger.info("stage %s: adopting the existing Job %s (%s)", t.stage, job.name, job.phase)
                self._watched.add(t.stage)
            if job.phase == "failed":
                self._fail(t, templates, job)
            if job.phase == "succeeded":
                # The manifest is written before the last pod exits: re-read it, the first read may predate it.
                if self.store.exists(t.output_manifest):
                    changed |= self._finished(t)
                    continue
                self._fail(t, templates, JobView(job.name, "failed",
                                                 f"the Job completed but {t.output_manifest} is missing"))
            waiting = [] if job.suspended else self.cluster.pods_waiting(job.name)
            if waiting and waiting[0].seconds >= self.stuck_after_s:
                self._fail(t, templates, JobView(job.name, "failed", f"its pod cannot start: {waiting[0].describe()}"))
            reason = (self.cluster.admission(job) if job.phase == "created" else None) or job.reason
            if waiting:  # `status` shows it while the grace runs
                reason = (f"{waiting[0].describe()} (the stage fails after {self.stuck_after_s / 60:.0f} min of "
                          "this)")
            return False, self._set(t.stage, job.phase, job=job.name, reason=reason) or changed
        return True, changed

    def _write_pilot_report(self, run_json: str, failures: dict[str, str] | None = None) -> None:
        """A pilot's report (`pilot_report`), from its run config and manifests, with the starts this driver saw;
        written when the run ends, whether its last stage committed or one failed."""
        from dflash_pipeline.pilot.report import build_report, write_report
        from dflash_pipeline.run.config import RunConfig

        pilot = RunConfig.model_validate_json(run_json)
        uri = write_report(self.store, pilot, build_report(self.store, pilot, self._started, failures))
        logger.info("pilot report %s written: `python -m dflash_pipeline status --config RUN.toml` shows it, "
                    "`plan --config RUN.toml --from-pilot %s` re-plans the full run", uri, uri)

    def _start(self, t: StageTemplate, templates: list[StageTemplate]) -> bool:
        if t.input_manifest is not None and not self.store.exists(t.input_manifest):
            if t.order - 1 not in {u.order for u in templates}:
                # The upstream stage has no template: a JobSet applied with the run. Its failure stops the run too.
                for stage, jobset in self.cluster.failed_jobsets(self.run_id):
                    self._fail(t, templates, jobset, kind="JobSet", failed_stage=stage)
            return self._set(t.stage, "waiting", reason=f"input {t.input_manifest} not committed yet")
        self._started.setdefault(t.stage, time.time())
        if self.cluster.create_job(t.body, self._owner):
            logger.info("stage %s: input committed, created Job %s", t.stage, t.job_name)
        else:
            logger.info("stage %s: Job %s exists already, adopting it", t.stage, t.job_name)
        self._watched.add(t.stage)
        return self._set(t.stage, "created", job=t.job_name, reason=None)

    def _finished(self, t: StageTemplate) -> bool:
        state: StageStateName = "succeeded" if t.stage in self._watched else "skipped"
        if state == "skipped":
            logger.info("stage %s: output %s committed before this driver started; skipped", t.stage,
                        t.output_manifest)
        else:
            logger.info("stage %s: output %s committed", t.stage, t.output_manifest)
        return self._set(t.stage, state, reason=f"output {t.output_manifest} committed")

    def _fail(self, t: StageTemplate, templates: list[StageTemplate], job: JobView, *, kind: str = "Job",
              failed_stage: str | None = None) -> None:
        """Record the failure and stop the run. `failed_stage`: a JobSet upstream of `t` failed, not `t` itself."""
        detail = self.cluster.failure_detail(job.name) if kind == "Job" else None
        reason = "; ".join(p for p in (job.reason, detail) if p) or "no reason given"
        stage = failed_stage or t.stage
        self._set(stage, "failed", job=job.name, reason=reason)
        later = templates[templates.index(t) + (1 if failed_stage is None else 0):]
        for u in later:
            self._set(u.stage, "waiting", reason=f"run stopped: upstream stage {stage} failed")
        self._save()
        if self._pilot is not None:
            try:
                self._write_pilot_report(self._pilot, {stage: reason})
            except StorageError as err:  # the failure below is the news; the report is its detail
                logger.warning("cannot write the pilot report: %s", err)
        raise StageFailedError(
            f"stage {stage} failed ({kind} {job.name}): {reason}. Nothing downstream was created. Read its log "
            f"(`python -m dflash_pipeline logs --config RUN.toml {stage}`), fix the cause, then `python -m "
            "dflash_pipeline resume --config RUN.toml`: it deletes the failed Jobs (this driver's too) and applies "
            "the run again; committed stages are skipped"
        )

    def _set(self, stage: str, state: StageStateName, *, job: str | None = None, reason: str | None = None) -> bool:
        return self.state.set(stage, state, job=job, reason=reason)

    def _save(self) -> None:
        try:
            write_run_state(self.store, self.root, self.run_id, self.state)
        except StorageError as err:
            if err.is_environment:
                raise
            # The state file is for people reading `status`; the run goes on without it.
            logger.warning("cannot write the driver state: %s", err)
