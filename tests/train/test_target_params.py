"""The torch-free sizing the pipeline plans with before a run is submitted agrees with the train stage's own:
parameter counts from config.json alone against the checkpoints' headers, the drafter built from a plain
config.json against the one built from transformers' config, the anchor ladder and the `parallelism = auto` rule
against the modules that import torch."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dflash_train.drafter.config import DrafterConfig
from dflash_train.training import anchor_ladder, anchors, memory_plan
from dflash_train.training.memory_plan import auto_parallelism
from dflash_train.training.target_params import ConfigView, checkpoint_sizes, target_sizes, text_config
from tests.support.published_configs import QWEN2_5_7B, QWEN3_6_27B, QWEN3_8B, QWEN3_30B_A3B
from tests.support.tiny_target import MOE_ARCHS, QWEN2_ARCHS, TargetArch, build_tiny_target


def test_from_config_equals_the_checkpoint_headers(target_arch: str) -> None:
    """Exactly: per decoder layer, and outside the layers (a tied head counted once; the Qwen3.6 layout's vision
    tower and MTP weights, which the headers list, not loaded and not counted)."""
    target_dir = build_tiny_target(target_arch)  # type: ignore[arg-type]
    raw = json.loads((target_dir / "config.json").read_text())
    assert target_sizes(raw) == checkpoint_sizes(target_dir)


# A Qwen3.5 mixture of experts at toy width (hybrid layers, routed experts beside a gated shared expert, the
# layout of Qwen3.5/3.6's MoE siblings).
QWEN3_5_MOE_TOY: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1024, "full_attention_interval": 4,
        "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 48, "tie_word_embeddings": False,
    },
    "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64},
}


@pytest.mark.parametrize("config", [QWEN3_6_27B, QWEN3_8B, QWEN3_30B_A3B, QWEN3_5_MOE_TOY, QWEN2_5_7B],
                         ids=["qwen3.6-27b", "qwen3-8b", "qwen3-30b-a3b", "qwen3.5-moe", "qwen2.5-7b"])
def test_from_config_equals_the_model_transformers_builds(config: dict[str, Any]) -> None:
    """The published shapes, counted against the modules transformers builds (on the meta device: no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    layers = model.get_decoder().layers
    shape = target_sizes(config)
    assert shape.layer_params == tuple(sum(p.numel() for p in layer.parameters()) for layer in layers)
    loaded = sum(p.numel() for name, p in model.named_parameters() if "visual" not in name)
    assert sum(shape.layer_params) + shape.whole_params == loaded


@pytest.mark.parametrize(("config", "total_b", "active_b"), [
    (QWEN3_30B_A3B, 30.5, 3.35), (QWEN3_8B, 8.19, 8.19), (QWEN3_6_27B, 26.9, 26.9), (QWEN2_5_7B, 7.61, 7.61)])
def test_a_mixture_of_experts_holds_every_expert_and_runs_the_routed_ones(config: dict[str, Any], total_b: float,
                                                                           active_b: float) -> None:
    """The model card's counts: Qwen3-30B-A3B holds 30.5B parameters and runs 3.3B per token (router, 8 of 128
    experts, attention, embedding and head); a dense target runs all it holds."""
    sizes = target_sizes(config)
    assert sizes.params / 1e9 == pytest.approx(total_b, abs=0.05)
    assert sizes.active_params / 1e9 == pytest.approx(active_b, abs=0.05)


@pytest.mark.parametrize("arch", MOE_ARCHS + QWEN2_ARCHS)
def test_the_other_families_fixtures_from_config_equal_their_checkpoints(arch: TargetArch) -> None:
    """The tiny mixture-of-experts targets' config.json counts their checkpoints exactly, every expert's weights
    (and Qwen3.6-MoE's shared experts) included, its MTP layer not; and Qwen2.5's, whose q/k/v biases its config
    does not state (the family does)."""
    target_dir = build_tiny_target(arch)
    raw = json.loads((target_dir / "config.json").read_text())
    assert target_sizes(raw) == checkpoint_sizes(target_dir)
    sizes = target_sizes(raw)
    assert (sizes.active_params < sizes.params) == (arch in MOE_ARCHS)


def _drafters(raw: dict[str, Any], tmp_path: Path, **overrides: Any) -> tuple[DrafterConfig, DrafterConfig]:
    """The drafter from_target builds from transformers' config (the train stage) and from config.json read as
    a plain dict (the pipeline)."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = AutoConfig.from_pretrained(tmp_path)
    hf = getattr(hf, "text_config", None) or hf
    stage = DrafterConfig.from_target(hf, mask_token_id=7, **overrides)
    plain = DrafterConfig.from_target(ConfigView(text_config(raw)), mask_token_id=7, **overrides)
    return stage, plain


def test_the_drafter_from_a_plain_config_json_is_the_stages(target_arch: str, tmp_path: Path) -> None:
    raw = json.loads((build_tiny_target(target_arch) / "config.json").read_text())  # type: ignore[arg-type]
    stage, plain = _drafters(raw, tmp_path, target_layer_ids=[1, 2])
    assert stage == plain
    for published in (QWEN3_6_27B, QWEN3_8B):
        stage, plain = _drafters(published, tmp_path, num_layers=3, block_size=8)
        assert stage == plain


def test_the_torch_free_anchor_ladder_is_the_samplers() -> None:
    for block in (2, 3, 4, 8, 16, 32):
        for cap in (1, 7, 64, 500, 512, 2048, None):
            if cap is not None:
                assert anchor_ladder.anchor_count_buckets(block, cap) == anchors.anchor_count_buckets(block, cap)
            for count in (0, 1, 9, 255, 257, 511, 513, 2047, 4000):
                assert anchor_ladder.bucket_anchor_count(count, block, cap) == \
                    anchors.bucket_anchor_count(count, block, cap)


def test_the_stage_resolves_auto_parallelism_from_the_gpus_total_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage reads the device's total memory and applies the plan's rule; off CUDA auto is ddp."""
    total = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    cuda = torch.device("cuda", 0)
    for requested in ("auto", "ddp", "fsdp"):
        for target_bytes in (10 * 2**30, 50 * 2**30, 70 * 2**30):
            for drafter_params in (100_000_000, 1_730_000_000):
                assert memory_plan.choose_parallelism(requested, target_bytes, drafter_params, cuda) == \
                    auto_parallelism(requested, target_bytes, drafter_params, total)
    assert {auto_parallelism("auto", t, 100_000_000, total) for t in (10 * 2**30, 70 * 2**30)} == {"ddp", "fsdp"}
    cpu = torch.device("cpu")
    assert memory_plan.choose_parallelism("auto", 10**12, 10**9, cpu) == "ddp"  # host memory: not what sharding is for
    assert memory_plan.choose_parallelism("fsdp", 1, 1, cpu) == "fsdp"
