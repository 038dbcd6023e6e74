"""Fit before any GPU is held: the memory each GPU stage of a run will need per GPU, against the GPU it is
scheduled on, checked by `plan` and `submit` before anything is applied. A stage that cannot fit is refused
(ConfigError, exit 64) with the settings that would make it fit; nothing waits hours for a GPU to find out.

Per GPU stage (a stage with gpus = 0 runs on CPU and is not checked here):

- train: the train stage's own memory plan (`dflash_train.training.memory_plan`) from the inputs the stage will
  have: its drafter (drafter, or drafter_preset with drafter_overrides; from_target reads the target's
  config.json as the stage does), max_length (train's, else tokenize's), micro_batch_rows, precision,
  target_dtype, activation_checkpointing, chunk_tokens, a world of stages.train nodes x gpus whose FSDP shards
  span one node, flex attention under `auto` (CUDA), and `parallelism = auto` resolved by the stage's rule
  (`memory_plan.auto_parallelism`: DDP when target and drafter state take under 80% of the GPU). The predicted
  peak must fit what torch finds free on the GPU. The fixes named are each re-planned: parallelism = "fsdp",
  activation checkpointing, a shorter max_length, a lower max_anchors_per_row, fewer micro_batch_rows, or a
  GPU with more memory.
- generate and serve-check (vLLM): `fit_engine` states the rule: refused when not even one max_model_len
  sequence fits beside the weights (vLLM refuses to start then); a warning, not a refusal, when fewer
  max_model_len sequences fit at once than generate keeps in flight. Fixes: more tensor parallelism (the
  stage's gpus), a lower max_model_len or max_num_seqs, a higher gpu_memory_utilization, a bigger GPU.
- evaluate (transformers, one GPU): the target, the trained drafter and the untrained baseline of the same
  shape, in bfloat16 (dtype auto on CUDA), one sequence's cache and features (max_prompt_tokens +
  max_new_tokens), its prefill activations, 1 GiB of CUDA workspaces and the memory plan's 10% margin, against
  the free memory.

The GPU: the products the stage is pinned to (gpu_types, or a node selector on its gpu_type_label; of several,
the smallest), else `[plan] gpu_model`; `[plan] gpu_memory_gib` replaces the table's memory (`gpu_models`). No
GPU known: the figures are printed, and the line says the check did not run (not a refusal).

The target's config.json: `--target-config PATH`, else `[plan] target_config` (relative to the run file), else
`<target.uri>/config.json` from the object store (never with `plan --offline`). Where none is read, the check
says why it could not run, and nothing is refused.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dflash_pipeline.plan.fit_engine import Engine, gib
from dflash_pipeline.plan.fit_engine import remedies as engine_remedies
from dflash_pipeline.plan.gpu_models import GpuModel, fitting, lookup, with_memory
from dflash_pipeline.run.config import JobSettings, RunConfig, load_run_config, quantity_value
from dflash_pipeline.run.stages import EVALUATE, GENERATE, SERVE_CHECK, TOKENIZE, TRAIN, selected_stages, stage_values
from dflash_shared.errors import ConfigError
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, StorageError, join
from dflash_shared.target_family import QWEN3, family_of_config, stated_parameters
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.mask_token import reference_mask_token
from dflash_train.drafter.resolve import build_drafter
from dflash_train.sections import TrainingRecipe, TrainingRuntime, section_of
from dflash_train.training import memory_plan as mp
from dflash_train.training.target_params import (
    DTYPE_BYTES,
    ConfigView,
    TargetSizes,
    kv_bytes_per_token,
    target_sizes,
    text_config,
)


@dataclass(frozen=True)
class StageFit:
    """One GPU stage's memory per GPU against its GPU, and the verdict."""

    stage: str
    gpu: str  # the product checked against, and where it came from ("" when none is known)
    verdict: str  # "fits" | "refused" | "not checked"
    peak: int  # predicted bytes per GPU (vLLM: the least its budget must hold)
    available: int | None  # bytes the stage may use per GPU (vLLM: its budget); None without a GPU
    summary: str  # the terms, in one line
    reason: str = ""  # refused or not checked: why
    fixes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    detail: str = ""  # train: the memory plan's table
    engine: bool = False  # a vLLM stage: `peak` is the least its budget must hold, `available` that budget

    def lines(self) -> list[str]:
        """The verdict with the predicted memory per GPU against the GPU's, then the terms."""
        if self.available is None:
            head = f"{gib(self.peak)} per GPU"
        elif self.engine:
            head = f"{gib(self.peak)} per GPU at least, of the {gib(self.available)} vLLM takes"
        else:
            head = f"peak {gib(self.peak)} per GPU, of {gib(self.available)} free"
        where = f" on {self.gpu}" if self.gpu else ""
        verdict = {"refused": "DOES NOT FIT", "not checked": "not checked"}.get(self.verdict, self.verdict)
        tail = f" ({self.reason})" if self.verdict == "not checked" and self.reason else ""
        return [f"  {self.stage}: {head}{where}: {verdict}{tail}", f"    {self.summary}"]


@dataclass(frozen=True)
class FitReport:
    """The fit check of a run: where the target's config.json came from and each GPU stage's verdict."""

    target: str  # where config.json was read, or why it was not
    stages: tuple[StageFit, ...] = ()
    ran: bool = True
    target_refusal: str = ""  # the staged target is not the model the run file names (`size_mismatch`)

    @property
    def refused(self) -> list[StageFit]:
        return [s for s in self.stages if s.verdict == "refused"]

    @property
    def blocked(self) -> bool:
        """Whether the run must not be submitted: a stage does not fit, or the target is not the one named."""
        return bool(self.refused or self.target_refusal)

    def warnings_of(self, stage: str) -> list[str]:
        return [w for s in self.stages if s.stage == stage for w in s.warnings]

    def lines(self, warnings: bool = False) -> list[str]:
        """The report as printed (`warnings`: with the stages' warnings, which `plan` prints with its own)."""
        if not self.ran:
            return [f"fit before any GPU is held: not checked, {self.target}"]
        if not self.stages:
            return [f"fit before any GPU is held ({self.target}): no stage runs on a GPU"]
        out = [f"fit before any GPU is held (target {self.target}):"]
        if self.target_refusal:
            out.append(f"  target: NOT THE NAMED MODEL: {self.target_refusal}")
        for s in self.stages:
            out += s.lines() + ([f"  warning: {s.stage}: {w}" for w in s.warnings] if warnings else [])
        return out

    def message(self) -> str:
        """The refusal: each stage that does not fit, why, and what would make it fit."""
        parts = ["the run does not fit its GPUs (checked before any GPU is held):"]
        if self.target_refusal:
            parts = [f"the staged target is not the model the run file names: {self.target_refusal}"]
        for s in self.refused:
            if s.detail:  # the memory plan's own refusal: its largest terms, the fixes, its table
                parts.append(f"{s.stage}: {s.detail}")
                continue
            fixes = "; ".join(s.fixes) if s.fixes else "none of the settings alone fits: a GPU with more memory"
            parts.append(f"{s.stage}: {s.reason}. Change one of: {fixes}")
        return "\n".join(parts + self.lines())

    def to_json(self) -> dict[str, Any]:
        return {"target_config": self.target, "checked": self.ran, "stages": [
            {"stage": s.stage, "gpu": s.gpu or None, "verdict": s.verdict, "peak_bytes": s.peak,
             "available_bytes": s.available, "summary": s.summary, "reason": s.reason or None,
             "fixes": list(s.fixes), "warnings": list(s.warnings)} for s in self.stages]}


# ------------------------------------------------------------------------------------------ inputs


def read_target_config(run: RunConfig, store: ObjectStore | None, given: Path | Mapping[str, Any] | None,
                       run_file: Path | None) -> tuple[dict[str, Any] | None, str]:
    """(config.json, where it came from) or (None, why none was read); a named file that cannot be read is a
    ConfigError (the command line or the run file is wrong), an unreadable store is not."""
    if isinstance(given, Mapping):
        return dict(given), "config given"
    path = given
    if path is None and run.plan.target_config:
        path = Path(run.plan.target_config)
        if not path.is_absolute() and run_file is not None:
            path = run_file.parent / path
    if path is not None:
        try:
            return _json_object(path.read_bytes(), str(path)), str(path)
        except OSError as err:
            raise ConfigError(f"cannot read the target config {path}: {err.strerror}") from err
    if store is None:
        return None, ("no config.json of the target was read: the object store was not read (--offline, or it "
                      "could not be read); pass --target-config PATH or set [plan] target_config")
    uri = join(run.target.uri, "config.json")
    try:
        return _json_object(store.read_bytes(uri), uri), uri
    except ObjectNotFoundError:
        return None, f"{uri} does not exist; pass --target-config PATH or set [plan] target_config"
    except StorageError as err:
        return None, f"could not read {uri} ({err}); pass --target-config PATH or set [plan] target_config"


def _json_object(raw: bytes, where: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as err:
        raise ConfigError(f"the target config {where} is not JSON: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"the target config {where} is not a JSON object")
    return data


def gpu_of(run: RunConfig, settings: JobSettings) -> tuple[GpuModel | None, str]:
    """The GPU a stage is checked against and where it came from; (None, why) when none is known."""
    pinned = list(settings.gpu_types)
    if settings.gpu_type_label in settings.node_selector:
        pinned.append(settings.node_selector[settings.gpu_type_label])
    names, source = (pinned, "gpu_types") if pinned else (
        [run.plan.gpu_model] if run.plan.gpu_model else [], "[plan] gpu_model")
    gib = run.plan.gpu_memory_gib
    if gib is not None:
        name = names[0] if len(names) == 1 else "GPU"
        return with_memory(name, gib), "[plan] gpu_memory_gib"
    if not names:
        return None, "no GPU model known: set [plan] gpu_model or the stage's gpu_types (or [plan] gpu_memory_gib)"
    known = [lookup(n) for n in names]
    unknown = [n for n, m in zip(names, known, strict=True) if m is None]
    if unknown:
        return None, f"{', '.join(unknown)} is not in the GPU table: set [plan] gpu_memory_gib"
    return min((m for m in known if m is not None), key=lambda m: m.usable), source


def drafter_of(values: Mapping[str, Any], raw: Mapping[str, Any]) -> DrafterConfig:
    """The drafter the train stage will build (`drafter.resolve.resolve_drafter`), from its config values and the
    target's config.json; ConfigError where the stage would refuse it."""
    def stand_in_mask(config: Any) -> int:
        # The stage's default is the first embedding row past the tokenizer, which needs the tokenizer; the id
        # changes no size, so the last row stands in where the reference's own is not known.
        known = reference_mask_token(config)
        return known if known is not None else int(config.vocab_size) - 1

    try:
        return build_drafter(values.get("drafter"), values.get("drafter_preset"), values.get("drafter_overrides") or {},
                             values.get("mask_token_id"), lambda: ConfigView(text_config(raw)), stand_in_mask)
    except (ConfigError, KeyError) as err:
        raise ConfigError(f"stages.train.config: the drafter the train stage would build is invalid: {err}") from err


# ------------------------------------------------------------------------------------------ the stages


_RUN_FILE_FIX = {
    "max_length": "stages.train.config.max_length = {} or less",
    "micro_batch_rows": "stages.train.config.micro_batch_rows = {} or less",
    "max_anchors_per_row": "stages.train.config.max_anchors_per_row = {} or less",
    "activation_checkpointing": "stages.train.config.activation_checkpointing = true",
    "attention_backend": 'stages.train.config.attention_backend = "flex"',
    "parallelism": 'stages.train.config.parallelism = "fsdp"',
    "fsdp_ranks": 'stages.train.gpus = {} with stages.train.config.parallelism = "fsdp"',
}


def _train(run: RunConfig, settings: JobSettings, raw: Mapping[str, Any], sizes: TargetSizes,
           cfg: DrafterConfig, gpu: GpuModel | None, gpu_note: str) -> StageFit:
    values = stage_values(run, TRAIN)
    max_length = int(values["max_length"] or stage_values(run, TOKENIZE)["max_length"])
    world = settings.nodes * settings.gpus
    target_bytes = 4 if values["target_dtype"] == "fp32" else 2  # auto: bf16 on CUDA
    drafter_params = mp.drafter_parameter_count(cfg)[0]
    # The stage sizes a replica from the weight files (vision tower and MTP included): the run file's disk size
    # is that where it is given; else the language model's own parameters.
    disk = run.target.disk_size
    replica = (int(float(quantity_value(disk)) * target_bytes / sizes.dtype_bytes) if disk is not None
               else sizes.params * target_bytes)
    requested = str(values["parallelism"])
    parallelism = "ddp" if requested == "auto" else requested
    if gpu is not None:
        parallelism = mp.auto_parallelism(requested, replica, drafter_params, gpu.total)
    runtime = section_of(TrainingRuntime, values)
    backend = "flex" if runtime.attention_backend == "auto" else runtime.attention_backend  # resolve_backend on CUDA
    inputs = mp.run_inputs(runtime, section_of(TrainingRecipe, values), cfg, sizes,
                           max_length, parallelism,
                           device_type="cuda", world_size=world, shard_size=settings.gpus,
                           target_bytes=target_bytes, backend=backend)
    plan = mp.plan_memory(inputs)
    chosen = f"{parallelism} (from auto)" if requested == "auto" and gpu is not None else parallelism
    summary = (f"{chosen}, {world} rank(s), max_length {max_length:,}, N={inputs.anchors} anchors x block "
               f"{cfg.block_size}, {inputs.micro_batch_rows} row(s) per micro-batch, "
               f"{'activation checkpointing' if inputs.activation_checkpointing else 'no activation checkpointing'}")
    if gpu is None:
        other = "fsdp" if parallelism == "ddp" else "ddp"
        alt = mp.plan_memory(replace(inputs, parallelism=other)).peak
        return StageFit("train", "", "not checked", plan.peak, None, f"{summary}; under {other}: {gib(alt)}",
                        gpu_note)
    plan = plan.with_available(gpu.usable, f"{gpu.name}: free of {gib(gpu.total)}")
    where = f"{gpu.name} ({gpu_note})"
    if plan.fits:
        return StageFit("train", where, "fits", plan.peak, gpu.usable, summary)
    fixes = mp.remedies(plan, _RUN_FILE_FIX)
    bigger = [m.name for m in fitting(plan.peak) if m.total > gpu.total]
    if bigger:
        fixes.append("a bigger GPU: " + ", ".join(bigger))
    reason = (f"predicted peak {gib(plan.peak)} per GPU does not fit the {gib(gpu.usable)} free on {gpu.name} "
              f"({summary})")
    return StageFit("train", where, "refused", plan.peak, gpu.usable, summary, reason, tuple(fixes),
                    detail=mp.refusal_message(plan, fixes))


def _engine_fit(stage: str, engine: Engine, gpu_note: str, heads: int, unchecked: str,
                concurrency: tuple[int, str] | None = None) -> StageFit:
    if unchecked:
        return StageFit(stage, "", "not checked", engine.need, None,
                        f"weights {gib(engine.weights)} + KV {gib(engine.per_sequence)} per "
                        f"{engine.max_model_len:,}-token sequence per GPU (tp {engine.tp})", unchecked, engine=True)
    where = f"{engine.gpu.name} ({gpu_note})"
    if not engine.fits:
        return StageFit(stage, where, "refused", engine.need, engine.budget, engine.summary(), engine.refusal(),
                        tuple(engine_remedies(engine, stage, heads)), engine=True)
    warnings: tuple[str, ...] = ()
    if concurrency is not None and engine.at_once < concurrency[0]:
        warnings = (f"the KV cache holds {engine.at_once} sequence(s) of max_model_len {engine.max_model_len:,} at "
                    f"once per engine, fewer than the {concurrency[0]} it keeps in flight ({concurrency[1]}): vLLM "
                    f"runs {engine.at_once} at once and queues the rest, so a throughput figure for full "
                    "concurrency is optimistic (counted at max_model_len each: shorter sequences share the cache; "
                    "more GPUs per engine, stages.generate.gpus, or a shorter max_model_len raise it)",)
    return StageFit(stage, where, "fits", engine.need, engine.budget, engine.summary(), warnings=warnings,
                    engine=True)


def _placeholder(gpu: GpuModel | None) -> GpuModel:
    # Without a GPU the engine's per-GPU weights and cache are still printed; the budget is then unknown.
    return gpu or GpuModel("unknown", 0, 0)


def _generate(run: RunConfig, settings: JobSettings, raw: Mapping[str, Any], sizes: TargetSizes,
              gpu: GpuModel | None, gpu_note: str) -> StageFit:
    from dflash_generate.config import generation_limits

    values = stage_values(run, GENERATE)
    family = (family_of_config(raw) or QWEN3).name
    _, context = generation_limits(family, bool(values["cap_to_training_window"]),
                                   int(values["training_window"]), values["max_new_tokens"], values["max_model_len"])
    dtype = DTYPE_BYTES.get(str(values["dtype"]), sizes.dtype_bytes)
    engine = Engine(sizes, _placeholder(gpu), dtype, settings.gpus or 1, int(context),
                    float(values["gpu_memory_utilization"]), values["max_num_seqs"])
    inflight = int(values["max_inflight"] or values["chunk_records"])
    seqs = f"max_num_seqs {engine.seqs}{'' if values['max_num_seqs'] else ' (vLLM default)'}"
    return _engine_fit("generate", engine, gpu_note, _heads(raw), "" if gpu else gpu_note,
                       (min(engine.seqs, inflight), f"min({seqs}, max_inflight {inflight})"))


def _serve_check(run: RunConfig, settings: JobSettings, raw: Mapping[str, Any], sizes: TargetSizes,
                 cfg: DrafterConfig, gpu: GpuModel | None, gpu_note: str) -> StageFit:
    values, offline = stage_values(run, SERVE_CHECK), stage_values(run, EVALUATE)
    block = int(offline["block_size"] or cfg.block_size)
    # Its default context: the longest prompt evaluated + max_new_tokens + a block.
    context = values["max_model_len"] or int(offline["max_prompt_tokens"]) + int(offline["max_new_tokens"]) + block
    dtype = DTYPE_BYTES.get(str(values["dtype"]), 2)  # auto: the offline evaluation's, bfloat16 on CUDA
    tp = settings.gpus or 1
    drafter_kv = kv_bytes_per_token(cfg.num_layers, cfg.num_key_value_heads, cfg.head_dim, dtype, tp)
    engine = Engine(sizes, _placeholder(gpu), dtype, tp, int(context), float(values["gpu_memory_utilization"]),
                    values["max_num_seqs"], mp.drafter_parameter_count(cfg)[0], drafter_kv)
    return _engine_fit("serve-check", engine, gpu_note, _heads(raw), "" if gpu else gpu_note)


def _heads(raw: Mapping[str, Any]) -> int:
    return int(text_config(raw)["num_attention_heads"])


def _evaluate(run: RunConfig, sizes: TargetSizes, cfg: DrafterConfig, gpu: GpuModel | None,
              gpu_note: str) -> StageFit:
    values = stage_values(run, EVALUATE)
    dtype = DTYPE_BYTES.get(str(values["dtype"]), 2)
    drafter = mp.drafter_parameter_count(cfg)[0]
    tokens = int(values["max_prompt_tokens"]) + int(values["max_new_tokens"]) + cfg.block_size
    weights = (sizes.params + 2 * drafter) * dtype
    cache = tokens * sizes.kv_bytes_per_token(dtype) + sizes.recurrent_bytes_per_sequence(dtype)
    # The captured target features, once in the drafter's context and once being concatenated; the prefill's
    # hidden states and MLP activations of one layer (as the memory plan's target forward).
    acts = tokens * (2 * cfg.feature_size + sizes.layer_activations_per_token) * dtype
    peak = int((weights + cache + acts) * (1 + mp.MARGIN_FRACTION)) + mp.CUDA_WORKSPACE_BYTES
    summary = (f"target {gib(sizes.params * dtype)} + 2 drafters {gib(2 * drafter * dtype)} + cache "
               f"{gib(cache)} and activations {gib(acts)} of a {tokens:,}-token sequence, margin and workspaces")
    if gpu is None:
        return StageFit("evaluate", "", "not checked", peak, None, summary, gpu_note)
    where = f"{gpu.name} ({gpu_note})"
    if peak <= gpu.usable:
        return StageFit("evaluate", where, "fits", peak, gpu.usable, summary)
    fixes = [f"a bigger GPU: {', '.join(m.name for m in fitting(peak))}"] if fitting(peak) else []
    if dtype == 4:
        fixes.insert(0, 'stages.evaluate.config.dtype = "bfloat16"')
    reason = f"predicted peak {gib(peak)} does not fit the {gib(gpu.usable)} free on {gpu.name}"
    return StageFit("evaluate", where, "refused", peak, gpu.usable, summary, reason, tuple(fixes))


def check_fit(run: RunConfig, store: ObjectStore | None, *, target_config: Path | Mapping[str, Any] | None = None,
              run_file: Path | None = None, only: list[str] | None = None) -> FitReport:
    """The fit check of the run's GPU stages (`only`: those named), as the module docstring states it."""
    raw, source = read_target_config(run, store, target_config, run_file)
    if raw is None:
        return FitReport(source, ran=False)
    try:
        sizes = target_sizes(raw)
    except ValueError as err:
        return FitReport(f"{source}: {err}", ran=False)
    gpu_stages = [s for s in selected_stages(run, only) if run.stages.for_stage(s.name).gpus]
    cfg = drafter_of(stage_values(run, TRAIN), raw) if gpu_stages else None
    out = []
    for stage in gpu_stages:
        settings = run.stages.for_stage(stage.name)
        gpu, note = gpu_of(run, settings)
        assert cfg is not None
        if stage.name == "train":
            out.append(_train(run, settings, raw, sizes, cfg, gpu, note))
        elif stage.name == "generate":
            out.append(_generate(run, settings, raw, sizes, gpu, note))
        elif stage.name == "serve-check":
            out.append(_serve_check(run, settings, raw, sizes, cfg, gpu, note))
        elif stage.name == "evaluate":
            out.append(_evaluate(run, sizes, cfg, gpu, note))
    params = f"{sizes.architecture}, {sizes.params / 1e9:.2f}B parameters" + (
        f" ({sizes.active_params / 1e9:.2f}B active per token)" if sizes.layer_active_params else "")
    return FitReport(f"{source}: {params}", tuple(out), target_refusal=size_mismatch(run, sizes.params, source))


# How far the staged target's parameter count may stray from the count in its model id ("27B"): a name rounds
# (Qwen3-8B has 8.2B parameters, 30B-A3B 30.5B), a different model is off by several times.
SIZE_TOLERANCE = 1.5


def size_mismatch(run: RunConfig, params: int, source: str) -> str:
    """Why the target's config.json (`params` parameters, read from `source`) is not the model target.model_id
    names, or "" when it is, the id states no count, or target.allow_size_mismatch is set."""
    if run.target.allow_size_mismatch:
        return ""
    stated = stated_parameters(run.target.model_id).total_b  # of "30B-A3B" the total
    if stated is None or not params:
        return ""
    named = stated * 1e9
    if 1 / SIZE_TOLERANCE <= params / named <= SIZE_TOLERANCE:
        return ""
    return (f"{source} describes {params / 1e9:.2f}B parameters, target.model_id {run.target.model_id!r} "
            f"{named / 1e9:g}B. Stage the named model at target.uri (`dflash-pipeline stage-model`), correct "
            "target.model_id, or, for a model whose name states another size, set target.allow_size_mismatch = "
            "true")


def check_before_submit(run_file: Path, target_config: Path | None, only: list[str] | None, setup: bool) -> None:
    """`submit`'s check: the fit lines on stderr (stdout carries the objects), a ConfigError when one does not fit."""
    if setup:
        return  # the namespace's setup holds no GPU
    report = check_fit(load_run_config(run_file), ObjectStore(), target_config=target_config, run_file=run_file,
                       only=only)
    for line in report.lines(warnings=True):
        print(line, file=sys.stderr)
    if report.blocked:
        raise ConfigError(report.message())
