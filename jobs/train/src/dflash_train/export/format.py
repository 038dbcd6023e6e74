"""The export format: what serving engines load, described without torch (files.py writes and reads it).

z-lab native format (what vLLM's and SGLang's `dflash` method load): a directory with
- `config.json`: a Qwen3 config of the DRAFTER (its own layer count, heads, widths, RoPE) plus
  `architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers`,
  `dflash_config: {mask_token_id, target_layer_ids}`, `layer_types`, `sliding_window` and
  `use_sliding_window`;
- `model.safetensors`: the drafter's own weights only (`layers.*`, `fc.weight`, `hidden_norm.weight`,
  `norm.weight`); the embedding and LM head are the target's and are never shipped.

`dflash_config.target_layer_ids` keeps this project's convention (id L = output of decoder layer L =
HF `output_hidden_states[L + 1]`); the engines add the 1 themselves. The optional speculators format
(`export_speculators_config`) instead names the captured state, `aux_hidden_state_layer_ids = L + 1`,
which vLLM turns back into L.

Attention per layer (`trained_layer_attention`): training masks a sliding-window layer causally inside
the block and a full-attention layer bidirectionally. The native format says so through `layer_types`
alone (vLLM and SGLang derive causality from each layer's type). The speculators format has one flag for
every layer, `sliding_window_non_causal`, so it can only carry a drafter whose layers are all of one kind;
a mixed drafter is refused (serve its native export). docs/serving-formats.md has the engines' code paths.

Everything here is plain data: config dicts, weight names and the per-layer attention; no torch import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from dflash_shared.errors import BadInputError
from dflash_train.drafter.config import DrafterConfig

CONFIG_NAME = "config.json"


# The drafter rotates every dimension of each head (see model.RotaryEmbedding).
FULL_ROTARY = 1.0


WEIGHTS_NAME = "model.safetensors"


ARCHITECTURE = "DFlashDraftModel"


# Per-layer weight names of the export, in the order the engines' loaders list them.
LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


TOP_WEIGHTS = ("fc.weight", "hidden_norm.weight", "norm.weight")



class ExportError(BadInputError):
    """An export directory (or the drafter being exported) is not in the expected format."""


class LayerAttention(NamedTuple):
    """How one drafter layer attends: `window` in tokens (the query's own included; None = no window) and
    whether the block is `causal` inside (slot k sees slots <= k) or bidirectional.

    A plain tuple too, so it compares equal to what the engines resolve per layer (vLLM's
    `_resolve_layer_attention` returns `(sliding_window, causal)`).
    """

    window: int | None
    causal: bool


def trained_layer_attention(cfg: DrafterConfig) -> list[LayerAttention]:
    """Per drafter layer, the attention training masks it with (`attention.build_drafter_mask`).

    A sliding_attention layer sees `sliding_window` tokens and its block causally; a full_attention layer
    sees the whole context and its whole block. An export must make the engines resolve exactly this.
    """
    return [LayerAttention(cfg.sliding_window, True) if kind == "sliding_attention" else LayerAttention(None, False)
            for kind in cfg.layer_types]


def expected_weight_names(num_layers: int) -> list[str]:
    """Every tensor name an export of a `num_layers`-layer drafter holds, sorted."""
    names = [f"layers.{i}.{name}" for i in range(num_layers) for name in LAYER_WEIGHTS]
    return sorted([*names, *TOP_WEIGHTS])


def _vocab_rows(target_config: Any) -> int:
    return int(target_config.vocab_size)


def drafter_hf_config(
    cfg: DrafterConfig, target_config: Any, dtype: str = "bfloat16"
) -> dict[str, Any]:
    """The export's `config.json` as a dict (see the module docstring).

    `target_config` is the target's HF config (vocabulary size, special ids); the drafter's shape comes
    from `cfg`. Both `rope_theta` and `rope_parameters` are written: older readers look for the first,
    transformers 5 for the second.
    """
    sliding = cfg.uses_sliding_window
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        # Stated, not left to defaults: Qwen3.5/3.6 targets rotate a quarter of each head
        # (partial_rotary_factor 0.25), and an engine that filled the drafter's missing value from the
        # target's config would rotate differently from training, which always rotates the whole head.
        "partial_rotary_factor": FULL_ROTARY,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": FULL_ROTARY},
        "max_position_embeddings": cfg.max_position,
        "vocab_size": _vocab_rows(target_config),
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": getattr(target_config, "bos_token_id", None),
        "eos_token_id": getattr(target_config, "eos_token_id", None),
        "dtype": dtype,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "target_hidden_size": cfg.target_hidden_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "max_window_layers": cfg.num_layers,
    }
    return config


def config_from_export(config: Mapping[str, Any], where: str = "config.json") -> DrafterConfig:
    """The DrafterConfig an export's config.json describes; errors name the missing or odd field."""
    if list(config.get("architectures") or []) != [ARCHITECTURE]:
        raise ExportError(f"{where}: architectures is {config.get('architectures')!r}, expected [{ARCHITECTURE!r}]")
    dflash = config.get("dflash_config")
    if not isinstance(dflash, Mapping) or "mask_token_id" not in dflash or "target_layer_ids" not in dflash:
        raise ExportError(f"{where}: dflash_config must hold mask_token_id and target_layer_ids, got {dflash!r}")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "block_size",
                "num_target_layers")
    missing = [key for key in required if key not in config]
    if missing:
        raise ExportError(f"{where}: missing field(s) {missing}")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 1_000_000.0))
    rotary = params.get("partial_rotary_factor", config.get("partial_rotary_factor", FULL_ROTARY))
    rope_type = params.get("rope_type", "default")
    if float(rotary) != FULL_ROTARY or rope_type != "default":
        raise ExportError(f"{where}: RoPE type {rope_type!r} with partial_rotary_factor {rotary} is not what this "
                          f"drafter trains with (type 'default' over the whole head, partial_rotary_factor "
                          f"{FULL_ROTARY}); serving it would not match training")
    layer_types = list(config.get("layer_types") or [])
    # The window only matters (and DrafterConfig only accepts one) when some layer slides.
    sliding = config.get("sliding_window") if "sliding_attention" in layer_types else None
    return DrafterConfig(
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate_size=int(config["intermediate_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position=int(config.get("max_position_embeddings", 40960)),
        block_size=int(config["block_size"]),
        num_target_layers=int(config["num_target_layers"]),
        target_layer_ids=[int(i) for i in dflash["target_layer_ids"]],
        target_hidden_size=int(config.get("target_hidden_size") or hidden),
        mask_token_id=int(dflash["mask_token_id"]),
        layer_types=layer_types,
        sliding_window=sliding,
    )


# The speculators format's only causality field. vLLM's converter (update_dflash in
# vllm/transformers_utils/configs/speculators/algos.py) turns it into
# `dflash_config.causal = not sliding_window_non_causal` (absent = True = non-causal), and the DFlash model
# (_dflash_layer_causal in vllm/model_executor/models/qwen3_dflash.py) applies that one value to EVERY layer,
# full or sliding, before it would look at the layer's type.
SPECULATORS_NON_CAUSAL = "sliding_window_non_causal"


def speculators_causality(cfg: DrafterConfig) -> dict[str, bool]:
    """The speculators field that makes vLLM mask every layer as training did; ExportError for a drafter that
    mixes causal (sliding) and bidirectional (full) layers, which one flag cannot describe."""
    attention = trained_layer_attention(cfg)
    causal = [i for i, layer in enumerate(attention) if layer.causal]
    bidirectional = [i for i, layer in enumerate(attention) if not layer.causal]
    if causal and bidirectional:
        raise ExportError(
            f"the speculators format cannot describe this drafter as it was trained: layers {causal} "
            f"(sliding_attention) attend causally inside the block and layers {bidirectional} (full_attention) "
            f"bidirectionally, but the format has one {SPECULATORS_NON_CAUSAL} flag that vLLM applies to every "
            "layer, so some layers would be served with another mask than in training. Export without "
            "--speculators and serve the native export (config.json with architectures [DFlashDraftModel]), "
            "which carries the attention of each layer in layer_types"
        )
    # Written even where it equals vLLM's default (absent = non-causal): the export states the mask it needs.
    return {SPECULATORS_NON_CAUSAL: not causal}


def export_speculators_config(cfg: DrafterConfig, target_config: Any, verifier: str,
                              dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of the speculators format (vLLM `speculators_model_type: dflash`).

    Same weights file as the native export. The layer ids are those of the captured auxiliary states:
    `aux_hidden_state_layer_ids = target_layer_ids + 1` (vLLM subtracts the 1 again when it builds
    `dflash_config.target_layer_ids`). `verifier` is the target's name or path. The block's causality is
    `speculators_causality` (refused for a drafter mixing sliding and full layers);
    `sample_from_anchor: false` states what training does (slot 0 is the verified anchor, the masked slots
    predict), which is also vLLM's default and the only mode its DFlash speculator runs.
    """
    causality = speculators_causality(cfg)
    layer = drafter_hf_config(cfg, target_config, dtype)
    for key in ("architectures", "block_size", "num_target_layers", "dflash_config", "target_hidden_size"):
        layer.pop(key)
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        **causality,
        "sample_from_anchor": False,
        "block_size": cfg.block_size,
        "draft_vocab_size": _vocab_rows(target_config),
        "target_hidden_size": cfg.target_hidden_size,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}
            ],
            "verifier": {"name_or_path": verifier, "architectures": list(getattr(target_config, "architectures",
                                                                                  None) or [])},
        },
    }
