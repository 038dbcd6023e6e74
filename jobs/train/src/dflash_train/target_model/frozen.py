"""The frozen target model inside the trainer: features of chosen layers, embedding and LM head.

`FrozenTarget` wraps a Hugging Face causal LM (eval mode, no gradients). Target features are taken with
forward hooks on the chosen decoder layers: layer id L is the output of decoder layer L, which equals
HF `output_hidden_states[L + 1]`. Unless the target's own predictions are wanted (`keep_output`), decoder
layers after the last chosen one are never needed, so they are dropped from the wrapped model at construction
(less memory, and the forward stops there). With `keep_output` every layer stays, and a hook on the final
norm keeps the target's last hidden states (`TargetPass.final_hidden`): through the LM head they are the
target's own next-token distribution, which the label-agreement check and the target-label objectives read.

Packed rows (several documents per row) must not attend across documents in the target either. Three ways:
- "mask": one forward per batch with position ids restarting per document and a block-diagonal causal
  mask handed to the model as a ready 4D mask per layer type (a float 0/-inf tensor for sdpa/eager, a
  flex BlockMask for flex_attention). transformers passes 4D masks through unchanged. Works for models
  whose layers are all full_attention / sliding_attention (Qwen3, Llama, Qwen2, ...).
- "varlen": for targets with linear-attention layers (Qwen3.5/3.6's Gated DeltaNet), whose recurrent and
  convolution states would flow across documents under any mask. The batch's non-padding tokens become one
  row of variable-length sequences: the linear-attention layers get the boundaries as transformers'
  `cu_seq_lens_q` / `seq_idx` kwargs, the attention layers the block-diagonal mask over that row (or the
  flash-attention varlen kwargs). One forward per batch, but only right on the fast kernels: transformers'
  PyTorch reference kernels drop those boundaries (see `dflash_train.target_model.linear_kernels`).
- "per_document": each document runs alone (slower, but right for any architecture and kernel).
`packing="auto"` picks "mask" when the layer types allow it, else "varlen" when the target has
linear-attention layers and the fast kernels are active, else "per_document".

The embedding and LM head are the target's own modules (tied or not, as the checkpoint says); the drafter
shares them frozen. Embeddings are never resized: a mask token id outside the table is an error.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask

from dflash_train.data.batch import PAD_DOCUMENT
from dflash_train.drafter.attention import additive_mask, document_causal_mask_mod, materialize
from dflash_train.drafter.config import check_target_layer_ids
from dflash_train.target_model.linear_kernels import KernelStatus, use_fla_conv

Packing = Literal["auto", "mask", "varlen", "per_document"]
FLA_PACKAGES = "flash-linear-attention (and causal-conv1d, or flash-linear-attention's Triton conv)"
ResolvedPacking = Literal["mask", "varlen", "per_document"]
LINEAR_ATTENTION = "linear_attention"
_MASKABLE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
_MASK_IMPLEMENTATIONS = frozenset({"sdpa", "eager", "flex_attention"})
# Attention implementations that read transformers' varlen kwargs (cu_seq_lens_q, ...) instead of a mask.
_VARLEN_KWARG_IMPLEMENTATIONS = frozenset({"flash_attention_2", "flash_attention_3"})
FINAL = -1  # the capture key of the final norm's output


def varlen_segments(document_ids: torch.Tensor) -> torch.Tensor:
    """Sequence index (0, 1, ...) of each non-padding token of `document_ids` [B, S], in row-major order.

    A sequence is one document of one row; padding (-1) belongs to none. A document split in two places of
    a row is an error (the masks of the other packings would join it again, a varlen forward would not).
    """
    rows, seq = document_ids.shape
    flat = document_ids.reshape(-1)
    row_of = torch.arange(rows, device=document_ids.device).repeat_interleave(seq)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = (flat[1:] != flat[:-1]) | (row_of[1:] != row_of[:-1])
    keep = flat != PAD_DOCUMENT
    runs = int((starts & keep).sum())
    pairs = torch.unique(row_of[keep] * (int(flat.max()) + 2) + flat[keep]).numel() if runs else 0
    if runs != pairs:
        raise ValueError("a document is not contiguous in its row: varlen packing needs one run per document")
    return (torch.cumsum(starts & keep, 0) - 1)[keep]


@dataclass(frozen=True)
class TargetPass:
    """One target forward: the chosen layers' outputs [B, S, n * H] and, when kept, the final norm's [B, S, H]."""

    features: torch.Tensor
    final_hidden: torch.Tensor | None


class FrozenTarget:
    """A frozen HF causal LM exposing `features`, `embed` and `lm_head` for drafter training."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], packing: Packing = "auto",
                 keep_output: bool = False) -> None:
        """Wrap `model` (modified in place: eval, frozen, layers after max(layer_ids) removed unless
        `keep_output`)."""
        self.model = model.eval().requires_grad_(False)
        self.config = model.config
        decoder = model.get_decoder()
        layers = decoder.layers
        self.num_layers = len(layers)
        self.layer_ids = [int(i) for i in layer_ids]
        if not self.layer_ids or len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer ids must be a non-empty list without repeats, got {self.layer_ids}")
        # The serving engine must capture every id: the last layer only on targets whose vLLM code records it.
        check_target_layer_ids(self.config, self.layer_ids, self.num_layers)
        self.keep_output = keep_output
        keep_layers = self.num_layers if keep_output else max(self.layer_ids) + 1
        decoder.layers = nn.ModuleList(list(layers)[:keep_layers])
        self._decoder = decoder
        self.hidden_size = int(self.config.hidden_size)
        self.layer_types = list(getattr(self.config, "layer_types", None) or ["full_attention"] * self.num_layers)
        self._kept_layer_types = sorted(set(self.layer_types[:keep_layers]))
        self.kernels = self._linear_attention_kernels(decoder.layers)
        self.packing = self._resolve_packing(packing)
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self._captured: dict[int, torch.Tensor] | None = None
        for layer_id in self.layer_ids:
            decoder.layers[layer_id].register_forward_hook(self._hook(layer_id))
        if keep_output:
            decoder.norm.register_forward_hook(self._hook(FINAL))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        layer_ids: Sequence[int],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        attn_implementation: str = "sdpa",
        packing: Packing = "auto",
        keep_output: bool = False,
    ) -> FrozenTarget:
        """Load a target checkpoint directory. dtype defaults to bf16 on CUDA and float32 elsewhere."""
        from transformers import AutoModelForCausalLM

        device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation=attn_implementation
        ).to(device)
        return cls(model, layer_ids, packing=packing, keep_output=keep_output)

    @property
    def has_linear_attention(self) -> bool:
        """Whether a kept layer is a linear-attention (recurrent) layer."""
        return LINEAR_ATTENTION in self._kept_layer_types

    def _linear_attention_kernels(self, layers: nn.ModuleList) -> KernelStatus | None:
        """Kernels of the linear-attention layers (None without any); fills in the Triton conv if it can."""
        if not self.has_linear_attention:
            return None
        modeling = sys.modules[type(layers[self.layer_types.index(LINEAR_ATTENTION)]).__module__]
        status = use_fla_conv(modeling)
        if status is None:
            raise ValueError(f"{modeling.__name__}: linear-attention layers of unknown kernels; use packing="
                             "'per_document'")
        return status

    def _resolve_packing(self, packing: Packing) -> ResolvedPacking:
        maskable = set(self._kept_layer_types) <= _MASKABLE_LAYER_TYPES and self.attn_implementation in (
            _MASK_IMPLEMENTATIONS
        )
        attention_ok = self.attn_implementation in _MASK_IMPLEMENTATIONS | _VARLEN_KWARG_IMPLEMENTATIONS
        others_ok = set(self._kept_layer_types) - {LINEAR_ATTENTION} <= _MASKABLE_LAYER_TYPES
        varlen = (self.kernels is not None and self.kernels.varlen and attention_ok and others_ok)
        if packing == "auto":
            return "mask" if maskable else "varlen" if varlen else "per_document"
        if packing == "mask" and not maskable:
            raise ValueError(
                f"packing='mask' needs layer types within {sorted(_MASKABLE_LAYER_TYPES)} and an attention"
                f" implementation in {sorted(_MASK_IMPLEMENTATIONS)}; this target has {self._kept_layer_types}"
                f" and {self.attn_implementation!r} (use packing='per_document')"
            )
        if packing == "varlen" and not varlen:
            if self.kernels is None:
                why = f"this target has no linear-attention layers ({self._kept_layer_types}): use packing='mask'"
            elif not self.kernels.varlen:
                why = (f"the linear-attention kernels are not both fast ({self.kernels.describe()}); transformers'"
                       " PyTorch reference kernels ignore the sequence boundaries of a packed batch, so documents"
                       f" would leak into each other: install {FLA_PACKAGES} or use packing='per_document'")
            else:
                why = (f"attention implementation {self.attn_implementation!r} or layer types"
                       f" {self._kept_layer_types} are not supported: use packing='per_document'")
            raise ValueError(f"packing='varlen' refused: {why}")
        if packing not in ("mask", "varlen", "per_document"):
            raise ValueError(f"unknown packing {packing!r}; expected auto, mask, varlen or per_document")
        return packing

    @property
    def attn_implementation(self) -> str:
        """The attention implementation the wrapped model runs with (sdpa, eager, flex_attention, ...)."""
        return str(getattr(self.config, "_attn_implementation", None) or "eager")

    @property
    def device(self) -> torch.device:
        """Device of the target weights."""
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the target weights."""
        return self.embed_tokens.weight.dtype

    @property
    def vocab_rows(self) -> int:
        """Rows of the input embedding table (>= tokenizer size)."""
        return int(self.embed_tokens.weight.shape[0])

    @property
    def feature_size(self) -> int:
        """Width of `features`: number of layer ids times the hidden size."""
        return len(self.layer_ids) * self.hidden_size

    def validate_token_id(self, token_id: int, what: str = "mask_token_id") -> None:
        """Raise unless `token_id` is an existing row of the embedding (the table is never resized)."""
        if not 0 <= token_id < self.vocab_rows:
            raise ValueError(
                f"{what} {token_id} is not a row of the target embedding (0..{self.vocab_rows - 1});"
                " pick an existing (e.g. reserved) token, embeddings are never resized"
            )

    def check_drafter_config(self, cfg: Any) -> None:
        """Raise if a DrafterConfig does not fit this target (layers, widths, mask token)."""
        problems = []
        if cfg.num_target_layers != self.num_layers:
            problems.append(f"num_target_layers {cfg.num_target_layers} != target's {self.num_layers}")
        if cfg.target_hidden_size != self.hidden_size:
            problems.append(f"target_hidden_size {cfg.target_hidden_size} != target's {self.hidden_size}")
        if list(cfg.target_layer_ids) != self.layer_ids:
            problems.append(f"target_layer_ids {list(cfg.target_layer_ids)} != hooked layers {self.layer_ids}")
        if problems:
            raise ValueError("drafter config does not match the target: " + "; ".join(problems))
        self.validate_token_id(cfg.mask_token_id)

    def _hook(self, layer_id: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            del module, args
            if self._captured is not None:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def _forward_captured(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: Any,
                          **kwargs: Any) -> TargetPass:
        self._captured = {}
        try:
            if isinstance(mask, dict) and len(mask) == 1:
                # One kind of layer: its mask alone. Every decoder takes a prepared 4D mask (or BlockMask, or none
                # for varlen flash attention) as it is; not all take a mapping by layer type (Qwen3-MoE's does not).
                mask = next(iter(mask.values()))
            self._decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False,
                          **kwargs)
            wanted = [*self.layer_ids, *([FINAL] if self.keep_output else [])]
            missing = [i for i in wanted if i not in self._captured]
            if missing:
                raise RuntimeError(f"forward hooks did not fire for target layers {missing}")
            return TargetPass(torch.cat([self._captured[i] for i in self.layer_ids], dim=-1),
                              self._captured.get(FINAL))
        finally:
            self._captured = None

    def _packed_masks(self, document_ids: torch.Tensor) -> dict[str, Any]:
        rows, seq = document_ids.shape
        masks: dict[str, Any] = {}
        for layer_type in self._kept_layer_types:
            if layer_type == LINEAR_ATTENTION:
                # Recurrent layers take no mask (their padding mask is 2D); varlen kwargs separate documents.
                masks[layer_type] = None
                continue
            if self.attn_implementation in _VARLEN_KWARG_IMPLEMENTATIONS:
                masks[layer_type] = None  # flash attention reads cu_seq_lens_q / cu_seq_lens_k
                continue
            window = getattr(self.config, "sliding_window", None) if layer_type == "sliding_attention" else None
            mod = document_causal_mask_mod(document_ids, window)
            if self.attn_implementation == "flex_attention":
                masks[layer_type] = create_block_mask(
                    mod, rows, None, seq, seq, device=document_ids.device, _compile=document_ids.device.type == "cuda"
                )
            else:
                masks[layer_type] = additive_mask(materialize(mod, rows, seq, seq, document_ids.device), self.dtype)
        return masks

    @torch.no_grad()
    def features(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Concatenated outputs of the chosen layers, [B, S, n * H], in the target dtype (see `forward`)."""
        return self.forward(input_ids, position_ids, document_ids).features

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
    ) -> TargetPass:
        """The chosen layers' outputs and (with `keep_output`) the final hidden states, in the target dtype.

        document_ids [B, S] (-1 = padding) makes the forward block-diagonal per document; without it each
        row is one causal sequence. Rows of padding slots are meaningless (never attended to or trained).
        """
        if document_ids is None:
            return self._forward_captured(input_ids, position_ids, None)
        if self.packing == "mask":
            return self._forward_captured(input_ids, position_ids, self._packed_masks(document_ids))
        if self.packing == "varlen":
            return self._features_varlen(input_ids, position_ids, document_ids)
        return self._features_per_document(input_ids, position_ids, document_ids)

    def _empty_pass(self, rows: int, seq: int, device: torch.device) -> TargetPass:
        features = torch.zeros(rows, seq, self.feature_size, dtype=self.dtype, device=device)
        final = torch.zeros(rows, seq, self.hidden_size, dtype=self.dtype, device=device) if self.keep_output else None
        return TargetPass(features, final)

    def _features_varlen(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor
    ) -> TargetPass:
        rows, seq = input_ids.shape
        keep = document_ids != PAD_DOCUMENT
        segments = varlen_segments(document_ids)
        cu_seqlens = torch.cat([segments.new_zeros(1), torch.bincount(segments).cumsum(0)])
        max_length = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        # Kwarg names and dtypes are transformers' (DataCollatorWithFlattening): cu_seq_lens_* int32 for
        # flash attention and the Gated DeltaNet delta rule, seq_idx int32 [1, T] for causal-conv1d.
        cu32 = cu_seqlens.to(torch.int32)
        varlen = {"cu_seq_lens_q": cu32, "cu_seq_lens_k": cu32, "max_length_q": max_length,
                  "max_length_k": max_length, "seq_idx": segments.to(torch.int32).unsqueeze(0)}
        flat = self._forward_captured(input_ids[keep].unsqueeze(0), position_ids[keep].unsqueeze(0),
                                      self._packed_masks(segments.unsqueeze(0)), **varlen)
        out = self._empty_pass(rows, seq, input_ids.device)
        out.features[keep] = flat.features[0]
        if out.final_hidden is not None and flat.final_hidden is not None:
            out.final_hidden[keep] = flat.final_hidden[0]
        return out

    def _features_per_document(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor
    ) -> TargetPass:
        rows, seq = input_ids.shape
        out = self._empty_pass(rows, seq, input_ids.device)
        for row in range(rows):
            docs = document_ids[row]
            for doc in torch.unique(docs[docs != PAD_DOCUMENT]).tolist():
                where = (docs == doc).nonzero().squeeze(-1)
                start, end = int(where[0]), int(where[-1]) + 1
                if end - start != where.numel():
                    raise ValueError(f"row {row}: document {doc} is not contiguous")
                part = self._forward_captured(
                    input_ids[row : row + 1, start:end], position_ids[row : row + 1, start:end], None
                )
                out.features[row, start:end] = part.features[0]
                if out.final_hidden is not None and part.final_hidden is not None:
                    out.final_hidden[row, start:end] = part.final_hidden[0]
        return out

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Target input embeddings of `ids` (frozen)."""
        return self.embed_tokens(ids)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H] weight of the target LM head (the embedding itself when tied)."""
        return self.lm_head.weight
