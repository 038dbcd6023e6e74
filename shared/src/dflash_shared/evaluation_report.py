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


class LearnabilityGate(_Frozen):
    """A fresh drafter of the run's shape, trained to memorise the target's answers to a few prompts, exported and
    decoding those prompts (dflash_train.evaluate.learnability): nearly every drafted token should be accepted."""

    documents: int = Field(description="Prompts whose answers the gate's drafter memorised.")
    new_tokens: int = Field(description="Tokens of each answer (the target's greedy output) and of each decode.")
    train_steps: int = Field(description="Training steps run (it stops once the answers are memorised).")
    train_accuracy: float = Field(description="Share of trained labels predicted at the last step.")
    min_acceptance: float = Field(description="Least share of drafted tokens accepted for the gate to pass.")
    acceptance_rate: float = Field(description="Drafted tokens accepted, over drafted tokens (block_size - 1 a step).")
    drafter_export: str = Field(description="Where the gate's drafter was exported to (the serving check loads it).")
    acceptance: Acceptance = Field(description="The offline loop over the memorised prompts.")
    results: list[PromptResult] = Field(description="Per-prompt outputs and acceptance.")

    @property
    def passed(self) -> bool:
        return self.acceptance_rate >= self.min_acceptance

    def summary(self) -> str:
        return (f"{'passed' if self.passed else 'FAILED'}: {100 * self.acceptance_rate:.1f}% of drafted tokens "
                f"accepted (at least {100 * self.min_acceptance:.0f}% required), tau {self.acceptance.tau:.2f} over "
                f"{self.documents} memorised prompts; training predicted {100 * self.train_accuracy:.1f}% of its "
                f"labels after {self.train_steps} steps")


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
    learnability: LearnabilityGate | None = Field(default=None, description="The learnability gate, where it ran.")

    def learnability_replay(self) -> OfflineReport | None:
        """The gate's prompts and outputs as a report of their own, for the serving check to replay with the gate's
        export; None where the gate did not run."""
        gate = self.learnability
        if gate is None:
            return None
        return self.model_copy(update={
            "max_new_tokens": gate.new_tokens, "drafter_export": gate.drafter_export, "prompt_split": "train",
            "trained": gate.acceptance, "untrained": None, "training_acceptance_per_position": [],
            "training_expected_tau": None, "lossless_checked": 0, "lossless_mismatches": [], "lossless": None,
            "lossless_untrained": None, "results": gate.results, "prompt_sets": {}, "learnability": None})


def parse_report(uri: str, data: bytes) -> OfflineReport:
    """An `evaluation.json` read back, or BadInputError naming the file and the fields that do not match: a
    report written by another version of the evaluate stage must not be replayed half understood."""
    try:
        return OfflineReport.model_validate_json(data)
    except ValidationError as e:
        fields = sorted({".".join(str(p) for p in err["loc"]) or "(document)" for err in e.errors()})
        raise BadInputError(f"{uri} is not an evaluation report of this version ({e.error_count()} error(s) at "
                            f"{', '.join(fields[:5])}): rerun `dflash-train evaluate` with the same images") from e
