"""Checkpoints on both storage backends: complete-or-ignored, newest found, pruned, restored exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_shared.errors import ConfigError
from dflash_shared.storage import ObjectStore, join
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.parallel.distributed import DistEnv
from dflash_train.training.checkpoint import (
    COMPLETE,
    MODEL,
    TrainState,
    checkpoint_uri,
    complete_checkpoints,
    find_resume,
    load_checkpoint,
    prune,
    publish,
    save_checkpoint,
)

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def fake_checkpoint(store: ObjectStore, output: str, step: int, tmp: Path, complete: bool = True) -> str:
    local = tmp / f"local-{step}"
    local.mkdir()
    (local / "a.bin").write_bytes(b"a" * (step + 1))
    (local / "b.json").write_text("{}")
    uri = checkpoint_uri(output, step)
    if complete:
        publish(store, str(local), uri, step, world_size=2)
    else:
        store.upload_from(str(local / "a.bin"), join(uri, "a.bin"))
    return uri


def test_only_complete_checkpoints_are_used(storage_root: str, store: ObjectStore, tmp_path: Path) -> None:
    out = join(storage_root, "run")
    assert find_resume(store, out, "auto") is None
    fake_checkpoint(store, out, 10, tmp_path)
    fake_checkpoint(store, out, 20, tmp_path)
    fake_checkpoint(store, out, 30, tmp_path, complete=False)  # a save cut short by kill -9
    # A marker whose files did not all arrive (or were truncated) is not complete either.
    broken = fake_checkpoint(store, out, 25, tmp_path)
    store.write_bytes(join(broken, "a.bin"), b"short")
    assert [ref.step for ref in complete_checkpoints(store, out)] == [10, 20]
    newest = find_resume(store, out, "auto")
    assert newest is not None and newest.step == 20 and newest.marker.world_size == 2
    assert set(newest.marker.files) == {"a.bin", "b.json"}
    assert find_resume(store, out, "never") is None
    chosen = find_resume(store, out, checkpoint_uri(out, 10))
    assert chosen is not None and chosen.step == 10
    with pytest.raises(ConfigError, match="not a complete checkpoint"):  # a setting naming no checkpoint: exit 64
        find_resume(store, out, checkpoint_uri(out, 30))


def test_prune_keeps_the_newest_complete_ones(storage_root: str, store: ObjectStore, tmp_path: Path) -> None:
    out = join(storage_root, "run")
    fake_checkpoint(store, out, 5, tmp_path, complete=False)
    for step in (10, 20, 30):
        fake_checkpoint(store, out, step, tmp_path)
    prune(store, out, keep=2)
    assert [ref.step for ref in complete_checkpoints(store, out)] == [20, 30]
    remaining = store.list(join(out, "checkpoints"))
    assert not any("step-00000005" in u or "step-00000010" in u for u in remaining)
    assert store.exists(join(checkpoint_uri(out, 30), COMPLETE))


def test_model_optimizer_and_rng_round_trip(storage_root: str, store: ObjectStore, tmp_path: Path) -> None:
    cfg = DrafterConfig.debug(num_layers=1)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.square().sum() for p in model.parameters()).backward()  # type: ignore[union-attr]
    optimizer.step()
    state = TrainState(step=7, total_steps=100, rows_per_step=4, consumed_rows=28,
                       data_position={"consumed_rows": 28, "epoch": 0, "shard_position": 1, "row_in_shard": 3},
                       plan_fingerprint="abc", scheduler={"last_epoch": 7}, world_size=1, metrics={"loss": 1.5})
    out = join(storage_root, "run")
    torch.manual_seed(123)
    saved = save_checkpoint(model, optimizer, state, cfg.model_dump_json(), store, out, ENV, str(tmp_path), keep=2)
    expected_draw = torch.rand(3)
    assert saved.uri == checkpoint_uri(out, 7) and store.exists(join(saved.uri, MODEL))

    torch.manual_seed(999)
    fresh = DFlashDrafter(cfg)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    ref = find_resume(store, out, "auto")
    assert ref == saved  # what the save returns is what a resume finds
    loaded = load_checkpoint(ref, fresh, fresh_opt, store, ENV, str(tmp_path))
    assert loaded == state
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(optimizer.state.values(), fresh_opt.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where the saved run was
