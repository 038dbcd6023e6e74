"""Everything a run applies, in one list: `render`, `submit` and the kustomize base all write this.

    per stage: its Job as a template (a suspended CronJob) and, for a multi-node Job, its headless Service
        (or, with gang = "jobset", its JobSet, applied as it is),
    the run object (a ConfigMap that owns the stage Jobs the driver creates),
    the run driver: ServiceAccount, Role, RoleBinding, Job.

A headless Service is applied directly: it holds no resources and selects nothing until its Job's pods exist.
Never the Namespace or the stages' ServiceAccount: every run of the namespace shares them, so they are its
one-time setup (`namespace_setup`), which deleting a run must not touch.
"""

from __future__ import annotations

from typing import Any

from dflash_pipeline.render.driver_objects import driver_objects, stage_template
from dflash_pipeline.render.jobs import job_object, stage_workload
from dflash_pipeline.render.jobset import jobset_object
from dflash_pipeline.render.rendezvous import headless_service
from dflash_pipeline.run.config import JobSettings, RunConfig
from dflash_pipeline.run.layout import layout
from dflash_pipeline.run.stages import StageDef, StageWiring, plan, selected_stages, stage_wiring
from dflash_shared.errors import ConfigError


def stage_objects(run: RunConfig, stage: StageDef, settings: JobSettings, wiring: StageWiring) -> list[dict[str, Any]]:
    """The stage's Job, preceded by its headless Service when it spans several nodes; or its JobSet."""
    workload = stage_workload(run, stage, settings, wiring)
    if settings.gang == "jobset":
        return [jobset_object(stage, settings, workload)]
    job = job_object(stage, settings, workload)
    if workload.rendezvous is not None:
        return [headless_service(workload.name, run.namespace, workload.labels), job]
    return [job]


def objects_of_stage(run: RunConfig, stage: StageDef) -> list[dict[str, Any]]:
    """One stage's objects as `stage_objects` builds them, with the stage resolved on its own."""
    settings = run.stages.for_stage(stage.name)
    return stage_objects(run, stage, settings, stage_wiring(stage, run, settings, layout(run.root, run.run_id)))


def run_documents(run: RunConfig, only: list[str] | None = None) -> list[dict[str, Any]]:
    """The run's objects, in the order they are applied (`only`: just the named stages' templates).

    The run is resolved first (its stages, its layout, each stage's settings and wiring); each stage's Job then
    travels as a template (`stage_template`) that knows its place in the run, its Service (if any) as it is.
    """
    order = [s.name for s in plan(run)]
    stages = selected_stages(run, only)
    lay = layout(run.root, run.run_id)
    documents = []
    for stage in stages:
        settings = run.stages.for_stage(stage.name)
        wiring = stage_wiring(stage, run, settings, lay)
        documents += [stage_template(doc, order.index(stage.name)) if doc["kind"] == "Job" else doc
                      for doc in stage_objects(run, stage, settings, wiring)]
    return [*documents, *driver_objects(run)]


def render_documents(run: RunConfig, only: list[str] | None = None) -> list[dict[str, Any]]:
    """What `kubectl apply` gets for the run (`only`: just the named stages' templates). Never a Secret."""
    if not run.root.startswith("s3://"):
        raise ConfigError(f"root {run.root!r} is a local directory: pods can only exchange data through s3://")
    return run_documents(run, only)
