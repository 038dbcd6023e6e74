"""Training checkpoints in the store: written completely or not at all, found again automatically.

A checkpoint is a folder `<output>/checkpoints/step-00001000/` holding

    model.safetensors     the drafter's fp32 master weights, full (unsharded), export names
    optimizer.pt          the full AdamW state, keyed by parameter name (any world size can load it)
    rng.pt                rank 0's torch/CUDA/numpy/python RNG states
    trainer_state.json    step, data position, LR scheduler, plan fingerprint, last metrics
    drafter_config.json   the DrafterConfig the weights belong to
    COMPLETE.json         written LAST: the name, size and sha256 of every file above

Resume picks the newest folder with a COMPLETE.json whose files are all present with their sizes: a save
cut short (kill -9, node loss) leaves a folder without the marker, which is never used and is deleted
by the next successful save. State dicts are full (gathered to rank 0), so a run saved with N ranks,
DDP or FSDP, resumes with M.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dflash_shared.errors import ConfigError
from dflash_shared.stage_identity import StageIdentity, refuse_changed
from dflash_shared.storage import ObjectStore, join
from dflash_train.drafter.config import DrafterConfig
from dflash_train.parallel.distributed import DistEnv

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE.json"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
STATE = "trainer_state.json"
DRAFTER_CONFIG = "drafter_config.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FileEntry(_Frozen):
    bytes: int = Field(ge=0, description="Size of the file.")
    sha256: str = Field(description="sha256 of the file's bytes.")


class CompleteMarker(_Frozen):
    """Content of COMPLETE.json: the checkpoint's file list, written after every file is stored."""

    step: int = Field(ge=0, description="Optimizer steps done when the checkpoint was taken.")
    files: dict[str, FileEntry] = Field(description="Every file of the checkpoint by name.")
    world_size: int = Field(ge=1, description="Ranks of the run that wrote it.")
    created_at: datetime = Field(description="When the marker was written (UTC).")


class TrainState(_Frozen):
    """Everything besides tensors that a resumed run needs to continue where the saved one stopped."""

    step: int = Field(ge=0, description="Optimizer steps done.")
    total_steps: int = Field(ge=1, description="Steps of the whole run (the LR schedule's length).")
    rows_per_step: int = Field(ge=1, description="Packed rows per optimizer step over all ranks.")
    consumed_rows: int = Field(ge=0, description="Global packed rows consumed: the data position.")
    data_position: dict[str, int] = Field(description="The data position spelt out: epoch, shard, row.")
    plan_fingerprint: str = Field(description="Data, max_length, seed and packing the position refers to.")
    scheduler: dict[str, Any] = Field(description="The LR scheduler's state_dict.")
    world_size: int = Field(ge=1, description="Ranks of the run that saved it.")
    metrics: dict[str, float] = Field(default_factory=dict, description="Last logged metrics.")
    identity: StageIdentity | None = Field(
        default=None, description="The settings and image of the run that saved it (dflash_train.config."
        "settings_identity); None in checkpoints saved before they were recorded, which are not compared.")


@dataclass(frozen=True)
class CheckpointRef:
    uri: str
    step: int
    marker: CompleteMarker


def checkpoint_uri(output: str, step: int) -> str:
    return join(output, CHECKPOINTS, f"step-{step:08d}")


# ---------------------------------------------------------------------------------------- store side


def _step_folders(store: ObjectStore, output: str) -> dict[int, set[str]]:
    """Step -> names of the files found in its folder."""
    root = join(output, CHECKPOINTS)
    found: dict[int, set[str]] = {}
    for uri in store.list(root):
        parts = uri[len(root):].strip("/").split("/")
        match = _STEP_DIR.match(parts[0]) if len(parts) == 2 else None
        if match:
            found.setdefault(int(match.group(1)), set()).add(parts[1])
    return found


def _read_marker(store: ObjectStore, uri: str, names: set[str]) -> CompleteMarker | None:
    if COMPLETE not in names:
        return None
    try:
        marker = CompleteMarker.model_validate_json(store.read_bytes(join(uri, COMPLETE)))
    except ValueError as err:
        log.warning("ignoring checkpoint %s: unreadable %s (%s)", uri, COMPLETE, err)
        return None
    for name, entry in marker.files.items():
        if name not in names or store.size(join(uri, name)) != entry.bytes:
            log.warning("ignoring checkpoint %s: %s is missing or has the wrong size", uri, name)
            return None
    return marker


def complete_checkpoints(store: ObjectStore, output: str, folders: dict[int, set[str]] | None = None,
                         ) -> list[CheckpointRef]:
    """Usable checkpoints under `output`, oldest first (`folders`: its step folders, where already listed)."""
    refs = []
    for step, names in sorted((_step_folders(store, output) if folders is None else folders).items()):
        uri = checkpoint_uri(output, step)
        marker = _read_marker(store, uri, names)
        if marker is not None:
            refs.append(CheckpointRef(uri, step, marker))
    return refs


def find_resume(store: ObjectStore, output: str, resume: str) -> CheckpointRef | None:
    """The checkpoint to start from: newest complete one (auto), none (never), or the URI given."""
    if resume == "never":
        return None
    if resume == "auto":
        refs = complete_checkpoints(store, output)
        return refs[-1] if refs else None
    uri = resume.rstrip("/")
    match = _STEP_DIR.match(uri.rsplit("/", 1)[-1])
    names = {u.rsplit("/", 1)[-1] for u in store.list(uri)}
    marker = _read_marker(store, uri, names) if match else None
    if marker is None:
        # A setting that names no checkpoint is a configuration mistake (exit 64), not a failure to retry.
        raise ConfigError(f"resume={resume}: not a complete checkpoint folder (step-NNNNNNNN with {COMPLETE}); give "
                          "a checkpoint URI under <output>/checkpoints/, auto or never")
    return CheckpointRef(uri, marker.step, marker)


def publish(store: ObjectStore, local_dir: str, uri: str, step: int, world_size: int, workers: int = 4,
            ) -> CompleteMarker:
    """Upload every file of `local_dir` to `uri`, then COMPLETE.json: the commit point of the checkpoint."""
    names = sorted(os.listdir(local_dir))

    def upload(name: str) -> tuple[str, FileEntry]:
        path = os.path.join(local_dir, name)
        store.upload_from(path, join(uri, name))
        return name, FileEntry(bytes=os.path.getsize(path), sha256=store.sha256(path))

    with ThreadPoolExecutor(max_workers=workers) as pool:
        files = dict(pool.map(upload, names))
    marker = CompleteMarker(step=step, files=files, world_size=world_size, created_at=datetime.now(UTC))
    store.write_bytes(join(uri, COMPLETE), marker.model_dump_json(indent=1).encode())
    return marker


def prune(store: ObjectStore, output: str, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and every unfinished folder older than them."""
    folders = _step_folders(store, output)
    complete = [ref.step for ref in complete_checkpoints(store, output, folders)]  # one listing of the store
    kept = set(complete[-keep:])
    newest = max(kept, default=-1)
    for step, names in folders.items():
        if step in kept or step > newest:
            continue
        uri = checkpoint_uri(output, step)
        # The marker goes first, so that a prune cut short never leaves a "complete" folder with holes.
        for name in sorted(names, key=lambda n: n != COMPLETE):
            store.delete(join(uri, name))
        log.info("deleted old checkpoint %s", uri)


def fetch(store: ObjectStore, ref: CheckpointRef, local_dir: str) -> dict[str, str]:
    """Download a checkpoint's files and check them against its marker; returns name -> local path."""
    os.makedirs(local_dir, exist_ok=True)
    paths = {}
    for name, entry in ref.marker.files.items():
        path = os.path.join(local_dir, name)
        store.download_to(join(ref.uri, name), path)
        if store.sha256(path) != entry.sha256:
            raise OSError(f"checkpoint file {join(ref.uri, name)} does not match its sha256 in {COMPLETE}")
        paths[name] = path
    return paths


# ---------------------------------------------------------------------------------------- torch side


def _rng_state() -> dict[str, Any]:
    np_state = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def save_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    drafter_config_json: str,
    store: ObjectStore,
    output: str,
    env: DistEnv,
    scratch: str,
    keep: int,
) -> CheckpointRef:
    """Gather the full state on rank 0 and publish it (a collective: every rank must call it); every rank gets
    the reference rank 0 wrote."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    uri = checkpoint_uri(output, state.step)
    marker = None
    if env.rank == 0:
        local = os.path.join(scratch, f"checkpoint-{state.step:08d}")
        shutil.rmtree(local, ignore_errors=True)
        os.makedirs(local)
        try:
            save_file({k: cast(torch.Tensor, v).contiguous() for k, v in model_sd.items()}, os.path.join(local, MODEL),
                      metadata={"format": "pt", "step": str(state.step)})
            torch.save(optim_sd, os.path.join(local, OPTIMIZER))
            torch.save(_rng_state(), os.path.join(local, RNG))
            with open(os.path.join(local, STATE), "w", encoding="utf-8") as fh:
                fh.write(state.model_dump_json(indent=1))
            with open(os.path.join(local, DRAFTER_CONFIG), "w", encoding="utf-8") as fh:
                fh.write(drafter_config_json)
            marker = publish(store, local, uri, state.step, env.world_size)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        prune(store, output, keep)
        log.info("checkpoint step %d saved to %s", state.step, uri)
    # The other ranks wait here until rank 0 has published (the broadcast is the barrier).
    return CheckpointRef(uri, state.step, env.broadcast_object(marker))


def load_checkpoint(
    ref: CheckpointRef,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    store: ObjectStore,
    env: DistEnv,
    scratch: str,
) -> TrainState:
    """Load `ref` into model and optimizer (rank 0 reads, the others receive) and return its TrainState."""
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    payload: list[Any] = [None, None]
    if env.rank == 0:
        local = os.path.join(scratch, f"resume-{ref.step:08d}")
        try:
            paths = fetch(store, ref, local)
            model_sd = load_file(paths[MODEL])
            optim_sd = torch.load(paths[OPTIMIZER], map_location="cpu", weights_only=True)
            rng = torch.load(paths[RNG], map_location="cpu", weights_only=True)
            with open(paths[STATE], encoding="utf-8") as fh:
                payload = [fh.read(), rng]
        finally:
            shutil.rmtree(local, ignore_errors=True)
    state_json, rng = env.broadcast_object(payload)
    broadcast = env.world_size > 1
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
    _set_rng_state(rng)
    state = TrainState.model_validate_json(state_json)
    log.info("resumed from %s (step %d, saved by %d rank(s), now %d)", ref.uri, state.step, state.world_size,
             env.world_size)
    return state


def read_state(store: ObjectStore, ref: CheckpointRef) -> TrainState:
    """The trainer state stored with a checkpoint, read without its tensors (a resume's checks come first)."""
    return TrainState.model_validate_json(store.read_bytes(join(ref.uri, STATE)))


def read_config_json(store: ObjectStore, ref: CheckpointRef) -> dict[str, Any]:
    """The drafter config stored with a checkpoint."""
    return dict(json.loads(store.read_bytes(join(ref.uri, DRAFTER_CONFIG))))


def refuse_other_settings(store: ObjectStore, ref: CheckpointRef, identity: StageIdentity) -> None:
    """SettingsChangedError (exit 64) when `ref` was saved under other settings than those of `identity` (the run's
    `dflash_train.config.settings_identity`: those that change what a step computes, see RESUMABLE_CHANGES), naming
    each and the ways out."""
    refuse_changed(read_state(store, ref).identity, identity, f"checkpoint {ref.uri} was saved by a run with other "
                   "settings", "`python -m dflash_pipeline restart --config RUN.toml --stage train` (it deletes the "
                   "checkpoints and the later stages' outputs), or write to a new output prefix (a new run_id)")


def resume_checkpoint(ref: CheckpointRef, identity: StageIdentity, drafter: DrafterConfig, model: nn.Module,
                      optimizer: torch.optim.Optimizer, store: ObjectStore, env: DistEnv, scratch: str) -> TrainState:
    """Load `ref` into model and optimizer once it is known to continue this run: saved under the same settings
    and for the same drafter (ConfigError otherwise, before a tensor is read)."""
    refuse_other_settings(store, ref, identity)
    if DrafterConfig.from_saved(read_config_json(store, ref)) != drafter:
        raise ConfigError(f"checkpoint {ref.uri} was trained with another drafter config; start a new output "
                          "prefix or set resume=never")
    return load_checkpoint(ref, model, optimizer, store, env, scratch)
