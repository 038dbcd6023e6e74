"""Throughput of one DFlash training step (dflash_step forward + backward), self-contained.

Builds a random-weight Qwen3 target in process from a preset shape (no files, no downloads), packs random
documents, and times `dflash_step` + `loss.backward()` after warm-up steps. Prints one JSON line:
- tokens_per_s: packed context tokens (rows x seq) per second; trained_tokens_per_s: weighted label slots;
- peak memory: GPU max allocated, or the process's peak RSS on CPU;
- on CUDA, MFU = model FLOPs / time / peak bf16 FLOPs, counting the target forward (kept layers,
  document-causal attention), the drafter forward + backward (3x forward, fc 2x: its input needs no
  gradient; attention over the allowed (query, key) pairs of the step's mask) and the chunked LM-head loss
  (logits + the gradient of the hidden states: 4 * tokens * vocab * hidden).

Presets: debug (the CPU test shape: 4-layer hidden-128 target, 2-layer drafter, block 8), speaking (the speaking
targets' shape as `make bench-quality --speaking code` trains it: block 16, 16 anchors per document, rows of 512),
mid (a Qwen3-1.7B-shaped target, 5-layer drafter, block 16, 512 anchors), 8b (a Qwen3-8B-shaped target).
  CPU:  python bench/bench_train_step.py
  GPU:  python bench/bench_train_step.py --device cuda --preset mid          (flex attention, torch.compile)
`--label-agreement-every 0 1 10` times the same steps once per setting, side by side in one process (0: off;
1: the target's greedy token at every trained position on every step; 10: on one step in ten, the default), and
prints each one's seconds per step against the first. `--precision fp32 bf16` does the same for the train stage's
precision settings: fp32 (the CPU default: an fp32 target, no autocast) and bf16 (`precision = "bf16"`,
`target_dtype = "bf16"`: a bf16 target and LM head under bf16 autocast, as on a GPU), with their first losses.
Needs torch >= 2.11, transformers >= 5.17 and pydantic; imports dflash_train from jobs/train/src when it is
not installed. The CPU figure is also given per CPU second, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

try:
    import dflash_train  # noqa: F401
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs" / "train" / "src"))

from dflash_train.data.batch import pack_row, stack_rows
from dflash_train.drafter.attention import compile_drafter_layers
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.sections import TrainingRecipe, TrainingRuntime
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.anchors import anchor_count_buckets, sample_anchors
from dflash_train.training.step import dflash_step

QWEN3_VOCAB = 151936
MASK_TOKEN = 151669
PRESETS: dict[str, dict[str, Any]] = {
    "debug": {"target": dict(layers=4, hidden=128, heads=2, kv=1, head_dim=64, inter=256),
              "drafter": dict(num_layers=2, block_size=8), "anchors": 16, "ids": [1, 2],
              "rows": 2, "seq": 256, "docs_per_row": 2},
    "speaking": {"target": dict(layers=4, hidden=128, heads=2, kv=1, head_dim=64, inter=384),
                 "drafter": dict(num_layers=2, block_size=16), "anchors": 16, "ids": [1, 2],
                 "rows": 2, "seq": 512, "docs_per_row": 3},
    "mid": {"target": dict(layers=28, hidden=2048, heads=16, kv=8, head_dim=128, inter=6144),
            "drafter": dict(num_layers=5, block_size=16), "anchors": 512, "ids": None,
            "rows": 2, "seq": 4096, "docs_per_row": 2},
    "8b": {"target": dict(layers=36, hidden=4096, heads=32, kv=8, head_dim=128, inter=12288),
           "drafter": dict(num_layers=5, block_size=16), "anchors": 512, "ids": None,
           "rows": 1, "seq": 4096, "docs_per_row": 1},
}
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def build_target(shape: dict[str, int], layer_ids: list[int], device: torch.device, attn: str,
                 keep_output: bool = False, dtype: torch.dtype | None = None) -> FrozenTarget:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB, hidden_size=shape["hidden"], intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
        head_dim=shape["head_dim"], max_position_embeddings=40960, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return FrozenTarget(model, layer_ids, keep_output=keep_output)


def preset_drafter(preset: dict[str, Any]) -> DrafterConfig:
    """The preset's drafter, shaped from its target's sizes as the train stage shapes one from a config.json."""
    shape = preset["target"]
    probe = type("C", (), {"num_hidden_layers": shape["layers"], "hidden_size": shape["hidden"],
                           "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv"],
                           "head_dim": shape["head_dim"], "intermediate_size": shape["inter"],
                           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960})
    return DrafterConfig.from_target(probe, mask_token_id=MASK_TOKEN, target_layer_ids=preset["ids"],
                                     **preset["drafter"])


def random_batch(rows: int, seq: int, docs: int, gen: torch.Generator):
    out = []
    for _ in range(rows):
        lengths = [seq // docs] * docs
        lengths[-1] += seq - sum(lengths)
        row_docs = []
        for n in lengths:
            ids = torch.randint(0, 151643, (n,), generator=gen).tolist()
            prompt = max(1, n // 8)  # an unmasked prompt, then the trained completion
            row_docs.append((ids, [False] * prompt + [True] * (n - prompt)))
        out.append(pack_row(row_docs, seq))
    return stack_rows(out)


def allowed_pairs(anchor_pos, keep, document_ids, block: int, window: int | None) -> int:
    """Number of (query, key) pairs the drafter mask allows, counted from the anchors (no mask built)."""
    seq = document_ids.shape[1]
    idx = torch.arange(seq).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    doc_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    p = anchor_pos
    start = doc_start.gather(1, p)
    off = torch.arange(block).view(1, 1, block)
    if window is None:
        ctx = (p - start).unsqueeze(-1).expand(*p.shape, block)
        own = torch.full_like(ctx, block)
    else:
        lowest = torch.maximum(start.unsqueeze(-1), p.unsqueeze(-1) + off - (window - 1))
        ctx = (p.unsqueeze(-1) - lowest).clamp(min=0)
        own = (off + 1).expand_as(ctx)
    return int(((ctx + own) * keep.unsqueeze(-1)).sum())


def step_flops(cfg: DrafterConfig, recipe: TrainingRecipe, runtime: TrainingRuntime, target: FrozenTarget, batch,
               gen_seed: int, tokens: int) -> float:
    """Model FLOPs of one step (see the module docstring); the anchors are re-drawn with the step's seed."""
    tcfg = target.config
    rows, seq = batch.shape
    kept = max(target.layer_ids) + 1
    h, inter = tcfg.hidden_size, tcfg.intermediate_size
    nh, nkv, hd = tcfg.num_attention_heads, tcfg.num_key_value_heads, tcfg.head_dim
    per_layer = 2 * (h * nh * hd * 2 + h * nkv * hd * 2 + 3 * h * inter)
    doc_sq = sum(int((batch.document_ids[r] == d).sum()) ** 2 for r in range(rows)
                 for d in batch.document_ids[r].unique().tolist() if d >= 0)
    target_flops = kept * (per_layer * rows * seq + 2 * nh * hd * doc_sq)  # causal: half of 4*L^2

    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, recipe.num_anchors, cfg.block_size,
                                      torch.Generator().manual_seed(gen_seed),
                                      max_anchors_per_row=runtime.max_anchors_per_row)
    q_len = anchor_pos.shape[1] * cfg.block_size
    pairs = sum(allowed_pairs(anchor_pos, keep, batch.document_ids, cfg.block_size,
                              cfg.sliding_window if t == "sliding_attention" else None) for t in cfg.layer_types)
    hid, dh = cfg.hidden_size, cfg.head_dim
    q_tok = rows * q_len
    proj = cfg.num_layers * (2 * q_tok * hid * cfg.num_attention_heads * dh * 2          # q, o
                             + 2 * (q_tok + rows * seq) * hid * cfg.num_key_value_heads * dh * 2  # k, v
                             + 2 * q_tok * 3 * hid * cfg.intermediate_size)           # mlp
    attn = 4 * cfg.num_attention_heads * dh * pairs
    fc = 2 * rows * seq * cfg.feature_size * hid
    drafter_flops = 3 * (proj + attn) + 2 * fc
    lm_flops = 4 * tokens * tcfg.vocab_size * hid
    return float(target_flops + drafter_flops + lm_flops)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default="debug")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, help="rows per micro-batch (preset default otherwise)")
    p.add_argument("--seq", type=int, help="tokens per row (preset default otherwise)")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="torch.compile drafter layers")
    p.add_argument("--backend", choices=["auto", "flex", "sdpa"], default="auto", help="drafter attention")
    p.add_argument("--target-attn", default="sdpa", help="target attn_implementation (sdpa, flex_attention)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per drafter layer")
    p.add_argument("--peak-tflops", type=float, help="peak bf16 TFLOP/s for MFU (detected for H100/H200/A100)")
    p.add_argument("--label-agreement-every", type=int, nargs="+", metavar="N",
                   help="time the default recipe's steps under each label_agreement_every (0: off), side by side")
    p.add_argument("--precision", choices=["fp32", "bf16"], nargs="+",
                   help="time the default recipe's steps under each precision (target dtype, autocast), side by side")
    args = p.parse_args(argv)
    if args.precision:
        compare_precision(args)
        return
    if args.label_agreement_every:
        if min(args.label_agreement_every) < 0:
            p.error("--label-agreement-every takes 0 (off) or a number of steps")
        compare_agreement(args)
        return

    device = torch.device(args.device)
    preset = PRESETS[args.preset]
    rows, seq = args.rows or preset["rows"], args.seq or preset["seq"]
    shape = preset["target"]
    t0 = time.perf_counter()
    cfg = preset_drafter(preset)
    # CE on the data under exponential decay: the step these timings were first measured with.
    recipe = TrainingRecipe(num_anchors=preset["anchors"], position_weighting="exp_decay", label_agreement=False)
    runtime = TrainingRuntime(attention_backend=args.backend)
    target = build_target(shape, cfg.target_layer_ids, device, args.target_attn)
    target.check_drafter_config(cfg)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(device).train()
    drafter.set_gradient_checkpointing(args.checkpointing)
    use_compile = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    if use_compile:  # as the trainer does: static shapes, the recompile limit raised first
        compile_drafter_layers(drafter.layers, len(anchor_count_buckets(cfg.block_size, runtime.max_anchors_per_row)))
    build_s = time.perf_counter() - t0
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    gen = torch.Generator().manual_seed(0)
    batch = random_batch(rows, seq, preset["docs_per_row"], gen).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def one_step(seed: int):
        with autocast:
            out = dflash_step(drafter, target, batch, cfg, recipe, runtime, torch.Generator().manual_seed(seed))
        out.loss.backward()
        drafter.zero_grad(set_to_none=True)
        return out

    for i in range(args.warmup):
        one_step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    trained = 0
    flops = 0.0
    for i in range(args.steps):
        out = one_step(1000 + i)
        trained += out.tokens
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    for i in range(args.steps):  # counted after timing: materialising masks on CPU is not part of the step
        flops += step_flops(cfg, recipe, runtime, target, batch.to("cpu"), 1000 + i, trained // args.steps)

    result: dict[str, Any] = {
        "preset": args.preset, "device": str(device), "rows": rows, "seq": seq, "steps": args.steps,
        "block_size": cfg.block_size, "num_anchors": recipe.num_anchors, "compile": use_compile,
        "backend": args.backend, "build_s": round(build_s, 1), "step_s": round(wall / args.steps, 4),
        "tokens_per_s": round(rows * seq * args.steps / wall, 1),
        "trained_tokens_per_s": round(trained / wall, 1),
        "drafter_params_m": round(sum(p.numel() for p in drafter.parameters()) / 1e6, 1),
        "target_kept_layers": max(cfg.target_layer_ids) + 1, "tflops_per_step": round(flops / args.steps / 1e12, 3),
        "achieved_tflops": round(flops / wall / 1e12, 3),
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = args.peak_tflops * 1e12 if args.peak_tflops else next(
            (v for k, v in PEAK_BF16.items() if k in name), None)
        result |= {"gpu": name, "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
                   "mfu": round(flops / wall / peak, 4) if peak else None}
    else:
        result |= {"cpu_s_per_step": round(cpu / args.steps, 3),
                   "tokens_per_cpu_s": round(rows * seq * args.steps / cpu, 1),
                   "threads": torch.get_num_threads(),
                   "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                   "rss_after_build_mib": round(rss_built, 1)}
    result["torch"] = torch.__version__
    print(json.dumps(result))


def _agreement_step(drafter: DFlashDrafter, target: FrozenTarget, batch: Any, cfg: DrafterConfig,
                    recipe: TrainingRecipe, runtime: TrainingRuntime, step: int) -> int:
    """One step as the trainer runs it (the label agreement when due): its agreed labels, -1 when not measured."""
    out = dflash_step(drafter, target, batch, cfg, recipe, runtime, torch.Generator().manual_seed(step),
                      measure_agreement=recipe.agreement_due(step))
    out.loss.backward()
    drafter.zero_grad(set_to_none=True)
    return out.agreed


def timed_steps(step: Callable[[int], Any], warmup: int, seeds: range) -> tuple[float, float, list[Any]]:
    """(wall s, CPU s per step, each step's result) of `step` over `seeds`, after `warmup` steps (seeds 0..)."""
    for i in range(warmup):
        step(i)
    started, cpu0 = time.perf_counter(), time.process_time()
    results = [step(seed) for seed in seeds]
    return (time.perf_counter() - started) / len(seeds), (time.process_time() - cpu0) / len(seeds), results


def compare_agreement(args: argparse.Namespace) -> None:
    """Seconds per CPU step of the default recipe under each label_agreement_every, in one process: the same batch,
    anchors and drafter init each time; steps rounded up to whole measurement periods so each setting measures its
    share."""
    preset = PRESETS[args.preset]
    rows, seq = args.rows or preset["rows"], args.seq or preset["seq"]
    shape = preset["target"]
    cfg = preset_drafter(preset)
    runtime = TrainingRuntime(attention_backend=args.backend)
    batch = random_batch(rows, seq, preset["docs_per_row"], torch.Generator().manual_seed(0))
    periods = [n for n in args.label_agreement_every if n > 0]
    steps = max(args.steps, *periods) if periods else args.steps
    for n in periods:
        steps = -(-steps // n) * n
    first = None
    for every in args.label_agreement_every:
        recipe = TrainingRecipe(num_anchors=preset["anchors"], label_agreement=every > 0,
                                label_agreement_every=max(every, 1))
        torch.manual_seed(0)
        target = build_target(shape, cfg.target_layer_ids, torch.device("cpu"), args.target_attn,
                              keep_output=recipe.needs_target_output)
        drafter = DFlashDrafter(cfg).train()
        wall, cpu, agreed = timed_steps(
            partial(_agreement_step, drafter, target, batch, cfg, recipe, runtime), args.warmup, range(steps))
        measured = sum(n >= 0 for n in agreed)
        first = first or wall
        print(json.dumps({"preset": args.preset, "label_agreement_every": every, "steps": steps,
                          "measured_steps": measured, "step_s": round(wall, 4), "cpu_s_per_step": round(cpu, 4),
                          "vs_first": round(wall / first, 3), "threads": torch.get_num_threads()}), flush=True)


def _precision_step(drafter: DFlashDrafter, target: FrozenTarget, batch: Any, cfg: DrafterConfig,
                    recipe: TrainingRecipe, runtime: TrainingRuntime, bf16: bool, step: int) -> float:
    """One step under bf16 autocast or none: its loss."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = dflash_step(drafter, target, batch, cfg, recipe, runtime, torch.Generator().manual_seed(step))
    out.loss.backward()
    drafter.zero_grad(set_to_none=True)
    return float(out.loss.detach())


def compare_precision(args: argparse.Namespace) -> None:
    """Seconds per CPU step of the default recipe under each precision, in one process: the same batch, anchors
    and drafter init each time, the label agreement off (it is measured on one step in ten)."""
    preset = PRESETS[args.preset]
    rows, seq = args.rows or preset["rows"], args.seq or preset["seq"]
    cfg = preset_drafter(preset)
    runtime = TrainingRuntime(attention_backend=args.backend)
    recipe = TrainingRecipe(num_anchors=preset["anchors"], label_agreement=False)
    batch = random_batch(rows, seq, preset["docs_per_row"], torch.Generator().manual_seed(0))
    first = None
    for precision in args.precision:
        bf16 = precision == "bf16"
        torch.manual_seed(0)
        target = build_target(preset["target"], cfg.target_layer_ids, torch.device("cpu"), args.target_attn,
                              dtype=torch.bfloat16 if bf16 else torch.float32)
        drafter = DFlashDrafter(cfg).train()
        step = partial(_precision_step, drafter, target, batch, cfg, recipe, runtime, bf16)
        wall, cpu, losses = timed_steps(step, args.warmup, range(1000, 1000 + args.steps))
        first = first or wall
        print(json.dumps({"preset": args.preset, "precision": precision, "steps": args.steps, "step_s": round(wall, 4),
                          "cpu_s_per_step": round(cpu, 4), "vs_first": round(wall / first, 3),
                          "first_losses": [round(x, 4) for x in losses[:3]], "threads": torch.get_num_threads()}),
              flush=True)


if __name__ == "__main__":
    main()
