"""Two gloo ranks under torchrun (DDP, then FSDP2): preempted together, resumed on one rank, same curve."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import DrafterSection, Kind
from dflash_shared.storage import ObjectStore
from dflash_train.parallel.distributed import init_distributed
from dflash_train.stage import run
from dflash_train.training.checkpoint import complete_checkpoints
from dflash_train.training.metrics import read_scalars
from tests.train.train_fixtures import RESUME_STEPS, resume_args, resume_config, resume_reference

pytestmark = pytest.mark.slow


def torchrun(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "-m", "dflash_train", "run", *args],
            stdout=log_file, stderr=subprocess.STDOUT,
        )


def preempt_after_first_checkpoint(store: ObjectStore, output: str, parallelism: str, log_path: Path) -> int:
    """Start 2 ranks, SIGTERM torchrun once a checkpoint exists (as Kubernetes does); return the stop step."""
    proc = torchrun(resume_args(output, parallelism=parallelism), log_path)
    deadline = time.monotonic() + 240
    try:
        while not complete_checkpoints(store, output):
            assert proc.poll() is None, f"torchrun exited early:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log_path.read_text()
    # Both ranks saw the signal, agreed on one step, and exited as preempted.
    assert text.count("exit 75 (PREEMPTED)") == 2, text[-4000:]
    return complete_checkpoints(store, output)[-1].step


def assert_close_to_reference(losses: dict[int, float], steps: range) -> None:
    reference = resume_reference()
    for step in steps:
        # Gloo sums and torchrun's one thread per rank reorder float additions: equal up to rounding.
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), f"step {step}"


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_ranks_preempted_then_resumed_on_one(parallelism: str, tmp_path: Path) -> None:
    store = ObjectStore()
    resume_reference()
    out = str(tmp_path / "out")
    stopped = preempt_after_first_checkpoint(store, out, parallelism, tmp_path / "torchrun.log")
    assert 2 <= stopped < RESUME_STEPS
    assert_close_to_reference(read_scalars(store, out, "train/loss"), range(1, stopped + 1))
    # The full-state checkpoint of 2 ranks (DDP or sharded) continues on 1 rank where it stopped.
    run(resume_config(out, parallelism=parallelism), store)
    losses = read_scalars(store, out, "train/loss")
    assert sorted(losses) == list(range(1, RESUME_STEPS + 1))
    assert_close_to_reference(losses, range(1, RESUME_STEPS + 1))
    manifest = load_manifest(store, out, Kind.drafter).manifest
    assert isinstance(manifest.section, DrafterSection)
    assert manifest.producer.config["resolved"]["world_size"] == 1
    assert {s.uri.rsplit("/", 1)[-1] for s in manifest.shards} >= {"model.safetensors", "optimizer.pt"}


def test_single_process_needs_no_process_group() -> None:
    env = init_distributed("cpu")
    assert (env.rank, env.world_size, env.distributed) == (0, 1, False)
    assert env.all_gather_object({"a": 1}) == [{"a": 1}] and env.broadcast_object(3) == 3
    assert env.any(True) and not env.any(False)
    assert torch.equal(env.all_reduce_sum(torch.ones(2)), torch.ones(2))


