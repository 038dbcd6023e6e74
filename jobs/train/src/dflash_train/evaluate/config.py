"""Typed config of `dflash-train evaluate` (flags, DFLASH_EVALUATE_* variables, the debug preset).

No torch import here: `--help` and config errors are answered before the heavy libraries load.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from dflash_shared.lossless import NumericsSettings
from dflash_shared.settings import StageSettings

# Set names become metric keys (tau_<name>).
SET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_names(sets: dict[str, str]) -> None:
    """Set names become metric keys (tau_<name>): letters, digits, '_', '.', '-'."""
    for name in sets:
        if not SET_NAME.match(name):
            raise ValueError(f"prompt set name {name!r}: use letters, digits, '_', '.' or '-' (e.g. gsm8k)")


class EvaluateConfig(StageSettings, NumericsSettings):
    """Acceptance of an exported drafter on held-out prompts with the offline speculative loop."""

    model_config = SettingsConfigDict(env_prefix="DFLASH_EVALUATE_")

    preset: Literal["none", "debug"] = Field(
        default="none", description="'debug' fills unset settings for a CPU run of a few minutes on a tiny target."
    )
    drafter: str = Field(description="Export prefix written by `dflash-train export` (or its manifest.json URI).")
    prompts: str = Field(
        description="Prompts to decode: a tokenized prefix (the run's own: its `split` is used), or a prompts or "
        "completions prefix (all of it), or a manifest.json URI. Completions and tokenized records contribute "
        "their prompt part only."
    )
    split: Literal["heldout", "train"] = Field(
        default="heldout",
        description="Which split of a tokenized `prompts` manifest to decode: heldout (records training never "
        "read) or train (records it trained on: an optimistic tau).",
    )
    prompt_sets: dict[str, str] = Field(
        default_factory=dict,
        description="User prompt sets, name -> JSONL file (local or s3://), e.g. gsm8k=/data/gsm8k.jsonl,mtbench="
        "/data/mt.jsonl; one prompt a line: 'messages', MT-Bench 'turns' (first turn), GSM8K 'question', MATH500 "
        "'problem' or HumanEval 'prompt'. Each set's first num_prompts are decoded and reported as tau_<name>.",
    )
    target: str = Field(description="Target model directory or s3:// prefix (copied to local scratch).")
    output: str = Field(description="Evaluation prefix, e.g. <run>/evaluation-offline.")
    run_id: str | None = Field(default=None, description="Run id; defaults to the drafter manifest's.")
    num_prompts: int = Field(
        default=64, ge=1,
        description="Prompts evaluated (the first usable ones, in shard order); as many from each prompt set.",
    )
    skip_prompts: int = Field(default=0, ge=0, description="Prompts skipped before the evaluated ones.")
    max_new_tokens: int = Field(default=256, ge=1, description="Tokens generated per prompt.")
    max_prompt_tokens: int = Field(
        default=4096, ge=1, description="Longer prompts are skipped (counted under 'too_long')."
    )
    block_size: int | None = Field(
        default=None, ge=2, description="Block size of the loop (num_speculative_tokens + 1); default: the export's."
    )
    min_tau: float = Field(
        default=1.5, ge=0, description="Fail (exit 65) when the offline mean acceptance length is below this."
    )
    baseline_prompts: int = Field(
        default=8, ge=0, description="Prompts also decoded with an untrained drafter of the same shape (0 = off)."
    )
    lossless_prompts: int = Field(
        default=16, ge=0, description="Prompts also decoded by the target alone: the loop's output (and the "
        "untrained drafter's) is compared with it position by position under the numerics policy.",
    )
    position_bucket_tokens: int = Field(
        default=4096, ge=1,
        description="Width of the context-length buckets tau is also reported by (0-4K, 4K-8K, ...).",
    )
    seed: int = Field(default=0, description="Seed of the untrained baseline drafter.")
    learnability_documents: int = Field(
        default=0, ge=0, description="Learnability gate (evaluate.learnability): a fresh drafter of the run's shape "
        "memorises the target's answers to this many of the prompts, is exported, and must then have "
        "learnability_min_acceptance of its drafted tokens accepted on them (0 = off; the pilot runs it).",
    )
    learnability_new_tokens: int = Field(
        default=64, ge=2, description="Learnability gate: tokens of each memorised answer; at most max_new_tokens "
        "(the serving check sizes its engine's context by that)."
    )
    learnability_steps: int = Field(
        default=400, ge=1, description="Learnability gate: most training steps (it stops once memorised)."
    )
    learnability_lr: float = Field(default=3e-3, gt=0, description="Learnability gate: the learning rate.")
    learnability_min_acceptance: float = Field(
        default=0.9, ge=0, le=1, description="Learnability gate: least share of drafted tokens accepted."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="Where to run; auto prefers CUDA.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="Dtype of target and drafter alike; auto = bfloat16 on CUDA, float32 on CPU. Compare with a "
        "serving check only at the same dtype.",
    )
    threads: int | None = Field(default=None, ge=1, description="CPU threads for torch (default: torch's choice).")
    scratch_dir: str | None = Field(default=None, description="Local scratch for a copied target or export.")

    @model_validator(mode="after")
    def _gate_within_budget(self) -> EvaluateConfig:
        if self.learnability_documents > self.num_prompts:
            raise ValueError(f"learnability_documents {self.learnability_documents} is above num_prompts "
                             f"{self.num_prompts}: the gate memorises the first of the evaluated prompts")
        return self

    @field_validator("prompt_sets")
    @classmethod
    def _set_names(cls, sets: dict[str, str]) -> dict[str, str]:
        check_names(sets)
        return sets

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset", "none") == "debug":
            data = {**DEBUG_EVALUATE, **data}
        return data


# What `--preset debug` sets unless given: a tiny CPU run in float32 (the serving check compares at float32).
DEBUG_EVALUATE: dict[str, Any] = {
    "num_prompts": 16,
    "max_new_tokens": 64,
    "baseline_prompts": 2,
    "lossless_prompts": 2,
    "device": "cpu",
    "dtype": "float32",
    "learnability_new_tokens": 24,  # the gate's training over the full vocabulary is most of its CPU time
}
