"""The generate stage's one typed config: flags, DFLASH_GENERATE_* variables and defaults come from here.

Some defaults depend on the target (its family and generation_config.json): sampling values and the
generation budget. Those fields default to None here and are settled by `GenerateConfig.settle` once the
target's config files are read (`dflash_generate.target`).

The budget is capped to the training window by default (`dflash_shared.window`): the engine's context is
the window, so each prompt gets min(max_new_tokens, training_window - its tokens) and no token is generated
that a training step never reads. Without the cap (the family budgets, 32K for Qwen3.6's long thinking) a
4,096-token window would leave ~40% of the generated tokens unread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from dflash_generate.engine import EngineConfig
from dflash_generate.sampling import SAMPLING_FIELDS, SamplingChoice, SamplingConfig, choose_sampling
from dflash_generate.target import Family, TargetInfo
from dflash_shared.errors import ConfigError
from dflash_shared.quality import QualityPolicy
from dflash_shared.settings import StageSettings
from dflash_shared.target_family import BY_NAME
from dflash_shared.window import DEFAULT_TRAINING_WINDOW

# Sampling fields that may override the target's defaults.
SAMPLING_OVERRIDES = SAMPLING_FIELDS


@dataclass(frozen=True)
class GenerationSettings:
    """The target-dependent settings of a run, settled: sampling (with sources) and the length budget."""

    family: Family
    enable_thinking: bool  # the mode prompts are rendered in: the config's, else the family's default
    choice: SamplingChoice
    max_new_tokens: int
    max_model_len: int
    # The window the generated tokens are accounted against, and whether max_model_len is that window.
    training_window: int = DEFAULT_TRAINING_WINDOW
    capped_to_window: bool = False

    @property
    def sampling(self) -> SamplingConfig:
        return self.choice.sampling


class GenerateConfig(StageSettings):
    model_config = SettingsConfigDict(env_prefix="DFLASH_GENERATE_")

    input: str = Field(description="Prompts prefix (or its manifest.json URI), as written by `import`.")
    output: str = Field(description="Prefix to write the completion shards and the completions manifest to.")
    model: str = Field(
        description="Target model: a local directory, an s3:// prefix (copied to local disk first) or a model "
        "id on a hub the cluster reaches (token from the HF_TOKEN environment variable, never recorded)."
    )
    model_id: str | None = Field(default=None, description="Model id to record; defaults to `model`.")
    model_revision: str | None = Field(
        default=None, description="Hub revision to download (branch, tag or commit) and the revision to record."
    )
    model_cache_dir: str | None = Field(
        default=None, description="Where an s3:// or hub model is copied to (default: under the scratch dir)."
    )
    download_workers: int = Field(default=16, ge=1, description="Files copied in parallel from S3 or the hub.")
    run_id: str | None = Field(default=None, description="Run id; defaults to the prompts manifest's.")
    enable_thinking: bool | None = Field(
        default=None, description="Render prompts with thinking mode on (recorded). Default: on where the target's "
        "family has a thinking mode (Qwen3, Qwen3.5/3.6), off where it has none (Qwen2.5), which refuses it on.")
    training_window: int = Field(
        default=DEFAULT_TRAINING_WINDOW, gt=16,
        description="Tokens per record (prompt + completion) the train stage reads: its max_length. The "
        "completions are accounted against it (tokens inside it, in the manifest) and, with "
        "cap_to_training_window, stopped at it.",
    )
    cap_to_training_window: bool = Field(
        default=True,
        description="Stop each completion where the training window ends: the engine's context is the window, "
        "so a prompt's budget is min(max_new_tokens, training_window - its tokens) and a completion stopped "
        "there is kept as truncated_by_budget. False generates the whole max_new_tokens (traces kept for a "
        "longer window later; the tokens past this window are paid for and not trained on).",
    )
    max_new_tokens: int | None = Field(
        default=None, gt=0, description="Most completion tokens per prompt; default: the training window less "
        "one (capped), else per target family: 32768 for Qwen3.5/3.6 (long thinking), 8192 otherwise."
    )
    max_model_len: int | None = Field(
        default=None, gt=1, description="Engine context: prompt plus completion tokens; default: the training "
        "window (capped; a longer one is refused), else per target family: 40960 for Qwen3.5/3.6, 16384 "
        "otherwise (with an explicit max_new_tokens: at least 8192 more)."
    )
    temperature: float | None = Field(
        default=None, ge=0, description="Sampling temperature; default: the target's generation_config.json "
        "(thinking mode), else its family's recommendation for the mode (as every sampling field)."
    )
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus mass; default: the target's.")
    top_k: int | None = Field(default=None, ge=-1, description="Top-k (-1 or 0 keeps all); default: the target's.")
    min_p: float | None = Field(default=None, ge=0, le=1, description="Min-p; default: the target's.")
    presence_penalty: float | None = Field(
        default=None, ge=-2, le=2, description="Presence penalty; default: the target's."
    )
    repetition_penalty: float | None = Field(
        default=None, gt=0, le=2, description="Repetition penalty (1: none); default: the target's."
    )
    seed: int | None = Field(
        default=None,
        description="Base of per-record seeds (a record's draws then do not depend on its batch); None samples "
        "unseeded, which is faster on GPUs.",
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs each engine shards the model over.")
    data_parallel_size: int = Field(
        default=1, ge=1, description="Engines per pod, each on its own tensor_parallel_size GPUs."
    )
    data_parallel_rank: int | None = Field(
        default=None, ge=0, description="Set by the pod's launcher for each of its engine processes; leave unset."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="Weight and activation dtype ('auto': the model config's)."
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="Accelerator memory vLLM may use.")
    enforce_eager: bool = Field(default=False, description="No CUDA graphs / compilation (faster start).")
    max_num_seqs: int | None = Field(default=None, ge=1, description="Sequences decoded at once (vLLM default).")
    chunk_records: int = Field(
        default=512, gt=0, description="Prompts per committed chunk file: the unit of resumption."
    )
    max_inflight: int | None = Field(
        default=None, ge=1, description="Prompts inside the engine at once (default: chunk_records); the most "
        "work a preemption can lose.",
    )
    end_of_turn: str = Field(default="<|im_end|>", description="The target's end-of-turn token (recorded).")
    think_start: str = Field(default="<think>", description="The target's think-open token, if it has one.")
    think_end: str = Field(default="</think>", description="The target's think-close token, if it has one.")
    max_bad_fraction: float = Field(
        default=0.05, ge=0, le=1, description="Fail when more prompts than this cannot be generated (bad input)."
    )
    fail_fast_window: int = Field(
        default=64, gt=0, description="First completions of each engine process checked for degenerate output."
    )
    fail_fast_max_bad_fraction: float = Field(
        default=0.5, ge=0, le=1, description="Stop when more of that window than this is degenerate (1 disables)."
    )
    min_content_tokens: int = Field(default=4, ge=0, description="Shorter answers count as degenerate.")
    reject_repetitive: bool = Field(
        default=True, description="Count looping text as degenerate; turn off only for targets that loop by design."
    )
    allow_truncated: bool = Field(
        default=False, description="Do not count length-cut completions as degenerate in the fail-fast check, "
        "even with keep_truncated_by_budget off."
    )
    keep_truncated_by_budget: bool = Field(
        default=True, description="A completion stopped at the budget (finish_reason 'length') is a prefix of "
        "the target's answer: kept and counted as truncated_by_budget, not degenerate (unless it loops or has "
        "fewer than min_content_tokens tokens); false counts it as truncated."
    )
    progress_every_s: float = Field(
        default=300.0, gt=0,
        description="Seconds between each worker's status report in the store (<output>/_status/worker-N.json: "
        "chunks, prompts, tokens, rate, ETA), read by `pipeline status`.",
    )
    shard_index: int | None = Field(default=None, description="This pod's shard; defaults to JOB_COMPLETION_INDEX.")
    num_shards: int | None = Field(default=None, description="Pod count; defaults to DFLASH_NUM_SHARDS or 1.")
    scratch_dir: str | None = Field(default=None, description="Local scratch directory (default: system temp).")
    disk_need_gib: float = Field(
        default=4.0, ge=0, description="Free scratch disk preflight requires besides the model copy."
    )
    min_shm_gib: float = Field(default=1.0, ge=0, description="/dev/shm size preflight requires (0 skips).")
    min_gpu_memory_gib: float = Field(default=0.0, ge=0, description="Memory preflight requires on each GPU.")

    @model_validator(mode="after")
    def _consistent(self) -> GenerateConfig:
        if self.max_new_tokens is not None and self.max_model_len is not None:
            _check_limits(self.max_new_tokens, self.max_model_len)
        if self.cap_to_training_window:
            _check_window(self.max_new_tokens, self.max_model_len, self.training_window)
        if self.data_parallel_rank is not None and self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {self.data_parallel_rank} is out of range for data_parallel_size "
                f"{self.data_parallel_size}"
            )
        return self

    @property
    def inflight(self) -> int:
        return self.max_inflight or self.chunk_records

    def settle(self, target: TargetInfo | None = None) -> GenerationSettings:
        """The target-dependent settings: what this config sets explicitly, the rest from the target."""
        target = target or TargetInfo()
        explicit: dict[str, Any] = {k: getattr(self, k) for k in SAMPLING_OVERRIDES if getattr(self, k) is not None}
        max_new_tokens, max_model_len = generation_limits(
            target.family, self.cap_to_training_window, self.training_window, self.max_new_tokens, self.max_model_len
        )
        try:
            _check_limits(max_new_tokens, max_model_len)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        try:
            thinking = BY_NAME[target.family].mode(self.enable_thinking)
        except ValueError as err:  # thinking on for a family without that mode
            raise ConfigError(f"enable_thinking: {err}") from err
        choice = choose_sampling(target.family, thinking, target.generation_config, explicit,
                                 max_tokens=max_new_tokens, seed=self.seed)
        return GenerationSettings(target.family, thinking, choice, max_new_tokens, max_model_len,
                                  self.training_window, self.cap_to_training_window)

    def sampling(self, target: TargetInfo | None = None) -> SamplingConfig:
        """The sampling for the thinking mode on `target` (default: a Qwen3 without generation_config)."""
        return self.settle(target).sampling

    def engine_config(self, model_dir: str, max_model_len: int | None = None) -> EngineConfig:
        return EngineConfig(
            model=model_dir,
            dtype=self.dtype,
            max_model_len=max_model_len or self.settle().max_model_len,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            seed=self.seed or 0,
            max_num_seqs=self.max_num_seqs,
        )

    def quality_policy(self) -> QualityPolicy:
        return QualityPolicy(
            min_content_tokens=self.min_content_tokens,
            allow_truncated=self.allow_truncated,
            keep_truncated_by_budget=self.keep_truncated_by_budget,
            reject_repetitive=self.reject_repetitive,
        )


def generation_limits(
    family: Family, capped: bool, training_window: int, max_new_tokens: int | None, max_model_len: int | None
) -> tuple[int, int]:
    """(max_new_tokens, max_model_len): explicit values, else the window's (`capped`: cap_to_training_window) or
    the family's. `pipeline plan` sizes generation with this rule too."""
    # The family's own budget (dflash_shared.target_family) when none is set and it is not capped to the window.
    default_new, default_len = BY_NAME[family].max_new_tokens, BY_NAME[family].max_model_len
    if capped:
        # The window is the context: vLLM then stops every completion at training_window - prompt tokens.
        max_model_len = max_model_len or training_window
        return max_new_tokens or min(default_new, max_model_len - 1), max_model_len
    max_new_tokens = max_new_tokens or default_new
    # An explicit budget keeps the default room for prompts beside it.
    return max_new_tokens, max_model_len or max(default_len, max_new_tokens + default_len - default_new)


def _check_limits(max_new_tokens: int, max_model_len: int) -> None:
    if max_new_tokens >= max_model_len:
        raise ValueError(
            f"max_new_tokens ({max_new_tokens}) must be below max_model_len ({max_model_len}), "
            "or no prompt would fit beside a full completion"
        )


def _check_window(max_new_tokens: int | None, max_model_len: int | None, window: int) -> None:
    """With the budget capped to the window, an explicit limit past it would generate what no step reads."""
    # The context may equal the window; a completion budget must leave room for a prompt inside it.
    for name, value, most in (("max_model_len", max_model_len, window), ("max_new_tokens", max_new_tokens,
                                                                          window - 1)):
        if value is not None and value > most:
            raise ValueError(
                f"{name} ({value}) does not fit inside training_window ({window}), where cap_to_training_window "
                f"stops every completion: set training_window to the train stage's max_length, leave {name} "
                "unset, or set cap_to_training_window false to generate past the window on purpose"
            )
