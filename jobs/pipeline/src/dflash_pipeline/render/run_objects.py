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
from dflash_pipeline.run.stages import StageDef, plan, selected_stages
from dflash_shared.errors import ConfigError


def stage_objects(run: RunConfig, stage: StageDef, settings: JobSettings) -> list[dict[str, Any]]:
    """The stage's Job, preceded by its headless Service when it spans several nodes; or its JobSet."""
    workload = stage_workload(run, stage, settings)
    if settings.gang == "jobset":
        return [jobset_object(run, stage, settings, workload)]
    job = job_object(stage, settings, workload)
    if workload.rendezvous is not None:
        return [headless_service(workload.name, run.namespace, workload.labels), job]
    return [job]


def stage_documents(run: RunConfig, stage: StageDef) -> list[dict[str, Any]]:
    """The stage's objects as applied: its Job wrapped as a template, its Service (if any) as it is."""
    order = [s.name for s in plan(run)].index(stage.name)
    objects = stage_objects(run, stage, run.stages.for_stage(stage.name))
    return [stage_template(doc, order) if doc["kind"] == "Job" else doc for doc in objects]


def render_documents(run: RunConfig, only: list[str] | None = None) -> list[dict[str, Any]]:
    """What `kubectl apply` gets for the run (`only`: just the named stages' templates). Never a Secret."""
    if not run.root.startswith("s3://"):
        raise ConfigError(f"root {run.root!r} is a local directory: pods can only exchange data through s3://")
    objects = [doc for stage in selected_stages(run, only) for doc in stage_documents(run, stage)]
    return [*objects, *driver_objects(run)]
