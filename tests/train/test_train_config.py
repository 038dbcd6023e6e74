"""TrainConfig: the optimiser's reference defaults, drafter settings that would be ignored are refused, and the
sections by role (recipe, runtime) are the config's own fields."""

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
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], config.recipe, torch.device("cpu"))
    assert optimizer.defaults["betas"] == (0.9, 0.999)
    tuned = parse_settings(TrainConfig, [*ARGS, "--adam-beta2", "0.95"])
    tuned_optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], tuned.recipe, torch.device("cpu"))
    assert tuned_optimizer.defaults["betas"] == (0.9, 0.95)


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


def test_the_config_is_its_sections_by_role_plus_the_stages_own_settings() -> None:
    """The recipe and the runtime are disjoint sections of the flat config: each section field is a config field
    with the same value, so a flag, a variable or a run-file key sets it in one place."""
    from dflash_train.sections import TrainingRecipe, TrainingRuntime

    config = parse_settings(TrainConfig, [*ARGS, "--lr", "3e-4", "--micro-batch-rows", "2"])
    recipe, runtime = set(TrainingRecipe.model_fields), set(TrainingRuntime.model_fields)
    assert not recipe & runtime and (recipe | runtime) < set(TrainConfig.model_fields)
    assert config.recipe.lr == 3e-4 and config.runtime.micro_batch_rows == 2
    assert config.recipe.model_dump() == {name: getattr(config, name) for name in recipe}
    assert type(config.recipe) is TrainingRecipe and type(config.runtime) is TrainingRuntime


def test_a_section_built_from_a_run_files_values_refuses_a_bad_one_by_name() -> None:
    """The pipeline's fit check builds the sections from a run file's train settings: a bad value is a ConfigError
    naming it, and the recipe's own rule (D-PACE needs a cross-entropy) holds there too."""
    from dflash_train.sections import TrainingRecipe, TrainingRuntime, section_of

    defaults = {name: field.default for name, field in TrainConfig.model_fields.items()}
    assert section_of(TrainingRuntime, defaults).precision == "bf16"
    with pytest.raises(ConfigError, match="precision"):
        section_of(TrainingRuntime, {**defaults, "precision": "fp16"})
    with pytest.raises(ConfigError, match="target_kl set position_weighting exp_decay"):
        section_of(TrainingRecipe, {**defaults, "objective": "target_kl"})
