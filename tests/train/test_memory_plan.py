"""The memory plan: its terms follow the settings, it matches real CPU training steps, and an oversize run
is refused (exit 64) before the target is loaded, naming the setting to change."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_shared.errors import ConfigError, exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.storage import ObjectStore
from dflash_train.config import debug
from dflash_train.drafter.config import QWEN3_6_DRAFTER, DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.stage import run
from dflash_train.training.memory_plan import (
    GIB,
    PlanInputs,
    _cgroup_room,
    drafter_parameter_count,
    plan_memory,
    planned_anchor_count,
    remedies,
    window_fits,
    window_table,
)
from dflash_train.training.target_params import checkpoint_sizes
from tests.support.tiny_target import build_tiny_target
from tests.train.train_fixtures import identity_of, synthetic_docs, tiny_target, write_tokenized

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import bench_memory_plan  # noqa: E402

# Stated tolerance of the prediction against the measured peak of a real CPU step (measured ratios are in
# docs/benchmarks.md: 0.93-1.09); the plan takes the worst-case anchor count and adds a 10% margin.
FACTOR = (0.75, 1.5)

# A Qwen3.6-27B-shaped target (64 layers, hidden 5120, 248,320 rows, untied): the reference drafter's setting,
# planned without any weights.
QWEN3_6_27B = bench_memory_plan.qwen3_6_27b_shape()


def reference_drafter(**overrides: object) -> DrafterConfig:
    values = {**QWEN3_6_DRAFTER, "hidden_size": 5120, "intermediate_size": 17408, "num_target_layers": 64,
              "target_layer_ids": [1, 16, 31, 46, 61], "target_hidden_size": 5120, "mask_token_id": 248070,
              "block_size": 16, "rope_theta": 1e7, **overrides}
    return DrafterConfig(**values)  # type: ignore[arg-type]


def gpu_inputs(**changes: object) -> PlanInputs:
    cfg = reference_drafter()
    cap = 512  # the runtime's default max_anchors_per_row
    values: dict[str, object] = dict(
        drafter=cfg, target=QWEN3_6_27B, max_length=4096, micro_batch_rows=1,
        anchors=planned_anchor_count(cfg.block_size, cap, 4096), max_anchors_per_row=cap, target_bytes=2,
        autocast_bf16=True, backend="flex",
        device_type="cuda", parallelism="ddp", world_size=8, shard_size=8, activation_checkpointing=False,
        chunk_tokens=None, feature_noise=False)
    values.update(changes)
    return PlanInputs(**values)  # type: ignore[arg-type]


def test_checkpoint_sizes_from_headers_count_what_transformers_loads(target_arch: str) -> None:
    """The parameter count read from the safetensors headers equals the loaded model's (the Qwen3.6 layout's
    vision tower and MTP weights are not loaded, a tied head is counted once)."""
    from transformers import AutoModelForCausalLM

    target_dir = build_tiny_target(target_arch)  # type: ignore[arg-type]
    shape = checkpoint_sizes(target_dir)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    layers = model.get_decoder().layers
    assert shape.layer_params == tuple(sum(p.numel() for p in layer.parameters()) for layer in layers)
    assert sum(shape.layer_params) + shape.whole_params == sum(p.numel() for p in model.parameters())
    assert shape.vocab_size == model.get_input_embeddings().weight.shape[0]


def test_drafter_parameter_count_matches_the_model() -> None:
    for cfg in (DrafterConfig.debug(), reference_drafter()):
        with torch.device("meta"):
            model = DFlashDrafter(cfg)
        total, per_layer = drafter_parameter_count(cfg)
        assert total == sum(p.numel() for p in model.parameters())
        assert per_layer == sum(p.numel() for p in model.layers[0].parameters())


def test_terms_follow_the_settings() -> None:
    base = plan_memory(gpu_inputs())
    terms = {t.name: t.bytes for t in base.terms}
    # The reference drafter on Qwen3.6-27B: 512 anchors of 16 at 4096 tokens, one 141 GB GPU per rank.
    assert base.inputs.anchors == 512
    assert 50 * GIB < terms["target weights"] < 56 * GIB  # layers 0..61 of 64 kept, bf16
    assert terms["attention"] < 0.01 * GIB  # flex keeps no score matrix
    # SDPA on CUDA: the math kernel's fp32 scores [1, 32, 8192, 12288] per layer dwarf everything else.
    sdpa = plan_memory(gpu_inputs(backend="sdpa"))
    assert {t.name: t.bytes for t in sdpa.terms}["attention"] > 6 * 4 * 32 * 8192 * 12288
    assert sdpa.peak > base.peak + 50 * GIB
    # FSDP over 8 ranks: the target's kept layers and the drafter state shrink per rank.
    fsdp = {t.name: t.bytes for t in plan_memory(gpu_inputs(parallelism="fsdp")).terms}
    assert fsdp["target weights"] < terms["target weights"] / 3
    assert fsdp["drafter + AdamW"] < terms["drafter + AdamW"] / 4
    # Checkpointing keeps one layer's activations instead of five; two rows double them.
    ckpt = {t.name: t.bytes for t in plan_memory(gpu_inputs(activation_checkpointing=True)).terms}
    assert ckpt["drafter activations"] < terms["drafter activations"] / 2
    rows2 = {t.name: t.bytes for t in plan_memory(gpu_inputs(micro_batch_rows=2)).terms}
    # (less than twice: autocast's bf16 copies of the drafter weights do not grow with the rows)
    assert 1.8 < rows2["drafter activations"] / terms["drafter activations"] < 2.0
    # Without the per-row cap a 4096-token row can carry a block per position: 8x the query tokens.
    block = reference_drafter().block_size
    assert planned_anchor_count(block, 100_000, 4096) == 4096
    assert planned_anchor_count(block, 300, 4096) == 304


def test_the_table_names_every_term_and_the_verdict() -> None:
    plan = plan_memory(gpu_inputs()).with_available(140 * GIB, "torch.cuda.mem_get_info")
    table = plan.table()
    for name in ("target weights", "drafter + AdamW", "target features", "drafter activations", "attention",
                 "LM-head chunk", "allocator margin", "predicted peak", "available"):
        assert name in table
    assert plan.fits and table.endswith("fits")
    small = plan.with_available(60 * GIB, "torch.cuda.mem_get_info")
    assert not small.fits and "DOES NOT FIT" in small.table()


def test_remedies_are_replanned_and_fit() -> None:
    plan = plan_memory(gpu_inputs(micro_batch_rows=4)).with_available(120 * GIB, "test")
    assert not plan.fits
    fixes = remedies(plan)
    text = " | ".join(fixes)
    assert "max_length" in text and "micro_batch_rows" in text and "parallelism=fsdp" in text
    # Each named value really fits when planned again.
    longest = int(next(f for f in fixes if f.startswith("max_length")).rsplit(" ", 1)[1])
    block, cap = plan.inputs.drafter.block_size, plan.inputs.max_anchors_per_row
    again = plan_memory(gpu_inputs(micro_batch_rows=4, max_length=longest,
                                   anchors=planned_anchor_count(block, cap, longest)))
    assert again.peak <= 120 * GIB
    over = plan_memory(gpu_inputs(micro_batch_rows=4, max_length=longest + 1,
                                  anchors=planned_anchor_count(block, cap, longest + 1)))
    assert over.peak > 120 * GIB


def test_cgroup_room(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("8589934592\n")
    (tmp_path / "memory.current").write_text(str(3 * GIB))
    (tmp_path / "memory.stat").write_text(f"anon 123\ninactive_file {GIB}\n")
    assert _cgroup_room(tmp_path) == 8 * GIB - 2 * GIB  # page cache is reclaimable, not used
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_room(tmp_path) is None


@pytest.mark.parametrize("shape", ["tiny-fp32", "acts-fp32"])
def test_prediction_is_close_to_the_measured_peak_of_real_cpu_steps(shape: str) -> None:
    """Two real training steps (target, drafter, AdamW, backward) in a fresh process: peak RSS growth vs plan."""
    result = bench_memory_plan.measure(shape, str(tiny_target()) if shape == "tiny-fp32" else None)
    assert result["trained_slots"] > 0
    ratio = result["predicted_bytes"] / result["measured_bytes"]
    assert FACTOR[0] <= ratio <= FACTOR[1], result["table"] + f"\nmeasured {result['measured_bytes']} B"


def truncated_target(tmp_path: Path) -> Path:
    """The tiny target with its weights cut off after the safetensors header: the memory plan reads the
    header; loading the weights would fail. A refusal with ConfigError therefore happened before loading."""
    out = tmp_path / "header-only-target"
    shutil.copytree(tiny_target(), out)
    weights = out / "model.safetensors"
    raw = weights.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    json.loads(raw[8:8 + length])
    weights.write_bytes(raw[:8 + length])
    return out


def test_oversize_max_length_is_refused_before_the_target_loads(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    store = ObjectStore()
    data = write_tokenized(store, str(tmp_path / "tok"), synthetic_docs(6), identity_of(tiny_target()))
    length = 200_000
    config = debug(data, str(tmp_path / "out"), str(truncated_target(tmp_path)), max_length=length,
                   batch_tokens=length, scratch_dir=str(tmp_path / "scratch"))
    with caplog.at_level("INFO"), pytest.raises(ConfigError) as caught:
        run(config, store)
    message = str(caught.value)
    assert exit_code_for(caught.value) is ExitCode.USAGE
    assert "does not fit" in message and "max_length (--max-length / DFLASH_TRAIN_MAX_LENGTH) <= " in message
    assert "predicted peak" in message and "MemAvailable" in message
    # The table is also logged before the refusal, as it is at the start of every run.
    assert any(r.getMessage().startswith("memory plan per rank (cpu, ddp, 1 rank(s)): max_length 200000")
               for r in caplog.records)
    assert not store.list(str(tmp_path / "out"))


def test_cli_exits_64_naming_the_setting(tmp_path: Path) -> None:
    store = ObjectStore()
    data = write_tokenized(store, str(tmp_path / "tok"), synthetic_docs(6), identity_of(tiny_target()))
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_train", "run", "--preset", "debug", "--input", data, "--output",
         str(tmp_path / "out"), "--target", str(truncated_target(tmp_path)), "--max-length", "200000",
         "--batch-tokens", "200000", "--scratch-dir", str(tmp_path / "scratch")],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 64, proc.stderr[-3000:]
    assert "--max-length" in proc.stderr and "predicted peak memory" in proc.stderr


def test_the_qwen3_6_preset_at_long_windows_on_80_and_141_gb() -> None:
    """The long-context option in figures (bench/bench_memory_plan.py --windows prints the table): with the 512-
    anchor cap every window up to 32K fits a 141 GB GPU under DDP and an 80 GB one under FSDP over 8 ranks;
    keeping a 4K row's anchors per token needs activation checkpointing (DDP on 141 GB, FSDP on 80 GB)."""
    base = bench_memory_plan.qwen3_6_inputs()
    fixed = {(f.max_length, f.parallelism, f.activation_checkpointing): f
             for f in window_fits(base, bench_memory_plan.WINDOWS)}
    assert len(fixed) == 12 and {f.anchors for f in fixed.values()} == {512}
    for length in (4096, 16384, 32768):
        ddp, fsdp = fixed[(length, "ddp", False)], fixed[(length, "fsdp", False)]
        assert ddp.fits == {"80 GB": False, "141 GB": True}, (length, ddp.peak / GIB)
        assert fsdp.fits == {"80 GB": True, "141 GB": True}, (length, fsdp.peak / GIB)
    # Little of the peak grows with the window under a fixed cap: 113 -> 121 GiB from 4K to 32K under DDP.
    assert fixed[(32768, "ddp", False)].peak - fixed[(4096, "ddp", False)].peak < 10 * GIB
    dense = {(f.max_length, f.parallelism, f.activation_checkpointing): f
             for f in window_fits(base, bench_memory_plan.WINDOWS, density_of=4096)}
    assert (dense[(16384, "ddp", False)].anchors, dense[(32768, "ddp", False)].anchors) == (2048, 4096)
    assert dense[(16384, "ddp", False)].fits["141 GB"] is False
    assert dense[(16384, "ddp", True)].fits == {"80 GB": False, "141 GB": True}
    assert dense[(32768, "ddp", True)].fits == {"80 GB": False, "141 GB": True}
    assert dense[(32768, "fsdp", False)].fits == {"80 GB": False, "141 GB": False}
    assert dense[(32768, "fsdp", True)].fits == {"80 GB": True, "141 GB": True}
    table = window_table(list(dense.values()))
    assert table.splitlines()[0].split() == ["max_length", "anchors", "parallelism", "ckpt", "peak", "80", "GB", "141",
                                             "GB"]
    assert len(table.splitlines()) == 13


def test_attention_memory_does_not_grow_with_the_window_under_flex() -> None:
    """The sliding layers' window bounds what flex attention keeps: its term is the same at 4K and 32K; SDPA's
    dense mask over every context key (sliding layers included) grows linearly with max_length."""
    def attention(**changes: object) -> int:
        return {t.name: t.bytes for t in plan_memory(gpu_inputs(**changes)).terms}["attention"]

    assert attention(max_length=4096) == attention(max_length=32768)
    short, long = attention(backend="sdpa", max_length=4096), attention(backend="sdpa", max_length=32768)
    q = 512 * 16  # the capped anchors' query tokens: the mask is [Q, S + Q]
    assert long / short == pytest.approx((32768 + q) / (4096 + q))
