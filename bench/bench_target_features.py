"""Target-feature throughput per packing path: the frozen target's share of a training step.

Packs random documents into rows and times `FrozenTarget.features` (one batch, no gradients) on the tiny
test targets of `tests.support.tiny_target`: the dense Qwen3 one (mask, per_document) and the Qwen3.6
hybrid (per_document, and varlen where the fast Gated DeltaNet kernels are active). Prints one JSON line
per path and a side-by-side table. On the PyTorch reference kernels the varlen forward is also timed as
"varlen_reference_leaky": the cost of one forward per batch, NOT a usable path (documents leak into each
other there; FrozenTarget refuses it).
  python bench/bench_target_features.py [--device cuda] [--rows 4 --seq 512 --docs-per-row 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import dflash_train  # noqa: F401
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(ROOT / "jobs" / "train" / "src"))
sys.path.insert(0, str(ROOT))

from dflash_train.data.batch import pack_row, stack_rows  # noqa: E402
from dflash_train.target_model.frozen import FrozenTarget  # noqa: E402
from tests.support.tiny_target import build_tiny_target  # noqa: E402

LAYER_IDS = {"qwen3": [1, 2], "qwen3_6": [1, 3, 5]}


def batch_of(rows: int, seq: int, docs_per_row: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        cuts = sorted(torch.randperm(seq - 2, generator=g)[: docs_per_row - 1].add(1).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq], strict=True)]
        docs = [(torch.randint(0, 100_000, (n,), generator=g).tolist(), [True] * n) for n in lengths]
        out.append(pack_row(docs, seq))
    return stack_rows(out)


def time_features(target: FrozenTarget, batch, iters: int) -> float:
    args = (batch.input_ids.to(target.device), batch.position_ids.to(target.device),
            batch.document_ids.to(target.device))
    target.features(*args)  # warm-up
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        target.features(*args)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--docs-per-row", type=int, default=4)
    p.add_argument("--iters", type=int, default=2)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    batch = batch_of(args.rows, args.seq, args.docs_per_row)
    tokens = int((batch.document_ids >= 0).sum())
    results = []
    for arch in ("qwen3", "qwen3_6"):
        target = FrozenTarget.from_pretrained(build_tiny_target(arch), LAYER_IDS[arch], device=args.device)
        kernels = target.kernels.describe() if target.kernels else "no linear-attention layers"
        paths = ["mask", "per_document"] if arch == "qwen3" else ["per_document", "varlen"]
        for path in paths:
            name = path
            try:
                target.packing = target._resolve_packing(path)  # noqa: SLF001 - the same checks as at load
            except ValueError:
                target.packing = "varlen"  # time it anyway, labelled as the leaky one-forward cost
                name = "varlen_reference_leaky"
            seconds = time_features(target, batch, args.iters)
            row = {"arch": arch, "packing": name, "tokens": tokens, "seconds": round(seconds, 4),
                   "features_tokens_per_s": round(tokens / seconds, 1), "device": args.device, "kernels": kernels}
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nfeatures tokens/s, {args.rows} rows x {args.seq} tokens, {args.docs_per_row} documents per row,"
          f" {args.device}:")
    for row in results:
        print(f"  {row['arch']:<8} {row['packing']:<24} {row['features_tokens_per_s']:>10,.0f}")


if __name__ == "__main__":
    main()
