"""Export files: write a drafter's export directory (native and speculators formats) and read one back.

Weights are written in a chosen dtype (bf16 by default, like the reference drafters). `load_export`
rebuilds a `DFlashDrafter` from the directory; with a float32 export it reproduces the trained drafter
bit for bit. What the files hold is format.py's.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dflash_shared.errors import BadInputError
from dflash_shared.storage import ObjectStore, is_s3, join
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.export.format import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    ExportError,
    config_from_export,
    drafter_hf_config,
    expected_weight_names,
    export_speculators_config,
)

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def export_state_dict(drafter: DFlashDrafter, dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    """The drafter's weights under their export names, contiguous CPU tensors in `dtype`.

    Refuses a drafter whose parameters are not exactly the expected set: an embedding or LM head that
    slipped in, or a renamed module, would be silently ignored or rejected by the engines.
    """
    if dtype not in DTYPES:
        raise ExportError(f"unsupported export dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    state = drafter.state_dict()
    want = expected_weight_names(drafter.config.num_layers)
    have = sorted(state)
    if have != want:
        extra = sorted(set(have) - set(want))
        missing = sorted(set(want) - set(have))
        raise ExportError(f"drafter weights do not match the export format: unexpected {extra}, missing {missing}")
    return {name: t.detach().to("cpu", DTYPES[dtype]).contiguous() for name, t in state.items()}


def write_export_dir(drafter: DFlashDrafter, target_config: Any, directory: str, dtype: str = "bfloat16") -> None:
    """Write config.json and model.safetensors into a local directory (created if needed)."""
    os.makedirs(directory, exist_ok=True)
    tensors = export_state_dict(drafter, dtype)
    config = drafter_hf_config(drafter.config, target_config, dtype)
    save_file(tensors, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG_NAME), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
        fh.write("\n")


def export_drafter(
    drafter: DFlashDrafter, target_config: Any, uri: str, store: ObjectStore, dtype: str = "bfloat16"
) -> list[str]:
    """Export to a local directory or an s3:// prefix; returns the URIs of the written files.

    The weights go first and config.json last, so a reader that finds the config finds the weights.
    """
    with tempfile.TemporaryDirectory(prefix="dflash-export-") as tmp:
        write_export_dir(drafter, target_config, tmp, dtype)
        written = []
        for name in (WEIGHTS_NAME, CONFIG_NAME):
            dest = join(uri, name)
            store.upload_from(os.path.join(tmp, name), dest)
            written.append(dest)
    return written


def load_export_dir(directory: str, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Rebuild the drafter of a local export directory (strict: every tensor present, none extra).

    `dtype` None keeps the stored dtype of the weights.
    """
    config_path = os.path.join(directory, CONFIG_NAME)
    weights_path = os.path.join(directory, WEIGHTS_NAME)
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise ExportError(f"export {directory} has no {os.path.basename(path)}")
    with open(config_path, encoding="utf-8") as fh:
        cfg = config_from_export(json.load(fh), config_path)
    tensors = load_file(weights_path)
    want = expected_weight_names(cfg.num_layers)
    if sorted(tensors) != want:
        extra = sorted(set(tensors) - set(want))
        missing = sorted(set(want) - set(tensors))
        raise ExportError(f"{weights_path}: unexpected tensors {extra}, missing {missing}")
    stored = {t.dtype for t in tensors.values()}
    if dtype is None:
        if len(stored) != 1:
            raise ExportError(f"{weights_path}: mixed dtypes {sorted(map(str, stored))}; pass a dtype")
        dtype = stored.pop()
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(tensors, strict=True)
    return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_export(uri: str, store: ObjectStore, device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None) -> DFlashDrafter:
    """`load_export_dir` for a local directory or an s3:// prefix (downloaded to a temp dir first)."""
    if not is_s3(uri):
        return load_export_dir(uri, device, dtype)
    with tempfile.TemporaryDirectory(prefix="dflash-export-") as tmp:
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            store.download_to(join(uri, name), os.path.join(tmp, name))
        return load_export_dir(tmp, device, dtype)


def write_speculators_dir(drafter: DFlashDrafter, target_config: Any, directory: str, verifier: str,
                          dtype: str = "bfloat16") -> None:
    """A speculators-format export: its config.json and the same model.safetensors as the native one.

    The config is built first, so a drafter the format cannot carry is refused before any file is written.
    """
    config = export_speculators_config(drafter.config, target_config, verifier, dtype)
    os.makedirs(directory, exist_ok=True)
    save_file(export_state_dict(drafter, dtype), os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG_NAME), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
        fh.write("\n")


def read_target_config(store: ObjectStore, target: str) -> Any:
    """The target's config.json as an attribute namespace (a multimodal config's text part when present)."""
    from types import SimpleNamespace

    uri = join(target, CONFIG_NAME)
    try:
        data = json.loads(store.read_bytes(uri))
    except (OSError, ValueError) as err:
        raise BadInputError(f"target config {uri} cannot be read: {err}") from err
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    merged = {**data, **{k: v for k, v in text.items() if k not in ("architectures",)}}
    missing = [key for key in ("vocab_size", "num_hidden_layers", "hidden_size") if key not in merged]
    if missing:
        raise BadInputError(f"target config {uri} lacks {missing}")
    return SimpleNamespace(**merged)


def load_checkpoint_drafter(store: ObjectStore, checkpoint: str) -> DFlashDrafter:
    """The drafter of a training checkpoint folder (its drafter_config.json and fp32 model.safetensors)."""
    from dflash_train.training.checkpoint import DRAFTER_CONFIG, MODEL

    with tempfile.TemporaryDirectory(prefix="dflash-checkpoint-") as tmp:
        paths = {}
        for name in (DRAFTER_CONFIG, MODEL):
            paths[name] = os.path.join(tmp, name)
            store.download_to(join(checkpoint, name), paths[name])
        with open(paths[DRAFTER_CONFIG], encoding="utf-8") as fh:
            cfg = DrafterConfig.from_saved(fh.read())
        drafter = DFlashDrafter(cfg)
        tensors = load_file(paths[MODEL])
    unexpected = sorted(set(tensors) - set(expected_weight_names(cfg.num_layers)))
    if unexpected:
        raise BadInputError(f"checkpoint {checkpoint} holds tensors outside the drafter: {unexpected}")
    drafter.load_state_dict(tensors, strict=True)
    return drafter.eval()
