"""Train preflight: the kernels check names each fast kernel and warns when a GPU run would do without."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

from dflash_shared.preflight import CheckWarning
from dflash_shared.settings import parse_settings
from dflash_shared.storage import ObjectStore
from dflash_train.checks import build_preflight, kernels_check
from dflash_train.config import TrainConfig
from tests.support.tiny_target import build_tiny_qwen3_6

FAST = importlib.util.find_spec("fla") is not None


def _config(target: Path, device: str, tmp_path: Path) -> TrainConfig:
    return parse_settings(TrainConfig, ["--preset", "debug", "--input", str(tmp_path / "in"), "--output",
                                        str(tmp_path / "out"), "--target", str(target), "--device", device])


def test_dense_target_needs_no_linear_attention_kernels(tiny_target_dir: Path, tmp_path: Path):
    detail = _kernels(_config(tiny_target_dir, "cuda", tmp_path))
    assert "flash-linear-attention" in detail and "causal-conv1d" in detail
    assert "not needed: the target (qwen3) has no linear-attention layers" in detail


@pytest.mark.skipif(FAST, reason="flash-linear-attention is installed: the reference-kernel lines do not apply")
def test_hybrid_target_on_the_reference_kernels_is_info_on_cpu_and_a_warning_on_gpu(tmp_path: Path):
    target = build_tiny_qwen3_6()
    cpu = _kernels(_config(target, "cpu", tmp_path))
    assert "flash-linear-attention not installed, causal-conv1d not installed" in cpu
    assert "hybrid target (qwen3_5_text, 6 linear-attention layers)" in cpu
    assert "gated delta rule: PyTorch reference" in cpu and "causal conv1d: PyTorch reference" in cpu
    assert cpu.endswith("packed rows run per_document (one forward per document) (CPU run: the fast kernels are"
                        " GPU kernels)")
    with pytest.raises(CheckWarning, match="on a GPU is an order of magnitude slower: install flash-linear"):
        _kernels(_config(target, "cuda", tmp_path))


@pytest.mark.skipif(FAST, reason="flash-linear-attention is installed: the reference-kernel lines do not apply")
def test_train_preflight_logs_the_warning_and_still_passes_it(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    checks = build_preflight(_config(build_tiny_qwen3_6(), "cuda", tmp_path))
    with caplog.at_level(logging.INFO, logger="dflash.preflight"):
        checks.run()
    kernels = [r for r in checks.results if r.name == "kernels"]
    assert kernels and kernels[0].ok and kernels[0].warning
    assert any(r.levelno == logging.WARNING and "preflight train WARN kernels:" in r.getMessage()
               for r in caplog.records)


def _kernels(config: TrainConfig) -> str:
    return kernels_check(config.runtime, config.target, ObjectStore())
