"""Held-out acceptance while training: the accepted prefix per block, the held-out rows, and the figures' identity
tau = 1 + sum_k P(first k slots accepted); then the stage's run logs it and the manifest records it."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_shared.storage import ObjectStore
from dflash_train.config import debug
from dflash_train.data.shards import ShardCache
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.parallel.distributed import DistEnv
from dflash_train.stage import run
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.heldout import accepted_prefix, heldout_acceptance, heldout_rows
from tests.support.step_recipe import step_recipe, step_runtime
from tests.train.train_fixtures import identity_of, synthetic_docs, tiny_target, write_tokenized


def test_the_accepted_prefix_runs_from_slot_one_to_the_first_miss() -> None:
    hits = torch.tensor([[[False, True, True, False, True],   # 2 accepted, then a miss
                          [False, False, True, True, True],   # slot 1 missed: 0
                          [False, True, True, True, True],    # all 4
                          [False, False, False, False, False]]])  # slot 1 not trained: no block
    trained = torch.ones_like(hits)
    trained[..., 0] = False
    trained[0, 3] = False
    assert accepted_prefix(hits, trained).tolist() == [2, 0, 4]


def _data(tmp_path: Path) -> str:
    store = ObjectStore()
    heldout = [([5000 + t for t in ids], mask) for ids, mask in synthetic_docs(6, seed=1, max_len=60)]
    return write_tokenized(store, str(tmp_path / "tok"), synthetic_docs(40, max_len=60), identity_of(tiny_target()),
                           shards=2, heldout=heldout)


def test_heldout_rows_hold_only_heldout_documents_and_the_figures_add_up(tmp_path: Path) -> None:
    data = _data(tmp_path)
    store = ObjectStore()
    source = load_manifest(store, data, Kind.tokenized)
    cache = ShardCache(store, str(tmp_path / "cache"), 2**30)
    try:
        rows = heldout_rows(cache, source.manifest.split_shards("heldout"), 4, 128)
    finally:
        cache.close()
    assert rows is not None
    kept = rows.input_ids[rows.document_ids >= 0]
    assert bool((kept >= 5000).all())  # held-out documents only
    assert int(rows.document_ids.max()) + 1 <= 4 * rows.shape[0]
    cfg = DrafterConfig.debug(mask_token_id=151669)
    target = FrozenTarget.from_pretrained(tiny_target(), cfg.target_layer_ids, keep_output=True)
    torch.manual_seed(0)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    recipe, runtime = step_recipe(), step_runtime(micro_batch_rows=1)
    figures = heldout_acceptance(DFlashDrafter(cfg), target, rows, cfg, recipe, runtime, env)
    reached = [figures[f"heldout_acc_{k}"] for k in range(1, cfg.block_size)]
    assert figures["heldout_blocks"] > 0
    assert all(a >= b for a, b in zip(reached, reached[1:], strict=False))  # a prefix: never more at k+1
    assert abs(figures["heldout_tau"] - (1 + sum(reached))) < 1e-9
    # The same drafter measured again sees the same anchors: the measurement is fixed, not a fresh draw.
    torch.manual_seed(0)
    assert heldout_acceptance(DFlashDrafter(cfg), target, rows, cfg, recipe, runtime, env) == figures


def test_the_stage_logs_and_records_the_heldout_acceptance(tmp_path: Path) -> None:
    data = _data(tmp_path)
    out = str(tmp_path / "out")
    uri = run(debug(data, out, str(tiny_target()), scratch_dir=str(tmp_path / "scratch"), max_length=64,
                    batch_tokens=128, max_steps=6, heldout_every=3, heldout_documents=4, checkpoint_every=6))
    assert uri is not None
    section = load_manifest(ObjectStore(), out, Kind.drafter).section
    metrics = section.final_metrics
    assert 1.0 <= metrics["heldout_tau"] <= 8.0 and metrics["heldout_blocks"] > 0
    assert 0.0 <= metrics["label_agreement"] <= 1.0 and "label_agreement_first" in metrics
    assert section.recipe["objective"] == "data_ce" and section.recipe["steps"] == 6
