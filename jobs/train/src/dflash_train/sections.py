"""The train stage's settings by role: the training recipe (what the steps compute) and the runtime (where and how
they run). The drafter's shape is the third role, `drafter.config.DrafterConfig`.

`TrainConfig` (`dflash_train.config`) is these sections plus the stage's inputs, outputs, data and checkpoint settings:
its fields, flags (`--lr`), environment variables (`DFLASH_TRAIN_LR`) and run-file keys stay flat, and each part of
the trainer receives the section it reads (`config.recipe`, `config.runtime`): the optimiser and the loss the recipe,
the memory plan the runtime and the recipe's one question (`needs_target_output`). The pipeline's fit check builds
the same sections from a run file (`section_of`), so a setting is defined, validated and defaulted once.

No torch import: the pipeline and `--help` read these before any heavy library loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dflash_shared.errors import ConfigError

Section = TypeVar("Section", bound=BaseModel)
AttentionBackend = Literal["auto", "flex", "sdpa"]

# Position-decay constants of the reference trainers, keyed by block size.
DEFAULT_DECAY_GAMMA = {16: 7.0, 8: 4.0}


def reads_target_output(objective: str, label_agreement: bool) -> bool:
    """Whether a training step needs the target's own output layers (all layers kept, the final hidden states): for
    the target-label objectives and for measuring the label agreement. The step and the memory plan both ask this."""
    return objective != "data_ce" or label_agreement


class TrainingRecipe(BaseModel):
    """What the training steps compute: the objective and its position weights, the optimiser and its learning-rate
    schedule, and the label agreement measured beside them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # ------------------------------------------------------------------ optimisation (training.optim)
    lr: float = Field(default=6e-4, gt=0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="Final learning rate as a fraction of lr.")
    warmup_ratio: float = Field(default=0.04, ge=0, lt=1, description="Linear warmup, as a fraction of all steps.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(default=0.999, ge=0, lt=1, description="AdamW beta2 (torch's default, as SpecForge).")
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(default=1.0, ge=0, description="Clip the global gradient norm to this (0 = off).")
    # wsd by measurement (docs/quality.md, "Recipe trials"): +3.0% tau over cosine on the long answers under two
    # seeds, within the seed spread on the short ones; TorchSpec found ~4%.
    lr_schedule: Literal["cosine", "wsd"] = Field(
        default="wsd",
        description="wsd: warmup, the peak held, then a linear decay over the last decay_ratio of the steps "
        "(warmup-stable-decay, TorchSpec); cosine: warmup then cosine to min_lr_ratio (SpecForge).",
    )
    decay_ratio: float = Field(
        default=0.2, gt=0, le=1, description="wsd: the share of all steps spent decaying to min_lr_ratio."
    )

    # ------------------------------------------------------------------ blocks (training.anchors, training.step)
    num_anchors: int = Field(
        default=512, ge=1,
        description="Anchors (blocks) sampled per document (conversation) of a packed row, before the memory's "
        "per-row cap (max_anchors_per_row); 512 is SpecForge's recipe (every valid position of a normal answer).",
    )
    feature_noise_std: float = Field(
        default=0.0, ge=0, description="Std of uniform noise added to the target features in training (0 = off)."
    )

    # ------------------------------------------------------------------ objective (training.loss)
    objective: Literal["data_ce", "target_argmax_ce", "target_kl"] = Field(
        default="data_ce",
        description="data_ce: cross-entropy on the data token (SpecForge); target_argmax_ce: on the trainer "
        "target's own greedy token; target_kl: KL to the target's distribution (speculators, ModelOpt).",
    )
    position_weighting: Literal["exp_decay", "dpace"] = Field(
        default="dpace",
        description="Weight of block slot k: dpace, speculators' D-PACE (expected accepted slots from k on, from the "
        "drafter's own confidence; CE objectives only; +11% offline tau over exp_decay in docs/quality.md's "
        "trials); exp_decay, exp(-(k-1)/loss_decay_gamma).",
    )
    dpace_alpha: float = Field(default=0.5, ge=0, le=1, description="D-PACE confidence smoothing (speculators' 0.5).")
    loss_decay_gamma: float | None = Field(
        default=None, gt=0,
        description="exp_decay's gamma: slot k weighs exp(-(k-1)/gamma); default by block size: 7 for 16, 4 for 8 "
        "(the reference trainers').",
    )
    label_agreement: bool = Field(
        default=True,
        description="Measure the share of trained data labels that are the trainer target's own greedy token "
        "(keeps the target's last layers and runs its LM head over the trained positions, about a tenth of a "
        "target forward); logged, in progress and the manifest, with a warning below label_agreement_warn.",
    )
    label_agreement_every: int = Field(
        default=10, ge=1,
        description="Steps between label-agreement measurements, the first step always measured (1: every step). "
        "Each costs the target's LM head over the step's trained positions: under data_ce nothing else reads it, "
        "and every step cost +31-35% per step on the CPU bench's target (docs/benchmarks.md). Target-label objectives "
        "measure every step for free.",
    )
    label_agreement_warn: float = Field(
        default=0.5, ge=0, le=1,
        description="Warn when the label agreement of the first logged window is below this share.",
    )

    @property
    def needs_target_output(self) -> bool:
        return reads_target_output(self.objective, self.label_agreement)

    def agreement_due(self, completed_steps: int) -> bool:
        """Whether the next step measures the label agreement: steps 1, 1 + label_agreement_every, ... (1-based)."""
        return self.label_agreement and completed_steps % self.label_agreement_every == 0

    def decay_gamma(self, block_size: int) -> float | None:
        """exp_decay's gamma: `loss_decay_gamma`, or the reference trainers' constant for this block size (ConfigError
        when it has none); None under D-PACE, whose weights come from the drafter's confidence instead."""
        if self.position_weighting != "exp_decay":
            return None
        if self.loss_decay_gamma is not None:
            return self.loss_decay_gamma
        if block_size not in DEFAULT_DECAY_GAMMA:
            raise ConfigError(f"no default loss_decay_gamma for block_size {block_size}: set loss_decay_gamma")
        return DEFAULT_DECAY_GAMMA[block_size]

    @model_validator(mode="after")
    def _check_weighting(self) -> TrainingRecipe:
        if self.position_weighting == "dpace" and self.objective == "target_kl":
            raise ValueError("position_weighting dpace (the default) reads the drafter's confidence from a "
                             "cross-entropy: with objective target_kl set position_weighting exp_decay")
        return self


class TrainingRuntime(BaseModel):
    """Where and how the steps run: the device and its parallelism, precision and the target's dtype, and the memory
    and speed knobs (rows per forward, activation checkpointing, LM-head chunks, compile, the target's kernels)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: Literal["auto", "cuda", "cpu"] = Field(default="auto", description="Where to train; auto prefers CUDA.")
    parallelism: Literal["auto", "ddp", "fsdp"] = Field(
        default="auto",
        description="ddp replicates target and drafter per GPU; fsdp shards both; auto picks ddp when a replica fits.",
    )
    target_packing: Literal["auto", "mask", "varlen", "per_document"] = Field(
        default="auto",
        description="How the target keeps packed documents apart: auto, mask (attention-only targets), varlen"
        " (linear-attention targets on the fast kernels) or per_document (see FrozenTarget).",
    )
    target_attn_implementation: str = Field(
        default="sdpa", description="attn_implementation the target is loaded with (sdpa, eager, flex_attention)."
    )

    micro_batch_rows: int = Field(default=1, ge=1, description="Packed rows per forward pass on one rank.")
    max_anchors_per_row: int = Field(
        default=512, ge=1,
        description="Memory bound on anchors (blocks) per packed row after the per-document draw, shared fairly "
        "across the row's documents (round-robin); the memory plan names the largest count that fits.",
    )
    attention_backend: AttentionBackend = Field(
        default="auto", description="Drafter attention: flex (BlockMask), sdpa (float mask), auto = flex on CUDA."
    )
    precision: Literal["bf16", "fp32"] = Field(
        default="bf16", description="bf16: autocast over fp32 master weights; fp32: no autocast."
    )
    target_dtype: Literal["auto", "bf16", "fp32"] = Field(
        default="auto", description="Dtype of the frozen target; auto is bf16 on CUDA and fp32 on CPU."
    )
    activation_checkpointing: bool = Field(default=False, description="Recompute drafter layers in backward.")
    compile: bool = Field(default=False, description="torch.compile each drafter layer.")
    chunk_tokens: int | None = Field(
        default=None, gt=0, description="Tokens per LM-head cross-entropy chunk (default: a 1 GiB logits budget)."
    )


def section_of(section: type[Section], values: Mapping[str, Any] | BaseModel) -> Section:
    """The section's fields picked from `values` (a TrainConfig, or a run file's train settings with the config's
    defaults), validated: ConfigError (exit 64) naming each invalid setting."""
    read = values.get if isinstance(values, Mapping) else lambda name: getattr(values, name)
    try:
        return section.model_validate({name: read(name) for name in section.model_fields})
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ConfigError(f"train settings ({section.__name__}): {problems}") from None
