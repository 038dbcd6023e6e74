"""Drafter attention masks: the rules on the materialised mask, flex == SDPA, and behaviour under perturbation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from dflash_train.data.batch import pack_row, stack_rows
from dflash_train.drafter.attention import build_drafter_mask, drafter_mask_mod, materialize
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.anchors import sample_anchors
from dflash_train.training.step import block_inputs

BLOCK = 4
WINDOW = 6


def _batch(qwen_docs):
    docs = qwen_docs[:3]
    length = sum(len(d[0]) for d in docs) + 6
    return stack_rows([pack_row(docs, length), pack_row(qwen_docs[3:5], length)])


def _rule(anchor_pos, keep, doc, b, q, kv, window):
    """The rules written out per element, independently of the predicate under test."""
    seq = doc.shape[1]
    j, off = divmod(q, BLOCK)
    p = int(anchor_pos[b, j])
    if not keep[b, j]:
        return False
    if kv < seq:
        ok = kv < p and doc[b, kv] == doc[b, p] and doc[b, kv] != -1
        return ok and (window is None or kv >= p + off - (window - 1))
    kb, koff = divmod(kv - seq, BLOCK)
    return kb == j and (window is None or koff <= off)


@pytest.mark.parametrize("window", [None, WINDOW])
def test_materialised_mask_follows_the_rules(qwen_docs, window):
    batch = _batch(qwen_docs)
    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, 5, BLOCK, torch.Generator().manual_seed(1))
    assert (~keep).any(), "the case needs padded anchors"
    rows, seq = batch.shape
    q_len = anchor_pos.shape[1] * BLOCK
    mask = materialize(drafter_mask_mod(anchor_pos, keep, batch.document_ids, BLOCK, window), rows, q_len, seq + q_len,
                       torch.device("cpu"))
    expected = torch.tensor(
        [[[_rule(anchor_pos, keep, batch.document_ids, b, q, kv, window) for kv in range(seq + q_len)]
          for q in range(q_len)] for b in range(rows)]
    ).unsqueeze(1)
    assert torch.equal(mask, expected)
    # Spot checks of the named rules on one kept block.
    b, j = 0, int(keep[0].nonzero()[-1])
    p = int(anchor_pos[b, j])
    rows_q = mask[b, 0, j * BLOCK : (j + 1) * BLOCK]
    assert not rows_q[:, p].any(), "the anchor's own target state must be invisible"
    assert not rows_q[:, p + 1 : seq].any(), "later context must be invisible"
    other_blocks = torch.ones(q_len, dtype=torch.bool)
    other_blocks[j * BLOCK : (j + 1) * BLOCK] = False
    assert not rows_q[:, seq:][:, other_blocks].any(), "another block must be invisible"
    other_docs = (batch.document_ids[b] != batch.document_ids[b, p])
    assert not rows_q[:, :seq][:, other_docs].any(), "another document or padding must be invisible"
    own = rows_q[:, seq + j * BLOCK : seq + (j + 1) * BLOCK]
    assert torch.equal(own, torch.ones(BLOCK, BLOCK, dtype=torch.bool) if window is None
                       else torch.ones(BLOCK, BLOCK, dtype=torch.bool).tril())
    assert not mask[~keep.repeat_interleave(BLOCK, 1).unsqueeze(1)].any(), "a padded block sees nothing"


@pytest.mark.parametrize("window", [None, WINDOW])
def test_flex_vmap_and_broadcast_evaluations_of_the_predicate_agree(qwen_docs, window):
    batch = _batch(qwen_docs)
    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, 8, BLOCK, torch.Generator().manual_seed(2))
    rows, seq = batch.shape
    q_len = anchor_pos.shape[1] * BLOCK
    mod = drafter_mask_mod(anchor_pos, keep, batch.document_ids, BLOCK, window)
    assert torch.equal(materialize(mod, rows, q_len, seq + q_len, torch.device("cpu")),
                       create_mask(mod, rows, 1, q_len, seq + q_len, "cpu"))


@pytest.fixture(scope="module")
def setup(tiny_target_dir: Path, qwen_docs, mask_token_id):
    cfg = DrafterConfig.debug(block_size=BLOCK, sliding_window=WINDOW, layer_types=["sliding_attention",
                              "full_attention"], mask_token_id=mask_token_id)
    target = FrozenTarget.from_pretrained(tiny_target_dir, cfg.target_layer_ids)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    batch = _batch(qwen_docs)
    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, 6, BLOCK, torch.Generator().manual_seed(3))
    feats = target.features(batch.input_ids, batch.position_ids, batch.document_ids)
    ids, pos = block_inputs(batch.input_ids, batch.position_ids, anchor_pos, BLOCK, cfg.mask_token_id)
    return cfg, drafter, batch, anchor_pos, keep, feats, target.embed(ids), pos


def _run(setup, backend, feats=None, embeds=None):
    cfg, drafter, batch, anchor_pos, keep, f0, e0, pos = setup
    mask = build_drafter_mask(anchor_pos, keep, batch.document_ids, BLOCK, cfg.layer_types, cfg.sliding_window, backend)
    with torch.no_grad():
        return drafter(e0 if embeds is None else embeds, pos, f0 if feats is None else feats, batch.position_ids, mask)


@pytest.mark.parametrize("layer_types", [["full_attention"] * 2, ["sliding_attention", "full_attention"]])
def test_flex_and_sdpa_drafter_forward_agree(setup, layer_types):
    cfg, _, *rest = setup
    anchor_pos, keep = rest[1], rest[2]
    cfg = cfg.model_copy(update={"layer_types": layer_types})
    drafter = DFlashDrafter(cfg).eval()
    local = (cfg, drafter, *rest)
    sdpa, flex = _run(local, "sdpa"), _run(local, "flex")
    assert torch.isfinite(sdpa).all() and torch.isfinite(flex).all()
    torch.testing.assert_close(sdpa, flex, rtol=1e-4, atol=1e-4)
    assert keep.any() and (~keep).any() and anchor_pos.shape[1] > 1


def _first_block_with_context(setup):
    _, _, batch, anchor_pos, keep, *_ = setup
    for b in range(anchor_pos.shape[0]):
        for j in range(anchor_pos.shape[1]):
            p = int(anchor_pos[b, j])
            doc = batch.document_ids[b]
            if keep[b, j] and p >= 2 and doc[p - 2] == doc[p] and (doc[:p] != doc[p]).any():
                return b, j, p
    raise AssertionError("no block with an earlier document and two context tokens")


def _block(out, j):
    return out[:, j * BLOCK : (j + 1) * BLOCK]


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_forbidden_inputs_do_not_change_a_block_and_allowed_ones_do(setup, backend):
    cfg, drafter, batch, anchor_pos, keep, feats, embeds, pos = setup
    b, j, p = _first_block_with_context(setup)
    base = _run(setup, backend)[b : b + 1]

    def changed(feats_new=None, embeds_new=None) -> float:
        out = _run(setup, backend, feats_new, embeds_new)[b : b + 1]
        return float((_block(out, j) - _block(base, j)).abs().max())

    def bump_feat(position):
        f = feats.clone()
        f[b, position] += 5.0
        return f

    doc = batch.document_ids[b]
    forbidden = {
        "anchor's own state": bump_feat(p),
        "later context": bump_feat(slice(p + 1, None)),
        "other document": bump_feat(doc != doc[p]),
    }
    for name, f in forbidden.items():
        assert changed(feats_new=f) == 0.0, name
    other_block = embeds.clone()
    other = [i for i in range(anchor_pos.shape[1]) if i != j]
    for i in other:
        other_block[b, i * BLOCK : (i + 1) * BLOCK] += 5.0
    assert changed(embeds_new=other_block) == 0.0, "another block"
    assert changed(feats_new=bump_feat(p - 1)) > 1e-3, "the context just before the anchor"
    own_last = embeds.clone()
    own_last[b, (j + 1) * BLOCK - 1] += 5.0
    out = _block(_run(setup, backend, embeds=own_last)[b : b + 1], j)
    # Full layers are bidirectional inside the block, so slot 0 sees the last slot; the first layer here
    # slides (causal), the second is full, so slot 0 changes only through the full layer.
    assert float((out[:, 0] - _block(base, j)[:, 0]).abs().max()) > 1e-4


def test_sliding_layer_is_causal_inside_the_block_and_windowed(setup):
    cfg, drafter, batch, anchor_pos, keep, feats, embeds, pos = setup
    b, j, p = _first_block_with_context(setup)
    mask = build_drafter_mask(anchor_pos, keep, batch.document_ids, BLOCK, ["sliding_attention"], WINDOW, "sdpa")
    seq = batch.shape[1]
    allowed = mask.for_layer("sliding_attention").bias[b, 0, j * BLOCK : (j + 1) * BLOCK] == 0
    for off in range(BLOCK):
        ctx = allowed[off, :seq].nonzero().squeeze(-1)
        if ctx.numel():
            assert int(ctx.min()) >= p + off - (WINDOW - 1)
            assert int(ctx.max()) == p - 1
        assert allowed[off, seq + j * BLOCK : seq + j * BLOCK + off + 1].all()
        assert not allowed[off, seq + j * BLOCK + off + 1 : seq + (j + 1) * BLOCK].any()


def test_fully_masked_rows_are_zero_not_nan():
    q = torch.randn(1, 2, 4, 8)
    k = v = torch.randn(1, 1, 6, 8)
    anchor_pos = torch.zeros(1, 1, dtype=torch.long)
    keep = torch.zeros(1, 1, dtype=torch.bool)
    doc = torch.zeros(1, 2, dtype=torch.int32)
    from dflash_train.drafter.attention import attend

    for backend in ("sdpa", "flex"):
        m = build_drafter_mask(anchor_pos, keep, doc, 4, ["full_attention"], None, backend)
        out = attend(q, k, v, m.for_layer("full_attention"), 8**-0.5)
        assert torch.equal(out, torch.zeros_like(out)), backend
