"""The tokenize stage's one typed config: flags, DFLASH_TOKENIZE_* variables and defaults come from here."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from dflash_shared.quality import QualityPolicy
from dflash_shared.settings import StageSettings
from dflash_shared.window import DEFAULT_TRAINING_WINDOW


class TokenizeConfig(StageSettings):
    """
    Settings of `dflash-tokenize run` and `preflight`: flags, else DFLASH_TOKENIZE_* variables, else defaults.

    example:
      dflash-tokenize run --input store/completions --output store/tokenized --tokenizer models/Qwen3-8B
      dflash-tokenize preflight --input store/completions --output store/tokenized --tokenizer models/Qwen3-8B
    """

    model_config = SettingsConfigDict(env_prefix="DFLASH_TOKENIZE_")

    input: str = Field(description="Completions prefix (or its manifest.json URI) to read.")
    output: str = Field(description="Prefix to write the Arrow shards and the tokenized manifest to.")
    tokenizer: str = Field(
        description="Target model (or tokenizer) directory, local or s3://, with tokenizer.json and the chat "
        "template (tokenizer_config.json or chat_template.jinja)."
    )
    model_id: str | None = Field(
        default=None, description="Target model id to record; defaults to the completions' target or the path."
    )
    model_revision: str | None = Field(default=None, description="Target model revision to record.")
    run_id: str | None = Field(default=None, description="Run id; defaults to the completions manifest's.")
    mode: Literal["auto", "token_exact", "render"] = Field(
        default="auto",
        description="token_exact uses the engine's ids as they are; render applies the chat template; auto "
        "picks token_exact when the completions carry token ids.",
    )
    mask_policy: Literal["final_turn", "all_turns"] = Field(
        default="final_turn", description="Which assistant turns carry loss (render mode)."
    )
    enable_thinking: bool | None = Field(
        default=None,
        description="Thinking mode to render with; defaults to the completions' setting (True for imports).",
    )
    preserve_thinking: bool | None = Field(
        default=None,
        description="The chat template's preserve_thinking (Qwen3.6: keep the reasoning of every earlier "
        "assistant turn); unset leaves the template's default. Must match how the prompts were rendered.",
    )
    max_length: int = Field(
        default=DEFAULT_TRAINING_WINDOW, gt=16,
        description="Longest sequence written, in tokens: the training window (the train stage's default "
        "max_length; the generate stage's training_window should equal it).",
    )
    over_length: Literal["truncate", "drop"] = Field(
        default="truncate", description="What to do with longer records: cut at max_length, or drop them."
    )
    min_content_tokens: int = Field(default=4, ge=0, description="Answers shorter than this are rejected.")
    allow_truncated: bool = Field(
        default=False, description="Keep completions cut off at a length limit (finish_reason 'length') that "
        "keep_truncated_by_budget does not keep: imported ones, and any in render mode."
    )
    keep_truncated_by_budget: bool = Field(
        default=True, description="Keep (as truncated_by_budget) the generate stage's completions stopped at its "
        "budget, token_exact mode: the tokens are the target's own, a prefix of its answer; false rejects them "
        "as truncated."
    )
    reject_repetitive: bool = Field(
        default=True, description="Reject looping text; turn off only for targets that loop by design."
    )
    max_bad_fraction: float = Field(
        default=0.05, ge=0, le=1, description="Fail the stage when more records than this are unusable."
    )
    mask_token_id: int | None = Field(
        default=None, description="Drafter mask token id to record (must exist in the vocabulary)."
    )
    heldout_fraction: float = Field(
        default=0.01, ge=0, le=0.5,
        description="Share of records held out of training for evaluation, chosen by a hash of the content id "
        "(written to data/heldout/); 0 turns the split off and every record trains.",
    )
    heldout_min_records: int = Field(
        default=64, ge=0,
        description="On small inputs the held-out fraction is raised to hold out about this many records (at most "
        "half of the input); 0 = the fraction alone.",
    )
    shard_bytes: int = Field(default=256 * 2**20, gt=0, description="Target size of an output shard.")
    workers: int = Field(default=0, ge=0, description="Tokenizer processes; 0 means one per available core.")
    batch_records: int = Field(default=256, gt=0, description="Records sent to a worker process at once.")
    shard_index: int | None = Field(
        default=None, description="This worker's shard; defaults to JOB_COMPLETION_INDEX."
    )
    num_shards: int | None = Field(default=None, description="Worker count; defaults to DFLASH_NUM_SHARDS or 1.")
    scratch_dir: str | None = Field(default=None, description="Local scratch directory (default: system temp).")
    disk_need_gib: float = Field(
        default=2.0, ge=0, description="Free scratch disk preflight requires (two shards plus the tokenizer)."
    )

    def template_kwargs(self) -> dict[str, bool]:
        """Chat template variables besides enable_thinking; a setting left unset is not passed at all."""
        return {} if self.preserve_thinking is None else {"preserve_thinking": self.preserve_thinking}

    def quality_policy(self) -> QualityPolicy:
        return QualityPolicy(
            min_content_tokens=self.min_content_tokens,
            allow_truncated=self.allow_truncated,
            keep_truncated_by_budget=self.keep_truncated_by_budget,
            max_bad_fraction=self.max_bad_fraction,
            reject_repetitive=self.reject_repetitive,
        )
