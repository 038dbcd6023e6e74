"""One optimizer step: every micro-batch's forward and backward on this rank, then one update of the drafter.

One optimizer step consumes `rows_per_step` packed rows over all ranks (see `data`); rank r runs its micro-batches
one after the other and gradients accumulate (reduced across ranks on the last one). Each micro-batch
backpropagates its loss's numerator (the weighted sum over its trained tokens); once all have run, the weights are
summed over the ranks and the gradients divided by that total, so the update is the weighted mean over every
trained token of the step, whatever the micro-batch split or world size: a micro-batch with few trained tokens
weighs what its tokens weigh, not as much as a full one. Anchor sampling and feature noise draw from a generator
seeded by (seed, step, micro-batch), never from a global RNG: a resumed run, or one with another world size, draws
exactly what the uninterrupted run would have.

What the step did comes back as `StepStats`, the counts the logging window sums (`training.metrics`): detached
tensors where the device computed them, so a step never waits for the device to report.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from dflash_train.data.loader import StepBatches
from dflash_train.drafter.config import DrafterConfig
from dflash_train.parallel.distributed import DistEnv
from dflash_train.parallel.placement import accumulate
from dflash_train.sections import TrainingRecipe, TrainingRuntime
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.optim import clip_gradients
from dflash_train.training.precision import autocast
from dflash_train.training.step import dflash_step


@dataclass(frozen=True)
class StepParts:
    """What every step of a run works with: the (wrapped) drafter and its optimiser, the frozen target, the drafter's
    shape, the recipe and runtime sections, this rank's place, and the run's seed."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    target: FrozenTarget
    drafter: DrafterConfig
    recipe: TrainingRecipe
    runtime: TrainingRuntime
    env: DistEnv
    seed: int


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did on this rank: the loss's numerator (detached) and denominator, the trained and
    input tokens, the trained labels checked against the target's own token and those that agreed, the per-slot
    correct and counted [block]; the learning rate it ran at and the gradient norm before clipping."""

    loss_sum: torch.Tensor
    weight: float
    label_tokens: int
    input_tokens: int
    agreed: int
    checked: int
    correct: torch.Tensor
    counted: torch.Tensor
    lr: float
    grad_norm: float


def micro_seed(seed: int, step: int, micro: int) -> int:
    """Seed of the anchor/noise generator of one micro-batch: independent of rank and world size."""
    digest = hashlib.sha256(f"{seed}:{step}:{micro}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def optimizer_step(parts: StepParts, scheduler: torch.optim.lr_scheduler.LRScheduler, item: StepBatches,
                   step: int) -> StepStats:
    """Run this rank's micro-batches of `item` (step `step`, 0-based) and update the drafter once (module
    docstring); the scheduler advances by one."""
    model, env, device = parts.model, parts.env, parts.env.device
    model.train()
    measure = parts.recipe.agreement_due(step)
    count = len(item.micro)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros(parts.drafter.block_size, dtype=torch.float64, device=device)
    counted = torch.zeros_like(correct)
    weight, label_tokens, input_tokens, agreed, checked = 0.0, 0, 0, 0, 0
    for i, (micro_id, cpu_batch) in enumerate(zip(item.micro_ids, item.micro, strict=True)):
        batch = cpu_batch.to(device, non_blocking=True)
        generator = torch.Generator(device=device).manual_seed(micro_seed(parts.seed, step, micro_id))
        with accumulate(model, sync=i == count - 1):
            with autocast(parts.runtime, device):
                out = dflash_step(model, parts.target, batch, parts.drafter,  # type: ignore[arg-type]
                                  parts.recipe, parts.runtime, generator, noise=True, measure_agreement=measure)
            assert out.loss_sum is not None
            out.loss_sum.backward()
        loss_sum += out.loss_sum.detach().double()
        weight += out.weight_sum
        label_tokens += out.tokens
        input_tokens += int((cpu_batch.document_ids >= 0).sum())
        if out.agreed >= 0:
            agreed, checked = agreed + out.agreed, checked + out.tokens
        correct += out.correct.double()
        counted += out.counted.double()
    # The reduction averaged the gradients over the ranks: times world size over the step's total weight is the
    # weighted mean over every trained token of the step (module docstring).
    total = float(env.all_reduce_sum(torch.tensor([weight], dtype=torch.float64, device=device)).item())
    if total > 0:
        for p in model.parameters():
            if p.grad is not None:  # DTensor gradients under FSDP2 included
                p.grad.mul_(env.world_size / total)
    grad_norm = clip_gradients(model.parameters(), parts.recipe.grad_clip)
    lr = float(scheduler.get_last_lr()[0])
    parts.optimizer.step()
    scheduler.step()
    parts.optimizer.zero_grad(set_to_none=True)
    return StepStats(loss_sum, weight, label_tokens, input_tokens, agreed, checked, correct, counted, lr, grad_norm)
