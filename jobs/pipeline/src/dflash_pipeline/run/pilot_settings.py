"""`[pilot]` of a run file: how far a pilot shrinks the run's counts (`dflash_pipeline.pilot.derive` derives it).

A pilot is the full run at full shape with only its counts reduced: the same images, target, storage,
placement, GPU model, tensor parallelism, node count and parallelism for train, and every shape (training
window, anchors, batch tokens, block size, generation budget, thinking mode). These fields are the counts.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

HOUR = 3600


class PilotSettings(BaseModel):
    """The counts of the run's pilot (`python -m dflash_pipeline pilot --config RUN.toml`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompts: int = Field(
        default=256, ge=1,
        description="Records of the run's own source the pilot imports: a sample chosen by a hash of each "
        "record's content id over the whole source (import's sample_records, read by one import pod). A source "
        "with fewer usable records fails the pilot's import (exit 64); at least 4 x evaluate_prompts, so that "
        "tokenize can hold out evaluate's prompts and keep the rest to train on.",
    )
    generate_shards: int = Field(
        default=4, ge=1, description="Generate pods (at most the full run's), each with the full run's GPUs."
    )
    tokenize_shards: int = Field(default=2, ge=1, description="Tokenize pods (at most the full run's).")
    train_steps: int = Field(default=30, ge=2, description="Training steps (max_steps).")
    restart_at_step: int = Field(
        default=15, ge=1,
        description="The step whose checkpoint is saved and then resumed from: train stops there as a "
        "preemption does (exit 75), the Job's retry starts it again, and it resumes (restart_after_step).",
    )
    log_every: int = Field(default=5, ge=1, description="Steps between metric lines, so 30 steps show a curve.")
    evaluate_prompts: int = Field(
        default=16, ge=1,
        description="Held-out prompts evaluated offline and replayed by the serving check; tokenize holds out "
        "twice as many in expectation (heldout_min_records), so the split rarely falls short of them.",
    )
    baseline_prompts: int = Field(default=4, ge=0, description="Of those, decoded by the untrained drafter too.")
    lossless_prompts: int = Field(default=4, ge=0, description="Of those, compared with the target alone.")
    learnability_documents: int = Field(
        default=4, ge=0, description="Of those, memorised by a fresh drafter that must then have nearly every drafted "
        "token accepted, offline and in the engine (the learnability gate, evaluate.learnability; 0 = off).",
    )
    stage_deadline_seconds: int = Field(
        default=2 * HOUR, ge=600,
        description="activeDeadlineSeconds of every pilot Job (or the full run's, if shorter): a pilot that hangs "
        "gives its GPUs back within this, instead of after the full run's days-long deadlines.",
    )
    max_wall_hours: float = Field(
        default=1.0, gt=0, description="`plan --pilot` warns when the pilot's planned wall time exceeds this."
    )
    max_gpu_hour_fraction: float = Field(
        default=0.02, gt=0, le=1,
        description="`plan --pilot` warns when the pilot's planned GPU-hours exceed this share of the full run's.",
    )
