"""Warm start (`init_from`): an export or a checkpoint of the run's drafter loads exactly; any other drafter is
refused with exit 64, naming each difference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from dflash_shared.errors import ConfigError, exit_code_for
from dflash_shared.storage import ObjectStore
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.export.files import write_export_dir
from dflash_train.training.checkpoint import DRAFTER_CONFIG, MODEL
from dflash_train.training.warm_start import warm_start

ROWS = 151936


def _drafter(seed: int, **overrides) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(DrafterConfig.debug(mask_token_id=151669, **overrides))


def _same(a: DFlashDrafter, b: DFlashDrafter) -> bool:
    sb = b.state_dict()
    return all(torch.equal(v, sb[k]) for k, v in a.state_dict().items())


def test_an_export_and_a_checkpoint_of_the_runs_drafter_load_exactly(tiny_target_dir: Path, tmp_path: Path) -> None:
    source = _drafter(1)
    export = tmp_path / "export"
    write_export_dir(source, AutoConfig.from_pretrained(tiny_target_dir), str(export), dtype="float32")
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / DRAFTER_CONFIG).write_text(source.config.model_dump_json())
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(checkpoint / MODEL))
    for where, kind in ((export, "export"), (checkpoint, "checkpoint")):
        fresh = _drafter(2)
        assert not _same(fresh, source)
        assert warm_start(fresh, ObjectStore(), str(where), ROWS) == f"{kind} {where}"
        assert _same(fresh, source), kind


def test_another_drafter_is_refused_naming_each_difference(tiny_target_dir: Path, tmp_path: Path) -> None:
    source = _drafter(1, target_layer_ids=[0, 1], num_layers=2)
    export = tmp_path / "export"
    write_export_dir(source, AutoConfig.from_pretrained(tiny_target_dir), str(export), dtype="float32")
    run = _drafter(2, target_layer_ids=[1, 2], num_layers=1)
    before = {k: v.clone() for k, v in run.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        warm_start(run, ObjectStore(), str(export), ROWS)
    message = str(err.value)
    assert "target_layer_ids [0, 1] (run: [1, 2])" in message and "num_layers 2 (run: 1)" in message
    assert int(exit_code_for(err.value)) == 64
    assert all(torch.equal(v, before[k]) for k, v in run.state_dict().items())  # nothing loaded
    # The target's vocabulary is the export's too.
    with pytest.raises(ConfigError, match=r"vocab_size 151936 \(run's target: 248320\)"):
        warm_start(_drafter(3, target_layer_ids=[0, 1], num_layers=2), ObjectStore(), str(export), 248320)


def test_a_folder_with_neither_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.json").write_text(json.dumps({}))
    with pytest.raises(ConfigError, match="neither a training checkpoint"):
        warm_start(_drafter(1), ObjectStore(), str(tmp_path), ROWS)
