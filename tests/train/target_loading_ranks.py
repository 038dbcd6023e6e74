"""One rank of the rank-0 loading test, started by torchrun (gloo on CPU): load, measure, check, report.

`python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.train.target_loading_ranks
TARGET_DIR OUT_DIR` writes OUT_DIR/rank-<r>.json per rank:
- host memory: peak RSS (VmHWM) after the FSDP load minus the peak before it, the bytes of the
  tensors this rank keeps, and the bytes of one full copy of the kept target;
- checks: the weights gathered from the shards equal transformers' own load of the checkpoint, the
  sharded target's features equal the world-1 target's, and the DDP placement (whole on every rank)
  holds the same weights on every rank.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from dflash_train.parallel.distributed import init_distributed, shutdown
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.target_model.loading import load_target

LAYER_IDS = [1, 5]  # keeps 6 of the 7 layers


def peak_rss_bytes() -> int:
    """This process's own peak RSS (VmHWM). getrusage's ru_maxrss would carry torchrun's size across fork and exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def kept_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shard of a DTensor, a whole tensor once if tied)."""
    seen = {id(p): p for p in model.parameters()}.values()
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in seen)


def full_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def digest(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.detach().contiguous().cpu().numpy().tobytes()).hexdigest() for k, v in state.items()}


def main(target_dir: str, out_dir: str) -> None:
    env = init_distributed("cpu")
    # Imported before the baseline: the library's code is not the target's memory.
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401

    ids = torch.randint(0, 8000, (2, 48), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(48).repeat(2, 1)
    documents = torch.cat([torch.zeros(2, 30, dtype=torch.long), torch.ones(2, 18, dtype=torch.long)], dim=1)
    baseline = peak_rss_bytes()
    sharded = load_target(target_dir, LAYER_IDS, env, sharded=True, dtype=torch.float32)
    peak = peak_rss_bytes()
    report: dict[str, object] = {"rank": env.rank, "peak_delta_bytes": peak - baseline, "baseline_bytes": baseline,
                                 "kept_bytes": kept_bytes(sharded.model), "full_copy_bytes": full_bytes(sharded.model),
                                 "largest_tensor_bytes": max(p.numel() * 4 for p in sharded.model.parameters())}
    features = sharded.features(ids, positions, documents)
    gathered = get_model_state_dict(sharded.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    whole = load_target(target_dir, LAYER_IDS, env, sharded=False, dtype=torch.float32)
    whole_digests = env.all_gather_object(digest(whole.model.state_dict()))
    report["tied"] = whole.lm_head.weight is whole.embed_tokens.weight
    if env.is_main:
        reference = FrozenTarget.from_pretrained(target_dir, LAYER_IDS, dtype=torch.float32)
        expected = reference.model.state_dict()
        report["keys_equal"] = sorted(gathered) == sorted(expected)
        report["sharded_weights_equal"] = all(torch.equal(gathered[k], expected[k]) for k in expected)
        report["features_equal"] = bool(torch.equal(features, reference.features(ids, positions, documents)))
        report["whole_weights_equal"] = all(d == digest(expected) for d in whole_digests)
        report["reference_tied"] = reference.lm_head.weight is reference.embed_tokens.weight
    Path(out_dir, f"rank-{env.rank}.json").write_text(json.dumps(report, indent=1))
    env.barrier()
    shutdown(env)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
