"""The process group under torchrun, and what each rank knows of it (`DistEnv`).

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous; a plain `python -m dflash_train run` is
world size 1 and needs none of it. The backend is NCCL on CUDA and gloo on CPU, so the same code runs
two CPU processes in tests. On one node the mesh is flat (all ranks shard). A job over several nodes gets a
2-D mesh, HSDP (`dflash_train.parallel.placement`); the node count is taken from torchrun's environment
(WORLD_SIZE / LOCAL_WORLD_SIZE: the pods of a multi-node Job each run one torchrun agent with
--nproc-per-node = its GPUs), not from the config, so it always matches the ranks that exist.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dflash_shared.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # Ranks on this node (torchrun's LOCAL_WORLD_SIZE); None: all ranks are on one node.
    local_world_size: int | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """FSDP's mesh: (world,) on one node, (nodes, ranks per node) across nodes (see `mesh_shape`)."""
        return mesh_shape(self.world_size, self.local_world_size or self.world_size)

    @functools.cached_property
    def mesh(self) -> Any:
        """The DeviceMesh FSDP shards over, made once per process (every rank must call it together)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = self.mesh_shape
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        log.info("FSDP mesh %s over %s", dict(zip(names, shape, strict=True)), self.device.type)
        return mesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (also returned); the identity at world size 1."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank (used to stop all ranks at the same step)."""
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        return bool(self.all_reduce_sum(value).item() > 0)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


def mesh_shape(world_size: int, ranks_per_node: int) -> tuple[int, ...]:
    """(world_size,) when every rank is on one node, else (nodes, ranks_per_node) for HSDP."""
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ConfigError(
            f"{world_size} ranks do not split into nodes of {ranks_per_node} (torchrun's LOCAL_WORLD_SIZE): "
            "every pod of a multi-node run must start the same --nproc-per-node"
        )
    nodes = world_size // ranks_per_node
    return (world_size,) if nodes == 1 else (nodes, ranks_per_node)


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistEnv:
    """Join the process group torchrun set up (if any) and pick this rank's device."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but CUDA is not available in this process")
        torch.cuda.set_device(local_rank)
        where = torch.device("cuda", local_rank)
    else:
        where = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                device_id=where if use_cuda else None)
        log.info("joined process group: rank %d of %d (%s), device %s", rank, world, backend, where)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=where, local_world_size=local_world)


def shutdown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: allocated CUDA memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # VmHWM, this process's own peak: getrusage's ru_maxrss carries the parent's (torchrun's, a test runner's)
    # high-water mark across fork and exec.
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
