"""Held-out acceptance while training: how much of each drafted block the target would accept, on data the
drafter never trains on, every `heldout_every` steps.

A fixed part of the tokenize stage's held-out split (its first `heldout_documents` documents, in shard order) is
packed once into rows of the run's length. At each measurement the drafter drafts blocks at that data's anchors
(the run's anchor rules, drawn with a fixed seed, so every measurement sees the same blocks) and each block's
accepted prefix is counted as the engine counts it: slots 1, 2, ... while the drafter's token is the label, where
the label is the trainer target's own greedy token (what a verifier accepts) when the target keeps its output
layers, else the data token. The figures: `heldout_tau` (1 + the mean accepted prefix per block) and
`heldout_acc_k` (the share of blocks whose first k drafted slots are all accepted).

Why it differs from the evaluate stage's offline tau: here every block is drafted in the data's own context
(teacher-forced: the context holds the data's tokens, not the tokens the drafter's earlier blocks committed), at
anchors spread over the answers rather than at each block boundary of one decode, and a block is cut where its
document's trained tokens end. Free decoding reaches the same contexts only while it agrees with the data, so the
held-out figure is an upper bound of the offline tau when the data is the target's own greedy output.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from dflash_shared.manifests import Shard
from dflash_train.data.batch import PackedBatch, pack_documents
from dflash_train.data.shards import ShardCache
from dflash_train.drafter.config import DrafterConfig
from dflash_train.parallel.distributed import DistEnv
from dflash_train.sections import TrainingRecipe, TrainingRuntime
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.precision import autocast
from dflash_train.training.step import dflash_step

log = logging.getLogger(__name__)
HELDOUT_SEED = 20_261_206  # the fixed anchors of every measurement


def heldout_rows(cache: ShardCache, shards: Sequence[Shard], documents: int, max_length: int) -> PackedBatch | None:
    """The first `documents` held-out documents (shard order), packed into rows of `max_length`; None: none."""
    docs: list[tuple[list[int], list[int]]] = []
    for shard in shards:
        table = cache.read(shard)
        for i in range(len(table)):
            if len(docs) >= documents:
                break
            docs.append(table.document(i))
        cache.release(shard)
        if len(docs) >= documents:
            break
    docs = [(ids, mask) for ids, mask in docs if any(mask)]
    return pack_documents(docs, max_length) if docs else None


def accepted_prefix(hits: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[blocks] accepted drafted slots per block that has a trained slot 1: the run of hits from slot 1 on."""
    blocks = hits.reshape(-1, hits.shape[-1])[:, 1:]
    first = weight.reshape(-1, weight.shape[-1])[:, 1]
    return torch.cumprod(blocks.long(), dim=1).sum(dim=1)[first]


@torch.no_grad()
def heldout_acceptance(model: torch.nn.Module, target: FrozenTarget, rows: PackedBatch, cfg: DrafterConfig,
                       recipe: TrainingRecipe, runtime: TrainingRuntime, env: DistEnv) -> dict[str, float]:
    """`heldout_tau` and `heldout_acc_k` over the rows (split over the ranks, summed; see the module docstring):
    the run's anchors and kernels, with the target's own greedy token as the label where the target keeps its output
    layers (what decoding accepts), and no label agreement to measure; under the runtime's autocast."""
    recipe = recipe.model_copy(update={"objective": "target_argmax_ce" if target.keep_output else "data_ce",
                                       "position_weighting": "exp_decay", "label_agreement": False})
    micro_rows = runtime.micro_batch_rows
    drafted = cfg.block_size - 1
    sums = torch.zeros(2 + drafted, dtype=torch.float64, device=env.device)  # blocks, accepted, reached[k]
    was_training = model.training
    model.eval()
    try:
        total = rows.shape[0]
        for start in range(env.rank * micro_rows, total, env.world_size * micro_rows):
            batch = rows.rows(start, min(start + micro_rows, total)).to(env.device)
            gen = torch.Generator(device=env.device).manual_seed(HELDOUT_SEED + start)
            with autocast(runtime, env.device):
                out = dflash_step(model, target, batch, cfg, recipe, runtime, gen,  # type: ignore[arg-type]
                                  noise=False)
            assert out.hits is not None and out.trained is not None
            accepted = accepted_prefix(out.hits, out.trained)
            head = torch.tensor([float(accepted.numel()), float(accepted.sum())], dtype=torch.float64)
            reached = torch.tensor([float((accepted > k).sum()) for k in range(drafted)], dtype=torch.float64)
            sums += torch.cat([head, reached]).to(env.device)
    finally:
        model.train(was_training)
    totals = env.all_reduce_sum(sums).cpu().tolist()
    blocks = max(totals[0], 1.0)
    metrics = {"heldout_tau": 1.0 + totals[1] / blocks, "heldout_blocks": totals[0]}
    metrics.update({f"heldout_acc_{k + 1}": totals[2 + k] / blocks for k in range(drafted)})
    return metrics
