"""Shape and training-rule configuration of a DFlash drafter (`DrafterConfig`), with presets.

The drafter is a small stack of Qwen3 decoder layers that reads hidden states of chosen target layers and
drafts a block of `block_size` tokens in one pass. Its hidden size must equal the target's (it shares the
target's frozen embedding and LM head); its attention shape is its own.

Layer ids follow the convention of the exported `dflash_config.target_layer_ids`: id L is the OUTPUT of
target decoder layer L, i.e. Hugging Face `output_hidden_states[L + 1]` (vLLM and SGLang add the 1
themselves). The last decoder layer (N - 1) is not allowed: HF returns it after the final norm and the
serving engines never capture it.

No torch import here: the config is read by tooling that does not need a tensor library.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LayerType = Literal["full_attention", "sliding_attention"]
AttentionBackend = Literal["auto", "flex", "sdpa"]

# Position-decay constants of the reference trainers, keyed by block size.
_DEFAULT_GAMMA = {16: 7.0, 8: 4.0}
# First unused embedding row of the Qwen2/2.5/3 vocabulary (151,669 tokens in 151,936 rows); the
# reference Qwen3 drafters use it as the mask token.
QWEN3_MASK_TOKEN_ID = 151669
# The reference Qwen3.6-27B drafter's mask token: <|audio_start|>, a control token a text model never emits
# (the Qwen3.5/3.6 tokenizer fills ids up to 248,076 of the 248,320 rows).
QWEN3_6_MASK_TOKEN_ID = 248070
QWEN3_6_VOCAB_ROWS = 248320

# The drafter the reference trainers pair with Qwen3.5/3.6 (hybrid) targets: its attention shape is not the
# target's (24 query / 4 KV heads of 256 with partial rotary in Qwen3.6-27B) but a plain Qwen3 one, with four
# sliding-window layers before one full-attention layer.
QWEN3_6_DRAFTER: dict[str, Any] = {
    "num_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "sliding_window": 2048,
}


def is_hybrid_family(target_config: Any) -> bool:
    """Whether a HF (text) config is a Qwen3.5/3.6-style hybrid: linear-attention layers beside full attention."""
    layer_types = getattr(target_config, "layer_types", None) or []
    model_type = str(getattr(target_config, "model_type", ""))
    return "linear_attention" in layer_types or model_type.startswith("qwen3_5")


def default_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """Spread `n` feature layers over a target of `num_target_layers` decoder layers.

    Formula of the reference drafters: round(1 + i * (N - 4) / (n - 1)) for i in 0..n-1 (one layer: [1]).
    Small targets can make it repeat an id; that is an error (pass explicit ids instead).
    """
    if n < 1:
        raise ValueError(f"need at least one target layer, got n={n}")
    if num_target_layers < 3:
        raise ValueError(f"target has {num_target_layers} layers; the layer formula needs at least 3")
    if n == 1:
        ids = [1]
    else:
        # Python's round() rounds halves to even; the reference uses the same builtin.
        ids = [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"default_target_layer_ids({num_target_layers}, {n}) repeats a layer: {ids}; pass explicit ids"
        )
    return ids


class DrafterConfig(BaseModel):
    """Everything that shapes the drafter and its training rules (block size, anchors, loss decay)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: int = Field(5, ge=1, description="Number of drafter decoder layers.")
    hidden_size: int = Field(..., ge=1, description="Drafter hidden size; must equal the target's hidden size.")
    num_attention_heads: int = Field(..., ge=1, description="Query heads per drafter layer.")
    num_key_value_heads: int = Field(..., ge=1, description="Key/value heads per drafter layer (GQA).")
    head_dim: int = Field(..., ge=2, description="Width of one attention head (even, for RoPE).")
    intermediate_size: int = Field(..., ge=1, description="SwiGLU MLP inner width.")
    rms_norm_eps: float = Field(1e-6, gt=0, description="Epsilon of every RMSNorm.")
    rope_theta: float = Field(1_000_000.0, gt=0, description="RoPE base frequency.")
    max_position: int = Field(40960, ge=1, description="max_position_embeddings written to the export config.")
    block_size: int = Field(16, ge=2, description="Tokens per drafted block: the anchor plus block_size-1 masks.")
    num_target_layers: int = Field(..., ge=3, description="Decoder layers of the target model (N).")
    target_layer_ids: list[int] = Field(
        ...,
        min_length=1,
        description="Target layers whose outputs feed the drafter; id L = HF output_hidden_states[L+1].",
    )
    target_hidden_size: int = Field(..., ge=1, description="Hidden size of the target model.")
    mask_token_id: int = Field(..., ge=0, description="Token id of the block's mask slots; an existing target row.")
    layer_types: list[LayerType] = Field(
        default_factory=list,
        description="Attention kind per drafter layer; empty means all full_attention.",
    )
    sliding_window: int | None = Field(
        None, ge=1, description="Window (tokens) of sliding_attention layers; required if any layer slides."
    )
    num_anchors: int = Field(
        512, ge=1, description="Anchors (blocks) sampled per document of a packed row, before the per-row cap."
    )
    max_anchors_per_row: int = Field(
        512,
        ge=1,
        description="Cap on anchors (blocks) per packed row after the per-document draw, shared fairly across"
        " the row's documents (round-robin); 512 is the SpecForge recipe.",
    )
    loss_decay_gamma: float = Field(
        ..., gt=0, description="Loss decay exp(-(k-1)/gamma) over block slot k; default 7 for B=16, 4 for B=8."
    )
    feature_noise_std: float = Field(
        0.0, ge=0, description="Std of uniform noise added to target features in training (0 = off)."
    )
    attention_backend: AttentionBackend = Field(
        "auto", description="Drafter attention: flex (BlockMask), sdpa (float mask), auto = flex on CUDA."
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            if data.get("loss_decay_gamma") is None:
                block = int(data.get("block_size", 16))
                if block not in _DEFAULT_GAMMA:
                    raise ValueError(f"no default loss_decay_gamma for block_size={block}; set it explicitly")
                data["loss_decay_gamma"] = _DEFAULT_GAMMA[block]
            if not data.get("layer_types"):
                data["layer_types"] = ["full_attention"] * int(data.get("num_layers", 5))
        return data

    @model_validator(mode="after")
    def _check(self) -> DrafterConfig:
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"hidden_size {self.hidden_size} != target_hidden_size {self.target_hidden_size}: the drafter"
                " uses the target's embedding and LM head"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of"
                f" num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids repeats a layer: {self.target_layer_ids}")
        if list(self.target_layer_ids) != sorted(self.target_layer_ids):
            # Engines concatenate the captured states in layer order: another order would feed `fc` permuted
            # features at serving time, and acceptance would collapse without an error.
            raise ValueError(
                f"target_layer_ids must be strictly increasing (engines concatenate the captured layers in"
                f" layer order), got {self.target_layer_ids}; use {sorted(self.target_layer_ids)}"
            )
        last_allowed = self.num_target_layers - 2
        for layer_id in self.target_layer_ids:
            if not 0 <= layer_id <= last_allowed:
                raise ValueError(
                    f"target layer id {layer_id} outside 0..{last_allowed} for a {self.num_target_layers}-layer"
                    " target (the last layer's output is not captured by serving engines)"
                )
        return self

    @property
    def num_target_features(self) -> int:
        """How many target layers feed the drafter (n)."""
        return len(self.target_layer_ids)

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features: n * target hidden size (fc's input)."""
        return self.num_target_features * self.target_hidden_size

    @property
    def uses_sliding_window(self) -> bool:
        """Whether any drafter layer is a sliding-window layer."""
        return "sliding_attention" in self.layer_types

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        mask_token_id: int,
        num_layers: int = 5,
        num_target_features: int = 5,
        target_layer_ids: list[int] | None = None,
        **overrides: Any,
    ) -> DrafterConfig:
        """Preset for a Hugging Face (text) target config.

        Dense targets: the drafter copies the target's layer shape, as the reference Qwen3 drafters do (e.g.
        Qwen3-8B: 4096 hidden, 32/8 heads, 128 head_dim, 12288 intermediate). Qwen3.5/3.6 hybrid targets: the
        reference drafter shape (`QWEN3_6_DRAFTER`: 32/8 heads of 128, 4 sliding-window layers of 2048 + 1
        full) at the target's hidden and intermediate size; for Qwen3.6-27B that is the published drafter
        (hidden 5120, intermediate 17408, target layers [1, 16, 31, 46, 61], mask token 248070). `overrides`
        replace any field (e.g. layer_types, sliding_window, block_size).
        """
        num_target_layers = int(target_config.num_hidden_layers)
        hidden = int(target_config.hidden_size)
        heads = int(target_config.num_attention_heads)
        values: dict[str, Any] = {
            "num_layers": num_layers,
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(target_config, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(target_config, "head_dim", None) or hidden // heads),
            "intermediate_size": int(target_config.intermediate_size),
            "rms_norm_eps": float(getattr(target_config, "rms_norm_eps", 1e-6)),
            "rope_theta": _rope_theta(target_config),
            "max_position": int(getattr(target_config, "max_position_embeddings", 40960)),
            "num_target_layers": num_target_layers,
            "target_layer_ids": target_layer_ids
            or default_target_layer_ids(num_target_layers, num_target_features),
            "target_hidden_size": hidden,
            "mask_token_id": mask_token_id,
        }
        if is_hybrid_family(target_config):
            values.update(QWEN3_6_DRAFTER)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def debug(cls, **overrides: Any) -> DrafterConfig:
        """Preset matching the tiny 4-layer test target (hidden 128, 2/1 heads of 64): runs on CPU in seconds."""
        values: dict[str, Any] = {
            "num_layers": 2,
            "hidden_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "intermediate_size": 256,
            "max_position": 2048,
            "block_size": 8,
            "num_target_layers": 4,
            "target_layer_ids": [1, 2],
            "target_hidden_size": 128,
            "mask_token_id": QWEN3_MASK_TOKEN_ID,
            "num_anchors": 16,
            "attention_backend": "sdpa",
        }
        values.update(overrides)
        return cls(**values)


def _rope_theta(target_config: Any) -> float:
    """RoPE base of a HF config: transformers 5 keeps it in rope_parameters, older versions at the top."""
    params = getattr(target_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(target_config, "rope_theta", None)
    return float(theta) if theta is not None else 1_000_000.0
