"""Stable drafter shapes: anchor counts on the ladder over a run of varied batches; padding changes no loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_train.data.batch import pack_row, stack_rows
from dflash_train.drafter.attention import build_drafter_mask
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.anchors import (
    anchor_count_buckets,
    anchor_count_multiple,
    bucket_anchor_count,
    sample_anchors,
)
from dflash_train.training.loss import block_targets, dflash_loss
from dflash_train.training.step import block_inputs, draft_blocks
from tests.support.step_recipe import step_recipe, step_runtime


def random_packed_batch(gen: torch.Generator, rows: int, seq: int, max_doc: int):
    """Rows of `seq` tokens holding documents of random length (1..max_doc), each with an unmasked prompt
    of random length, up to a random fill (the rest is padding, as at the end of a best-fit row)."""
    packed = []
    for _ in range(rows):
        docs, used = [], 0
        fill = int(torch.randint(1, seq + 1, (1,), generator=gen))
        while used < fill:
            n = int(torch.randint(1, max_doc + 1, (1,), generator=gen))
            prompt = int(torch.randint(0, n, (1,), generator=gen))
            docs.append(([5] * n, [False] * prompt + [True] * (n - prompt)))
            used += n
        packed.append(pack_row(docs, seq))
    return stack_rows(packed)


def test_ladder_values_and_length():
    assert anchor_count_buckets(16, 512) == (8, 16, 32, 64, 128, 256, 512)
    assert anchor_count_buckets(8, 512) == (16, 32, 64, 128, 256, 512)
    assert anchor_count_buckets(16, 300) == (8, 16, 32, 64, 128, 256, 304)  # top: the cap rounded up to 8
    assert anchor_count_buckets(16, 5) == (8,)
    assert [bucket_anchor_count(c, 16, 512) for c in (0, 1, 8, 9, 200, 257, 512)] == [8, 8, 8, 16, 256, 512, 512]
    assert bucket_anchor_count(3000, 16, None) == 4096  # no cap: the ladder goes on doubling


@pytest.mark.parametrize(("block_size", "seq", "max_doc", "per_doc"), [(16, 640, 300, 32), (8, 256, 90, 12)])
def test_a_run_of_varied_batches_stays_within_the_bound(block_size, seq, max_doc, per_doc):
    cap = 512
    ladder = anchor_count_buckets(block_size, cap)
    gen = torch.Generator().manual_seed(block_size)
    shapes, exact_counts = set(), set()
    for _ in range(60):
        batch = random_packed_batch(gen, 2, seq, max_doc)
        anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, per_doc, block_size, gen,
                                          max_anchors_per_row=cap)
        n = anchor_pos.shape[1]
        assert n in ladder
        assert int(keep.sum(dim=1).max()) <= min(cap, n)
        exact_counts.add(int(keep.sum(dim=1).max()))
        q_len = n * block_size
        shapes.add((q_len, seq + q_len))  # (drafter query length, key length) of this step
    assert len(shapes) <= len(ladder)
    assert len(shapes) >= 3, shapes  # the batches really vary
    assert len(exact_counts) > len(shapes)  # ...more than the ladder lets through


def _loss_and_grads(drafter, target, batch, cfg, anchor_pos, keep):
    feats = target.features(batch.input_ids, batch.position_ids, batch.document_ids)
    ids, positions = block_inputs(batch.input_ids, batch.position_ids, anchor_pos, cfg.block_size, cfg.mask_token_id)
    mask = build_drafter_mask(anchor_pos, keep, batch.document_ids, cfg.block_size, cfg.layer_types,
                              cfg.sliding_window, "sdpa")
    hidden = drafter(target.embed(ids), positions, feats, batch.position_ids, mask)
    labels, weight = block_targets(batch.input_ids, batch.loss_mask, batch.document_ids, anchor_pos, keep,
                                   cfg.block_size)
    out = dflash_loss(hidden, target.lm_head_weight, labels, weight, step_recipe().decay_gamma(cfg.block_size))
    drafter.zero_grad(set_to_none=True)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in drafter.named_parameters()}
    return out.loss.detach(), grads, out.counted


def test_bucketed_padding_leaves_loss_and_gradients_unchanged(tiny_target_dir: Path, qwen_docs, mask_token_id):
    cfg = DrafterConfig.debug(mask_token_id=mask_token_id, layer_types=["sliding_attention", "full_attention"],
                              sliding_window=12)
    recipe, runtime = step_recipe(num_anchors=8), step_runtime()
    target = FrozenTarget.from_pretrained(tiny_target_dir, cfg.target_layer_ids)
    drafter = DFlashDrafter(cfg).train()
    batch = stack_rows([pack_row(qwen_docs, 160), pack_row(qwen_docs[2:4], 160)])
    seed = 4

    def anchors(bucket: bool):
        return sample_anchors(batch.loss_mask, batch.document_ids, recipe.num_anchors, cfg.block_size,
                              torch.Generator().manual_seed(seed), max_anchors_per_row=runtime.max_anchors_per_row,
                              bucket=bucket)

    exact_pos, exact_keep = anchors(False)
    padded_pos, padded_keep = anchors(True)
    count = int(exact_keep.sum(dim=1).max())
    multiple = anchor_count_multiple(cfg.block_size)
    # The ladder pads further than the plain multiple: 48 (3 x 16) becomes 64.
    assert exact_pos.shape[1] == -(-count // multiple) * multiple < padded_pos.shape[1]
    n = exact_pos.shape[1]
    assert torch.equal(padded_pos[:, :n], exact_pos) and torch.equal(padded_keep[:, :n], exact_keep)
    assert not padded_keep[:, n:].any()

    loss_exact, grads_exact, counted_exact = _loss_and_grads(drafter, target, batch, cfg, exact_pos, exact_keep)
    loss_padded, grads_padded, counted_padded = _loss_and_grads(drafter, target, batch, cfg, padded_pos, padded_keep)
    assert torch.equal(counted_exact, counted_padded) and int(counted_exact.sum()) > 0
    torch.testing.assert_close(loss_padded, loss_exact)
    assert all(float(grad.abs().max()) > 0 for grad in grads_exact.values())
    for name, grad in grads_exact.items():
        torch.testing.assert_close(grads_padded[name], grad, msg=lambda m, name=name: f"{name}: {m}")

    # The step itself pads to the ladder: the same anchors as the bucketed draw.
    with torch.no_grad():
        blocks = draft_blocks(drafter, target, batch, cfg, recipe, runtime, torch.Generator().manual_seed(seed))
    assert torch.equal(blocks.anchor_pos, padded_pos) and torch.equal(blocks.keep, padded_keep)
