"""The train stage's checks, one list (`build_preflight`): `run` starts with it on every rank and `preflight` runs
it alone. Everything that can be checked before the target is loaded:

Imports, GPUs (when training on CUDA), S3 credentials and write access to the output, scratch disk, the
kernels a hybrid target's linear-attention layers would run on (a WARN line when a GPU run would use the
PyTorch reference kernels), and the tokenized manifest's compatibility with the target: its tokenizer and
chat template hashes must be those of the target directory (only the target's small files are copied for
this check).
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from dflash_shared.manifest_io import ManifestError
from dflash_shared.manifests import Kind
from dflash_shared.model_copy import fetch_model
from dflash_shared.preflight import CheckError, CheckWarning, Preflight, io_checks, manifest_check_error
from dflash_shared.storage import ObjectStore, is_s3, join
from dflash_train.config import TrainConfig
from dflash_train.evaluate.config import EvaluateConfig
from dflash_train.export.config import ExportConfig
from dflash_train.prepare import TARGET_SMALL_FILES, open_input
from dflash_train.publish import STAGE
from dflash_train.sections import TrainingRuntime

REQUIRED = ["dflash_train", "dflash_shared", "torch", "transformers", "safetensors", "pyarrow", "numpy"]


def _local_gpus() -> int:
    """GPUs this pod's ranks need: torchrun's LOCAL_WORLD_SIZE, else one."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(raw) if raw else 1


def _target_config(store: ObjectStore, target: str) -> dict[str, Any]:
    raw = store.read_bytes(join(target, "config.json")) if is_s3(target) else Path(target, "config.json").read_bytes()
    config: dict[str, Any] = json.loads(raw)
    return config


def _on_gpu(runtime: TrainingRuntime) -> bool:
    if runtime.device != "auto":
        return runtime.device == "cuda"
    import torch

    return bool(torch.cuda.is_available())


def kernels_check(runtime: TrainingRuntime, target_uri: str, store: ObjectStore) -> str:
    """Which fast kernels are active; warns when a hybrid target would run on the reference ones on a GPU."""
    from dflash_train.target_model.linear_kernels import CAUSAL_CONV1D, FLA, modeling_module, use_fla_conv

    installed = {FLA: importlib.util.find_spec("fla") is not None,
                 CAUSAL_CONV1D: importlib.util.find_spec("causal_conv1d") is not None}
    present = ", ".join(f"{name} {'installed' if ok else 'not installed'}" for name, ok in installed.items())
    try:
        target = _target_config(store, target_uri)
    except Exception as err:  # noqa: BLE001 - reported as this check's failure
        raise CheckError(f"target {target_uri} config.json cannot be read: {err}") from err
    text = target.get("text_config") or target
    layer_types = list(text.get("layer_types") or [])
    model_type = str(text.get("model_type") or target.get("model_type") or "")
    if "linear_attention" not in layer_types:
        return f"{present}; not needed: the target ({model_type}) has no linear-attention layers"
    modeling = modeling_module(model_type)
    status = use_fla_conv(modeling) if modeling is not None else None
    if status is None:
        raise CheckError(f"target {model_type} has linear-attention layers but transformers has no Gated DeltaNet"
                         " kernels for it")
    packing = "varlen (one forward per batch)" if status.varlen else "per_document (one forward per document)"
    detail = (f"{present}; hybrid target ({model_type}, {layer_types.count('linear_attention')} linear-attention"
              f" layers): {status.describe()}; packed rows run {packing}")
    on_gpu = _on_gpu(runtime)
    if status.varlen:
        if not on_gpu:
            raise CheckWarning(f"{detail}. This run is on the CPU: the Triton / CUDA kernels transformers selected"
                               " need a GPU, so a hybrid target will likely fail to run here")
        return detail
    if on_gpu:
        raise CheckWarning(f"{detail}. A hybrid target on the PyTorch reference kernels on a GPU is an order of"
                           f" magnitude slower: install {FLA} (the trainer image ships it)")
    return f"{detail} (CPU run: the fast kernels are GPU kernels)"


def export_start_checks(config: ExportConfig, store: ObjectStore) -> Preflight:
    """What `export` checks before it reads a checkpoint: the drafter manifest and a writable output."""
    return io_checks("export", store, config.output, {"drafter_manifest": (config.drafter, Kind.drafter)},
                     [config.target])


def evaluate_start_checks(config: EvaluateConfig, store: ObjectStore) -> Preflight:
    """What `evaluate` checks before it copies the target: the exported drafter's manifest and a writable output
    (the prompts' manifest may be of three kinds; the stage names a wrong one before loading a model)."""
    return io_checks("evaluate", store, config.output, {"drafter_manifest": (config.drafter, Kind.drafter)},
                     [config.target, config.prompts])


def build_preflight(config: TrainConfig, store: ObjectStore | None = None) -> Preflight:
    store = store or ObjectStore()
    checks = Preflight(STAGE, store).imports(REQUIRED + (["tensorboard"] if config.tensorboard else []))
    checks.gpus(_local_gpus() if config.device == "cuda" else 0)
    s3_uris = [uri for uri in (config.input, config.output, config.target) if is_s3(uri)]
    if s3_uris:
        checks.credentials(s3_uris[0])
    checks.storage_write(config.output)
    checks.disk(config.scratch_dir or tempfile.gettempdir(), int(config.disk_need_gib * 2**30))
    checks.add("kernels", lambda: kernels_check(config.runtime, config.target, store))
    # The manifest alone first: a missing or wrong input is bad input (65) whatever else fails.
    checks.input_manifest(store, config.input, Kind.tokenized)

    def target_compatible() -> str:
        base = config.scratch_dir or tempfile.gettempdir()
        os.makedirs(base, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=base) as scratch:
            try:
                target_dir = fetch_model(store, config.target, scratch, only=TARGET_SMALL_FILES)
            except Exception as err:  # noqa: BLE001 - reported as this check's failure
                raise CheckError(f"target {config.target} cannot be read: {err}") from err
            try:
                source = open_input(store, config, target_dir)
            except ManifestError as err:
                raise manifest_check_error(err) from err
        m, section = source.manifest, source.section
        heldout = section.heldout.records if section.heldout else 0
        return (f"tokenized {source.uri}: run {m.run_id}, {len(m.shards)} shard(s), {m.total_records:,} records "
                f"({heldout:,} held out for evaluation), {section.total_tokens:,} tokens; tokenizer and chat template "
                f"match the target {config.target}")

    return checks.add("target_compatible", target_compatible)
