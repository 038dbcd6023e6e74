"""End to end: a drafter given the answer through planted target features learns it; shifted labels do not.

The target is a tiny random Qwen3 with the real Qwen3 vocabulary (151,936 tied embedding rows), built in
process with a wider embedding init than the cached test target so that a small drafter can reach
confident logits within a few hundred steps. Its `features` are replaced by a planted signal: the feature
at position t is the target embedding of token t+4 (zero past the document's end). Slot k of the block
anchored at p (position p+k) finds its label, token p+k, in the feature at p+k-4, always 4 positions
back: for a block of 4 that is p-3, p-2, p-1, all visible context. Documents are fresh random tokens
every step, so nothing can be memorised: the only way to a low loss is attending 4 positions back and
decoding the planted embedding through the target's LM head. Drafter layers slide with a window of 5,
which leaves few keys to choose from and makes the attention pattern quick to learn.

With labels shifted by one (slot k -> token p+k+1, the classic next-token shift), the label sits 3
positions back, and for slot 3 that is the anchor's own feature (position p), which the mask hides: slot
3 stays at chance. A mask that leaked the anchor's feature, or labels off by one, fail an assertion.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_train.data.batch import pack_documents
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.target_model.frozen import FrozenTarget, TargetPass
from dflash_train.training.loss import block_targets, dflash_loss
from dflash_train.training.step import dflash_step, draft_blocks
from tests.support.qwen_assets import qwen_embedding_rows
from tests.support.step_recipe import step_recipe, step_runtime

BLOCK = 4
LAYER_IDS = [1]
LOOKAHEAD = 4
LR = 5e-3
STEPS = 500
HIDDEN = 64  # narrow: the LM head over 151,936 rows is what each step costs
PROMPT = 3  # unmasked tokens at the start of each document, so every anchor has 3 tokens of context
TOKENS = torch.arange(1000, 1000 + 4096 * 7, 7)  # 4,096 real vocabulary ids
GAMMA = 4.0  # a block of 4 has no default decay
RECIPE = step_recipe(num_anchors=6, loss_decay_gamma=GAMMA)
RUNTIME = step_runtime()


class PlantedTarget(FrozenTarget):
    """A target whose features carry the token 4 positions ahead (see the module docstring)."""

    def forward(self, input_ids, position_ids, document_ids=None):  # type: ignore[override]
        emb = self.embed(input_ids)
        planted = torch.zeros_like(emb)
        same = document_ids[:, LOOKAHEAD:] == document_ids[:, :-LOOKAHEAD]
        planted[:, :-LOOKAHEAD] = emb[:, LOOKAHEAD:] * same.unsqueeze(-1)
        return TargetPass(planted, None)


def _batch(gen: torch.Generator):
    docs = []
    for n in (12, 16):
        ids = TOKENS[torch.randint(0, len(TOKENS), (n,), generator=gen)].tolist()
        docs.append((ids, [False] * PROMPT + [True] * (n - PROMPT)))
    return pack_documents(docs, 28)


@pytest.fixture(scope="module")
def planted(mask_token_id: int) -> Iterator[tuple[DrafterConfig, PlantedTarget]]:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=qwen_embedding_rows("qwen3"), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
        initializer_range=0.1,
    )
    target = PlantedTarget(Qwen3ForCausalLM(config), LAYER_IDS)
    cfg = DrafterConfig.debug(
        num_layers=1, hidden_size=HIDDEN, target_hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, head_dim=32,
        block_size=BLOCK, num_target_layers=3, target_layer_ids=LAYER_IDS, layer_types=["sliding_attention"],
        sliding_window=LOOKAHEAD + 1, mask_token_id=mask_token_id,
    )
    # One thread: on a busy two-core machine the small matmuls here run faster without thread hand-offs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield cfg, target
    torch.set_num_threads(threads)


def _train(cfg, target, label_offset: int, steps: int) -> tuple[float, list[float]]:
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    opt = torch.optim.AdamW(drafter.parameters(), lr=LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = _batch(gen)
        blocks = draft_blocks(drafter, target, batch, cfg, RECIPE, RUNTIME, gen)
        labels, weight = block_targets(batch.input_ids, batch.loss_mask, batch.document_ids,
                                       blocks.anchor_pos + label_offset, blocks.keep, BLOCK)
        out = dflash_loss(blocks.hidden, target.lm_head_weight, labels, weight, GAMMA)
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
            blocks = draft_blocks(drafter, target, batch, cfg, RECIPE, RUNTIME, gen)
            labels, weight = block_targets(batch.input_ids, batch.loss_mask, batch.document_ids,
                                           blocks.anchor_pos + label_offset, blocks.keep, BLOCK)
            out = dflash_loss(blocks.hidden, target.lm_head_weight, labels, weight, GAMMA)
            losses.append(float(out.loss))
            correct += out.correct
            counted += out.counted
    return sum(losses) / len(losses), (correct[1:] / counted[1:]).tolist()


def test_step_matches_the_composed_pieces(planted):
    cfg, target = planted
    drafter = DFlashDrafter(cfg)
    batch = _batch(torch.Generator().manual_seed(7))
    out = dflash_step(drafter, target, batch, cfg, RECIPE, RUNTIME, torch.Generator().manual_seed(1))
    blocks = draft_blocks(drafter, target, batch, cfg, RECIPE, RUNTIME, torch.Generator().manual_seed(1))
    labels, weight = block_targets(batch.input_ids, batch.loss_mask, batch.document_ids, blocks.anchor_pos,
                                   blocks.keep, BLOCK)
    ref = dflash_loss(blocks.hidden, target.lm_head_weight, labels, weight, GAMMA)
    torch.testing.assert_close(out.loss, ref.loss)
    assert out.tokens == int(weight.sum()) > 0
    assert abs(float(out.loss) - torch.log(torch.tensor(float(target.vocab_rows)))) < 1.0  # untrained: ~ln V


@pytest.mark.slow
def test_planted_signal_is_learned_and_a_shifted_label_is_not(planted):
    cfg, target = planted
    chance = math.log(target.vocab_rows)  # 11.93 nats
    loss, acc = _train(cfg, target, label_offset=0, steps=STEPS)
    assert loss < 0.25 * chance and min(acc) > 0.75, (loss, acc)
    shifted_loss, shifted_acc = _train(cfg, target, label_offset=1, steps=STEPS)
    # Slots 1-2 still find their (shifted) label 3 positions back and learn; slot 3's label is only in the
    # anchor's own feature, which the mask hides.
    assert min(shifted_acc[:2]) > 0.25, shifted_acc
    assert shifted_acc[2] < 0.05, shifted_acc
    assert shifted_loss > loss + 1.5, (shifted_loss, loss)
