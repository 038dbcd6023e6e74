"""Drafter attention shapes and compilations over a run of varied packed documents (`make bench-train`).

The drafter's flex attention is compiled for static shapes, so the number of distinct (query, key)
lengths of a run is the number of compilations it pays, and past dynamo's recompile limit flex falls back
to an unfused kernel. Two parts, one JSON line each:

  shapes:  the production shape (block 16, rows of 4096 tokens, 2 rows per micro-batch, 512 anchors per
           document, the 512-anchor row cap), and a sparser one (rows of 2048, 32 anchors per document)
           whose counts spread over the ladder, each over --steps micro-batches of documents packed by the
           trainer's best-fit packer (log-uniform lengths 64..row, a random prompt share each): distinct
           drafter query/key lengths with the anchor ladder, and without it (the old rule: the exact
           widest-row count rounded to 8, no row cap), counted from `sample_anchors` alone.
  compile: the step's drafter path (anchors as `draft_blocks` draws them, block inputs, the flex masks,
           the 2-layer debug drafter with one sliding and one full-attention layer, block 8, flex attention
           compiled on CPU, forward only: flex has no CPU backward) over --steps micro-batches of
           512-token rows; random target features stand in for the target's (they do not change a
           shape): distinct shapes, dynamo graphs compiled (`torch._dynamo` counters), unfused-fallback
           warnings (must be 0), compile and steady-state step times.

  python bench/bench_train_shapes.py [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_step import MASK_TOKEN  # noqa: E402  (also puts dflash_train on the path)

from dflash_train.data.batch import PackedBatch, pack_row, stack_rows  # noqa: E402
from dflash_train.data.plan import best_fit_rows  # noqa: E402
from dflash_train.drafter.attention import build_drafter_mask, compiled_flex_on_cpu  # noqa: E402
from dflash_train.drafter.config import DrafterConfig  # noqa: E402
from dflash_train.drafter.model import DFlashDrafter  # noqa: E402
from dflash_train.training.anchors import anchor_count_buckets, sample_anchors  # noqa: E402
from dflash_train.training.step import block_inputs  # noqa: E402

UNFUSED_FALLBACK = "flex_attention called without torch.compile"


def packed_batches(steps: int, rows: int, seq: int, seed: int) -> list[PackedBatch]:
    """`steps` micro-batches of best-fit packed rows; each document has a random unmasked prompt share."""
    rng = np.random.default_rng(seed)
    batches: list[PackedBatch] = []
    while len(batches) < steps:
        lengths = np.exp(rng.uniform(np.log(64), np.log(seq), 64 * rows)).astype(np.int64)
        prompt_share = rng.uniform(0.05, 0.95, len(lengths))
        docs = [([5] * int(n), [False] * int(n * s) + [True] * (int(n) - int(n * s)))
                for n, s in zip(lengths, prompt_share, strict=True)]
        packed = [pack_row([docs[i] for i in row], seq) for row in best_fit_rows(lengths, seq)]
        order = rng.permutation(len(packed))
        for start in range(0, len(order) - rows + 1, rows):
            batches.append(stack_rows([packed[i] for i in order[start:start + rows]]))
    return batches[:steps]


def shape_counts(steps: int, seed: int, seq: int, per_doc: int) -> dict[str, Any]:
    block, rows, cap = 16, 2, 512
    gen = torch.Generator().manual_seed(seed)
    laddered: set[int] = set()
    old_rule: set[int] = set()
    kept_blocks = padded_blocks = old_padded = old_kept = 0
    for batch in packed_batches(steps, rows, seq, seed):
        anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, per_doc, block,
                                          torch.Generator().manual_seed(int(torch.randint(2**31, (1,), generator=gen))),
                                          max_anchors_per_row=cap)
        laddered.add(anchor_pos.shape[1])
        kept_blocks += int(keep.sum())
        padded_blocks += int((~keep).sum())
        old, old_keep = sample_anchors(batch.loss_mask, batch.document_ids, per_doc, block, bucket=False)
        old_rule.add(old.shape[1])
        old_padded += int((~old_keep).sum())
        old_kept += int(old_keep.sum())
    return {
        "part": "shapes", "steps": steps, "block_size": block, "seq": seq, "rows": rows,
        "num_anchors": per_doc, "max_anchors_per_row": cap,
        "ladder": list(anchor_count_buckets(block, cap)),
        "distinct_qk_lengths": len(laddered),
        "anchor_counts": sorted(laddered),
        "padding_block_share": round(padded_blocks / max(1, kept_blocks + padded_blocks), 3),
        "old_rule_distinct_qk_lengths": len(old_rule),
        "old_rule_max_anchors": max(old_rule),
        # Padding of the old rule comes from rows of one micro-batch differing; the ladder adds its rounding.
        "old_rule_padding_block_share": round(old_padded / max(1, old_padded + old_kept), 3),
    }


def compile_counts(steps: int, seed: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    seq, rows = 512, 2
    cfg = DrafterConfig.debug(mask_token_id=MASK_TOKEN, layer_types=["sliding_attention", "full_attention"],
                              sliding_window=256)
    per_doc, cap = 16, 512  # the CPU benches' anchors per document; the stage's default cap per row
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    embedding = torch.nn.Embedding(MASK_TOKEN + 1, cfg.hidden_size)
    torch._dynamo.reset()
    counters.clear()
    shapes: set[tuple[int, int]] = set()
    old_rule: set[int] = set()
    compile_s, steady = 0.0, []
    wall0, cpu0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), compiled_flex_on_cpu():
        warnings.simplefilter("always")
        for i, batch in enumerate(packed_batches(steps, rows, seq, seed)):
            graphs_before = counters["stats"]["unique_graphs"]
            started = time.perf_counter()
            gen = torch.Generator().manual_seed(seed + i)
            anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, per_doc, cfg.block_size,
                                              gen, max_anchors_per_row=cap)
            ids, positions = block_inputs(batch.input_ids, batch.position_ids, anchor_pos, cfg.block_size,
                                          cfg.mask_token_id)
            mask = build_drafter_mask(anchor_pos, keep, batch.document_ids, cfg.block_size, cfg.layer_types,
                                      cfg.sliding_window, "flex")
            features = torch.randn(rows, seq, cfg.feature_size, generator=gen)
            drafter(embedding(ids), positions, features, batch.position_ids, mask)
            elapsed = time.perf_counter() - started
            q_len = anchor_pos.shape[1] * cfg.block_size
            shapes.add((q_len, seq + q_len))
            old_rule.add(sample_anchors(batch.loss_mask, batch.document_ids, per_doc, cfg.block_size,
                                        bucket=False)[0].shape[1])
            if counters["stats"]["unique_graphs"] > graphs_before:
                compile_s += elapsed
            else:
                steady.append(elapsed)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    fallbacks = sum(1 for w in caught if UNFUSED_FALLBACK in str(w.message))
    return {
        "part": "compile", "steps": steps, "block_size": cfg.block_size, "seq": seq, "rows": rows,
        "num_anchors": per_doc, "max_anchors_per_row": cap,
        "layer_types": cfg.layer_types, "ladder": list(anchor_count_buckets(cfg.block_size, cap)),
        "distinct_qk_lengths": len(shapes), "qk_lengths": sorted(shapes),
        "old_rule_distinct_qk_lengths": len(old_rule),
        "compiled_graphs": int(counters["stats"]["unique_graphs"]), "unfused_fallbacks": fallbacks,
        "compile_s": round(compile_s, 1),
        "steady_step_s": round(float(np.median(steady)), 4) if steady else None,
        # This process's CPU time beside the wall time: on a shared machine the wall time says little.
        "wall_s": round(wall, 1), "process_cpu_s": round(cpu, 1),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="micro-batches per part (at least 50 for the figures)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-compile", action="store_true", help="only the shape count (no torch.compile)")
    args = p.parse_args(argv)
    for seq, per_doc in ((4096, 512), (2048, 32)):
        print(json.dumps(shape_counts(args.steps, args.seed, seq, per_doc)), flush=True)
    if args.skip_compile:
        return 0
    result = compile_counts(args.steps, args.seed)
    print(json.dumps(result), flush=True)
    # A fallback or more graphs than shapes means the bound does not hold: fail the benchmark run.
    return 1 if result["unfused_fallbacks"] or result["compiled_graphs"] > len(result["ladder"]) else 0


if __name__ == "__main__":
    sys.exit(main())
