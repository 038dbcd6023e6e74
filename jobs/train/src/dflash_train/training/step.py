"""One DFlash training step: target features -> anchors -> drafted blocks -> chunked loss.

`dflash_step` is what the trainer calls per micro-batch (it does not call backward or step an optimizer):

1. target features of the packed batch, without gradients (block-diagonal per document);
2. anchors: up to `num_anchors` per document, at most `max_anchors_per_row` per row, N on a fixed ladder
   of counts so the compiled attention sees few shapes (`sample_anchors`);
3. block inputs [input_ids[p], MASK x (B-1)] embedded with the target's embedding, at positions
   position_ids[p] + k (document positions, as at inference);
4. the drafter pass under the step's block-sparse mask (optionally with uniform noise on the features);
5. the decayed block CE through the target's LM head, in chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_train.data.batch import PackedBatch
from dflash_train.drafter.attention import build_drafter_mask, resolve_backend
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.anchors import sample_anchors
from dflash_train.training.loss import block_targets, dflash_loss


@dataclass(frozen=True)
class DraftBlocks:
    """Drafter output of one step: hidden [B, N*block, H] and the anchors [B, N] it was built for."""

    hidden: torch.Tensor
    anchor_pos: torch.Tensor
    keep: torch.Tensor


@dataclass(frozen=True)
class StepOutput:
    """Loss (scalar, differentiable), per-slot correct/counted [block] (long) and trained label count."""

    loss: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    tokens: int


def block_inputs(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    anchor_pos: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block token ids, block positions), both [B, N*block]: [anchor, MASK...] at position_ids[p] + k."""
    rows, n_anchors = anchor_pos.shape
    ids = torch.full((rows, n_anchors, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchor_pos)
    k = torch.arange(block_size, device=anchor_pos.device)
    positions = position_ids.gather(1, anchor_pos).unsqueeze(-1) + k
    return ids.view(rows, -1), positions.view(rows, -1)


def uniform_noise_like(x: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Zero-mean uniform noise with standard deviation `std` (U(-a, a) has std a / sqrt(3))."""
    if generator is not None and generator.device != x.device:
        generator = None  # drawing on another device and copying would cost more than it is worth
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    return ((u * 2.0 - 1.0) * (std * math.sqrt(3.0))).to(x.dtype)


def draft_blocks(
    drafter: DFlashDrafter,
    target: FrozenTarget,
    batch: PackedBatch,
    cfg: DrafterConfig,
    generator: torch.Generator | None = None,
    noise: bool = False,
) -> DraftBlocks:
    """Steps 1-4 of the module docstring: the drafter's hidden states for freshly sampled anchors."""
    features = target.features(batch.input_ids, batch.position_ids, batch.document_ids)
    anchor_pos, keep = sample_anchors(
        batch.loss_mask,
        batch.document_ids,
        cfg.num_anchors,
        cfg.block_size,
        generator,
        max_anchors_per_row=cfg.max_anchors_per_row,
    )
    ids, positions = block_inputs(batch.input_ids, batch.position_ids, anchor_pos, cfg.block_size, cfg.mask_token_id)
    embeds = target.embed(ids)
    if noise and cfg.feature_noise_std > 0:
        features = features + uniform_noise_like(features, cfg.feature_noise_std, generator)
    device = batch.input_ids.device
    param_dtype = drafter.fc.weight.dtype
    if not torch.is_autocast_enabled(device.type):
        # Without autocast the drafter runs in its parameter dtype (e.g. fp32 drafter, bf16 target).
        features, embeds = features.to(param_dtype), embeds.to(param_dtype)
    backend = resolve_backend(cfg.attention_backend, device)
    mask = build_drafter_mask(
        anchor_pos,
        keep,
        batch.document_ids,
        cfg.block_size,
        cfg.layer_types,
        cfg.sliding_window,
        backend,
    )
    hidden = drafter(embeds, positions, features, batch.position_ids, mask)
    return DraftBlocks(hidden, anchor_pos, keep)


def dflash_step(
    drafter: DFlashDrafter,
    target: FrozenTarget,
    batch: PackedBatch,
    cfg: DrafterConfig,
    generator: torch.Generator | None = None,
    noise: bool = False,
    chunk_tokens: int | None = None,
) -> StepOutput:
    """Forward of one training step; call `.loss.backward()` on the result.

    `generator` drives anchor sampling (and the feature noise when on the features' device); `noise`
    adds uniform noise of std cfg.feature_noise_std to the target features (training only).
    """
    blocks = draft_blocks(drafter, target, batch, cfg, generator, noise)
    labels, weight = block_targets(
        batch.input_ids, batch.loss_mask, batch.document_ids, blocks.anchor_pos, blocks.keep, cfg.block_size
    )
    out = dflash_loss(blocks.hidden, target.lm_head_weight, labels, weight, cfg.loss_decay_gamma, chunk_tokens)
    return StepOutput(out.loss, out.correct, out.counted, int(out.counted.sum()))
