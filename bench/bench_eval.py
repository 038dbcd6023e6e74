"""Offline tau, engine tau and their gap in the tiny CPU setting (`make bench-eval`).

The chain the pipeline runs after training, on local directories: a drafter trained on the tiny random
Qwen3 target's own greedy answers (cached after the first run), `dflash-train export`, `dflash-train
evaluate` on held-out prompts (offline speculative loop, untrained baseline, losslessness check), then
`dflash-generate serve-check` (vLLM on CPU with DFlash speculative decoding, and without it). Prints the
acceptance both ways, per block position, and the relative gap the serving check holds to 10%.

Runs in the generate environment with the train package installed (.venv-generate).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--block-size", type=int, default=None, help="block size (default: the drafter's, 8)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both sides' dtype")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the outputs here (default: temp dir)")
    args = parser.parse_args()

    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("HF_HUB_OFFLINE", "1")):
        os.environ.setdefault(key, value)
    import torch

    from dflash_generate.serve_check import REPORT_NAME, ServeCheckConfig, ServeCheckReport
    from dflash_generate.serve_check import run as serve_check
    from dflash_shared.errors import BadInputError
    from dflash_shared.storage import ObjectStore, join
    from dflash_train.evaluate import REPORT_NAME as OFFLINE_REPORT
    from dflash_train.evaluate import OfflineReport
    from dflash_train.evaluate import run as evaluate
    from dflash_train.evaluate_config import EvaluateConfig, ExportConfig
    from dflash_train.export import run_export
    from tests.evaluate import eval_fixtures as ef
    from tests.support.tiny_target import build_tiny_qwen3

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
    print("  per position offline   " + " ".join(f"{a:.2f}" for a in report.trained.acceptance_per_position))
    print("  per position engine    " + " ".join(f"{a:.2f}" for a in check.engine.acceptance_per_position))
    print(f"  engine output, speculative == plain: {check.outputs_identical}/{check.prompts}; engine == offline "
          f"loop: {check.engine_equals_offline}/{check.prompts}; offline loop == target greedy: "
          f"{report.lossless_checked - len(report.lossless_mismatches)}/{report.lossless_checked}")
    for name, seconds in timings.items():
        print(f"  {name:<46} {seconds:6.1f} s")
    print(f"  engine start-up: {check.start_seconds}")
    print(f"  outputs under {root}")
    if failure is not None:
        sys.exit(f"serving check failed: {failure}")


if __name__ == "__main__":
    main()
