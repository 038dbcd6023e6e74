"""The DFlash drafter: Qwen3 decoder layers whose keys/values also read the target's hidden states.

Per layer (x = block token states [B, Q, H], c = target_hidden [B, S, H]):
    q = q_norm(q_proj(input_layernorm(x)))                     queries from block tokens only
    k = k_norm(cat(k_proj(c), k_proj(input_layernorm(x))))     context keys first, then block keys
    v = cat(v_proj(c), v_proj(input_layernorm(x)))
    x = x + o_proj(attention(rope(q), rope(k), v, mask));  x = x + mlp(post_attention_layernorm(x))
where target_hidden = hidden_norm(fc(concatenated target layer outputs)) and does NOT pass through
input_layernorm. RoPE uses absolute document positions: context keys at their own positions, block slot k
at anchor position + k. The output is norm(x); logits come from the TARGET's LM head (the drafter has no
embedding or LM head of its own).

Parameter names are exactly those of the exported `model.safetensors` (layers.{i}.self_attn.q_proj.weight,
..., fc.weight, hidden_norm.weight, norm.weight), so export is `safetensors.torch.save_file(state_dict())`.
Layer math follows transformers' Qwen3 (RMSNorm in float32, rotate-half RoPE) so that serving engines
reproduce the trained drafter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_train.drafter.attention import DrafterMask, LayerMask, attend
from dflash_train.drafter.config import DrafterConfig

# transformers' Qwen3 initialiser: normal(0, initializer_range) for linear weights.
INITIALIZER_RANGE = 0.02


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, scale by the weight in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D] (broadcast over heads)."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE tables for integer positions, computed in float32."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        # Not persistent: it is derived from the config and must not appear in the exported weights.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> (cos, sin) [B, T, head_dim]."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class DrafterAttention(nn.Module):
    """Attention whose keys/values are [context from target_hidden; block tokens]."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_kv: tuple[torch.Tensor, torch.Tensor],
        mask: LayerMask,
    ) -> torch.Tensor:
        rows, q_len, _ = x.shape
        kv_len = context.shape[1] + q_len
        q = self.q_norm(self.q_proj(x).view(rows, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = torch.cat((self.k_proj(context), self.k_proj(x)), dim=1)
        k = self.k_norm(k.view(rows, kv_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = torch.cat((self.v_proj(context), self.v_proj(x)), dim=1)
        v = v.view(rows, kv_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # Under autocast the norms return float32 (float32 weights) while v stays bf16; flex attention
        # needs one dtype, so q and k follow v.
        q = apply_rope(q, *rope_q).to(v.dtype)
        k = apply_rope(k, *rope_kv).to(v.dtype)
        out = attend(q, k, v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(rows, q_len, self.num_heads * self.head_dim))


class DrafterMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """One pre-norm decoder layer; the context bypasses input_layernorm."""

    def __init__(self, cfg: DrafterConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_kv: tuple[torch.Tensor, torch.Tensor],
        mask: LayerMask,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, rope_q, rope_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter. `forward` maps embedded blocks + raw target features to final hidden states."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DrafterLayer(cfg, t) for t in cfg.layer_types)
        self.fc = nn.Linear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.gradient_checkpointing = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random init as transformers does for Qwen3: normal(0, 0.02) linears, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=INITIALIZER_RANGE)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each layer's activations in backward instead of keeping them (saves memory)."""
        self.gradient_checkpointing = enabled

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Concatenated target features [B, S, n*H_t] -> context states [B, S, H] (fc, hidden_norm)."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        target_hidden: torch.Tensor,
        context_positions: torch.Tensor,
        mask: DrafterMask,
    ) -> torch.Tensor:
        """Drafter pass over a step's blocks.

        block_embeds [B, Q, H]: target embeddings of [anchor, MASK, ...] per block (Q = N * block_size);
        block_positions [B, Q]: document positions p_j + k; target_hidden [B, S, n*H_t]: concatenated
        target layer outputs; context_positions [B, S]: document positions of the context; mask: the
        step's DrafterMask. Returns the normed final states [B, Q, H] (feed them to the target LM head).
        """
        cfg = self.config
        if target_hidden.shape[-1] != cfg.feature_size:
            raise ValueError(
                f"target_hidden has width {target_hidden.shape[-1]}, expected {cfg.feature_size}"
                f" ({cfg.num_target_features} layers x {cfg.target_hidden_size})"
            )
        context = self.project_context(target_hidden)
        rope_q = self.rotary(block_positions)
        rope_ctx = self.rotary(context_positions)
        rope_kv = (torch.cat((rope_ctx[0], rope_q[0]), dim=1), torch.cat((rope_ctx[1], rope_q[1]), dim=1))
        x = block_embeds
        for layer in self.layers:
            layer_mask = mask.for_layer(layer.layer_type)
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, context, rope_q, rope_kv, layer_mask, use_reentrant=False)
            else:
                x = layer(x, context, rope_q, rope_kv, layer_mask)
        return self.norm(x)
