"""HSDP: a job over several nodes shards within a node and replicates across nodes (a 2-D DeviceMesh).

Two torchrun agents on this machine play two nodes of two gloo ranks each (`--nnodes 2`, static
rendezvous on 127.0.0.1), exactly as two pods of a multi-node Job would start: torchrun then sets
WORLD_SIZE=4 and LOCAL_WORLD_SIZE=2 in every rank, which is where the mesh's shape comes from. The
target is on S3 and each agent has its own scratch directory, as each pod has its own disk: only the
node of rank 0 copies the weights.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_shared.errors import ConfigError
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_shared.storage import ObjectStore, join
from dflash_train.parallel.distributed import mesh_shape
from dflash_train.stage import run
from dflash_train.training.metrics import read_scalars
from tests.train.train_fixtures import resume_args, resume_config, small_vocab_target

# 4 rows of 64 tokens per step: one micro-batch per rank at world size 4, four on one rank.
HSDP_FLAGS = {"batch-tokens": "256", "max-steps": "4", "checkpoint-every": "4", "parallelism": "fsdp"}


def test_mesh_is_flat_on_one_node_and_two_dimensional_across_nodes() -> None:
    assert mesh_shape(8, 8) == (8,)
    assert mesh_shape(32, 8) == (4, 8)
    assert mesh_shape(4, 2) == (2, 2)
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        mesh_shape(12, 8)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def _copied(scratch: Path) -> dict[str, int]:
    """Bytes of each file copied from the target into a node's scratch (its target-* directories)."""
    return {path.name: path.stat().st_size for path in scratch.glob("dflash-train-*/target-*/*")
            if not path.name.startswith(".")}


def test_two_nodes_of_two_ranks_train_as_one_rank_does(tmp_path: Path, s3_bucket: str) -> None:
    store = ObjectStore()
    target = join(s3_bucket, "models", "tiny")
    for path in small_vocab_target().iterdir():
        if path.is_file() and not path.name.startswith("."):
            store.upload_from(str(path), join(target, path.name))
    reference_out = str(tmp_path / "reference")
    run(resume_config(reference_out, **HSDP_FLAGS), store)
    reference = read_scalars(store, reference_out, "train/loss")

    out = str(tmp_path / "hsdp")
    port = _free_port()
    agents, logs = [], []
    for node in (0, 1):
        logs.append(tmp_path / f"node-{node}.log")
        with open(logs[-1], "wb") as log_file:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                 "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                 "-m", "dflash_train", "run", *resume_args(out, **HSDP_FLAGS, target=target,
                                                           **{"scratch-dir": str(tmp_path / f"scratch-{node}")})],
                stdout=log_file, stderr=subprocess.STDOUT))
    try:
        codes = [agent.wait(timeout=240) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert codes == [0, 0], "\n".join(path.read_text()[-3000:] for path in logs)
    # Rank 0's node copied the whole target; the other node only what its ranks read (no weight file).
    node0, node1 = _copied(tmp_path / "scratch-0"), _copied(tmp_path / "scratch-1")
    assert "model.safetensors" in node0 and {"config.json", "tokenizer.json"} <= set(node1)
    assert not [name for name in node1 if name.endswith((".safetensors", ".bin"))], node1
    print(f"\ntarget bytes copied per node: node 0 {sum(node0.values()):,} ({len(node0)} files), node 1 "
          f"{sum(node1.values()):,} ({len(node1)} files)")

    resolved = load_manifest(store, out, Kind.drafter).manifest.producer.config["resolved"]
    # Read from the drafter's parameters: sharded over 2 ranks of a node, replicated over the 2 nodes.
    assert resolved["mesh"] == {"replicate": 2, "shard": 2}
    assert resolved["world_size"] == 4
    losses = read_scalars(store, out, "train/loss")
    assert sorted(losses) == sorted(reference) == [1, 2, 3, 4]
    worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in reference)
    print(f"\nHSDP 2x2 vs 1 rank, steps 1-4: losses {[round(losses[s], 6) for s in sorted(losses)]}, largest "
          f"relative difference {worst:.1e}")
    for step, loss in reference.items():
        # The same rows and anchors per step; gloo's sums and the per-rank micro-batch split reorder float
        # additions only, so the losses agree to rounding (fp32 training).
        assert losses[step] == pytest.approx(loss, rel=1e-4), f"step {step}"
