"""Sampling settings of the generate stage and Qwen's recommended defaults.

The drafter learns the target's own distribution, so completions are sampled with the settings the model
is meant to run with: Qwen recommends different values for thinking and non-thinking mode. This module
has no vLLM import; the engine turns a `SamplingConfig` into vLLM's `SamplingParams`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


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


def qwen_thinking() -> SamplingConfig:
    """Qwen3's recommended values for thinking mode (greedy decoding is discouraged there)."""
    return SamplingConfig(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0)


def qwen_non_thinking() -> SamplingConfig:
    """Qwen3's recommended values for non-thinking mode."""
    return SamplingConfig(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0)


def default_sampling(enable_thinking: bool) -> SamplingConfig:
    """The recommended sampling for the requested mode."""
    return qwen_thinking() if enable_thinking else qwen_non_thinking()
