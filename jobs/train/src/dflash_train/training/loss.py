"""DFlash block loss: labels, objectives, position weights and a chunked LM-head loss.

Labels have NO shift: slot k of the block anchored at p predicts the token at p + k (slot 0 holds the anchor
token itself and is never trained). A slot counts when its block is kept, p + k < S, k > 0, the token at p + k
is loss-masked and belongs to the anchor's document. What it is trained towards is the objective's:
- `data_ce`: cross-entropy on the data token input_ids[p + k] (SpecForge, the paper);
- `target_argmax_ce`: cross-entropy on the trainer target's own greedy token after p + k - 1 (speculators' `ce`);
- `target_kl`: KL(target || drafter) to the target's whole distribution after p + k - 1 (speculators' default,
  ModelOpt's self-logit distillation).
The position weight of slot k is the exponential decay d_k = exp(-(k - 1) / gamma) (early slots matter most:
a draft is accepted only up to its first wrong token), or D-PACE (speculators' definition, `dpace_weights`).

The loss is a weighted mean: sum(loss_t * w_t) / sum(w_t). `dflash_loss` returns the numerator and the
denominator separately so that the trainer can normalise over every trained token of an optimizer step
(all micro-batches, all ranks) instead of averaging per-micro-batch means, which would weigh a micro-batch
with few trained tokens as much as a full one (SpecForge's #731 made the same change).

The LM head is the target's, with a 150k-250k vocabulary: logits of all block tokens at once would not
fit, so `linear_token_loss` walks the tokens in chunks and never keeps more than one chunk of logits (two
under `target_kl`: the drafter's and the target's). It computes each token's gradient with respect to its
hidden state during the forward pass (one extra matmul per chunk instead of re-running the chunk in
backward), and scales it by that token's upstream gradient in backward; position weights that depend on the
loss itself (D-PACE) are applied afterwards, as they are constants of the gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dflash_train.training.memory_plan import DEFAULT_LOGITS_BYTES  # 1 GiB: ~1,700 tokens of a 152k vocabulary

Objective = Literal["data_ce", "target_argmax_ce", "target_kl"]
Weighting = Literal["exp_decay", "dpace"]
OBJECTIVES: tuple[str, ...] = ("data_ce", "target_argmax_ce", "target_kl")


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


def dpace_weights(token_loss: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [..., block] (speculators' `dpace_loss_decay`), from per-slot CE and the mask.

    q_k = exp(-CE_k) is the drafter's confidence in slot k's label; smoothed s_k = (1 - alpha) q_k + alpha (1 where
    the slot is not trained); the weight of slot k is the expected number of accepted slots from k on, if slot k
    is reached: mask_k * sum_{j >= k} mask_j prod_{i <= j} s_i. A slot that later slots depend on weighs more, and
    the weights follow what the drafter already gets right, instead of a fixed decay. No gradient flows through
    them.
    """
    with torch.no_grad():
        m = mask.to(torch.float32)
        smooth = torch.where(mask, (1.0 - alpha) * torch.exp(-token_loss.float()) + alpha, torch.ones_like(m))
        prefix = torch.cumprod(smooth, dim=-1) * m
        return torch.flip(torch.cumsum(torch.flip(prefix, dims=[-1]), dim=-1), dims=[-1]) * m


class _LinearTokenLoss(torch.autograd.Function):
    """Per-token loss_t of hidden[t] @ weight.T, chunked: CE to labels[t], or KL(softmax(soft[t] @ weight.T) ||
    drafter) when `soft` rows (the target's own final hidden states) are given."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        soft: torch.Tensor | None,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        need_h = ctx.needs_input_grad[0]
        tokens = hidden.shape[0]
        # Softmax statistics in float32 at least (float64 inputs, as in gradient checks, stay float64).
        stats = torch.promote_types(weight.dtype, torch.float32)
        token_loss = torch.empty(tokens, dtype=stats, device=hidden.device)
        pred = torch.empty(tokens, dtype=torch.long, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        # The matmuls and the logits stay in the LM head's dtype (bf16 on GPU); sums and the loss in float32.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            for start in range(0, tokens, chunk):
                end = min(start + chunk, tokens)
                h = hidden[start:end].to(weight.dtype)
                grad, scale, token_loss[start:end], pred[start:end] = _chunk_loss(
                    h, weight, labels[start:end], None if soft is None else soft[start:end], stats)
                if grad_h is not None:
                    # d loss_t / d logits = (softmax - label distribution), normalised after the matmul, on [T, H].
                    grad_h[start:end] = ((grad @ weight).to(stats) / scale.unsqueeze(1)).to(hidden.dtype)
                del grad
        ctx.mark_non_differentiable(pred)
        ctx.save_for_backward(hidden, weight, labels, *(() if soft is None else (soft,)),
                              *(() if grad_h is None else (grad_h,)))
        ctx.soft, ctx.has_h, ctx.chunk = soft is not None, grad_h is not None, chunk
        return token_loss, pred

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, grad_pred: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        del grad_pred
        saved = list(ctx.saved_tensors)
        hidden, weight, labels = saved[:3]
        soft = saved[3] if ctx.soft else None
        grad_h = grad_w = None
        if ctx.has_h:
            g = saved[-1]
            grad_h = g * grad_loss.to(g.dtype).unsqueeze(1)
        if ctx.needs_input_grad[1]:
            # The LM head is frozen in training; its gradient (tests, other heads) is recomputed chunk by chunk.
            stats = torch.promote_types(weight.dtype, torch.float32)
            acc = torch.zeros(weight.shape, dtype=stats, device=weight.device)
            for start in range(0, hidden.shape[0], ctx.chunk):
                end = min(start + ctx.chunk, hidden.shape[0])
                h = hidden[start:end].to(weight.dtype)
                grad, scale = _chunk_loss(h, weight, labels[start:end], None if soft is None else soft[start:end],
                                          stats)[:2]
                grad.mul_((grad_loss[start:end].to(stats) / scale).to(grad.dtype).unsqueeze(1))
                acc += (grad.t() @ h).to(stats)
                if soft is not None:  # the target's side of KL depends on the head too
                    acc += _soft_side_grad(soft[start:end], weight, h, grad_loss[start:end], stats)
            grad_w = acc.to(weight.dtype)
        return grad_h, grad_w, None, None, None


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, soft: torch.Tensor | None,
                stats: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale * d loss / d logits [T, V], scale [T], loss [T], argmax [T]) of one chunk.

    One buffer of logits in the head's dtype, worked on in place: its max, then exp(logits - max), whose row sums
    (row_sum, in `stats`) give the loss. The buffer is not normalised: the label distribution times row_sum is
    subtracted in `stats` (at the label: exact where the drafter is confident), and the caller divides by
    scale = row_sum after its matmul, on [T, H]. That is four passes over a bf16 buffer, where a float32 copy took
    six and two conversions (a bf16 step 2.0x faster on CPU: docs/benchmarks.md)."""
    logits = h @ weight.t()
    row_max, pred = logits.max(dim=-1)
    if soft is None:
        label_logit = logits.gather(1, labels.unsqueeze(1)).squeeze(1).to(stats)
    else:
        target = torch.log_softmax((soft.to(weight.dtype) @ weight.t()).to(stats), dim=-1)
        p = target.exp()
        # KL(p || q) = sum p log p - sum p logits + lse(logits)
        label_logit = (p * logits.to(stats)).sum(-1) - (p * target).sum(-1)
        del target
    exp = logits.sub_(row_max.unsqueeze(1)).exp_()
    rows = torch.arange(h.shape[0], device=h.device)
    if exp.dtype == stats:
        row_sum = exp.sum(dim=-1)
    else:
        # A reduced-precision sum accumulates in float32 but is rounded once, to 8 bits: near 1 (a confident
        # drafter) that is a step of 2^-7, as large as the gradient at the label. The argmax's term is exactly
        # exp(0) = 1, so it is left out of the rounded sum and added in `stats`: the rounding then falls on the
        # rest only. (Upcasting the buffer instead would cost a float32 copy of it.)
        exp[rows, pred] = 0
        row_sum = exp.sum(dim=-1).to(stats) + 1
        exp[rows, pred] = 1
    loss = row_max.to(stats) + row_sum.log() - label_logit
    if soft is None:
        exp[rows, labels] = (exp[rows, labels].to(stats) - row_sum).to(exp.dtype)
    else:
        exp.sub_((p * row_sum.unsqueeze(1)).to(exp.dtype))
    return exp, row_sum, loss, pred


def _soft_side_grad(soft: torch.Tensor, weight: torch.Tensor, h: torch.Tensor, grad_loss: torch.Tensor,
                    stats: torch.dtype) -> torch.Tensor:
    """d KL / d weight through the target's logits soft @ weight.T (only for a head that is not frozen)."""
    with torch.enable_grad():
        w = weight.detach().to(stats).requires_grad_(True)
        logp = torch.log_softmax(soft.to(stats) @ w.t(), dim=-1)
        q_logits = h.to(stats) @ w.t().detach()
        kl = (logp.exp() * (logp - q_logits)).sum(-1)
        (grad,) = torch.autograd.grad((kl * grad_loss.to(stats)).sum(), w)
    return grad


def linear_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    soft: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss of an LM head without materialising all logits: (loss [T] of at least float32, argmax [T]).

    hidden [T, H], weight [V, H], labels [T]; with `soft` [T, H] (hidden states whose logits through the same
    head are the label distribution) the loss is KL(softmax(soft @ weight.T) || softmax(hidden @ weight.T)) and
    `labels` only names the hard label the accuracy is measured against. `chunk_tokens` defaults to a 1 GiB
    float32 logits budget (half that for soft labels). Differentiable with respect to hidden and weight.
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and LM head weight {tuple(weight.shape)} do not fit")
    if soft is not None and soft.shape != hidden.shape:
        raise ValueError(f"soft label rows {tuple(soft.shape)} do not match hidden {tuple(hidden.shape)}")
    if chunk_tokens is None:
        chunk_tokens = max(1, DEFAULT_LOGITS_BYTES // (4 * weight.shape[0] * (1 if soft is None else 2)))
    return _LinearTokenLoss.apply(hidden, weight, labels, None if soft is None else soft.detach(), int(chunk_tokens))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weight: torch.Tensor,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_t token_weight[t] * CE(hidden[t] @ weight.T, labels[t]), chunked, and the argmax prediction [T]."""
    token_loss, pred = linear_token_loss(hidden, weight, labels, None, chunk_tokens)
    return (token_loss * token_weight.detach().to(token_loss.dtype)).sum(), pred


@torch.no_grad()
def chunked_argmax(hidden: torch.Tensor, weight: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """argmax(hidden @ weight.T) [T] for hidden [T, H], one chunk of logits at a time."""
    if chunk_tokens is None:
        chunk_tokens = max(1, DEFAULT_LOGITS_BYTES // (4 * weight.shape[0]))
    out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, hidden.shape[0])
            out[start:end] = (hidden[start:end].to(weight.dtype) @ weight.t()).argmax(dim=-1)
    return out


@dataclass(frozen=True)
class LossOutput:
    """Loss of one micro-batch plus per-slot accuracy counts (index k = block slot; slot 0 always 0).

    `loss` is the weighted mean (differentiable); `loss_sum` and `weight_sum` are its numerator (differentiable)
    and denominator, which a trainer sums over a step before dividing."""

    loss: torch.Tensor
    correct: torch.Tensor
    counted: torch.Tensor
    loss_sum: torch.Tensor | None = None
    weight_sum: float = 0.0
    hits: torch.Tensor | None = None  # [B, N, block] bool: trained slots whose argmax is the label


def target_next_tokens(final_hidden: torch.Tensor, lm_head: torch.Tensor, wanted: torch.Tensor,
                       chunk_tokens: int | None = None) -> torch.Tensor:
    """[B, S] long: the target's greedy next token after each position where `wanted` [B, S] is set, else -1."""
    out = torch.full(wanted.shape, -1, dtype=torch.long, device=wanted.device)
    where = wanted.nonzero(as_tuple=True)
    if where[0].numel():
        out[where] = chunked_argmax(final_hidden[where], lm_head, chunk_tokens)
    return out


def block_target_labels(final_hidden: torch.Tensor, lm_head: torch.Tensor, loss_mask: torch.Tensor,
                        document_ids: torch.Tensor, anchor_pos: torch.Tensor, block_size: int,
                        chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own labels of the blocks anchored at `anchor_pos` [B, N], beside `block_targets`' data labels:
    ([B, N, block] the target's greedy token after p + k - 1, -1 where no trained label follows; [B, N, block] the
    flat positions p + k - 1 they are predicted from, clamped into the row)."""
    rows, seq = loss_mask.shape
    # Positions t whose next token is a trained label: t + 1 loss-masked and in t's document.
    wanted = torch.zeros_like(loss_mask, dtype=torch.bool)
    wanted[:, :-1] = loss_mask[:, 1:].bool() & (document_ids[:, 1:] == document_ids[:, :-1])
    next_tokens = target_next_tokens(final_hidden, lm_head, wanted, chunk_tokens)
    k = torch.arange(block_size, device=anchor_pos.device)
    where = (anchor_pos.unsqueeze(-1) + k - 1).clamp(0, seq - 1)
    return next_tokens.gather(1, where.view(rows, -1)).view_as(where), where


def dflash_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    gamma: float | None,
    chunk_tokens: int | None = None,
    soft: torch.Tensor | None = None,
    weighting: Weighting = "exp_decay",
    dpace_alpha: float = 0.5,
) -> LossOutput:
    """Weighted block loss. hidden [B, N*block, H]; labels/weight [B, N, block]; soft [B, N, block, H] (target
    hidden states for `target_kl`, None for the CE objectives). See the module docstring."""
    rows, n_anchors, block = labels.shape
    if hidden.shape[:2] != (rows, n_anchors * block):
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match {n_anchors} blocks of {block} x {rows} rows")
    slot = torch.arange(block, device=labels.device).expand(rows, n_anchors, block)
    take = weight.reshape(-1).nonzero().squeeze(-1)
    slot_taken = slot.reshape(-1)[take]
    counted = torch.bincount(slot_taken, minlength=block)
    if take.numel() == 0:
        zero = hidden.sum() * 0.0  # keeps the graph, so backward still runs on every rank
        return LossOutput(zero.float(), torch.zeros_like(counted), counted, zero.float(), 0.0,
                          torch.zeros_like(weight, dtype=torch.bool))
    h = hidden.reshape(rows * n_anchors * block, -1).index_select(0, take)
    lab = labels.reshape(-1)[take]
    soft_rows = None if soft is None else soft.reshape(-1, soft.shape[-1]).index_select(0, take)
    token_loss, pred = linear_token_loss(h, lm_head_weight, lab, soft_rows, chunk_tokens)
    if weighting == "dpace":
        grid = torch.zeros(rows * n_anchors * block, dtype=token_loss.dtype, device=token_loss.device)
        grid[take] = token_loss.detach()
        token_weight = dpace_weights(grid.view(-1, block), weight.reshape(-1, block), dpace_alpha).reshape(-1)[take]
    else:
        if gamma is None:
            raise ValueError("exp_decay position weights need a gamma")
        token_weight = position_decay(block, gamma, labels.device)[slot_taken]
    token_weight = token_weight.to(token_loss.dtype)
    loss_sum = (token_loss * token_weight).sum()
    weight_sum = float(token_weight.sum())
    right = pred == lab
    correct = torch.bincount(slot_taken, weights=right.float(), minlength=block).long()
    hits = torch.zeros(weight.numel(), dtype=torch.bool, device=weight.device)
    hits[take] = right
    return LossOutput(loss_sum / weight_sum, correct, counted, loss_sum, weight_sum, hits.view_as(weight))


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
