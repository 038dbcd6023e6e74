"""Compiled drafter layers: one static graph per anchor-ladder rung, shared by every layer, as designed.

The trainer compiles each drafter layer (`TrainConfig.compile`, through `initial_drafter`). Here the real
drafter (two sliding-window layers and one full-attention layer, flex attention captured into the layer's
graph) runs its forward on CPU (flex has no CPU backward) while the anchor count N cycles over three ladder
rungs twice, with anchors drawn by `sample_anchors` from documents whose loss masks put N on each rung.
Dynamo's counters then give the graphs compiled per step. The design (dflash_train.drafter.attention): without
gradients a new N compiles exactly one graph for all three layers, a known N none; in training (SDPA, the
CPU backend, with backward) a new N compiles two, the first layer's (its input, the frozen embeddings,
needs no gradient) and one shared by the other two. The control test shows the count can tell: torch's
default (automatic dynamic shapes) compiles a second, symbolic graph and nothing after it.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from dflash_train.config import TrainConfig
from dflash_train.data.batch import pack_row, stack_rows
from dflash_train.drafter.attention import (
    GRAPHS_PER_SHAPE,
    build_drafter_mask,
    compile_drafter_layers,
    raise_recompile_limit,
)
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.training.anchors import anchor_count_buckets, sample_anchors
from dflash_train.training.step import block_inputs
from dflash_train.training.warm_start import initial_drafter

# The start of flex's warning when it runs uncompiled (a layer that fell out of its compiled graph).
UNFUSED_FALLBACK = "flex_attention called without torch.compile"
SEQ, ROWS = 256, 2
# Block 8 and a 64-anchor row cap: the ladder is (16, 32, 64), three shapes.
CAP = 64
CYCLE = (16, 32, 64, 16, 32, 64)


def _config() -> DrafterConfig:
    return DrafterConfig.debug(layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                               sliding_window=48)


def _train_config(backend: str = "flex") -> TrainConfig:
    """The run's side of the drafter: CAP anchors per document and per row, the attention kernel, compiled."""
    return TrainConfig(input="in", output="out", target="t", compile=True, num_anchors=CAP, max_anchors_per_row=CAP,
                       attention_backend=backend)


def _batch(anchors_per_row: int, gen: torch.Generator):
    """Rows of two documents filling SEQ, whose trained tails give `anchors_per_row` valid anchors a row."""
    rows = []
    for _ in range(ROWS):
        first = anchors_per_row // 2
        tails = (first, anchors_per_row - first)
        lengths = (SEQ // 2, SEQ - SEQ // 2)
        # A trained tail of t + 1 tokens holds t valid anchors (p and p + 1 both trained, same document).
        docs = [(torch.randint(0, 1000, (n,), generator=gen).tolist(), [False] * (n - t - 1) + [True] * (t + 1))
                for n, t in zip(lengths, tails, strict=True)]
        rows.append(pack_row(docs, SEQ))
    return stack_rows(rows)


def _forward_counts(drafter: DFlashDrafter, cfg: DrafterConfig, config: TrainConfig, train: bool = False,
                    ) -> list[tuple[int, int]]:
    """(N, graphs compiled by that step) for each N of CYCLE, fresh documents and anchors every step;
    with `train`, forward and backward as in a training step (the embedding frozen, as the target's is)."""
    gen = torch.Generator().manual_seed(0)
    embedding = torch.nn.Embedding(cfg.mask_token_id + 1, cfg.hidden_size).requires_grad_(False)
    seen = []
    for rung in CYCLE:
        # 3/4 of the rung: more than the rung below holds, so sample_anchors must put N on this rung.
        batch = _batch(rung * 3 // 4, gen)
        anchor_pos, keep = sample_anchors(batch.loss_mask, batch.document_ids, config.num_anchors, cfg.block_size,
                                          gen, max_anchors_per_row=config.max_anchors_per_row)
        ids, positions = block_inputs(batch.input_ids, batch.position_ids, anchor_pos, cfg.block_size,
                                      cfg.mask_token_id)
        mask = build_drafter_mask(anchor_pos, keep, batch.document_ids, cfg.block_size, cfg.layer_types,
                                  cfg.sliding_window, config.attention_backend)
        features = torch.randn(ROWS, SEQ, cfg.feature_size, generator=gen)
        before = counters["stats"]["unique_graphs"]
        with torch.set_grad_enabled(train):
            out = drafter(embedding(ids), positions, features, batch.position_ids, mask)
            if train:
                out.square().mean().backward()
        assert torch.isfinite(out).all()
        seen.append((anchor_pos.shape[1], counters["stats"]["unique_graphs"] - before))
    return seen


@pytest.mark.filterwarnings(f"error:{UNFUSED_FALLBACK}:UserWarning")
def test_one_graph_per_ladder_rung_for_all_layers(fresh_dynamo):
    cfg, config = _config(), _train_config()
    assert anchor_count_buckets(cfg.block_size, config.max_anchors_per_row) == (16, 32, 64)
    drafter = initial_drafter(cfg, config.seed, config.runtime, torch.device("cpu"))[0].eval()
    # Set by initial_drafter before compiling, not by the first traced call.
    assert torch._dynamo.config.recompile_limit >= GRAPHS_PER_SHAPE * 3
    seen = _forward_counts(drafter, cfg, config)
    assert [n for n, _ in seen] == list(CYCLE), seen  # N did land on each of the three rungs
    # First visit of a rung: exactly one graph for the three layers (a guard on anything per layer, or a
    # limit set inside the trace, would give more); second visit: nothing compiled.
    assert [graphs for _, graphs in seen] == [1, 1, 1, 0, 0, 0], seen


def test_training_compiles_two_graphs_per_ladder_rung(fresh_dynamo):
    cfg = _config()
    config = _train_config("sdpa")  # flex has no CPU backward; the graph count does not depend on the backend
    drafter = initial_drafter(cfg, config.seed, config.runtime, torch.device("cpu"))[0].train()
    seen = _forward_counts(drafter, cfg, config, train=True)
    assert [n for n, _ in seen] == list(CYCLE), seen
    assert [graphs for _, graphs in seen] == [2, 2, 2, 0, 0, 0], seen
    assert all(p.grad is not None for p in drafter.layers[0].parameters())  # the backward did run


def test_the_default_dynamic_compile_gives_a_different_count(fresh_dynamo):
    """The control: the count above tells static from automatic-dynamic compilation."""
    cfg = _config()
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    raise_recompile_limit(3)
    for layer in drafter.layers:
        layer.compile()  # torch's default: a shape that changes is made symbolic on its second value
    seen = _forward_counts(drafter, cfg, _train_config())
    assert [n for n, _ in seen] == list(CYCLE), seen
    assert sum(graphs for _, graphs in seen) < 3, seen


def test_compile_drafter_layers_is_static_and_raises_the_limit_first(fresh_dynamo):
    torch._dynamo.config.recompile_limit = 8
    layers = DFlashDrafter(_config()).layers
    limit = compile_drafter_layers(layers, shapes=7)
    assert limit == torch._dynamo.config.recompile_limit >= GRAPHS_PER_SHAPE * 7
    assert all(layer._compiled_call_impl is not None for layer in layers)
    # A limit the caller raised further is kept.
    torch._dynamo.config.recompile_limit = 99
    assert raise_recompile_limit(7) == 99


def test_setting_the_limit_inside_a_traced_call_is_refused(fresh_dynamo):
    @torch.compile(fullgraph=True, dynamic=False)
    def traced(x: torch.Tensor) -> torch.Tensor:
        raise_recompile_limit(3)
        return x + 1

    with pytest.raises(Exception, match="inside a traced call"):
        traced(torch.zeros(2))
