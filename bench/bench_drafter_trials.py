"""Drafter recipe trials on the speaking targets: one change of the train recipe at a time, side by side.

For each speaking target (`--speaking docs code`), `bench_quality.py`'s setup (the target, its regenerated answers
to the bench's training questions, run by the product's own stages; resumed from `--work-dir`) leaves the answers
in its store (DIR/<target>/store/bench-quality/completions). Each trial re-imports them (`source.kind =
"completions"`: the token ids are kept, no generation runs) into a run of its own, whose run file is the bench's
with one change to `[stages.train] config`, and runs its tokenize, train and export stages through
`dflash-pipeline local`, as the bench does. The trial's export is then measured by the evaluate stage's offline
speculative loop (`bench_quality.offline_tau`, equal to vLLM's engine tau in every bench so far, and step by step
in float32 in the serving check's test) on the bench's 48 held-out prompts: tau, tokens per target step as the bench
counts the engine's, and accepted tokens per drafted position; with `--bench-json` (the bench's `--json` file of
the same work dir) the tokens per step against the bench's best n-gram setting and its untrained drafter.

Equal steps and equal CPU time: every trial trains the bench's number of steps. A trial whose stages took more than
15% more or less CPU seconds than the first trial named (the baseline: `today` by default; more blocks per step, or
a cheaper precision) is run a second time (`<name>@time`) with its steps scaled to the baseline's cost, so that
what a change buys per step and per CPU-second are both shown. The CPU seconds (user and system, of every process
the stages ran; kept in the trial's `cpu.json`) are what a busy machine does not inflate; a trial trained before
they were recorded is compared by its training's wall-clock time (steps x the median seconds per step of its log),
which holds only under equal load.

    .venv-generate/bin/python bench/bench_drafter_trials.py --work-dir /work/bq [--speaking code] [--trials kl]
        [--bench-json bq.json]

A trial whose export exists is measured again without training (delete DIR/trials/<target>/<name> to retrain).
Runs in the generate environment with the train package installed (.venv-generate), like bench_quality.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import resource
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

# Each trial: what it changes of the bench's [stages.train] config. `today` is the recipe these trials started from
# (CE on the data token, exponential decay, cosine: the defaults before the trials chose D-PACE, then WSD), and every
# other trial changes one thing of it; `dpace` is D-PACE under cosine (the default between the two choices),
# `dpace_wsd` both changes together (today's default, pinned here so that its figures keep their meaning as defaults
# move); `*_seed1` are reruns under another seed.
BEFORE = {"position_weighting": "exp_decay", "lr_schedule": "cosine"}
DPACE = {"position_weighting": "dpace", "lr_schedule": "cosine"}
DPACE_WSD = {"position_weighting": "dpace", "lr_schedule": "wsd"}
DPACE_WSD_BF16 = {**DPACE_WSD, "precision": "bf16", "target_dtype": "bf16"}
TRIALS: dict[str, dict[str, Any]] = {
    "today": BEFORE,
    "anchors512": {**BEFORE, "num_anchors": 512},  # every valid position of a normal answer
    "target_argmax_ce": {**BEFORE, "objective": "target_argmax_ce"},
    "target_kl": {**BEFORE, "objective": "target_kl"},
    "dpace": DPACE,
    "wsd": {**BEFORE, "lr_schedule": "wsd"},
    "dpace_wsd": DPACE_WSD,
    # A second seed (drafter init, data order, anchors) of the recipe before and of the chosen defaults: how much of
    # a difference between trials one seed can move.
    "today_seed1": {**BEFORE, "seed": 1},
    "dpace_seed1": {**DPACE, "seed": 1},
    "dpace_wsd_seed1": {**DPACE_WSD, "seed": 1},
    # One change of the D-PACE recipe, for the targets measured after that choice. KL has no D-PACE variant (D-PACE
    # reads its confidence from a cross-entropy; the train config refuses the pair): `target_kl` measures it against
    # `today`.
    "dpace_anchors512": {**DPACE, "num_anchors": 512},
    # 4x the bench's 16 per document of the long answers (~145 valid positions): what 512 buys, at a CPU cost the
    # bench can run (512 trains about 5x slower per step here).
    "dpace_anchors64": {**DPACE, "num_anchors": 64},
    "dpace_argmax_ce": {**DPACE, "objective": "target_argmax_ce"},
    # A warm start from the docstring target's D-PACE trial drafter: the same drafter shape and target shape, another
    # target's answers, as a released drafter of a sibling model would be. `{work_dir}` is `--work-dir`.
    "dpace_warm_docs": {**DPACE, "init_from": "{work_dir}/trials/docs/dpace/store/trial-dpace/export"},
    # The other way round, for the docstring target: from the long-answer target's D-PACE trial drafter.
    "dpace_warm_code": {**DPACE, "init_from": "{work_dir}/trials/code/dpace/store/trial-dpace/export"},
    # The GPU's numerics on the CPU: a bf16 target and LM head under bf16 autocast, over fp32 master weights (the
    # CPU's default is fp32 throughout). Against `dpace_wsd`, the defaults in fp32.
    "dpace_wsd_bf16": DPACE_WSD_BF16,
    # One change of the bf16 recipe (the benches' since it was measured): twice the peak learning rate; a drafter
    # twice as deep with twice the MLP (the debug preset's 2 layers, 256); KL to the target under
    # warmup-stable-decay (exponential decay: D-PACE reads a cross-entropy).
    "bf16_lr2x": {**DPACE_WSD_BF16, "lr": 6e-3},
    "bf16_deeper": {**DPACE_WSD_BF16, "drafter_overrides": {"num_layers": 4, "intermediate_size": 512}},
    "bf16_kl_wsd": {**DPACE_WSD_BF16, "position_weighting": "exp_decay", "objective": "target_kl"},
    # The earlier trials' changes again, on the bf16 recipe: 4x the anchors per document, CE on the target's greedy
    # token, a warm start from the other speaking target's bf16 drafter (same shapes), a second seed.
    "bf16_anchors64": {**DPACE_WSD_BF16, "num_anchors": 64},
    "bf16_argmax_ce": {**DPACE_WSD_BF16, "objective": "target_argmax_ce"},
    "bf16_warm_other": {**DPACE_WSD_BF16, "init_from": "{work_dir}/trials/{other}/dpace_wsd_bf16/store/"
                                                       "trial-dpace-wsd-bf16/export"},
    "bf16_seed1": {**DPACE_WSD_BF16, "seed": 1},
}
# A warm start's source: the other speaking target's trial of the same name.
OTHER_TARGET = {"docs": "code", "code": "docs"}
STAGES = ("import", "tokenize", "train", "export")
PROMPTS = 48
# A trial this much slower or faster than the baseline also runs at the baseline's training time.
OTHER_COST = 1.15


def trial_run(bench_run: dict[str, Any], bench_dir: Path, name: str, change: dict[str, Any]) -> dict[str, Any]:
    """The trial's run file: the bench's, reading the bench's completions, with the trial's one change."""
    run = copy.deepcopy(bench_run)
    run.update(run_id="trial-" + name.replace("@", "-at-").replace("_", "-"),
               root=str(bench_dir.parent / "trials" / bench_dir.name / name / "store"),
               source={"kind": "completions", "uri": str(bench_dir / "store" / "bench-quality" / "completions")})
    train = run["stages"]["train"]["config"]
    for key, value in change.items():
        if isinstance(value, str):
            value = value.format(work_dir=bench_dir.parent, other=OTHER_TARGET[bench_dir.name])
        train[key] = {**train.get(key, {}), **value} if isinstance(value, dict) else value
    return run


def trial_export(bench_dir: Path, name: str, change: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The trial's export (trained now unless it exists) and what its training reported."""
    run = trial_run(json.loads((bench_dir / "run.json").read_text()), bench_dir, name, change)
    work = Path(run["root"]).parent
    export = Path(run["root"]) / run["run_id"] / "export"
    cpu_file = work / "cpu.json"
    if not (export / "manifest.json").exists():
        work.mkdir(parents=True, exist_ok=True)
        (work / "run.json").write_text(json.dumps(run, indent=1) + "\n")
        before = children_cpu_seconds()
        subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "dflash_pipeline", "local", "--config",
                        str(work / "run.json"), "--log-dir", str(work / "logs"),
                        *[arg for stage in STAGES for arg in ("--stage", stage)]],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        cpu_file.write_text(json.dumps({"cpu_seconds": children_cpu_seconds() - before}) + "\n")
    from dflash_shared.manifest_io import load_manifest
    from dflash_shared.manifests import Kind
    from dflash_shared.storage import ObjectStore

    drafter = load_manifest(ObjectStore(), str(Path(run["root"]) / run["run_id"] / "drafter"), Kind.drafter,
                            verify=False)
    metrics = dict(drafter.section.final_metrics)
    metrics["steps"] = float(run["stages"]["train"]["config"].get("max_steps") or 0)
    metrics["train_seconds"] = seconds_per_step(work / "logs" / "train-0.log") * metrics["steps"]
    # A trial trained before CPU seconds were recorded has only its wall-clock pace.
    metrics["cpu_seconds"] = json.loads(cpu_file.read_text())["cpu_seconds"] if cpu_file.exists() else float("nan")
    return export, metrics


def children_cpu_seconds() -> float:
    """User and system CPU seconds of every process this one has waited for (the stages and their workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def training_cost(metrics: dict[str, Any], baseline: dict[str, Any]) -> tuple[float, float]:
    """(the trial's, the baseline's) cost: CPU seconds of their stages where both have them, which shared cores do
    not inflate; else their training's wall-clock seconds, which compare only runs made under the same load."""
    if math.isfinite(metrics.get("cpu_seconds", math.nan)) and math.isfinite(baseline.get("cpu_seconds", math.nan)):
        return metrics["cpu_seconds"], baseline["cpu_seconds"]
    return metrics["train_seconds"], baseline["train_seconds"]


def seconds_per_step(train_log: Path, span: int = 20) -> float:
    """The training's steady pace: the median seconds per step over `span` consecutive metric lines of its log (a
    resumed run's restart gap and the start-up are not steps, and a median leaves them out; the log's whole-second
    stamps need a span of lines to time steps shorter than a second)."""
    points = []
    for line in train_log.read_text(errors="replace").splitlines():
        if "metrics: step " in line:
            stamp = datetime.fromisoformat(line.split()[0].replace("Z", "+00:00"))
            points.append((int(line.split("metrics: step ", 1)[1].split("/", 1)[0]), stamp))
    span = max(1, min(span, len(points) - 1))
    pairs = zip(points, points[span:], strict=False)
    paces = [(b[1] - a[1]).total_seconds() / (b[0] - a[0]) for a, b in pairs if b[0] > a[0]]
    return statistics.median(paces) if paces else float("nan")


def measure(target: Path, export: Path, prompts: list[list[int]], max_new_tokens: int, stops: list[int]
            ) -> tuple[float, float, list[float]]:
    """Offline tau, tokens per target step and the accepted share per drafted position (the evaluate stage's loop).

    Tokens per step as the bench counts the engine's (`dflash_generate.ngram_baseline.tokens_per_step`: every verify
    step and each prompt's prefill), from the loop's own steps: in float32 the engine takes the same steps, step by
    step (tests/evaluate/test_serve_check.py::test_engine_tau_agrees_with_offline_tau), so these are its figures too.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_generate.ngram_baseline import tokens_per_step
    from dflash_train.evaluate.speculate import HookedTarget, speculative_generate
    from dflash_train.export.files import load_export_dir

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    drafter = load_export_dir(str(export), device="cpu", dtype=torch.float32)
    hooked = HookedTarget(model, drafter.config.target_layer_ids)
    accepted: list[int] = []
    tokens = 0
    try:
        for prompt in prompts:
            result = speculative_generate(drafter, hooked, prompt, max_new_tokens, frozenset(stops))
            accepted += result.accepted
            tokens += len(result.tokens)
    finally:
        hooked.close()
    drafted = drafter.config.block_size - 1
    per_position = [sum(a > k for a in accepted) / len(accepted) for k in range(drafted)]
    return ((sum(accepted) + len(accepted)) / len(accepted), tokens_per_step(tokens, sum(accepted), len(accepted),
                                                                              len(prompts)), per_position)


def bench_baselines(bench_json: Path | None, key: str) -> dict[str, float]:
    """The quality bench's tokens per step of its best n-gram setting and of the untrained drafter on this target
    (its --json file, same prompts and tokens), which each trial's figure is divided by; {} without the file."""
    if bench_json is None:
        return {}
    from dflash_generate.ngram_baseline import tokens_per_step

    runs = json.loads(bench_json.read_text()).get(f"speaking target '{key}'", [])
    per_step = {(r["method"], r["settings"]): tokens_per_step(r["tokens"], r["accepted"], r["drafts"], r["prompts"])
                for r in runs}
    ngram = [v for (method, _), v in per_step.items() if method == "n-gram"]
    untrained = [v for (method, _), v in per_step.items() if method == "DFlash, untrained"]
    return {**({"ngram": max(ngram)} if ngram else {}), **({"untrained": untrained[0]} if untrained else {})}


def trials_setup(bench_parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The quality bench's options as the trials run its setup: its defaults, the trials' held-out prompt count."""
    return bench_parser.parse_args(["--heldout", str(PROMPTS)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, required=True, help="bench_quality.py's --work-dir")
    parser.add_argument("--speaking", nargs="+", choices=["docs", "code"], default=["docs", "code"])
    parser.add_argument("--trials", nargs="+", choices=list(TRIALS), default=list(TRIALS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the offline loop")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--bench-json", type=Path, default=None,
                        help="bench_quality.py's --json of the same work dir: tokens per step against its best n-gram "
                        "and its untrained drafter")
    args = parser.parse_args()
    import torch
    from bench_quality import SPEAKING_BENCHES, build_parser, chat_ids, speaking_measured, speaking_prompts

    from tests.evaluate import eval_fixtures as ef
    from tests.support.speaking_target import TARGETS, build_speaking_target

    torch.set_num_threads(args.threads)
    setup = trials_setup(build_parser())
    results: dict[str, list[dict[str, Any]]] = {}
    for key in args.speaking:
        bench = SPEAKING_BENCHES[key]
        bench_dir = args.work_dir / key
        completions = bench_dir / "store" / "bench-quality" / "completions" / "manifest.json"
        if completions.exists() and (bench_dir / "run.json").exists():
            # The trials need the bench's answers only, not its own drafter: no need to finish its stages.
            target_dir = build_speaking_target(TARGETS[key])  # cached
            heldout_q, _ = speaking_prompts(TARGETS[key].corpus, PROMPTS, setup.train_prompts)
            conversations = [[{"role": "user", "content": q}] for q in heldout_q]
        else:
            measured = speaking_measured(bench, setup, args.work_dir)  # runs (or resumes) the bench's own stages
            target_dir, conversations = measured.target_dir, measured.conversations
        prompts = chat_ids(target_dir, conversations)
        stops = list(ef.stop_ids(target_dir))
        rows: list[dict[str, Any]] = []
        baselines = bench_baselines(args.bench_json, key)
        queue = [(name, TRIALS[name]) for name in args.trials]
        while queue:
            name, change = queue.pop(0)
            export, metrics = trial_export(bench_dir, name, change)
            tau, per_step, per_position = measure(target_dir, export, prompts, bench.max_new_tokens, stops)
            # `tau` of the manifest is training's estimate; the offline loop's is `offline_tau`.
            row = {"trial": name, "change": change, **metrics, "offline_tau": tau, "tokens_per_step": per_step,
                   **{f"vs_{k}": per_step / v for k, v in baselines.items()}, "accepted_per_position": per_position}
            rows.append(row)
            against = "".join(f" ({per_step / v:.2f}x {k})" for k, v in baselines.items())
            print(f"  {key} {name}: offline tau {tau:.3f}, {per_step:.3f} tokens/step{against}, per position "
                  f"{' '.join(f'{a:.2f}' for a in per_position)}, train {metrics['train_seconds']:.0f} s "
                  f"(CPU {metrics['cpu_seconds']:.0f} s), loss "
                  f"{metrics.get('loss', float('nan')):.3f}, label agreement "
                  f"{metrics.get('label_agreement', float('nan')):.3f}", flush=True)
            baseline = rows[0]
            cost, baseline_cost = training_cost(metrics, baseline)
            other_cost = not 1 / OTHER_COST <= cost / baseline_cost <= OTHER_COST
            if "@" not in name and name != baseline["trial"] and other_cost:
                steps = int(json.loads((bench_dir / "run.json").read_text())["stages"]["train"]["config"]["max_steps"])
                scaled = max(1, round(steps * baseline_cost / cost))  # max_steps wins over epochs
                queue.insert(0, (f"{name}@time", {**change, "max_steps": scaled}))
        results[key] = rows
        print(f"\n{key}: | trial | change | steps | train s | CPU s | loss | label agreement | held-out tau | "
              "offline tau | tokens/step | vs n-gram | vs untrained | accepted per position |")
        for r in rows:
            print(f"| {r['trial']} | {json.dumps(r['change']) if r['change'] else '-'} | "
                  f"{int(r['steps']) or '-'} | {r['train_seconds']:.0f} | {r['cpu_seconds']:.0f} | "
                  f"{r.get('loss', float('nan')):.3f} | "
                  f"{r.get('label_agreement', float('nan')):.3f} | {r.get('heldout_tau', float('nan')):.2f} | "
                  f"{r['offline_tau']:.3f} | {r['tokens_per_step']:.3f} | "
                  f"{r.get('vs_ngram', float('nan')):.2f}x | {r.get('vs_untrained', float('nan')):.2f}x | "
                  f"{' '.join(f'{a:.2f}' for a in r['accepted_per_position'])} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
