"""Anchor sampling: which positions start a drafted block in a training step.

A position p is a valid anchor when p and p+1 are both loss-masked tokens of the same document (so the
block has at least one trained slot) and p < S-1. Up to `num_anchors` anchors are drawn per DOCUMENT,
uniformly without replacement: a packed row of several short documents then gets as many blocks per
document as an unpacked row would, instead of the short ones being crowded out by one long neighbour.
The anchors of a row are sorted ascending; rows with fewer anchors than the widest row are padded with
keep=False (position 0).
"""

from __future__ import annotations

import torch

from dflash_train.batch import PAD_DOCUMENT

# Query tiles of flex attention are 128 tokens; N * block_size is rounded up to a multiple of this so the
# number of query tokens is tile-aligned (and varies less from step to step, for torch.compile).
QUERY_TILE = 128


def valid_anchor_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: positions that may start a block (see the module docstring)."""
    lm = loss_mask.bool()
    doc = document_ids
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:] & (doc[:, :-1] == doc[:, 1:]) & (doc[:, :-1] != PAD_DOCUMENT)
    return valid


def anchor_count_multiple(block_size: int) -> int:
    """N is padded to a multiple of this, so that N * block_size fills whole query tiles where it can."""
    return max(1, QUERY_TILE // block_size) if QUERY_TILE % block_size == 0 else 1


def sample_anchors(
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
    pad_to: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample block anchors. Returns (anchor_pos [B, N] long, keep [B, N] bool) on loss_mask's device.

    Sampling runs on the generator's device (CPU when no generator is given), so a CPU generator gives
    the same anchors whatever device the batch is on. N is the largest per-row count, at least `pad_to`,
    rounded up to `anchor_count_multiple(block_size)`.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if loss_mask.shape != document_ids.shape or loss_mask.ndim != 2:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} and document_ids {tuple(document_ids.shape)} differ")
    out_device = loss_mask.device
    device = generator.device if generator is not None else torch.device("cpu")
    valid = valid_anchor_mask(loss_mask.to(device), document_ids.to(device))
    doc = document_ids.to(device=device, dtype=torch.long)
    rows, seq = valid.shape
    idx = torch.arange(seq, device=device).expand(rows, seq)

    # Group positions by document (invalid ones last) in a random order inside each group: a random
    # permutation, then a stable sort by document keeps the random order within a document.
    no_doc = seq + 1
    doc_key = torch.where(valid, doc, torch.full_like(doc, no_doc))
    perm = torch.argsort(torch.rand(rows, seq, generator=generator, device=device), dim=1)
    by_doc = torch.argsort(doc_key.gather(1, perm), dim=1, stable=True)
    order = perm.gather(1, by_doc)
    sorted_doc = doc_key.gather(1, order)
    # Rank inside the document group = index minus the index where the group starts.
    starts = torch.ones_like(valid)
    starts[:, 1:] = sorted_doc[:, 1:] != sorted_doc[:, :-1]
    group_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    take_sorted = ((idx - group_start) < num_anchors) & (sorted_doc != no_doc)
    chosen = torch.zeros_like(valid).scatter(1, order, take_sorted)

    count = int(chosen.sum(dim=1).max()) if rows else 0
    n = max(count, pad_to or 0, 1)
    multiple = anchor_count_multiple(block_size)
    n = -(-n // multiple) * multiple
    # Chosen positions first, in ascending order; unchosen ones pushed past S.
    ranked = torch.sort(torch.where(chosen, idx, idx + seq), dim=1).values
    if n > seq:
        ranked = torch.cat([ranked, torch.full((rows, n - seq), 2 * seq, device=device)], dim=1)
    ranked = ranked[:, :n]
    keep = ranked < seq
    anchor_pos = torch.where(keep, ranked, torch.zeros_like(ranked))
    return anchor_pos.to(out_device), keep.to(out_device)
