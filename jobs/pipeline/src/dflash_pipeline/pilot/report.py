"""The pilot's report: per stage what the pilot measured beside what the plan assumed, and a verdict.

`build_report` reads the pilot's manifests (the figures every stage records: generate's throughput, the drafter
manifest's `performance`, evaluation and serving tau) and the pilot's own plan, computed offline from the same
run file so that its figures are the assumptions and never the measurements. It is written to
`<root>/<run>-pilot/report.json` when the pilot ends (by the run driver on a cluster, by `local --pilot` here)
and read by `status` and `plan --from-pilot`.

A stage's verdict compares its rate with the plan's where the stage has one (the rates are what the full run
scales with; a pilot's wall time is mostly start-up), else its wall time: within `TOLERANCE` it is "as planned",
beyond it "slower (or faster) than planned by X%". A stage that did not commit its output has no figures: its
verdict says so, with the driver's recorded reason where there is one. Every figure says where it came from; one
that was not measured is None and printed as "not measured", never filled in from the plan.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dflash_pipeline.run.config import RunConfig
from dflash_pipeline.run.layout import EXPORT_FOLDER, SERVING_FOLDER, layout
from dflash_shared.manifest_io import ManifestError, parse_manifest
from dflash_shared.manifests import MANIFEST_NAME, Kind, Manifest
from dflash_shared.storage import ObjectNotFoundError, ObjectStore, join

REPORT_NAME = "report.json"
# A measured rate within this share of the plan's is "as planned".
TOLERANCE = 0.15
# Dense bf16 tensor throughput per GPU (the vendors' data-sheet figures, no sparsity): the MFU denominator.
PEAK_BF16_FLOPS = {"B200": 2250e12, "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}
# Below this share of labels equal to the target's own greedy token, the pilot's verdict names the drift: greedy
# regeneration by the same target agrees nearly everywhere (bf16 near-ties part a few percent).
LOW_LABEL_AGREEMENT = 0.5
MFU_FORMULA = ("(2 x target parameters run per token x input tokens/s + 6 x drafter parameters x label tokens/s) / "
               "(GPUs x peak bf16 FLOP/s)")


class Figure(BaseModel):
    """One figure of a stage: measured beside planned, either may be missing."""

    model_config = ConfigDict(extra="forbid")

    name: str
    measured: float | None = Field(description="What the pilot measured; None: not measured.")
    planned: float | None = Field(default=None, description="What the plan assumed; None: no assumption.")
    unit: str = ""
    note: str | None = None


def _planned(value: float | None) -> float | None:
    """A plan figure worth showing beside a measurement: a plan that has none (0) assumed nothing."""
    return value if value else None


class StageReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage: str
    committed: bool = Field(description="The stage's output manifest exists.")
    wall_seconds: float | None = Field(description="Measured: the stage's start to its manifest.")
    planned_wall_seconds: float | None
    figures: list[Figure] = Field(default_factory=list)
    verdict: str
    fix: str | None = None


class PilotReport(BaseModel):
    """`report.json` under the pilot's prefix."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = 1
    run_id: str
    pilot_of: str
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    gpu_model: str | None
    stages: list[StageReport]
    measured: dict[str, float] = Field(
        default_factory=dict, description="The rates and sizes `plan --from-pilot` re-plans the full run from."
    )
    planned: dict[str, Any] = Field(default_factory=dict, description="The pilot's plan (`plan --json`).")

    def stage(self, name: str) -> StageReport | None:
        return next((s for s in self.stages if s.stage == name), None)


def report_uri(run: RunConfig) -> str:
    return join(layout(run.root, run.run_id).run_prefix, REPORT_NAME)


def pilot_report_uri(root: str, full_run_id: str) -> str:
    """Where the pilot of the run `full_run_id` writes its report."""
    from dflash_pipeline.pilot.derive import pilot_run_id

    return join(layout(root, pilot_run_id(full_run_id)).run_prefix, REPORT_NAME)


def read_report(store: ObjectStore, uri: str) -> PilotReport | None:
    try:
        return PilotReport.model_validate_json(store.read_bytes(uri))
    except ObjectNotFoundError:
        return None


def write_report(store: ObjectStore, run: RunConfig, report: PilotReport) -> str:
    uri = report_uri(run)
    store.write_bytes(uri, report.model_dump_json(indent=2).encode("utf-8"))
    return uri


def gpu_model(run: RunConfig) -> str | None:
    """The GPU the run assumes: [plan] gpu_model, else the train stage's pinned product."""
    return run.plan.gpu_model or next(iter(run.stages.train.gpu_types), None)


def peak_flops(model: str | None) -> float | None:
    if model is None:
        return None
    return next((flops for name, flops in PEAK_BF16_FLOPS.items() if re.search(name, model, re.IGNORECASE)), None)


class _Manifests:
    def __init__(self, store: ObjectStore, run: RunConfig) -> None:
        lay = layout(run.root, run.run_id)
        self.store = store
        self.prefixes = {"import": lay.prefix(Kind.prompts if run.source.kind == "prompts" else Kind.completions),
                         "generate": lay.completions, "tokenize": lay.tokenized, "train": lay.drafter,
                         "export": lay.folder(EXPORT_FOLDER), "evaluate": lay.evaluation,
                         "serve-check": lay.folder(SERVING_FOLDER)}
        self.cache: dict[str, Manifest | None] = {}

    def get(self, stage: str) -> Manifest | None:
        if stage not in self.cache:
            uri = join(self.prefixes[stage], MANIFEST_NAME)
            try:
                self.cache[stage] = parse_manifest(uri, self.store.read_bytes(uri))
            except (ObjectNotFoundError, ManifestError):
                self.cache[stage] = None
        return self.cache[stage]


def _verdict(measured: float | None, planned: float | None, higher_is_faster: bool, what: str) -> str:
    if measured is None or planned is None or measured <= 0 or planned <= 0:
        return f"{what}: not measured" if measured is None else f"{what}: measured, no plan figure to compare"
    slower = planned / measured - 1 if higher_is_faster else measured / planned - 1
    if abs(slower) <= TOLERANCE:
        return "as planned"
    return f"{'slower' if slower > 0 else 'faster'} than planned by {abs(slower):.0%} ({what})"


# What a failed stage's reason says when memory stopped it: the memory plan's refusal, the CUDA allocator, the
# kernel's OOM killer (exit 137), vLLM's KV-cache check.
_NO_FIT = re.compile(r"does not fit|out of memory|OutOfMemory|OOMKilled|exit(ed)? (code )?137|KV cache",
                     re.IGNORECASE)


def _failed_verdict(stage: str, reason: str) -> tuple[str, str]:
    if _NO_FIT.search(reason):
        return (f"would not fit: {reason}",
                f"`python -m dflash_pipeline plan --config RUN.toml` names the settings that fit stage {stage} "
                "(parallelism = \"fsdp\", activation_checkpointing, a smaller max_length or anchor cap; more tensor "
                "parallelism or a shorter max_model_len for the engines); change them in the full run file too")
    return (f"failed: {reason}", "fix the cause (the stage's log), then run the pilot again: committed stages are "
            "skipped")


def build_report(store: ObjectStore, pilot: RunConfig, started: dict[str, float] | None = None,
                 failures: dict[str, str] | None = None) -> PilotReport:
    """The report of the pilot `pilot` (a run `derive_pilot` made). `started`: each stage's start (epoch seconds)
    where the caller saw it; otherwise a stage starts when its upstream manifest was committed. `failures`: the
    reason of each stage that failed (the run stops there: the report is written all the same)."""
    from dflash_pipeline.plan.run_plan import build_plan, plan_json
    from dflash_pipeline.run.stages import plan as run_stages

    planned = build_plan(pilot, None)
    plan_rows = {s.stage: s for s in planned.stages}
    figures = {name: f.value for name, f in planned.figures.items()}
    manifests = _Manifests(store, pilot)
    started = started or {}
    measured: dict[str, float] = {}
    reports: list[StageReport] = []
    previous: Manifest | None = None
    for stage in run_stages(pilot):
        name = stage.name
        manifest = manifests.get(name)
        start = started.get(name) or (previous.created_at.timestamp() if previous is not None else None)
        wall = None if manifest is None or start is None else max(0.0, manifest.created_at.timestamp() - start)
        row = plan_rows.get(name)
        planned_wall = row.wall_seconds if row is not None else None
        if manifest is None:
            reason = (failures or {}).get(name)
            verdict, fix = (_failed_verdict(name, reason) if reason is not None else
                            ("not committed: no figures", f"python -m dflash_pipeline status --config RUN.toml "
                             f"--pilot shows where {name} stands"))
            reports.append(StageReport(stage=name, committed=False, wall_seconds=None,
                                       planned_wall_seconds=planned_wall, verdict=verdict, fix=fix))
            previous = None
            continue
        builder = _STAGE_FIGURES.get(name)
        rows, rate_verdict, rate_fix = (builder(manifest, manifests, pilot, figures, wall, measured)
                                        if builder is not None else ([], None, None))
        reports.append(StageReport(stage=name, committed=True, wall_seconds=wall, planned_wall_seconds=planned_wall,
                                   figures=rows, fix=rate_fix, verdict=rate_verdict or _verdict(
                                       wall, planned_wall, higher_is_faster=False, what="wall time")))
        previous = manifest
    return PilotReport(run_id=pilot.run_id, pilot_of=pilot.pilot_of or pilot.run_id, gpu_model=gpu_model(pilot),
                       stages=reports, measured=measured, planned=plan_json(planned))


_Built = tuple[list[Figure], str | None, str | None]


def _generate(m: Manifest, _: _Manifests, run: RunConfig, plan: dict[str, float], wall: float | None,
              out: dict[str, float]) -> _Built:
    section: Any = m.section
    throughput = section.throughput or {}
    gpus = max(1, run.stages.generate.gpus)
    engine = throughput.get("output_tokens_per_s_per_engine")
    per_gpu = None if engine is None else engine / gpus
    prompt_rate = throughput.get("prompt_tokens_per_s_per_engine")
    records = m.total_records
    mean_answer = section.output_tokens / records if records else None
    note = None if "output_tokens_per_s_per_gpu" in throughput else "a CPU engine here, not a GPU"
    rows = [Figure(name="decode tokens/s per GPU", measured=per_gpu, planned=plan.get("generate tokens/s/GPU"),
                   unit="tok/s", note=note),
            Figure(name="prefill (prompt) tokens/s per GPU", measured=None if prompt_rate is None else
                   prompt_rate / gpus, unit="tok/s", note="the same engine-seconds as decode: vLLM batches both"),
            Figure(name="mean completion tokens", measured=mean_answer,
                   planned=_planned(plan.get("mean completion tokens")), unit="tokens")]
    seconds = throughput.get("engine_seconds")
    if prompt_rate and seconds and records:
        out["mean_prompt_tokens"] = prompt_rate * seconds / records
    if per_gpu:
        out["generate_tokens_per_s_per_gpu"] = per_gpu
    if mean_answer is not None:
        out["mean_completion_tokens"] = mean_answer
    if section.window_fraction is not None:
        out["generate_window_fraction"] = section.window_fraction
    verdict = _verdict(per_gpu, plan.get("generate tokens/s/GPU"), True, "decode tokens/s per GPU")
    fix = None if verdict == "as planned" else "plan --from-pilot re-plans the full run at the measured rate"
    return rows, verdict, fix


def _import(m: Manifest, _: _Manifests, run: RunConfig, plan: dict[str, float], wall: float | None,
            out: dict[str, float]) -> _Built:
    acc = m.accounting
    # What the full run will import: every usable record the sample was drawn from.
    usable = acc.input_records - acc.failed - acc.skips_by_reason.get("duplicate", 0)
    out["source_records"] = float(usable)
    return [Figure(name="records read", measured=float(acc.input_records), unit="records"),
            Figure(name="records kept (the sample)", measured=float(m.total_records), unit="records",
                   note=f"{acc.failed} failed, {acc.skipped} skipped, of which sampled out "
                        f"{acc.skips_by_reason.get('sampled_out', 0)}")], None, None


def _tokenize(m: Manifest, _: _Manifests, run: RunConfig, plan: dict[str, float], wall: float | None,
              out: dict[str, float]) -> _Built:
    section: Any = m.section
    pods = run.stages.tokenize.shards
    records_per_s = None if not wall else m.accounting.input_records / wall
    tokens_per_pod = None if not wall else section.total_tokens / wall / pods
    if tokens_per_pod:
        out["tokenize_tokens_per_s_per_pod"] = tokens_per_pod
    rows = [Figure(name="records/s", measured=records_per_s, unit="records/s", note="over the stage's wall time"),
            Figure(name="tokens/s per pod", measured=tokens_per_pod, planned=plan.get("tokenize tokens/s/pod"),
                   unit="tok/s", note="start-up included: a lower bound on the rate")]
    if m.total_records:
        out["mean_record_tokens"] = section.total_tokens / m.total_records
    return rows, None, None


def _train(m: Manifest, _: _Manifests, run: RunConfig, plan: dict[str, float], wall: float | None,
           out: dict[str, float]) -> _Built:
    section: Any = m.section
    perf: dict[str, float] = dict(section.performance or {})
    world = int(perf.get("world_size") or run.stages.train.nodes * max(1, run.stages.train.gpus))
    tokens = perf.get("tokens_per_s")
    per_gpu = None if tokens is None else tokens / world
    planned_rate = plan.get("train tokens/s/GPU")
    batch = _train_value(run, "batch_tokens")
    planned_step = None if not planned_rate or batch is None else batch / (planned_rate * world)
    flops = peak_flops(gpu_model(run)) if run.stages.train.gpus else None
    mfu = None
    if flops and tokens is not None and perf.get("target_parameters") and perf.get("drafter_parameters"):
        mfu = (2 * perf["target_parameters"] * tokens + 6 * perf["drafter_parameters"]
               * perf.get("label_tokens_per_s", 0.0)) / (world * flops)
    restart = _train_value(run, "restart_after_step")
    resumed = perf.get("resumed_from_step")
    rows = [
        Figure(name="step time", measured=perf.get("step_seconds"), planned=planned_step, unit="s"),
        Figure(name="tokens/s per GPU", measured=per_gpu, planned=planned_rate, unit="tok/s"),
        Figure(name="MFU", measured=mfu, unit="", note=MFU_FORMULA if mfu is not None else
               "not measured: no peak FLOP/s for this device (a CPU run, or a GPU model the table lacks)"),
        Figure(name="peak memory per GPU", measured=perf.get("peak_memory_gib_max"),
               planned=perf.get("planned_peak_gib"), unit="GiB", note="planned: the memory plan's prediction"),
        Figure(name="checkpoint save", measured=perf.get("checkpoint_save_seconds"), unit="s"),
        Figure(name="resume from checkpoint", measured=perf.get("resume_seconds"), unit="s",
               note=None if resumed is not None else "no resume happened"),
    ]
    metrics: dict[str, float] = dict(section.final_metrics or {})
    agreement = metrics.get("label_agreement_first", metrics.get("label_agreement"))
    rows.append(Figure(name="label agreement", measured=agreement, unit="share",
                       note="trained labels that are the trainer target's own greedy token, as training started"
                       if agreement is not None else "not measured (label_agreement off, or a drafter manifest "
                       "made before it was recorded)"))
    if per_gpu:
        out["train_tokens_per_s_per_gpu"] = per_gpu
    verdict = _verdict(per_gpu, planned_rate, True, "tokens/s per GPU")
    fix = None if verdict == "as planned" else "plan --from-pilot re-plans the full run at the measured rate"
    peak, predicted = perf.get("peak_memory_gib_max"), perf.get("planned_peak_gib")
    if peak is not None and predicted is not None and peak > predicted:
        verdict += f"; peak memory {peak:.1f} GiB exceeds the memory plan's {predicted:.1f} GiB"
        fix = ("the memory plan underestimates this setting: keep headroom (parallelism = \"fsdp\" or "
               "activation_checkpointing = true) before the full run")
    if agreement is not None and agreement < LOW_LABEL_AGREEMENT:
        verdict += f"; only {100 * agreement:.0f}% of the trained labels are the target's own greedy tokens"
        fix = ("the data does not say what this target says: check the chat template and enable_thinking of the "
               "generate and tokenize stages against the target's, greedy sampling, and the target checkpoint")
    if restart and resumed is None:
        verdict += f"; the restart at step {restart} did not resume from its checkpoint"
        fix = "read the train logs (its second start): the full run's preemptions would not resume either"
    return rows, verdict, fix


def _train_value(run: RunConfig, field: str) -> Any:
    from dflash_pipeline.run.stages import TRAIN, stage_values

    return stage_values(run, TRAIN).get(field)


def _export(m: Manifest, manifests: _Manifests, run: RunConfig, plan: dict[str, float], wall: float | None,
            out: dict[str, float]) -> _Built:
    served = manifests.get("serve-check")
    note = "the serving check loaded it in vLLM" if served is not None else "not loaded yet: serve-check has not run"
    return [Figure(name="loaded by the engine", measured=None if served is None else 1.0, unit="yes", note=note)], \
        None, None


def _evaluate(m: Manifest, _: _Manifests, run: RunConfig, plan: dict[str, float], wall: float | None,
              out: dict[str, float]) -> _Built:
    section: Any = m.section
    from dflash_pipeline.run.stages import EVALUATE, stage_values

    values = stage_values(run, EVALUATE)
    decoded = m.total_records * int(values["max_new_tokens"]) if m.total_records else None
    rate = None if not wall or decoded is None else decoded / wall
    if rate:
        out["evaluate_tokens_per_s"] = rate
    return [Figure(name="tau offline", measured=section.tau, unit="tokens/step",
                   note="a pilot's few-step drafter: a check of the path, not a forecast of the run's tau"),
            Figure(name="tau untrained", measured=section.tau_untrained, unit="tokens/step"),
            Figure(name="decode tokens/s", measured=rate, planned=plan.get("evaluate tokens/s"), unit="tok/s",
                   note="over the stage's wall time, start-up included"),
            *_learnability(section.metrics)], None, None


def _learnability(metrics: dict[str, float]) -> list[Figure]:
    """The learnability gate's row, where it ran (the stage fails when the gate does, so a row here passed)."""
    if "learnability_acceptance" not in metrics:
        return []
    return [Figure(name="learnability gate", measured=metrics["learnability_acceptance"], unit="share",
                   note="drafted tokens accepted after memorising a few answers: passed (a share below the gate's "
                   "floor fails evaluate)")]


def _serve_check(m: Manifest, _: _Manifests, run: RunConfig, plan: dict[str, float], wall: float | None,
                 out: dict[str, float]) -> _Built:
    section: Any = m.section
    return [Figure(name="tau engine", measured=section.engine_tau, unit="tokens/step"),
            Figure(name="tau offline", measured=section.tau, unit="tokens/step")], None, None


_STAGE_FIGURES = {"import": _import, "generate": _generate, "tokenize": _tokenize, "train": _train, "export": _export,
                  "evaluate": _evaluate, "serve-check": _serve_check}


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "not measured"
    if unit == "yes":
        return "yes"
    if unit == "":
        return f"{value:.1%}"
    text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.2f}"
    return f"{text} {unit}".strip()


def format_report(report: PilotReport) -> str:
    """The report as `status` and `plan --from-pilot` print it."""
    from dflash_pipeline.plan.run_plan import long_duration

    lines = [f"pilot report of {report.pilot_of} (run {report.run_id}, {report.created_at:%Y-%m-%d %H:%M} UTC, "
             f"GPU {report.gpu_model or 'not named'})"]
    for s in report.stages:
        wall = "not measured" if s.wall_seconds is None else long_duration(s.wall_seconds)
        lines.append(f"  {s.stage}: {s.verdict} (wall {wall}, planned {long_duration(s.planned_wall_seconds)})")
        for f in s.figures:
            planned = "" if f.planned is None else f"; plan {_value(f.planned, f.unit)}"
            note = "" if not f.note else f" ({f.note})"
            lines.append(f"      {f.name}: {_value(f.measured, f.unit)}{planned}{note}")
        if s.fix:
            lines.append(f"      fix: {s.fix}")
    return "\n".join(lines) + "\n"

