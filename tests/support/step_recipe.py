"""The train step's sections as the tests call `dflash_step` and `draft_blocks` directly: the rules the drafter's
debug preset carried before they became train settings (16 anchors per document, sdpa attention), with CE on the
data token under exponential decay and no label agreement unless a test asks for them."""

from __future__ import annotations

from typing import Any

from dflash_train.sections import TrainingRecipe, TrainingRuntime


def step_recipe(**changes: Any) -> TrainingRecipe:
    """A plain recipe (data CE, exp_decay, 16 anchors per document, no label agreement) with `changes`."""
    values: dict[str, Any] = {"num_anchors": 16, "position_weighting": "exp_decay", "label_agreement": False}
    return TrainingRecipe(**{**values, **changes})


def step_runtime(**changes: Any) -> TrainingRuntime:
    """The CPU runtime of the tests (sdpa attention, the default cap of 512 anchors per row) with `changes`."""
    return TrainingRuntime(**{"attention_backend": "sdpa", **changes})
