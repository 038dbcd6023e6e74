"""Anchor sampling: validity, per-document budget, uniformity, padding, determinism."""

from __future__ import annotations

import torch

from dflash_train.data.batch import pack_row, stack_rows
from dflash_train.training.anchors import anchor_count_multiple, sample_anchors, valid_anchor_mask


def _row(docs, length):
    return stack_rows([pack_row(docs, length)])


def test_valid_positions_need_two_masked_tokens_of_one_document():
    docs = [([1, 2, 3, 4], [0, 1, 1, 1]), ([5, 6, 7], [1, 1, 0])]
    batch = _row(docs, 9)
    valid = valid_anchor_mask(batch.loss_mask, batch.document_ids)[0].tolist()
    # doc 0 at 0..3: p=1,2 valid (3 is the document's last token); doc 1 at 4..6: p=4 only; padding never.
    assert valid == [False, True, True, False, True, False, False, False, False]


def test_anchors_are_valid_sorted_unique_and_padded(qwen_docs):
    batch = stack_rows([pack_row(qwen_docs[:3], 80), pack_row(qwen_docs[3:4], 80)])
    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, 4, 16, torch.Generator().manual_seed(0))
    valid = valid_anchor_mask(batch.loss_mask, batch.document_ids)
    assert anchor_pos.shape == keep.shape and anchor_pos.shape[1] % anchor_count_multiple(16) == 0
    for b in range(2):
        kept = anchor_pos[b][keep[b]]
        assert valid[b, kept].all()
        assert torch.equal(kept, torch.unique(kept))  # sorted, no repeats
        assert not keep[b, int(keep[b].sum()):].any()  # padding only at the end
        assert (anchor_pos[b][~keep[b]] == 0).all()


def test_every_document_gets_its_own_budget(qwen_docs):
    long_doc = ([7] * 300, [True] * 300)
    short = qwen_docs[4]  # a short answer: a handful of valid anchors
    batch = _row([long_doc, short], 400)
    valid = valid_anchor_mask(batch.loss_mask, batch.document_ids)[0]
    short_valid = int(valid[batch.document_ids[0] == 1].sum())
    assert 0 < short_valid < 8
    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, 8, 16, torch.Generator().manual_seed(0))
    docs = batch.document_ids[0, anchor_pos[0][keep[0]]]
    assert int((docs == 0).sum()) == 8
    assert int((docs == 1).sum()) == short_valid  # not crowded out by the long neighbour


def test_sampling_is_uniform_over_valid_positions():
    batch = _row([([3] * 40, [False] * 10 + [True] * 30)], 40)
    valid = valid_anchor_mask(batch.loss_mask, batch.document_ids)[0]
    n_valid = int(valid.sum())  # 29: positions 10..38
    gen = torch.Generator().manual_seed(0)
    draws, k = 3000, 5
    counts = torch.zeros(40)
    for _ in range(draws):
        anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, k, 16, gen)
        counts.index_add_(0, anchor_pos[0][keep[0]], torch.ones(int(keep.sum())))
    assert counts[~valid].sum() == 0
    expected = draws * k / n_valid  # ~517 per position
    # Binomial std is ~21; 5 std either way.
    assert ((counts[valid] - expected).abs() < 110).all(), counts[valid]


def test_same_generator_seed_gives_the_same_anchors(qwen_docs):
    batch = stack_rows([pack_row(qwen_docs, 128)])
    a = sample_anchors(batch.loss_mask, batch.document_ids, 3, 8, torch.Generator().manual_seed(5))
    b = sample_anchors(batch.loss_mask, batch.document_ids, 3, 8, torch.Generator().manual_seed(5))
    c = sample_anchors(batch.loss_mask, batch.document_ids, 3, 8, torch.Generator().manual_seed(6))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_row_without_valid_anchor_is_all_padding_and_pad_to_is_honoured():
    batch = stack_rows([pack_row([([1, 2, 3], [True, False, True])], 8), pack_row([([4, 5], [True, True])], 8)])
    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, 4, 16, pad_to=20)
    assert anchor_pos.shape == (2, 32)  # 20 put on the ladder 8, 16, 32, ... (multiples of 128 / 16)
    assert not keep[0].any()
    assert keep[1].tolist() == [True] + [False] * 31 and int(anchor_pos[1, 0]) == 0
    exact, _ = sample_anchors(batch.loss_mask, batch.document_ids, 4, 16, pad_to=20, bucket=False)
    assert exact.shape == (2, 24)  # without the ladder: 20 rounded up to a multiple of 8
