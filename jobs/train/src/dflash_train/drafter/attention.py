"""Block-sparse attention masks of DFlash training, with two backends built from one predicate.

Drafter attention of one row: queries are the N*B block tokens (block j = slots j*B .. j*B+B-1, anchored
at position p_j); keys/values are the S context tokens (target features) followed by the N*B block tokens.
A query in slot `off` of block j may see:
- context kv < p_j STRICTLY (the anchor's own target state is not available at inference either), of the
  anchor's document only (never another document of a packed row, never padding); on sliding-window
  layers only kv >= p_j + off - (W - 1);
- the tokens of its own block: all of them on full-attention layers, slots <= off on sliding layers;
- nothing of another block; and nothing at all when the block is not kept (padding anchor).

`drafter_mask_mod` is that predicate, written with broadcasting tensor ops only, so the same function
serves flex attention (vmapped over scalar indices into a BlockMask) and the SDPA path (evaluated once on
broadcast index grids into an explicit float mask: 0 allowed, -inf forbidden; boolean masks are not used
because some attention paths add them as numbers). Flex attention backward does not exist on CPU, so CPU
training uses SDPA; `tests/train/test_attention.py` checks that both give the same forward output.

Compiled shapes: static, a fixed few graphs per rung of the anchor ladder, chosen on purpose. Both paths
use `dynamic=False`: flex attention on its own (`compiled_flex_attention`, what eager drafter layers call on
CUDA) and the drafter layers when the trainer compiles them (`compile_drafter_layers`, where dynamo captures
the flex call into the layer's graph). Each distinct (query length N*B, key length S + N*B) compiles once
and is then found again by dynamo's guards; fresh anchors and masks of a known shape reuse it. Static,
not dynamic, because the ladder of `dflash_train.training.anchors` already bounds the shapes of a run (7 for block
16 and the 512-anchor cap), and a static graph gets flex kernels and tile counts specialised to its
length. Left to torch's default ("automatic dynamic"), the second distinct N would recompile the layer
with a symbolic query length and later N would reuse that one dynamic graph: a different kernel from the
first shape's, and not what this design measures. The layer type and the window enter the predicate as
tensors, not Python values, so full and sliding layers (and every layer of the drafter: dynamo inlines
the modules, their weights are graph inputs) share one graph per shape; a Python `if` on the window
would be specialised into a second graph. Without gradients (evaluation) that is one graph per shape for
all layers. In training it is two: the first layer's input, the frozen target's embeddings, needs no
gradient and the later layers' inputs do, and dynamo guards on `requires_grad` (making the embeddings
require a gradient would buy one graph with a wasted input-gradient matmul per step). So a ladder of n
rungs makes at most 3n graphs of the layer code. Past dynamo's recompile limit (cache entries per code
object; torch's default is 8) the layer would run eagerly and flex would fall back to an unfused kernel that
materialises the full score matrix (~12 GB per layer at 512 anchors), so `raise_recompile_limit` sets the
limit BEFORE anything is compiled: set inside a traced call, the assignment becomes a guard of the first
graph and the next layer recompiles. On CPU flex runs eagerly (a forward check) unless inside
`compiled_flex_on_cpu`, which tests and benchmarks use to count compilations;
`tests/train/test_compile_shapes.py` counts the graphs of compiled drafter layers while N cycles over
three rungs, with and without gradients.

`document_causal_mask_mod` is the target model's mask for packed rows: causal, same document only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Backend = Literal["flex", "sdpa"]

# Room for every rung of the anchor ladder (m * 2^k up to the cap: 16 rungs reach a cap of 2^15 * m
# anchors); torch's default of 8 would be one rung short for a cap above 1024 at block 16.
FLEX_RECOMPILE_LIMIT = 16
# Graphs of the compiled layer code per shape (see the module docstring): in training one for the first
# layer (input without gradient) and one for the others, in evaluation (no_grad) one for all layers.
GRAPHS_PER_SHAPE = 3


def drafter_mask_mod(
    anchor_pos: torch.Tensor,
    keep: torch.Tensor,
    document_ids: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
) -> MaskMod:
    """The DFlash mask predicate (see the module docstring) for anchors [B, N] over a [B, S] row."""
    seq = int(document_ids.shape[1])
    doc = document_ids.long()
    device = document_ids.device
    # Tensors, not Python constants: the compiled kernel then does not specialise on the layer type (see
    # the module docstring). A full-attention layer is a window that never binds (anchor + off < S + B).
    window = torch.tensor(seq + block_size if sliding_window is None else sliding_window, device=device)
    causal_in_block = torch.tensor(sliding_window is not None, device=device)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        del h  # the same pattern for every head
        block = q_idx // block_size
        off = q_idx % block_size
        anchor = anchor_pos[b, block]
        is_ctx = kv_idx < seq
        ctx = kv_idx.clamp(max=seq - 1)  # block keys index past S; clamp keeps the gather in range
        ctx_ok = is_ctx & (ctx < anchor) & (doc[b, ctx] == doc[b, anchor]) & (ctx >= anchor + off - (window - 1))
        in_block = kv_idx - seq
        blk_ok = (~is_ctx) & (in_block // block_size == block) & ((in_block % block_size <= off) | ~causal_in_block)
        return keep[b, block] & (ctx_ok | blk_ok)

    return mask_mod


def document_causal_mask_mod(document_ids: torch.Tensor, sliding_window: int | None = None) -> MaskMod:
    """Target mask of packed rows: causal within a document (optionally windowed), plus the diagonal.

    The diagonal keeps every query with at least one key (padding attends to itself), so no softmax row
    is empty and no NaN can reach the features.
    """
    doc = document_ids.long()

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        del h
        allowed = (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)
        if sliding_window is not None:
            allowed = allowed & (kv_idx > q_idx - sliding_window)
        return allowed | (kv_idx == q_idx)

    return mask_mod


def materialize(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate `mask_mod` on broadcast index grids: bool [batch, 1, q_len, kv_len], True = allowed."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return mask_mod(b, h, q, kv).expand(batch, 1, q_len, kv_len)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float mask for SDPA/eager attention: 0 where allowed, -inf where not."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.tensor(float("-inf"), dtype=dtype, device=allowed.device))


@dataclass(frozen=True)
class SdpaMask:
    """Explicit float mask [B, 1, Q, KV] plus which query rows see at least one key [B, 1, Q, 1].

    Rows with no allowed key (padding blocks) would make softmax NaN; they are opened to every key
    instead and their output is zeroed afterwards, which matches flex attention's output of 0.
    """

    bias: torch.Tensor
    row_has_key: torch.Tensor


LayerMask = BlockMask | SdpaMask


@dataclass(frozen=True)
class DrafterMask:
    """The per-step drafter masks, one per layer type present in the drafter."""

    backend: Backend
    by_layer_type: dict[str, LayerMask]

    def for_layer(self, layer_type: str) -> LayerMask:
        """Mask of a layer of `layer_type` (full_attention or sliding_attention)."""
        try:
            return self.by_layer_type[layer_type]
        except KeyError:
            raise KeyError(f"no mask built for layer type {layer_type!r}; have {sorted(self.by_layer_type)}") from None


def resolve_backend(requested: str, device: torch.device) -> Backend:
    """`auto` means flex on CUDA (sparse, fast) and SDPA elsewhere (flex has no CPU backward)."""
    if requested == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if requested not in ("flex", "sdpa"):
        raise ValueError(f"unknown attention backend {requested!r}; expected auto, flex or sdpa")
    return requested  # type: ignore[return-value]


def build_drafter_mask(
    anchor_pos: torch.Tensor,
    keep: torch.Tensor,
    document_ids: torch.Tensor,
    block_size: int,
    layer_types: list[str] | tuple[str, ...],
    sliding_window: int | None,
    backend: Backend,
    dtype: torch.dtype = torch.float32,
) -> DrafterMask:
    """Build the masks of one step for every layer type in `layer_types` with the chosen backend.

    `dtype` is the dtype of the SDPA float mask (the attention compute dtype).
    """
    rows, n_anchors = anchor_pos.shape
    seq = int(document_ids.shape[1])
    q_len = n_anchors * block_size
    kv_len = seq + q_len
    device = anchor_pos.device
    masks: dict[str, LayerMask] = {}
    for layer_type in sorted(set(layer_types)):
        window = sliding_window if layer_type == "sliding_attention" else None
        mod = drafter_mask_mod(anchor_pos, keep, document_ids, block_size, window)
        if backend == "flex":
            masks[layer_type] = create_block_mask(
                mod, rows, None, q_len, kv_len, device=device, _compile=device.type == "cuda"
            )
        else:
            allowed = materialize(mod, rows, q_len, kv_len, device)
            row_has_key = allowed.any(dim=-1, keepdim=True)
            masks[layer_type] = SdpaMask(additive_mask(allowed | ~row_has_key, dtype), row_has_key)
    return DrafterMask(backend, masks)


_compiled_flex: Callable[..., torch.Tensor] | None = None
_compile_on_cpu = False


@contextmanager
def compiled_flex_on_cpu() -> Iterator[None]:
    """Inside this block `attend` runs flex attention compiled on CPU too, as it always does on CUDA.

    For tests and benchmarks that count compilations on a CPU machine (the compiled forward works on
    CPU; its backward does not exist there). Outside it, CPU flex stays eager: a forward check that
    needs no compile time.
    """
    global _compile_on_cpu
    before, _compile_on_cpu = _compile_on_cpu, True
    try:
        yield
    finally:
        _compile_on_cpu = before


def raise_recompile_limit(shapes: int = 0) -> int:
    """Set dynamo's recompile limit to hold `shapes` static shapes (and the ladder's); returns the limit.

    Call it before compiling, never from inside a compiled function (see the module docstring). It only
    raises the limit: a larger value set by the caller stays.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("raise_recompile_limit inside a traced call would become a guard of its graph")
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, FLEX_RECOMPILE_LIMIT,
                                        GRAPHS_PER_SHAPE * shapes)
    return int(dynamo_config.recompile_limit)


def compile_drafter_layers(layers: Iterable[torch.nn.Module], shapes: int = 0) -> int:
    """torch.compile each drafter layer with static shapes; `shapes` is the run's ladder length.

    One graph per (query, key) length, shared by every layer (see the module docstring). The recompile
    limit is raised first, outside any traced call. Returns the limit in force.
    """
    limit = raise_recompile_limit(shapes)
    for layer in layers:
        layer.compile(dynamic=False)
    return limit


def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """The process's one compiled flex attention (static shapes: one kernel per shape of the ladder)."""
    # Uncompiled flex attention materialises the scores; on CUDA the compiled kernel is the point of it.
    global _compiled_flex
    if _compiled_flex is None:
        raise_recompile_limit()
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: LayerMask, scale: float) -> torch.Tensor:
    """Masked attention: q [B, Hq, Q, D], k/v [B, Hkv, KV, D] (GQA when Hq > Hkv) -> [B, Hq, Q, D]."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        if torch.compiler.is_compiling():
            # Inside a compiled drafter layer dynamo captures flex attention into the layer's own graph;
            # going through the compiled wrapper here would trace its one-time setup into that graph.
            fn = flex_attention
        elif q.device.type == "cuda" or _compile_on_cpu:
            fn = compiled_flex_attention()
        else:
            fn = flex_attention
        return fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.bias.to(q.dtype), scale=scale, enable_gqa=gqa)
    return out * mask.row_has_key.to(out.dtype)
