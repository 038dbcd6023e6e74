"""Optimiser, learning-rate schedule and precision of the drafter's training.

AdamW over the drafter's fp32 parameters (the master weights), with torch's default betas (0.9, 0.999) as
the reference trainer (SpecForge) uses them unless the config says otherwise; the forward runs under bf16
autocast when precision is bf16, so activations and matmuls are bf16 while updates accumulate in fp32. The
schedule is linear warmup to the peak rate, then a cosine down to `min_lr_ratio` of it (the reference
recipe: 4% warmup, cosine), or warmup-stable-decay (`wsd`: the peak held until the last `decay_ratio` of the
steps, then a linear decay to `min_lr_ratio`; TorchSpec found it ~4% better in tau than cosine). The scheduler
is a LambdaLR whose state is the step count, stored with each checkpoint.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn


class OptimizerSettings(Protocol):
    """The settings read here; the stage's TrainConfig has them (typed structurally, so this floor does not
    import the stage's config above it)."""

    @property
    def lr(self) -> float: ...
    @property
    def adam_beta1(self) -> float: ...
    @property
    def adam_beta2(self) -> float: ...
    @property
    def adam_eps(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def warmup_ratio(self) -> float: ...
    @property
    def min_lr_ratio(self) -> float: ...
    @property
    def lr_schedule(self) -> str: ...
    @property
    def decay_ratio(self) -> float: ...
    @property
    def precision(self) -> str: ...
    @property
    def target_dtype(self) -> str: ...


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate before optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_stable_decay(step: int, warmup_steps: int, total_steps: int, min_ratio: float,
                        decay_ratio: float) -> float:
    """Multiplier of the peak learning rate before optimizer step `step` (0-based): warmup, hold, linear decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, int(round(decay_ratio * total_steps)))
    decay_from = max(warmup_steps, total_steps - decay_steps)
    if step < decay_from:
        return 1.0
    progress = min(1.0, (step - decay_from + 1) / max(1, total_steps - decay_from))
    return 1.0 - (1.0 - min_ratio) * progress


def warmup_steps_for(config: OptimizerSettings, total_steps: int) -> int:
    return int(round(config.warmup_ratio * total_steps))


def build_optimizer(params: Iterable[nn.Parameter], config: OptimizerSettings,
                    device: torch.device) -> torch.optim.AdamW:
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the drafter has no trainable parameters")
    # The fused kernel is the fastest on CUDA; CPU uses the foreach implementation.
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        trainable,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        fused=fused,
        foreach=None if fused else True,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerSettings, total_steps: int,
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = warmup_steps_for(config, total_steps)
    if config.lr_schedule == "wsd":
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_stable_decay(step, warmup, total_steps, config.min_lr_ratio,
                                                        config.decay_ratio))
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup, total_steps, config.min_lr_ratio)
    )


def clip_gradients(params: Iterable[nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm (over all ranks for sharded parameters); returns the norm before."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else float("inf"))
    full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
    return float(full() if full is not None else norm)


def autocast(config: OptimizerSettings, device: torch.device) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast for the forward pass, or nothing for fp32 training."""
    if config.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def target_dtype(config: OptimizerSettings, device: torch.device) -> torch.dtype:
    if config.target_dtype == "bf16" or (config.target_dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32
