"""What a target's config.json alone says about its size: parameters per decoder layer, KV cache per token and
recurrent state per sequence. No torch import: the pipeline's pre-submit fit check (`dflash_pipeline.plan.fit`) reads
it where no weights are at hand. The train stage's memory plan reads the same sizes with the exact parameter counts of
the checkpoint's safetensors headers (`checkpoint_sizes`).

The counts follow the modules transformers builds (models/qwen3/modeling_qwen3.py, models/qwen3_5/
modeling_qwen3_5.py), parameter by parameter:

- a dense Qwen3 decoder layer (Qwen3ForCausalLM): q/k/v/o projections (with biases under attention_bias), q_norm
  and k_norm over head_dim, the SwiGLU MLP (gate, up, down), two RMSNorms over hidden; a Qwen2 / Qwen2.5 layer
  (Qwen2ForCausalLM, models/qwen2/modeling_qwen2.py) the same without q_norm and k_norm and with biases on q, k and v
  (the family's `qk_norm` and `qkv_bias`);
- a Qwen3.5/3.6 layer (Qwen3_5ForConditionalGeneration's language model, by `layer_types`): full_attention as
  Qwen3's but with q_proj twice as wide (it also makes the output gate); linear_attention, Gated DeltaNet:
  in_proj_qkv to 2K + V channels (K = key heads x key head dim, V = value heads x value head dim), in_proj_z to
  V, in_proj_b and in_proj_a to one value per value head, a depthwise conv1d over the 2K + V channels with
  linear_conv_kernel_dim taps and no bias, dt_bias and A_log per value head, a gated RMSNorm over the value
  head dim, out_proj from V; both kinds with the same MLP and two RMSNorms;
- a mixture-of-experts MLP (Qwen3MoeForCausalLM, Qwen3.5-MoE) in place of the dense one, on the layers its config
  makes sparse (every `decoder_sparse_step`-th, none of `mlp_only_layers`): the router (experts x hidden), each
  expert's SwiGLU over `moe_intermediate_size`, and Qwen3.5-MoE's shared expert (over
  `shared_expert_intermediate_size`) with its one-output gate. All experts are held (`layer_params`); a token runs
  the router, `num_experts_per_tok` experts and the shared one (`layer_active_params`, which the plan's throughput
  reads);
- outside the layers: the embedding (vocab x hidden), the final norm, the LM head unless tied. The vision tower
  and the MTP weights of a Qwen3.5/3.6 checkpoint are not loaded, so not counted.

Caches, as vLLM holds them per GPU of a `tp`-way tensor-parallel engine: K and V of every full-attention layer
(KV heads split over the GPUs, replicated when there are fewer heads than GPUs); a linear-attention layer keeps
no per-token cache but a fixed state per sequence, its conv state [(kernel - 1), (2K + V) / tp] and its
delta-rule state [value heads / tp, key head dim, value head dim], both in the model's dtype.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dflash_shared.errors import ConfigError
from dflash_shared.target_family import EXPERT_COUNT_KEYS, FAMILIES, QWEN3, family_of_config, is_hybrid_config

# Bytes per parameter of the dtypes a config.json or an engine setting names.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Checkpoint parts AutoModelForCausalLM does not load (Qwen3.5/3.6: the vision tower and the MTP head).
_NOT_LOADED = re.compile(r"(^|\.)(visual|vision_tower|multi_modal_projector)\.|^mtp\.")
# Softmax-attention layer kinds. A sliding-window layer holds fewer keys than a full one; counting its cache as
# full keeps the figure an upper bound.
_ATTENTION = ("full_attention", "sliding_attention")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1) -> int:
    """K and V of one token in `layers` attention layers, on one GPU of a `tp`-way engine (a target's cache, or
    a drafter's beside it in the serving engine)."""
    return 2 * layers * max(1, kv_heads // tp) * head_dim * dtype_bytes


def tied_embeddings(raw: Mapping[str, Any]) -> bool:
    """Whether the LM head is the input embedding (the text config's flag, else the outer config's)."""
    return bool(text_config(raw).get("tie_word_embeddings", raw.get("tie_word_embeddings", False)))


def text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's fields: a multimodal checkpoint's `text_config`, else the config itself, with
    `layer_types` filled in the way transformers' Qwen3.5 config does when a file leaves it implicit."""
    nested = raw.get("text_config")
    text = dict(nested) if isinstance(nested, Mapping) else dict(raw)
    text.setdefault("model_type", str(raw.get("model_type", "")))
    if is_hybrid_config(text) and not text.get("layer_types"):
        interval = int(text.get("full_attention_interval", 4))
        text["layer_types"] = ["linear_attention" if (i + 1) % interval else "full_attention"
                               for i in range(int(text["num_hidden_layers"]))]
    return text


class ConfigView:
    """A config.json read as an attribute object (`view.hidden_size`, `getattr(view, "head_dim", None)`), so the
    drafter presets (`DrafterConfig.from_target`, which take a transformers config) can read a plain dict."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getattr__(self, name: str) -> Any:
        try:
            value = self._data[name]
        except KeyError:
            raise AttributeError(name) from None
        return ConfigView(value) if isinstance(value, Mapping) and name == "text_config" else value


@dataclass(frozen=True)
class TargetSizes:
    """A target's parameter counts and cache shapes, from its config.json (see the module docstring)."""

    architecture: str
    layer_types: tuple[str, ...]
    layer_params: tuple[int, ...]  # parameters of each decoder layer, in order (every expert held)
    whole_params: int  # embedding, final norm, untied LM head
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_key_value_heads: int
    head_dim: int
    dtype_bytes: int  # of the stored weights (config dtype / torch_dtype; bf16 when unstated)
    linear_key_dim: int = 0  # K: linear key heads x key head dim (0: no linear-attention layers)
    linear_value_dim: int = 0  # V
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    conv_kernel: int = 0
    layer_active_params: tuple[int, ...] = ()  # of a mixture of experts: what one token runs per layer

    @property
    def params(self) -> int:
        return sum(self.layer_params) + self.whole_params

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: all of a dense target's, the routed experts' of a mixture."""
        return sum(self.layer_active_params or self.layer_params) + self.whole_params

    @property
    def full_attention_layers(self) -> int:
        """Layers with a KV cache (sliding-window ones counted as full)."""
        return sum(1 for kind in self.layer_types if kind in _ATTENTION)

    @property
    def linear_attention_layers(self) -> int:
        return sum(1 for kind in self.layer_types if kind == "linear_attention")

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """K and V of one token in every full-attention layer, on one GPU of a `tp`-way engine."""
        return kv_bytes_per_token(self.full_attention_layers, self.num_key_value_heads, self.head_dim, dtype_bytes, tp)

    @property
    def layer_activations_per_token(self) -> int:
        """Elements one decoder layer's forward holds per token at its peak, about: its hidden states and MLP
        activations (the memory plan's target forward; the fit check's evaluation prefill)."""
        return 4 * self.hidden_size + 3 * self.intermediate_size

    def recurrent_bytes_per_sequence(self, dtype_bytes: int, tp: int = 1) -> int:
        """The fixed state of one sequence in every linear-attention layer, on one GPU of a `tp`-way engine."""
        if not self.linear_attention_layers:
            return 0
        conv = (self.conv_kernel - 1) * (2 * self.linear_key_dim + self.linear_value_dim) // tp
        delta = max(1, self.linear_value_heads // tp) * self.linear_key_head_dim * self.linear_value_head_dim
        return self.linear_attention_layers * (conv + delta) * dtype_bytes


def target_sizes(raw: Mapping[str, Any]) -> TargetSizes:
    """The sizes of the target whose config.json is `raw`; ValueError for an architecture not counted here."""
    text = text_config(raw)
    model_type = str(text.get("model_type", ""))
    architecture = ",".join(raw.get("architectures") or []) or model_type or "unknown"
    hybrid = is_hybrid_config(text)
    # The families' architectures (dflash_shared.target_family) are counted; anything else is refused, never guessed.
    if not hybrid and family_of_config(text) is None:
        counted = ", ".join(sorted(kind for family in FAMILIES for kind in family.model_types))
        raise ValueError(f"config.json of a {architecture} (model_type {model_type!r}) is not counted: the model types "
                         f"counted are those of the target families (dflash_shared.target_family): {counted}")
    try:
        layers = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
        inter = int(text.get("intermediate_size") or 0)  # a mixture whose every layer is sparse states none
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        vocab = int(text["vocab_size"])
    except KeyError as err:
        raise ValueError(f"config.json of a {architecture} has no {err.args[0]}") from None
    types = tuple(text.get("layer_types") or ["full_attention"] * layers)
    if len(types) != layers:
        raise ValueError(f"config.json: {len(types)} layer_types for {layers} layers")
    family = family_of_config(text) or QWEN3  # a hybrid of no family (by its layer_types): Qwen3's attention terms
    gate = 2 if hybrid else 1  # Qwen3.5's q_proj also produces the attention output gate
    attention = (hidden * heads * head_dim * gate + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
                 + (2 * head_dim if family.qk_norm else 0))
    attention_bias = bool(text.get("attention_bias", False))  # Qwen3's flag: q, k, v and o biased
    if family.qkv_bias or attention_bias:
        attention += heads * head_dim * gate + 2 * kv_heads * head_dim + (hidden if attention_bias else 0)
    norms = 2 * hidden  # input and post-attention norms
    mlps = [_mlp_params(text, hidden, inter, index) for index in range(layers)]  # (held, active) per layer
    linear = dict(k_heads=0, v_heads=0, k_dim=0, v_dim=0, kernel=0)
    per_layer = []
    for kind in types:
        if kind in _ATTENTION:
            per_layer.append(attention + norms)
        elif kind == "linear_attention":
            linear = dict(k_heads=int(text["linear_num_key_heads"]), v_heads=int(text["linear_num_value_heads"]),
                          k_dim=int(text["linear_key_head_dim"]), v_dim=int(text["linear_value_head_dim"]),
                          kernel=int(text.get("linear_conv_kernel_dim", 4)))
            key, value = linear["k_heads"] * linear["k_dim"], linear["v_heads"] * linear["v_dim"]
            channels = 2 * key + value
            delta_net = (hidden * channels + hidden * value + 2 * hidden * linear["v_heads"]
                         + channels * linear["kernel"] + 2 * linear["v_heads"] + linear["v_dim"] + value * hidden)
            per_layer.append(delta_net + norms)
        else:
            raise ValueError(f"config.json: layer type {kind!r} is not counted ({', '.join(_ATTENTION)}, "
                             "linear_attention)")
    tied = tied_embeddings(raw)
    whole = vocab * hidden * (1 if tied else 2) + hidden
    dtype = str(text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype")
                or "bfloat16")
    sparse = any(held != active for held, active in mlps)
    return TargetSizes(
        architecture=architecture, layer_types=types,
        layer_params=tuple(mixer + held for mixer, (held, _) in zip(per_layer, mlps, strict=True)),
        layer_active_params=tuple(mixer + active for mixer, (_, active) in zip(per_layer, mlps, strict=True))
        if sparse else (), whole_params=whole,
        hidden_size=hidden, intermediate_size=inter, vocab_size=vocab, num_key_value_heads=kv_heads,
        head_dim=head_dim, dtype_bytes=DTYPE_BYTES.get(dtype, 2),
        linear_key_dim=linear["k_heads"] * linear["k_dim"], linear_value_dim=linear["v_heads"] * linear["v_dim"],
        linear_value_heads=linear["v_heads"], linear_key_head_dim=linear["k_dim"],
        linear_value_head_dim=linear["v_dim"], conv_kernel=linear["kernel"],
    )


def _mlp_params(text: Mapping[str, Any], hidden: int, inter: int, layer: int) -> tuple[int, int]:
    """(held, run per token) parameters of one layer's MLP: the dense SwiGLU, or a mixture of experts on the layers
    the config makes sparse (transformers' Qwen3-MoE rule: not in `mlp_only_layers`, and every
    `decoder_sparse_step`-th layer)."""
    experts = next((int(text[key]) for key in EXPERT_COUNT_KEYS if text.get(key)), 0)
    sparse = (experts > 0 and layer not in (text.get("mlp_only_layers") or [])
              and (layer + 1) % int(text.get("decoder_sparse_step") or 1) == 0)
    if not sparse:
        if not inter:
            raise ValueError("config.json of a dense layer has no intermediate_size")
        return 3 * hidden * inter, 3 * hidden * inter
    try:
        expert = 3 * hidden * int(text["moe_intermediate_size"])
        routed = int(text["num_experts_per_tok"])
    except KeyError as err:
        raise ValueError(f"config.json of a mixture of experts has no {err.args[0]}") from None
    shared = 3 * hidden * int(text.get("shared_expert_intermediate_size") or 0)
    always = experts * hidden + shared + (hidden if shared else 0)  # router; shared expert and its gate
    return always + experts * expert, always + routed * expert


def checkpoint_sizes(target_dir: str | Path) -> TargetSizes:
    """The sizes of a checkpoint directory: its config.json's, with the parameter counts of its safetensors headers
    (exact, whatever the config leaves implicit); a mixture's active counts keep the experts a token skips, which only
    the config says. ConfigError (exit 64) for an architecture not counted here or a folder without weight files."""
    root = Path(target_dir)
    raw = json.loads((root / "config.json").read_text(encoding="utf-8"))
    try:
        counted = target_sizes(raw)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    tied = tied_embeddings(raw)
    per_layer = [0] * len(counted.layer_params)
    whole, vocab = 0, counted.vocab_size
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"target {root} holds no .safetensors files; the memory plan reads their headers")
    for file in files:
        for name, numel, shape in _safetensors_entries(file):
            if _NOT_LOADED.search(name) or (tied and name.endswith("lm_head.weight")):
                continue
            match = _LAYER.search(name)
            if match and int(match.group(1)) < len(per_layer):
                per_layer[int(match.group(1))] += numel
            else:
                whole += numel
                if name.endswith("embed_tokens.weight"):
                    vocab = int(shape[0])
    skipped = [held - active for held, active in zip(counted.layer_params, counted.layer_active_params, strict=True)
               ] if counted.layer_active_params else []
    return replace(counted, layer_params=tuple(per_layer), whole_params=whole, vocab_size=vocab,
                   layer_active_params=tuple(n - s for n, s in zip(per_layer, skipped, strict=True)) if skipped
                   else ())


def _safetensors_entries(path: Path) -> list[tuple[str, int, list[int]]]:
    """(name, element count, shape) of each tensor: the file's 8-byte length, then its JSON header."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return [(name, math.prod(int(d) for d in info["shape"]), [int(d) for d in info["shape"]])
            for name, info in header.items() if name != "__metadata__"]


def loaded_sizes(target_dir: str | Path, loaded_bytes: int) -> tuple[TargetSizes, int]:
    """The checkpoint's sizes (`checkpoint_sizes`) and the device bytes of one whole replica loaded at `loaded_bytes`
    per parameter: what the train stage weighs its parallelism and memory plan with. The replica is the weight
    files' sizes (everything they hold, vision tower and MTP included) rescaled from their stored bytes per
    parameter (`TargetSizes.dtype_bytes`); what `parallelism = auto` weighs, where the plan's weights term counts
    layers."""
    sizes = checkpoint_sizes(target_dir)
    files = sum(p.stat().st_size for p in Path(target_dir).glob("*") if p.suffix in (".safetensors", ".bin"))
    return sizes, files * loaded_bytes // sizes.dtype_bytes
