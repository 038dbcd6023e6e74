"""The compiled flex attention of the drafter compiles once per rung of the anchor ladder, never falls back.

Runs the real drafter forward with compiled flex attention on CPU (forward only: flex has no CPU
backward) over varied packed batches. A fallback to flex's unfused kernel is an error here: past dynamo's
recompile limit the call runs eagerly and flex warns that it materialises the full score matrix.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from dflash_train.data.batch import pack_row, stack_rows
from dflash_train.drafter.attention import build_drafter_mask, compiled_flex_attention, compiled_flex_on_cpu
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.sections import TrainingRecipe, TrainingRuntime
from dflash_train.training.anchors import anchor_count_buckets, sample_anchors

# The start of flex's warning when it runs without torch.compile (torch/nn/attention/flex_attention.py).
UNFUSED_FALLBACK = "flex_attention called without torch.compile"
SEQ = 128


def _batch(gen: torch.Generator, docs_per_row: int):
    rows = []
    for _ in range(2):
        docs = []
        for _ in range(docs_per_row):
            n = int(torch.randint(6, 21, (1,), generator=gen))
            docs.append(([9] * n, [False] * 2 + [True] * (n - 2)))
        rows.append(pack_row(docs, SEQ))
    return stack_rows(rows)


def _drafter_forward(drafter, cfg, recipe: TrainingRecipe, runtime: TrainingRuntime, batch, gen):
    anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, recipe.num_anchors, cfg.block_size, gen,
                                      max_anchors_per_row=runtime.max_anchors_per_row)
    mask = build_drafter_mask(anchor_pos, keep, batch.document_ids, cfg.block_size, cfg.layer_types,
                              cfg.sliding_window, runtime.attention_backend)
    q_len = anchor_pos.shape[1] * cfg.block_size
    embeds = torch.randn(2, q_len, cfg.hidden_size, generator=gen)
    features = torch.randn(2, SEQ, cfg.feature_size, generator=gen)
    positions = torch.arange(q_len).expand(2, q_len)
    with torch.no_grad(), compiled_flex_on_cpu():
        out = drafter(embeds, positions, features, batch.position_ids, mask)
    assert torch.isfinite(out).all()
    return anchor_pos.shape[1]


@pytest.mark.filterwarnings(f"error:{UNFUSED_FALLBACK}:UserWarning")
def test_compiled_flex_compiles_at_most_once_per_ladder_rung(fresh_dynamo):
    # Block 8 and a 32-anchor cap: the ladder is (16, 32), so two kernels for the whole run, shared by the
    # sliding and the full-attention layer.
    cfg = DrafterConfig.debug(layer_types=["sliding_attention", "full_attention"], sliding_window=24)
    recipe, runtime = TrainingRecipe(num_anchors=4), TrainingRuntime(max_anchors_per_row=32, attention_backend="flex")
    ladder = anchor_count_buckets(cfg.block_size, runtime.max_anchors_per_row)
    assert ladder == (16, 32)
    drafter = DFlashDrafter(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    seen = [_drafter_forward(drafter, cfg, recipe, runtime, _batch(gen, docs), gen)
            for docs in (2, 6, 3, 2, 5, 1, 4, 3)]
    assert set(seen) == set(ladder), seen  # both rungs used, fresh anchors and masks every step
    assert counters["stats"]["unique_graphs"] <= len(ladder), dict(counters["stats"])
    assert counters["stats"]["unique_graphs"] >= 1  # the kernel was compiled, not run eagerly


def test_a_fallback_to_the_unfused_kernel_fails_the_test(fresh_dynamo):
    """The tripwire of the test above works: with room for one shape only, the second shape falls back."""
    compiled = compiled_flex_attention()
    q = torch.randn(1, 1, 128, 16)
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(UserWarning, match=UNFUSED_FALLBACK):
        for kv_len in (128, 256):
            k = torch.randn(1, 1, kv_len, 16)
            compiled(q, k, k)
