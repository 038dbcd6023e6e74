"""The shape of a DFlash drafter (`DrafterConfig`), with presets. How it is trained (anchors, loss decay, feature
noise, attention kernel) is the train stage's (`dflash_train.sections`).

The drafter is a small stack of Qwen3 decoder layers that reads hidden states of chosen target layers and
drafts a block of `block_size` tokens in one pass. Its hidden size must equal the target's (it shares the
target's frozen embedding and LM head); its attention shape is its own.

Layer ids follow the convention of the exported `dflash_config.target_layer_ids`: id L is the OUTPUT of
target decoder layer L (before any final norm), i.e. Hugging Face `output_hidden_states[L + 1]` for L < N - 1
(vLLM and SGLang add the 1 themselves). The last decoder layer (N - 1) is allowed only for the targets whose
serving code captures its output (`captures_last_layer`); a `DrafterConfig` alone checks ids against 0..N-1,
and the rule about N - 1 is applied wherever the target's config is known (`check_target_layer_ids`).

No torch import here: the config is read by tooling that does not need a tensor library.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from dflash_shared.target_family import (
    QWEN3_5,
    QWEN3_6_MASK_TOKEN,
    config_model_types,
    config_view,
    engine_captures_last_layer,
    family_of_config,
    is_hybrid_config,
)

LayerType = Literal["full_attention", "sliding_attention"]
# Training rules a drafter config carried before they became train settings (`dflash_train.sections`), with the
# section that holds each now: a config given with one is refused naming its new place; checkpoints written before
# still list them, and `DrafterConfig.from_saved` reads those without them.
MOVED_TO_TRAIN_SETTINGS = {"num_anchors": "recipe", "loss_decay_gamma": "recipe", "feature_noise_std": "recipe",
                           "max_anchors_per_row": "runtime", "attention_backend": "runtime"}
# First unused embedding row of the Qwen2/2.5/3 vocabulary (151,669 tokens in 151,936 rows); the
# reference Qwen3 drafters use it as the mask token.
QWEN3_MASK_TOKEN_ID = 151669
# The reference Qwen3.6-27B drafter's mask token, said in the family module.
QWEN3_6_MASK_TOKEN_ID = QWEN3_6_MASK_TOKEN

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
# Period of the reference hybrid drafter's layer pattern: four sliding-window layers, then one full-attention.
_HYBRID_PERIOD = 5

def moved_setting_message(name: str, value: Any) -> str:
    """Where a training rule that was a drafter setting is set now (the train stage's flat settings)."""
    return (f"{name} is a train setting now ({MOVED_TO_TRAIN_SETTINGS[name]}), not a drafter one: set {name} = "
            f"{json.dumps(value)} in [stages.train] config (--{name.replace('_', '-')}), not in drafter or "
            "drafter_overrides")


def is_hybrid_family(target_config: Any) -> bool:
    """Whether a HF (text) config is a Qwen3.5/3.6-style hybrid: linear-attention layers beside full attention."""
    return is_hybrid_config(config_view(target_config))


def hybrid_layer_types(num_layers: int) -> list[LayerType]:
    """Layer kinds of a `num_layers` drafter for a hybrid target, keeping the reference pattern.

    The rule: counted back from the last layer, every fifth layer is full attention and the others slide, so
    the last layer is always full attention. 5 layers give the reference drafter (4 sliding + 1 full); fewer
    keep its tail (1: [full]; 2: [sliding, full]); more repeat the period (10: twice 4 sliding + 1 full).
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return [
        "full_attention" if (num_layers - 1 - i) % _HYBRID_PERIOD == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def _config_model_types(target_config: Any) -> set[str]:
    """model_type of a HF config and of its nested text config (Qwen3.5/3.6 checkpoints nest one)."""
    return set(config_model_types(config_view(target_config))) - {""}


def captures_last_layer(target_config: Any) -> bool:
    """Whether the serving engine (vLLM) captures the output of the target's last decoder layer (id N - 1): a
    fact of the target's family (dflash_shared.target_family.engine_captures_last_layer)."""
    return engine_captures_last_layer(config_view(target_config))


def check_target_layer_ids(target_config: Any, layer_ids: Sequence[int], num_target_layers: int | None = None,
                           ) -> None:
    """Refuse target layer ids the serving engine would not capture for this target (ValueError naming the id).

    Ids run 0..N-1 where vLLM captures the last layer's output (`captures_last_layer`), else 0..N-2.
    `num_target_layers` defaults to the config's num_hidden_layers.
    """
    layers = int(num_target_layers if num_target_layers is not None else _text_config(target_config).num_hidden_layers)
    last_layer_ok = captures_last_layer(target_config)
    last_allowed = layers - 1 if last_layer_ok else layers - 2
    for layer_id in layer_ids:
        if 0 <= layer_id <= last_allowed:
            if layer_id == layers - 1 and family_of_config(config_view(target_config)) is QWEN3_5:
                # SGLang's Qwen3.5 text model (srt/models/qwen3_5_text.py) refuses the last layer as a capture
                # layer: such a drafter loads in vLLM only (docs/serving-formats.md).
                logging.getLogger(__name__).warning(
                    "target layer id %d is the last decoder layer: vLLM captures it on this target, SGLang refuses "
                    "it for Qwen3.5/3.6 targets (use ids up to %d to serve on both)", layer_id, layers - 2)
            continue
        if layer_id == layers - 1:
            kind = "/".join(sorted(_config_model_types(target_config))) or "unknown"
            raise ValueError(
                f"target layer id {layer_id} is the last decoder layer of this {layers}-layer target (model_type"
                f" {kind}): the engine reads it as aux layer {layers}, which vLLM's decoder loop is known to record"
                " (after every layer, the last included) only for Qwen2/Qwen3, Qwen3-MoE, Qwen3-Next and"
                f" Qwen3.5/3.6 targets; use ids in 0..{last_allowed}"
            )
        raise ValueError(f"target layer id {layer_id} outside 0..{last_allowed} for a {layers}-layer target")


def _text_config(target_config: Any) -> Any:
    return getattr(target_config, "text_config", None) or target_config


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
    """Everything that shapes the drafter: its layers, the target layers it reads, its block and mask token."""

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

    @model_validator(mode="before")
    @classmethod
    def _fill_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = sorted(set(data) & set(MOVED_TO_TRAIN_SETTINGS))
            if moved:
                raise ValueError("; ".join(moved_setting_message(name, data[name]) for name in moved))
            data = dict(data)
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
        # Only what the config alone can tell: the layer exists. Whether the engine captures the last layer
        # depends on the target's architecture (`check_target_layer_ids`, applied where the target is known).
        last_layer = self.num_target_layers - 1
        for layer_id in self.target_layer_ids:
            if not 0 <= layer_id <= last_layer:
                raise ValueError(
                    f"target layer id {layer_id} outside 0..{last_layer} for a {self.num_target_layers}-layer"
                    " target"
                )
        return self

    @classmethod
    def from_saved(cls, saved: str | bytes | Mapping[str, Any]) -> DrafterConfig:
        """A config as a checkpoint's drafter_config.json holds it (JSON text or parsed), including those written
        while the training rules were drafter settings: their values are the run's, not the drafter's."""
        data = json.loads(saved) if isinstance(saved, str | bytes) else dict(saved)
        return cls.model_validate({k: v for k, v in data.items() if k not in MOVED_TO_TRAIN_SETTINGS})

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
        num_layers: int | None = None,
        num_target_features: int | None = None,
        target_layer_ids: list[int] | None = None,
        **overrides: Any,
    ) -> DrafterConfig:
        """Preset for a Hugging Face (text) target config.

        Dense targets: the drafter copies the target's layer shape, as the reference Qwen3 drafters do (e.g.
        Qwen3-8B: 4096 hidden, 32/8 heads, 128 head_dim, 12288 intermediate). Qwen3.5/3.6 hybrid targets: the
        reference drafter shape (`QWEN3_6_DRAFTER`: 32/8 heads of 128, 4 sliding-window layers of 2048 + 1
        full) at the target's hidden and intermediate size; for Qwen3.6-27B that is the published drafter
        (hidden 5120, intermediate 17408, target layers [1, 16, 31, 46, 61], mask token 248070).

        Every setting given here takes effect or is refused (ValueError naming it): `num_layers` (default 5;
        on a hybrid target the layer pattern follows it, see `hybrid_layer_types`), `num_target_features`
        (default 5; spread by `default_target_layer_ids`) or explicit `target_layer_ids`, and `overrides` of
        any other DrafterConfig field (e.g. layer_types, sliding_window, block_size). `layer_types` alone also
        sets num_layers. Fields read from the target (num_target_layers, target_hidden_size) cannot be changed.
        """
        text = _text_config(target_config)
        requested = _given(overrides, num_layers=num_layers, num_target_features=num_target_features,
                           target_layer_ids=target_layer_ids)
        _refuse_target_contradictions(text, overrides)
        num_target_layers = int(text.num_hidden_layers)
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        layers = _num_layers(num_layers, overrides)
        values: dict[str, Any] = {
            "num_layers": layers,
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(text, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(text, "head_dim", None) or hidden // heads),
            "intermediate_size": int(text.intermediate_size),
            "rms_norm_eps": float(getattr(text, "rms_norm_eps", 1e-6)),
            "rope_theta": _rope_theta(text),
            "max_position": int(getattr(text, "max_position_embeddings", 40960)),
            "num_target_layers": num_target_layers,
            "target_layer_ids": _layer_ids(num_target_layers, num_target_features, target_layer_ids),
            "target_hidden_size": hidden,
            "mask_token_id": mask_token_id,
        }
        hybrid = is_hybrid_family(text)
        if hybrid:
            values.update(QWEN3_6_DRAFTER, num_layers=layers, layer_types=hybrid_layer_types(layers))
        values.update(overrides)
        if hybrid and "sliding_window" not in overrides and "sliding_attention" not in values["layer_types"]:
            values["sliding_window"] = None  # the preset's window, when no layer slides, would only mislead
        config = cls(**values)
        check_target_layer_ids(target_config, config.target_layer_ids, num_target_layers)
        _check_applied(config, requested)
        return config

    @classmethod
    def debug(cls, **overrides: Any) -> DrafterConfig:
        """Preset matching the tiny 4-layer test target (hidden 128, 2/1 heads of 64): runs on CPU in seconds.

        `overrides` replace any field and each takes effect (`layer_types` alone also sets num_layers).
        """
        values: dict[str, Any] = {
            "num_layers": _num_layers(None, overrides, default=2),
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
        }
        values.update(overrides)
        config = cls(**values)
        _check_applied(config, overrides)
        return config


def _given(overrides: Mapping[str, Any], **keywords: Any) -> dict[str, Any]:
    """The settings a caller asked for: the overrides plus the keyword arguments that were passed."""
    return {**{k: v for k, v in keywords.items() if v is not None}, **overrides}


def _num_layers(num_layers: int | None, overrides: Mapping[str, Any], default: int = 5) -> int:
    """Drafter depth: as given, else as many layers as an explicit layer_types lists, else `default`."""
    if num_layers is not None:
        return int(num_layers)
    if "num_layers" in overrides:
        return int(overrides["num_layers"])
    if overrides.get("layer_types"):
        return len(overrides["layer_types"])
    return default


def _layer_ids(num_target_layers: int, num_target_features: int | None, target_layer_ids: list[int] | None,
               ) -> list[int]:
    """Explicit target layer ids, or `num_target_features` (default 5) spread over the target; both must agree."""
    if target_layer_ids is None:
        return default_target_layer_ids(num_target_layers, 5 if num_target_features is None else num_target_features)
    if num_target_features is not None and num_target_features != len(target_layer_ids):
        raise ValueError(
            f"num_target_features={num_target_features} contradicts target_layer_ids {list(target_layer_ids)}"
            f" ({len(target_layer_ids)} layers); give only one of them"
        )
    return list(target_layer_ids)


def _refuse_target_contradictions(text_config: Any, overrides: Mapping[str, Any]) -> None:
    """Refuse overrides of the settings `from_target` reads from the target config (they must match it)."""
    facts = {"num_target_layers": int(text_config.num_hidden_layers),
             "target_hidden_size": int(text_config.hidden_size)}
    for name, fact in facts.items():
        if name in overrides and overrides[name] != fact:
            raise ValueError(
                f"drafter setting {name}={overrides[name]!r} contradicts the target config ({fact}):"
                f" the from_target preset reads {name} from the target; drop it"
            )


def _check_applied(config: DrafterConfig, requested: Mapping[str, Any]) -> None:
    """Refuse any requested setting the resulting config does not carry (ValueError naming the field).

    The safety net behind "every override takes effect or is refused": a preset that later overwrote a
    caller's value, or a value with no effect, fails here instead of training another drafter than asked.
    """
    for name, wanted in requested.items():
        if name == "num_target_features":
            actual: Any = config.num_target_features
        elif name in DrafterConfig.model_fields:
            if wanted is None or wanted == []:
                continue  # None / [] ask for the default, which the validator fills in
            wanted = TypeAdapter(DrafterConfig.model_fields[name].annotation).validate_python(wanted)
            actual = getattr(config, name)
        else:
            raise ValueError(
                f"unknown drafter setting {name!r}; DrafterConfig fields and num_target_features are allowed"
            )
        if actual != wanted:
            raise ValueError(f"drafter setting {name}={wanted!r} did not take effect (the config has {actual!r})")
    if requested.get("sliding_window") is not None and not config.uses_sliding_window:
        raise ValueError(
            f"drafter setting sliding_window={requested['sliding_window']!r} has no effect: no drafter layer is"
            " sliding_attention; set layer_types with sliding_attention layers too, or drop sliding_window"
        )


def _rope_theta(target_config: Any) -> float:
    """RoPE base of a HF config: transformers 5 keeps it in rope_parameters, older versions at the top."""
    params = getattr(target_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(target_config, "rope_theta", None)
    return float(theta) if theta is not None else 1_000_000.0
