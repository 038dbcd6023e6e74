"""The memory plan's predicted peak beside the measured peak of real CPU training steps, for a few shapes.

Each shape runs in a fresh interpreter (so one shape's freed memory cannot hide another's peak): it saves a
random-weight Qwen3 target of the shape to a temporary directory (or takes --target-dir), computes the
plan from the configs as the train stage does (`memory_plan.plan_for_run`), then loads the target, builds
the drafter and AdamW and runs two optimizer steps with `dflash_step` + backward. The first step has a few
anchors only (it creates the AdamW moments, as every step after the first has them); the second has one
document filling each row with every token trained, so it reaches the plan's worst-case anchor count.
Measured = peak RSS (VmHWM) minus the RSS before the target is loaded: it includes what glibc keeps of freed
memory, as the device's free memory would. Not getrusage's ru_maxrss: Linux carries the high-water mark of the
process that started this one across fork and exec, so under a large parent (a pytest process that has loaded
models) it reports the parent's size.

  python bench/bench_memory_plan.py                 # all shapes, one line each, then a JSON list
  python bench/bench_memory_plan.py --shape tiny-fp32 --json
  python bench/bench_memory_plan.py --windows        # the Qwen3.6-27B preset at 4K/16K/32K on 80 and 141 GB
Runs on CPU with the train environment (.venv-train): torch, transformers, pydantic.

`--windows` only plans (no step runs, no weights): the reference drafter on a Qwen3.6-27B-shaped target, 8 GPUs
per node, bf16 autocast, flex attention, one row per micro-batch, at each training window, under DDP and FSDP
with and without activation checkpointing, with the 512-anchor cap and with the cap grown to keep a 4K row's
anchors per token.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
try:
    import dflash_train  # noqa: F401
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(REPO / "jobs" / "train" / "src"))

# target: a Qwen3 shape; drafter: DrafterConfig.debug overrides; train: TrainConfig fields (the anchors among them).
SHAPES: dict[str, dict[str, Any]] = {
    # The test suite's tiny target shape and drafter (block 8) over its real 151,936-row vocabulary: the
    # LM-head chunks (1 GiB of logits each) dominate.
    "tiny-fp32": {"target": dict(layers=4, hidden=128, heads=2, kv=1, head_dim=64, inter=256, vocab=151936),
                  "drafter": dict(num_layers=2, block_size=8),
                  "train": dict(max_length=256, precision="fp32", target_dtype="fp32", num_anchors=512)},
    # Block 16, 128 anchors per row (2048 query tokens), a wider drafter: activations and the SDPA mask dominate.
    "acts-fp32": {"target": dict(layers=4, hidden=512, heads=4, kv=2, head_dim=64, inter=1024, vocab=32768),
                  "drafter": dict(num_layers=3, block_size=16, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=1024),
                  "train": dict(max_length=512, precision="fp32", target_dtype="fp32", chunk_tokens=512,
                                num_anchors=512, max_anchors_per_row=128)},
    # The GPU recipe's dtypes (bf16 target, bf16 autocast over fp32 weights), two rows per micro-batch; small,
    # because this CPU has no native bf16 arithmetic.
    "acts-bf16": {"target": dict(layers=4, hidden=256, heads=4, kv=2, head_dim=64, inter=512, vocab=8192),
                  "drafter": dict(num_layers=3, block_size=16, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=512),
                  "train": dict(max_length=256, precision="bf16", target_dtype="bf16", chunk_tokens=512,
                                micro_batch_rows=2, num_anchors=512, max_anchors_per_row=64)},
}


# Training windows `--windows` plans: the default, and the long-context options up to the generation budget.
WINDOWS = (4096, 16384, 32768)


def qwen3_6_27b_shape() -> Any:
    """A Qwen3.6-27B-shaped target (64 layers of ~400M parameters, 3 linear-attention then 1 full, hidden 5120,
    248,320 untied vocabulary rows): the reference drafter's setting, planned without any weights."""
    from dflash_train.training.target_params import TargetSizes

    return TargetSizes(architecture="Qwen3.6-27B-shaped",
                       layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 16,
                       layer_params=(400_000_000,) * 64, whole_params=2 * 248_320 * 5120, hidden_size=5120,
                       intermediate_size=17408, vocab_size=248_320, num_key_value_heads=4, head_dim=256,
                       dtype_bytes=2)


def qwen3_6_inputs(max_length: int = 4096) -> Any:
    """The memory plan's inputs for the reference Qwen3.6-27B drafter on 8 GPUs (no weights needed): 64 target
    layers of ~400M parameters (the ~54 GB bf16 checkpoint), hidden 5120, 248,320 untied vocabulary rows."""
    from dflash_train.drafter.config import QWEN3_6_DRAFTER, DrafterConfig
    from dflash_train.training.memory_plan import PlanInputs, planned_anchor_count

    target = qwen3_6_27b_shape()
    cfg = DrafterConfig(**{**QWEN3_6_DRAFTER, "hidden_size": 5120, "intermediate_size": 17408,
                           "num_target_layers": 64, "target_layer_ids": [1, 16, 31, 46, 61],
                           "target_hidden_size": 5120, "mask_token_id": 248070, "block_size": 16,
                           "rope_theta": 1e7})
    cap = 512  # the train stage's default anchors per row
    return PlanInputs(drafter=cfg, target=target, max_length=max_length, micro_batch_rows=1,
                      anchors=planned_anchor_count(cfg.block_size, cap, max_length), max_anchors_per_row=cap,
                      target_bytes=2, autocast_bf16=True,
                      backend="flex", device_type="cuda", parallelism="ddp", world_size=8, shard_size=8,
                      activation_checkpointing=False, chunk_tokens=None, feature_noise=False)


def window_report() -> dict[str, Any]:
    """The Qwen3.6-27B preset's plan at each of WINDOWS: the fixed anchor cap, and the cap keeping 4K's density."""
    from dflash_train.training.memory_plan import GPU_CLASSES, window_fits

    base = qwen3_6_inputs()
    return {"gpus_gib": {name: round(room / 2**30, 1) for name, room in GPU_CLASSES.items()},
            "fixed_cap": window_fits(base, WINDOWS), "density_of_4096": window_fits(base, WINDOWS, density_of=4096)}


def print_windows() -> None:
    from dataclasses import asdict

    from dflash_train.training.memory_plan import window_table

    report = window_report()
    rooms = ", ".join(f"{name}: {gib} GiB free" for name, gib in report["gpus_gib"].items())
    print(f"Qwen3.6-27B reference drafter, 8 GPUs per node, flex, bf16; available per GPU class: {rooms}")
    print("anchor cap 512 per row (the drafter's default):")
    print(window_table(report["fixed_cap"]))
    print("anchor cap grown with the window (512 x max_length / 4096: a 4K row's anchors per token):")
    print(window_table(report["density_of_4096"]))
    print(json.dumps({key: [asdict(f) for f in value] if isinstance(value, list) else value
                      for key, value in report.items()}))


def save_target(shape: dict[str, int], out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"],
        head_dim=shape["head_dim"], max_position_embeddings=4096, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    return out


def _status_bytes(field: str) -> int:
    """A memory figure of this process's own address space from /proc/self/status (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rss() -> int:
    return _status_bytes("VmRSS")


def worker(name: str, target_dir: str | None) -> dict[str, Any]:
    """One shape in this process: the plan, then the measured peak of two real training steps."""
    import torch

    from dflash_train.config import debug
    from dflash_train.data.batch import pack_row, stack_rows
    from dflash_train.drafter.config import DrafterConfig
    from dflash_train.parallel.distributed import DistEnv
    from dflash_train.target_model.frozen import FrozenTarget
    from dflash_train.training.memory_plan import plan_for_run
    from dflash_train.training.optim import build_optimizer, clip_gradients
    from dflash_train.training.precision import autocast, target_dtype
    from dflash_train.training.step import dflash_step
    from dflash_train.training.warm_start import initial_drafter

    spec = SHAPES[name]
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(target_dir) if target_dir else save_target(spec["target"], Path(tmp) / "target")
        hf = json.loads((target / "config.json").read_text())
        hidden, vocab = int(hf["hidden_size"]), int(hf["vocab_size"])
        cfg = DrafterConfig.debug(**{"hidden_size": hidden, "target_hidden_size": hidden,
                                     "num_target_layers": int(hf["num_hidden_layers"]), "mask_token_id": vocab - 1,
                                     **spec["drafter"]})
        config = debug("unused", "unused", str(target), device="cpu", **spec["train"])
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
        dtype = target_dtype(config.runtime, env.device)
        plan = plan_for_run(config.runtime, config.recipe, cfg, str(target), config.max_length or 0, "ddp", env,
                            dtype.itemsize)
        rows, seq = config.micro_batch_rows, int(config.max_length or 0)
        gen = torch.Generator().manual_seed(0)

        def batch(trained_tokens: int) -> Any:
            out = []
            for _ in range(rows):
                ids = torch.randint(0, vocab - 1, (seq,), generator=gen).tolist()
                out.append(pack_row([(ids, [False] * (seq - trained_tokens) + [True] * trained_tokens)], seq))
            return stack_rows(out)

        warmup, full = batch(8), batch(seq - 1)
        before = _rss()
        frozen = FrozenTarget.from_pretrained(target, cfg.target_layer_ids, device="cpu", dtype=dtype,
                                              attn_implementation=config.target_attn_implementation,
                                              keep_output=config.recipe.needs_target_output)
        drafter, _ = initial_drafter(cfg, config.seed, config.runtime, env.device)
        optimizer = build_optimizer(drafter.parameters(), config.recipe, env.device)
        anchors = 0
        for step, packed in enumerate((warmup, full)):
            with autocast(config.runtime, env.device):
                out = dflash_step(drafter, frozen, packed, cfg, config.recipe, config.runtime,
                                  torch.Generator().manual_seed(step), noise=True)
            out.loss.backward()
            clip_gradients(drafter.parameters(), config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            anchors = int(out.counted.sum())
        measured = _status_bytes("VmHWM") - before
    return {"shape": name, "predicted_bytes": plan.peak, "measured_bytes": measured,
            "ratio": round(plan.peak / measured, 3), "anchors": plan.inputs.anchors, "trained_slots": anchors,
            "table": plan.table()}


def measure(name: str, target_dir: str | None = None, python: str = sys.executable) -> dict[str, Any]:
    """Run `worker` for one shape in a fresh interpreter and return its result."""
    cmd = [python, str(Path(__file__).resolve()), "--worker", name]
    if target_dir:
        cmd += ["--target-dir", str(target_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "jobs" / "train" / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), action="append", help="shape(s) to run (default: all)")
    parser.add_argument("--target-dir", help="use this target checkpoint instead of a random one of the shape")
    parser.add_argument("--json", action="store_true", help="print only the JSON list")
    parser.add_argument("--windows", action="store_true",
                        help="plan the Qwen3.6-27B preset at 4K/16K/32K windows on 80 GB and 141 GB GPUs (no steps)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.target_dir)))
        return
    if args.windows:
        print_windows()
        return
    results = []
    for name in args.shape or list(SHAPES):
        result = measure(name, args.target_dir)
        results.append(result)
        if not args.json:
            print(result["table"])
            print(f"{name}: predicted {result['predicted_bytes'] / 2**30:.2f} GiB, measured "
                  f"{result['measured_bytes'] / 2**30:.2f} GiB (ratio {result['ratio']:.2f}), N={result['anchors']}\n")
    print(json.dumps([{k: v for k, v in r.items() if k != "table"} for r in results]))


if __name__ == "__main__":
    main()
