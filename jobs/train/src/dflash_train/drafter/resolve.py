"""The drafter a train run builds, decided once: by the train stage (`resolve_drafter`, with the target's
files) and by the plan's fit check (`dflash_pipeline.plan.fit`, from config.json alone). Torch-free.

Given whole (`drafter`), or a preset (`debug`, or the target's own shape: `DrafterConfig.from_target`) with
overrides; the mask token from the settings, else `default_mask`, which each caller answers with what it can
read (the stage: the tokenizer's first unused row; the plan: a stand-in, since the id changes no size).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from dflash_shared.errors import ConfigError
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.mask_token import default_mask_token

if TYPE_CHECKING:
    from dflash_shared.manifests import TokenizedSection
    from dflash_train.config import TrainConfig


def build_drafter(drafter: DrafterConfig | Mapping[str, Any] | None, preset: str | None,
                  overrides: Mapping[str, Any], mask: int | None, text_config: Callable[[], Any],
                  default_mask: Callable[[Any], int]) -> DrafterConfig:
    """The drafter of these settings (`text_config`: the target's language-model config, read only when the
    preset needs it); ConfigError for settings the drafter refuses."""
    try:
        if drafter is not None:
            return drafter if isinstance(drafter, DrafterConfig) else DrafterConfig.model_validate(drafter)
        kept = dict(overrides)
        if preset == "debug":
            kept.pop("num_target_features", None)
            return DrafterConfig.debug(**kept, **({"mask_token_id": mask} if mask is not None else {}))
        config = text_config()
        return DrafterConfig.from_target(config, mask_token_id=mask if mask is not None else default_mask(config),
                                         **kept)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"invalid drafter config: {err}") from err


def resolve_drafter(config: TrainConfig, target_dir: str, section: TokenizedSection) -> DrafterConfig:
    """The train stage's drafter: given whole, or a preset with overrides; the mask id from the config, else the
    data's manifest, else the target's reference mask token or first embedding row past the tokenizer."""
    mask = config.mask_token_id if config.mask_token_id is not None else section.target.special_tokens.mask

    def text_config() -> Any:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(target_dir)
        return getattr(hf_config, "text_config", None) or hf_config

    return build_drafter(config.drafter, config.drafter_preset, config.drafter_overrides, mask, text_config,
                         lambda hf_config: default_mask_token(target_dir, hf_config))
