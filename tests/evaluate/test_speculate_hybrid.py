"""The offline loop on the Qwen3.6 architecture (Gated DeltaNet + full attention): lossless where blocks are
partly rejected, because the linear-attention state is restored after each rejection.

`cache.crop` alone leaves the recurrent state polluted by rejected drafts. On this tiny target the polluted
state rarely flips an argmax (its greedy output is dominated by the embedding's residual), so the rollback is
also checked where the bug shows whatever the logits: the cache after a rejection against a fresh prefill.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash_shared.evaluation_report import OfflineReport
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_train.evaluate import speculate
from dflash_train.evaluate.speculate import HookedTarget, greedy_reference, speculative_generate
from tests.evaluate import eval_fixtures as ef
from tests.evaluate.forced_drafts import forced_drafts

NEW_TOKENS = 32
PROMPTS = 8


@pytest.fixture(scope="module")
def hybrid_references(hybrid_model: Any, hybrid_target_dir: Path,
                      hybrid_heldout_prompts: list[list[int]]) -> list[list[int]]:
    stops = ef.stop_ids(hybrid_target_dir)
    return [greedy_reference(hybrid_model, p, NEW_TOKENS, stops) for p in hybrid_heldout_prompts[:PROMPTS]]


def test_the_fixture_is_the_hybrid_architecture(hybrid_model: Any, hybrid_target_dir: Path) -> None:
    config = json.loads((hybrid_target_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and config["model_type"] == "qwen3_5"
    layer_types = hybrid_model.config.layer_types
    assert layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert hybrid_model.lm_head.weight.data_ptr() != hybrid_model.get_input_embeddings().weight.data_ptr()


# The untrained drafter is rejected at every step (a replay each time): one block size is enough for it.
@pytest.mark.parametrize(("which", "block_size"), [("trained", 8), ("trained", 16), ("untrained", 8)])
def test_hybrid_output_is_the_targets_greedy_output(which: str, block_size: int, request: pytest.FixtureRequest,
                                                   hybrid_hooked_target: Any, hybrid_target_dir: Path,
                                                   hybrid_heldout_prompts: list[list[int]],
                                                   hybrid_references: list[list[int]]) -> None:
    drafter = request.getfixturevalue(f"hybrid_{which}_drafter")
    stops = ef.stop_ids(hybrid_target_dir)
    rejected = accepted_whole = 0
    for prompt, reference in zip(hybrid_heldout_prompts[:PROMPTS], hybrid_references, strict=True):
        result = speculative_generate(drafter, hybrid_hooked_target, prompt, NEW_TOKENS, stops, block_size)
        assert result.tokens == reference
        rejected += sum(n < block_size - 1 for n in result.accepted)
        accepted_whole += sum(n == block_size - 1 for n in result.accepted)
        # Every step that did not accept the whole block rebuilt the linear-attention state once.
        assert result.state_replays == sum(n < block_size - 1 for n in result.accepted)
    if which == "trained":
        assert rejected > 0 and accepted_whole > 0  # both rollback paths ran


@pytest.mark.parametrize("wrong_at", [0, 1, 3, 6])
def test_rejection_at_every_slot_stays_lossless(wrong_at: int, monkeypatch: pytest.MonkeyPatch,
                                                hybrid_hooked_target: Any, hybrid_untrained_drafter: Any,
                                                hybrid_target_dir: Path, hybrid_heldout_prompts: list[list[int]],
                                                hybrid_references: list[list[int]]) -> None:
    """Drafts right up to slot `wrong_at` and wrong there: every step accepts exactly `wrong_at` tokens."""
    block = 8
    mask_id = ef.special_ids(hybrid_target_dir)["mask"]
    reference = hybrid_references[0]
    assert mask_id not in reference
    monkeypatch.setattr(speculate, "propose", forced_drafts(reference, wrong_at, mask_id))
    result = speculative_generate(hybrid_untrained_drafter, hybrid_hooked_target, hybrid_heldout_prompts[0],
                                  NEW_TOKENS, ef.stop_ids(hybrid_target_dir), block)
    assert result.tokens == reference
    assert result.accepted[:-1] == [wrong_at] * (len(result.accepted) - 1)


def _states_after_rejection(target: HookedTarget, prompt: list[int], reference: list[int], mask_id: int,
                            accepted: int, restore: bool) -> tuple[Any, Any]:
    """(cache after verifying a block that is right for `accepted` drafts and then wrong, a fresh cache
    prefilled with the same committed tokens)."""
    import torch

    from dflash_train.evaluate.speculate import _Context, commit_verified

    cache = target.new_cache()
    target.forward(torch.tensor(prompt), cache, logits_to_keep=1)
    verify = torch.tensor([*reference[: accepted + 1], *[mask_id] * (7 - accepted)])
    before = target.recurrent_states(cache) if restore else {}
    _, features = target.forward(verify, cache)
    commit_verified(target, cache, verify, features, accepted, before, _Context())
    fresh = target.new_cache()
    target.forward(torch.tensor([*prompt, *reference[: accepted + 1]]), fresh, logits_to_keep=1)
    return cache, fresh


@pytest.mark.parametrize("accepted", [0, 3])
def test_rolled_back_state_equals_a_fresh_prefill(accepted: int, hybrid_hooked_target: Any,
                                                  hybrid_target_dir: Path, hybrid_heldout_prompts: list[list[int]],
                                                  hybrid_references: list[list[int]]) -> None:
    """After a rejection the cache is what a prefill of the committed tokens gives, in every layer kind; with
    crop alone (the loop's former behaviour) the linear-attention states are far off."""
    import torch

    mask_id = ef.special_ids(hybrid_target_dir)["mask"]
    prompt, reference = hybrid_heldout_prompts[0], hybrid_references[0]
    cache, fresh = _states_after_rejection(hybrid_hooked_target, prompt, reference, mask_id, accepted, True)
    assert cache.get_seq_length() == fresh.get_seq_length() == len(prompt) + accepted + 1
    linear = [i for i, kind in enumerate(hybrid_hooked_target.config.layer_types) if kind == "linear_attention"]
    for i in linear:
        torch.testing.assert_close(cache.layers[i].recurrent_states[0], fresh.layers[i].recurrent_states[0],
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cache.layers[i].conv_states[0], fresh.layers[i].conv_states[0][..., -4:])
    polluted, _ = _states_after_rejection(hybrid_hooked_target, prompt, reference, mask_id, accepted, False)

    def worst(candidate: Any) -> float:
        return max((candidate.layers[i].recurrent_states[0] - fresh.layers[i].recurrent_states[0]).abs().max().item()
                   for i in linear)

    # The restored state differs from the fresh one only by float rounding; the polluted one by far more.
    assert worst(polluted) > 100 * max(worst(cache), 1e-7)


def test_hybrid_evaluation_is_lossless_and_committed(hybrid_offline_run: Any) -> None:
    """The evaluate stage on the hybrid target: every held-out prompt identical to greedy, manifest committed."""
    loaded = load_manifest(hybrid_offline_run.store, hybrid_offline_run.evaluation, Kind.evaluation)
    (shard,) = loaded.manifest.shards
    report = OfflineReport.model_validate_json(hybrid_offline_run.store.read_bytes(shard.uri))
    assert report.lossless_checked == 16 and report.lossless_mismatches == []
    assert report.untrained is not None
    assert report.trained.tau > report.untrained.tau + 1.0
    assert loaded.manifest.section.target.model_id == "tiny-qwen3_6"


def test_a_lossless_mismatch_fails_the_evaluation(hybrid_offline_run: Any, tmp_path: Path) -> None:
    """A report whose check found a difference exits 65 naming prompt, position and margins; commits nothing."""
    from dflash_shared.errors import BadInputError, exit_code_for
    from dflash_shared.lossless import Parting
    from dflash_shared.storage import ObjectStore
    from dflash_train.evaluate.config import EvaluateConfig
    from dflash_train.evaluate.stage import commit

    store = hybrid_offline_run.store
    loaded = load_manifest(store, hybrid_offline_run.evaluation, Kind.evaluation)
    report = OfflineReport.model_validate_json(store.read_bytes(loaded.manifest.shards[0].uri))
    assert report.lossless is not None
    wrong = Parting(prompt_id=report.results[3].id, index=7, speculative_token=11, plain_token=12,
                    speculative_margin=-0.05, plain_margin=0.05, tie=False)
    bad = report.model_copy(update={"lossless": report.lossless.model_copy(update={"partings": [wrong]})})
    drafter = load_manifest(store, hybrid_offline_run.drafter, Kind.drafter)
    prompts = load_manifest(store, hybrid_offline_run.prompts, Kind.prompts)
    out = str(tmp_path / "evaluation")
    config = EvaluateConfig(drafter=hybrid_offline_run.export, prompts=hybrid_offline_run.prompts,
                            target="unused", output=out)
    with pytest.raises(BadInputError, match="exported drafter. is not lossless: greedy output with speculative "
                                            "decoding differs from output without it on 1/16 prompts") as err:
        commit(config, ObjectStore(), bad, drafter, prompts, loaded.manifest.accounting,
               loaded.manifest.section.target)
    assert f"prompt {report.results[3].id} at token 7: speculative 11, plain 12 (speculative margin -0.05 nats, " \
           "plain margin 0.05 nats)" in str(err.value)
    assert int(exit_code_for(err.value)) == 65
    assert not (tmp_path / "evaluation" / "manifest.json").exists()
    assert (tmp_path / "evaluation" / "evaluation.json").exists()  # the report is kept for diagnosis
