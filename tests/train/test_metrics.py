"""The trainer's metrics sink: the progress report and TensorBoard files reach the store while training runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dflash_shared.storage import ObjectStore, join
from dflash_train.parallel.distributed import DistEnv
from dflash_train.training.metrics import MetricsSink, read_scalars

METRICS = {"loss": 2.5, "tau": 1.75, "accuracy": 0.3, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 5000.0,
           "label_tokens_per_s": 900.0, "steps_per_s": 2.0, "peak_memory_gib_max": 0.1, "label_agreement": 0.9}


def test_progress_report_and_tensorboard_reach_the_store_while_training_runs(tmp_path: Path) -> None:
    store, out = ObjectStore(), str(tmp_path / "drafter")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    sink = MetricsSink(env, str(tmp_path / "tensorboard"), True, "from-step-0", store=store, output=out,
                       progress_every_s=1e-6, tokens_per_step=1024)
    sink.write(10, 100, METRICS)
    sink.report()  # the trainer's RunMetrics asks once per step
    report_uri = join(out, "progress.json")
    deadline = time.monotonic() + 60
    while not (store.exists(report_uri) and store.list(join(out, "tensorboard"))):
        assert time.monotonic() < deadline, "no progress report in the store while training runs"
        time.sleep(0.05)
    first = json.loads(store.read_bytes(report_uri))
    assert (first["state"], first["step"], first["total"], first["tokens"]) == ("training", 10, 100, 10 * 1024)
    assert first["loss"] == 2.5 and first["tau"] == 1.75 and first["last_checkpoint"] is None

    sink.checkpoint_saved(10, join(out, "checkpoints", "step-00000010"))
    time.sleep(0.01)
    sink.write(20, 100, {**METRICS, "loss": 2.0})
    sink.state = "finished"  # what the trainer sets once the last step is done
    sink.close()
    last = json.loads(store.read_bytes(report_uri))
    assert (last["state"], last["step"], last["loss"]) == ("finished", 20, 2.0)
    assert last["last_checkpoint"]["step"] == 10 and last["eta_s"] is not None and last["updated"].endswith("Z")
    assert read_scalars(store, out, "train/loss") == {10: 2.5, 20: 2.0}
    # What the drafter learns is under train/, the rates under perf/.
    assert read_scalars(store, out, "train/label_agreement") == pytest.approx({10: 0.9, 20: 0.9})
    assert read_scalars(store, out, "perf/label_tokens_per_s") == {10: 900.0, 20: 900.0}
    # Rank 0 only: another rank writes nothing.
    other = MetricsSink(DistEnv(rank=1, world_size=2, local_rank=1, device=torch.device("cpu")),
                        str(tmp_path / "tb1"), True, "r1", store=store, output=str(tmp_path / "other"))
    other.write(10, 100, METRICS)
    other.report()
    other.close()
    assert not store.list(str(tmp_path / "other"))
