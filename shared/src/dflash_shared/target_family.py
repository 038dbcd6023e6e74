"""What a target family is, said once: which checkpoints belong to it, whether it is a hybrid, its generation
budget. Every stage and the plan ask here; no other module tests a model type or a model id.

A family is known from a target's config.json (`family_of_config`: its `model_type`, at the top level or under
`text_config`, where multimodal checkpoints nest the language model) or, where no file is read (the plan), from
the model id (`family_of_model_id`). A hybrid has linear-attention layers (Qwen3.5/3.6's Gated DeltaNet) beside
full attention: the drafter's layer pattern, the mask token, the target's recurrent state in memory and vLLM's
CPU path all follow from that one fact (`is_hybrid_config`, which also reads `layer_types` where a file lists
them).

| family | model types | hybrid | budget (new tokens / context) |
|---|---|---|---|
| qwen3 | qwen3 | no | 8,192 / 16,384 |
| qwen3_5 | qwen3_5, qwen3_5_text (Qwen3.5 and Qwen3.6), and their MoE siblings' | yes | 32,768 / 40,960 |

Adding a family takes: a `TargetFamily` in `FAMILIES` (its model types, a model-id pattern, hybrid or not, its
budget); its sampling preset (dflash_generate.sampling.PRESETS, keyed by family name); its drafter shape where
the reference differs (dflash_train.drafter.config); its parameter terms if its layers are not those counted in
dflash_train.training.target_params (mixture-of-experts layers are not yet); and a tiny fixture in
tests/support/tiny_target.py, which runs it through every stage's tests.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

FamilyName = Literal["qwen3", "qwen3_5"]
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class TargetFamily:
    """One family of targets and the facts every stage reads about it."""

    name: FamilyName
    model_types: frozenset[str]  # config.json model_type values of its checkpoints (top level or text_config)
    model_id_pattern: str  # a regex over the lower-cased model id ("qwen/qwen3.6-27b"), for the plan
    hybrid: bool  # linear-attention layers beside full attention
    max_new_tokens: int  # generation budget when none is set and it is not capped to the training window
    max_model_len: int  # the engine's context for that budget (prompt + answer)
    about: str


QWEN3 = TargetFamily(
    "qwen3", frozenset({"qwen3"}), r"qwen3(?![.\d])", hybrid=False, max_new_tokens=8192, max_model_len=16384,
    about="dense Qwen3 (Qwen3ForCausalLM): 8K of output in a 16K context")
# Qwen3.6's card suggests ~32K output tokens for most queries in thinking mode; the context adds 8K of prompt.
# Its mixture-of-experts siblings (qwen3_5_moe) share its sampling and hybrid layers; their expert layers are not
# counted by the memory model yet (dflash_train.training.target_params refuses them).
QWEN3_5 = TargetFamily(
    "qwen3_5", frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}), r"qwen3\.[5-9]",
    hybrid=True, max_new_tokens=32768, max_model_len=40960,
    about="Qwen3.5 / Qwen3.6 (Qwen3_5ForConditionalGeneration): Gated DeltaNet hybrids")
FAMILIES: tuple[TargetFamily, ...] = (QWEN3, QWEN3_5)
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


def config_view(obj: Any) -> dict[str, Any]:
    """The fields the family is read from, of a transformers config object (or a dict): model_type, layer_types and
    text_config."""
    if isinstance(obj, Mapping):
        return dict(obj)
    out: dict[str, Any] = {key: getattr(obj, key) for key in ("model_type", "layer_types") if
                           getattr(obj, key, None) is not None}
    text = getattr(obj, "text_config", None)
    if text is not None:
        out["text_config"] = config_view(text)
    return out
