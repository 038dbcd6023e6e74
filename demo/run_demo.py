"""`make demo`: the whole pipeline on this machine, on CPU, with a tiny model and the prompts in this folder.

It builds a small target with the real Qwen vocabulary, writes a run file whose storage root is
a local directory (an s3:// root works the same against any endpoint), and runs every stage with
`python -m dflash_pipeline local`: the same wiring and settings the Kubernetes Jobs get, each stage in
its own environment. A rerun skips the stages that are complete. It ends with a summary read from the
manifests: records and tokens per stage, the loss curve, acceptance before and after training on the prompts
held out of training, and the acceptance the serving engine (vLLM with the exported drafter) counted on the same
prompts.

`--target` (or DFLASH_DEMO_TARGET) picks the target:
- `speaking` (default): a dense 4-layer Qwen3 that really speaks, trained by the project on the Python standard
  library's docstrings (`tests.support.speaking_target`, cached after its first build, ~2-3 minutes on 2 cores),
  asked about standard-library names it never trained on; the serving check also runs vLLM's n-gram speculation
  on the same prompts, so the summary compares the trained drafter with the untrained one and with n-gram;
- `qwen3`: a random dense 4-layer Qwen3 (it loops, so its acceptance says little about training);
- `qwen3_6`: a random 8-layer Qwen3.6-architecture hybrid (Gated DeltaNet beside gated full attention, in the
  vision-language checkpoint layout);
- `qwen3_moe`: a random 4-layer Qwen3 mixture of experts (Qwen3-30B-A3B's layout: 8 experts a layer, 2 routed per
  token);
- `qwen3_6_moe`: the `qwen3_6` hybrid as a mixture of experts (Qwen3.6's MoE siblings' layout: 8 routed experts and
  a gated shared one a layer);
- `qwen2`: a random dense 4-layer Qwen2 (Qwen2.5's layout, vocabulary and template: no thinking mode).
Each has its own run id and model folder, so the runs can share a store.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dflash_shared.manifests import Kind
from dflash_shared.storage import ObjectStore, join

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "demo"

# The tiny target has random weights: greedy decoding makes it loop ("wb wb wb ..."), it never opens a
# think block and never ends its turn. The quality gate rightly rejects all of that for a real model (the
# first demo run did, with exit 65), so the demo says what it expects instead of lowering the bar to 100%:
# thinking off, truncation at max_new_tokens allowed, loops allowed. What the drafter learns is then
# exactly what this target says, which is the point of the pipeline.
QUALITY = {"allow_truncated": True, "reject_repetitive": False}
# Small enough for 2 CPU cores in a few minutes, large enough for the drafter to learn something.
# Greedy and unpenalised, as the evaluation decodes: Qwen3.6's recommended presence_penalty 1.5 would steer the
# tiny target off its loops, and the drafter would learn text that greedy decoding never produces.
GENERATE = {"max_new_tokens": 96, "max_model_len": 512, "enforce_eager": True, "temperature": 0.0,
            "presence_penalty": 0.0, "repetition_penalty": 1.0, "dtype": "bfloat16", "chunk_records": 16,
            "gpu_memory_utilization": 0.3, **QUALITY}
# About a fifth of the 80 prompts are held out of training (a hash of each record's content id picks them: 15 of
# these), and the evaluation decodes those: acceptance on prompts the drafter never saw.
TOKENIZE = {"max_length": 512, "workers": 1, "heldout_min_records": 20, **QUALITY}
# The debug presets: a small drafter, CPU, fp32; enough steps over the 65 trained completions to learn their loops.
TRAIN = {"preset": "debug", "epochs": 8, "max_steps": 48, "checkpoint_every": 16}
# Every held-out prompt by the trained drafter, the first 4 also by an untrained one (whose drafts are never
# accepted: one target forward per token, the slow part of the evaluation on CPU).
EVALUATE = {"preset": "debug", "num_prompts": 16, "baseline_prompts": 4, "max_new_tokens": 48, "device": "cpu"}
# vLLM on the CPU, replaying the evaluation's prompts with the exported drafter and without it. On the hybrid
# target it runs bfloat16 (the CPU build's only dtype for Gated DeltaNet) against the float32 evaluation.
SERVE_CHECK = {"enforce_eager": True, "gpu_memory_utilization": 0.3}
# vLLM's CPU build sizes its KV cache from free memory unless told (6 GiB here for a 512-token context); 1 GiB
# holds every sequence these stages run at once, and sets the demo's peak memory.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
TARGETS = ("speaking", "qwen3", "qwen3_6", "qwen3_moe", "qwen3_6_moe", "qwen2")
TARGET_ENV = "DFLASH_DEMO_TARGET"
# Per target: run id (it names the Jobs: lowercase letters, digits, '-'), model folder, and what differs from
# the defaults above. The debug drafter preset fits the 4-layer Qwen3 target (layers 1 and 2); the 8-layer
# hybrid one gets explicit layer ids, two linear-attention layers and the full-attention layer between them,
# as its evaluate tests use.
HYBRID_TRAIN = {"num_anchors": 4, "drafter_overrides": {"num_target_layers": 8, "target_layer_ids": [1, 3, 5]}}
PER_TARGET: dict[str, dict[str, Any]] = {
    # The speaking target ends its turns after about 10 tokens of prose: the whole corpus's questions give the
    # drafter about 40K answer tokens to learn from. The n-gram baseline runs beside it in the serving check.
    # Trained in bf16 as on a GPU (a bf16 target and LM head under autocast, fp32 master weights), and 707 steps:
    # the CPU time 400 took in float32 (bench/bench_drafter_trials.py, `dpace_wsd_bf16@time`, docs/quality.md).
    "speaking": {"run_id": "demo-speaking", "model": "model-speaking", "stages": {
        "train": {"epochs": 4, "max_steps": 707, "checkpoint_every": 100, "lr": 3e-3, "precision": "bf16",
                  "target_dtype": "bf16"},
        "evaluate": {"num_prompts": 48, "baseline_prompts": 16},
        "serve-check": {"ngram_baseline": True},
    }},
    # The random targets' source is this folder's 80 prompts: their pilots sample all of them.
    "qwen3": {"run_id": "demo", "model": "model", "stages": {}, "pilot": {"prompts": 80}},
    "qwen3_6": {"run_id": "demo-qwen36", "model": "model-qwen3_6", "stages": {"train": HYBRID_TRAIN},
                "pilot": {"prompts": 80}},
    "qwen3_moe": {"run_id": "demo-qwen3-moe", "model": "model-qwen3_moe", "stages": {}, "pilot": {"prompts": 80}},
    "qwen3_6_moe": {"run_id": "demo-qwen36-moe", "model": "model-qwen3_6_moe", "stages": {"train": HYBRID_TRAIN},
                    "pilot": {"prompts": 80}},
    # Left unset, as a Qwen2.5 user would: the stages settle it from the family, which has no thinking mode.
    "qwen2": {"run_id": "demo-qwen2", "model": "model-qwen2", "stages": {}, "pilot": {"prompts": 80},
              "enable_thinking": None},
}
# Every stage runs on this machine's CPU: no GPU requests, no GPU tolerations.
ON_CPU = {"gpus": 0, "tolerations": []}


def run_file(model: Path, root: str, overrides: dict[str, Any], target: str = "speaking") -> dict[str, Any]:
    defaults = {"generate": GENERATE, "tokenize": TOKENIZE, "train": TRAIN, "export": {}, "evaluate": EVALUATE,
                "serve-check": SERVE_CHECK}
    own = PER_TARGET[target]["stages"]
    stages: dict[str, Any] = {
        name: {**ON_CPU, "config": {**config, **own.get(name, {}), **overrides.get(name, {})}}
        for name, config in defaults.items()
    }
    for name in ("generate", "serve-check"):
        stages[name]["env"] = ENGINE_ENV
    return {
        "run_id": PER_TARGET[target]["run_id"],
        "root": root,
        "target": {"model_id": f"tiny-{target}-demo", "uri": str(model),
                   "enable_thinking": PER_TARGET[target].get("enable_thinking", False)},
        "source": {"kind": "prompts", "uri": f"{str(root).rstrip('/')}/{source_folder(target)}"},
        "stages": stages,
        # `--overrides` may also hold a [pilot] table: the counts of the run's pilot.
        "pilot": {**PER_TARGET[target].get("pilot", {}), **overrides.get("pilot", {})},
    }


def source_folder(target: str) -> str:
    """The prompts' folder under the root: the speaking target asks its own questions."""
    return "sources-speaking" if target == "speaking" else "sources"


def summary_input(run_path: Path) -> str:
    """The run's prefixes for demo/summary.py (JSON), which runs where the orchestration is not installed."""
    # Imported here: bench/bench_quality.py reuses run_file from an environment without the orchestration.
    from dflash_pipeline.run.config import load_run_config
    from dflash_pipeline.run.layout import layout

    run = load_run_config(run_path)
    lay = layout(run.root, run.run_id)
    # The serving check writes a second evaluation: the offline figures with the engine's tau beside them.
    outputs = [(kind.value, lay.prefix(kind), kind.value) for kind in
               (Kind.prompts, Kind.completions, Kind.tokenized, Kind.drafter, Kind.evaluation)]
    outputs.append(("serving", lay.serving, Kind.evaluation.value))
    return json.dumps({"run_id": run.run_id, "run_prefix": lay.run_prefix, "model_id": run.target.model_id,
                       "outputs": outputs})


def build_model(out: Path, target: str = "speaking") -> Path:
    model = out / PER_TARGET[target]["model"]
    if (model / "config.json").exists():
        return model
    python = str(REPO / ".venv-generate" / "bin" / "python")
    if target == "speaking":
        command = [python, "-m", "tests.support.speaking_target", str(model)]
    else:
        command = [python, "-m", "tests.support.tiny_target", str(model), "--arch", target]
    subprocess.run(command, cwd=REPO, check=True)
    return model


def speaking_prompts(path: Path) -> Path:
    """The speaking target's demo prompts: every question of its corpus (4,171 standard-library names on Python
    3.11), written from this interpreter's standard library, the text the target was trained from. The target
    regenerates its own answers to them, as the pipeline does for a real model's prompts; the tokenize stage
    holds a hash-chosen part out of training, which the evaluation decodes."""
    subprocess.run([sys.executable, "-m", "tests.support.stdlib_corpus", "--write-prompts", str(path)], cwd=REPO,
                   check=True)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "demo-output", help="Where the run and its model go.")
    parser.add_argument("--root", default=None, help="Storage root (default: <out>/store; s3:// works too).")
    parser.add_argument("--overrides", type=Path, default=None,
                        help="JSON file of per-stage config overrides (and a \"pilot\" table of the pilot's counts).")
    parser.add_argument("--target", choices=TARGETS, default=os.environ.get(TARGET_ENV, "speaking"),
                        help=f"Target (default: ${TARGET_ENV}, else speaking).")
    parser.add_argument("--verbose", action="store_true", help="Print every line of every stage (engines' too).")
    parser.add_argument("--pilot", action="store_true",
                        help="Run the run file's pilot (its counts reduced, its shapes kept), write its report, and "
                        "re-plan the full run from it (`make demo-pilot`).")
    args = parser.parse_args()
    if args.target not in TARGETS:  # argparse checks choices on the command line, not on a default from the env
        parser.error(f"{TARGET_ENV}={args.target!r}: expected one of {', '.join(TARGETS)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    root = args.root or str(out / "store")
    prompts = speaking_prompts(out / "speaking-prompts.jsonl") if args.target == "speaking" else DEMO / "prompts.jsonl"
    ObjectStore().upload_from(str(prompts), join(root, source_folder(args.target), "prompts.jsonl"))
    model = build_model(out, args.target)
    overrides = json.loads(args.overrides.read_text()) if args.overrides else {}
    config = run_file(model, root, overrides, args.target)
    run_path = out / ("run.json" if args.target == "speaking" else f"run-{args.target}.json")
    run_path.write_text(json.dumps(config, indent=2) + "\n")
    logs = out / "logs" / args.target
    transcript = logs / "console.log"
    console_before = _line_count(transcript)
    if args.pilot:
        return run_pilot(run_path, logs.with_name(f"{args.target}-pilot"), args.verbose)
    command = [sys.executable, "-m", "dflash_pipeline", "local", "--config", str(run_path),
               "--log-dir", str(logs), *(["--verbose"] if args.verbose else [])]
    started = time.monotonic()
    with PeakMemory() as memory:
        code = subprocess.run(command, cwd=REPO, check=False).returncode
    if code != 0:
        return code
    wall_s = time.monotonic() - started
    # The trainer's environment: the summary reads the loss curve from its TensorBoard files.
    trainer_python = str(REPO / ".venv-train" / "bin" / "python")
    summary = subprocess.run([trainer_python, str(DEMO / "summary.py"), summary_input(run_path)], cwd=REPO,
                             check=False, capture_output=True, text=True)
    sys.stdout.write(summary.stdout)
    sys.stderr.write(summary.stderr)
    if summary.returncode != 0:
        return summary.returncode
    record = {
        "target": args.target,
        # The speaking target's own build (its first run; cached after it), which the pipeline's wall time excludes.
        "target_build_s": _target_build_seconds(model),
        "command": "make demo" if args.target == "speaking" else f"DFLASH_DEMO_TARGET={args.target} make demo",
        "wall_s": round(wall_s, 1),
        "cpus": os.cpu_count(),
        "peak_rss_gib": round(memory.peak_bytes / 2**30, 2),
        "console_lines": _line_count(transcript) - console_before + len(summary.stdout.splitlines()),
        "log_lines": sum(_line_count(p) for p in logs.glob("*.log") if p != transcript),
        # The figures without the manifest paths, which name this machine's folders.
        "summary": "\n".join(line for line in summary.stdout.splitlines()
                             if line.startswith("  ") and not line.rstrip().endswith("manifest.json")),
    }
    (out / f"last-run-{args.target}.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


def run_pilot(run_path: Path, logs: Path, verbose: bool) -> int:
    """The pilot of the demo's run: `local --pilot` (which prints and writes the report), then the full run
    re-planned from that report (`plan --from-pilot`)."""
    from dflash_pipeline.pilot.derive import derive_pilot
    from dflash_pipeline.pilot.report import report_uri
    from dflash_pipeline.run.config import load_run_config

    pilot = derive_pilot(load_run_config(run_path))
    started = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "dflash_pipeline", "local", "--pilot", "--config", str(run_path),
                           "--log-dir", str(logs), *(["--verbose"] if verbose else [])], cwd=REPO,
                          check=False).returncode
    if code != 0:
        return code
    wall_s = time.monotonic() - started
    print(f"pilot {pilot.run_id}: {wall_s:.0f} s on {os.cpu_count()} CPU cores; the full run re-planned from it:")
    replan = [sys.executable, "-m", "dflash_pipeline", "plan", "--config", str(run_path), "--from-pilot",
              report_uri(pilot)]
    code = subprocess.run(replan, cwd=REPO, check=False).returncode
    (run_path.parent / f"last-pilot-{pilot.pilot_of}.json").write_text(json.dumps(
        {"command": "make demo-pilot", "wall_s": round(wall_s, 1), "cpus": os.cpu_count(),
         "report": report_uri(pilot)}, indent=2) + "\n")
    return code


def _target_build_seconds(model: Path) -> float | None:
    metrics = model / "speaking_target.json"
    return json.loads(metrics.read_text())["build_seconds"] if metrics.exists() else None


def _line_count(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as fh:
        return sum(1 for _ in fh)


class PeakMemory:
    """The largest total resident memory of this process's descendants, sampled twice a second."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(self.interval_s):
            total = 0
            for child in me.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except psutil.Error:  # exited between the listing and the reading
                    continue
            self.peak_bytes = max(self.peak_bytes, total)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


if __name__ == "__main__":
    raise SystemExit(main())
