"""`[plan]` of a run file: the workload and throughput figures `pipeline plan` sizes a run from.

Every field is optional. What the run's own manifests already say (prompts counted by import, tokens
generated, tokens tokenized) always wins over these; an earlier run named in `measured_from` supplies measured
throughputs and per-record sizes; what neither gives comes from these fields, and what they leave out from
stated default estimates. The plan prints where each figure came from, so an estimate never passes for a
measurement.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PlanInputs(BaseModel):
    """Figures for sizing a run before it is submitted (`python -m dflash_pipeline plan`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompts: int | None = Field(
        default=None, ge=1, description="Conversations the import will produce; the prompts manifest's count wins."
    )
    source_records: int | None = Field(
        default=None, ge=1,
        description="Records the import reads, where more than it keeps (a pilot reads the whole source to draw "
        "its sample); default: prompts.",
    )
    mean_prompt_tokens: float | None = Field(
        default=None, gt=0, description="Mean prompt (conversation history) tokens per record."
    )
    mean_completion_tokens: float | None = Field(
        default=None, gt=0,
        description="Mean answer tokens per prompt were no budget to stop them; the plan takes answer lengths as "
        "exponential with this mean, cut at each prompt's budget and counted against the training window "
        "(dflash_pipeline.plan.tokens). Default: half the target family's budget (32768 for Qwen3.5/3.6, else 8192).",
    )
    measured_from: str | None = Field(
        default=None, description="An earlier run's prefix (<root>/<run_id>) whose manifests give measured figures."
    )
    generate_tokens_per_s_per_gpu: float | None = Field(
        default=None, gt=0, description="Generated tokens per second per GPU (vLLM, the whole batch)."
    )
    tokenize_tokens_per_s_per_pod: float | None = Field(
        default=None, gt=0, description="Tokens rendered, tokenized and masked per second per tokenize pod."
    )
    train_tokens_per_s_per_gpu: float | None = Field(
        default=None, gt=0, description="Training tokens (packed rows x length) per second per GPU."
    )
    evaluate_tokens_per_s: float | None = Field(
        default=None, gt=0, description="Tokens per second of the offline acceptance loop (one prompt at a time)."
    )
    copy_bytes_per_s: float | None = Field(
        default=None, gt=0, description="Object store -> pod scratch copy rate of the target, bytes per second."
    )
    gpu_model: str | None = Field(
        default=None,
        description="The GPU product the throughput figures assume, as the node label names it (e.g. "
        "'NVIDIA-H200'): the plan warns about a GPU stage whose gpu_types does not pin it.",
    )
    gpu_memory_gib: float | None = Field(
        default=None, gt=0,
        description="Memory of one GPU in GiB as nvidia-smi reports its total (an 80 GB H100: 79.6; an H200: "
        "140.4): replaces the GPU table's figure in the fit check (dflash_pipeline.plan.gpu_models), for every "
        "GPU stage.",
    )
    target_config: str | None = Field(
        default=None,
        description="The target's config.json, a path relative to the run file: what the fit check sizes the "
        "target from where <target.uri>/config.json cannot be read (plan --offline). --target-config wins.",
    )
    gpu_hour_price: float | None = Field(
        default=None, ge=0, description="Price of one GPU-hour: the plan prints each stage's cost and the total."
    )
    currency: str = Field(default="USD", max_length=8, description="What gpu_hour_price is counted in.")
