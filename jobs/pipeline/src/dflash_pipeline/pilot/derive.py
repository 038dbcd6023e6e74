"""A run's pilot: the full run at full shape with only its counts reduced, under its own run id.

Everything that can fail at scale is kept as the run file says: the images (by digest), the target, storage,
namespace, scheduling and placement, the GPU model, tensor parallelism, the train stage's node count and
parallelism (the multi-node gang must form), and every shape: training window, anchors, batch tokens, block
size, generation budget, thinking mode. What shrinks (`[pilot]`, `PilotSettings`):

- import draws a sample of the run's own source (`sample_records`, a hash of each record's content id), on one
  pod, since the sample is drawn over every record;
- generate and tokenize run on fewer pods, each with the full run's resources;
- train runs `train_steps` steps, saves a checkpoint at `restart_at_step`, stops there as a preemption does
  and is resumed by the Job's retry (`restart_after_step`): save, exit, rendezvous and resume all happen once;
- tokenize holds out enough records that evaluate can decode `evaluate_prompts` held-out prompts; evaluate's
  quality floor is off (a 30-step drafter measures the path, not the drafter), its lossless checks stay;
- every Job gets a short deadline, so a hung pilot gives its GPUs back in hours, not days.

The pilot is derived from the run file's data and validated again as a whole, so it is exactly as valid as a
run file written by hand would be.
"""

from __future__ import annotations

from typing import Any

from dflash_pipeline.run.config import MAX_RUN_ID, STAGE_DEFAULTS, RunConfig, parse_run_config

PILOT_SUFFIX = "-pilot"
# evaluate's quality floor (min_tau) in a pilot: its drafter trained 30 steps, which says nothing of the run's.
PILOT_MIN_TAU = 0.0
# The pilot's sample against evaluate's prompts: tokenize holds out two per evaluated prompt, and at least as many
# again must be left to train on.
HELD_OUT_SHARE = 4


def pilot_run_id(run_id: str) -> str:
    """`<run>-pilot`; a ConfigError where the suffix would make the run id too long to name the Jobs."""
    from dflash_shared.errors import ConfigError

    if len(run_id) + len(PILOT_SUFFIX) > MAX_RUN_ID:
        raise ConfigError(f"run_id {run_id!r} is {len(run_id)} characters: its pilot {run_id + PILOT_SUFFIX!r} "
                          f"would exceed {MAX_RUN_ID}; shorten run_id to at most {MAX_RUN_ID - len(PILOT_SUFFIX)}")
    return run_id + PILOT_SUFFIX


def _stage(data: dict[str, Any], name: str) -> dict[str, Any]:
    """The stage's settings table in `data`, its defaults filled in (what the run file leaves out)."""
    stages = data.setdefault("stages", {})
    table = {**STAGE_DEFAULTS.get(name, {}), **stages.get(name, {})}
    table["config"] = dict(table.get("config") or {})
    stages[name] = table
    return table


def _shrink_shards(table: dict[str, Any], most: int) -> None:
    shards = min(int(table.get("shards", 1)), most)
    table["shards"] = shards
    for field in ("min_parallelism", "max_failed_shards"):
        if table.get(field) is not None:
            table[field] = min(int(table[field]), shards)


def derive_pilot(run: RunConfig) -> RunConfig:
    """The pilot of `run` (module docstring)."""
    from dflash_shared.errors import ConfigError

    if run.pilot_of is not None:
        raise ConfigError(f"run {run.run_id} is already the pilot of {run.pilot_of}; derive from the full run file")
    p = run.pilot
    if p.restart_at_step >= p.train_steps:
        raise ConfigError(f"pilot.restart_at_step {p.restart_at_step} must come before pilot.train_steps "
                          f"{p.train_steps}, so the resumed run has steps left to train")
    data = run.model_dump(mode="json", by_alias=True, exclude_none=True)
    full_id = run.run_id
    data["run_id"] = pilot_run_id(full_id)
    data["pilot_of"] = full_id

    if p.prompts < HELD_OUT_SHARE * p.evaluate_prompts:
        raise ConfigError(f"pilot.prompts {p.prompts} is too few for pilot.evaluate_prompts {p.evaluate_prompts}: "
                          f"tokenize holds out twice evaluate's prompts and the rest trains, so prompts must be at "
                          f"least {HELD_OUT_SHARE * p.evaluate_prompts}")
    imp = _stage(data, "import")
    imp["config"]["sample_records"] = p.prompts
    _shrink_shards(imp, 1)
    if run.source.kind == "prompts":
        _shrink_shards(_stage(data, "generate"), p.generate_shards)
    tokenize = _stage(data, "tokenize")
    _shrink_shards(tokenize, p.tokenize_shards)
    held = int(tokenize["config"].get("heldout_min_records") or 0)
    tokenize["config"]["heldout_min_records"] = max(held, 2 * p.evaluate_prompts)

    train = _stage(data, "train")["config"]
    train.update(max_steps=p.train_steps, checkpoint_every=p.restart_at_step, restart_after_step=p.restart_at_step,
                 log_every=min(int(train.get("log_every") or p.log_every), p.log_every))

    evaluate = _stage(data, "evaluate")["config"]
    evaluate.update(num_prompts=p.evaluate_prompts, min_tau=PILOT_MIN_TAU,
                    baseline_prompts=min(int(evaluate.get("baseline_prompts", p.baseline_prompts)),
                                         p.baseline_prompts),
                    lossless_prompts=min(int(evaluate.get("lossless_prompts", p.lossless_prompts)),
                                         p.lossless_prompts),
                    learnability_documents=min(p.learnability_documents, p.evaluate_prompts))

    for name in data["stages"]:
        table = _stage(data, name)
        full = table.get("active_deadline_seconds")
        table["active_deadline_seconds"] = (p.stage_deadline_seconds if not full
                                            else min(int(full), p.stage_deadline_seconds))

    plan = data.setdefault("plan", {})
    if run.plan.prompts is not None:
        plan["source_records"] = run.plan.prompts
    plan["prompts"] = p.prompts
    # The pilot's figures are its own to measure: an earlier run's would hide what this cluster does.
    plan.pop("measured_from", None)
    return parse_run_config(data, f"the pilot of {full_id}")


def full_run_id(run: RunConfig) -> str:
    """The full run a run stands for: itself, or the run a pilot was derived from."""
    return run.pilot_of or run.run_id


def pilot_cost(full: RunConfig, pilot_plan: Any, full_plan: Any) -> dict[str, Any]:
    """The pilot's GPU-hours, wall time and cost beside the full run's, and whether they keep to [pilot]'s limits
    (`pilot_plan`, `full_plan`: `plan.RunPlan`s)."""
    def totals(plan: Any) -> tuple[float, float]:
        return sum(s.gpu_hours or 0 for s in plan.stages), sum(s.wall_seconds or 0 for s in plan.stages)

    hours, wall = totals(pilot_plan)
    full_hours, full_wall = totals(full_plan)
    share = hours / full_hours if full_hours else None
    price = full.plan.gpu_hour_price
    return {"gpu_hours": hours, "wall_seconds": wall, "full_gpu_hours": full_hours, "full_wall_seconds": full_wall,
            "gpu_hour_share": share, "cost": None if price is None else hours * price, "currency": full.plan.currency,
            "within_wall": wall <= full.pilot.max_wall_hours * 3600,
            "within_share": share is None or share <= full.pilot.max_gpu_hour_fraction}


def pilot_cost_lines(full: RunConfig, pilot_plan: Any, full_plan: Any) -> list[str]:
    from dflash_pipeline.plan.run_plan import long_duration

    c = pilot_cost(full, pilot_plan, full_plan)
    share = "" if c["gpu_hour_share"] is None else f" ({c['gpu_hour_share']:.2%} of the full run's " \
        f"{c['full_gpu_hours']:,.0f})"
    cost = "" if c["cost"] is None else f", {c['cost']:,.0f} {c['currency']}"
    lines = [f"pilot of {full.run_id}: {c['gpu_hours']:,.1f} GPU-hours{share}{cost}, {long_duration(c['wall_seconds'])}"
             f" of wall time (the full run: {long_duration(c['full_wall_seconds'])}); it keeps the run's images, "
             "target, placement, GPUs, train nodes and every shape, and shrinks only the counts ([pilot])"]
    if not c["within_wall"]:
        lines.append(f"warning: the pilot's planned wall time exceeds pilot.max_wall_hours {full.pilot.max_wall_hours}"
                     ": lower pilot.prompts or pilot.train_steps, or raise generate_shards")
    if not c["within_share"]:
        lines.append(f"warning: the pilot's GPU-hours exceed pilot.max_gpu_hour_fraction "
                     f"{full.pilot.max_gpu_hour_fraction:.0%} of the full run's")
    return lines
