"""Sampling settings of the generate stage: the target's own defaults, Qwen's presets, explicit overrides.

The drafter learns the target's own distribution, so completions are sampled with the settings the model
is meant to run with. Each value comes from, in order: the user (an explicit setting always wins); the
target's `generation_config.json`, in its family's default mode (the mode Qwen's shipped values are for: its file
has one set of values and no mode; thinking where the family thinks); the family's preset for the mode (Qwen
recommends different values for thinking and non-thinking mode, and Qwen3.5/3.6 others than Qwen3:
dflash_shared.target_family holds them).
`choose_sampling` records where each value came from. This module has no vLLM import; the engine turns a
`SamplingConfig` into vLLM's `SamplingParams`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_generate.target import Family
from dflash_shared.target_family import BY_NAME

log = logging.getLogger(__name__)
# The fields a target's generation_config.json or the user may set (the rest are the stage's own).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty")


class SamplingConfig(BaseModel):
    """Per-request sampling parameters (one value for the whole batch)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(ge=0.0, description="Softmax temperature; 0 means greedy decoding.")
    top_p: float = Field(gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(ge=-1, description="Keep the k most likely tokens; -1 or 0 keeps all.")
    min_p: float = Field(ge=0.0, le=1.0, description="Drop tokens below min_p x the top probability.")
    presence_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, description="Penalty on tokens already present (Qwen allows 0-2)."
    )
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=2.0, description="Multiplicative penalty on repeated tokens; 1 is none."
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most completion tokens per record; None fills the context (max_model_len - prompt).",
    )
    seed: int | None = Field(
        default=None,
        description=(
            "Base seed; when set, each record is sampled with a seed derived from it and the record id, "
            "so a record's random draws do not depend on which batch or shard it ran in (its logits "
            "still may, where kernels vary with batch shape)."
        ),
    )

    def record_seed(self, record_id: str) -> int | None:
        """The per-record seed (stable across runs and batchings), or None when unseeded."""
        if self.seed is None:
            return None
        digest = hashlib.sha256(f"{self.seed}:{record_id}".encode()).digest()
        return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF

    def as_record_dict(self) -> dict[str, Any]:
        """The parameters as stored in each CompletionRecord's `sampling` field."""
        return self.model_dump(mode="json")

    def with_overrides(self, **overrides: Any) -> SamplingConfig:
        """A copy with some fields replaced (validated like the original)."""
        return SamplingConfig.model_validate({**self.model_dump(), **overrides})


def default_sampling(enable_thinking: bool, family: Family = "qwen3") -> SamplingConfig:
    """The family's recommended sampling for the requested mode (dflash_shared.target_family)."""
    return SamplingConfig(**asdict(BY_NAME[family].sampling(enable_thinking)))


def qwen_thinking() -> SamplingConfig:
    """Qwen3's recommended values for thinking mode (greedy decoding is discouraged there)."""
    return default_sampling(True, "qwen3")


def qwen_non_thinking() -> SamplingConfig:
    """Qwen3's recommended values for non-thinking mode."""
    return default_sampling(False, "qwen3")


def generation_config_values(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields a generation_config.json sets, each checked as SamplingConfig checks it.

    A value out of range (or of the wrong type) is skipped with a warning: the preset then fills it.
    """
    found: dict[str, Any] = {}
    reference = qwen_thinking()
    for name in SAMPLING_FIELDS:
        value = generation_config.get(name)
        if value is None:
            continue
        try:
            if isinstance(value, bool):
                raise TypeError("a boolean")
            reference.with_overrides(**{name: value})
        except (ValidationError, TypeError) as err:
            log.warning("ignoring %s=%r from generation_config.json: %s", name, value, err)
            continue
        found[name] = value
    return found


@dataclass(frozen=True)
class SamplingChoice:
    """The sampling a run uses and, per field, where its value came from."""

    sampling: SamplingConfig
    # field -> "explicit", "generation_config" or "preset:<family>/<thinking|non_thinking>"
    sources: dict[str, str]


def choose_sampling(
    family: Family,
    enable_thinking: bool,
    generation_config: Mapping[str, Any] | None = None,
    explicit: Mapping[str, Any] | None = None,
    max_tokens: int | None = None,
    seed: int | None = None,
) -> SamplingChoice:
    """Each sampling field from the user, else the target's generation_config (the family's default mode), else
    the preset. Thinking on for a family without that mode is a ValueError."""
    preset_source = f"preset:{family}/{'thinking' if enable_thinking else 'non_thinking'}"
    values = default_sampling(enable_thinking, family).model_dump()
    sources = dict.fromkeys(SAMPLING_FIELDS, preset_source)
    # generation_config.json holds one set of values, the default mode's (thinking for Qwen3 and Qwen3.5/3.6, the
    # only mode for Qwen2.5): using them in the other mode would contradict the model card's values for it.
    default_mode = BY_NAME[family].thinks
    shipped = generation_config_values(generation_config or {}) if enable_thinking == default_mode else {}
    for layer, source in ((shipped, "generation_config"), (explicit or {}, "explicit")):
        for name, value in layer.items():
            if value is None:
                continue
            if name not in SAMPLING_FIELDS:
                raise ValueError(f"{name} is not a sampling field; expected one of {SAMPLING_FIELDS}")
            values[name] = value
            sources[name] = source
    sampling = SamplingConfig.model_validate({**values, "max_tokens": max_tokens, "seed": seed})
    return SamplingChoice(sampling, sources)
