"""`evaluation.json`: the offline evaluation's report, a contract between two images.

`dflash-train evaluate` (train image) writes it; `dflash-generate serve-check` (generator image) replays its
prompts in the engine and compares acceptance step by step against its per-prompt traces. One schema, strict on
both sides: a field renamed or dropped on one side fails the reading side at once instead of being ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_shared.errors import BadInputError
from dflash_shared.lossless import Equivalence

REPORT_NAME = "evaluation.json"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PositionBucket(_Frozen):
    """Acceptance of the steps that drafted at context lengths within one bucket."""

    tau: float = Field(description="Mean acceptance length of the bucket's steps.")
    steps: int = Field(description="Verification steps in the bucket.")


class Acceptance(_Frozen):
    """Acceptance statistics of one drafter over a set of decoded prompts."""

    tau: float = Field(description="Mean acceptance length: accepted draft tokens + 1, over all steps.")
    steps: int = Field(description="Verification steps (drafts) counted.")
    accepted_tokens: int = Field(description="Draft tokens accepted in all steps.")
    acceptance_per_position: list[float] = Field(description="Fraction of steps accepted at least to slot k.")
    tau_histogram: dict[str, int] = Field(description="Steps per acceptance length.")
    generated_tokens: int = Field(description="Tokens generated over all prompts.")
    target_forwards: int = Field(description="Target passes: one prefill per prompt plus one per step.")
    tokens_per_target_forward: float = Field(description="generated_tokens / target_forwards.")
    prompts: int = Field(description="Prompts decoded.")
    by_position: dict[str, PositionBucket] = Field(
        default_factory=dict, description="Acceptance by the context length at which each step drafted, e.g. "
        "'0-4K', '4K-8K' (prompt + tokens generated before the step).")


class PromptResult(_Frozen):
    """One held-out prompt as the loop decoded it."""

    id: str = Field(description="Record id of the prompt.")
    prompt_token_ids: list[int] = Field(description="Prompt ids fed to the target (rendered, template applied).")
    output_token_ids: list[int] = Field(description="Generated ids (stop token included when reached).")
    accepted: list[int] = Field(description="Accepted draft tokens per verification step.")


class PromptSetReport(_Frozen):
    """Acceptance of the exported drafter on one user prompt set."""

    uri: str = Field(description="The set's JSONL file.")
    acceptance: Acceptance = Field(description="The exported drafter over the set's decoded prompts.")
    bad_lines: list[str] = Field(description="Lines that could not be used, as 'file:line: why'.")


class OfflineReport(_Frozen):
    """Content of `evaluation.json`: settings, per-prompt results and summaries of the offline loop."""

    block_size: int = Field(description="Block size B of the loop (num_speculative_tokens = B - 1).")
    max_new_tokens: int = Field(description="Generation budget per prompt.")
    stop_token_ids: list[int] = Field(description="Ids that end a generation (kept in the output).")
    dtype: str = Field(description="Dtype of target and drafter.")
    drafter_export: str = Field(description="Export directory the drafter was loaded from.")
    prompt_split: Literal["heldout", "train", "all"] = Field(
        description="Which prompts `results` are: a tokenized manifest's held-out or train split, or all of a "
        "prompts or completions manifest.")
    trained: Acceptance = Field(description="The exported drafter.")
    untrained: Acceptance | None = Field(description="An untrained drafter of the same shape, first prompts.")
    training_acceptance_per_position: list[float] = Field(description="Per-slot accuracy logged by training.")
    training_expected_tau: float | None = Field(description="tau implied by the training accuracies.")
    lossless_checked: int = Field(description="Prompts also decoded by the target alone.")
    lossless_mismatches: list[str] = Field(
        description="Ids of prompts whose outputs differ beyond the numerics policy (should be none).")
    lossless: Equivalence | None = Field(
        default=None, description="The exported drafter's output against the target's greedy output (lossless.py).")
    lossless_untrained: Equivalence | None = Field(
        default=None, description="The same check for the untrained drafter on its prompts.")
    results: list[PromptResult] = Field(description="Per-prompt outputs and acceptance.")
    prompt_sets: dict[str, PromptSetReport] = Field(default_factory=dict, description="Per user prompt set.")


def parse_report(uri: str, data: bytes) -> OfflineReport:
    """An `evaluation.json` read back, or BadInputError naming the file and the fields that do not match: a
    report written by another version of the evaluate stage must not be replayed half understood."""
    try:
        return OfflineReport.model_validate_json(data)
    except ValidationError as e:
        fields = sorted({".".join(str(p) for p in err["loc"]) or "(document)" for err in e.errors()})
        raise BadInputError(f"{uri} is not an evaluation report of this version ({e.error_count()} error(s) at "
                            f"{', '.join(fields[:5])}): rerun `dflash-train evaluate` with the same images") from e
