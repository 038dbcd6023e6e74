"""Offline tau, engine tau and their gap in the tiny CPU setting (`make bench-eval`).

The chain the pipeline runs after training, on local directories: a drafter trained on the tiny random
Qwen3 target's own greedy answers (cached after the first run), `dflash-train export`, `dflash-train
evaluate` on held-out prompts (offline speculative loop, untrained baseline, losslessness check), then
`dflash-generate serve-check` (vLLM on CPU with DFlash speculative decoding, and without it). Prints the
acceptance both ways, per block position, and the relative gap the serving check holds to 10%.

Then the cost of linear-attention state replays: on a hybrid target (Qwen3.5/3.6) every partially accepted
step of the offline loop takes one extra target forward to rebuild the recurrent state
(`SpeculativeResult.state_replays`). The same held-out prompts run through the offline loop on the dense
target and on the tiny Qwen3.6-architecture target (its own trained drafter, cached like the dense one),
with every target and drafter pass timed, and the two are printed side by side: replays, replays per step,
and their share of the target forwards, of the target-forward time and of the loop's wall time.
`--hybrid-prompts 0` skips that part.

Runs in the generate environment with the train package installed (.venv-generate).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class PassClock:
    """Times every target and drafter pass through module hooks, and tells state replays apart by order.

    Each step of the loop is one drafter pass, one verification pass of the target and, after a partial
    acceptance on a hybrid target, one replay pass: a target pass that follows another target pass with no
    drafter pass between them (the prompt's first target pass is its prefill). Hooks on the two modules see
    every pass whatever the loop's own helpers are called.
    """

    def __init__(self, target_model: Any, drafter: Any) -> None:
        self.seconds = {"prefill": 0.0, "verify": 0.0, "replay": 0.0, "draft": 0.0}
        self.counts = dict.fromkeys(self.seconds, 0)
        self._began = 0.0
        self._previous: str | None = None
        self._handles = [
            *self._timed(target_model, self._target_kind),
            *self._timed(drafter, lambda: "draft"),
        ]

    def _timed(self, module: Any, kind_of: Any) -> list[Any]:
        def before(*_: Any) -> None:
            self._began = time.perf_counter()

        def after(*_: Any) -> None:
            kind = kind_of()
            self.seconds[kind] += time.perf_counter() - self._began
            self.counts[kind] += 1
            self._previous = "draft" if kind == "draft" else "target"

        return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def _target_kind(self) -> str:
        if self._previous is None:
            return "prefill"
        return "replay" if self._previous == "target" else "verify"

    def new_prompt(self) -> None:
        self._previous = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class LoopProfile:
    """What the offline loop did over a prompt set, and where its time went."""

    name: str
    prompts: int = 0
    steps: int = 0
    tokens: int = 0
    accepted: int = 0
    target_forwards: int = 0  # prefill + verification passes (SpeculativeResult.target_forwards)
    state_replays: int = 0  # SpeculativeResult.state_replays
    wall_seconds: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def all_forwards(self) -> int:
        return self.target_forwards + self.state_replays

    @property
    def target_seconds(self) -> float:
        return self.seconds["prefill"] + self.seconds["verify"] + self.seconds["replay"]


def profile_loop(name: str, target_dir: Path, checkpoint: Path, texts: list[str], max_new_tokens: int,
                 block_size: int | None) -> LoopProfile:
    """Run the offline speculative loop (float32, CPU) over `texts` with every pass timed."""
    from dflash_train.evaluate.speculate import HookedTarget, speculative_generate
    from tests.evaluate import eval_fixtures as ef

    model = ef.load_target(target_dir)
    drafter = ef.load_checkpoint_drafter(checkpoint)
    target = HookedTarget(model, drafter.config.target_layer_ids)
    clock = PassClock(model, drafter)
    profile = LoopProfile(name)
    try:
        for prompt in ef.chat_prompts(target_dir, texts):
            clock.new_prompt()
            began = time.perf_counter()
            result = speculative_generate(drafter, target, prompt, max_new_tokens, ef.stop_ids(target_dir),
                                          block_size=block_size)
            profile.wall_seconds += time.perf_counter() - began
            profile.prompts += 1
            profile.steps += len(result.accepted)
            profile.accepted += sum(result.accepted)
            profile.tokens += len(result.tokens)
            profile.target_forwards += result.target_forwards
            profile.state_replays += result.state_replays
    finally:
        clock.close()
        target.close()
    profile.seconds, profile.counts = dict(clock.seconds), dict(clock.counts)
    if profile.counts["replay"] != profile.state_replays:
        print(f"  note: {name}: {profile.counts['replay']} timed replay passes, but the loop reports"
              f" {profile.state_replays} state replays (the loop's order of passes changed?)")
    return profile


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "n/a"


def _ratio(part: float, whole: float, digits: int = 3) -> str:
    return f"{part / whole:.{digits}f}" if whole else "n/a"


def _mean_pass(p: LoopProfile, kind: str) -> float:
    """Mean seconds of one pass of `kind` (0 when there was none)."""
    return p.seconds[kind] / p.counts[kind] if p.counts[kind] else 0.0


# The comparison's rows: label, then the cell of one profile.
REPLAY_ROWS: list[tuple[str, Any]] = [
    ("steps (verification passes)", lambda p: f"{p.steps}"),
    ("offline tau (accepted + 1 per step)", lambda p: _ratio(p.accepted + p.steps, p.steps)),
    ("target forwards (prefill + verify)", lambda p: f"{p.target_forwards}"),
    ("state replays", lambda p: f"{p.state_replays}"),
    ("replays per step", lambda p: _ratio(p.state_replays, p.steps)),
    ("replays / all target forwards", lambda p: _share(p.state_replays, p.all_forwards)),
    ("tokens per target forward, w/o replays", lambda p: _ratio(p.tokens, p.target_forwards, 2)),
    ("tokens per target forward, all", lambda p: _ratio(p.tokens, p.all_forwards, 2)),
    ("target-forward time, prefill + verify", lambda p: f"{p.seconds['prefill'] + p.seconds['verify']:.2f} s"),
    ("target-forward time, replays", lambda p: f"{p.seconds['replay']:.2f} s"),
    ("drafter time", lambda p: f"{p.seconds['draft']:.2f} s"),
    ("loop wall time", lambda p: f"{p.wall_seconds:.2f} s"),
    ("replays / target-forward time", lambda p: _share(p.seconds["replay"], p.target_seconds)),
    ("replays / loop wall time", lambda p: _share(p.seconds["replay"], p.wall_seconds)),
    ("mean replay pass / mean verify pass", lambda p: _ratio(_mean_pass(p, "replay"), _mean_pass(p, "verify"), 2)),
]


def print_replay_costs(profiles: list[LoopProfile], max_new_tokens: int) -> None:
    """The replay figures of each profile side by side (the dense target is the no-replay reference)."""
    print(f"\noffline loop, linear-attention state replays ({profiles[0].prompts} held-out prompts x"
          f" {max_new_tokens} tokens, float32, 1 thread):")
    print(f"  {'':<40}" + "".join(f"{p.name:>16}" for p in profiles))
    for label, cell in REPLAY_ROWS:
        print(f"  {label:<40}" + "".join(f"{cell(p):>16}" for p in profiles))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--block-size", type=int, default=None, help="block size (default: the drafter's, 8)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both sides' dtype")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the outputs here (default: temp dir)")
    parser.add_argument("--hybrid-prompts", type=int, default=None,
                        help="held-out prompts of the replay comparison (default: --prompts; 0 skips it)")
    args = parser.parse_args()

    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("HF_HUB_OFFLINE", "1")):
        os.environ.setdefault(key, value)
    import torch

    from dflash_generate.serve_check.config import REPORT_NAME, ServeCheckConfig
    from dflash_generate.serve_check.report import ServeCheckReport
    from dflash_generate.serve_check.stage import run as serve_check
    from dflash_shared.errors import BadInputError
    from dflash_shared.evaluation_report import REPORT_NAME as OFFLINE_REPORT
    from dflash_shared.evaluation_report import OfflineReport
    from dflash_shared.storage import ObjectStore, join
    from dflash_train.evaluate.config import EvaluateConfig
    from dflash_train.evaluate.stage import run as evaluate
    from dflash_train.export.config import ExportConfig
    from dflash_train.export.stage import run_export
    from tests.evaluate import eval_fixtures as ef
    from tests.support.tiny_target import build_tiny_qwen3, build_tiny_qwen3_6

    torch.set_num_threads(1)  # two shared cores: thread spinning costs more than the second thread gains
    timings: dict[str, float] = {}
    began = time.monotonic()
    target = Path(build_tiny_qwen3())
    train_prompts = ef.chat_prompts(target, ef.train_texts())
    checkpoint = ef.train_drafter(target, list(zip(train_prompts, ef.target_answers(target, train_prompts),
                                                   strict=True)))
    timings["data + training (cached after the first run)"] = time.monotonic() - began

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-eval-"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    store = ObjectStore()
    root = str(work / f"run-{int(time.time())}")
    drafter = ef.write_trained(store, join(root, "drafter"), checkpoint, target)
    prompts = ef.write_prompts(store, join(root, "heldout"), ef.heldout_texts(args.prompts))
    export, offline, served = join(root, "export"), join(root, "evaluation-offline"), join(root, "evaluation")

    began = time.monotonic()
    run_export(ExportConfig(drafter=drafter, output=export, target=str(target), dtype=args.dtype), store)
    timings["export"] = time.monotonic() - began
    began = time.monotonic()
    evaluate(EvaluateConfig(drafter=export, prompts=prompts, target=str(target), output=offline,
                            num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                            baseline_prompts=min(4, args.prompts), lossless_prompts=2, device="cpu",
                            dtype=args.dtype, min_tau=0.0, threads=1), store)
    timings["offline evaluation"] = time.monotonic() - began
    began = time.monotonic()
    failure = None
    try:
        serve_check(ServeCheckConfig(evaluation=offline, target=str(target), output=served,
                                     gpu_memory_utilization=0.3, enforce_eager=True), store)
    except BadInputError as err:  # the numbers are in the written report: print them, then fail
        failure = err
    timings["serving check (2 engines)"] = time.monotonic() - began

    hybrid_prompts = args.prompts if args.hybrid_prompts is None else args.hybrid_prompts
    profiles: list[LoopProfile] = []
    if hybrid_prompts > 0:
        began = time.monotonic()
        hybrid = Path(build_tiny_qwen3_6())
        hybrid_checkpoint = ef.trained_checkpoint(hybrid)
        timings["hybrid target data + training (cached)"] = time.monotonic() - began
        began = time.monotonic()
        texts = ef.heldout_texts(hybrid_prompts)
        profiles = [profile_loop(name, where, ckpt, texts, args.max_new_tokens, args.block_size)
                    for name, where, ckpt in (("dense qwen3", target, checkpoint),
                                              ("hybrid qwen3.6", hybrid, hybrid_checkpoint))]
        timings["replay comparison (2 offline loops)"] = time.monotonic() - began

    report = OfflineReport.model_validate_json(store.read_bytes(join(offline, OFFLINE_REPORT)))
    check = ServeCheckReport.model_validate_json(store.read_bytes(join(served, REPORT_NAME)))
    untrained = report.untrained
    print(f"\ntiny CPU setting: {report.trained.prompts} held-out prompts x {report.max_new_tokens} tokens, "
          f"block {report.block_size}, {report.dtype}")
    print(f"  untrained drafter tau  {untrained.tau:.3f}" if untrained else "  untrained drafter: not run")
    print(f"  training-implied tau   {report.training_expected_tau or float('nan'):.3f}")
    print(f"  offline tau            {report.trained.tau:.3f}  ({report.trained.steps} steps, "
          f"{report.trained.tokens_per_target_forward:.2f} tokens per target forward)")
    print(f"  engine tau             {check.engine.tau:.3f}  ({check.engine.drafts} drafts)")
    print(f"  relative gap           {100 * check.relative_gap:.2f} %  (serving check fails above 10 %)")
    if check.steps is not None:
        print(f"  steps, engine vs loop  {check.steps.summary()}")
    print("  per position offline   " + " ".join(f"{a:.2f}" for a in report.trained.acceptance_per_position))
    print("  per position engine    " + " ".join(f"{a:.2f}" for a in check.engine.acceptance_per_position))
    print(f"  engine output, speculative == plain: {check.outputs_identical}/{check.prompts}; engine == offline "
          f"loop: {check.engine_equals_offline}/{check.prompts}; offline loop == target greedy: "
          f"{report.lossless_checked - len(report.lossless_mismatches)}/{report.lossless_checked}")
    for name, seconds in timings.items():
        print(f"  {name:<46} {seconds:6.1f} s")
    print(f"  engine start-up: {check.start_seconds}")
    print(f"  outputs under {root}")
    if profiles:
        print_replay_costs(profiles, args.max_new_tokens)
    if failure is not None:
        sys.exit(f"serving check failed: {failure}")


if __name__ == "__main__":
    main()
