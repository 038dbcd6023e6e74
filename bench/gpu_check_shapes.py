"""The `shapes` part of bench/gpu_check.py: the step while the anchor count N cycles over three ladder rungs.

Training varies N from step to step (packed documents of varied length leave each row a different number of
valid anchors, put on the ladder of `dflash_train.training.anchors`); the train-step part keeps N on one rung so its
timed steps compile nothing. Here the same drafter and target run the project's step (`dflash_step` +
backward under bf16 autocast; no optimizer step, which no shape changes) on batches built so that N lands
on each of three rungs (`chosen_rungs`), visited in turn, then again: rows of fixed length
(so the key length is S + N * B), documents whose trained tails hold 3/4 of a rung's anchors each row, more
than the rung below holds. With the drafter layers compiled for static shapes (dflash_train.drafter.attention) the
first visit of a rung compiles it (none for the rung the train step already compiled) and a later visit
compiles nothing. Reported per rung: compiles (dynamo graphs, AOT-autograd graphs) on the first and on later
visits, the first visit's seconds (compilation included) and the later visits' median step time.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any

import torch

from dflash_train.data.batch import PackedBatch, pack_row, stack_rows
from dflash_train.drafter.attention import compile_drafter_layers
from dflash_train.training.anchors import anchor_count_buckets
from dflash_train.training.step import dflash_step

# Visits of each rung: the first compiles, the later ones are timed (the part stops early at its deadline).
VISITS = 3
FALLBACK_WARNING = "unfused implementation"


def chosen_rungs(ladder: tuple[int, ...], seq: int, count: int = 3) -> list[int]:
    """The `count` largest rungs whose anchors (3/4 of the rung per row) fill at most an eighth of a row.

    For the GPU run's 4096-token rows that is the top of the 512-anchor ladder (128, 256, 512: what long
    documents reach in training); for the CPU run's 256-token rows small rungs, which keep it short.
    """
    fitting = [n for n in ladder if n * 3 // 4 <= seq // 8]
    if len(fitting) < count:
        raise ValueError(f"rows of {seq} tokens hold fewer than {count} ladder rungs of {ladder}; raise --seq")
    return fitting[-count:]


def rung_batch(rows: int, seq: int, docs: int, anchors: int, vocab: int, seed: int) -> PackedBatch:
    """Full rows of `docs` documents whose trained tails give each row `anchors` valid anchors."""
    gen = torch.Generator().manual_seed(seed)
    packed = []
    for _ in range(rows):
        tails = [anchors // docs + (i < anchors % docs) for i in range(docs)]
        lengths = [seq // docs + (i < seq % docs) for i in range(docs)]
        # A trained tail of t + 1 tokens holds t valid anchors (p and p + 1 trained, one document).
        row = [(torch.randint(0, vocab, (n,), generator=gen).tolist(), [False] * (n - t - 1) + [True] * (t + 1))
               for n, t in zip(lengths, tails, strict=True)]
        packed.append(pack_row(row, seq))
    return stack_rows(packed)


def _counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]), "aot_autograd": int(counters["aot_autograd"]["total"])}


def run_shapes(b: Any, args: argparse.Namespace, device: torch.device, vocab: int,
               deadline: float = float("inf")) -> dict[str, Any]:
    """The part (see the module docstring); `b` is gpu_check_parts.Built after the train step."""
    cfg, target, drafter = b.cfg, b.target, b.drafter
    rows = b.rows or args.rows
    ladder = anchor_count_buckets(cfg.block_size, b.runtime.max_anchors_per_row)
    rungs = chosen_rungs(ladder, args.seq)
    docs = max(1, min(args.docs_per_row, min(rungs) * 3 // 4))
    # Per-document anchors as high as the top rung: the tails, not num_anchors, decide N here.
    step_recipe = b.recipe.model_copy(update={"num_anchors": max(rungs)})
    out: dict[str, Any] = {"ladder": list(ladder), "rungs": rungs, "rows": rows, "seq": args.seq,
                           "docs_per_row": docs, "optimizer_step": False}
    untested: list[str] = []
    compiled_here = False
    if b.compile_stepped_down:
        untested.append("compiled layers: they failed in train_step and run eagerly, so compile counts say nothing")
    elif not b.layers_compiled:
        compile_drafter_layers(drafter.layers, len(ladder))  # as the trainer compiles them
        compiled_here = True
    out["layers_compiled_by"] = "this part" if compiled_here else ("train_step" if b.layers_compiled else "none")
    batches = {n: rung_batch(rows, args.seq, docs, n * 3 // 4, vocab, seed=n).to(device) for n in rungs}
    seen: list[int] = []
    hook = drafter.register_forward_pre_hook(lambda _m, a: seen.append(int(a[0].shape[1]) // cfg.block_size))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    visits: list[dict[str, Any]] = []
    drafter.train()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for visit in range(VISITS):
                for n in rungs:
                    # A first visit is always made (it is what the part checks); later ones only in budget.
                    if visit > 0 and time.perf_counter() > deadline:
                        break
                    before = _counts()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    gen = torch.Generator(device=device).manual_seed(1000 * visit + n)
                    with autocast:
                        step = dflash_step(drafter, target, batches[n], cfg, step_recipe, b.runtime, gen, noise=True)
                    step.loss.backward()
                    drafter.zero_grad(set_to_none=True)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    after = _counts()
                    visits.append({"rung": n, "visit": visit, "n": seen[-1], "s": time.perf_counter() - t0,
                                   "loss": float(step.loss.detach()),
                                   **{k: after[k] - before[k] for k in before}})
        fallbacks = sum(FALLBACK_WARNING in str(w.message) for w in caught)
    finally:
        hook.remove()
    problems: list[str] = []
    per_rung: dict[str, Any] = {}
    for n in rungs:
        mine = [v for v in visits if v["rung"] == n]
        first, later = mine[0], mine[1:]
        row: dict[str, Any] = {
            "n": first["n"], "q_len": first["n"] * cfg.block_size, "kv_len": args.seq + first["n"] * cfg.block_size,
            "first_visit_s": round(first["s"], 3),
            "first_visit_compiles": {"graphs": first["graphs"], "aot_autograd": first["aot_autograd"]},
            "later_visits": len(later),
            "later_visits_compiles": {"graphs": sum(v["graphs"] for v in later),
                                      "aot_autograd": sum(v["aot_autograd"] for v in later)},
            "step_s_median": round(statistics.median(v["s"] for v in later), 4) if later else None,
        }
        per_rung[str(n)] = row
        if any(v["n"] != n for v in mine):
            problems.append(f"rung {n}: the step used N = {sorted({v['n'] for v in mine})}")
        if row["later_visits_compiles"]["graphs"] or row["later_visits_compiles"]["aot_autograd"]:
            problems.append(f"rung {n}: a later visit compiled again (shapes not stable)")
        if not later:
            untested.append(f"rung {n}: no later visit within the budget (steady step time and reuse not seen)")
        if not all(torch.isfinite(torch.tensor([v["loss"] for v in mine]))):
            problems.append(f"rung {n}: a loss is not finite")
    if fallbacks:
        problems.append("flex attention fell back to its unfused implementation")
    layers_graphs = sum(r["first_visit_compiles"]["graphs"] for r in per_rung.values())
    out |= {"per_rung": per_rung, "visits": len(visits), "first_visit_graphs_total": layers_graphs,
            "flex_unfused_fallback_warnings": fallbacks, "problems": problems}
    if untested:
        out["untested"] = untested
    if compiled_here and layers_graphs < len(rungs):
        problems.append(f"{layers_graphs} graphs compiled over {len(rungs)} new shapes: not one per shape")
    return {"ok": not problems, **out}
