"""End to end: a drafter given the answer through planted target features learns it; shifted labels do not.

The planted target is the real tiny Qwen3 target (its embedding, tied LM head and real vocabulary) whose
`features` are replaced: the feature vector at position t holds the target embeddings of tokens
t+2, t+3, t+4 (one per feature slot, zero past the document's end). Under the DFlash rules the block
anchored at p sees context only up to p-1, whose feature holds exactly tokens p+1..p+3 = the labels of
slots 1..3 of a block of 4. Documents are fresh random tokens every step, so nothing can be memorised:
the only way to low loss is reading the planted feature and decoding it through the right slot.

With labels shifted by one (slot k -> token p+k+1, the classic next-token shift), slot 3 would need token
p+4, which only the anchor's own feature (position p) holds; the mask hides it, so slot 3 stays at chance.
A mask that leaked the anchor's feature, or labels off by one, make one of the two assertions fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_train.batch import pack_documents
from dflash_train.drafter_config import DrafterConfig
from dflash_train.loss import block_targets, dflash_loss
from dflash_train.model import DFlashDrafter
from dflash_train.step import dflash_step, draft_blocks
from dflash_train.target import FrozenTarget

BLOCK = 4
LAYER_IDS = [0, 1, 2]  # three feature slots: tokens t+2, t+3, t+4
TOKENS = torch.arange(1000, 1000 + 4096 * 7, 7)  # 4,096 real vocabulary ids


class PlantedTarget(FrozenTarget):
    """The tiny target with features that carry the next tokens (see the module docstring)."""

    def features(self, input_ids, position_ids, document_ids=None):  # type: ignore[override]
        rows, seq = input_ids.shape
        emb = self.embed(input_ids)
        parts = []
        for m in range(len(self.layer_ids)):
            shift = 2 + m
            part = torch.zeros_like(emb)
            same = document_ids[:, shift:] == document_ids[:, :-shift]
            part[:, :-shift] = emb[:, shift:] * same.unsqueeze(-1)
            parts.append(part)
        return torch.cat(parts, dim=-1) * 20.0


def _batch(gen: torch.Generator):
    docs = []
    for n in (20, 28, 24, 24):
        ids = TOKENS[torch.randint(0, len(TOKENS), (n,), generator=gen)].tolist()
        docs.append((ids, [False] + [True] * (n - 1)))
    return pack_documents(docs, 48)


@pytest.fixture(scope="module")
def planted(tiny_target_dir: Path, mask_token_id: int):
    cfg = DrafterConfig.debug(num_layers=1, block_size=BLOCK, loss_decay_gamma=4.0, target_layer_ids=LAYER_IDS,
                              num_anchors=12, mask_token_id=mask_token_id)
    return cfg, PlantedTarget.from_pretrained(tiny_target_dir, LAYER_IDS)


def _train(cfg, target, label_offset: int, steps: int) -> tuple[float, list[float]]:
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = _batch(gen)
        blocks = draft_blocks(drafter, target, batch, cfg, gen)
        labels, weight = block_targets(batch.input_ids, batch.loss_mask, batch.document_ids,
                                       blocks.anchor_pos + label_offset, blocks.keep, BLOCK)
        out = dflash_loss(blocks.hidden, target.lm_head_weight, labels, weight, cfg.loss_decay_gamma)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    # Held-out batches: fresh random documents.
    correct = torch.zeros(BLOCK)
    counted = torch.zeros(BLOCK)
    losses = []
    with torch.no_grad():
        for _ in range(4):
            batch = _batch(gen)
            blocks = draft_blocks(drafter, target, batch, cfg, gen)
            labels, weight = block_targets(batch.input_ids, batch.loss_mask, batch.document_ids,
                                           blocks.anchor_pos + label_offset, blocks.keep, BLOCK)
            out = dflash_loss(blocks.hidden, target.lm_head_weight, labels, weight, cfg.loss_decay_gamma)
            losses.append(float(out.loss))
            correct += out.correct
            counted += out.counted
    return sum(losses) / len(losses), (correct[1:] / counted[1:]).tolist()


def test_step_matches_the_composed_pieces(planted):
    cfg, target = planted
    drafter = DFlashDrafter(cfg)
    batch = _batch(torch.Generator().manual_seed(7))
    out = dflash_step(drafter, target, batch, cfg, torch.Generator().manual_seed(1))
    blocks = draft_blocks(drafter, target, batch, cfg, torch.Generator().manual_seed(1))
    labels, weight = block_targets(batch.input_ids, batch.loss_mask, batch.document_ids, blocks.anchor_pos,
                                   blocks.keep, BLOCK)
    ref = dflash_loss(blocks.hidden, target.lm_head_weight, labels, weight, cfg.loss_decay_gamma)
    torch.testing.assert_close(out.loss, ref.loss)
    assert out.tokens == int(weight.sum()) > 0
    assert abs(float(out.loss) - torch.log(torch.tensor(float(target.vocab_rows)))) < 1.0  # untrained: ~ln V


@pytest.mark.slow
def test_planted_signal_is_learned_and_a_shifted_label_is_not(planted):
    cfg, target = planted
    loss, acc = _train(cfg, target, label_offset=0, steps=150)
    assert loss < 0.5 and min(acc) > 0.95, (loss, acc)
    shifted_loss, shifted_acc = _train(cfg, target, label_offset=1, steps=150)
    # Slots 1-2 can still read tokens p+2, p+3 from feature p-1; slot 3 (token p+4) cannot.
    assert shifted_acc[2] < 0.05, shifted_acc
    assert shifted_loss > loss + 1.0, (shifted_loss, loss)
