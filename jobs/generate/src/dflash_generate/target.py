"""What the generate stage needs to know about a target before it starts an engine, read from its files.

`config.json` says which model family the target belongs to (it picks the sampling preset and the default
generation budget) and whether it is a hybrid (linear-attention layers beside full attention, as Qwen3.5/3.6's
Gated DeltaNet), which changes how vLLM must run it on CPU. `generation_config.json` carries the sampling
values the model's authors ship. Multimodal checkpoints nest the language model's fields under
`text_config`; both levels are read. No vLLM or torch import.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger(__name__)

# "qwen3": dense Qwen3 (and the default for families without a preset of their own);
# "qwen3_5": Qwen3.5 / Qwen3.6 (dense and MoE), whose checkpoints say model_type qwen3_5[_moe][_text].
Family = Literal["qwen3", "qwen3_5"]
QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_6")


@dataclass(frozen=True)
class TargetInfo:
    """The facts about a target that shape generation, from its config files."""

    model_type: str | None = None
    family: Family = "qwen3"
    hybrid: bool = False
    # A vision-language checkpoint (Qwen3.5/3.6 ship as one): the stage runs its language model only.
    multimodal: bool = False
    generation_config: dict[str, Any] = field(default_factory=dict)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("ignoring %s: %s", path, err)
        return {}
    return data if isinstance(data, dict) else {}


def family_of(config: dict[str, Any]) -> Family:
    """The sampling family of a `config.json` (top level or its `text_config`)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for model_type in (config.get("model_type"), text.get("model_type")):
        if isinstance(model_type, str) and model_type.startswith(QWEN3_5_MODEL_TYPES):
            return "qwen3_5"
    return "qwen3"


def is_hybrid(config: dict[str, Any]) -> bool:
    """Whether the model has linear-attention layers (Gated DeltaNet and the like) beside full attention."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for level in (config, text):
        layer_types = level.get("layer_types")
        if isinstance(layer_types, list) and "linear_attention" in layer_types:
            return True
    # Qwen3.5/3.6 checkpoints may leave layer_types implicit (full_attention_interval); the family is hybrid.
    return family_of(config) == "qwen3_5"


def read_target(model_dir: str) -> TargetInfo:
    """The target's facts from `config.json` and `generation_config.json` in `model_dir` (missing files: defaults)."""
    config = _read_json(os.path.join(model_dir, "config.json"))
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    return TargetInfo(
        model_type=model_type,
        family=family_of(config),
        hybrid=is_hybrid(config),
        multimodal=isinstance(config.get("vision_config"), dict),
        generation_config=_read_json(os.path.join(model_dir, "generation_config.json")),
    )
