"""DFlashDrafter: export names and shapes, Qwen3 layer math, context injection, checkpointing, config."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from dflash_shared.errors import ConfigError
from dflash_train.drafter.attention import DrafterMask, SdpaMask, additive_mask, build_drafter_mask
from dflash_train.drafter.config import DrafterConfig, default_target_layer_ids
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.sections import TrainingRecipe

H, HEADS, KV_HEADS, HEAD_DIM = 128, 2, 1, 64


def _cfg(**overrides) -> DrafterConfig:
    return DrafterConfig.debug(**overrides)


def test_state_dict_has_exactly_the_export_names_and_shapes():
    cfg = _cfg(num_layers=2, target_layer_ids=[0, 1, 2])
    sd = DFlashDrafter(cfg).state_dict()
    expected = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, H),
            p + "self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,),
            p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (256, H),
            p + "mlp.up_proj.weight": (256, H),
            p + "mlp.down_proj.weight": (H, 256),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        }
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected  # no embedding, no LM head, no rope buffer


def _hf_layer(layer_state: dict[str, torch.Tensor], cfg: DrafterConfig):
    config = Qwen3Config(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=cfg.rms_norm_eps, num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
    )
    config._attn_implementation = "eager"
    layer = Qwen3DecoderLayer(config, 0).eval()
    layer.load_state_dict(layer_state)
    return layer, Qwen3RotaryEmbedding(config)


def _randomise(module: torch.nn.Module) -> None:
    # Norm weights start at 1; random ones make the comparison see every norm.
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)


def test_layer_with_only_its_own_block_visible_is_a_qwen3_decoder_layer():
    cfg = _cfg(num_layers=1)
    layer = DFlashDrafter(cfg).layers[0].eval()
    _randomise(layer)
    hf, rope = _hf_layer(layer.state_dict(), cfg)
    q_len, seq = 6, 5
    x = torch.randn(1, q_len, H)
    pos = torch.arange(40, 40 + q_len).unsqueeze(0)
    context = torch.randn(1, seq, H)
    ctx_pos = torch.arange(seq).unsqueeze(0)
    allowed = torch.zeros(1, 1, q_len, seq + q_len, dtype=torch.bool)
    allowed[..., seq:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    mask = SdpaMask(additive_mask(allowed, torch.float32), torch.ones(1, 1, q_len, 1, dtype=torch.bool))
    drafter = DFlashDrafter(cfg)
    rope_q = drafter.rotary(pos)
    rope_kv = tuple(torch.cat((a, b), dim=1) for a, b in zip(drafter.rotary(ctx_pos), rope_q, strict=True))
    with torch.no_grad():
        ours = layer(x, context, rope_q, rope_kv, mask)
        causal = additive_mask(allowed[..., seq:], torch.float32)
        theirs = hf(x, attention_mask=causal, position_embeddings=rope(x, pos))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_context_enters_as_keys_and_values_without_input_layernorm():
    """HF's layer over [U; x] equals ours over context C = w * U: input_layernorm(U) is w * U for unit-RMS U."""
    cfg = _cfg(num_layers=1)
    layer = DFlashDrafter(cfg).layers[0].eval()
    _randomise(layer)
    hf, rope = _hf_layer(layer.state_dict(), cfg)
    q_len, seq = 4, 7
    x = torch.randn(1, q_len, H)
    u = torch.randn(1, seq, H)
    u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    context = layer.input_layernorm.weight.detach() * u
    ctx_pos = torch.arange(seq).unsqueeze(0)
    pos = torch.arange(seq, seq + q_len).unsqueeze(0)
    allowed = torch.ones(1, 1, q_len, seq + q_len, dtype=torch.bool)
    mask = SdpaMask(additive_mask(allowed, torch.float32), torch.ones(1, 1, q_len, 1, dtype=torch.bool))
    drafter = DFlashDrafter(cfg)
    rope_q = drafter.rotary(pos)
    rope_kv = tuple(torch.cat((a, b), dim=1) for a, b in zip(drafter.rotary(ctx_pos), rope_q, strict=True))
    with torch.no_grad():
        ours = layer(x, context, rope_q, rope_kv, mask)
        full = torch.cat((u, x), dim=1)
        all_pos = torch.cat((ctx_pos, pos), dim=1)
        hf_mask = torch.zeros(1, 1, seq + q_len, seq + q_len)
        theirs = hf(full, attention_mask=hf_mask, position_embeddings=rope(full, all_pos))[:, seq:]
        moved = layer(x, context, drafter.rotary(pos + 3), rope_kv, mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert (moved - ours).abs().max() > 1e-3  # positions matter (RoPE on both sides)


def _step_inputs(cfg: DrafterConfig):
    gen = torch.Generator().manual_seed(0)
    rows, seq = 2, 20
    doc = torch.zeros(rows, seq, dtype=torch.int32)
    doc[0, 12:] = 1
    anchor_pos = torch.tensor([[2, 5, 14, 0], [1, 9, 16, 0]])
    keep = torch.tensor([[True, True, True, False], [True, True, True, False]])
    q_len = anchor_pos.shape[1] * cfg.block_size
    embeds = torch.randn(rows, q_len, H, generator=gen)
    positions = (anchor_pos.unsqueeze(-1) + torch.arange(cfg.block_size)).view(rows, -1)
    feats = torch.randn(rows, seq, cfg.feature_size, generator=gen)
    ctx_pos = torch.arange(seq).expand(rows, seq)
    mask = build_drafter_mask(anchor_pos, keep, doc, cfg.block_size, cfg.layer_types, cfg.sliding_window, "sdpa")
    return embeds, positions, feats, ctx_pos, mask


def test_activation_checkpointing_gives_the_same_output_and_gradients():
    cfg = _cfg()
    drafter = DFlashDrafter(cfg).train()
    inputs = _step_inputs(cfg)
    out = drafter(*inputs)
    out.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    drafter.set_gradient_checkpointing(True)
    out2 = drafter(*inputs)
    out2.pow(2).mean().backward()
    torch.testing.assert_close(out, out2)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=n)


def test_feature_width_is_checked():
    cfg = _cfg()
    embeds, positions, feats, ctx_pos, mask = _step_inputs(cfg)
    with pytest.raises(ValueError, match="expected 256"):
        DFlashDrafter(cfg)(embeds, positions, feats[..., :128], ctx_pos, mask)


def test_missing_layer_type_mask_is_reported():
    cfg = _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    embeds, positions, feats, ctx_pos, mask = _step_inputs(_cfg())
    with pytest.raises(KeyError, match="sliding_attention"):
        DFlashDrafter(cfg)(embeds, positions, feats, ctx_pos, DrafterMask("sdpa", dict(mask.by_layer_type)))


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B reference drafter
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B reference drafter
    with pytest.raises(ValueError, match="repeats a layer"):
        default_target_layer_ids(4, 3)


def test_config_presets_and_validation():
    target = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1e6})
    cfg = DrafterConfig.from_target(target, mask_token_id=151669)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.num_layers == 5
    assert cfg.feature_size == 5 * 4096 and cfg.layer_types == ["full_attention"] * 5
    # The loss decay is the recipe's: by block size under exp_decay, none under D-PACE.
    decay = TrainingRecipe(position_weighting="exp_decay")
    assert decay.decay_gamma(cfg.block_size) == 7.0
    assert decay.decay_gamma(DrafterConfig.debug(block_size=8).block_size) == 4.0
    assert TrainingRecipe().decay_gamma(16) is None
    with pytest.raises(ValidationError, match="sliding_window is not set"):
        DrafterConfig.debug(layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValidationError, match="target layer id 4 outside 0..3"):
        DrafterConfig.debug(target_layer_ids=[1, 4])
    with pytest.raises(ValidationError, match="hidden_size 64 != target_hidden_size 128"):
        DrafterConfig.debug(hidden_size=64)
    with pytest.raises(ConfigError, match="no default loss_decay_gamma"):
        decay.decay_gamma(DrafterConfig.debug(block_size=4).block_size)
    with pytest.raises(ValidationError, match="extra"):
        DrafterConfig.debug(unknown_field=1)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_bf16_autocast_runs_both_backends_close_to_float32(backend, monkeypatch):
    import dflash_train.drafter.model as model_module

    seen: list[tuple[torch.dtype, ...]] = []
    real_attend = model_module.attend

    def recording_attend(q, k, v, mask, scale):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real_attend(q, k, v, mask, scale)

    # Compiled flex kernels need one dtype for q, k and v (the norms alone would give float32 q/k).
    monkeypatch.setattr(model_module, "attend", recording_attend)
    cfg = _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    drafter = DFlashDrafter(cfg)
    embeds, positions, feats, ctx_pos, _ = _step_inputs(cfg)
    anchor_pos = torch.tensor([[2, 5, 14, 0], [1, 9, 16, 0]])
    keep = torch.tensor([[True, True, True, False], [True, True, True, False]])
    doc = torch.zeros(2, 20, dtype=torch.int32)
    doc[0, 12:] = 1
    mask = build_drafter_mask(anchor_pos, keep, doc, cfg.block_size, cfg.layer_types, cfg.sliding_window, backend)
    with torch.no_grad():
        ref = drafter(embeds, positions, feats, ctx_pos, mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = drafter(embeds.bfloat16(), positions, feats.bfloat16(), ctx_pos, mask)
    assert torch.isfinite(low).all()
    assert seen[-1] == (torch.bfloat16,) * 3 and all(len(set(d)) == 1 for d in seen), seen
    rel = (low.float() - ref).norm() / ref.norm()
    assert rel < 0.05, float(rel)


def _qwen3_6_27b_text_config() -> Any:
    """The text config of Qwen3.6-27B as its checkpoint states it (no weights are built)."""
    from transformers import Qwen3_5Config

    text = {"vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
            "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
            "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_interleaved": True, "mrope_section": [11, 11, 10]}}
    return Qwen3_5Config(text_config=text).text_config


def test_qwen3_6_27b_target_gets_the_reference_drafter():
    """Not a copy of the target's 24/4 heads of 256: the published 1.7B-class drafter shape."""
    from dflash_train.drafter.config import QWEN3_6_MASK_TOKEN_ID

    target = _qwen3_6_27b_text_config()
    assert target.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    cfg = DrafterConfig.from_target(target, mask_token_id=QWEN3_6_MASK_TOKEN_ID)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (5120, 32, 8, 128)
    assert cfg.intermediate_size == 17408 and cfg.num_layers == 5 and cfg.rope_theta == 1e7
    assert cfg.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and cfg.sliding_window == 2048
    assert cfg.target_layer_ids == [1, 16, 31, 46, 61] and cfg.num_target_layers == 64
    assert cfg.mask_token_id == 248070
    # Overrides still win (e.g. full-attention layers for a CPU serving check).
    override = DrafterConfig.from_target(target, mask_token_id=248070, layer_types=["full_attention"] * 5)
    assert override.layer_types == ["full_attention"] * 5 and override.num_attention_heads == 32


def test_default_mask_token_of_a_qwen3_6_target(tmp_path):
    from dflash_train.drafter.mask_token import default_mask_token

    assert default_mask_token(str(tmp_path), _qwen3_6_27b_text_config()) == 248070


def test_target_layer_ids_must_increase():
    """Engines concatenate the captured states in layer order; another order is refused, naming the fix."""
    with pytest.raises(ValidationError, match=r"strictly increasing .* got \[2, 1\]; use \[1, 2\]"):
        DrafterConfig.debug(target_layer_ids=[2, 1])
    assert DrafterConfig.debug(target_layer_ids=[0, 2]).target_layer_ids == [0, 2]
