"""The train stage's commit: the drafter manifest, written LAST by rank 0 (a rerun after it exists does nothing).

It names the final checkpoint's files, the resolved config, the target's identity, the lineage, the final metrics,
the settings that decide the drafter's quality, what the run read of the data, and what this process measured
against the plan.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dflash_shared.manifest_io import write_manifest
from dflash_shared.manifests import Accounting, DrafterSection, Kind, Manifest, Shard, TrainedTokens
from dflash_shared.provenance import producer
from dflash_shared.settings import public_dict
from dflash_shared.storage import ObjectStore, join
from dflash_shared.window import window_fraction
from dflash_train.config import TrainConfig, settings_identity
from dflash_train.drafter.config import DrafterConfig

if TYPE_CHECKING:
    from dflash_train.data.plan import DataPlan
    from dflash_train.prepare import PreparedRun, Resolved
    from dflash_train.trainer import Trainer, TrainResult
    from dflash_train.training.checkpoint import CheckpointRef

log = logging.getLogger(__name__)
STAGE = "train"
PACKAGES = ["dflash-train", "torch", "transformers", "safetensors", "pyarrow", "numpy"]


def quality_recipe(config: TrainConfig, cfg: DrafterConfig, steps: int) -> dict[str, str | float | int | bool | None]:
    """The settings that decide the drafter's quality, as the manifest names them (`DrafterSection.recipe`)."""
    return {"objective": config.objective, "position_weighting": config.position_weighting,
            "dpace_alpha": config.dpace_alpha if config.position_weighting == "dpace" else None,
            "lr_schedule": config.lr_schedule, "lr": config.lr, "warmup_ratio": config.warmup_ratio,
            "steps": steps, "num_anchors_per_document": config.num_anchors,
            "max_anchors_per_row": config.max_anchors_per_row,
            "loss_decay_gamma": config.recipe.decay_gamma(cfg.block_size),
            "feature_noise_std": config.feature_noise_std,
            "block_size": cfg.block_size, "num_layers": cfg.num_layers, "target_layer_ids": str(cfg.target_layer_ids),
            "init_from": config.init_from}


def performance(trainer: Trainer, result: TrainResult, world_size: int, planned_peak: int, target_params: int,
                drafter_params: int) -> dict[str, float]:
    """What this process measured, for the drafter manifest (`DrafterSection.performance`): the last logged
    window's rates (steady state: the first window also holds start-up), the peak memory over ranks against the
    memory plan's prediction, and the checkpoint timings. `target_params` are those a token runs (a mixture of
    experts' active ones), what the pilot's MFU counts."""
    out: dict[str, float] = {"world_size": float(world_size), "planned_peak_gib": planned_peak / 2**30,
                             "target_parameters": float(target_params), "drafter_parameters": float(drafter_params)}
    if result.history:
        _, last = result.history[-1]
        if last.get("steps_per_s"):
            out["step_seconds"] = 1.0 / last["steps_per_s"]
        out.update({name: last[name] for name in ("tokens_per_s", "label_tokens_per_s", "peak_memory_gib_max")
                    if name in last})
    if trainer.save_seconds is not None:
        out["checkpoint_save_seconds"] = trainer.save_seconds
    if trainer.resume_seconds is not None and trainer.resumed_from is not None:  # both set by one resume
        out["resume_seconds"] = trainer.resume_seconds
        out["resumed_from_step"] = float(trainer.resumed_from)
    return out


def trained_tokens(plan: DataPlan, steps: int, rows_per_step: int) -> TrainedTokens | None:
    """What the run's rows read of the train split (plan: data.DataPlan), or None for a plan saved before it
    was counted."""
    window = plan.window
    if window is None:
        return None
    return TrainedTokens(
        max_length=plan.max_length,
        tokens_available=window.tokens,
        tokens_trained=window.tokens_in_window,
        loss_tokens_available=window.loss_tokens,
        loss_tokens_trained=window.loss_tokens_in_window,
        window_fraction=window_fraction(window.loss_tokens_in_window, window.loss_tokens) or 0.0,
        epochs=round(steps * rows_per_step / max(plan.rows_per_epoch, 1), 4),
    )


def build_manifest(resolved: Resolved, checkpoint: CheckpointRef, final_metrics: dict[str, float],
                   extra: dict[str, Any], data: TrainedTokens | None = None,
                   performance: dict[str, float] | None = None) -> Manifest:
    """The drafter manifest: final checkpoint, resolved config, target identity, lineage, final metrics."""
    config, source, cfg = resolved.config, resolved.source, resolved.drafter
    identity = resolved.section.target
    identity = identity.model_copy(update={"special_tokens": identity.special_tokens.model_copy(
        update={"mask": cfg.mask_token_id})})
    trained = sum(s.records for s in resolved.train_shards)
    heldout = source.manifest.total_records - trained
    resolved_config = {**public_dict(config), "resolved": {"drafter": cfg.model_dump(mode="json"),
                                                           "max_length": resolved.max_length,
                                                           "rows_per_step": resolved.rows_per_step, **extra}}
    return Manifest(
        kind=Kind.drafter,
        run_id=config.run_id or source.manifest.run_id,
        producer=producer(STAGE, resolved_config, PACKAGES, settings_identity(config).sha256),
        inputs=[source.as_input()],
        shards=[Shard(uri=join(checkpoint.uri, name), bytes=entry.bytes, sha256=entry.sha256, records=0)
                for name, entry in sorted(checkpoint.marker.files.items())],
        accounting=Accounting(input_records=trained + heldout, succeeded=trained, failed=0, skipped=heldout,
                              skips_by_reason={"heldout": heldout} if heldout else {}),
        section=DrafterSection(
            target=identity,
            target_layer_ids=list(cfg.target_layer_ids),
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            checkpoint_uri=checkpoint.uri,
            final_metrics=final_metrics,
            recipe=quality_recipe(config, cfg, int(extra.get("total_steps", 0))),
            data=data,
            performance=performance or {},
        ),
    )


def publish(run: PreparedRun, result: TrainResult, store: ObjectStore, world_size: int) -> str:
    """Write the drafter manifest of a finished run (rank 0 only) and return its URI."""
    from dflash_train.parallel.placement import mesh_of

    resolved, trainer = run.resolved, run.trainer
    steps = trainer.total_steps
    measured = performance(trainer, result, world_size, run.planned_peak, run.target_params, run.drafter_params)
    data = trained_tokens(trainer.plan, steps, resolved.rows_per_step)
    extra = {"world_size": world_size, "parallelism": trainer.setup.parallelism, "mesh": mesh_of(trainer.model),
             "total_steps": steps, "warm_start": trainer.warm_started}
    manifest = build_manifest(resolved, result.checkpoint, result.final_metrics, extra, data, measured)
    uri, _ = write_manifest(store, resolved.config.output, manifest)
    log.info("drafter manifest %s: %d steps, final loss %.4f, tau %.2f", uri, result.steps,
             result.final_metrics.get("loss", float("nan")), result.final_metrics.get("tau", float("nan")))
    return uri
