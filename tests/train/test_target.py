"""FrozenTarget: hooked features, packed rows, tied LM head, mask-token validation, frozen weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_train.batch import pack_documents, pack_row, stack_rows
from dflash_train.drafter_config import DrafterConfig
from dflash_train.model import DFlashDrafter
from dflash_train.step import dflash_step
from dflash_train.target import FrozenTarget
from tests.support.qwen_assets import qwen_embedding_rows

ALL_IDS = [0, 1, 2]  # every id a 4-layer target allows (the last layer is excluded)


@pytest.fixture(scope="module")
def reference(tiny_target_dir: Path) -> Qwen3ForCausalLM:
    """The unmodified HF model, for output_hidden_states comparisons."""
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path) -> FrozenTarget:
    return FrozenTarget.from_pretrained(tiny_target_dir, ALL_IDS)


def test_hooks_equal_hf_hidden_states_of_next_index(target: FrozenTarget, reference: Qwen3ForCausalLM, qwen_docs):
    ids = torch.tensor([qwen_docs[0][0]])
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        states = reference(input_ids=ids, position_ids=pos, output_hidden_states=True).hidden_states
    feats = target.features(ids, pos)
    h = target.hidden_size
    for n, layer_id in enumerate(ALL_IDS):
        got = feats[..., n * h : (n + 1) * h]
        torch.testing.assert_close(got, states[layer_id + 1], rtol=1e-5, atol=1e-5)
        # The neighbouring index is a different tensor: the off-by-one would be caught.
        assert (got - states[layer_id]).abs().max() > 1e-2


def test_layers_after_the_last_id_are_dropped(tiny_target_dir: Path):
    t = FrozenTarget.from_pretrained(tiny_target_dir, [1])
    assert t.num_layers == 4
    assert len(t.model.get_decoder().layers) == 2


@pytest.mark.parametrize("bad", [[3], [-1], [1, 1], []])
def test_layer_ids_outside_the_capturable_range_are_rejected(tiny_target_dir: Path, bad: list[int]):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="layer id|non-empty"):
        FrozenTarget(model, bad)


def _docs_alone(target: FrozenTarget, docs) -> list[torch.Tensor]:
    out = []
    for ids, _ in docs:
        t = torch.tensor([ids])
        out.append(target.features(t, torch.arange(len(ids)).unsqueeze(0))[0])
    return out


@pytest.mark.parametrize("packing", ["mask", "per_document"])
def test_packed_row_features_equal_each_document_alone(tiny_target_dir: Path, qwen_docs, packing: str):
    target = FrozenTarget.from_pretrained(tiny_target_dir, [1, 2], packing=packing)
    docs = qwen_docs[:4]
    length = sum(len(d[0]) for d in docs) + 5  # room for padding at the end
    batch = stack_rows([pack_row(docs, length), pack_row(docs[::-1], length)])
    feats = target.features(batch.input_ids, batch.position_ids, batch.document_ids)
    alone = _docs_alone(target, docs)
    for row, order in ((0, range(4)), (1, range(3, -1, -1))):
        start = 0
        for i in order:
            n = len(docs[i][0])
            torch.testing.assert_close(feats[row, start : start + n], alone[i], rtol=1e-5, atol=1e-5)
            start += n
        assert torch.isfinite(feats[row, start:]).all()  # padding rows are finite (no empty softmax)
    if packing == "mask":
        # Treated as one document, the second document reads the first: the comparison can tell them apart.
        plain = target.features(batch.input_ids, batch.position_ids, torch.zeros_like(batch.document_ids))
        n0 = len(docs[0][0])
        assert (plain[0, n0 : n0 + len(docs[1][0])] - alone[1]).abs().max() > 1e-3


def test_sliding_window_target_layers_get_a_windowed_document_mask(tmp_path: Path, qwen_docs):
    config = Qwen3Config(
        vocab_size=qwen_embedding_rows("qwen3"), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config).eval()
    assert "sliding_attention" in config.layer_types
    model.save_pretrained(tmp_path)
    target = FrozenTarget.from_pretrained(tmp_path, [1, 2])
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    docs = qwen_docs[1:3]
    batch = pack_documents(docs, sum(len(d[0]) for d in docs))
    feats = target.features(batch.input_ids, batch.position_ids, batch.document_ids)
    start = 0
    for ids, _ in docs:
        with torch.no_grad():
            states = reference(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        expected = torch.cat([states[2], states[3]], dim=-1)[0]
        torch.testing.assert_close(feats[0, start : start + len(ids)], expected, rtol=1e-5, atol=1e-5)
        start += len(ids)


def test_tied_target_shares_the_embedding_as_lm_head(target: FrozenTarget):
    assert target.config.tie_word_embeddings
    assert target.lm_head_weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    assert target.vocab_rows == qwen_embedding_rows("qwen3")


def test_untied_target_uses_its_own_lm_head(tmp_path: Path):
    config = Qwen3Config(
        vocab_size=qwen_embedding_rows("qwen3"), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(tmp_path)
    saved_head = model.lm_head.weight.detach().clone()
    target = FrozenTarget.from_pretrained(tmp_path, [0, 1])
    assert target.lm_head_weight.data_ptr() != target.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(target.lm_head_weight, saved_head)
    assert (target.lm_head_weight - target.embed_tokens.weight).abs().max() > 1e-3


def test_mask_token_must_be_an_existing_row(target: FrozenTarget, mask_token_id: int):
    target.validate_token_id(mask_token_id)
    with pytest.raises(ValueError, match=r"mask_token_id 151936 is not a row .*never resized"):
        target.validate_token_id(qwen_embedding_rows("qwen3"))
    cfg = DrafterConfig.debug(target_layer_ids=ALL_IDS, mask_token_id=200_000)
    with pytest.raises(ValueError, match="not a row"):
        target.check_drafter_config(cfg)
    with pytest.raises(ValueError, match="target_layer_ids"):
        target.check_drafter_config(DrafterConfig.debug(mask_token_id=mask_token_id))


def test_step_leaves_the_target_frozen_and_its_embedding_unresized(tiny_target_dir: Path, qwen_docs, mask_token_id):
    cfg = DrafterConfig.debug(mask_token_id=mask_token_id)
    target = FrozenTarget.from_pretrained(tiny_target_dir, cfg.target_layer_ids)
    target.check_drafter_config(cfg)
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    drafter = DFlashDrafter(cfg)
    batch = pack_documents(qwen_docs, 64)
    out = dflash_step(drafter, target, batch, cfg, torch.Generator().manual_seed(0), noise=True)
    out.loss.backward()
    assert all(not p.requires_grad and p.grad is None for p in target.model.parameters())
    assert all(p.grad is not None for p in drafter.parameters())
    after = target.model.state_dict()
    noisy_cfg = cfg.model_copy(update={"feature_noise_std": 0.05})
    clean = dflash_step(drafter, target, batch, noisy_cfg, torch.Generator().manual_seed(0), noise=False)
    noisy = dflash_step(drafter, target, batch, noisy_cfg, torch.Generator().manual_seed(0), noise=True)
    assert float(clean.loss) != float(noisy.loss)
    assert target.embed_tokens.weight.shape == (qwen_embedding_rows("qwen3"), 128)
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name
