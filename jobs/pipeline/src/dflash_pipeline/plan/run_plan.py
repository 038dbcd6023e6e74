"""`pipeline plan`: what each stage of a run will take, before anything is submitted.

Per stage: pods, GPUs, GPU-hours, wall time, scratch disk per pod, bytes written to the object store and
copies of the target pulled from it. The arithmetic is deliberately simple (work / rate, all pods of a stage in
parallel, a start-up term for the target copy), so a reader can check every line by hand; its value is in
putting the run file's choices (shards, GPUs, nodes, deadlines, scratch sizes) next to the size of the work.

Where each figure comes from is kept beside it and printed: `manifest` (this run's own manifests: counts already
known), `measured` (an earlier run's manifests, `[plan] measured_from`), `run file` (`[plan]` or stage settings),
`estimate` (a stated default), `derived` (computed from the others). A deadline shorter than the predicted wall
time, and a scratch volume smaller than what the pod will copy into it, are warnings: the Job would be killed or
its pod evicted partway.

Training reads at most a window of `max_length` tokens of each record, so the plan counts per record
min(record length, window) as trained, and prints the share of the generated tokens no window reads
(`plan_tokens` states the length distribution it assumes). More than `MAX_UNREAD_FRACTION` is a warning, not a
refusal: the figure rests on an assumed length distribution until a run measured it, and generating past the
window can be deliberate (traces kept for a longer window later); by default the budget is capped to the window
and the share is zero by construction.

Before any of it, the run must fit its GPUs (`fit`): each GPU stage's memory per GPU against the GPU it is
scheduled on, printed per stage; a stage that cannot fit refuses the run (ConfigError, exit 64) with the settings
that would make it fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dflash_pipeline.plan.fit import FitReport, check_fit, gpu_of
from dflash_pipeline.plan.gang_hold import GangHold, dead_rank_hold
from dflash_pipeline.plan.gpu_models import REFERENCE_GPU, throughput_scale
from dflash_pipeline.plan.tokens import RecordTokens, answer_mean_for
from dflash_pipeline.render.run_objects import objects_of_stage
from dflash_pipeline.render.scheduling import active_deadline_seconds, scratch_limit, target_disk_bytes
from dflash_pipeline.run.config import RunConfig, quantity_value
from dflash_pipeline.run.layout import layout
from dflash_pipeline.run.stages import (
    EVALUATE,
    GENERATE,
    TOKENIZE,
    TRAIN,
    generation_budget,
    stage_values,
    target_family,
    training_window,
)
from dflash_pipeline.run.stages import plan as run_stages
from dflash_shared.errors import ConfigError
from dflash_shared.manifest_io import ManifestError, parse_manifest
from dflash_shared.manifests import (
    MANIFEST_NAME,
    CompletionsSection,
    Kind,
    Manifest,
    PromptsSection,
    TokenizedSection,
)
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, StorageError, join
from dflash_shared.target_family import stated_parameters
from dflash_shared.window import MAX_UNREAD_FRACTION
from dflash_train.training.memory_plan import DRAFTER_STATE_BYTES

# Default estimates, used only where neither a manifest nor the run file says; each is printed as `estimate`.
# Mean prompt length of chat SFT data (ShareGPT/UltraChat-like histories).
DEFAULT_PROMPT_TOKENS = 600.0
# Thinking-mode answers stop well before their family's budget on most prompts; half of it is a round middle.
DEFAULT_COMPLETION_FRACTION = 0.5
# vLLM, a ~30B bf16 target on one H100/H200-class GPU at a few hundred sequences in flight.
DEFAULT_GENERATE_TOKENS_PER_S_PER_GPU = 1500.0
# bench/bench_tokenize.py's order of magnitude: ~0.5 Mtok/s per pod of 4 CPU.
DEFAULT_TOKENIZE_TOKENS_PER_S_PER_POD = 500_000.0
# Target forward + drafter forward/backward on one H200 (SpecForge-class figure for a 27B target).
DEFAULT_TRAIN_TOKENS_PER_S_PER_GPU = 3000.0
# The offline acceptance loop decodes one prompt at a time (target + drafter per block).
DEFAULT_EVALUATE_TOKENS_PER_S = 100.0
# Import: records read and validated per second per pod (`_import`), and prompts also counted with the target's
# tokenizer (an import of prompts; a pilot's sample counts only the prompts it draws). `make bench-import`
# measured 15,000 and 1,950 a second per core on ~1 KB prompts from a local file; these allow for object-store
# reads and longer conversations.
IMPORT_RECORDS_PER_S_PER_POD = 10_000.0
IMPORT_COUNTED_PROMPTS_PER_S_PER_POD = 1_500.0
# The default rates above are for a dense target of about this size (the headline's Qwen3.6-27B). A mixture of
# experts runs only its active parameters per token, so its rates are scaled by this over its active count, at most
# by MOE_RATE_CAP: attention, the KV cache, routing and the reads of every expert's weights at large batches do not
# shrink with the active count (vLLM serves Qwen3-30B-A3B a few times faster than a dense 27B, not 8 times).
REFERENCE_TARGET_B = 27.0
MOE_RATE_CAP = 3.0
# Object store to local NVMe, one pod, parallel ranged GETs.
DEFAULT_COPY_BYTES_PER_S = 500e6
# Engine/process start after the copy: CUDA context, weights to the GPU, graph capture or compilation.
START_SECONDS = 300.0
CPU_POD_START_SECONDS = 60.0  # a CPU stage's pod (import, tokenize): no model to load
# The drafter the plan sizes checkpoints for before one exists: ~2B parameters (fp32 weights, gradients and AdamW
# moments in a checkpoint; bf16 weights in an export).
REFERENCE_DRAFTER_PARAMS = 2e9
# Stored bytes per token: completions as JSONL with text and token ids, zstd; tokenized Arrow rows (int32 ids,
# loss mask, document ids, uncompressed). Measured ratios from an earlier run replace these.
COMPLETION_BYTES_PER_TOKEN = 4.0
TOKENIZED_BYTES_PER_TOKEN = 9.0
PROMPT_BYTES_PER_TOKEN = 1.5


@dataclass(frozen=True)
class Figure:
    """A number and where it came from."""

    value: float
    source: str  # manifest | measured | run file | estimate


@dataclass
class StagePlan:
    """What one stage takes."""

    stage: str
    pods: int
    gpus: int
    wall_seconds: float | None
    scratch_bytes_per_pod: float
    store_bytes: float
    model_copies: int
    work: str  # the work in words, with its figures' sources
    deadline_seconds: int | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def gpu_hours(self) -> float | None:
        return None if self.wall_seconds is None else self.gpus * self.wall_seconds / 3600


@dataclass
class RunPlan:
    run_id: str
    stages: list[StagePlan]
    figures: dict[str, Figure]
    run_warnings: list[str] = field(default_factory=list)  # about the run as a whole (storage, GPU model)
    gpu_hour_price: float | None = None
    currency: str = "USD"
    gang: GangHold | None = None  # a multi-node train stage: what a lost node costs the other pods
    fit: FitReport | None = None  # each GPU stage's memory per GPU against its GPU (`fit`)

    @property
    def warnings(self) -> list[str]:
        return [*self.run_warnings, *(f"{s.stage}: {w}" for s in self.stages for w in s.warnings)]

    def cost(self, stage: StagePlan) -> float | None:
        if self.gpu_hour_price is None or stage.gpu_hours is None:
            return None
        return stage.gpu_hours * self.gpu_hour_price


class _Manifests:
    """Reads manifests from the store until it refuses: `plan` is a pre-submit check, often run where no
    credentials for the bucket exist, so a store it cannot read leaves the figures to the run file (and says so)
    instead of failing the command."""

    def __init__(self, store: ObjectStore | None) -> None:
        self.store = store
        self.unread: str | None = None

    def read(self, prefix: str) -> Manifest | None:
        if self.store is None:
            return None
        uri = join(prefix, MANIFEST_NAME)
        try:
            return parse_manifest(uri, self.store.read_bytes(uri))
        except (ObjectNotFoundError, ManifestError):
            return None
        except StorageError as err:
            self.store, self.unread = None, f"{uri}: {err}"
            return None


class _Figures:
    """Resolves each figure once, from the first source that has it."""

    def __init__(self, run: RunConfig, store: ObjectStore | None) -> None:
        self.run = run
        self.inputs = run.plan
        lay = layout(run.root, run.run_id)
        self.manifests = _Manifests(store)
        read = self.manifests.read
        self.own = {kind: read(lay.prefix(kind)) for kind in (Kind.prompts, Kind.completions, Kind.tokenized)}
        earlier = run.plan.measured_from
        self.earlier = ({kind: read(join(earlier, kind.value)) for kind in (Kind.prompts, Kind.completions,
                                                                            Kind.tokenized, Kind.drafter)}
                        if earlier else {})
        self.table: dict[str, Figure] = {}

    def put(self, name: str, figure: Figure) -> float:
        self.table[name] = figure
        return figure.value

    def target_bytes(self) -> float:
        """The target copy's size, as the Jobs size its scratch for it (target.disk_size, or from the model id)."""
        source = "run file" if self.run.target.disk_size is not None else "estimate"
        return self.put("target bytes", Figure(float(target_disk_bytes(self.run)), source))

    def prompts(self) -> float | None:
        own = self.own[Kind.prompts]
        if own is not None:
            return self.put("prompts", Figure(own.total_records, "manifest"))
        if self.inputs.prompts is not None:
            return self.put("prompts", Figure(self.inputs.prompts, "run file"))
        return None

    def prompt_tokens(self) -> float:
        """The mean prompt length: counted by this run's import (or the pilot's, measured), else the run file's,
        else an estimate."""
        for manifest, source in ((self.own[Kind.prompts], "manifest"), (self.earlier.get(Kind.prompts), "measured")):
            section = getattr(manifest, "section", None)
            if manifest is not None and isinstance(section, PromptsSection) and section.prompt_tokens \
                    and manifest.total_records:
                return self.put("mean prompt tokens", Figure(section.prompt_tokens / manifest.total_records, source))
        given = self.inputs.mean_prompt_tokens
        return self.put("mean prompt tokens", Figure(given, "run file") if given else
                        Figure(DEFAULT_PROMPT_TOKENS, "estimate"))

    def answer_tokens(self, limits: Limits, prompt_tokens: float) -> float:
        """The mean answer length were no budget to stop it (`plan_tokens`): from a completions manifest's mean
        under that run's budget, else the run file, else half the family's budget."""
        for manifest, source in ((self.own[Kind.completions], "manifest"),
                                 (self.earlier.get(Kind.completions), "measured")):
            section = getattr(manifest, "section", None)
            if manifest is not None and manifest.total_records and getattr(section, "output_tokens", 0):
                assert isinstance(section, CompletionsSection)
                mean = section.output_tokens / manifest.total_records
                budget = _measured_budget(section, limits, prompt_tokens)
                return self.put("mean answer tokens (uncut)", Figure(answer_mean_for(mean, budget), source))
        if self.inputs.mean_completion_tokens:
            return self.put("mean answer tokens (uncut)", Figure(self.inputs.mean_completion_tokens, "run file"))
        return self.put("mean answer tokens (uncut)",
                        Figure(DEFAULT_COMPLETION_FRACTION * limits.family_budget, "estimate"))

    def rate(self, name: str, given: float | None, measured: float | None, default: float,
             scaled: tuple[str, str] | None = None) -> float:
        """A rate measured, else set in the run file, else the default; `scaled` = (stage, "memory" or "compute"):
        the default is an H200 figure, scaled to the stage's GPU (`gpu_models.throughput_scale`)."""
        if measured:
            return self.put(name, Figure(measured, "measured"))
        if given:
            return self.put(name, Figure(given, "run file"))
        if scaled is None:
            return self.put(name, Figure(default, "estimate"))
        figure = self._for_gpu(default, *scaled)
        if (moe := moe_rate_factor(self.run.target.model_id)) is not None:
            factor, why = moe
            figure = Figure(figure.value * factor, f"{figure.source}; x {factor:.2f}, {why}")
        return self.put(name, figure)

    def _for_gpu(self, default: float, stage: str, bound: str) -> Figure:
        model, _ = gpu_of(self.run, self.run.stages.for_stage(stage))
        if model is None:
            return Figure(default, f"estimate: an {REFERENCE_GPU} figure, the stage's GPU unknown")
        if model.name == REFERENCE_GPU:
            return Figure(default, f"estimate for {REFERENCE_GPU}")
        scale = throughput_scale(model, bound)
        if scale is None:
            return Figure(default, f"estimate: an {REFERENCE_GPU} figure, {model.name}'s speed unknown")
        factor, why = scale
        return Figure(default * factor, f"estimate for {model.name}: the {REFERENCE_GPU}'s {default:,.0f} x "
                                        f"{factor:.2f}, {why}")

    def measured_generate_rate(self) -> float | None:
        manifest = self.earlier.get(Kind.completions)
        throughput = getattr(getattr(manifest, "section", None), "throughput", {}) or {}
        return throughput.get("output_tokens_per_s_per_gpu")

    def bytes_per_token(self, kind: Kind, tokens_of: str, default: float) -> float:
        """Stored bytes per token, measured from an earlier run's shards where it has them."""
        manifest = self.earlier.get(kind)
        tokens = getattr(getattr(manifest, "section", None), tokens_of, 0) if manifest else 0
        stored = sum(s.bytes for s in manifest.shards) if manifest and tokens else 0
        if stored:
            return self.put(f"{kind.value} bytes per token", Figure(stored / tokens, "measured"))
        return self.put(f"{kind.value} bytes per token", Figure(default, "estimate"))


def moe_rate_factor(model_id: str) -> tuple[float, str] | None:
    """How much faster than the dense reference target a mixture of experts runs (its active parameters per token,
    as its model id states them: "30B-A3B"), and why; None for a dense target."""
    stated = stated_parameters(model_id)
    if stated.active_b is None or stated.total_b is None:
        return None
    factor = max(1.0, min(MOE_RATE_CAP, REFERENCE_TARGET_B / stated.active_b))
    return factor, (f"a mixture of experts running {stated.active_b:g}B of its {stated.total_b:g}B parameters per "
                    f"token ({REFERENCE_TARGET_B:g}B / {stated.active_b:g}B, at most {MOE_RATE_CAP:g})")


@dataclass(frozen=True)
class Limits:
    """The generation budget and the training window as the stages will settle them."""

    max_new_tokens: int
    context: int  # the generate engine's max_model_len
    family_budget: int  # the family's own budget (uncapped), what the default answer length is half of
    tokenize_window: int  # tokenize's max_length: records are cut there
    window: int  # tokens per record a training row reads: train's max_length, at most tokenize's
    refusal: str | None = None  # why the generate stage would refuse these limits at its start


def _limits(run: RunConfig) -> Limits:
    """The run's limits, settled as the stages settle them: the generation budget by the generate stage's own
    rule (`generation_limits`), the windows from tokenize's and train's max_length (train's default: the
    tokenized data's)."""
    generate = stage_values(run, GENERATE)
    max_new, context = generation_budget(run)
    family = target_family(run)
    tokenize_window = int(stage_values(run, TOKENIZE)["max_length"])
    window = min(int(stage_values(run, TRAIN)["max_length"] or tokenize_window), tokenize_window)
    capped = bool(generate["cap_to_training_window"])
    generate_window = int(generate["training_window"])
    refusal = None
    if capped and (context > generate_window or max_new >= generate_window):
        refusal = (f"max_new_tokens {max_new:,} / max_model_len {context:,} do not fit inside its training_window "
                   f"{generate_window:,} (cap_to_training_window): the stage refuses them at its start; leave "
                   "them unset, or set cap_to_training_window = false to generate past the window")
    return Limits(int(max_new), int(context), family.max_new_tokens, tokenize_window, window, refusal)


def _measured_budget(section: CompletionsSection, limits: Limits, prompt_tokens: float) -> float:
    """The per-prompt budget a completions manifest's mean was generated under (this run's, where it does not
    record its own)."""
    new = section.max_new_tokens or limits.max_new_tokens
    context = section.max_model_len or limits.context
    return max(1.0, min(new, context - prompt_tokens))


def _wall(work: float | None, rate_per_unit: float, units: int, start_seconds: float) -> float | None:
    """Seconds for `work` spread evenly over `units` running at once, plus their start."""
    if work is None:
        return None
    return start_seconds + work / (rate_per_unit * max(units, 1))


@dataclass(frozen=True)
class _Workload:
    """The run-wide figures every stage's estimate starts from."""

    target_bytes: float
    target_start: float  # seconds from pod start to a loaded target: the copy, then the engine's start
    prompts: float | None
    prompt_tokens: float
    completion_tokens: float  # generated per prompt (0 for imported completions)
    record_tokens: float  # prompt + completion: what tokenize reads of a record
    total_tokens: float | None  # tokens of the tokenized data (records cut at tokenize's max_length)
    trained_tokens: float | None  # tokens per epoch the training rows read: min(record, window) per record
    limits: Limits
    records: RecordTokens | None  # the per-record model of a generating run; None for imported completions


def _workload(run: RunConfig, figures: _Figures) -> _Workload:
    target = figures.target_bytes()
    copy_rate = figures.rate("copy bytes/s", run.plan.copy_bytes_per_s, None, DEFAULT_COPY_BYTES_PER_S)
    prompts = figures.prompts()
    prompt_tokens = figures.prompt_tokens()
    limits = _limits(run)
    records = None
    if run.source.kind == "prompts":
        answer = figures.answer_tokens(limits, prompt_tokens)
        records = RecordTokens(prompt_tokens, answer, limits.max_new_tokens, limits.context, limits.window)
        completion, length, trained = records.generated, records.length, records.trained
        # What tokenize keeps of a record: the same record against its own max_length.
        stored = replace(records, window=limits.tokenize_window).trained
        _record_figures(figures, records, "run file" if training_window(run) is not None else "estimate")
    else:  # imported conversations: the whole conversation is the record
        completion, length, trained = 0.0, prompt_tokens, min(prompt_tokens, limits.window)
        stored = min(prompt_tokens, limits.tokenize_window)
    total, per_epoch = _data_tokens(figures, prompts, stored, trained)
    return _Workload(target, target / copy_rate + START_SECONDS, prompts, prompt_tokens, completion, length, total,
                     per_epoch, limits, records)


def _record_figures(figures: _Figures, records: RecordTokens, window_source: str) -> None:
    """The per-record figures of a generating run, in the printed table (derived from the ones above them)."""
    figures.put("completion budget per prompt", Figure(records.budget, "derived"))
    figures.put("mean completion tokens", Figure(records.generated, "derived"))
    figures.put("completions cut by the budget", Figure(records.truncated_by_budget, "derived"))
    figures.put("training window", Figure(records.window, window_source))
    figures.put("tokens per record trained", Figure(records.trained, "derived"))
    figures.put("generated tokens never trained", Figure(records.unread_fraction, "derived"))


def _data_tokens(figures: _Figures, prompts: float | None, stored: float, trained: float) -> tuple[
        float | None, float | None]:
    """(tokens the tokenized shards hold, tokens a training epoch reads): the run's tokenized manifest where it
    exists (its train split, rescaled when train's window is shorter than tokenize's), else per record x prompts."""
    tokenized = figures.own[Kind.tokenized]
    if tokenized is not None:
        section = tokenized.section
        assert isinstance(section, TokenizedSection)
        total = figures.put("tokens", Figure(section.total_tokens, "manifest"))
        heldout = section.heldout.tokens if section.heldout is not None else 0
        return total, (total - heldout) * (trained / stored if stored else 1.0)
    if prompts is None:
        return None, None
    return figures.put("tokens", Figure(prompts * stored, "derived")), prompts * trained


def _import(run: RunConfig, figures: _Figures, w: _Workload, pods: int, gpus: int) -> StagePlan:
    # A sample (a pilot's) is read whole by one pod, which counts only the prompts it draws.
    read = run.plan.source_records or w.prompts
    sampled = f" (a sample of {_count(read)} read)" if read != w.prompts else ""
    counted = 0.0 if run.source.kind != "prompts" else (w.prompts or 0) / IMPORT_COUNTED_PROMPTS_PER_S_PER_POD
    wall = _wall(read, IMPORT_RECORDS_PER_S_PER_POD, pods, CPU_POD_START_SECONDS)
    wall = None if wall is None else wall + counted / max(pods, 1)
    return StagePlan("import", pods, gpus, wall, 0.0,
                     (w.prompts or 0) * w.prompt_tokens * PROMPT_BYTES_PER_TOKEN, 0,
                     f"{_count(w.prompts)} conversations{sampled}")


def _generate(run: RunConfig, figures: _Figures, w: _Workload, pods: int, gpus: int) -> StagePlan:
    rate = figures.rate("generate tokens/s/GPU", run.plan.generate_tokens_per_s_per_gpu,
                        figures.measured_generate_rate(), DEFAULT_GENERATE_TOKENS_PER_S_PER_GPU,
                        scaled=("generate", "memory"))
    work = None if w.prompts is None else w.prompts * w.completion_tokens
    per_token = figures.bytes_per_token(Kind.completions, "output_tokens", COMPLETION_BYTES_PER_TOKEN)
    # Every pod copies the whole target to its scratch and serves it from there.
    plan = StagePlan("generate", pods, gpus, _wall(work, rate, gpus, w.target_start), w.target_bytes,
                     (work or 0) * per_token, pods,
                     f"{_count(work)} tokens to generate ({_count(w.prompts)} prompts x {w.completion_tokens:,.0f}); "
                     f"{rate:,.0f} tok/s/GPU")
    if w.limits.refusal is not None:
        plan.warnings.append(w.limits.refusal)
    if w.records is not None:
        _unread_warning(plan, w.records, w.limits)
    return plan


def _unread_warning(plan: StagePlan, records: RecordTokens, limits: Limits) -> None:
    """More than MAX_UNREAD_FRACTION of the generated tokens past the training window: GPU-hours no step uses."""
    unread = records.unread_fraction
    if unread <= MAX_UNREAD_FRACTION:
        return
    hours = "" if plan.gpu_hours is None else f" (~{_gpu_hours(unread * plan.gpu_hours)} of its GPU-hours)"
    plan.warnings.append(
        f"{unread:.0%} of the generated tokens{hours} lie past the {limits.window:,}-token training window and are "
        f"never trained on (limit {MAX_UNREAD_FRACTION:.0%}; a prompt's budget is {records.budget:,.0f} tokens): "
        "cap the budget to the window (stages.generate.config: cap_to_training_window = true, max_model_len "
        "unset), or train on longer records (stages.train.config.max_length and stages.tokenize.config.max_length "
        "toward the budget; their memory: bench/bench_memory_plan.py --windows)")


def _tokenize(run: RunConfig, figures: _Figures, w: _Workload, pods: int, gpus: int) -> StagePlan:
    rate = figures.rate("tokenize tokens/s/pod", run.plan.tokenize_tokens_per_s_per_pod, None,
                        DEFAULT_TOKENIZE_TOKENS_PER_S_PER_POD)
    per_token = figures.bytes_per_token(Kind.tokenized, "total_tokens", TOKENIZED_BYTES_PER_TOKEN)
    # It reads every token of the records and writes those within its max_length.
    read = None if w.prompts is None else w.prompts * w.record_tokens
    return StagePlan("tokenize", pods, gpus, _wall(read, rate, pods, CPU_POD_START_SECONDS), 0.0,
                     (w.total_tokens or 0) * per_token, 0,
                     f"{_count(read)} tokens read, {_count(w.total_tokens)} kept (max_length "
                     f"{w.limits.tokenize_window:,}); {rate:,.0f} tok/s/pod")


def _train(run: RunConfig, figures: _Figures, w: _Workload, pods: int, gpus: int) -> StagePlan:
    rate = figures.rate("train tokens/s/GPU", run.plan.train_tokens_per_s_per_gpu, None,
                        DEFAULT_TRAIN_TOKENS_PER_S_PER_GPU, scaled=("train", "compute"))
    train = stage_values(run, TRAIN)
    epochs = int(train["epochs"])
    max_steps = train["max_steps"]
    batch = int(train["batch_tokens"])
    keep = int(train["keep_checkpoints"])
    cache = float(train["cache_gib"]) * 2**30
    # Rows are packed: every token inside the window is a training token, once per epoch (or max_steps x batch).
    work = max_steps * batch if max_steps else None if w.trained_tokens is None else w.trained_tokens * epochs
    steps = None if work is None else math.ceil(work / batch)
    limit = f", max_steps {max_steps}" if max_steps else f", {epochs} epochs"
    # A restart (restart_after_step, the pilot's) starts the pods again: one more copy and load of the target.
    restart = train.get("restart_after_step")
    starts = 2 if restart and (steps is None or restart < steps) else 1
    if starts == 2:
        limit += f", a restart resuming from step {restart}"
    # Only the pod holding global rank 0 copies the weights (rank 0 loads and broadcasts them; the other pods
    # copy config and tokenizer files), but any pod may hold rank 0, so each is sized for a copy, with the data
    # cache beside it. The store keeps `keep` checkpoints of the drafter's weights and AdamW states.
    return StagePlan("train", pods, gpus, _wall(work, rate, gpus, starts * w.target_start), w.target_bytes + cache,
                     keep * REFERENCE_DRAFTER_PARAMS * DRAFTER_STATE_BYTES, 1,
                     f"{_count(work)} training tokens ({_count(steps)} steps{limit}, rows of {w.limits.window:,}); "
                     f"{rate:,.0f} tok/s/GPU")


def _decode(run: RunConfig, figures: _Figures, w: _Workload, pods: int, gpus: int, stage: str) -> StagePlan:
    rate = figures.rate("evaluate tokens/s", run.plan.evaluate_tokens_per_s, None, DEFAULT_EVALUATE_TOKENS_PER_S,
                        scaled=("evaluate", "memory"))
    # The serving check replays the offline evaluation's prompts at its budget (evaluation.json).
    evaluate = stage_values(run, EVALUATE)
    prompts = int(evaluate["num_prompts"])
    new = int(evaluate["max_new_tokens"])
    # serve-check decodes twice (with and without speculation) in a batched engine, ~10x the offline loop's rate.
    work = prompts * new * (1.0 if stage == "evaluate" else 0.2)
    return StagePlan(stage, pods, gpus, _wall(work, rate, 1, w.target_start), w.target_bytes, 1e6, pods,
                     f"{prompts} prompts x {new} tokens")


def _export(run: RunConfig, figures: _Figures, w: _Workload, pods: int, gpus: int) -> StagePlan:
    # Reads the final checkpoint (fp32 weights and optimizer states) and writes bf16 serving files.
    return StagePlan("export", pods, gpus, 600.0, REFERENCE_DRAFTER_PARAMS * DRAFTER_STATE_BYTES,
                     REFERENCE_DRAFTER_PARAMS * 2, 0, "the final checkpoint to serving files")


def build_plan(run: RunConfig, store: ObjectStore | None = None, *,
               target_config: Path | Mapping[str, Any] | None = None, run_file: Path | None = None) -> RunPlan:
    """The plan of every stage of the run, upstream first. `store` (optional) reads the manifests already there
    and the target's config.json; `target_config` (a path or the parsed file) and `run_file` (what `[plan]
    target_config` is relative to) are the fit check's (`fit.check_fit`), which refuses a run that cannot fit."""
    figures = _Figures(run, store)
    workload = _workload(run, figures)
    out: list[StagePlan] = []
    for stage in run_stages(run):
        settings = run.stages.for_stage(stage.name)
        pods = settings.nodes if stage.name == "train" else settings.shards
        args = (run, figures, workload, pods, pods * settings.gpus)
        if stage.name in ("evaluate", "serve-check"):
            item = _decode(*args, stage.name)
        else:
            item = {"import": _import, "generate": _generate, "tokenize": _tokenize, "train": _train,
                    "export": _export}[stage.name](*args)
        item.deadline_seconds = active_deadline_seconds(settings)
        _scratch_warning(item, float(quantity_value(scratch_limit(run, stage, settings))))
        _deadline_warning(item)
        out.append(item)
    # The store as the manifests left it: one that refused them is not asked for the target's config again.
    fit = check_fit(run, figures.manifests.store, target_config=target_config, run_file=run_file)
    if fit.blocked:
        raise ConfigError(fit.message())
    for item in out:
        item.warnings += fit.warnings_of(item.stage)
    warnings = [] if figures.manifests.unread is None else [
        f"storage: could not read {figures.manifests.unread}; the figures come from the run file and estimates, "
        "not from manifests (credentials for the bucket, or --offline to skip reading)"]
    warnings += gpu_model_warnings(run)
    warnings += _reserved_while_waiting(run, out)
    return RunPlan(run.run_id, out, figures.table, warnings, run.plan.gpu_hour_price, run.plan.currency,
                   _gang_hold(run), fit)


def _gang_hold(run: RunConfig) -> GangHold | None:
    if run.stages.train.nodes < 2:
        return None
    # The rendered objects: the figures are theirs.
    (gang,) = [d for d in objects_of_stage(run, TRAIN) if d["kind"] in ("Job", "JobSet")]
    return dead_rank_hold(gang)


def _reserved_while_waiting(run: RunConfig, stages: list[StagePlan]) -> list[str]:
    """A JobSet under Kueue is admitted, and holds its quota, from apply, while its first pod waits for the data."""
    train = run.stages.train
    if train.gang != "jobset" or not (train.queue_name or run.scheduling.queue_name):
        return []
    before = stages[:[s.stage for s in stages].index("train")]
    wait = sum(s.wall_seconds or 0 for s in before)
    gpus = train.nodes * train.gpus
    return [f"train: under Kueue the JobSet reserves quota for its {gpus} GPUs from apply while it waits "
            f"~{long_duration(wait)} for its input (~{_gpu_hours(gpus * wait / 3600)} GPU-hours of quota held): keep "
            "gang = \"indexed-job\" (the driver creates it once its input exists) or apply it after tokenize "
            "(render --stage train)"]


def gpu_model_warnings(run: RunConfig) -> list[str]:
    """Each GPU stage's gpu_types against the product labels GPU feature discovery writes (a value no node carries
    leaves the Job pending), and the GPU the throughputs assume against the GPUs each stage may be scheduled on
    (gpu_types or a node selector on the GPU product label): a cluster overlay that pins another product than the
    plan assumes would make every figure of the plan wrong."""
    from dflash_pipeline.plan.gpu_models import PRODUCT_LABEL, product_label_warning

    out = []
    for stage in run_stages(run):
        settings = run.stages.for_stage(stage.name)
        if settings.gpus and settings.gpu_type_label == PRODUCT_LABEL:
            out += [f"{stage.name}: gpu_types {w}" for v in settings.gpu_types if (w := product_label_warning(v))]
    model = run.plan.gpu_model
    if model is None:
        return out
    for stage in run_stages(run):
        settings = run.stages.for_stage(stage.name)
        if not settings.gpus:
            continue
        pinned = set(settings.gpu_types)
        if settings.gpu_type_label in settings.node_selector:
            pinned.add(settings.node_selector[settings.gpu_type_label])
        if not pinned:
            out.append(f"{stage.name}: the plan assumes {model} ([plan] gpu_model) but the stage may run on any GPU; "
                       f"set stages.{stage.name}.gpu_types = [\"{model}\"]")
        elif model not in pinned:
            out.append(f"{stage.name}: the plan assumes {model} ([plan] gpu_model) but the stage runs on "
                       f"{', '.join(sorted(pinned))}: measure or set the throughputs for that GPU")
    return out


def _scratch_warning(plan: StagePlan, limit: float) -> None:
    """`limit`: the scratch volume's sizeLimit as rendered (scratch_size, plus the target copy where one is made)."""
    if plan.scratch_bytes_per_pod > limit:
        plan.warnings.append(
            f"needs ~{_bytes(plan.scratch_bytes_per_pod)} of scratch per pod, its volume holds {_bytes(limit)}: the "
            f"pod would be evicted; raise stages.{plan.stage}.scratch_size")


def _deadline_warning(plan: StagePlan) -> None:
    if plan.deadline_seconds is None or plan.wall_seconds is None or plan.deadline_seconds >= plan.wall_seconds:
        return
    plan.warnings.append(
        f"active_deadline_seconds {plan.deadline_seconds:,} is shorter than the predicted "
        f"{long_duration(plan.wall_seconds)}: the Job would be stopped partway; raise "
        f"stages.{plan.stage}.active_deadline_seconds or add pods")


def _money(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f}"


def _count(value: float | None) -> str:
    if value is None:
        return "?"
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:,.1f}{unit}"
    return f"{value:,.0f}"


def _bytes(value: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value:,.0f} B"


def long_duration(seconds: float | None) -> str:
    """A stage-length duration: '12 min', '10.5 h', '3.1 d' ('?' when unknown)."""
    if seconds is None:
        return "?"
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min"


def _gpu_hours(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value:,.0f}" if value >= 10 else f"{value:.1f}"


def format_plan(plan: RunPlan) -> str:
    priced = plan.gpu_hour_price is not None
    rows = [("stage", "pods", "GPUs", "GPU-hours", *(["cost"] if priced else []), "wall", "scratch/pod", "written",
             "model copies", "work")]
    for s in plan.stages:
        priced_cell = [] if not priced else ["-" if not s.gpus else _money(plan.cost(s))]
        rows.append((s.stage, str(s.pods), str(s.gpus), "-" if not s.gpus else
                     _gpu_hours(s.gpu_hours), *priced_cell, long_duration(s.wall_seconds),
                     _bytes(s.scratch_bytes_per_pod) if s.scratch_bytes_per_pod else "-", _bytes(s.store_bytes),
                     str(s.model_copies), s.work))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [f"plan of run {plan.run_id}"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    gpu_hours = sum(s.gpu_hours or 0 for s in plan.stages)
    wall = sum(s.wall_seconds or 0 for s in plan.stages)
    copies = sum(s.model_copies for s in plan.stages)
    total_cost = "" if not priced else (f" ({_money(gpu_hours * (plan.gpu_hour_price or 0))} {plan.currency} at "
                                        f"{plan.gpu_hour_price:,.2f} per GPU-hour)")
    lines.append(f"total: {_gpu_hours(gpu_hours)} GPU-hours{total_cost}, {long_duration(wall)} of wall time with "
                 f"the stages one after another; {copies} copies of the target pulled from the object store "
                 f"({_bytes(copies * plan.figures['target bytes'].value)})")
    if plan.gang is not None:
        g = plan.gang
        lines.append(f"a lost node: the other {g.pods} train pods hold their {g.gpus} GPUs up to "
                     f"{long_duration(g.seconds)} ({_gpu_hours(g.gpu_hours)} GPU-hours) before the gang fails "
                     f"(bounded by {g.bounded_by}; stages.train.rendezvous_timeout_seconds, retries_per_shard)")
    if any(s.wall_seconds is None for s in plan.stages):
        lines.append("unknown (?): the run's prompt count is not known yet: set [plan] prompts, or plan again once "
                     "the import has written its manifest")
    lines += _window_lines(plan.figures)
    if plan.fit is not None:
        lines += plan.fit.lines()
    lines.append("figures (source: manifest = this run's, measured = [plan] measured_from, run file, estimate, "
                 "derived):")
    lines += [f"  {name}: {_figure(name, f.value)} ({f.source})" for name, f in plan.figures.items()]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines) + "\n"


# Figures that are shares, printed as percentages; token counts per record, printed whole.
_FRACTIONS = frozenset({"completions cut by the budget", "generated tokens never trained"})
_PER_RECORD = frozenset({"mean prompt tokens", "mean answer tokens (uncut)", "completion budget per prompt",
                         "mean completion tokens", "training window", "tokens per record trained"})


def _figure(name: str, value: float) -> str:
    if name in _FRACTIONS:
        return f"{value:.1%}"
    if name in _PER_RECORD:
        return f"{value:,.0f}"
    if value >= 1000 or float(value).is_integer():  # counts (prompts, records) print whole, never "256.00"
        return _count(value) if value >= 1000 else f"{value:,.0f}"
    return f"{value:,.2f}"


def _window_lines(figures: dict[str, Figure]) -> list[str]:
    """The record's tokens against the training window, in one sentence (generating runs only)."""
    if "tokens per record trained" not in figures:
        return []
    value = {name: f.value for name, f in figures.items()}
    return [f"tokens per record: prompt {value['mean prompt tokens']:,.0f} + completion "
            f"{value['mean completion tokens']:,.0f} (budget {value['completion budget per prompt']:,.0f}, "
            f"{value['completions cut by the budget']:.1%} cut by it, kept as truncated_by_budget); training reads "
            f"min(record, {value['training window']:,.0f}) = {value['tokens per record trained']:,.0f}; "
            f"{value['generated tokens never trained']:.1%} of the generated tokens are never trained on "
            f"(limit {MAX_UNREAD_FRACTION:.0%})"]


def plan_json(plan: RunPlan) -> dict[str, Any]:
    return {
        "run_id": plan.run_id,
        "stages": [{"stage": s.stage, "pods": s.pods, "gpus": s.gpus, "gpu_hours": s.gpu_hours,
                    "wall_seconds": s.wall_seconds, "scratch_bytes_per_pod": s.scratch_bytes_per_pod,
                    "store_bytes": s.store_bytes, "model_copies": s.model_copies, "work": s.work,
                    "deadline_seconds": s.deadline_seconds, "cost": plan.cost(s), "warnings": s.warnings}
                   for s in plan.stages],
        "gpu_hour_price": plan.gpu_hour_price, "currency": plan.currency,
        "lost_node_hold": None if plan.gang is None else {
            "seconds": plan.gang.seconds, "gpus": plan.gang.gpus, "gpu_hours": plan.gang.gpu_hours,
            "bounded_by": plan.gang.bounded_by, "steps": plan.gang.steps},
        "figures": {name: {"value": f.value, "source": f.source} for name, f in plan.figures.items()},
        "fit": None if plan.fit is None else plan.fit.to_json(),
        "warnings": plan.warnings,
    }
