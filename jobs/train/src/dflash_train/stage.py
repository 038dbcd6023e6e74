"""The train stage: a tokenized manifest and a target model in, a trained drafter and its manifest out.

Per rank (torchrun process): join the process group, copy the target to local scratch (the whole
target once, on the node of rank 0, the only rank that reads its weights; the other nodes copy only
`TARGET_SMALL_FILES`: their ranks build the target from config.json, hash the tokenizer and template,
and get the weights' sizes and then the weights themselves from rank 0), refuse data made with another
tokenizer or chat template, resolve the drafter config, plan the data (the train split only: the
held-out shards are the evaluation's and are never downloaded here), load the frozen target (whole, or
FSDP-sharded), resume from the newest complete checkpoint, train, and on rank 0 write the drafter
manifest LAST (the commit point). A rerun after the manifest exists does nothing; a rerun before it
continues from the last checkpoint.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_shared.errors import BadInputError, ConfigError
from dflash_shared.identity import chat_template_sha256, tokenizer_sha256
from dflash_shared.manifest_io import LoadedManifest, committed, load_manifest, write_manifest
from dflash_shared.manifests import (
    Accounting,
    DrafterSection,
    Kind,
    Manifest,
    Shard,
    TokenizedSection,
    TrainedTokens,
)
from dflash_shared.model_copy import IDENTITY_FILES, fetch_model
from dflash_shared.provenance import producer
from dflash_shared.settings import public_dict
from dflash_shared.storage import ObjectStore, join
from dflash_shared.window import window_fraction
from dflash_train.config import TrainConfig, settings_identity
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.mask_token import default_mask_token, warn_on_zero_mask_row
from dflash_train.drafter.resolve import build_drafter
from dflash_train.parallel.rank0 import holds_rank0, on_rank0
from dflash_train.training.target_params import TargetSizes, checkpoint_sizes, replica_bytes

if TYPE_CHECKING:
    from dflash_train.data.loader import DataPlan, ShardCache
    from dflash_train.parallel.distributed import DistEnv
    from dflash_train.trainer import Trainer, TrainResult
    from dflash_train.training.checkpoint import CheckpointRef

log = logging.getLogger(__name__)
STAGE = "train"
PACKAGES = ["dflash-train", "torch", "transformers", "safetensors", "pyarrow", "numpy"]
# What identity checks, the drafter config and a target skeleton need: preflight and the nodes without
# rank 0 copy only these.
TARGET_SMALL_FILES = IDENTITY_FILES


def open_input(store: ObjectStore, config: TrainConfig, target_dir: str) -> LoadedManifest[TokenizedSection]:
    """The tokenized manifest, refused (ManifestError naming the field) unless made with this target's
    tokenizer and chat template."""
    return load_manifest(store, config.input, Kind.tokenized, expected={
        "target.tokenizer_sha256": tokenizer_sha256(target_dir),
        "target.chat_template_sha256": chat_template_sha256(target_dir),
    }, verify=False)


def resolve_drafter(config: TrainConfig, target_dir: str, section: TokenizedSection) -> DrafterConfig:
    """The drafter config: given whole, or a preset with overrides; the mask id from the config, else the
    data's manifest, else the first embedding row past the tokenizer."""
    mask = config.mask_token_id if config.mask_token_id is not None else section.target.special_tokens.mask

    def text_config() -> Any:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(target_dir)
        return getattr(hf_config, "text_config", None) or hf_config

    return build_drafter(config.drafter, config.drafter_preset, config.drafter_overrides, mask, text_config,
                         lambda hf_config: default_mask_token(target_dir, hf_config))


@dataclass(frozen=True)
class Resolved:
    """Everything decided before the first step."""

    config: TrainConfig
    source: LoadedManifest[TokenizedSection]
    target_dir: str
    drafter: DrafterConfig
    max_length: int
    rows_per_step: int

    @property
    def section(self) -> TokenizedSection:
        return self.source.section

    @property
    def train_shards(self) -> list[Shard]:
        """The shards training reads: never the held-out split."""
        return self.source.manifest.split_shards("train")


def resolve(config: TrainConfig, store: ObjectStore, target_dir: str) -> Resolved:
    source = open_input(store, config, target_dir)
    section = source.section
    if not source.manifest.split_shards("train"):
        raise BadInputError(f"{source.uri} holds no training shards (every record is held out for evaluation)")
    drafter = resolve_drafter(config, target_dir, section)
    config.recipe.decay_gamma(drafter.block_size)  # a block size with no default decay is refused before any load
    max_length = config.max_length or section.max_length
    rows_per_step = config.batch_tokens // max_length
    if rows_per_step < 1:
        raise ConfigError(f"batch_tokens {config.batch_tokens} is less than one row of max_length {max_length}")
    if rows_per_step * max_length != config.batch_tokens:
        log.info("batch_tokens %d -> %d rows of %d tokens (%d tokens per step)", config.batch_tokens,
                 rows_per_step, max_length, rows_per_step * max_length)
    return Resolved(config, source, target_dir, drafter, max_length, rows_per_step)


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


def _target_sizes(target_dir: str, loaded_bytes: int) -> tuple[TargetSizes, int]:
    """The target's sizes from its weight files' headers, and the device bytes of one whole replica as loaded."""
    sizes = checkpoint_sizes(target_dir)
    return sizes, replica_bytes(target_dir, sizes.dtype_bytes, loaded_bytes)


def scratch_root(config: TrainConfig) -> str:
    """Node-local scratch shared by the ranks of a node (the target copy and the shard cache live there)."""
    base = config.scratch_dir or tempfile.gettempdir()
    return os.path.join(base, "dflash-train-" + hashlib.sha256(config.output.encode()).hexdigest()[:12])


def run(config: TrainConfig, store: ObjectStore | None = None) -> str | None:
    """Train (or resume); returns the drafter manifest URI on rank 0 once written, None elsewhere."""
    from dflash_train.parallel import distributed

    store = store or ObjectStore()
    env = distributed.init_distributed(config.device)
    try:
        if done := committed(store, config.output, STAGE):
            return done if env.is_main else None
        root = scratch_root(config)
        os.makedirs(root, exist_ok=True)
        # Only rank 0 reads the weights (target_model.loading); a node without it needs the small files only.
        small = not holds_rank0(env)
        only = TARGET_SMALL_FILES if small else None
        if env.local_rank == 0:
            fetch_model(store, config.target, root, config.copy_workers, only)
        env.barrier()
        target_dir = fetch_model(store, config.target, root, config.copy_workers, only)
        resolved = resolve(config, store, target_dir)
        return _train(resolved, store, env, root)
    finally:
        distributed.shutdown(env)


def plan_data(resolved: Resolved, store: ObjectStore, cache: ShardCache, env: DistEnv) -> DataPlan:
    """The run's data plan over the train split (counted by the ranks together, or read back on a resume)."""
    from dflash_train.data import loader as data

    return data.build_plan(store, join(resolved.config.output, "train", "plan.json"), resolved.train_shards,
                           resolved.source.sha256, cache, resolved.max_length, resolved.config.seed, env.rank,
                           env.world_size, env.all_gather_object)


def _train(resolved: Resolved, store: ObjectStore, env: DistEnv, root: str) -> str | None:
    import torch

    from dflash_train.data import loader as data
    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.parallel import distributed
    from dflash_train.target_model.loading import load_target
    from dflash_train.trainer import Trainer, TrainerSetup, refuse_other_settings
    from dflash_train.training import checkpoint as ckpt
    from dflash_train.training import memory_plan, optim
    from dflash_train.training.metrics import MetricsSink

    config, cfg = resolved.config, resolved.drafter
    scratch = os.path.join(root, f"rank-{env.rank}")
    os.makedirs(scratch, exist_ok=True)
    cache = data.ShardCache(store, os.path.join(root, "shards"), int(config.cache_gib * 2**30), config.verify_shards)
    try:
        # A checkpoint saved under other settings is refused before the target is loaded or a byte planned.
        ref = ckpt.find_resume(store, config.output, config.resume)
        if ref is not None:
            refuse_other_settings(store, ref, config)
        dtype = optim.target_dtype(config.runtime, env.device)
        with torch.device("meta"):
            drafter_params = sum(p.numel() for p in DFlashDrafter(cfg).parameters())
        # Weight sizes come from the weight files, which only rank 0's node holds: rank 0 reads, all use.
        shape, replica = on_rank0(env, lambda: _target_sizes(resolved.target_dir, dtype.itemsize))
        parallelism = distributed.choose_parallelism(config.parallelism, replica, drafter_params, env)
        # Before the data plan and the target load: a configuration predicted not to fit stops here (exit 64).
        planned = memory_plan.check_run(config.runtime, config.recipe, cfg, shape, resolved.max_length, parallelism,
                                        env, dtype.itemsize)
        plan = plan_data(resolved, store, cache, env)
        steps = data.total_steps(plan, resolved.rows_per_step, config.epochs, config.max_steps)
        sharded = parallelism == "fsdp" and env.distributed
        # Rank 0 reads the checkpoint and broadcasts it: no rank but rank 0 holds a host copy of the target.
        target = load_target(resolved.target_dir, cfg.target_layer_ids, env, sharded, dtype,
                             attn_implementation=config.target_attn_implementation, packing=config.target_packing,
                             keep_output=config.recipe.needs_target_output)
        warn_on_zero_mask_row(target, cfg.mask_token_id)
        log.info("drafter %.1fM parameters, %s, %d step(s), target %s on %s", drafter_params / 1e6, parallelism,
                 steps, resolved.target_dir, env.device)
        heldout = None
        if config.heldout_every:
            from dflash_train.training.heldout import heldout_rows

            heldout = heldout_rows(cache, resolved.source.manifest.split_shards("heldout"), config.heldout_documents,
                                   resolved.max_length)
            if heldout is None:
                log.info("no held-out split in %s: the held-out acceptance is not measured", resolved.source.uri)
        setup = TrainerSetup(config=config, drafter=cfg, plan=plan, cache=cache, scratch=scratch,
                             parallelism=parallelism, total_steps=steps, rows_per_step=resolved.rows_per_step,
                             init_from=config.init_from if ref is None else None, heldout=heldout)
        trainer = Trainer(setup, target, env, store)
        if ref is not None:
            trainer.resume(ref)
        sink = MetricsSink(env, os.path.join(scratch, "tensorboard"), config.tensorboard, f"from-step-{trainer.step}",
                           store=store, output=config.output, progress_every_s=config.progress_every_s,
                           tokens_per_step=resolved.rows_per_step * resolved.max_length)
        try:
            result = trainer.train(sink)
        finally:
            sink.close(store, config.output)
        if not env.is_main:
            return None
        final = ckpt.find_resume(store, config.output, result.checkpoint_uri)
        assert final is not None
        manifest = build_manifest(resolved, final, result.final_metrics,
                                  {"world_size": env.world_size, "parallelism": parallelism,
                                   "mesh": distributed.mesh_of(trainer.model), "total_steps": trainer.total_steps,
                                   "warm_start": trainer.warm_started},
                                  trained_tokens(plan, trainer.total_steps, resolved.rows_per_step),
                                  performance(trainer, result, env.world_size, planned.peak, shape.active_params,
                                              drafter_params))
        uri, _ = write_manifest(store, config.output, manifest)
        log.info("drafter manifest %s: %d steps, final loss %.4f, tau %.2f", uri, result.steps,
                 result.final_metrics.get("loss", float("nan")), result.final_metrics.get("tau", float("nan")))
        return uri
    finally:
        cache.close()
        shutil.rmtree(scratch, ignore_errors=True)
