"""One DFlash training step: target features -> anchors -> drafted blocks -> chunked loss.

`dflash_step` is what the trainer calls per micro-batch (it does not call backward or step an optimizer):

1. target features of the packed batch, without gradients (block-diagonal per document);
2. anchors: up to `num_anchors` per document, at most `max_anchors_per_row` per row, N on a fixed ladder
   of counts so the compiled attention sees few shapes (`sample_anchors`);
3. block inputs [input_ids[p], MASK x (B-1)] embedded with the target's embedding, at positions
   position_ids[p] + k (document positions, as at inference);
4. the drafter pass under the step's block-sparse mask (optionally with uniform noise on the features);
5. the block loss of the recipe's objective and position weights through the target's LM head, in chunks
   (`dflash_train.training.loss`); where the objective reads the target's labels, or on a step that measures the
   label agreement, the target's own greedy token at every trained label's position too. The label agreement is
   the share of trained data labels that are what the trainer's target itself would say there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_train.data.batch import PackedBatch
from dflash_train.drafter.attention import build_drafter_mask, resolve_backend
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.sections import TrainingRecipe, TrainingRuntime
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.anchors import sample_anchors
from dflash_train.training.loss import block_target_labels, block_targets, dflash_loss


@dataclass(frozen=True)
class DraftBlocks:
    """Drafter output of one step: hidden [B, N*block, H], the anchors [B, N] it was built for, and the target's
    final hidden states [B, S, H] where the target keeps them."""

    hidden: torch.Tensor
    anchor_pos: torch.Tensor
    keep: torch.Tensor
    target_final: torch.Tensor | None = None


@dataclass(frozen=True)
class StepOutput:
    """Loss (scalar, differentiable), per-slot correct/counted [block] (long) and trained label count; the loss's
    numerator (differentiable) and denominator, which the trainer sums over a step; the trained labels that
    equal the target's own greedy token (`agreed` of `tokens`; -1 when not measured)."""

    loss: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    tokens: int
    loss_sum: torch.Tensor | None = None
    weight_sum: float = 0.0
    agreed: int = -1
    hits: torch.Tensor | None = None  # [B, N, block] bool: trained slots whose prediction is the label
    trained: torch.Tensor | None = None  # [B, N, block] bool: the trained slots


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
    recipe: TrainingRecipe,
    runtime: TrainingRuntime,
    generator: torch.Generator | None = None,
    noise: bool = False,
) -> DraftBlocks:
    """Steps 1-4 of the module docstring: the drafter's hidden states for freshly sampled anchors (the recipe's
    anchors per document, the runtime's cap per row and attention kernel)."""
    target_pass = target.forward(batch.input_ids, batch.position_ids, batch.document_ids)
    features = target_pass.features
    anchor_pos, keep = sample_anchors(
        batch.loss_mask,
        batch.document_ids,
        recipe.num_anchors,
        cfg.block_size,
        generator,
        max_anchors_per_row=runtime.max_anchors_per_row,
    )
    ids, positions = block_inputs(batch.input_ids, batch.position_ids, anchor_pos, cfg.block_size, cfg.mask_token_id)
    embeds = target.embed(ids)
    if noise and recipe.feature_noise_std > 0:
        features = features + uniform_noise_like(features, recipe.feature_noise_std, generator)
    device = batch.input_ids.device
    param_dtype = drafter.fc.weight.dtype
    if not torch.is_autocast_enabled(device.type):
        # Without autocast the drafter runs in its parameter dtype (e.g. fp32 drafter, bf16 target).
        features, embeds = features.to(param_dtype), embeds.to(param_dtype)
    backend = resolve_backend(runtime.attention_backend, device)
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
    return DraftBlocks(hidden, anchor_pos, keep, target_pass.final_hidden)


def dflash_step(
    drafter: DFlashDrafter,
    target: FrozenTarget,
    batch: PackedBatch,
    cfg: DrafterConfig,
    recipe: TrainingRecipe,
    runtime: TrainingRuntime,
    generator: torch.Generator | None = None,
    noise: bool = False,
    measure_agreement: bool = True,
) -> StepOutput:
    """Forward of one training step; call `.loss.backward()` (or the trainer's step-normalised `.loss_sum`).

    `recipe` gives the anchors per document, the objective, the position weights and whether the label agreement
    is measured; `runtime` the anchors' cap per row, the attention kernel and the LM-head chunks. `generator` drives
    anchor sampling (and the feature noise when on the features' device); `noise` adds uniform noise of std
    recipe.feature_noise_std to the target features (training only). `measure_agreement` False skips the label
    agreement on this step (the trainer measures it every `label_agreement_every` steps) where the objective does not
    read the target's labels anyway.
    """
    chunk_tokens = runtime.chunk_tokens
    blocks = draft_blocks(drafter, target, batch, cfg, recipe, runtime, generator, noise)
    labels, weight = block_targets(
        batch.input_ids, batch.loss_mask, batch.document_ids, blocks.anchor_pos, blocks.keep, cfg.block_size
    )
    agreed, soft = -1, None
    if recipe.objective != "data_ce" or (recipe.label_agreement and measure_agreement):
        if blocks.target_final is None:
            raise ValueError(f"objective {recipe.objective} and the label agreement need the target's output layers: "
                             "load the target with keep_output=True")
        target_labels, where = block_target_labels(blocks.target_final, target.lm_head_weight, batch.loss_mask,
                                                   batch.document_ids, blocks.anchor_pos, cfg.block_size, chunk_tokens)
        agreed = int(((target_labels == labels) & weight).sum())
        if recipe.objective != "data_ce":
            labels = torch.where(weight, target_labels, labels)
        if recipe.objective == "target_kl":
            final = blocks.target_final
            soft = final.gather(1, where.view(final.shape[0], -1, 1).expand(-1, -1, final.shape[-1]))
            soft = soft.view(*labels.shape, final.shape[-1])
    out = dflash_loss(blocks.hidden, target.lm_head_weight, labels, weight, recipe.decay_gamma(cfg.block_size),
                      chunk_tokens, soft=soft, weighting=recipe.position_weighting, dpace_alpha=recipe.dpace_alpha)
    return StepOutput(out.loss, out.correct, out.counted, int(out.counted.sum()), out.loss_sum, out.weight_sum,
                      agreed, out.hits, weight)
