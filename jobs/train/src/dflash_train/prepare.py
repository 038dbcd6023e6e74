"""What the train stage decides and loads before the first step, in the order that lets it refuse early.

Per rank: copy the target to local scratch (the whole target once, on the node of rank 0, the only rank that reads
its weights; the other nodes copy only `TARGET_SMALL_FILES`: their ranks build the target from config.json, hash the
tokenizer and template, and get the weights' sizes and then the weights themselves from rank 0), refuse data made
with another tokenizer or chat template, resolve the drafter config, refuse a checkpoint saved under other
settings, weigh the parallelism and check the memory plan (a configuration predicted not to fit stops here, exit
64), plan the data (the train split only: the held-out shards are the evaluation's and are never downloaded here),
load the frozen target (whole, or FSDP-sharded), pack the held-out rows, and build the trainer, resumed from the
newest complete checkpoint.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from dflash_shared.errors import BadInputError, ConfigError
from dflash_shared.identity import chat_template_sha256, tokenizer_sha256
from dflash_shared.manifest_io import LoadedManifest, load_manifest
from dflash_shared.manifests import Kind, Shard, TokenizedSection
from dflash_shared.model_copy import IDENTITY_FILES, fetch_model
from dflash_shared.storage import ObjectStore, join
from dflash_train.config import TrainConfig, settings_identity
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.resolve import resolve_drafter
from dflash_train.parallel.rank0 import holds_rank0, on_rank0

if TYPE_CHECKING:
    from dflash_train.data.plan import DataPlan
    from dflash_train.data.shards import ShardCache
    from dflash_train.parallel.distributed import DistEnv
    from dflash_train.parallel.placement import Parallelism
    from dflash_train.trainer import Trainer

log = logging.getLogger(__name__)
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


@dataclass(frozen=True)
class Resolved:
    """Everything decided from the settings, the input manifest and the target's files."""

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
    if not source.manifest.split_shards("train"):
        raise BadInputError(f"{source.uri} holds no training shards (every record is held out for evaluation)")
    drafter = resolve_drafter(config, target_dir, source.section)
    config.recipe.decay_gamma(drafter.block_size)  # a block size with no default decay is refused before any load
    max_length = config.max_length or source.section.max_length
    rows_per_step = config.batch_tokens // max_length
    if rows_per_step < 1:
        raise ConfigError(f"batch_tokens {config.batch_tokens} is less than one row of max_length {max_length}")
    if rows_per_step * max_length != config.batch_tokens:
        log.info("batch_tokens %d -> %d rows of %d tokens (%d tokens per step)", config.batch_tokens,
                 rows_per_step, max_length, rows_per_step * max_length)
    return Resolved(config, source, target_dir, drafter, max_length, rows_per_step)


def scratch_root(config: TrainConfig) -> str:
    """Node-local scratch shared by the ranks of a node (the target copy and the shard cache live there)."""
    base = config.scratch_dir or tempfile.gettempdir()
    return os.path.join(base, "dflash-train-" + hashlib.sha256(config.output.encode()).hexdigest()[:12])


def plan_data(resolved: Resolved, store: ObjectStore, cache: ShardCache, env: DistEnv) -> DataPlan:
    """The run's data plan over the train split (counted by the ranks together, or read back on a resume)."""
    from dflash_train.data.plan import build_plan

    return build_plan(store, join(resolved.config.output, "train", "plan.json"), resolved.train_shards,
                      resolved.source.sha256, cache, resolved.max_length, resolved.config.seed, env.rank,
                      env.world_size, env.all_gather_object)


@dataclass(frozen=True)
class PreparedRun:
    """A run ready for its first step: what was resolved, the trainer (resumed where a checkpoint was; it holds the
    data plan, the shard cache and this rank's scratch), and what the drafter manifest reports of the plan
    (`publish`); `close` removes the scratch and the cache."""

    resolved: Resolved
    trainer: Trainer
    planned_peak: int
    target_params: int  # those a token runs (a mixture of experts' active ones): what the pilot's MFU counts
    drafter_params: int

    def close(self) -> None:
        _remove_scratch(self.trainer.setup.cache, self.trainer.setup.scratch)


def _remove_scratch(cache: ShardCache, scratch: str) -> None:
    cache.close()
    shutil.rmtree(scratch, ignore_errors=True)


def prepare_run(config: TrainConfig, store: ObjectStore, env: DistEnv) -> PreparedRun:
    """The run, prepared as the module docstring says (the caller closes it)."""
    import torch

    from dflash_train.data.plan import total_steps
    from dflash_train.data.shards import ShardCache
    from dflash_train.drafter.mask_token import warn_on_zero_mask_row
    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.target_model.loading import load_target
    from dflash_train.trainer import Trainer, TrainerSetup
    from dflash_train.training import checkpoint as ckpt
    from dflash_train.training import memory_plan, precision
    from dflash_train.training.heldout import heldout_rows
    from dflash_train.training.target_params import loaded_sizes

    root = scratch_root(config)
    os.makedirs(root, exist_ok=True)
    # Only rank 0 reads the weights (target_model.loading); a node without it needs the small files only.
    only = None if holds_rank0(env) else TARGET_SMALL_FILES
    if env.local_rank == 0:
        fetch_model(store, config.target, root, config.copy_workers, only)
    env.barrier()
    target_dir = fetch_model(store, config.target, root, config.copy_workers, only)
    resolved = resolve(config, store, target_dir)
    cfg = resolved.drafter
    scratch = os.path.join(root, f"rank-{env.rank}")
    os.makedirs(scratch, exist_ok=True)
    cache = ShardCache(store, os.path.join(root, "shards"), int(config.cache_gib * 2**30), config.verify_shards)
    try:
        # A checkpoint saved under other settings is refused before the target is loaded or a byte planned.
        ref = ckpt.find_resume(store, config.output, config.resume)
        if ref is not None:
            ckpt.refuse_other_settings(store, ref, settings_identity(config))
        dtype = precision.target_dtype(config.runtime, env.device)
        with torch.device("meta"):
            drafter_params = sum(p.numel() for p in DFlashDrafter(cfg).parameters())
        # Weight sizes come from the weight files, which only rank 0's node holds: rank 0 reads, all use.
        shape, replica = on_rank0(env, lambda: loaded_sizes(target_dir, dtype.itemsize))
        parallelism = cast("Parallelism", memory_plan.choose_parallelism(config.parallelism, replica,
                                                                           drafter_params, env.device))
        planned = memory_plan.check_run(config.runtime, config.recipe, cfg, shape, resolved.max_length, parallelism,
                                        env, dtype.itemsize)
        plan = plan_data(resolved, store, cache, env)
        steps = total_steps(plan, resolved.rows_per_step, config.epochs, config.max_steps)
        # Rank 0 reads the checkpoint and broadcasts it: no rank but rank 0 holds a host copy of the target.
        target = load_target(target_dir, cfg.target_layer_ids, env, parallelism == "fsdp" and env.distributed, dtype,
                             attn_implementation=config.target_attn_implementation, packing=config.target_packing,
                             keep_output=config.recipe.needs_target_output)
        warn_on_zero_mask_row(target, cfg.mask_token_id)
        log.info("drafter %.1fM parameters, %s, %d step(s), target %s on %s", drafter_params / 1e6, parallelism,
                 steps, target_dir, env.device)
        heldout = None
        if config.heldout_every:
            heldout = heldout_rows(cache, resolved.source.manifest.split_shards("heldout"), config.heldout_documents,
                                   resolved.max_length)
            if heldout is None:
                log.info("no held-out split in %s: the held-out acceptance is not measured", resolved.source.uri)
        trainer = Trainer(TrainerSetup(config=config, drafter=cfg, plan=plan, cache=cache, scratch=scratch,
                                       parallelism=parallelism, total_steps=steps,
                                       rows_per_step=resolved.rows_per_step,
                                       init_from=config.init_from if ref is None else None, heldout=heldout),
                          target, env, store)
        if ref is not None:
            trainer.resume(ref)
    except BaseException:
        _remove_scratch(cache, scratch)
        raise
    return PreparedRun(resolved, trainer, planned.peak, shape.active_params, drafter_params)
