"""The offline loop on the families beyond the two every test runs on: the mixtures of experts (Qwen3-MoE;
Qwen3.6-MoE, a hybrid with a shared expert) and Qwen2.5. The target's greedy output whatever the drafts, with a
rejection forced at a chosen slot, and with every draft accepted. Routing is per token, so a verification of a
block routes each token as plain decoding does."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from dflash_train.drafter.model import DFlashDrafter
from dflash_train.evaluate import speculate
from dflash_train.evaluate.speculate import HookedTarget, greedy_reference, speculative_generate
from tests.evaluate import eval_fixtures as ef
from tests.evaluate.forced_drafts import forced_drafts
from tests.support.qwen_assets import qwen_special_ids
from tests.support.tiny_target import MOE_ARCHS, QWEN2_ARCHS, TargetArch, build_tiny_target

NEW_TOKENS = 32
BLOCK = 8
# Each fixture's dense sibling: its vocabulary, and the drafter shape the evaluate tests use for it.
DENSE_SIBLING: dict[str, TargetArch] = {"qwen3_moe": "qwen3", "qwen3_6_moe": "qwen3_6", "qwen2": "qwen2"}


@functools.cache
def _setup(arch: TargetArch) -> tuple[Any, Any, list[int], list[int], tuple[int, int], int]:
    """(hooked target, untrained drafter, a held-out prompt, its greedy reference, stop ids, mask id)."""
    import torch

    target_dir = build_tiny_target(arch)
    model = ef.load_target(target_dir)
    special = qwen_special_ids(DENSE_SIBLING[arch])  # type: ignore[arg-type]
    torch.manual_seed(0)
    drafter = DFlashDrafter(ef.drafter_config(BLOCK, DENSE_SIBLING[arch])).eval().requires_grad_(False)
    stops = (special["im_end"], special["endoftext"])
    prompt = ef.chat_prompts(target_dir, ef.heldout_texts(1))[0]
    reference = greedy_reference(model, prompt, NEW_TOKENS, stops)
    return HookedTarget(model, drafter.config.target_layer_ids), drafter, prompt, reference, stops, special["mask"]


@pytest.mark.parametrize("arch", MOE_ARCHS + QWEN2_ARCHS)
@pytest.mark.parametrize("wrong_at", [None, 3, BLOCK - 1])
def test_the_other_families_targets_decode_their_own_greedy_output(arch: TargetArch, wrong_at: int | None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """None: the untrained drafter's own drafts (rejected); 3: drafts right up to that slot; BLOCK - 1: the
    whole block right, every step."""
    hooked, drafter, prompt, reference, stops, mask_id = _setup(arch)
    if wrong_at is not None:
        assert mask_id not in reference
        monkeypatch.setattr(speculate, "propose", forced_drafts(reference, wrong_at, mask_id))
    result = speculative_generate(drafter, hooked, prompt, NEW_TOKENS, stops, BLOCK)
    assert result.tokens == reference
    if wrong_at is not None:
        assert result.accepted[:-1] == [wrong_at] * (len(result.accepted) - 1)
