"""What a target family is, said once: which checkpoints belong to it, whether it is a hybrid or a mixture of
experts, whether it has a thinking mode, its generation budget, its recommended sampling, and the sizes a model id
states. Every stage and the plan ask here; no other module tests a model type or reads a model id.

A family is known from a target's config.json (`family_of_config`: its `model_type`, at the top level or under
`text_config`, where multimodal checkpoints nest the language model) or, where no file is read (the plan), from
the model id (`family_of_model_id`). A hybrid has linear-attention layers (Qwen3.5/3.6's Gated DeltaNet) beside
full attention: the drafter's layer pattern, the mask token, the target's recurrent state in memory and vLLM's
CPU path all follow from that one fact (`is_hybrid_config`, which also reads `layer_types` where a file lists
them).

A mixture-of-experts target (`is_moe_config`: its config states `num_experts`) holds every expert in memory but
runs `num_experts_per_tok` of them per token: the memory model counts its total parameters, the plan's throughput
its active ones (`stated_parameters` reads both from a model id such as "Qwen3-30B-A3B").

A family without a thinking mode (Qwen2.5: its template has no think block, its answers no reasoning) generates
with thinking off unless told otherwise, and refuses thinking on (`TargetFamily.thinks`).

| family | model types | hybrid | experts | thinks | budget (new / ctx) | sampling |
|---|---|---|---|---|---|---|
| qwen2 | qwen2 (Qwen2, Qwen2.5, their Coder and Math models) | no | no | no | 8,192 / 16,384 | Qwen2.5's |
| qwen3 | qwen3 | no | no | yes | 8,192 / 16,384 | Qwen3's |
| qwen3_moe | qwen3_moe (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, 235B-A22B) | no | yes | yes | 8,192 / 16,384 | Qwen3's |
| qwen3_5 | qwen3_5, qwen3_5_text (Qwen3.5, 3.6), their MoE siblings' | yes | some | yes | 32,768 / 40,960 | Qwen3.5's |

A model id names the MoE family when it states an active count ("-A3B") or says "moe".

Adding a family takes: a `TargetFamily` in `FAMILIES` (its model types, a model-id pattern, hybrid or not, its
budget, its sampling per mode and whether it thinks, its reference mask token where the first unused row is not it);
its attention's parameter terms (`qk_norm`, `qkv_bias`); its drafter shape where the reference differs
(dflash_train.drafter.config); its layers' parameter terms if they are not those counted in
dflash_train.training.target_params (dense and expert MLPs, full and Gated DeltaNet attention are); and a tiny fixture
in tests/support/tiny_target.py. What the qwen3_moe and qwen2 families took beyond this module:
docs/targets.md, "Mixtures of experts" and "Qwen2.5".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

FamilyName = Literal["qwen2", "qwen3", "qwen3_moe", "qwen3_5"]
LINEAR_ATTENTION = "linear_attention"
# The config.json keys that make a layer's MLP a mixture of experts (Qwen3-MoE and Qwen3.5-MoE state the first).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


@dataclass(frozen=True)
class Sampling:
    """A family's recommended sampling for one mode (its model card's values)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class TargetFamily:
    """One family of targets and the facts every stage reads about it."""

    name: FamilyName
    model_types: frozenset[str]  # config.json model_type values of its checkpoints (top level or text_config)
    model_id_pattern: str  # a regex over the lower-cased model id ("qwen/qwen3.6-27b"), for the plan
    hybrid: bool  # linear-attention layers beside full attention
    max_new_tokens: int  # generation budget when none is set and it is not capped to the training window
    max_model_len: int  # the engine's context for that budget (prompt + answer)
    thinking: Sampling | None  # recommended sampling in thinking mode; None: the family has no thinking mode
    non_thinking: Sampling  # and in non-thinking (instruct) mode
    about: str
    # The reference drafters' mask token on the family's own vocabulary: (embedding rows, mask id); None where the
    # rule is the first embedding row past the tokenizer (dflash_train.drafter.mask_token).
    reference_mask: tuple[int, int] | None = None
    # The attention's parameter terms beside its four projections (dflash_train.training.target_params): Qwen3's and
    # Qwen3.5's norm q and k per head; Qwen2's q, k and v projections carry biases (its config states none).
    qk_norm: bool = True
    qkv_bias: bool = False

    def mask_token_for(self, vocab_rows: int) -> int | None:
        """The reference mask token of a target of this family with `vocab_rows` embedding rows, where known."""
        if self.reference_mask is not None and self.reference_mask[0] == vocab_rows:
            return self.reference_mask[1]
        return None

    @property
    def thinks(self) -> bool:
        """Whether the family has a thinking mode; it is then the mode its targets run in by default."""
        return self.thinking is not None

    def mode(self, enable_thinking: bool | None) -> bool:
        """The thinking mode a target of this family runs in: the one asked for, else (None) the family's default;
        thinking on a family without that mode is a ValueError."""
        if enable_thinking is None:
            return self.thinks
        if enable_thinking and not self.thinks:
            raise ValueError(f"{self.name} targets have no thinking mode: set enable_thinking = false")
        return enable_thinking

    def sampling(self, enable_thinking: bool) -> Sampling:
        """The recommended sampling for a mode (`mode` refuses thinking on a family without it)."""
        if not self.mode(enable_thinking):
            return self.non_thinking
        assert self.thinking is not None  # mode() refused thinking on a family without it
        return self.thinking


# Qwen3's model card: thinking mode must not decode greedily; non-thinking mode samples cooler and narrower.
_QWEN3_THINKING = Sampling(temperature=0.6, top_p=0.95, top_k=20)
_QWEN3_NON_THINKING = Sampling(temperature=0.7, top_p=0.8, top_k=20)


# The reference Qwen3.6-27B drafter's mask token: <|audio_start|>, a control token a text model never emits (the
# Qwen3.5/3.6 tokenizer fills ids up to 248,076 of the 248,320 rows).
QWEN3_6_MASK_TOKEN = 248070
QWEN3_6_VOCAB_ROWS = 248320
# Qwen2.5's generation_config.json (its only mode): Qwen3's non-thinking values and a light repetition penalty.
QWEN2 = TargetFamily(
    "qwen2", frozenset({"qwen2"}), r"qwen2(?!\d)", hybrid=False, max_new_tokens=8192, max_model_len=16384,
    thinking=None, non_thinking=Sampling(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    about="dense Qwen2 / Qwen2.5 (Qwen2ForCausalLM, attention with q/k/v biases): no thinking mode",
    qk_norm=False, qkv_bias=True)
# A model id that states an active count ("-A3B") names a mixture of experts.
_ACTIVE_COUNT = r"(?:-a\d+(?:\.\d+)?b(?![a-z0-9])|[-_]moe)"
QWEN3 = TargetFamily(
    "qwen3", frozenset({"qwen3"}), r"qwen3(?![.\d])(?!.*" + _ACTIVE_COUNT + ")", hybrid=False, max_new_tokens=8192,
    max_model_len=16384, thinking=_QWEN3_THINKING, non_thinking=_QWEN3_NON_THINKING,
    about="dense Qwen3 (Qwen3ForCausalLM): 8K of output in a 16K context")
# Qwen3's mixture-of-experts models (Qwen3MoeForCausalLM): Qwen3's attention, template and sampling; every layer's
# MLP 128 experts of which 8 run per token.
QWEN3_MOE = TargetFamily(
    "qwen3_moe", frozenset({"qwen3_moe"}), r"qwen3(?![.\d]).*" + _ACTIVE_COUNT, hybrid=False, max_new_tokens=8192,
    max_model_len=16384, thinking=_QWEN3_THINKING, non_thinking=_QWEN3_NON_THINKING,
    about="Qwen3 mixture of experts (Qwen3MoeForCausalLM): Qwen3's budget and sampling")
# Qwen3.6's card suggests ~32K output tokens for most queries in thinking mode; the context adds 8K of prompt.
# Its mixture-of-experts siblings (qwen3_5_moe) share its sampling and hybrid layers; the memory model counts their
# experts held and run (dflash_train.training.target_params).
QWEN3_5 = TargetFamily(
    "qwen3_5", frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}), r"qwen3\.[5-9]",
    hybrid=True, max_new_tokens=32768, max_model_len=40960,
    thinking=Sampling(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5),
    non_thinking=Sampling(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5),
    about="Qwen3.5 / Qwen3.6 (Qwen3_5ForConditionalGeneration): Gated DeltaNet hybrids",
    reference_mask=(QWEN3_6_VOCAB_ROWS, QWEN3_6_MASK_TOKEN))
FAMILIES: tuple[TargetFamily, ...] = (QWEN2, QWEN3, QWEN3_MOE, QWEN3_5)
BY_NAME: dict[str, TargetFamily] = {family.name: family for family in FAMILIES}


def config_model_types(config: Mapping[str, Any]) -> list[str]:
    """The model types a config.json states: its own, then its nested `text_config`'s."""
    text = config.get("text_config")
    levels = [config, text] if isinstance(text, Mapping) else [config]
    return [str(level["model_type"]) for level in levels if isinstance(level.get("model_type"), str)]


def family_of_config(config: Mapping[str, Any]) -> TargetFamily | None:
    """The family of a config.json, or None for a model type no family holds."""
    for model_type in config_model_types(config):
        for family in FAMILIES:
            if model_type in family.model_types:
                return family
    return None


def family_of_model_id(model_id: str) -> TargetFamily:
    """The family a model id names (the plan reads no target files); dense Qwen3, the smaller budget, where none
    matches."""
    text = model_id.lower()
    for family in FAMILIES:
        if re.search(family.model_id_pattern, text):
            return family
    return QWEN3


def is_moe_config(config: Mapping[str, Any]) -> bool:
    """Whether a config.json (or its text config) describes mixture-of-experts MLPs."""
    text = config.get("text_config")
    return any(int(level.get(key) or 0) > 0 for level in ([config, text] if isinstance(text, Mapping) else [config])
               for key in EXPERT_COUNT_KEYS)


# "Qwen3-8B", "Qwen3.6-27B", "Qwen3-30B-A3B", "Llama-3.1-70B-Instruct", "gpt-oss-120b": a count of billions.
_PARAMETER_COUNT = re.compile(r"(?<![A-Za-z0-9.])(a?)(\d+(?:\.\d+)?)b(?![a-z0-9])")


@dataclass(frozen=True)
class StatedSize:
    """The parameter counts a model id states, in billions: the total, and the active ones per token where it
    names a mixture of experts ("30B-A3B"); None where it states none."""

    total_b: float | None
    active_b: float | None

    @property
    def runs_b(self) -> float | None:
        """Billions of parameters each token runs through: the active count, else the total."""
        return self.active_b if self.active_b is not None else self.total_b


def stated_parameters(model_id: str) -> StatedSize:
    """What the model id's name (the part after the last '/') states of its size."""
    name = model_id.rsplit("/", 1)[-1].lower()
    total: list[float] = []
    active: list[float] = []
    for match in _PARAMETER_COUNT.finditer(name):
        (active if match.group(1) else total).append(float(match.group(2)))
    return StatedSize(max(total) if total else None, max(active) if active else None)


def is_hybrid_config(config: Mapping[str, Any]) -> bool:
    """Whether a config.json (or its text config) describes linear-attention layers beside full attention: listed
    in `layer_types`, or implied by a hybrid family's model type (Qwen3.5/3.6 may leave layer_types implicit)."""
    text = config.get("text_config")
    for level in ([config, text] if isinstance(text, Mapping) else [config]):
        layer_types = level.get("layer_types")
        if isinstance(layer_types, list) and LINEAR_ATTENTION in layer_types:
            return True
    family = family_of_config(config)
    return family is not None and family.hybrid


# Targets whose vLLM (0.32) model code captures the output of the LAST decoder layer as an auxiliary hidden
# state. vLLM reads `dflash_config.target_layer_ids` as aux layers id + 1, and these decoder loops record aux
# layer idx + 1 (hidden_states + residual, before the final norm) after every layer idx, the last one
# included, so id N - 1 (aux layer N) is captured:
# - qwen2 / qwen3: `Qwen2Model.forward` (models/qwen2.py), which `Qwen3Model` (models/qwen3.py) inherits;
# - qwen3_moe: `Qwen3MoeModel.forward` (models/qwen3_moe.py);
# - qwen3_next and Qwen3.5/3.6 (qwen3_5*): `Qwen3NextModel.forward` (models/qwen3_next.py), which
#   `Qwen3_5Model` (models/qwen3_5.py) inherits; `Qwen3_5ForConditionalGeneration` runs that same model.
# Other targets are not known to capture it: for them the last allowed id is N - 2.
LAST_LAYER_CAPTURED_MODEL_TYPES = frozenset({
    "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
})
LAST_LAYER_CAPTURED_ARCHITECTURES = frozenset({
    "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
})


def engine_captures_last_layer(config: Mapping[str, Any]) -> bool:
    """Whether vLLM captures the output of the target's last decoder layer (id N - 1), from a config.json's
    architectures or model types (see `LAST_LAYER_CAPTURED_MODEL_TYPES`)."""
    architectures = set(config.get("architectures") or [])
    return bool(architectures & LAST_LAYER_CAPTURED_ARCHITECTURES) or bool(
        set(config_model_types(config)) & LAST_LAYER_CAPTURED_MODEL_TYPES)


# Every family's chat markers are Qwen's ChatML: a turn opens with TURN_START and its role, ends with END_OF_TURN;
# the reasoning of a family that thinks sits between THINK_MARKERS (Qwen2.5's template never writes them). The
# tokenize stage renders and masks with them.
TURN_START = "<|im_start|>"
END_OF_TURN = "<|im_end|>"
THINK_MARKERS = ("<think>", "</think>")


def config_view(obj: Any) -> dict[str, Any]:
    """The fields the family is read from, of a transformers config object (or a dict): model_type, layer_types,
    architectures and text_config."""
    if isinstance(obj, Mapping):
        return dict(obj)
    out: dict[str, Any] = {key: getattr(obj, key) for key in ("model_type", "layer_types", "architectures") if
                           getattr(obj, key, None) is not None}
    text = getattr(obj, "text_config", None)
    if text is not None:
        out["text_config"] = config_view(text)
    return out
