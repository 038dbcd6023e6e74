"""The learnability gate against each defect it exists for, on both tiny target families (`make bench-learnability`).

For the dense (Qwen3) and the hybrid (Qwen3.6 layout) varied tiny targets (`build_varied_target`: answers that
take context to predict), the gate (`dflash_train.evaluate.learnability`) runs once as shipped and once with each
defect of tests/support/gate_defects.py put in: labels one slot late, block positions one ahead, target layer ids one
lower in the export, a weight dropped from the export. Printed per case: the share of drafted tokens accepted, tau,
the training steps it took, the verdict, and the seconds the gate took. The figures in docs/quality.md come from it.

Runs in the generate or train environment (torch, transformers, the train package); about 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=2, help="answers memorised")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens per answer")
    parser.add_argument("--steps", type=int, default=100, help="most training steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()

    import torch

    from dflash_shared.errors import BadInputError
    from tests.support.gate_defects import BREAKS, gate_on, weight_dropped
    from tests.support.tiny_target import build_varied_target

    torch.set_num_threads(args.threads)
    cases: dict[str, Any] = {"none": contextlib.nullcontext, **BREAKS, "weight dropped": weight_dropped}
    print(f"{args.documents} answers of {args.new_tokens} tokens, blocks of 8, at most {args.steps} steps, CPU, "
          f"float32, {args.threads} thread(s)")
    print("| target | defect | accepted | tau | steps | verdict | seconds |")
    print("|---|---|---|---|---|---|---|")
    for arch in ("qwen3", "qwen3_6"):
        target = build_varied_target(arch)
        for name, defect in cases.items():
            began = time.monotonic()
            with tempfile.TemporaryDirectory() as scratch, defect():
                try:
                    gate = gate_on(target, Path(scratch), args.documents, args.new_tokens, args.steps)
                    row = (f"{100 * gate.acceptance_rate:.1f}% | {gate.acceptance.tau:.2f} | {gate.train_steps} | "
                           f"{'passed' if gate.passed else 'FAILED'}")
                except BadInputError as exc:
                    row = f"- | - | - | refused: {str(exc)[:90]}"
            print(f"| {arch} | {name} | {row} | {time.monotonic() - began:.0f} |", flush=True)


if __name__ == "__main__":
    main()
