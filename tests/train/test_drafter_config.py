"""Drafter presets on dense and hybrid targets: every override takes effect or is refused; target layer N-1.

The targets are HF configs of `tests.support.tiny_target`'s shapes (no weights): the dense Qwen3 one
(hidden 128, 2/1 heads of 64; 8 layers here, so the default 5 feature layers are distinct) and the
Qwen3.6-architecture hybrid (8 layers, 3 linear + 1 full attention twice). Models are built in memory where
a test needs one (random weights, small vocabulary).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from dflash_shared.errors import ConfigError
from dflash_shared.manifests import SpecialTokens, TargetIdentity, TokenizedSection
from dflash_train import config as train_config
from dflash_train.config import DRAFTER_OVERRIDE_KEYS, TrainConfig
from dflash_train.drafter.config import (
    MOVED_TO_TRAIN_SETTINGS,
    QWEN3_6_DRAFTER,
    DrafterConfig,
    captures_last_layer,
    check_target_layer_ids,
    hybrid_layer_types,
)

MASK = 151669
VOCAB = 512  # enough rows for the mask-free tests that build a model


def dense_config(vocab_size: int = 151936) -> Any:
    """The tiny dense Qwen3 target's config, 8 layers deep."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                         rope_theta=1_000_000.0, tie_word_embeddings=True)
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def hybrid_config(vocab_size: int = 248320) -> Any:
    """The tiny Qwen3.6-architecture target's config (top level, with its nested text config)."""
    from transformers import Qwen3_5Config

    text = {"vocab_size": vocab_size, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 1,
            "linear_num_value_heads": 3, "full_attention_interval": 4, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_interleaved": True, "mrope_section": [3, 3, 2]}}
    config = Qwen3_5Config(text_config=text, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config


def text_of(config: Any) -> Any:
    """What the train stage hands `from_target`: the text config of a nested checkpoint config."""
    return getattr(config, "text_config", None) or config


TARGETS = {"dense": dense_config, "hybrid": hybrid_config}

# One valid value per setting, each unlike what the preset would choose on either target.
ALTERNATIVES: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-5,
    "rope_theta": 5e5,
    "max_position": 1024,
    "block_size": 8,
    "num_target_layers": 12,
    "target_layer_ids": [0, 2],
    "target_hidden_size": 256,
    "layer_types": ["full_attention"] * 3,
    "sliding_window": 64,
    "num_target_features": 2,
}
# One valid value per training rule that was a drafter setting: each is the train stage's now.
MOVED: dict[str, Any] = {
    "num_anchors": 7,
    "max_anchors_per_row": 9,
    "loss_decay_gamma": 3.0,
    "feature_noise_std": 0.1,
    "attention_backend": "flex",
}
# (setting, target) -> the error naming why it cannot take effect; every other pair must take effect.
REFUSED = {
    ("hidden_size", "dense"): "hidden_size 64 != target_hidden_size 128",
    ("hidden_size", "hybrid"): "hidden_size 64 != target_hidden_size 128",
    ("num_target_layers", "dense"): "num_target_layers=12 contradicts the target config",
    ("num_target_layers", "hybrid"): "num_target_layers=12 contradicts the target config",
    ("target_hidden_size", "dense"): "target_hidden_size=256 contradicts the target config",
    ("target_hidden_size", "hybrid"): "target_hidden_size=256 contradicts the target config",
    # The dense preset has no sliding layer, so a window alone would change nothing.
    ("sliding_window", "dense"): "sliding_window=64 has no effect",
}


def test_every_override_key_is_covered() -> None:
    """A new DrafterConfig field must be added here, so that the rule below is checked for it too."""
    assert set(ALTERNATIVES) == set(DRAFTER_OVERRIDE_KEYS)
    assert set(MOVED) == set(MOVED_TO_TRAIN_SETTINGS)


@pytest.mark.parametrize("arch", sorted(TARGETS))
@pytest.mark.parametrize("name", sorted(ALTERNATIVES))
def test_each_override_takes_effect_or_is_refused(name: str, arch: str) -> None:
    target = text_of(TARGETS[arch]())
    value = ALTERNATIVES[name]
    refused = REFUSED.get((name, arch))
    if refused is not None:
        with pytest.raises(ValueError, match=refused):
            DrafterConfig.from_target(target, mask_token_id=MASK, **{name: value})
        return
    cfg = DrafterConfig.from_target(target, mask_token_id=MASK, **{name: value})
    actual = cfg.num_target_features if name == "num_target_features" else getattr(cfg, name)
    assert actual == value
    if name == "layer_types":  # layer_types alone also sets the depth
        assert cfg.num_layers == len(value)


def test_num_layers_on_a_hybrid_target_shortens_the_reference_pattern() -> None:
    """The reported case: `{"num_layers": 1}` on a Qwen3.6 target trained a 5-layer drafter."""
    target = text_of(hybrid_config())
    one = DrafterConfig.from_target(target, mask_token_id=MASK, num_layers=1)
    # The last full-attention layer is kept; no layer slides, so no window is kept either.
    assert (one.num_layers, one.layer_types, one.sliding_window) == (1, ["full_attention"], None)
    assert one.num_attention_heads == QWEN3_6_DRAFTER["num_attention_heads"]
    two = DrafterConfig.from_target(target, mask_token_id=MASK, num_layers=2)
    assert two.layer_types == ["sliding_attention", "full_attention"] and two.sliding_window == 2048
    reference = DrafterConfig.from_target(target, mask_token_id=MASK)
    assert reference.layer_types == QWEN3_6_DRAFTER["layer_types"] and reference.num_layers == 5
    seven = DrafterConfig.from_target(target, mask_token_id=MASK, num_layers=7)
    assert seven.layer_types == ["sliding_attention", "full_attention", *QWEN3_6_DRAFTER["layer_types"]]


@pytest.mark.parametrize("num_layers", range(1, 12))
def test_hybrid_layer_pattern_rule(num_layers: int) -> None:
    kinds = hybrid_layer_types(num_layers)
    assert len(kinds) == num_layers and kinds[-1] == "full_attention"
    assert kinds[-5:] == QWEN3_6_DRAFTER["layer_types"][-num_layers:]  # the reference's tail
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    assert all((num_layers - 1 - i) % 5 == 0 for i in full) and len(full) == (num_layers + 4) // 5


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_num_layers_with_layer_types_must_agree(arch: str) -> None:
    target = text_of(TARGETS[arch]())
    kinds = ["full_attention"] * 2
    cfg = DrafterConfig.from_target(target, mask_token_id=MASK, num_layers=2, layer_types=kinds)
    assert (cfg.num_layers, cfg.layer_types) == (2, kinds)
    with pytest.raises(ValueError, match="layer_types has 2 entries for 3 layers"):
        DrafterConfig.from_target(target, mask_token_id=MASK, num_layers=3, layer_types=kinds)


def test_layer_count_and_ids_must_agree() -> None:
    with pytest.raises(ValueError, match=r"num_target_features=3 contradicts target_layer_ids \[0, 2\]"):
        DrafterConfig.from_target(dense_config(), mask_token_id=MASK, num_target_features=3, target_layer_ids=[0, 2])
    cfg = DrafterConfig.from_target(dense_config(), mask_token_id=MASK, num_target_features=2,
                                    target_layer_ids=[0, 2])
    assert cfg.target_layer_ids == [0, 2]
    # An empty list is not "the default": it is refused like any invalid value.
    with pytest.raises(ValidationError, match="target_layer_ids"):
        DrafterConfig.from_target(dense_config(), mask_token_id=MASK, target_layer_ids=[])


@pytest.mark.parametrize("arch", sorted(TARGETS))
@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_training_rule_given_to_from_target_is_refused_naming_its_train_setting(name: str, arch: str) -> None:
    with pytest.raises(ValueError, match=f"{name} is a train setting now"):
        DrafterConfig.from_target(text_of(TARGETS[arch]()), mask_token_id=MASK, **{name: MOVED[name]})


def test_training_rules_are_refused_as_drafter_settings_and_dropped_from_saved_configs() -> None:
    with pytest.raises(ValidationError, match=re.escape("set num_anchors = 4 in [stages.train] config")):
        DrafterConfig.debug(num_anchors=4)
    with pytest.raises(ValidationError, match=r"max_anchors_per_row is a train setting now \(runtime\).*"
                                              r"--max-anchors-per-row"):
        train_config.debug(input="in", output="out", target="t", drafter_overrides={"max_anchors_per_row": 64})
    # A checkpoint written while they were drafter settings still lists them: they say how it was trained, not
    # what the drafter is.
    cfg = DrafterConfig.debug()
    saved = {**cfg.model_dump(mode="json"), "num_anchors": 16, "max_anchors_per_row": 512, "loss_decay_gamma": 4.0,
             "feature_noise_std": 0.0, "attention_backend": "sdpa"}
    assert DrafterConfig.from_saved(saved) == cfg
    assert DrafterConfig.from_saved(json.dumps(saved)) == cfg == DrafterConfig.from_saved(cfg.model_dump_json())


def test_debug_preset_overrides_take_effect() -> None:
    cfg = DrafterConfig.debug(layer_types=["full_attention"] * 3, block_size=16)
    assert (cfg.num_layers, cfg.block_size) == (3, 16)
    with pytest.raises(ValidationError, match="num_target_features"):
        DrafterConfig.debug(num_target_features=2)


# ----------------------------------------------------------------------------------- the train stage


def _section() -> TokenizedSection:
    """A tokenized manifest's section naming the mask token (resolve_drafter reads no other field here)."""
    identity = TargetIdentity(model_id="tiny", tokenizer_sha256="0" * 64, chat_template_sha256="0" * 64,
                              enable_thinking=False, special_tokens=SpecialTokens(end_of_turn=1, mask=MASK))
    return TokenizedSection(target=identity, mode="render", mask_policy="final_turn", max_length=512,
                            total_tokens=0, loss_tokens=0)


def test_stage_applies_num_layers_on_a_hybrid_target(tmp_path: Path) -> None:
    """`--drafter-preset from_target --drafter-overrides '{"num_layers": 1}'` on a Qwen3.6 checkpoint."""
    from dflash_train.drafter.resolve import resolve_drafter

    hybrid_config().save_pretrained(tmp_path)
    config = TrainConfig(input="in", output="out", target="t", drafter_overrides={"num_layers": 1, "block_size": 8})
    cfg = resolve_drafter(config, str(tmp_path), _section())
    assert (cfg.num_layers, cfg.layer_types, cfg.block_size) == (1, ["full_attention"], 8)
    assert cfg.target_layer_ids == [1, 2, 3, 4, 5] and cfg.num_target_layers == 8
    config = TrainConfig(input="in", output="out", target="t", drafter_overrides={"sliding_window": 64})
    dense = tmp_path / "dense"
    dense_config().save_pretrained(dense)
    with pytest.raises(ConfigError, match="sliding_window=64 has no effect"):
        resolve_drafter(config, str(dense), _section())


# ----------------------------------------------------------------------------------- target layer N-1


def test_last_layer_is_accepted_where_vllm_captures_it() -> None:
    """vLLM 0.32's Qwen2Model / Qwen3NextModel loops record aux layer idx + 1 after every layer, the last too."""
    for config in (dense_config(), hybrid_config(), text_of(hybrid_config())):
        assert captures_last_layer(config)
    cfg = DrafterConfig.from_target(dense_config(), mask_token_id=MASK, target_layer_ids=[1, 7])
    assert cfg.target_layer_ids == [1, 7]
    hybrid = DrafterConfig.from_target(text_of(hybrid_config()), mask_token_id=MASK, target_layer_ids=[1, 7])
    assert hybrid.target_layer_ids == [1, 7]
    with pytest.raises(ValueError, match="target layer id 8 outside 0..7 for a 8-layer target"):
        DrafterConfig.from_target(dense_config(), mask_token_id=MASK, target_layer_ids=[1, 8])


def _llama_config() -> Any:
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    config.architectures = ["LlamaForCausalLM"]
    return config


def test_last_layer_is_refused_for_other_targets() -> None:
    llama = _llama_config()
    assert not captures_last_layer(llama)
    with pytest.raises(ValueError, match=r"target layer id 3 is the last decoder layer .*model_type llama\).*"
                                         r" aux layer 4.*use ids in 0\.\.2"):
        DrafterConfig.from_target(llama, mask_token_id=MASK, target_layer_ids=[1, 3])
    check_target_layer_ids(llama, [0, 2])
    # The config alone only knows the layer exists; the serving rule needs the target.
    assert DrafterConfig.debug(target_layer_ids=[1, 3]).target_layer_ids == [1, 3]


def _tiny_model(config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_hooked_target_captures_the_last_layer_before_the_final_norm() -> None:
    """What vLLM captures as aux layer N (hidden_states + residual) is the last layer's output, not HF's
    normed `hidden_states[N]`; the hook captures the same."""
    from dflash_train.evaluate.speculate import HookedTarget

    model = _tiny_model(dense_config(VOCAB))
    target = HookedTarget(model, [1, 7])
    ids = torch.tensor([5, 9, 2, 7])
    _, features = target.forward(ids, target.new_cache())
    last = features[:, 128:]
    with torch.no_grad():
        out = model(input_ids=ids.unsqueeze(0), output_hidden_states=True)
    torch.testing.assert_close(model.model.norm(last), out.hidden_states[-1][0])
    target.close()


def test_hooked_target_accepts_the_last_layer_of_a_hybrid_target() -> None:
    from dflash_train.evaluate.speculate import HookedTarget

    model = _tiny_model(text_of(hybrid_config(VOCAB)))
    target = HookedTarget(model, [1, 7])
    _, features = target.forward(torch.tensor([5, 9, 2, 7]), target.new_cache())
    assert features.shape == (4, 2 * 128)
    target.close()


def test_hooked_target_refuses_the_last_layer_elsewhere() -> None:
    from dflash_train.evaluate.speculate import HookedTarget

    with pytest.raises(ValueError, match="target layer id 3 is the last decoder layer"):
        HookedTarget(_tiny_model(_llama_config()), [1, 3])
