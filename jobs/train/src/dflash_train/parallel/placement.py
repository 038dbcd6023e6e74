"""Where the models' weights live across the ranks: DDP when a replica fits a device, FSDP2 when not.

- ddp: every rank holds the whole target and drafter; the drafter is wrapped in DistributedDataParallel
  (gradient all-reduce overlapping backward, no_sync on accumulation micro-steps).
- fsdp: the target's decoder layers are sharded with FSDP2 (`fully_shard`, gathered one layer at a time
  in its forward) and so is the drafter (per layer, plus the root); the target's embedding and LM head
  stay whole on every rank because the drafter reads them directly. Over several nodes the mesh is 2-D,
  HSDP (`DistEnv.mesh`): parameters are sharded within a node and replicated across nodes, so the
  all-gathers of every forward and the gradient reduce-scatters stay on the node's NVLink and only the
  (already reduced) gradient shards are all-reduced across nodes, once per step.
- auto: ddp when the bf16 target plus the drafter with fp32 master weights, gradients and AdamW moments
  take under 80% of one device's memory, else fsdp (`training.memory_plan.choose_parallelism`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dflash_train.parallel.distributed import DistEnv

Parallelism = Literal["ddp", "fsdp"]


class DrafterDDP(DistributedDataParallel):
    """DDP that still answers the wrapped drafter's attributes (config, fc, layers) like the drafter does."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def move_to_device(module: nn.Module, device: torch.device) -> None:
    """`module.to(device)` for what is materialised; parameters still on the meta device stay there (the
    rank-0 broadcast of `target_model.loading` fills them in on the device)."""
    for param in module.parameters():
        if not param.is_meta and param.device != device:
            param.data = param.data.to(device)  # the same Parameter object: tied weights stay tied
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                sub._buffers[name] = buffer.to(device)


def shard_target(target_model: nn.Module, env: DistEnv) -> None:
    """FSDP2-shard each decoder layer of the frozen target; the rest (embedding, head, norm) stays whole.

    Everything but the layers moves to the device whole; then each layer is sharded over `env.mesh`,
    which places only this rank's shard of it on the device. Parameters on the meta device (a rank
    that did not read the checkpoint) become meta shards, filled in by the rank-0 broadcast.
    """
    from torch.distributed.fsdp import fully_shard

    decoder = target_model.get_decoder()  # type: ignore[operator]
    layers = decoder.layers
    decoder.layers = nn.ModuleList()
    try:
        move_to_device(target_model, env.device)
    finally:
        decoder.layers = layers
    for layer in layers:
        fully_shard(layer, mesh=env.mesh, reshard_after_forward=True)


def wrap_drafter(drafter: nn.Module, parallelism: Parallelism, env: DistEnv, bf16: bool) -> nn.Module:
    """The drafter as the trainer calls it: as is (world 1), in DDP, or FSDP2-sharded."""
    if not env.distributed:
        return drafter
    if parallelism == "ddp":
        # No device_ids: the inputs (masks in dataclasses among them) are already on the device, and
        # DDP should not try to move them.
        return DrafterDDP(drafter)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = env.mesh
    # Gathered weights in bf16 for compute, gradients reduced in fp32; the sharded masters stay fp32.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else (
        MixedPrecisionPolicy())
    layers = drafter.get_submodule("layers")  # the decoder layers, each sharded on its own
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(drafter, mesh=mesh, mp_policy=policy)
    return drafter


def mesh_of(model: nn.Module) -> dict[str, int] | None:
    """The mesh the model's parameters are actually sharded over ({"replicate": 2, "shard": 8}), or None
    when they are plain tensors (world 1, DDP): recorded in the manifest from the parameters themselves."""
    mesh = getattr(next(model.parameters()), "device_mesh", None)
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return dict(zip(names, (int(n) for n in mesh.shape), strict=True))


@contextlib.contextmanager
def accumulate(model: nn.Module, sync: bool) -> Iterator[None]:
    """Skip the gradient reduction on accumulation micro-steps (`sync=False`); reduce on the last one."""
    if isinstance(model, DistributedDataParallel) and not sync:
        with model.no_sync():
            yield
        return
    set_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2
    if set_sync is not None:
        set_sync(sync)
    yield
