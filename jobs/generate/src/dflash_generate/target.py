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
from typing import Any

from dflash_shared.target_family import QWEN3, FamilyName, family_of_config, is_hybrid_config

log = logging.getLogger(__name__)

# The families (dflash_shared.target_family): "qwen3" is also the default for a model type no family holds.
Family = FamilyName


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
    """The sampling family of a `config.json`: its family's, else dense Qwen3's."""
    return (family_of_config(config) or QWEN3).name


def read_target(model_dir: str) -> TargetInfo:
    """The target's facts from `config.json` and `generation_config.json` in `model_dir` (missing files: defaults)."""
    config = _read_json(os.path.join(model_dir, "config.json"))
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    return TargetInfo(
        model_type=model_type,
        family=family_of(config),
        hybrid=is_hybrid_config(config),
        multimodal=isinstance(config.get("vision_config"), dict),
        generation_config=_read_json(os.path.join(model_dir, "generation_config.json")),
    )
