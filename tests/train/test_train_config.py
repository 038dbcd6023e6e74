"""TrainConfig: the optimiser's reference defaults, and drafter settings that would be ignored are refused."""

from __future__ import annotations

import pytest
import torch

from dflash_shared.errors import ConfigError
from dflash_shared.settings import parse_settings
from dflash_train.config import TrainConfig
from dflash_train.drafter.config import DrafterConfig
from dflash_train.training.optim import build_optimizer

ARGS = ["--input", "in", "--output", "out", "--target", "t"]


def test_adamw_defaults_are_torchs_as_in_the_reference_trainer() -> None:
    """SpecForge builds torch.optim.AdamW without betas: (0.9, 0.999)."""
    config = parse_settings(TrainConfig, ARGS)
    assert (config.adam_beta1, config.adam_beta2, config.adam_eps) == (0.9, 0.999, 1e-8)
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], config, torch.device("cpu"))
    assert optimizer.defaults["betas"] == (0.9, 0.999)
    tuned = parse_settings(TrainConfig, [*ARGS, "--adam-beta2", "0.95"])
    assert build_optimizer([torch.nn.Parameter(torch.zeros(2))], tuned, torch.device("cpu")).defaults["betas"] == (
        0.9, 0.95)


def _drafter_json() -> str:
    return DrafterConfig.debug().model_dump_json()


@pytest.mark.parametrize(("extra", "message"), [
    (["--drafter-overrides", '{"num_layers": 1}'], "drafter_overrides given with a complete drafter config"),
    (["--drafter-preset", "debug"], "drafter_preset given with a complete drafter config"),
    (["--mask-token-id", "7"], "mask_token_id 7 contradicts drafter.mask_token_id 151669"),
])
def test_settings_a_complete_drafter_would_ignore_are_refused(extra: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_settings(TrainConfig, [*ARGS, "--drafter", _drafter_json(), *extra])


def test_a_complete_drafter_with_the_debug_preset() -> None:
    """The preset's own drafter settings step aside for a complete drafter; its other settings still apply."""
    config = parse_settings(TrainConfig, [*ARGS, "--preset", "debug", "--drafter", _drafter_json(),
                                          "--mask-token-id", "151669"])
    assert config.drafter == DrafterConfig.debug() and config.drafter_overrides == {}
    assert config.device == "cpu"


@pytest.mark.parametrize(("overrides", "message"), [
    ('{"num_layer": 3}', r"unknown key\(s\) \['num_layer'\]"),
    ('{"mask_token_id": 5}', "may not hold mask_token_id; set --mask-token-id"),
])
def test_overrides_that_cannot_apply_are_refused_at_parse_time(overrides: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_settings(TrainConfig, [*ARGS, "--drafter-overrides", overrides])


def test_num_target_features_needs_the_from_target_preset() -> None:
    """The debug preset has fixed target layers; the count would be dropped without a word."""
    with pytest.raises(ConfigError, match="num_target_features only applies to drafter_preset from_target"):
        parse_settings(TrainConfig, [*ARGS, "--drafter-preset", "debug", "--drafter-overrides",
                                     '{"num_target_features": 2}'])
    config = parse_settings(TrainConfig, [*ARGS, "--drafter-overrides", '{"num_target_features": 2}'])
    assert config.drafter_overrides == {"num_target_features": 2}


def test_a_field_of_the_nested_drafter_is_set_with_dots_or_double_underscores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What StageSettings' docstring promises: `--drafter.block-size` and DFLASH_TRAIN_DRAFTER__BLOCK_SIZE."""
    assert DrafterConfig.debug().block_size != 4
    dotted = parse_settings(TrainConfig, [*ARGS, "--drafter", _drafter_json(), "--drafter.block-size", "4"])
    assert dotted.drafter is not None and dotted.drafter.block_size == 4
    monkeypatch.setenv("DFLASH_TRAIN_DRAFTER", _drafter_json())
    monkeypatch.setenv("DFLASH_TRAIN_DRAFTER__BLOCK_SIZE", "4")
    from_env = parse_settings(TrainConfig, ARGS)
    assert from_env.drafter is not None and from_env.drafter.block_size == 4
