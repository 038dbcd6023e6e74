"""Model FLOPs of one DFlash training step, term by term, and the peak they are divided by (for gpu_check).

Every term counts 2 FLOP per multiply-add and only useful work (no padding tokens, no padding blocks,
no masked-out attention pairs, no recomputation):
- target forward: 2 * P * T over the kept decoder layers (P = their parameters, T = non-padding tokens),
  plus causal attention in the full-attention layers (4 * heads * head_dim per allowed (query, key) pair,
  L(L+1)/2 pairs per document of L tokens) and the Gated DeltaNet recurrence in the linear-attention
  layers (6 * dk * dv per token per value head: state read, delta and update of the dk x dv state);
- drafter forward + backward: 3 x forward = 6 * P * T, where each weight meets its own tokens (q, o and
  MLP the kept block tokens; k and v the kept block tokens and the context tokens; fc the context tokens),
  plus attention over the pairs the step's block-sparse mask allows (4 * heads * head_dim per pair, x3
  with backward). fc is counted x2 (forward + weight gradient): its input, the frozen target's features,
  needs no gradient;
- LM head: 2 * V * H per trained slot for the logits plus 2 * V * H for the hidden-state gradient (the
  project's chunked loss computes it in the forward pass). The head is the target's and frozen, so no
  weight gradient: x2, not the x3 of a trained layer.
"""

from __future__ import annotations

import time
from typing import Any

import torch

# NVIDIA H200 (SXM) datasheet: BF16 Tensor Core 1,979 TFLOPS "with sparsity", i.e. 989 TFLOPS dense (the
# same figure as the H100 SXM). KINDS.md-style measurements of a large bf16 matmul on an H200 land near
# 790 TFLOP/s; the script reports that ratio too (mfu_vs_measured_matmul).
H200_BF16_DENSE = 989e12
PEAKS = {"H200": (H200_BF16_DENSE, "NVIDIA H200 datasheet: bf16 dense 989 TFLOP/s (1,979 with sparsity)")}


def datasheet_peak(device_name: str) -> tuple[float, str] | None:
    """(FLOP/s, source) of the device's bf16 dense peak, None when the name is not in `PEAKS`."""
    return next((v for k, v in PEAKS.items() if k in device_name), None)


def measured_matmul_flops(device: torch.device) -> dict[str, float]:
    """Measured matmul rate per dtype on `device`: the practical ceiling on a GPU, the peak on a CPU.

    Random inputs (zeros run faster than real data on some GPUs); the fastest of the timed repeats after warm-up:
    a peak, which a step's own matmuls must not beat (a CPU's 512-wide median was beaten by the tiny step's
    LM head, MFU 100.6%, on a busy machine). On CUDA FLOP per second of wall time; on a CPU FLOP per second of
    this process's CPU time (all its threads), so that a machine shared with other work does not distort the
    ratio (see `clock`).
    """
    n = 8192 if device.type == "cuda" else 1024
    dtypes = [torch.bfloat16] if device.type == "cuda" else [torch.float32, torch.bfloat16]
    out: dict[str, float] = {}
    for dtype in dtypes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        times = []
        for i in range(13 if device.type == "cuda" else 5):
            start = clock(device)
            a @ b
            if i >= 2:
                times.append(clock(device) - start)
        out[str(dtype).removeprefix("torch.")] = 2 * n**3 / max(min(times), 1e-9)
    return out


def clock(device: torch.device) -> float:
    """Seconds: wall time after a device sync on CUDA, this process's CPU time on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def allowed_pairs(mask: Any, rows: int, q_len: int, kv_len: int, chunk: int = 1024) -> tuple[int, int]:
    """(allowed (query, key) pairs, query tokens with at least one key) of one layer's drafter mask.

    Works for both backends of dflash_train.drafter.attention: an SDPA mask is read as built; a flex BlockMask is
    evaluated through its own mask_mod, a chunk of queries at a time (the dense mask of a 4k-token row of
    512 blocks would be ~0.7 GB of booleans per layer type).
    """
    bias = getattr(mask, "bias", None)
    if bias is not None:
        allowed = (bias == 0) & mask.row_has_key
        return int(allowed.sum()), int(mask.row_has_key.sum())
    block_mask = getattr(mask, "block_mask", mask)  # dflash_train.drafter.attention.FlexMask wraps the BlockMask
    mod = block_mask.mask_mod
    device = block_mask.kv_num_blocks.device
    b = torch.arange(rows, device=device).view(rows, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    pairs = kept = 0
    for start in range(0, q_len, chunk):
        q = torch.arange(start, min(start + chunk, q_len), device=device).view(1, 1, -1, 1)
        allowed = mod(b, h, q, kv).expand(rows, 1, q.shape[2], kv_len)
        pairs += int(allowed.sum())
        kept += int(allowed.any(dim=-1).sum())
    return pairs, kept


def target_flops(target: Any, input_ids: torch.Tensor, document_ids: torch.Tensor,
                 layer_kinds: list[str] | None = None) -> dict[str, float]:
    """Target forward terms (see the module docstring) for one packed batch of a FrozenTarget.

    `layer_kinds` counts another depth of the same layers (the full 64-layer target when the check keeps
    a few): each kind's parameters are read from a kept layer of that kind; None means the kept layers.
    """
    cfg = target.config
    layers = target.model.get_decoder().layers  # the kept ones: FrozenTarget drops the rest
    kept = target.layer_types[: len(layers)]
    kinds = list(kept if layer_kinds is None else layer_kinds)
    # Every layer of a kind has one size, so the kept layers give each kind's parameter count.
    size = {kind: sum(p.numel() for p in layer.parameters()) for kind, layer in zip(kept, layers, strict=True)}
    if unknown := set(kinds) - set(size):
        raise ValueError(f"no kept layer of kind(s) {sorted(unknown)} to count parameters from")
    params = sum(size[kind] for kind in kinds)
    tokens = int((document_ids >= 0).sum())
    causal_pairs = 0
    for row in document_ids.cpu():
        counts = torch.bincount(row[row >= 0].long())
        causal_pairs += int((counts * (counts + 1) // 2).sum())
    full = kinds.count("full_attention") + kinds.count("sliding_attention")
    linear = kinds.count("linear_attention")
    attention = 4 * cfg.num_attention_heads * cfg.head_dim * causal_pairs * full
    recurrence = 0
    if linear:
        dk, dv, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
        recurrence = 6 * dk * dv * hv * tokens * linear
    return {"target_matmul": 2.0 * params * tokens, "target_attention": float(attention),
            "target_linear_recurrence": float(recurrence)}


def drafter_flops(cfg: Any, context_tokens: int, kept_query_tokens: int, pairs_per_layer: list[int],
                  ) -> dict[str, float]:
    """Drafter forward + backward terms (see the module docstring)."""
    h, hq, hkv, d, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                            cfg.intermediate_size)
    per_query = h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * inter  # q, k, v, o, gate/up/down
    per_context = 2 * h * hkv * d  # k, v of the target features
    layers = cfg.num_layers
    matmul = 2 * layers * (per_query * kept_query_tokens + per_context * context_tokens)
    attention = 4 * hq * d * sum(pairs_per_layer)
    fc = 2 * cfg.feature_size * h * context_tokens
    return {"drafter_matmul": 3.0 * matmul, "drafter_attention": 3.0 * attention, "drafter_fc": 2.0 * fc}


def lm_head_flops(vocab: int, hidden: int, trained_slots: int) -> dict[str, float]:
    """Logits plus the hidden-state gradient of the frozen LM head over the trained slots."""
    return {"lm_head": 4.0 * vocab * hidden * trained_slots}


# Which FLOP terms each timed phase of the step does (gpu_check_phases): the drafter's forward is a third
# of its forward + backward, fc's half (no input gradient); the chunked loss does the LM head's logits and
# hidden gradient in its forward, so backward holds the drafter's share only.
PHASE_TERMS = {
    "target_features": {"target_matmul": 1.0, "target_attention": 1.0, "target_linear_recurrence": 1.0},
    "drafter_forward": {"drafter_matmul": 1 / 3, "drafter_attention": 1 / 3, "drafter_fc": 1 / 2},
    "loss": {"lm_head": 1.0},
    "backward": {"drafter_matmul": 2 / 3, "drafter_attention": 2 / 3, "drafter_fc": 1 / 2},
}

FORMULAS = {
    "target_matmul": "2 * P_kept_layers * T (non-padding tokens)",
    "target_attention": "4 * heads * head_dim * sum_docs L(L+1)/2, per full-attention layer",
    "target_linear_recurrence": "6 * dk * dv * value_heads * T, per Gated DeltaNet layer",
    "drafter_matmul": "3 x 2 * (P_q,k,v,o,mlp * kept block tokens + P_k,v * context tokens) per layer",
    "drafter_attention": "3 x 4 * heads * head_dim * allowed (query, key) pairs of the block-sparse mask",
    "drafter_fc": "2 x 2 * (n_features * H) * H * context tokens (forward + weight gradient)",
    "lm_head": "2 x 2 * V * H * trained slots (logits + hidden gradient; frozen head, no weight gradient)",
}
