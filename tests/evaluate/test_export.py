"""Export format: config fields and tensor names exactly as the engines load them, round trip, layer ids."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dflash_shared.errors import BadInputError
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_train.drafter_config import QWEN3_MASK_TOKEN_ID, DrafterConfig
from dflash_train.export import (
    ExportError,
    config_from_export,
    drafter_hf_config,
    export_speculators_config,
    load_export,
    load_export_dir,
    write_export_dir,
)
from dflash_train.model import DFlashDrafter
from dflash_train.speculate import speculative_generate
from tests.evaluate import eval_fixtures as ef

QWEN3_8B = SimpleNamespace(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, intermediate_size=12288, rms_norm_eps=1e-6, max_position_embeddings=40960,
                           rope_theta=1_000_000.0, vocab_size=151936, bos_token_id=151643, eos_token_id=151645,
                           architectures=["Qwen3ForCausalLM"])


def _drafter_inputs(cfg: DrafterConfig, seq: int = 12) -> tuple[torch.Tensor, ...]:
    from dflash_train.attention import build_drafter_mask

    gen = torch.Generator().manual_seed(7)
    block = cfg.block_size
    embeds = torch.randn(1, block, cfg.hidden_size, generator=gen)
    features = torch.randn(1, seq, cfg.feature_size, generator=gen)
    anchor = torch.tensor([[seq - 1]])
    positions = (seq - 1 + torch.arange(block)).unsqueeze(0)
    mask = build_drafter_mask(anchor, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, seq, dtype=torch.int32),
                              block, cfg.layer_types, cfg.sliding_window, "sdpa")
    return embeds, positions, features, torch.arange(seq).unsqueeze(0), mask


def test_config_has_every_field_of_the_native_format() -> None:
    cfg = DrafterConfig.from_target(QWEN3_8B, mask_token_id=QWEN3_MASK_TOKEN_ID, num_target_features=5)
    config = drafter_hf_config(cfg, QWEN3_8B, "bfloat16")
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 16
    assert config["num_target_layers"] == 36
    assert config["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert config["layer_types"] == ["full_attention"] * 5
    assert config["sliding_window"] is None and config["use_sliding_window"] is False
    # The drafter's own Qwen3 shape (the reference Qwen3-8B drafter's numbers).
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (
        5, 4096, 32, 8, 128, 12288)
    assert config["vocab_size"] == 151936 and config["tie_word_embeddings"] is False
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == 1_000_000.0


# A Qwen3.6-like target: RoPE over a quarter of each head, its base in rope_parameters (transformers 5).
QWEN3_6_LIKE = SimpleNamespace(**{**vars(QWEN3_8B), "rope_theta": None, "partial_rotary_factor": 0.25,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                                                      "partial_rotary_factor": 0.25}})


def test_rotary_fraction_is_stated_and_equals_training_for_a_partial_rotary_target() -> None:
    # Pitfall: the target's partial_rotary_factor leaking into the drafter on one side only.
    cfg = DrafterConfig.from_target(QWEN3_6_LIKE, mask_token_id=QWEN3_MASK_TOKEN_ID, num_target_features=5)
    config = drafter_hf_config(cfg, QWEN3_6_LIKE)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10_000_000.0
    assert config["partial_rotary_factor"] == config["rope_parameters"]["partial_rotary_factor"] == 1.0
    # Training rotates every dimension of the head, as the export says.
    rotary = DFlashDrafter(DrafterConfig.debug()).rotary
    cos, sin = rotary(torch.tensor([[5]]))
    assert cos.shape[-1] == DrafterConfig.debug().head_dim and bool((sin[0, 0] != 0).all())
    assert config_from_export(config).rope_theta == 10_000_000.0


@pytest.mark.parametrize("rope", [{"partial_rotary_factor": 0.25}, {"rope_parameters": {
    "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}, {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0}}])
def test_an_export_with_another_rope_is_refused(rope: dict[str, Any]) -> None:
    cfg = DrafterConfig.from_target(QWEN3_8B, mask_token_id=QWEN3_MASK_TOKEN_ID)
    config = {**drafter_hf_config(cfg, QWEN3_8B), "partial_rotary_factor": 1.0, **rope}
    if "rope_parameters" not in rope:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    with pytest.raises(ExportError, match="RoPE .* not what this drafter trains with"):
        config_from_export(config, "export/config.json")


def test_sliding_window_drafter_config() -> None:
    layer_types = ["sliding_attention"] * 4 + ["full_attention"]
    cfg = DrafterConfig.from_target(QWEN3_8B, mask_token_id=QWEN3_MASK_TOKEN_ID, layer_types=layer_types,
                                    sliding_window=2048)
    config = drafter_hf_config(cfg, QWEN3_8B)
    assert config["layer_types"] == layer_types
    assert config["sliding_window"] == 2048 and config["use_sliding_window"] is True


def test_weight_names_are_exactly_the_drafters_own(tmp_path: Path, trained_drafter: Any, tiny_target_dir: Path
                                                   ) -> None:
    from transformers import AutoConfig

    write_export_dir(trained_drafter, AutoConfig.from_pretrained(tiny_target_dir), str(tmp_path), "bfloat16")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight"]
    want = {f"layers.{i}.{n}" for i in range(2) for n in per_layer} | {"fc.weight", "hidden_norm.weight",
                                                                        "norm.weight"}
    assert set(tensors) == want  # no embedding, no LM head
    cfg = trained_drafter.config
    assert tensors["fc.weight"].shape == (cfg.hidden_size, cfg.hidden_size * len(cfg.target_layer_ids))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    # transformers reads the config as a Qwen3 config of the drafter's shape.
    hf = AutoConfig.from_pretrained(tmp_path)
    assert (hf.model_type, hf.num_hidden_layers, hf.hidden_size) == ("qwen3", 2, 128)
    assert hf.dflash_config["target_layer_ids"] == [1, 2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_reproduces_the_drafter_exactly(tmp_path: Path, trained_drafter: Any, tiny_target_dir: Path,
                                                   dtype: str) -> None:
    from transformers import AutoConfig

    write_export_dir(trained_drafter, AutoConfig.from_pretrained(tiny_target_dir), str(tmp_path), dtype)
    loaded = load_export_dir(str(tmp_path))
    torch_dtype = getattr(torch, dtype)
    reference = DFlashDrafter(trained_drafter.config).eval()
    reference.load_state_dict(trained_drafter.state_dict())
    reference = reference.to(torch_dtype)
    assert loaded.config.model_dump(exclude={"loss_decay_gamma", "num_anchors", "attention_backend"}) == \
        trained_drafter.config.model_dump(exclude={"loss_decay_gamma", "num_anchors", "attention_backend"})
    with torch.no_grad():
        inputs = _drafter_inputs(loaded.config)
        cast = [t.to(torch_dtype) if t.is_floating_point() else t for t in inputs[:4]]
        assert torch.equal(loaded(*cast, inputs[4]), reference(*cast, inputs[4]))


def test_round_trip_decodes_identically(tmp_path: Path, trained_drafter: Any, tiny_target_dir: Path,
                                        hooked_target: Any, heldout_prompts: list[list[int]]) -> None:
    from transformers import AutoConfig

    write_export_dir(trained_drafter, AutoConfig.from_pretrained(tiny_target_dir), str(tmp_path), "float32")
    loaded = load_export_dir(str(tmp_path))
    a = speculative_generate(trained_drafter, hooked_target, heldout_prompts[0], 24, ef.STOP_IDS)
    b = speculative_generate(loaded, hooked_target, heldout_prompts[0], 24, ef.STOP_IDS)
    assert (a.tokens, a.accepted) == (b.tokens, b.accepted)
    assert sum(a.accepted) > 0  # a trained drafter: the comparison covers accepted drafts


def test_speculators_format_keeps_the_layer_id_convention(trained_drafter: Any) -> None:
    """vLLM's own converter must turn aux ids (L + 1) back into the native target_layer_ids (L)."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    cfg = trained_drafter.config
    target = SimpleNamespace(vocab_size=151936, architectures=["Qwen3ForCausalLM"])
    spec = export_speculators_config(cfg, target, verifier="tiny-qwen3")
    assert spec["aux_hidden_state_layer_ids"] == [2, 3]
    converted = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(spec)))
    assert converted["dflash_config"]["target_layer_ids"] == cfg.target_layer_ids == [1, 2]
    assert converted["dflash_config"]["mask_token_id"] == cfg.mask_token_id
    assert converted["architectures"] == ["DFlashDraftModel"]
    assert SpeculatorsConfig.extract_vllm_speculative_config(spec) == {"method": "dflash",
                                                                      "num_speculative_tokens": cfg.block_size - 1}


def test_native_layer_ids_are_what_vllm_captures_plus_one(tmp_path: Path, trained_drafter: Any,
                                                          tiny_target_dir: Path) -> None:
    """vLLM reads dflash_config.target_layer_ids L and captures auxiliary state L + 1 = HF hidden_states[L+1]."""
    from transformers import AutoConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    write_export_dir(trained_drafter, AutoConfig.from_pretrained(tiny_target_dir), str(tmp_path), "float32")
    hf = AutoConfig.from_pretrained(tmp_path)
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
    assert get_eagle3_aux_layers_from_config(spec) == (2, 3)
    # ...and our features are HF hidden_states[L + 1] of the same target.
    from transformers import AutoModelForCausalLM

    from dflash_train.speculate import HookedTarget

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32)
    hooked = HookedTarget(model, [1, 2])
    ids = torch.tensor([151644, 872, 198, 9707])
    _, features = hooked.forward(ids, hooked.new_cache())
    states = model(ids.unsqueeze(0), output_hidden_states=True).hidden_states
    assert torch.equal(features, torch.cat([states[2][0], states[3][0]], dim=-1))


def test_export_refuses_foreign_weights(trained_drafter: Any) -> None:
    from dflash_train.export import export_state_dict

    drafter = DFlashDrafter(trained_drafter.config)
    drafter.embed_tokens = torch.nn.Embedding(4, drafter.config.hidden_size)
    with pytest.raises(ExportError, match="unexpected.*embed_tokens.weight"):
        export_state_dict(drafter)


def test_load_refuses_a_missing_tensor(tmp_path: Path, trained_drafter: Any, tiny_target_dir: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig

    write_export_dir(trained_drafter, AutoConfig.from_pretrained(tiny_target_dir), str(tmp_path), "float32")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ExportError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        load_export_dir(str(tmp_path))


def test_export_stage_writes_a_drafter_manifest_naming_the_export(offline_run: Any, tiny_target_dir: Path,
                                                                 trained_drafter: Any) -> None:
    """The session's `dflash-train export` on S3: files, manifest (verified hashes), exact round trip."""
    store = offline_run.store
    loaded = load_manifest(store, offline_run.export, Kind.drafter)  # verifies every shard's sha256
    section = loaded.manifest.section
    assert section.export_uri == offline_run.export
    assert loaded.manifest.inputs[0].uri.startswith(offline_run.drafter)
    names = sorted(s.uri.rsplit("/", 2)[-1] if "speculators" not in s.uri else "speculators/" +
                   s.uri.rsplit("/", 1)[-1] for s in loaded.manifest.shards)
    assert names == ["config.json", "model.safetensors", "speculators/config.json", "speculators/model.safetensors"]
    drafter = load_export(offline_run.export, store)
    for name, tensor in trained_drafter.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], tensor), name


def test_export_refuses_a_checkpoint_that_does_not_fit_the_target(tmp_path: Path, offline_run: Any) -> None:
    from dflash_train.evaluate_config import ExportConfig
    from dflash_train.export import run_export
    from tests.support.tiny_target import build_tiny_qwen3

    other = build_tiny_qwen3(num_layers=6)  # a different target: 6 layers, the drafter was built for 4
    with pytest.raises(BadInputError, match="num_target_layers 4 != target's 6"):
        run_export(ExportConfig(drafter=offline_run.drafter, output=str(tmp_path / "export"), target=str(other)),
                   offline_run.store)
    assert not (tmp_path / "export" / "manifest.json").exists()
