"""Drafter recipe trials on the long-answer target: one change to the train stage's settings at a time, offline tau.

`bench_quality.py --speaking code --work-dir DIR` leaves the target's regenerated answers in its store
(DIR/code/store/bench-quality/completions). Each trial re-imports them (`source.kind = "completions"`: the token
ids are kept, no generation runs) into a run of its own, whose run file is the bench's with one change to
`[stages.train] config`. The trial's tokenize, train and export stages then run through `dflash-pipeline local`,
as they do in the bench. The trial's export is measured with the evaluate stage's offline speculative loop
(`bench_quality.offline_tau`, equal to the engine's tau in every bench so far) on the bench's 48 held-out prompts,
and on 48 of the target's own training questions (answers the drafter trained on too), which tells a drafter
that did not learn apart from one that learned what the held-out prompts do not ask.

    .venv-generate/bin/python bench/bench_drafter_trials.py --work-dir /work/bq [--trials steps1800 deeper]

A trial whose export exists is measured again without training (delete DIR/trials/<name> to train it anew).
Runs in the generate environment with the train package installed (.venv-generate), like bench_quality.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

# Each trial: what it changes of the bench's [stages.train] config (600 steps, 16 anchors, the debug drafter).
TRIALS: dict[str, dict[str, Any]] = {
    "bench": {},
    "layers13": {"drafter_overrides": {"num_anchors": 16, "target_layer_ids": [1, 3]}},
    "deeper": {"drafter_overrides": {"num_anchors": 16, "num_layers": 4, "intermediate_size": 512}},
    "steps1800": {"max_steps": 1800, "epochs": 8},
}
STAGES = ("import", "tokenize", "train", "export")
PROMPTS = 48
MAX_NEW_TOKENS = 256


def trial_run(bench_run: dict[str, Any], bench_dir: Path, name: str) -> dict[str, Any]:
    """The trial's run file: the bench's, reading the bench's completions, with the trial's one change."""
    run = copy.deepcopy(bench_run)
    run.update(run_id=f"trial-{name}", root=str(bench_dir.parent / "trials" / name / "store"),
               source={"kind": "completions", "uri": str(bench_dir / "store" / "bench-quality" / "completions")})
    run["stages"]["train"]["config"].update(TRIALS[name])
    return run


def trial_export(bench_dir: Path, name: str) -> tuple[Path, str]:
    """The trial's export (trained now unless it exists) and its last training line."""
    run = trial_run(json.loads((bench_dir / "run.json").read_text()), bench_dir, name)
    work = Path(run["root"]).parent
    export = Path(run["root"]) / run["run_id"] / "export"
    if not (export / "manifest.json").exists():
        work.mkdir(parents=True, exist_ok=True)
        (work / "run.json").write_text(json.dumps(run, indent=1) + "\n")
        began = time.monotonic()
        subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "dflash_pipeline", "local", "--config",
                        str(work / "run.json"), "--log-dir", str(work / "logs"),
                        *[arg for stage in STAGES for arg in ("--stage", stage)]],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        print(f"  {name}: stages in {time.monotonic() - began:.0f} s", flush=True)
    lines = [line for line in (work / "logs" / "train-0.log").read_text().splitlines() if "metrics: step" in line]
    return export, lines[-1].split("metrics: ", 1)[1] if lines else "no training line"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, required=True, help="bench_quality.py's --work-dir (code bench run)")
    parser.add_argument("--trials", nargs="+", choices=list(TRIALS), default=list(TRIALS))
    parser.add_argument("--trained-questions", action="store_true",
                        help=f"also measure on {PROMPTS} of the target's training questions (3 minutes a trial)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the offline loop")
    args = parser.parse_args()
    import torch
    from bench_quality import chat_ids, offline_tau, speaking_prompts

    from tests.evaluate import eval_fixtures as ef
    from tests.support.speaking_target import TARGETS, build_speaking_target

    torch.set_num_threads(args.threads)
    bench_dir = args.work_dir / "code"
    if not (bench_dir / "store" / "bench-quality" / "completions" / "manifest.json").exists():
        sys.exit(f"no completions under {bench_dir}: run bench_quality.py --speaking code --work-dir {args.work_dir}")
    spec = TARGETS["code"]
    target = build_speaking_target(spec)
    heldout, _ = speaking_prompts(spec.corpus, PROMPTS, 4200)
    trained_on = [pair.question for pair in spec.corpus.split_pairs("train")][:PROMPTS]
    questions = {"held-out": heldout, **({"trained": trained_on} if args.trained_questions else {})}
    prompt_sets = {key: chat_ids(target, [[{"role": "user", "content": q}] for q in chosen])
                   for key, chosen in questions.items()}
    stops = list(ef.stop_ids(target))
    rows = []
    for name in args.trials:
        export, last = trial_export(bench_dir, name)
        taus = {key: offline_tau(target, export, prompts, MAX_NEW_TOKENS, stops, "cpu", "float32")
                for key, prompts in prompt_sets.items()}
        rows.append((name, taus))
        figures = ", ".join(f"{key} {tau:.3f}" for key, tau in taus.items())
        print(f"  {name}: offline tau {figures}; last step: {last[:100]}", flush=True)
    print(f"\n| trial | change of [stages.train] config | offline tau ({PROMPTS} prompts each): "
          f"{', '.join(questions)} |")
    print("|---|---|---|")
    for name, taus in rows:
        print(f"| {name} | {json.dumps(TRIALS[name]) if TRIALS[name] else '(the bench: none)'} | "
              f"{' / '.join(f'{tau:.3f}' for tau in taus.values())} |")


if __name__ == "__main__":
    main()
