"""DFlash block loss: labels, weights, position decay and a chunked LM-head cross-entropy.

Labels have NO shift: slot k of the block anchored at p predicts input_ids[p + k] (slot 0 holds the
anchor token itself and is never trained). A slot counts (weight 1) when its block is kept, p + k < S,
k > 0, input_ids[p + k] is loss-masked and belongs to the anchor's document. The loss is
sum(CE * w * d) / sum(w * d) with decay d_k = exp(-(k - 1) / gamma): early slots matter most, because a
draft is accepted only up to its first wrong token.

The LM head is the target's, with a 150k-250k vocabulary: logits of all block tokens at once would not
fit, so `linear_cross_entropy` walks the tokens in chunks and never keeps more than one chunk of logits.
It computes the gradient with respect to the hidden states during the forward pass (one extra matmul per
chunk instead of re-running the chunk in backward) and hands it out, scaled, in backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Budget of float32 logits held at once; 1 GiB is ~1,700 tokens of a 152k vocabulary.
DEFAULT_LOGITS_BYTES = 1 << 30


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    anchor_pos: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [B, N, block] long, weight [B, N, block] bool) for anchors [B, N] (see module docstring)."""
    rows, n_anchors = anchor_pos.shape
    seq = input_ids.shape[1]
    k = torch.arange(block_size, device=anchor_pos.device)
    pos = anchor_pos.unsqueeze(-1) + k
    in_range = pos < seq
    flat = pos.clamp(max=seq - 1).view(rows, -1)
    labels = input_ids.gather(1, flat).view(rows, n_anchors, block_size)
    masked = loss_mask.bool().gather(1, flat).view(rows, n_anchors, block_size)
    anchor_doc = document_ids.gather(1, anchor_pos).unsqueeze(-1)
    same_doc = document_ids.gather(1, flat).view(rows, n_anchors, block_size) == anchor_doc
    weight = keep.bool().unsqueeze(-1) & in_range & (k > 0) & masked & same_doc
    return labels, weight


def position_decay(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """[block] float32: d_k = exp(-(k - 1) / gamma) for k >= 1; slot 0 gets 0 (never trained)."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    decay = torch.exp(-(k - 1) / gamma)
    decay[0] = 0.0
    return decay


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_t token_weight[t] * CE(hidden[t] @ weight.T, labels[t]), chunked over tokens."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        token_weight: torch.Tensor,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        tokens = hidden.shape[0]
        # Softmax statistics in float32 at least (float64 inputs, as in gradient checks, stay float64).
        stats = torch.promote_types(weight.dtype, torch.float32)
        total = torch.zeros((), dtype=stats, device=hidden.device)
        pred = torch.empty(tokens, dtype=torch.long, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=stats, device=weight.device) if need_w else None
        # The matmuls run in the LM head's dtype (bf16 on GPU); softmax statistics in float32.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, tokens, chunk):
                end = min(start + chunk, tokens)
                h = hidden[start:end].to(weight.dtype)
                logits = (h @ weight.t()).to(stats)
                lab = labels[start:end]
                tw = token_weight[start:end].to(stats)
                target_logit = logits.gather(1, lab.unsqueeze(1)).squeeze(1)
                # One pass gives the max (for a stable softmax) and the prediction; the rest works in place
                # on the logits buffer: exp(logits - max), its row sums, then the softmax gradient.
                row_max, pred[start:end] = logits.max(dim=-1)
                probs = logits.sub_(row_max.unsqueeze(1)).exp_()
                row_sum = probs.sum(dim=-1)
                lse = row_max + row_sum.log()
                total += (tw * (lse - target_logit)).sum()
                if need_h or need_w:
                    # d/dlogits of w * CE = w * (softmax - onehot).
                    grad = probs.mul_((tw / row_sum).unsqueeze(1))
                    grad[torch.arange(end - start, device=grad.device), lab] -= tw
                    grad = grad.to(weight.dtype)
                    if grad_h is not None:
                        grad_h[start:end] = (grad @ weight).to(hidden.dtype)
                    if grad_w is not None:
                        grad_w += (grad.t() @ h).to(stats)
                    # Drop the chunk's gradient before the next chunk's logits exist: on an fp32 head `grad` IS
                    # the logits buffer, and holding it would double the loop's peak (two chunks, not one).
                    del grad
                del logits, probs
        ctx.mark_non_differentiable(pred)
        ctx.save_for_backward(*(g for g in (grad_h, grad_w) if g is not None))
        ctx.has = (grad_h is not None, grad_w is not None)
        ctx.weight_dtype = weight.dtype
        return total, pred

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, grad_pred: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        del grad_pred
        saved = list(ctx.saved_tensors)
        has_h, has_w = ctx.has
        grad_h = grad_w = None
        if has_h:
            g = saved.pop(0)
            grad_h = g * grad_total.to(g.dtype)
        if has_w:
            grad_w = (saved.pop(0) * grad_total).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weight: torch.Tensor,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted CE of an LM head without materialising all logits.

    hidden [T, H], weight [V, H], labels [T], token_weight [T]. Returns (sum_t w_t * CE_t as a scalar of at
    least float32, argmax prediction [T]). `chunk_tokens` defaults to a 1 GiB float32 logits budget.
    Differentiable with respect to hidden and weight (call backward at most once).
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and LM head weight {tuple(weight.shape)} do not fit")
    if chunk_tokens is None:
        chunk_tokens = max(1, DEFAULT_LOGITS_BYTES // (4 * weight.shape[0]))
    return _LinearCrossEntropy.apply(hidden, weight, labels, token_weight.detach(), int(chunk_tokens))


@dataclass(frozen=True)
class LossOutput:
    """Loss of one step plus per-slot accuracy counts (index k = block slot; slot 0 always 0)."""

    loss: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor


def dflash_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    gamma: float,
    chunk_tokens: int | None = None,
) -> LossOutput:
    """Decayed, normalised block CE. hidden [B, N*block, H]; labels/weight [B, N, block]."""
    rows, n_anchors, block = labels.shape
    if hidden.shape[:2] != (rows, n_anchors * block):
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match {n_anchors} blocks of {block} x {rows} rows")
    slot = torch.arange(block, device=labels.device).expand(rows, n_anchors, block)
    take = weight.reshape(-1).nonzero().squeeze(-1)
    slot_taken = slot.reshape(-1)[take]
    counted = torch.bincount(slot_taken, minlength=block)
    if take.numel() == 0:
        zero = hidden.sum() * 0.0  # keeps the graph, so backward still runs on every rank
        return LossOutput(zero.float(), torch.zeros_like(counted), counted)
    decay = position_decay(block, gamma, labels.device)[slot_taken]
    token_weight = decay / decay.sum()
    h = hidden.reshape(rows * n_anchors * block, -1).index_select(0, take)
    lab = labels.reshape(-1)[take]
    loss, pred = linear_cross_entropy(h, lm_head_weight, lab, token_weight, chunk_tokens)
    correct = torch.bincount(slot_taken, weights=(pred == lab).float(), minlength=block).long()
    return LossOutput(loss, correct, counted)


def per_position_accuracy(
    correct: torch.Tensor | Sequence[float], counted: torch.Tensor | Sequence[float]
) -> list[float]:
    """Accuracy of slots 1..block-1 (slot 0 is the given anchor); 0 where nothing was counted."""
    corr = [float(c) for c in correct]
    cnt = [float(c) for c in counted]
    return [c / n if n > 0 else 0.0 for c, n in zip(corr[1:], cnt[1:], strict=True)]


def expected_acceptance_length(per_pos_acc: Sequence[float]) -> float:
    """tau estimate from slot accuracies acc_1..acc_{B-1}: 1 + sum_k prod_{i<=k} acc_i.

    A draft is accepted up to its first wrong slot, and every verification step also commits the target's
    own bonus token (the 1). Treating slot errors as independent, P(first k slots all right) is the
    product of their accuracies, and the expected accepted count is the sum of those products. The
    training accuracies are measured against data tokens, so this is an estimate, not a served tau.
    """
    tau, run = 1.0, 1.0
    for acc in per_pos_acc:
        if not 0.0 <= acc <= 1.0 or math.isnan(acc):
            raise ValueError(f"accuracy {acc} is not in [0, 1]")
        run *= acc
        tau += run
    return tau
