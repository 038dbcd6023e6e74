"""The train stage's one typed config: flags, DFLASH_TRAIN_* variables, defaults and presets come from here.

The defaults are the reference recipe (AdamW with torch's betas (0.9, 0.999), lr 6e-4, 4% warmup then
cosine, clip 1.0, 6 epochs, bf16 autocast over fp32 master weights). A preset fills in every setting the
caller did not give: `--preset debug` (or `debug(...)` in Python) is a CPU run of a few seconds against the
tiny test target. No torch import here: the config is parsed (and `--help` answered) before the heavy libraries load.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import SettingsConfigDict

from dflash_shared.settings import StageSettings
from dflash_shared.stage_identity import StageIdentity, stage_identity
from dflash_train.drafter.config import MOVED_TO_TRAIN_SETTINGS, DrafterConfig, moved_setting_message
from dflash_train.sections import TrainingRecipe, TrainingRuntime, section_of

Preset = Literal["none", "debug"]
# Keys `drafter_overrides` may hold: DrafterConfig's fields plus from_target's one extra argument; the mask
# token has its own setting (`mask_token_id`), which the stage passes to the preset itself.
DRAFTER_OVERRIDE_KEYS = (frozenset(DrafterConfig.model_fields) | {"num_target_features"}) - {"mask_token_id"}
# Settings that only shape a drafter built from a preset: a complete `drafter` leaves nothing for them to do.
_PRESET_ONLY = ("drafter_preset", "drafter_overrides")

# What `--preset debug` sets unless given explicitly: every piece small enough for 2 CPU cores.
DEBUG_PRESET: dict[str, Any] = {
    "device": "cpu",
    "precision": "fp32",
    "drafter_preset": "debug",
    "num_anchors": 4,
    "max_length": 256,
    "batch_tokens": 1024,
    "micro_batch_rows": 1,
    "epochs": 1,
    "max_steps": 20,
    "lr": 1e-3,
    "warmup_ratio": 0.1,
    "checkpoint_every": 10,
    "log_every": 1,
    "heldout_every": 10,
    "heldout_documents": 8,
    "prefetch_steps": 2,
    "cache_gib": 1.0,
    "disk_need_gib": 0.5,
}


class StageIO(BaseModel):
    """What the stage reads and writes: the first settings of `--help` and of the configuration reference."""

    preset: Preset = Field(
        default="none", description="Fill every setting not given explicitly from a preset ('debug': tiny CPU run)."
    )
    input: str = Field(description="Tokenized prefix (or its manifest.json URI) to train on.")
    output: str = Field(description="Drafter prefix: checkpoints, TensorBoard files and the drafter manifest.")
    target: str = Field(description="Target model directory, local or s3:// (copied to local scratch).")
    run_id: str | None = Field(default=None, description="Run id; defaults to the tokenized manifest's.")


# Field order (pydantic lists the bases' fields from the last base to the first, then the class's own): what the
# stage reads and writes, the runtime, the recipe, then the drafter, the data and the checkpoints and logs below.
class TrainConfig(StageSettings, TrainingRecipe, TrainingRuntime, StageIO):
    """The stage's inputs and outputs, the drafter, the data and the checkpoints and logs, with the recipe's and the
    runtime's fields (`dflash_train.sections`) beside them, flat: one flag, variable and run-file key per field."""

    model_config = SettingsConfigDict(env_prefix="DFLASH_TRAIN_")

    # ------------------------------------------------------------------ drafter
    drafter: DrafterConfig | None = Field(
        default=None,
        description="Complete drafter config as JSON; refused together with drafter_preset or drafter_overrides.",
    )
    drafter_preset: Literal["from_target", "debug"] = Field(
        default="from_target",
        description="from_target: the reference drafter for the target (dense: its own layer shape; "
        "Qwen3.5/3.6: 32/8 heads of 128, 4 sliding + 1 full layers); debug matches the tiny "
        "test target.",
    )
    drafter_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description='DrafterConfig fields replacing the preset\'s, as JSON: {"num_layers": 5, "block_size": 16};'
        " each takes effect or is refused (from_target also takes num_target_features).",
    )
    mask_token_id: int | None = Field(
        default=None,
        description="Mask token id; defaults to the tokenized manifest's special_tokens.mask, then the preset's.",
    )
    init_from: str | None = Field(
        default=None,
        description="Warm start: a fresh run's first drafter weights from a training checkpoint folder or an "
        "export directory (z-lab native or ours), local or s3://; its shape, target layers, block and mask token "
        "must be the run's (exit 64 names each difference). A resumed run continues from its own checkpoint.",
    )

    # ------------------------------------------------------------------ data
    max_length: int | None = Field(
        default=None, gt=16, description="Tokens per packed row; defaults to the tokenized manifest's max_length."
    )
    batch_tokens: int = Field(
        default=65536, gt=0, description="Tokens (packed rows x max_length) per optimizer step, over all ranks."
    )
    epochs: int = Field(default=6, ge=1, description="Passes over the data (each with its own shuffle).")
    max_steps: int | None = Field(
        default=None, ge=1, description="Optimizer steps to run; defaults to what `epochs` amounts to."
    )
    seed: int = Field(default=0, description="Seed of the drafter init, data order, anchors and feature noise.")
    cache_gib: float = Field(default=20.0, gt=0, description="Local cache of downloaded data shards (LRU).")
    prefetch_steps: int = Field(default=4, ge=1, description="Steps of batches prepared ahead of the GPU.")
    verify_shards: bool = Field(default=True, description="Check each downloaded shard's sha256 against the manifest.")

    # ------------------------------------------------------------------ checkpoints and logs
    checkpoint_every: int = Field(default=1000, ge=1, description="Save a checkpoint every this many steps.")
    keep_checkpoints: int = Field(default=2, ge=1, description="Complete checkpoints kept; older ones are deleted.")
    resume: str = Field(
        default="auto",
        description="auto: continue from the newest complete checkpoint under output; never: start fresh; or a "
        "checkpoint URI.",
    )
    restart_after_step: int | None = Field(
        default=None, ge=1,
        description="Stop once this step's checkpoint is written, exactly as a preemption does (exit 75), in a run "
        "that started before it; the Job's retry then resumes from that checkpoint. A pilot run's restart test: "
        "the save, the exit, the rendezvous again and the resume are all exercised.",
    )
    heldout_every: int = Field(
        default=500, ge=0,
        description="Measure the drafter's acceptance on a fixed part of the held-out split every this many steps "
        "and at the end (heldout_tau, heldout_acc_k: training.heldout); 0 = never.",
    )
    heldout_documents: int = Field(default=64, ge=1, description="Held-out documents that measurement reads.")
    log_every: int = Field(default=10, ge=1, description="Steps between metric lines (log and TensorBoard).")
    tensorboard: bool = Field(default=True, description="Write TensorBoard event files under <output>/tensorboard.")
    progress_every_s: float = Field(
        default=300.0, gt=0,
        description="Seconds between progress reports in the store: <output>/progress.json (step, loss, tau, "
        "tokens/s, ETA, last checkpoint), read by `pipeline status`, and the TensorBoard files uploaded.",
    )
    scratch_dir: str | None = Field(default=None, description="Local scratch (target copy, shard cache).")
    disk_need_gib: float = Field(default=200.0, ge=0, description="Free scratch disk preflight requires.")
    copy_workers: int = Field(default=8, ge=1, description="Parallel downloads when copying the target from S3.")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset", "none") != "none":
            if data["preset"] != "debug":
                raise ValueError(f"unknown preset {data['preset']!r}; known: none, debug")
            preset = DEBUG_PRESET
            if data.get("drafter") is not None:  # a complete drafter: the preset's drafter settings do not apply
                preset = {k: v for k, v in preset.items() if k not in _PRESET_ONLY}
            data = {**preset, **data}
        return data

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        self._check_drafter_settings()
        if self.resume not in ("auto", "never") and "/" not in self.resume:
            raise ValueError(f"resume must be auto, never or a checkpoint URI, got {self.resume!r}")
        return self

    @property
    def recipe(self) -> TrainingRecipe:
        """What the steps compute: the section the optimiser, the loss and the step read."""
        return section_of(TrainingRecipe, self)

    @property
    def runtime(self) -> TrainingRuntime:
        """Where and how the steps run: the section the memory plan, the kernels check and the placement read."""
        return section_of(TrainingRuntime, self)

    def _check_drafter_settings(self) -> None:
        """Refuse drafter settings that would be ignored: each one given either takes effect or is refused."""
        if self.drafter is not None:
            ignored = [name for name in _PRESET_ONLY if name in self.model_fields_set and getattr(self, name)]
            if ignored:
                raise ValueError(
                    f"{', '.join(ignored)} given with a complete drafter config, which they would not change;"
                    " put those settings into drafter, or drop drafter to use the preset"
                )
            if self.mask_token_id is not None and self.mask_token_id != self.drafter.mask_token_id:
                raise ValueError(
                    f"mask_token_id {self.mask_token_id} contradicts drafter.mask_token_id"
                    f" {self.drafter.mask_token_id}; give it in one place"
                )
            return
        keys = set(self.drafter_overrides)
        if "mask_token_id" in keys:
            raise ValueError("drafter_overrides may not hold mask_token_id; set --mask-token-id instead")
        moved = sorted(keys & set(MOVED_TO_TRAIN_SETTINGS))
        if moved:
            raise ValueError("; ".join(moved_setting_message(name, self.drafter_overrides[name]) for name in moved))
        unknown = sorted(keys - DRAFTER_OVERRIDE_KEYS)
        if unknown:
            raise ValueError(
                f"drafter_overrides has unknown key(s) {unknown}; allowed: DrafterConfig fields"
                " (see dflash_train.drafter.config) and num_target_features"
            )
        if self.drafter_preset == "debug" and "num_target_features" in keys:
            raise ValueError(
                "drafter_overrides.num_target_features only applies to drafter_preset from_target; the debug"
                " preset has fixed target layers: give target_layer_ids instead"
            )


# Settings a resumed run may change (see dflash_shared.stage_identity): where and how the work runs (device,
# parallelism, kernels, the drafter's attention_backend among them, compile, and micro_batch_rows, a memory knob:
# the update stays the mean of the step's rows), the data cache, how often it logs and saves, the length of the run
# (a resume keeps the checkpoint's schedule, with a warning), and the settings the checkpoint is checked by exactly
# in other terms: the drafter ones (its resolved DrafterConfig) and the input and target locations (the data order,
# which holds the input manifest's sha256). Every other setting (lr and the optimiser, precision, seed,
# batch_tokens, max_length, the anchors per document and per row, ...) changes what the steps compute, and a resume
# under another value is refused.
RESUMABLE_CHANGES = frozenset({
    "preset", "input", "target", "drafter", "drafter_preset", "drafter_overrides", "mask_token_id", "init_from",
    "micro_batch_rows", "epochs", "max_steps", "cache_gib", "prefetch_steps", "verify_shards", "device", "parallelism",
    "target_packing", "target_attn_implementation", "attention_backend", "activation_checkpointing", "compile",
    "chunk_tokens",
    "checkpoint_every", "keep_checkpoints", "resume", "restart_after_step", "log_every", "tensorboard",
    "heldout_every", "heldout_documents", "label_agreement_every",
    "copy_workers",
})


def settings_identity(config: TrainConfig) -> StageIdentity:
    """What a checkpoint records of the run that saved it, and a resume must match."""
    return stage_identity(config, exclude=RESUMABLE_CHANGES)


def debug(input: str, output: str, target: str, **overrides: Any) -> TrainConfig:  # noqa: A002 - field name
    """CPU run of a few seconds against the tiny test target (`tests/support/tiny_target.py`)."""
    return TrainConfig(preset="debug", input=input, output=output, target=target, **overrides)
