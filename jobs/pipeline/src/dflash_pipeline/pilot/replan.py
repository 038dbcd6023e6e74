"""`plan --from-pilot REPORT`: the full run planned again from what its pilot measured.

The pilot measured the rates the full run scales with (generate, tokenize and train throughput, the offline
loop's decode rate) and the sizes of its records (answers, stored bytes per token). The re-plan puts them in the
run's `[plan]` in place of the assumptions and points `[plan] measured_from` at the pilot's prefix, whose
manifests give the measured answer lengths and bytes per token the plan already knows how to read; then every
figure that moved is listed beside the assumption it replaced.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_pipeline.pilot.derive import pilot_run_id
from dflash_pipeline.pilot.report import PilotReport
from dflash_pipeline.plan.run_plan import RunPlan, build_plan
from dflash_pipeline.plan.tokens import answer_mean_for
from dflash_pipeline.run.config import RunConfig
from dflash_pipeline.run.layout import layout
from dflash_shared.errors import ConfigError
from dflash_shared.storage import ObjectStore

# Report key -> the [plan] field it replaces.
RATE_FIELDS = {
    "generate_tokens_per_s_per_gpu": "generate_tokens_per_s_per_gpu",
    "tokenize_tokens_per_s_per_pod": "tokenize_tokens_per_s_per_pod",
    "train_tokens_per_s_per_gpu": "train_tokens_per_s_per_gpu",
    "evaluate_tokens_per_s": "evaluate_tokens_per_s",
}
# A figure that moved by less than this is not listed.
MOVED = 0.005


@dataclass(frozen=True)
class Moved:
    name: str
    before: float
    before_source: str
    after: float
    after_source: str

    @property
    def change(self) -> float:
        return self.after / self.before - 1 if self.before else float("inf")


def replanned_run(run: RunConfig, report: PilotReport) -> RunConfig:
    """`run` with the pilot's measurements as its [plan] figures."""
    if report.pilot_of != run.run_id:
        raise ConfigError(f"the report is of the pilot of run {report.pilot_of!r}, not of {run.run_id!r}: pass the "
                          "report of this run's pilot (<root>/<run>-pilot/report.json)")
    update: dict[str, object] = {field: report.measured[key] for key, field in RATE_FIELDS.items()
                                 if report.measured.get(key)}
    mean = report.measured.get("mean_completion_tokens")
    budget = (report.planned.get("figures") or {}).get("completion budget per prompt", {}).get("value")
    if mean and budget:
        # The pilot's answers were cut at the same budget; the plan's input is the uncut mean.
        update["mean_completion_tokens"] = answer_mean_for(float(mean), float(budget))
    if report.measured.get("mean_prompt_tokens"):
        update["mean_prompt_tokens"] = report.measured["mean_prompt_tokens"]
    if run.plan.prompts is None and report.measured.get("source_records"):
        # The pilot read the whole source to draw its sample: the full run imports that many.
        update["prompts"] = int(report.measured["source_records"])
    update["measured_from"] = layout(run.root, pilot_run_id(run.run_id)).run_prefix
    return run.model_copy(update={"plan": run.plan.model_copy(update=update)})


def replan(run: RunConfig, report: PilotReport, store: ObjectStore | None) -> tuple[RunPlan, list[Moved]]:
    """The full run's plan before and after the pilot's figures, and every figure that moved."""
    before = build_plan(run, None)
    after = build_plan(replanned_run(run, report), store)
    from_pilot = set(RATE_FIELDS.values()) | {"mean_completion_tokens", "mean_prompt_tokens", "prompts"}
    moved = []
    for name, figure in after.figures.items():
        old = before.figures.get(name)
        if old is None or not old.value:
            continue
        if abs(figure.value / old.value - 1) < MOVED:
            continue
        source = figure.source
        if source == "run file" and _field_of(name) in from_pilot:
            source = "pilot"
        moved.append(Moved(name, old.value, old.source, figure.value, source))
    for name, figure in after.figures.items():
        if figure.source == "run file" and _field_of(name) in from_pilot:
            after.figures[name] = type(figure)(figure.value, "pilot")
    return after, moved


def _field_of(figure: str) -> str | None:
    return {"generate tokens/s/GPU": "generate_tokens_per_s_per_gpu",
            "tokenize tokens/s/pod": "tokenize_tokens_per_s_per_pod",
            "train tokens/s/GPU": "train_tokens_per_s_per_gpu", "evaluate tokens/s": "evaluate_tokens_per_s",
            "mean answer tokens (uncut)": "mean_completion_tokens", "mean prompt tokens": "mean_prompt_tokens",
            "prompts": "prompts"}.get(figure)


def format_moved(before: RunPlan, after: RunPlan, moved: list[Moved]) -> str:
    """What moved, in words, with the totals before and after."""
    def totals(plan: RunPlan) -> tuple[float, float]:
        return (sum(s.gpu_hours or 0 for s in plan.stages), sum(s.wall_seconds or 0 for s in plan.stages))

    from dflash_pipeline.plan.run_plan import long_duration

    (h0, w0), (h1, w1) = totals(before), totals(after)
    price = after.gpu_hour_price
    cost = "" if price is None else f"; cost {h0 * price:,.0f} -> {h1 * price:,.0f} {after.currency}"
    lines = [f"re-planned from the pilot: {h0:,.0f} -> {h1:,.0f} GPU-hours, {long_duration(w0)} -> "
             f"{long_duration(w1)} of wall time{cost}"]
    if not moved:
        lines.append("no assumption moved by more than 0.5%")
    for m in moved:
        lines.append(f"  moved: {m.name}: {m.before:,.2f} ({m.before_source}) -> {m.after:,.2f} ({m.after_source}), "
                     f"{m.change:+.0%}")
    return "\n".join(lines) + "\n"
