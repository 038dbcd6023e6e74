"""Settings of `dflash-generate serve-check`: torch- and vLLM-free, so the pipeline reads them without either."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from dflash_generate.ngram_baseline import NgramSettings
from dflash_shared.lossless import NumericsSettings
from dflash_shared.settings import StageSettings

STAGE = "serve-check"
REPORT_NAME = "serve-check.json"


class ServeCheckConfig(StageSettings, NumericsSettings):
    """Settings of `dflash-generate serve-check` (flags, DFLASH_SERVE_CHECK_* variables)."""

    model_config = SettingsConfigDict(env_prefix="DFLASH_SERVE_CHECK_")

    evaluation: str = Field(description="Offline evaluation prefix written by `dflash-train evaluate`.")
    target: str = Field(description="Target model: a local directory, an s3:// prefix or a hub model id.")
    output: str = Field(description="Evaluation prefix to commit, e.g. <run>/evaluation.")
    max_tau_gap: float = Field(
        default=0.10, ge=0, description="Largest relative gap |engine tau - offline tau| / offline tau allowed."
    )
    require_identical_outputs: bool = Field(
        default=True, description="Fail when greedy output with speculation differs from output without it."
    )
    max_step_mismatch_fraction: float = Field(
        default=0.02, ge=0, le=1, description="Largest share of the drafter steps, offline and engine (over the "
        "prompts both decoded alike), that one side takes otherwise: another position, draft count or acceptance "
        "(serve_steps.py).",
    )
    min_matched_fraction: float = Field(
        default=0.5, ge=0, le=1, description="Engine at another dtype than the offline evaluation: least share of "
        "prompts it must decode as the offline loop did; the tau gap is taken over those.",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="Engine dtype; auto = the offline evaluation's (they must be the same), or the "
        "engine's only dtype for the target where it has one.",
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="Engine context; default: longest prompt + max_new_tokens + block size."
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="Accelerator memory vLLM may take.")
    enforce_eager: bool = Field(default=False, description="Skip graph capture and compilation (faster start).")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs the target is sharded over.")
    max_num_seqs: int | None = Field(default=None, ge=1, description="Most sequences decoded at once.")
    model_cache_dir: str | None = Field(default=None, description="Where an s3:// or hub target is copied to.")
    download_workers: int = Field(default=16, ge=1, description="Files copied in parallel.")
    run_id: str | None = Field(default=None, description="Run id; defaults to the offline evaluation's.")
    ngram_baseline: bool = Field(
        default=False, description="Also decode the prompts with vLLM's n-gram speculation (no training needed) "
        "and report its acceptance beside the drafter's: one more engine start.")
    ngram_num_speculative_tokens: int = Field(default=3, ge=1, description="n-gram baseline: tokens per draft.")
    ngram_prompt_lookup_min: int = Field(default=1, ge=1, description="n-gram baseline: shortest match.")
    ngram_prompt_lookup_max: int = Field(default=4, ge=1, description="n-gram baseline: longest match.")

    @model_validator(mode="after")
    def _lookup_range(self) -> ServeCheckConfig:
        # vLLM refuses min > max only when the third engine starts, after the two others have run: refuse it here.
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError(f"ngram_prompt_lookup_min {self.ngram_prompt_lookup_min} is above "
                             f"ngram_prompt_lookup_max {self.ngram_prompt_lookup_max}")
        return self

    def ngram_settings(self) -> NgramSettings | None:
        if not self.ngram_baseline:
            return None
        return NgramSettings(num_speculative_tokens=self.ngram_num_speculative_tokens,
                             prompt_lookup_min=self.ngram_prompt_lookup_min,
                             prompt_lookup_max=self.ngram_prompt_lookup_max)
