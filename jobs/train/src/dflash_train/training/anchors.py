"""Anchor sampling: which positions start a drafted block in a training step, and how many blocks a row has.

A position p is a valid anchor when p and p+1 are both loss-masked tokens of the same document (so the
block has at least one trained slot) and p < S-1. Anchors are chosen in two stages:

1. Per DOCUMENT (conversation): up to `num_anchors` per document, uniformly without replacement. This is the
   reference's count: SpecForge draws up to 512 anchors per conversation, one conversation per row, which is
   every valid position of a normal answer. A packed row of several documents then gets as many blocks per
   document as an unpacked row would, instead of the short ones being crowded out by one long neighbour.
2. Per packed ROW: at most `max_anchors_per_row` of those. This cap is a memory bound, not a recipe: a row of
   k documents holds up to k x num_anchors blocks, and the drafter's activations grow with the blocks
   (N x B query tokens). The memory plan predicts the step's peak from it, and the fit check refuses a cap
   that does not fit, naming the largest one that does (`memory_plan.remedy_settings`); on a GPU the target's
   forward dominates a step, so the largest cap that fits is the cheapest learning there is. The cap is
   shared round-robin: every document of the row keeps its first drawn anchor, then its second, and so on,
   until the cap is reached (documents drawn at random within the last round). A short document therefore
   keeps all its anchors unless the row holds more documents than the cap; only the long documents give
   anchors up. Without the cap a row can carry one block per valid position (N x B ~ block_size x S query
   tokens).

The anchors of a row are sorted ascending; rows with fewer anchors than N are padded with keep=False
(position 0), which the mask and the loss ignore.

Stable shapes. The drafter's attention is compiled for fixed shapes (`torch.compile(flex_attention,
dynamic=False)`), so every new query length recompiles it, and past dynamo's recompile limit (torch's default
is 8 per code object; `dflash_train.drafter.attention.raise_recompile_limit` raises it before compiling) flex falls
back to an unfused kernel that materialises the whole score matrix. N is therefore not the exact per-row count
but the smallest rung of a fixed ladder that holds it (`anchor_count_buckets`): m, 2m, 4m, ... (m =
`anchor_count_multiple(block_size)`, which makes N x B a whole number of 128-token query tiles), topped by the
cap rounded up to m. With rows of a fixed length S (the packer pads every row to max_length) and a fixed
number of rows per micro-batch, the drafter's attention sees at most len(ladder) distinct (query, key) lengths
over a whole run: query N x B, key S + N x B, one pair per rung. For block 16 and the 512 cap that is 7 (N in
8, 16, 32, 64, 128, 256, 512); for block 8, 6 (16 ... 512). Full and sliding-window layers share one compiled
kernel per shape (see `dflash_train.drafter.attention`). The price is padding: the rounding can add nearly N/2 padding
blocks (a count of 257 becomes 512); they cost projection and MLP work only, as flex skips their empty
attention blocks and the loss reads only weighted slots. """

from __future__ import annotations

import torch

from dflash_train.data.batch import PAD_DOCUMENT

# The ladder of anchor counts lives where torch-free planning reads it too; its names stay importable from here.
from dflash_train.training.anchor_ladder import (  # noqa: F401
    QUERY_TILE,
    _round_up,
    anchor_count_buckets,
    anchor_count_multiple,
    bucket_anchor_count,
)


def valid_anchor_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: positions that may start a block (see the module docstring)."""
    lm = loss_mask.bool()
    doc = document_ids
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:] & (doc[:, :-1] == doc[:, 1:]) & (doc[:, :-1] != PAD_DOCUMENT)
    return valid


def _rank_within_group(group_key: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """For rows sorted by `group_key`: each entry's index within its run of equal keys."""
    starts = torch.ones_like(group_key, dtype=torch.bool)
    starts[:, 1:] = group_key[:, 1:] != group_key[:, :-1]
    group_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    return idx - group_start


def sample_anchors(
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
    pad_to: int | None = None,
    max_anchors_per_row: int | None = None,
    bucket: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample block anchors. Returns (anchor_pos [B, N] long, keep [B, N] bool) on loss_mask's device.

    Up to `num_anchors` per document, then at most `max_anchors_per_row` per row (None: no row cap),
    as the module docstring says. Sampling runs on the generator's device (CPU when no generator is
    given), so a CPU generator gives the same anchors whatever device the batch is on. N is the largest
    per-row count (at least `pad_to`) put on the ladder of `bucket_anchor_count`; with `bucket=False` it
    is only rounded up to `anchor_count_multiple(block_size)` (the same anchors, less padding: for tests
    and measurements, not for compiled training).
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if max_anchors_per_row is not None and max_anchors_per_row < 1:
        raise ValueError(f"max_anchors_per_row must be >= 1, got {max_anchors_per_row}")
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
    # Rank inside the document = the round in which a round-robin over the row's documents takes it.
    rank = _rank_within_group(sorted_doc, idx)
    take_sorted = (rank < num_anchors) & (sorted_doc != no_doc)
    chosen = torch.zeros_like(valid).scatter(1, order, take_sorted)

    count = int(chosen.sum(dim=1).max()) if rows else 0
    if max_anchors_per_row is not None and count > max_anchors_per_row:
        chosen = _cap_round_robin(rank, take_sorted, order, max_anchors_per_row, generator)
        count = max_anchors_per_row
    wanted = max(count, pad_to or 0, 1)
    if bucket:
        n = bucket_anchor_count(wanted, block_size, max_anchors_per_row)
    else:
        n = _round_up(wanted, anchor_count_multiple(block_size))
    # Chosen positions first, in ascending order; unchosen ones pushed past S.
    ranked = torch.sort(torch.where(chosen, idx, idx + seq), dim=1).values
    if n > seq:
        ranked = torch.cat([ranked, torch.full((rows, n - seq), 2 * seq, device=device)], dim=1)
    ranked = ranked[:, :n]
    keep = ranked < seq
    anchor_pos = torch.where(keep, ranked, torch.zeros_like(ranked))
    return anchor_pos.to(out_device), keep.to(out_device)


def _cap_round_robin(
    rank: torch.Tensor,
    take_sorted: torch.Tensor,
    order: torch.Tensor,
    cap: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Keep at most `cap` of the chosen anchors per row, by round (rank within the document) first.

    `rank` and `take_sorted` ([B, S]) are in the grouped order `order` (see `sample_anchors`); the result
    is a [B, S] mask over positions. Inside one round the documents are ordered at random (a uniform
    tie-break), so when the last round does not fit whole, which documents get one more block is not
    decided by their place in the row.
    """
    rows, seq = take_sorted.shape
    device = take_sorted.device
    tie = torch.rand(rows, seq, generator=generator, device=device, dtype=torch.float64)
    priority = torch.where(take_sorted, rank.to(torch.float64) + tie, torch.full_like(tie, float("inf")))
    by_priority = torch.argsort(priority, dim=1)
    within_cap = torch.zeros_like(take_sorted).scatter(
        1, by_priority, torch.arange(seq, device=device).expand(rows, seq) < cap
    )
    return torch.zeros_like(take_sorted).scatter(1, order, take_sorted & within_cap)
