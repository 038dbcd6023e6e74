"""How the frozen target reaches the ranks: read once by rank 0, broadcast, kept as each rank needs it.

A node runs one rank per GPU. If every rank read the checkpoint itself (`from_pretrained` on each), a
node with 8 GPUs would hold 8 full copies of the target in host memory before FSDP sharded them
(8 x ~54 GB for Qwen3.6-27B in bf16). Instead:

1. rank 0 loads the checkpoint with transformers (its own loader: key renaming such as Qwen3.6's
   `model.language_model.*`, skipped vision/MTP weights, tied heads and the dtype are its business);
2. every other rank builds the same model from the config with its parameters on the meta device
   (no memory; buffers such as RoPE tables are computed for real, they are not in the checkpoint);
3. every rank drops the layers after the last hooked one (`FrozenTarget`) and places the model the way
   the parallelism wants it: FSDP shards the decoder layers (meta shards on the ranks that read nothing),
   DDP wants the whole model on the device;
4. `set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`
   broadcasts rank 0's tensors one at a time on the device (NCCL on GPU, gloo on CPU); each rank keeps
   its FSDP shard of a sharded tensor, or the whole tensor where it is replicated.

A non-zero rank therefore reads nothing from disk and holds no host copy: on CUDA the broadcast lands
on its device; on CPU (gloo, tests) it holds what it keeps plus the one tensor in flight. Rank 0 holds
one full host copy while it loads (transformers reads into host memory; under DDP it then moves to the
device). The checkpoint is read once per job instead of once per rank.

Rejected alternative: each rank reading only its shard's tensors from the safetensors files by name
(safe_open with mmap) avoids the broadcast, but it duplicates the per-architecture checkpoint
conventions of 1. (renamed prefixes, skipped weights, tied heads, dtype); the broadcast is one pass over
the weights at interconnect speed. Under DDP on CPU each rank's device is host memory, so there each
rank holds a full copy by definition.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_train.parallel.distributed import DistEnv
from dflash_train.parallel.placement import move_to_device, shard_target
from dflash_train.target_model.frozen import FrozenTarget, Packing

log = logging.getLogger(__name__)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device, their buffers for real.

    `with torch.device("meta")` would put buffers there too, and non-persistent buffers (RoPE's inv_freq)
    are in no state dict, so no broadcast would ever fill them in.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        # Already on meta: a tied weight re-registered under its second name keeps its identity.
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def skeleton(path: str | Path, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    """The model `AutoModelForCausalLM.from_pretrained(path)` would build, with every parameter on meta."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (tied embedding and LM head), as lists of two or more."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make each group one Parameter again (a broadcast with assign gives every name its own tensor)."""
    for first, *others in groups:
        param = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)


def load_target(
    path: str | Path,
    layer_ids: Sequence[int],
    env: DistEnv,
    sharded: bool,
    dtype: torch.dtype,
    attn_implementation: str = "sdpa",
    packing: Packing = "auto",
    keep_output: bool = False,
) -> FrozenTarget:
    """The frozen target on this rank's device: whole (DDP, world 1) or with FSDP-sharded layers; with
    `keep_output` its layers past the last hooked one and its final norm stay (FrozenTarget).

    World size 1 loads directly; otherwise rank 0 reads the checkpoint and broadcasts it (module docstring).
    """
    if env.is_main:
        # Rank 0 (the only rank of world 1) reads the checkpoint. Sharded: into host memory, each layer then goes to
        # the device as this rank's shard only.
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn_implementation)
        if not sharded:
            model.to(env.device)
    else:
        model = skeleton(path, dtype, attn_implementation)
    # Drops unused layers (all are used with keep_output) before anything is broadcast.
    target = FrozenTarget(model, layer_ids, packing=packing, keep_output=keep_output)
    if not env.distributed:
        return target
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    tied = _tied_groups(target.model)
    aliases = {name for _, *others in tied for name in others}
    # A tied weight is broadcast once, under its first name; `_retie` gives the others the same tensor.
    full: dict[str, Any] = ({k: v for k, v in target.model.state_dict().items() if k not in aliases}
                            if env.is_main else {})
    if sharded:
        shard_target(target.model, env)
    else:
        move_to_device(target.model, env.device)
    # strict=False lets the aliases be absent; a name rank 0 did not send stays on meta and is refused below.
    set_model_state_dict(target.model, full, options=StateDictOptions(full_state_dict=True,
                                                                      broadcast_from_rank0=True, strict=False))
    del full
    _retie(target.model, tied)
    move_to_device(target.model, env.device)  # buffers of a skeleton, built on the host
    left = [name for name, p in target.model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"target parameters not filled in by rank 0's broadcast: {left[:5]}")
    log.info("target loaded by rank 0 and broadcast to %d ranks (%s)", env.world_size,
             "decoder layers sharded" if sharded else "whole on every rank")
    return target
