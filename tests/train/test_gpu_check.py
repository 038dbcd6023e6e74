"""bench/gpu_check.py: the prepared one-command GPU check, run end to end on CPU (`--tiny`).

The CPU run is the same script at toy width: the Qwen3.5 text classes with the 3:1 linear/full pattern, the
reference drafter layout, the real 248,320-row vocabulary, the project's step, flex compiled for the
agreement check, the compiled drafter while the anchor count cycles over three ladder rungs. The tests check
the JSON a GPU run would hand back: every field there, sane values (MFU in (0, 1], tokens/s > 0, phase times
that add up to the step, a full-depth projection that follows its formula, agreement within the stated
tolerances), honest labels (a part that could not test its point says not_tested), and the exit codes.
On a GPU machine (`pytest -m gpu`, a CUDA build of torch) the full check runs as well.
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

from dflash_train.data.batch import pack_row, stack_rows
from dflash_train.drafter.attention import build_drafter_mask, drafter_mask_mod, materialize
from dflash_train.training.anchors import sample_anchors

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
import gpu_check_flops as flops  # noqa: E402
import gpu_check_phases as phases  # noqa: E402

PARTS = gpu_check.PARTS


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
    # The summary printed last names what was not tested.
    assert "gpu_check on cpu" in proc.stdout
    assert "failed: none; not tested: ['packed_features', 'vllm_context_k_norm']" in proc.stdout
    result["stdout"] = proc.stdout
    return result


def test_every_part_ran_and_passed_or_says_not_tested(tiny_run: dict[str, Any]):
    assert tiny_run["ok"] is True and tiny_run["failed"] == []
    for part in PARTS:
        expected = "not_tested" if part in ("packed_features", "vllm_context_k_norm") else "ok"
        assert tiny_run[part]["status"] == expected, (part, tiny_run[part])
    assert tiny_run["not_tested"] == ["packed_features", "vllm_context_k_norm"]
    # No CUDA build of vLLM on a CPU machine: the context-key norm self-test on CUDA says it did not run.
    assert tiny_run["vllm_context_k_norm"]["not_tested"] == "not run: no CUDA build of vLLM is installed"
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
    assert step["steps"] == step["steps_requested"] and step["steps_cut_by_budget"] is False
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


def test_train_step_times_each_phase(tiny_run: dict[str, Any]):
    step = tiny_run["train_step"]
    timing = step["phases"]
    assert timing["problems"] == [] and timing["timed_steps"] == step["steps"]
    assert set(timing["phase_s_mean"]) == set(phases.PHASES)
    assert all(v > 0 for v in timing["phase_s_mean"].values()), timing
    # The phases tile the step: their sum is the step's wall time less the loop's own overhead.
    assert 0.8 * step["step_s"] <= timing["step_s_phases_mean"] <= 1.01 * step["step_s"], timing
    # The target's kept layers were timed by kind, and they fit inside the target phase.
    layers = timing["target_layer_s_per_step"]
    assert set(layers) == {"linear_attention", "full_attention"}
    assert sum(layers.values()) <= timing["phase_s_mean"]["target_features"]
    assert set(step["phase_tflops_per_s"]) == set(flops.PHASE_TERMS)
    assert all(v > 0 for v in step["phase_tflops_per_s"].values())


def test_the_full_depth_projection_follows_its_formula(tiny_run: dict[str, Any]):
    step = tiny_run["train_step"]
    full = step["full_depth"]
    # 8 built layers, 6 kept (features 1..5); the real target runs 62 of its 64 (features up to 61).
    assert full["layers"]["linear_attention"]["kept"] == 5 and full["layers"]["full_attention"]["kept"] == 1
    assert full["layers"]["linear_attention"]["full"] == 47 and full["layers"]["full_attention"]["full"] == 15
    added = sum((v["full"] - v["kept"]) * v["s_per_layer"] for v in full["layers"].values())
    assert math.isclose(full["step_s_full_depth"], full["step_s"] + added, rel_tol=1e-3)
    assert full["step_s"] == pytest.approx(step["step_s"], rel=1e-3)
    target_now = sum(v for k, v in step["flops_per_step_tflop"].items() if k.startswith("target_"))
    assert full["flops_full_depth_tflop"] == pytest.approx(
        step["flops_per_step_total_tflop"] - target_now + sum(full["target_flops_full_depth_tflop"].values()),
        rel=1e-3, abs=1e-4)
    assert full["flops_full_depth_tflop"] > step["flops_per_step_total_tflop"]
    expected = step["mfu"] * full["flops_full_depth_tflop"] / full["flops_tflop"] * full["step_s"] / full[
        "step_s_full_depth"]
    assert full["mfu_full_depth"] == pytest.approx(expected, rel=2e-2, abs=1e-4)
    assert "MFU_full = MFU * (F_full / F) * (T / T_full)" in full["formula"]
    assert "full depth (62 target layers run, 6 measured)" in tiny_run["stdout"]


def test_the_shapes_part_compiles_each_rung_once(tiny_run: dict[str, Any]):
    shapes = tiny_run["shapes"]
    # TINY: block 16, the 512-anchor ladder, 256-token rows: the three rungs whose anchors fill <= 1/8 row.
    assert shapes["rungs"] == [8, 16, 32] and shapes["layers_compiled_by"] == "this part"
    for n, row in shapes["per_rung"].items():
        assert row["n"] == int(n) and row["q_len"] == int(n) * 16 and row["kv_len"] == 256 + int(n) * 16
        # A new shape compiled the layers' two training graphs (the first layer, whose input needs no
        # gradient, and one shared by the other four; dflash_train.drafter.attention), a known one nothing.
        assert row["first_visit_compiles"] == {"graphs": 2, "aot_autograd": 2}, row
        assert row["later_visits"] >= 1 and row["later_visits_compiles"] == {"graphs": 0, "aot_autograd": 0}, row
        assert row["step_s_median"] > 0
    assert shapes["problems"] == [] and "untested" not in shapes


def test_flex_and_sdpa_agree_on_the_drafter_masks(tiny_run: dict[str, Any]):
    check = tiny_run["flex_vs_sdpa"]
    assert set(check["layer_types"]) == {"full_attention", "sliding_attention"}
    for row in check["layer_types"].values():
        assert row["ok"] and row["forward_max_abs_diff"] <= check["rtol_of_max_abs"] * row["forward_ref_max_abs"]
        assert row["forward_ref_max_abs"] > 0.1  # outputs that are not all zero
    assert check["backward"] is False  # flex has no backward on CPU; the GPU run compares dq, dk, dv too
    assert any("backward" in item for item in check["untested"])  # and the report says so
    assert check["compiles"]["graphs"] >= 1  # flex ran compiled, as on the GPU


def test_packed_features_match_each_document_and_the_leak_is_visible(tiny_run: dict[str, Any]):
    check = tiny_run["packed_features"]
    # Per-document packing on CPU: both sides are one computation, so the part does not claim a pass.
    assert check["packing"] == "per_document" and "not_tested" in check and check["fla_importable"] is False
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


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_on_a_gpu_the_full_check_passes(tmp_path: Path):
    """The check as a GPU machine runs it (real widths, 8 layers, its own 520 s budget)."""
    proc = _run("--out", str(tmp_path), timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["ok"] is True and result["failed"] == []
    assert result["environment"]["device"] == "cuda"


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
    from dflash_train.drafter.config import DrafterConfig
    from dflash_train.drafter.model import DFlashDrafter

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


def _report(tmp_path: Path, budget_s: float = 100.0) -> gpu_check.Report:
    return gpu_check.Report(budget_s, {"device": "cpu"}, tmp_path, {"flex_vs_sdpa": 10.0, "packed_features": 20.0,
                                                                     "shapes": 30.0})


def test_the_budget_is_shared_by_reserving_time_for_the_later_parts(tmp_path: Path):
    report = _report(tmp_path)
    assert report.deadline("train_step") == pytest.approx(report.start + 100 - 60)
    assert report.deadline("packed_features") == pytest.approx(report.start + 100 - 30)
    assert report.deadline("shapes") == pytest.approx(report.start + 100)


def test_a_part_is_written_as_running_while_it_runs_and_as_not_tested_after(tmp_path: Path):
    report = _report(tmp_path)
    seen = {}

    def part(_deadline: float) -> dict[str, Any]:
        seen["during"] = json.loads((tmp_path / "gpu_check.json").read_text())["build"]["status"]
        return {"ok": True, "not_tested": "nothing to compare against"}

    report.run("build", part)
    assert seen["during"] == "running"  # a kill here would leave this on disk
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["build"]["status"] == "not_tested" and written["failed"] == [] and written["ok"] is True
    assert written["not_tested"] == ["build"]


def test_sigterm_fails_the_part_in_progress_and_skips_the_rest(tmp_path: Path):
    report = _report(tmp_path)

    def interrupted(_deadline: float) -> dict[str, Any]:
        try:
            raise gpu_check.Terminated("SIGTERM")
        except Exception:  # noqa: BLE001 - what a part's own handler does: it must not swallow SIGTERM
            return {"ok": True}

    report.run("build", interrupted)
    report.run("train_step", lambda _d: {"ok": True})
    result = report.result()
    assert result["build"]["status"] == "failed" and "SIGTERM" in result["build"]["error"]
    assert result["train_step"] == {"status": "skipped", "reason": "terminated (SIGTERM)"}
    assert result["failed"] == ["build", "train_step"] and result["ok"] is False


def _summary_input(status: str, recovered: list[str]) -> dict[str, Any]:
    full = phases.project_full_depth(["linear_attention", "full_attention"], ["linear_attention"] * 3 + [
        "full_attention"], {"linear_attention": 0.1, "full_attention": 0.2}, 1.0, {"target_matmul": 1e12,
                                                                                   "lm_head": 1e12}, {
        "target_matmul": 2e12}, 0.3)
    step = {"status": status, "recovered_by": recovered, "tokens_per_s": 100.0, "mfu": 0.3,
            "mfu_vs_measured_matmul": 0.4, "step_s": 1.0, "steps": 5, "rows": 1, "seq": 4096,
            "compiles": {"timed_steps": {"graphs": 0}}, "phases": {"clock": "wall", "phase_s_mean": {"loss": 0.1}},
            "phase_tflops_per_s": {"loss": 10.0}, "full_depth": full}
    return {"environment": {"device": "cuda", "gpu": "H200", "versions": {"torch": "x"}, "peak_tflops": 989},
            "train_step": step, "failed": [] if status == "ok" else ["train_step"], "not_tested": [], "wall_s": 1}


def test_the_summary_labels_figures_after_a_step_down(capsys: pytest.CaptureFixture[str]):
    gpu_check.print_summary(_summary_input("failed", ["out of memory (...): rows halved to 1"]))
    lines = capsys.readouterr().out.splitlines()
    mfu_line = next(line for line in lines if "MFU 30.0%" in line)
    assert "AFTER STEP-DOWN: out of memory" in mfu_line and "train_step FAILED" in mfu_line
    full_line = next(line for line in lines if line.strip().startswith("full depth"))
    assert "AFTER STEP-DOWN" in full_line
    gpu_check.print_summary(_summary_input("ok", []))
    assert "STEP-DOWN" not in capsys.readouterr().out


def test_full_depth_projection_by_hand():
    # Kept 1 linear + 1 full; the full depth 3 + 1: two more linear layers at 0.1 s each.
    full = _summary_input("ok", [])["train_step"]["full_depth"]
    assert full["step_s_full_depth"] == pytest.approx(1.2)
    assert full["flops_full_depth_tflop"] == pytest.approx(3.0)  # 2 measured - 1 target + 2 target at depth
    assert full["mfu_full_depth"] == pytest.approx(0.3 * 3.0 / 2.0 * 1.0 / 1.2, rel=1e-3)
    with pytest.raises(ValueError, match="no measured"):
        phases.project_full_depth(["linear_attention"], ["linear_attention", "full_attention"],
                                  {"linear_attention": 0.1}, 1.0, {"lm_head": 1.0}, {}, 0.1)


def test_a_step_whose_hooks_did_not_fire_is_reported():
    timer = phases.PhaseTimer(torch.device("cpu"))
    timer.start()
    for name in ("target_features", "loss", "backward", "optimizer"):  # no drafter marks
        timer.mark(name)
    timer.end()
    summary = timer.summary()
    assert summary["problems"] and "hook did not fire" in summary["problems"][0]
    timer.mark("loss")  # outside start/end: ignored (warm-up steps are not timed)
    assert len(timer.steps) == 1


def test_the_cuda_clock_reads_events_in_milliseconds(monkeypatch: pytest.MonkeyPatch):
    """The CUDA branch of the phase timer, on CPU: events stand in for torch.cuda.Event (times in ms)."""
    clock = iter(range(0, 10_000, 250))  # each event 250 ms after the one before

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            self.t = next(clock)

        def elapsed_time(self, later: Event) -> float:
            return float(later.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    timer = phases.PhaseTimer(torch.device("cuda"))
    layer = torch.nn.Linear(1, 1)
    timer.start()
    for name in phases.PHASES:
        if name == "target_features":
            timer.layer_begin(layer)
            timer.layer_end(layer, "full_attention")
        timer.mark(name)
    timer.end()
    summary = timer.summary()
    assert summary["problems"] == [] and "CUDA events" in summary["clock"]
    assert summary["phase_s_mean"]["target_features"] == pytest.approx(0.75)  # start, layer in, layer out, mark
    assert all(summary["phase_s_mean"][p] == pytest.approx(0.25) for p in phases.PHASES[1:])
    assert summary["target_layer_s_per_step"] == {"full_attention": pytest.approx(0.25)}


def test_at_full_depth_the_projection_is_the_measurement():
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    full = phases.project_full_depth(kinds, kinds, {"linear_attention": 0.3, "full_attention": 0.1}, 2.0,
                                     {"target_matmul": 5e12, "lm_head": 1e12}, {"target_matmul": 5e12}, 0.4)
    assert full["step_s_full_depth"] == 2.0 and full["flops_full_depth_tflop"] == 6.0
    assert full["mfu_full_depth"] == 0.4


def test_sigterm_mid_run_keeps_the_finished_parts(tmp_path: Path):
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report = tmp_path / "gpu_check.json"
    deadline = time.monotonic() + 300
    try:
        # Wait until the build has finished and the train step is under way, then stop the run.
        while time.monotonic() < deadline:
            if report.exists():
                try:
                    if json.loads(report.read_text()).get("train_step", {}).get("status") == "running":
                        break
                except json.JSONDecodeError:
                    pass  # replaced between the read and the parse
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1
    result = json.loads(report.read_text())
    assert result["build"]["status"] == "ok"
    assert result["train_step"]["status"] == "failed" and "SIGTERM" in result["train_step"]["error"]
    assert all(result[p]["status"] == "skipped" for p in PARTS[2:])
    assert "failed: ['train_step', 'flex_vs_sdpa', 'packed_features', 'shapes', 'vllm_context_k_norm']" in stdout


def test_the_train_step_stops_its_timed_loop_at_its_share_of_the_budget():
    import argparse
    import time

    import gpu_check_parts as parts

    b = parts.build(parts.TINY, 8, torch.device("cpu"), True, None)
    args = argparse.Namespace(steps=10, warmup=1, rows=1, seq=256, docs_per_row=2, batches=3, compile="off")
    step = parts.run_train_step(b, args, torch.device("cpu"), 1e12, 1e12, deadline=time.perf_counter())
    # Past its deadline from the start: it keeps the minimum of timed steps and says it was cut.
    assert step["steps"] == parts.MIN_TIMED_STEPS and step["steps_requested"] == 10
    assert step["steps_cut_by_budget"] is True and step["phases"]["timed_steps"] == parts.MIN_TIMED_STEPS
    assert b.rows == 1 and b.layers_compiled is False  # what the shapes part is told
