"""Defects the learnability gate exists for, put in on purpose one at a time (context managers that patch the train
and export code in this process): the gate's tests and bench/bench_learnability.py use them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@contextlib.contextmanager
def patched(module: Any, name: str, wrap: Callable[[Any], Any]) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setattr(module, name, wrap(getattr(module, name)))
    try:
        yield
    finally:
        mp.undo()


def labels_shifted() -> contextlib.AbstractContextManager[None]:
    """Training's labels one slot late: slot k learns the token of slot k + 1."""
    import torch

    import dflash_train.training.step as step

    def wrap(block_targets: Any) -> Any:
        def shifted(*args: Any, **kwargs: Any) -> Any:
            labels, weight = block_targets(*args, **kwargs)
            return torch.roll(labels, -1, dims=-1), weight
        return shifted
    return patched(step, "block_targets", wrap)


def positions_shifted() -> contextlib.AbstractContextManager[None]:
    """Training's block positions one ahead of the context's."""
    import dflash_train.training.step as step

    def wrap(block_inputs: Any) -> Any:
        def shifted(*args: Any, **kwargs: Any) -> Any:
            ids, positions = block_inputs(*args, **kwargs)
            return ids, positions + 1
        return shifted
    return patched(step, "block_inputs", wrap)


def layer_ids_off_by_one() -> contextlib.AbstractContextManager[None]:
    """The export names the target layers one below those training read."""
    import dflash_train.export.files as files

    def wrap(drafter_hf_config: Any) -> Any:
        def shifted(*args: Any, **kwargs: Any) -> Any:
            config = drafter_hf_config(*args, **kwargs)
            config["dflash_config"]["target_layer_ids"] = [i - 1 for i in config["dflash_config"]["target_layer_ids"]]
            return config
        return shifted
    return patched(files, "drafter_hf_config", wrap)


DROPPED_WEIGHT = "layers.0.mlp.down_proj.weight"


def weight_dropped() -> contextlib.AbstractContextManager[None]:
    """The export leaves one of the drafter's weights out."""
    import dflash_train.export.files as files

    def wrap(export_state_dict: Any) -> Any:
        def dropped(*args: Any, **kwargs: Any) -> Any:
            tensors = dict(export_state_dict(*args, **kwargs))
            tensors.pop(DROPPED_WEIGHT)
            return tensors
        return dropped
    return patched(files, "export_state_dict", wrap)


# Defects the gate's decode must catch; a dropped weight is refused earlier, when the export is loaded back.
BREAKS = {"labels shifted": labels_shifted, "positions shifted": positions_shifted,
          "layer ids off by one": layer_ids_off_by_one}


def gate_on(target_dir: Path, scratch: Path, documents: int, new_tokens: int, steps: int) -> Any:
    """The learnability gate on the first of the evaluate tests' held-out questions (blocks of 8, CPU, float32,
    the gate's default learning rate and threshold), its drafter exported under `scratch`."""
    import torch

    from dflash_shared.storage import ObjectStore
    from dflash_train.evaluate.config import EvaluateConfig
    from dflash_train.evaluate.learnability import GateSettings, run_gate
    from dflash_train.evaluate.stage import stop_token_ids
    from tests.evaluate import eval_fixtures as ef

    defaults = EvaluateConfig.model_fields
    settings = GateSettings(documents, new_tokens, steps, defaults["learnability_lr"].default,
                            defaults["learnability_min_acceptance"].default)
    model = ef.load_target(target_dir)
    prompts = [(f"p{i}", ids) for i, ids in enumerate(ef.chat_prompts(target_dir, ef.heldout_texts(documents)))]
    return run_gate(model, ef.drafter_config(8, ef.arch_of(target_dir)), prompts, stop_token_ids(model), settings,
                    torch.device("cpu"), torch.float32, ObjectStore(), str(scratch / "gate-export"))
