"""The drafter a run starts from: freshly initialised (seeded, so the same on every rank), or warm-started.

Warm start: a fresh run's first weights from a drafter that exists (`init_from`), instead of random ones.

Two sources, told apart by what the folder holds: a training checkpoint of this project (`drafter_config.json`
and the fp32 `model.safetensors`, e.g. `<output>/checkpoints/step-00001000`), or an export in the native format
vLLM and SGLang load (`config.json` with `dflash_config`, and `model.safetensors`), which is also how z-lab
publishes its drafters. The source's drafter must be the run's: the same shape, the same target layers and
target width, the same block and the same mask token; anything else is refused (exit 64) naming each difference,
because loading a drafter into another shape, or onto other target layers, would train from weights that mean
something else. The training recipe (objective, anchors, schedule) is the run's own and may differ freely.

Only a fresh run reads it: a resumed run continues from its own checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

import torch

from dflash_shared.errors import ConfigError
from dflash_shared.storage import ObjectStore, join
from dflash_train.drafter.attention import compile_drafter_layers
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.export.files import load_checkpoint_drafter, load_export
from dflash_train.export.format import CONFIG_NAME
from dflash_train.sections import TrainingRuntime
from dflash_train.training.anchor_ladder import anchor_count_buckets
from dflash_train.training.checkpoint import DRAFTER_CONFIG

log = logging.getLogger(__name__)

# What must match between the source and the run: the shape of every weight and what the weights are fed.
MATCHED_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "layer_types", "num_target_layers", "target_layer_ids", "target_hidden_size",
                  "block_size", "mask_token_id")


def source_drafter(store: ObjectStore, uri: str) -> tuple[DFlashDrafter, str]:
    """The drafter at `uri` (a checkpoint or an export, local or s3://) in float32, and which kind it was."""
    if store.exists(join(uri, DRAFTER_CONFIG)):
        return load_checkpoint_drafter(store, uri).float(), "checkpoint"
    if store.exists(join(uri, CONFIG_NAME)):
        return load_export(uri, store, dtype=torch.float32), "export"
    raise ConfigError(f"init_from {uri} holds neither a training checkpoint ({DRAFTER_CONFIG}) nor an export "
                      f"({CONFIG_NAME}): give a checkpoint folder (<output>/checkpoints/step-N) or an export "
                      "directory")


def export_vocab_rows(store: ObjectStore, uri: str) -> int | None:
    """The target vocabulary an export's config.json names (vocab_size), when it names one."""
    with tempfile.TemporaryDirectory(prefix="dflash-init-") as tmp:
        path = os.path.join(tmp, CONFIG_NAME)
        store.download_to(join(uri, CONFIG_NAME), path)
        with open(path, encoding="utf-8") as fh:
            rows = json.load(fh).get("vocab_size")
    return int(rows) if rows is not None else None


def differences(source: DrafterConfig, run: DrafterConfig) -> list[str]:
    """Each field of MATCHED_FIELDS whose value differs, as '<field> <source> (run: <run>)'."""
    return [f"{name} {getattr(source, name)!r} (run: {getattr(run, name)!r})" for name in MATCHED_FIELDS
            if getattr(source, name) != getattr(run, name)]


def warm_start(drafter: DFlashDrafter, store: ObjectStore, uri: str, target_vocab_rows: int) -> str:
    """Load the weights at `uri` into `drafter` (in place) after checking they fit; returns what was loaded."""
    source, kind = source_drafter(store, uri)
    problems = differences(source.config, drafter.config)
    if kind == "export":
        rows = export_vocab_rows(store, uri)
        if rows is not None and rows != target_vocab_rows:
            problems.append(f"vocab_size {rows} (run's target: {target_vocab_rows})")
    if problems:
        raise ConfigError(f"init_from {uri} ({kind}) does not fit this run's drafter: {'; '.join(problems)}. Make "
                          "the run's drafter the same (drafter_overrides, target_layer_ids, mask_token_id) or start "
                          "from random weights (no init_from)")
    with torch.no_grad():
        drafter.load_state_dict({k: v.to(drafter.fc.weight.dtype) for k, v in source.state_dict().items()},
                                strict=True)
    log.info("warm start: drafter weights from the %s %s", kind, uri)
    return f"{kind} {uri}"


def initial_drafter(cfg: DrafterConfig, seed: int, runtime: TrainingRuntime, device: torch.device,
                    store: ObjectStore | None = None, init_from: str | None = None,
                    target_vocab_rows: int = 0) -> tuple[DFlashDrafter, str | None]:
    """The run's first drafter on `device`: seeded random weights, or those at `init_from` (`warm_start`); and what
    was loaded (None: random weights). Gradient checkpointing and compilation as the runtime says."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).to(device)
    if runtime.activation_checkpointing:
        drafter.set_gradient_checkpointing(True)
    if runtime.compile:
        # Static shapes: per ladder rung two training graphs (the first layer, the rest) and one for
        # no_grad evaluation; the recompile limit is raised before the first compile (dflash_train.drafter.attention).
        compile_drafter_layers(drafter.layers, len(anchor_count_buckets(cfg.block_size, runtime.max_anchors_per_row)))
    loaded = None
    if init_from is not None:
        assert store is not None
        loaded = warm_start(drafter, store, init_from, target_vocab_rows)
    return drafter, loaded
