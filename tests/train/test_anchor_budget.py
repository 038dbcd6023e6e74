"""The per-row anchor cap: shared round-robin across a row's documents, validated, and applied by the step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from dflash_train.data.batch import pack_row, stack_rows
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.sections import TrainingRuntime
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.anchors import sample_anchors, valid_anchor_mask
from dflash_train.training.step import draft_blocks
from tests.support.step_recipe import step_recipe, step_runtime


def _anchors_per_document(batch, anchor_pos, keep, row: int = 0) -> dict[int, int]:
    docs = batch.document_ids[row, anchor_pos[row][keep[row]]].tolist()
    return {d: docs.count(d) for d in sorted(set(docs))}


def test_row_cap_leaves_every_short_document_its_anchors_and_takes_from_the_long_one():
    # One long document (300 valid anchors) and 20 short ones (5 valid anchors each) in a row; 64 per
    # document would be 64 + 20 * 5 = 164 blocks, the cap allows 160.
    long_doc = ([7] * 301, [True] * 301)
    short = [([11 + i] * 6, [True] * 6) for i in range(20)]
    batch = stack_rows([pack_row([long_doc, *short], 440)])
    valid = valid_anchor_mask(batch.loss_mask, batch.document_ids)[0]
    assert all(int(valid[batch.document_ids[0] == d].sum()) == 5 for d in range(1, 21))
    for seed in range(5):
        anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, 64, 16,
                                          torch.Generator().manual_seed(seed), max_anchors_per_row=160)
        per_doc = _anchors_per_document(batch, anchor_pos, keep)
        assert int(keep.sum()) == 160
        assert all(per_doc[d] == 5 for d in range(1, 21)), per_doc  # round-robin: the short ones keep all
        assert per_doc[0] == 160 - 20 * 5
        assert valid[anchor_pos[0][keep[0]]].all()


def test_row_cap_below_the_number_of_documents_gives_each_at_most_one():
    docs = [([3 + i] * 12, [True] * 12) for i in range(30)]
    batch = stack_rows([pack_row(docs, 360)])
    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, 8, 16, torch.Generator().manual_seed(0),
                                      max_anchors_per_row=17)
    per_doc = _anchors_per_document(batch, anchor_pos, keep)
    assert int(keep.sum()) == 17 and len(per_doc) == 17 and set(per_doc.values()) == {1}
    # Which documents get the last round is random, not their order in the row.
    seen = set()
    for seed in range(1, 6):
        pos, kp = sample_anchors(batch.loss_mask, batch.document_ids, 8, 16, torch.Generator().manual_seed(seed),
                                 max_anchors_per_row=17)
        seen |= set(_anchors_per_document(batch, pos, kp))
    assert max(seen) > 16


def test_counts_between_rounds_differ_by_at_most_one():
    docs = [([5] * 40, [True] * 40), ([6] * 25, [True] * 25), ([8] * 9, [True] * 9)]
    batch = stack_rows([pack_row(docs, 80)])
    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, 32, 8, torch.Generator().manual_seed(2),
                                      max_anchors_per_row=40)
    per_doc = _anchors_per_document(batch, anchor_pos, keep)
    assert sum(per_doc.values()) == 40
    assert per_doc[2] == 8  # all 8 valid anchors of the short document
    assert abs(per_doc[0] - per_doc[1]) <= 1  # the rest split evenly: 16 and 16


def test_a_cap_that_does_not_bind_changes_nothing(qwen_docs):
    batch = stack_rows([pack_row(qwen_docs, 160), pack_row(qwen_docs[:2], 160)])
    free = sample_anchors(batch.loss_mask, batch.document_ids, 4, 8, torch.Generator().manual_seed(1))
    capped = sample_anchors(batch.loss_mask, batch.document_ids, 4, 8, torch.Generator().manual_seed(1),
                            max_anchors_per_row=512)
    assert torch.equal(free[0], capped[0]) and torch.equal(free[1], capped[1])


def test_cap_must_be_at_least_one():
    with pytest.raises(ValidationError, match="max_anchors_per_row"):
        TrainingRuntime(max_anchors_per_row=0)
    batch = stack_rows([pack_row([([1, 2, 3], [True] * 3)], 4)])
    with pytest.raises(ValueError, match="max_anchors_per_row must be >= 1"):
        sample_anchors(batch.loss_mask, batch.document_ids, 4, 8, max_anchors_per_row=0)
    assert TrainingRuntime().max_anchors_per_row == 512  # the SpecForge recipe


def test_the_training_step_applies_the_configured_cap(tiny_target_dir: Path, qwen_docs, mask_token_id):
    cfg = DrafterConfig.debug(mask_token_id=mask_token_id)
    target = FrozenTarget.from_pretrained(tiny_target_dir, cfg.target_layer_ids)
    drafter = DFlashDrafter(cfg).eval()
    batch = stack_rows([pack_row(qwen_docs, 160), pack_row(qwen_docs[:1], 160)])
    with torch.no_grad():
        blocks = draft_blocks(drafter, target, batch, cfg, step_recipe(num_anchors=8),
                              step_runtime(max_anchors_per_row=10), torch.Generator().manual_seed(0))
    kept = blocks.keep.sum(dim=1).tolist()
    assert kept[0] == 10 and 0 < kept[1] <= 8
    assert len(_anchors_per_document(batch, blocks.anchor_pos, blocks.keep)) == len(qwen_docs)
    assert blocks.hidden.shape[1] == blocks.anchor_pos.shape[1] * cfg.block_size
