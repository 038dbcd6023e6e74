"""The precision a run computes in: the forward under bf16 autocast when precision is bf16 (activations and matmuls
in bf16 over the fp32 master weights, `training.optim`), and the frozen target's dtype.
"""

from __future__ import annotations

import contextlib

import torch

from dflash_train.sections import TrainingRuntime


def autocast(runtime: TrainingRuntime, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast for the forward pass, or nothing for fp32 training."""
    if runtime.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def target_dtype(runtime: TrainingRuntime, device: torch.device) -> torch.dtype:
    if runtime.target_dtype == "bf16" or (runtime.target_dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32
