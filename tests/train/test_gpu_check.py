"""bench/gpu_check.py: the prepared one-command GPU check, run end to end on CPU (`--tiny`).

The CPU run is the same script at toy width: the Qwen3.5 text classes with the 3:1 linear/full pattern, the
reference drafter layout, the real 248,320-row vocabulary, the project's step, flex compiled for the
agreement check. The tests check the JSON a GPU run would hand back: every field there, sane values
(MFU in (0, 1], tokens/s > 0, agreement within the stated tolerances), and the exit codes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_train.anchors import sample_anchors
from dflash_train.attention import build_drafter_mask, drafter_mask_mod, materialize
from dflash_train.batch import pack_row, stack_rows

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check_flops as flops  # noqa: E402

PARTS = ("build", "train_step", "flex_vs_sdpa", "packed_features")


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # $OUT would be the default --out
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu_check")
    proc = _run("--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert "gpu_check on cpu" in proc.stdout and "failed: none" in proc.stdout  # the summary printed last
    return result


def test_every_part_ran_and_passed(tiny_run: dict[str, Any]):
    assert tiny_run["ok"] is True and tiny_run["failed"] == []
    for part in PARTS:
        assert tiny_run[part]["status"] == "ok", (part, tiny_run[part])
    env = tiny_run["environment"]
    assert env["device"] == "cpu" and env["versions"]["torch"] == torch.__version__
    assert env["peak_tflops"] > 0 and "measured cpu matmul" in env["peak_source"]


def test_build_is_the_qwen3_6_layout_with_the_reference_drafter(tiny_run: dict[str, Any]):
    build = tiny_run["build"]
    assert build["target_layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    drafter = build["drafter"]
    assert drafter["target_layer_ids"] == [1, 2, 3, 4, 5] and build["target_kept_layers"] == 6
    assert drafter["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"]
    assert drafter["mask_token_id"] == 248070 and drafter["intermediate_size"] == 256
    # On CPU the Gated DeltaNet layers run transformers' reference kernels, so documents run one by one.
    assert build["packing"] == "per_document" and "PyTorch reference" in build["linear_kernels"]


def test_train_step_figures_are_sane(tiny_run: dict[str, Any]):
    step = tiny_run["train_step"]
    assert step["tokens_per_s"] > 0 and step["trained_tokens_per_s"] > 0 and step["step_s"] > 0
    assert 0 < step["mfu"] <= 1 and 0 < step["mfu_vs_measured_matmul"] <= 1
    terms = step["flops_per_step_tflop"]
    assert set(terms) == set(flops.FORMULAS) == set(step["flop_formulas"])
    for name in ("target_matmul", "drafter_matmul", "drafter_attention", "drafter_fc", "lm_head"):
        assert terms[name] > 0, name
    assert math.isclose(step["flops_per_step_total_tflop"], sum(terms.values()), rel_tol=1e-2, abs_tol=1e-4)
    assert step["peak_memory_gib"] > 0
    # The memory plan's prediction for the same step sits beside the measurement (judged on CUDA only: on
    # CPU the peak is the process's RSS, libraries included).
    assert step["memory_plan_peak_gib"] > 0 and "memory_plan_error" not in step
    # A random drafter over the real vocabulary starts near ln(248,320) = 12.4.
    assert all(abs(loss - math.log(248320)) < 1.5 for loss in step["loss_first_last"])
    # Documents long enough to fill every anchor: one query length, nothing compiled while timing.
    assert len(step["query_lengths"]) == 1
    assert step["compiles"]["timed_steps"] == {"graphs": 0, "aot_autograd": 0}
    assert step["flex_unfused_fallback_warnings"] == 0 and step["problems"] == []


def test_flex_and_sdpa_agree_on_the_drafter_masks(tiny_run: dict[str, Any]):
    check = tiny_run["flex_vs_sdpa"]
    assert set(check["layer_types"]) == {"full_attention", "sliding_attention"}
    for row in check["layer_types"].values():
        assert row["ok"] and row["forward_max_abs_diff"] <= check["rtol_of_max_abs"] * row["forward_ref_max_abs"]
        assert row["forward_ref_max_abs"] > 0.1  # outputs that are not all zero
    assert check["backward"] is False  # flex has no backward on CPU; the GPU run compares dq, dk, dv too
    assert check["compiles"]["graphs"] >= 1  # flex ran compiled, as on the GPU


def test_packed_features_match_each_document_and_the_leak_is_visible(tiny_run: dict[str, Any]):
    check = tiny_run["packed_features"]
    worst = max(check["max_abs_diff_per_document"])
    assert worst <= check["rtol_of_max_abs"] * check["ref_max_abs"]
    # The same row read as one document differs clearly: the check can tell a lost boundary.
    assert check["leak_max_abs_diff"] > check["leak_margin"] * worst
    assert check["leak_max_abs_diff"] > 1e-3


def test_a_part_that_does_not_run_fails_the_check(tmp_path: Path):
    proc = _run("--tiny", "--budget-s", "0", "--out", str(tmp_path))
    assert proc.returncode == 1, proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["ok"] is False and result["failed"] == list(PARTS)
    assert all(result[p]["status"] == "skipped" and "--budget-s" in result[p]["reason"] for p in PARTS)


def test_without_a_gpu_the_full_check_names_the_way_out(tmp_path: Path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    proc = _run("--out", str(tmp_path))
    assert proc.returncode == 69
    assert "no CUDA device" in proc.stderr and "--tiny" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_pair_count_reads_both_backends_alike():
    """The attention FLOPs come from the step's own masks: a BlockMask and an SDPA mask give one count."""
    gen = torch.Generator().manual_seed(0)
    docs = [(torch.randint(0, 1000, (n,), generator=gen).tolist(), [False] * 8 + [True] * (n - 8)) for n in (70, 50)]
    batch = stack_rows([pack_row(docs, 128), pack_row(docs[::-1], 128)])
    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, 5, 8, generator=gen)
    rows, n = anchor_pos.shape
    q_len, kv_len = n * 8, 128 + n * 8
    for window in (None, 16):
        layer = "full_attention" if window is None else "sliding_attention"
        counts = [flops.allowed_pairs(build_drafter_mask(anchor_pos, keep, batch.document_ids, 8, [layer], window,
                                                         backend).for_layer(layer), rows, q_len, kv_len, chunk=24)
                  for backend in ("flex", "sdpa")]
        allowed = materialize(drafter_mask_mod(anchor_pos, keep, batch.document_ids, 8, window), rows, q_len,
                              kv_len, torch.device("cpu"))
        expected = (int(allowed.sum()), int(allowed.any(-1).sum()))
        assert counts == [expected, expected]
        assert expected[1] == int(keep.sum()) * 8  # every query of a kept block sees its own block


def test_drafter_flops_are_six_p_t_for_the_matmuls():
    from dflash_train.drafter_config import DrafterConfig
    from dflash_train.model import DFlashDrafter

    cfg = DrafterConfig.debug()
    drafter = DFlashDrafter(cfg)
    linear = sum(m.weight.numel() for name, m in drafter.named_modules() if isinstance(m, torch.nn.Linear)
                 and name != "fc")
    # Without context tokens every weight but fc meets the block tokens alone: exactly 6 P T.
    terms = flops.drafter_flops(cfg, context_tokens=0, kept_query_tokens=100, pairs_per_layer=[0] * cfg.num_layers)
    assert terms["drafter_matmul"] == 6 * linear * 100
    assert terms["drafter_fc"] == 0 and terms["drafter_attention"] == 0
    assert flops.drafter_flops(cfg, 10, 0, [7, 3])["drafter_attention"] == 3 * 4 * cfg.num_attention_heads * \
        cfg.head_dim * 10
