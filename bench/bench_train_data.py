"""Train-stage data loader against the training step it feeds, side by side (`make bench-train`).

Writes synthetic tokenized shards (document lengths spread like chat answers, up to --max-length), then
measures in one process:
  (a) the data loader alone: shards from the local cache, packing plan, epoch order and packed batches
      (the trainer's `StepLoader`, background thread included) in token slots (rows x max_length) per s;
  (b) the training step on the same batch shape: target features, drafter forward, chunked LM-head loss,
      backward and AdamW (the tiny test target on this machine's device), in token slots per second.
The loader must deliver at least 10x what the step consumes, or it would become the bottleneck as soon
as the step gets faster (a GPU, a smaller drafter); the script exits 1 when it does not.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

REQUIRED_RATIO = 10.0


@dataclass(frozen=True)
class Rates:
    loader_tokens_per_s: float
    step_tokens_per_s: float

    @property
    def ratio(self) -> float:
        return self.loader_tokens_per_s / self.step_tokens_per_s


def make_shards(work: Path, docs: int, max_length: int, shards: int, seed: int = 0) -> tuple[list, str]:
    """Synthetic tokenized shards in the tokenize stage's Arrow format; returns (Shard list, a digest)."""
    import numpy as np
    import pyarrow as pa

    from dflash_shared.manifests import Shard
    from dflash_tokenize.arrow_shards import Sequences

    rng = np.random.default_rng(seed)
    # Log-uniform lengths: many short answers, some as long as a row.
    lengths = np.exp(rng.uniform(np.log(64), np.log(max_length), docs)).astype(np.int64)
    out = []
    for index in range(shards):
        part = lengths[index::shards]
        offsets = np.concatenate([[0], np.cumsum(part)]).astype(np.int64)
        ids = rng.integers(0, 150_000, int(offsets[-1]), dtype=np.int32)
        mask = (rng.random(int(offsets[-1])) < 0.7).astype(np.int8)
        seqs = Sequences([f"d{index}-{i}" for i in range(len(part))], ids, mask, offsets)
        batch = seqs.to_record_batch()
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        data = sink.getvalue().to_pybytes()
        path = work / f"part-{index:05d}.arrow"
        path.write_bytes(data)
        out.append(Shard(uri=str(path), bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), records=len(part)))
    return out, hashlib.sha256("".join(s.sha256 for s in out).encode()).hexdigest()


def loader_rate(work: Path, shards: list, digest: str, max_length: int, rows_per_step: int, steps: int) -> float:
    from dflash_shared.storage import ObjectStore
    from dflash_train.data.loader import StepLoader
    from dflash_train.data.plan import build_plan
    from dflash_train.data.shards import ShardCache

    store = ObjectStore()
    cache = ShardCache(store, str(work / "cache"), 2**34)
    plan = build_plan(store, str(work / "plan.json"), shards, digest, cache, max_length, 0, 0, 1, lambda o: [o])
    steps = min(steps, plan.rows_per_epoch // rows_per_step)
    loader = StepLoader(plan, cache, rows_per_step, 1, 0, 1, 0, steps)
    started = time.perf_counter()
    try:
        done = sum(1 for _ in loader)
    finally:
        loader.close()
        cache.close()
    return done * rows_per_step * max_length / (time.perf_counter() - started)


def step_rate(work: Path, shards: list, digest: str, max_length: int, rows: int, steps: int, device: str,
              num_anchors: int = 64) -> float:
    import torch

    from dflash_shared.storage import ObjectStore
    from dflash_train.data.loader import StepLoader
    from dflash_train.data.plan import build_plan
    from dflash_train.data.shards import ShardCache
    from dflash_train.drafter.config import DrafterConfig
    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.target_model.frozen import FrozenTarget
    from dflash_train.training.step import dflash_step
    from tests.support.step_recipe import step_recipe, step_runtime
    from tests.support.tiny_target import build_tiny_qwen3

    store = ObjectStore()
    cache = ShardCache(store, str(work / "cache"), 2**34)
    plan = build_plan(store, str(work / "plan.json"), shards, digest, cache, max_length, 0, 0, 1, lambda o: [o])
    loader = StepLoader(plan, cache, rows, rows, 0, 1, 0, steps + 1)
    batches = [item.micro[0] for item in loader]
    loader.close()
    cache.close()
    cfg = DrafterConfig.debug()
    # CE on the data under exponential decay, sdpa attention: the step these rates were first measured with.
    recipe, runtime = step_recipe(num_anchors=num_anchors), step_runtime()
    target = FrozenTarget.from_pretrained(build_tiny_qwen3(), cfg.target_layer_ids, device=device)
    drafter = DFlashDrafter(cfg).to(device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)

    def one(batch: object, step: int) -> None:
        out = dflash_step(drafter, target, batch.to(device), cfg, recipe, runtime,  # type: ignore[attr-defined]
                          torch.Generator(device=device).manual_seed(step), noise=True)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    one(batches[0], 0)  # first call pays one-off allocations
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for step, batch in enumerate(batches[1:], start=1):
        one(batch, step)
    if device == "cuda":
        torch.cuda.synchronize()
    return steps * rows * max_length / (time.perf_counter() - started)


def measure(work: Path, docs: int = 4000, max_length: int = 4096, shards: int = 4, rows_per_step: int = 8,
            loader_steps: int = 50, step_rows: int = 1, train_steps: int = 3, device: str = "cpu",
            num_anchors: int = 64) -> Rates:
    shard_list, digest = make_shards(work, docs, max_length, shards)
    return Rates(
        loader_tokens_per_s=loader_rate(work, shard_list, digest, max_length, rows_per_step, loader_steps),
        step_tokens_per_s=step_rate(work, shard_list, digest, max_length, step_rows, train_steps, device,
                                    num_anchors),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--docs", type=int, default=4000, help="synthetic documents")
    parser.add_argument("--max-length", type=int, default=4096, help="tokens per packed row")
    parser.add_argument("--rows-per-step", type=int, default=8, help="rows per loader step")
    parser.add_argument("--loader-steps", type=int, default=50, help="loader steps to time")
    parser.add_argument("--train-steps", type=int, default=3, help="training steps to time")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-train-data-") as tmp:
        rates = measure(Path(tmp), args.docs, args.max_length, 4, args.rows_per_step, args.loader_steps, 1,
                        args.train_steps, args.device)
    print(f"data loader:    {rates.loader_tokens_per_s:>14,.0f} token slots/s (packed rows x max_length)")
    print(f"training step:  {rates.step_tokens_per_s:>14,.0f} token slots/s ({args.device}, tiny target)")
    print(f"ratio:          {rates.ratio:>14,.1f}x (required >= {REQUIRED_RATIO:g}x)")
    sys.exit(0 if rates.ratio >= REQUIRED_RATIO else 1)


if __name__ == "__main__":
    main()
