"""Where the sampling values and the length budget of a run come from (no engine needed).

The user's explicit values win; then the target's generation_config.json (thinking mode); then the preset
of the target's family and mode. The family and the hybrid layout are read from config.json, nested
`text_config` included, as the tiny Qwen3.6 target writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash_generate.config import GenerateConfig
from dflash_generate.engine import EngineConfig
from dflash_generate.sampling import (
    choose_sampling,
    default_sampling,
    generation_config_values,
)
from dflash_generate.target import TargetInfo, family_of, read_target
from dflash_shared.errors import ConfigError
from dflash_shared.target_family import is_hybrid_config as is_hybrid

QWEN3_6 = TargetInfo(model_type="qwen3_5", family="qwen3_5", hybrid=True, multimodal=True)
SHIPPED = {"do_sample": True, "temperature": 0.9, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.05}


def values(sampling: Any) -> tuple[Any, ...]:
    return (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.presence_penalty,
            sampling.repetition_penalty)


def generate_config(**overrides: Any) -> GenerateConfig:
    return GenerateConfig(input="s3://b/p", output="s3://b/c", model="/m", **overrides)


def test_family_presets() -> None:
    assert values(default_sampling(True, "qwen3")) == (0.6, 0.95, 20, 0.0, 0.0, 1.0)
    assert values(default_sampling(False, "qwen3")) == (0.7, 0.8, 20, 0.0, 0.0, 1.0)
    assert values(default_sampling(True, "qwen3_5")) == (1.0, 0.95, 20, 0.0, 1.5, 1.0)
    assert values(default_sampling(False, "qwen3_5")) == (0.7, 0.8, 20, 0.0, 1.5, 1.0)
    # The MoE family samples as dense Qwen3 does (its model card's values).
    assert default_sampling(True, "qwen3_moe") == default_sampling(True, "qwen3")
    # Qwen2.5 has one mode, with a light repetition penalty (its generation_config.json's values).
    assert values(default_sampling(False, "qwen2")) == (0.7, 0.8, 20, 0.0, 0.0, 1.05)


@pytest.mark.parametrize(
    ("config", "family", "hybrid"),
    [
        ({"model_type": "qwen3", "layer_types": ["full_attention"] * 2}, "qwen3", False),
        ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}, "qwen3_5", True),
        ({"model_type": "qwen3_5_moe"}, "qwen3_5", True),
        ({"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"]}, "qwen3_5", True),
        ({"model_type": "other", "text_config": {"layer_types": ["linear_attention"]}}, "qwen3", True),
        ({}, "qwen3", False),
    ],
)
def test_family_and_hybrid_from_config_json(config: dict[str, Any], family: str, hybrid: bool) -> None:
    assert (family_of(config), is_hybrid(config)) == (family, hybrid)


def test_read_target_on_the_tiny_targets() -> None:
    pytest.importorskip("torch", reason="building the tiny targets needs torch")
    from tests.support.tiny_target import build_tiny_target

    dense, hybrid = read_target(str(build_tiny_target("qwen3"))), read_target(str(build_tiny_target("qwen3_6")))
    assert (dense.model_type, dense.family, dense.hybrid) == ("qwen3", "qwen3", False)
    assert (hybrid.model_type, hybrid.family, hybrid.hybrid, hybrid.multimodal) == ("qwen3_5", "qwen3_5", True, True)
    assert not dense.multimodal
    # Their generation_config.json sets token ids only: nothing for sampling.
    assert generation_config_values(hybrid.generation_config) == {}
    assert read_target("/nonexistent") == TargetInfo()


def test_generation_config_beats_the_preset_in_thinking_mode() -> None:
    choice = choose_sampling("qwen3_5", True, SHIPPED)
    assert values(choice.sampling) == (0.9, 0.9, 40, 0.0, 1.5, 1.05)
    assert choice.sources == {"temperature": "generation_config", "top_p": "generation_config",
                              "top_k": "generation_config", "min_p": "preset:qwen3_5/thinking",
                              "presence_penalty": "preset:qwen3_5/thinking",
                              "repetition_penalty": "generation_config"}


def test_non_thinking_mode_keeps_the_preset() -> None:
    """generation_config.json has one set of values, the default (thinking) mode's: not for the other mode."""
    choice = choose_sampling("qwen3_5", False, SHIPPED)
    assert choice.sampling == default_sampling(False, "qwen3_5")
    assert set(choice.sources.values()) == {"preset:qwen3_5/non_thinking"}


def test_a_family_without_thinking_settles_to_its_only_mode_and_reads_its_generation_config() -> None:
    """Qwen2.5 has no thinking mode: unset, enable_thinking settles off there (on for the families that think);
    its generation_config.json is that mode's; thinking on is refused before any engine starts (exit 64)."""
    qwen2 = TargetInfo(model_type="qwen2", family="qwen2", generation_config=SHIPPED)
    settled = generate_config().settle(qwen2)
    assert settled.enable_thinking is False
    assert values(settled.sampling) == (0.9, 0.9, 40, 0.0, 0.0, 1.05)
    assert settled.choice.sources["temperature"] == "generation_config"
    assert generate_config().settle(TargetInfo()).enable_thinking is True
    assert generate_config(enable_thinking=False).settle(TargetInfo()).enable_thinking is False
    with pytest.raises(ConfigError, match="enable_thinking: qwen2 targets have no thinking mode"):
        generate_config(enable_thinking=True).settle(qwen2)


def test_explicit_values_always_win() -> None:
    choice = choose_sampling("qwen3_5", True, SHIPPED, {"temperature": 0.3, "presence_penalty": 0.0},
                             max_tokens=64, seed=5)
    assert (choice.sampling.temperature, choice.sampling.presence_penalty, choice.sampling.top_k) == (0.3, 0.0, 40)
    assert (choice.sources["temperature"], choice.sources["presence_penalty"]) == ("explicit", "explicit")
    assert (choice.sampling.max_tokens, choice.sampling.seed) == (64, 5)
    with pytest.raises(ValueError, match="seed is not a sampling field"):
        choose_sampling("qwen3", True, {}, {"seed": 1})


def test_unusable_generation_config_values_are_skipped() -> None:
    shipped = {"temperature": "hot", "top_p": 1.5, "top_k": True, "min_p": 0.05, "max_new_tokens": 9}
    assert generation_config_values(shipped) == {"min_p": 0.05}
    assert choose_sampling("qwen3", True, shipped).sources["top_p"] == "preset:qwen3/thinking"


def test_config_settles_sampling_and_budget_per_family() -> None:
    """Without the cap to the training window, the family's budget: Qwen3.6's long thinking gets 32K."""
    shipped = TargetInfo(model_type="qwen3_5", family="qwen3_5", hybrid=True, generation_config=SHIPPED)
    settled = generate_config(top_k=10, cap_to_training_window=False).settle(shipped)
    assert settled.family == "qwen3_5" and (settled.max_new_tokens, settled.max_model_len) == (32768, 40960)
    assert (settled.sampling.temperature, settled.sampling.top_k) == (0.9, 10)
    assert settled.choice.sources["top_k"] == "explicit"
    assert settled.sampling.max_tokens == 32768
    dense = generate_config(enable_thinking=False, cap_to_training_window=False).settle(TargetInfo())
    assert (dense.max_new_tokens, dense.max_model_len) == (8192, 16384)
    assert dense.sampling == default_sampling(False, "qwen3").with_overrides(max_tokens=8192)
    # An explicit budget keeps the family's room for prompts; explicit limits are taken as they are.
    uncapped = {"cap_to_training_window": False}
    assert generate_config(max_new_tokens=65536, **uncapped).settle(QWEN3_6).max_model_len == 73728
    assert generate_config(max_new_tokens=1024, **uncapped).settle(QWEN3_6).max_model_len == 40960
    with pytest.raises(ConfigError, match="must be below max_model_len"):
        generate_config(max_model_len=16384, **uncapped).settle(QWEN3_6)


def test_the_budget_stops_at_the_training_window_by_default() -> None:
    """The engine's context is the training window: each prompt's budget is window - its tokens (vLLM's
    max_tokens is min(max_new_tokens, max_model_len - prompt)), so nothing is generated that no step reads."""
    settled = generate_config().settle(QWEN3_6)
    assert (settled.max_new_tokens, settled.max_model_len) == (4095, 4096)
    assert (settled.training_window, settled.capped_to_window) == (4096, True)
    long = generate_config(training_window=16384).settle(QWEN3_6)
    assert (long.max_new_tokens, long.max_model_len) == (16383, 16384)
    # The family's budget is the most when it is shorter than the window; an explicit shorter context is kept.
    assert generate_config(training_window=16384).settle(TargetInfo()).max_new_tokens == 8192
    assert generate_config(max_model_len=2048, max_new_tokens=512).settle(QWEN3_6).max_model_len == 2048
    # Limits past the window would generate what no step reads: refused, naming the ways out.
    for limits in ({"max_model_len": 40960}, {"max_new_tokens": 4096}):
        with pytest.raises(ValueError, match="does not fit inside training_window .4096.*cap_to_training_window false"):
            generate_config(**limits)


def test_hybrid_targets_on_cpu_get_bf16_no_prefix_caching_and_text_only() -> None:
    base = EngineConfig(model="/m", max_model_len=64, dtype="auto")
    cpu = base.for_target(QWEN3_6, "cpu")
    assert (cpu.dtype, cpu.enable_prefix_caching, cpu.language_model_only) == ("bfloat16", False, True)
    assert cpu.llm_kwargs()["enable_prefix_caching"] is False and cpu.llm_kwargs()["language_model_only"] is True
    # Dense targets run as configured; hybrid ones on the CUDA build only as text models.
    assert base.for_target(TargetInfo(), "cpu") == base
    assert base.for_target(QWEN3_6, "cuda") == base.model_copy(update={"language_model_only": True})
    assert "enable_prefix_caching" not in base.llm_kwargs() and "language_model_only" not in base.llm_kwargs()
    with pytest.raises(ConfigError, match="bfloat16 only, not float16"):
        base.model_copy(update={"dtype": "float16"}).for_target(QWEN3_6, "cpu")
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        base.model_copy(update={"enable_prefix_caching": True}).for_target(QWEN3_6, "cpu")


def test_target_files_in_a_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.8, "top_k": 20}))
    target = read_target(str(tmp_path))
    assert (target.family, target.hybrid) == ("qwen3_5", True)
    assert generation_config_values(target.generation_config) == {"temperature": 0.8, "top_k": 20}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_target(str(tmp_path)).generation_config == {}
