"""The contract between stages: one manifest envelope, a typed section per kind.

Every stage output prefix holds a `manifest.json` written LAST, as the commit point of the stage. It says
who produced the data (stage, image, git revision, package versions, resolved config), what it was made
from (input manifests by URI and sha256), which shards hold it (URI, bytes, sha256, counts), how every
input record was accounted for, and the fields that must agree across stages (target identity, tokenizer
and template hashes, thinking mode, special token ids). A stage reading a manifest goes through
`dflash_shared.manifest_io.load_manifest`, which checks all of that before any expensive work starts.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# 2: shard, input and checkpoint locations are relative to the manifest's own prefix when inside the run root.
SCHEMA_VERSION = 2
MANIFEST_NAME = "manifest.json"


class Kind(StrEnum):
    prompts = "prompts"
    completions = "completions"
    tokenized = "tokenized"
    drafter = "drafter"
    evaluation = "evaluation"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Producer(_Frozen):
    stage: str = Field(description="Stage (or command) that wrote the manifest.")
    image: str | None = Field(default=None, description="Container image reference, when run in one.")
    git_revision: str | None = Field(default=None, description="Source revision of the producing code.")
    package_versions: dict[str, str] = Field(default_factory=dict, description="Key package versions.")
    config: dict[str, Any] = Field(default_factory=dict, description="The resolved stage config (no secrets).")
    settings_sha256: str | None = Field(
        default=None, description="Digest of the settings and image every shard (or every resume) ran with "
        "(dflash_shared.stage_identity); None where not recorded.")


class InputRef(_Frozen):
    uri: str = Field(description="URI of an input manifest; relative to this one's prefix when inside the run root.")
    sha256: str = Field(description="sha256 of that manifest's bytes when it was read.")
    kind: Kind = Field(description="Kind of that manifest.")


class Shard(_Frozen):
    uri: str = Field(description="URI of the shard object; relative to the manifest's prefix when inside the run root.")
    bytes: int = Field(ge=0, description="Size of the object in bytes.")
    sha256: str = Field(description="sha256 of the object's bytes.")
    records: int = Field(ge=0, description="Records stored in the shard.")
    tokens: int | None = Field(default=None, ge=0, description="Tokens stored, where that applies.")
    split: Literal["train", "heldout"] | None = Field(
        default=None, description="Tokenized shards: training data, or held out of training for evaluation."
    )


class Accounting(_Frozen):
    """Where every input record went. input_records = succeeded + failed + skipped, always."""

    input_records: int = Field(ge=0, description="Records read from the inputs.")
    succeeded: int = Field(ge=0, description="Records written to the shards.")
    failed: int = Field(ge=0, description="Records rejected as bad input.")
    skipped: int = Field(ge=0, description="Records left out on purpose (duplicates, policy).")
    failures_by_reason: dict[str, int] = Field(default_factory=dict, description="Failed count per reason.")
    skips_by_reason: dict[str, int] = Field(default_factory=dict, description="Skipped count per reason.")
    examples: dict[str, list[str]] = Field(
        default_factory=dict, description="A few examples per reason: record id or source and the message."
    )

    @model_validator(mode="after")
    def _balanced(self) -> Accounting:
        total = self.succeeded + self.failed + self.skipped
        if total != self.input_records:
            raise ValueError(
                f"accounting does not balance: succeeded {self.succeeded} + failed {self.failed} + "
                f"skipped {self.skipped} = {total}, but input_records is {self.input_records}"
            )
        if sum(self.failures_by_reason.values()) != self.failed:
            raise ValueError(f"failures_by_reason {self.failures_by_reason} does not sum to failed={self.failed}")
        if sum(self.skips_by_reason.values()) != self.skipped:
            raise ValueError(f"skips_by_reason {self.skips_by_reason} does not sum to skipped={self.skipped}")
        return self


class SpecialTokens(_Frozen):
    end_of_turn: int = Field(description="Id of the end-of-turn token (Qwen: <|im_end|>).")
    think_start: int | None = Field(default=None, description="Id of <think>, when the vocabulary has it.")
    think_end: int | None = Field(default=None, description="Id of </think>, when the vocabulary has it.")
    mask: int | None = Field(default=None, description="Drafter mask token id (an existing embedding row).")


class TargetIdentity(_Frozen):
    """The fields that must agree across stages: a mismatch here is what collapses served acceptance."""

    model_id: str = Field(description="Target model id or path as configured.")
    revision: str | None = Field(default=None, description="Target model revision (commit or tag).")
    tokenizer_sha256: str = Field(description="sha256 of the target's tokenizer.json.")
    chat_template_sha256: str = Field(description="sha256 of the chat template text used.")
    enable_thinking: bool = Field(description="Whether thinking mode was on when rendering/generating.")
    special_tokens: SpecialTokens = Field(description="Special token ids in the target vocabulary.")


class PromptsSection(_Frozen):
    kind: Literal[Kind.prompts] = Kind.prompts
    sources: list[str] = Field(description="Source files or prefixes the prompts were imported from.")
    duplicates: int = Field(ge=0, description="Records dropped because their content id was seen before.")
    prompt_tokens: int | None = Field(
        default=None, ge=0, description="Tokens of the prompts kept, rendered with the target's chat template and "
        "thinking mode (import's tokenizer); None where they were not counted.")
    longest_prompt_tokens: int | None = Field(
        default=None, ge=0, description="Tokens of the longest prompt kept; None where they were not counted.")


class CompletionsSection(_Frozen):
    kind: Literal[Kind.completions] = Kind.completions
    target: TargetIdentity | None = Field(
        description="Target that generated the completions; None for imported external data."
    )
    has_token_ids: bool = Field(description="Records carry the engine's prompt and completion token ids.")
    sampling: dict[str, Any] = Field(default_factory=dict, description="Sampling parameters used.")
    sampling_sources: dict[str, str] = Field(
        default_factory=dict,
        description="Where each sampling value came from: 'explicit' (the user), 'generation_config' (the "
        "target's generation_config.json) or 'preset:<family>/<thinking|non_thinking>'; empty for imports.",
    )
    target_family: str | None = Field(
        default=None, description="Target family the defaults were chosen for ('qwen3', 'qwen3_5'); None for imports."
    )
    max_new_tokens: int | None = Field(default=None, description="Generation budget per prompt.")
    max_model_len: int | None = Field(default=None, description="Engine context length.")
    output_tokens: int = Field(default=0, ge=0, description="Completion tokens generated in total.")
    throughput: dict[str, float] = Field(default_factory=dict, description="Throughput summary.")
    training_window: int | None = Field(
        default=None, description="Tokens per record (prompt + completion) a training step reads, which the "
        "tokens below are counted against; None for imports and manifests made before it was recorded.",
    )
    capped_to_window: bool = Field(
        default=False, description="Each completion was stopped where the training window ends (max_model_len is "
        "the window, each prompt's budget min(max_new_tokens, window - its tokens)).",
    )
    truncated_by_budget: int | None = Field(
        default=None, ge=0, description="Completions stopped at the budget (finish_reason 'length') and kept: a "
        "prefix of the target's answer, trained on; None where not counted.",
    )
    output_tokens_in_window: int | None = Field(
        default=None, ge=0, description="Completion tokens inside the training window: what training can read of "
        "output_tokens; None where not counted.",
    )
    window_fraction: float | None = Field(
        default=None, ge=0, le=1, description="output_tokens_in_window / output_tokens: the share of the "
        "generated tokens a training step reads (the rest was paid for and is never trained on).",
    )


Split = Literal["train", "heldout"]


class HeldoutSplit(_Frozen):
    """The tokenized records kept out of training for evaluation, chosen by a hash of their content id.

    A record is held out when sha256("dflash-heldout:" + id), read as a fraction of 2**64 from its first
    8 bytes, falls below `effective_fraction`: the same id lands in the same split whatever the sharding,
    the worker count or the order of the input, and repeated ids never straddle the split. Its rows are in
    the shards whose `split` is "heldout".
    """

    method: Literal["sha256_id_v1"] = Field(default="sha256_id_v1", description="How records were assigned.")
    fraction: float = Field(ge=0, le=1, description="Configured share of records to hold out (0 = no split).")
    min_records: int = Field(ge=0, description="Configured least held-out count (in expectation) on small inputs.")
    input_records: int = Field(ge=0, description="Records of the input manifest the effective fraction is based on.")
    effective_fraction: float = Field(
        ge=0, le=1, description="max(fraction, min_records / input_records), at most one half; 0 without a split."
    )
    records: int = Field(ge=0, description="Records in the held-out shards.")
    tokens: int = Field(ge=0, description="Tokens in the held-out shards.")
    loss_tokens: int = Field(ge=0, description="Tokens with loss_mask = 1 in the held-out shards.")


class TokenizedSection(_Frozen):
    kind: Literal[Kind.tokenized] = Kind.tokenized
    target: TargetIdentity = Field(description="Tokenizer, template and thinking mode the shards were made with.")
    mode: Literal["token_exact", "render"] = Field(description="How ids and masks were produced.")
    mask_policy: Literal["final_turn", "all_turns"] = Field(description="Which assistant turns carry loss.")
    max_length: int = Field(gt=0, description="Longest sequence allowed in the shards.")
    total_tokens: int = Field(ge=0, description="Tokens in all shards (held-out ones included).")
    loss_tokens: int = Field(ge=0, description="Tokens with loss_mask = 1 (held-out ones included).")
    length_histogram: dict[str, int] = Field(
        default_factory=dict, description="Sequence count per length bucket ('lo-hi' tokens)."
    )
    heldout: HeldoutSplit | None = Field(
        default=None,
        description="The held-out split that training never reads; None (manifests made before the split "
        "existed): every shard is training data.",
    )
    truncated_by_budget: int | None = Field(
        default=None, ge=0, description="Records kept whose completion the generate stage stopped at its budget; "
        "None in manifests made before they were kept.",
    )
    truncated_to_max_length: int | None = Field(
        default=None, ge=0, description="Records cut at max_length (their tail is not in the shards); None where "
        "not counted.",
    )
    loss_tokens_before_truncation: int | None = Field(
        default=None, ge=0, description="Loss tokens of the kept records before the max_length cut: the "
        "completions' tokens (generated ones, in token_exact mode); None where not counted.",
    )
    window_fraction: float | None = Field(
        default=None, ge=0, le=1, description="loss_tokens / loss_tokens_before_truncation: the share of the "
        "completions' tokens inside the max_length window.",
    )


class TrainedTokens(_Frozen):
    """What the train split holds and what rows of `max_length` tokens read of it, per epoch."""

    max_length: int = Field(gt=0, description="Tokens per packed row: the training window.")
    tokens_available: int = Field(ge=0, description="Tokens of the train split's records.")
    tokens_trained: int = Field(ge=0, description="Of those, tokens inside the window (a longer record is cut).")
    loss_tokens_available: int = Field(ge=0, description="Loss tokens of the train split's records.")
    loss_tokens_trained: int = Field(ge=0, description="Of those, loss tokens inside the window.")
    window_fraction: float = Field(
        ge=0, le=1, description="loss_tokens_trained / loss_tokens_available: the share of the completions' tokens "
        "a training step reads.",
    )
    epochs: float = Field(ge=0, description="Passes over the packed rows the run's steps made.")


class DrafterSection(_Frozen):
    kind: Literal[Kind.drafter] = Kind.drafter
    target: TargetIdentity = Field(description="Target the drafter was trained against.")
    target_layer_ids: list[int] = Field(description="Target layer ids L (output of decoder layer L).")
    block_size: int = Field(gt=1, description="Tokens per drafted block.")
    mask_token_id: int = Field(description="Mask token id (an existing target embedding row).")
    checkpoint_uri: str = Field(description="Final training checkpoint.")
    export_uri: str | None = Field(default=None, description="Serving export directory, once exported.")
    final_metrics: dict[str, float] = Field(
        default_factory=dict,
        description="Loss (weighted mean over the last logged window), accuracies, expected tau, label_agreement "
        "(share of trained labels that are the trainer target's own greedy token) and label_agreement_first "
        "(the same as training started).",
    )
    recipe: dict[str, str | float | int | bool | None] = Field(
        default_factory=dict,
        description="The settings that decide the drafter's quality, resolved: objective, position_weighting, "
        "lr_schedule, lr, steps, anchors per document and per row, loss_decay_gamma, feature noise, block size.",
    )
    data: TrainedTokens | None = Field(
        default=None, description="The tokens of the train split and the share the training window read; None "
        "in manifests made before it was recorded.",
    )
    performance: dict[str, float] = Field(
        default_factory=dict,
        description="Measured by the process that finished the run: step_seconds, tokens_per_s (all ranks), "
        "world_size, peak_memory_gib_max against planned_peak_gib (the memory plan), checkpoint_save_seconds, "
        "resume_seconds and resumed_from_step (when it resumed), target_parameters (those a token runs: a mixture "
        "of experts' active ones), drafter_parameters. A pilot's report compares them with the plan; empty in "
        "manifests made before they were recorded.",
    )


class EvaluationSection(_Frozen):
    kind: Literal[Kind.evaluation] = Kind.evaluation
    target: TargetIdentity = Field(description="Target the evaluation ran against.")
    tau: float = Field(description="Mean acceptance length of the trained drafter (offline loop).")
    tau_untrained: float | None = Field(default=None, description="Same for an untrained drafter.")
    engine_tau: float | None = Field(default=None, description="Acceptance length measured by the engine.")
    acceptance_per_position: list[float] = Field(default_factory=list, description="Acceptance by slot.")
    tau_histogram: dict[str, int] = Field(default_factory=dict, description="Steps per acceptance length.")
    prompt_split: Literal["heldout", "train", "all"] | None = Field(
        default=None,
        description="Which prompts tau was measured on: the held-out or the train split of a tokenized manifest, "
        "or all of a prompts or completions manifest; None in manifests made before the split existed.",
    )
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description="Further figures: tau_<set> and prompts_<set> per user prompt set, tokens per target "
        "forward, ...",
    )


Section = Annotated[
    PromptsSection | CompletionsSection | TokenizedSection | DrafterSection | EvaluationSection,
    Field(discriminator="kind"),
]


def utc_now() -> datetime:
    return datetime.now(UTC)


class Manifest(_Frozen):
    """The envelope written at `<prefix>/manifest.json` by every stage."""

    schema_version: Literal[2] = Field(default=2, description="Manifest schema version.")
    kind: Kind = Field(description="What the prefix holds; must equal section.kind.")
    run_id: str = Field(description="Pipeline run this output belongs to.")
    created_at: datetime = Field(default_factory=utc_now, description="When the manifest was written (UTC).")
    producer: Producer = Field(description="Who wrote it.")
    inputs: list[InputRef] = Field(default_factory=list, description="Input manifests it was made from.")
    shards: list[Shard] = Field(default_factory=list, description="Data objects, in reading order.")
    accounting: Accounting = Field(description="Where every input record went.")
    section: Section = Field(description="The kind-specific part.")

    @model_validator(mode="after")
    def _kind_matches_section(self) -> Manifest:
        if self.section.kind != self.kind:
            raise ValueError(f"kind is {self.kind.value!r} but the section is {self.section.kind.value!r}")
        return self

    @model_validator(mode="after")
    def _heldout_shards_listed(self) -> Manifest:
        heldout = getattr(self.section, "heldout", None)
        if heldout is None:
            return self
        records = sum(s.records for s in self.split_shards("heldout"))
        if records != heldout.records:
            raise ValueError(f"the held-out shards hold {records} records, the split says {heldout.records}")
        return self

    @property
    def total_records(self) -> int:
        return sum(s.records for s in self.shards)

    def split_shards(self, split: Split) -> list[Shard]:
        """A tokenized manifest's shards of one split, in reading order (no split recorded: all are train)."""
        return [s for s in self.shards if (s.split == "heldout") == (split == "heldout")]

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=2).encode("utf-8")


SECTION_TYPES: dict[Kind, type[BaseModel]] = {
    Kind.prompts: PromptsSection,
    Kind.completions: CompletionsSection,
    Kind.tokenized: TokenizedSection,
    Kind.drafter: DrafterSection,
    Kind.evaluation: EvaluationSection,
}
