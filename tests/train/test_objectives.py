"""The recipe's choices: the KL objective and D-PACE weights against their plain definitions, the target-label
objectives and the label agreement on both target families, warmup-stable-decay, and the mask-row warning.

The label agreement is measured on documents whose answers are the target's own greedy continuation (what the
generate stage writes with a greedy target): every trained label is then the target's argmax, so the share is 1
in float32. Answers sampled at a high temperature are not what the target would say, and the share drops. (A
random target loops whatever its prompt, so a wrong template or thinking mode shows on the speaking target:
tests/evaluate/test_speaking_target.py.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from dflash_train.data.batch import pack_documents
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.mask_token import warn_on_zero_mask_row
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.sections import TrainingRecipe
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.loss import dflash_loss, dpace_weights, linear_token_loss
from dflash_train.training.optim import warmup_stable_decay
from dflash_train.training.step import dflash_step
from tests.support.qwen_assets import qwen_special_ids
from tests.support.step_recipe import step_recipe, step_runtime

ARCH_IDS = {"qwen3": [1, 2], "qwen3_6": [2, 3]}
ARCH_LAYERS = {"qwen3": 4, "qwen3_6": 8}


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_chunked_kl_equals_the_plain_kl_in_value_and_gradient(chunk: int) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.randn(13, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    soft = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    labels = (soft @ head.detach().t()).argmax(-1)
    loss, pred = linear_token_loss(hidden, head, labels, soft, chunk)
    p = torch.softmax(soft @ head.t(), -1)
    ref = (p * (torch.log_softmax(soft @ head.t(), -1) - torch.log_softmax(hidden @ head.t(), -1))).sum(-1)
    torch.testing.assert_close(loss, ref.detach())
    assert torch.equal(pred, (hidden @ head.t()).argmax(-1))
    assert (loss >= -1e-12).all()  # a KL
    scale = torch.rand(9, generator=gen, dtype=torch.float64)
    (loss * scale).sum().backward()
    g_h, g_w = hidden.grad.clone(), head.grad.clone()
    hidden.grad = head.grad = None
    (ref * scale).sum().backward()
    torch.testing.assert_close(g_h, hidden.grad)
    torch.testing.assert_close(g_w, head.grad)


def test_kl_to_a_one_hot_like_target_is_the_cross_entropy() -> None:
    """A target distribution sharpened to one token: KL -> CE on that token (its entropy -> 0)."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    head = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    soft = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 1e4
    labels = (soft @ head.t()).argmax(-1)
    kl, _ = linear_token_loss(hidden, head, labels, soft)
    ce, _ = linear_token_loss(hidden, head, labels)
    torch.testing.assert_close(kl, ce)
    torch.testing.assert_close(ce, F.cross_entropy(hidden @ head.t(), labels, reduction="none"))


def test_dpace_weights_follow_speculators_definition() -> None:
    """w_k = m_k * sum_{j>=k} m_j prod_{i<=j} s_i, s_i = (1-a) exp(-CE_i) + a (1 where untrained)."""
    ce = torch.tensor([[0.0, 0.2, 1.0, 3.0, 0.5]])
    mask = torch.tensor([[False, True, True, False, True]])
    alpha = 0.5
    w = dpace_weights(ce, mask, alpha)
    s = [1.0 if not m else (1 - alpha) * float(torch.exp(-c)) + alpha for c, m in zip(ce[0], mask[0], strict=True)]
    prefix = [float(torch.tensor(s[: j + 1]).prod()) for j in range(5)]
    want = [float(mask[0, k]) * sum(prefix[j] * float(mask[0, j]) for j in range(k, 5)) for k in range(5)]
    torch.testing.assert_close(w[0], torch.tensor(want))
    assert w[0, 1] > w[0, 2] > w[0, 4] > 0 and w[0, 0] == 0 and w[0, 3] == 0


def test_dflash_loss_with_dpace_is_the_dpace_weighted_mean() -> None:
    gen = torch.Generator().manual_seed(2)
    rows, n, block, h, vocab = 1, 2, 4, 8, 30
    hidden = torch.randn(rows, n * block, h, generator=gen, requires_grad=True)
    head = torch.randn(vocab, h, generator=gen)
    labels = torch.randint(0, vocab, (rows, n, block), generator=gen)
    weight = torch.ones(rows, n, block, dtype=torch.bool)
    weight[..., 0] = False
    out = dflash_loss(hidden, head, labels, weight, gamma=4.0, weighting="dpace", dpace_alpha=0.5)
    ce = F.cross_entropy((hidden.view(-1, h) @ head.t()), labels.view(-1), reduction="none").view(n, block)
    w = dpace_weights(ce.detach(), weight.view(n, block), 0.5)
    torch.testing.assert_close(out.loss, (ce * w).sum() / w.sum())
    torch.testing.assert_close(out.loss_sum / out.weight_sum, out.loss)
    out.loss.backward()
    assert hidden.grad is not None and hidden.grad[0, 0].abs().sum() == 0


def test_warmup_stable_decay_holds_the_peak_then_decays_linearly() -> None:
    f = [warmup_stable_decay(s, 2, 10, 0.0, 0.2) for s in range(10)]
    assert f[:2] == [0.5, 1.0] and f[2:8] == [1.0] * 6
    assert f[8] == pytest.approx(0.5) and f[9] == pytest.approx(0.0)
    assert warmup_stable_decay(9, 0, 10, 0.1, 0.5) == pytest.approx(0.1)


def _answers(model_dir: Path, prompts: list[list[int]], new: int, sample: bool = False) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    torch.manual_seed(0)
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=sample, pad_token_id=0,
                                 eos_token_id=None, **({"temperature": 5.0, "top_k": 0} if sample else {}))
            out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def agreement_setup(arch_target_dir: Path, target_arch: str, qwen_docs):
    special = qwen_special_ids(target_arch)
    prompts = [[special["im_start"], *doc[:6], special["im_end"], special["im_start"]] for doc, _ in qwen_docs[:3]]
    cfg = DrafterConfig.debug(mask_token_id=special["mask"], target_layer_ids=ARCH_IDS[target_arch],
                              num_target_layers=ARCH_LAYERS[target_arch])
    target = FrozenTarget.from_pretrained(arch_target_dir, cfg.target_layer_ids, keep_output=True)

    def docs(answers: list[list[int]]) -> list[tuple[list[int], list[bool]]]:
        return [(p + a, [False] * len(p) + [True] * len(a)) for p, a in zip(prompts, answers, strict=True)]

    return (cfg, target, docs(_answers(arch_target_dir, prompts, 24)),
            docs(_answers(arch_target_dir, prompts, 24, sample=True)))


def _agreement(cfg: DrafterConfig, target: FrozenTarget, docs, recipe: TrainingRecipe,
               ) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    out = dflash_step(drafter, target, pack_documents(docs, 128), cfg, recipe, step_runtime(),
                      torch.Generator().manual_seed(0))
    assert out.tokens > 0 and out.agreed >= 0
    return out.agreed / out.tokens, out.loss


def test_label_agreement_is_full_on_the_targets_own_greedy_answers_and_drops_on_sampled_ones(agreement_setup):
    cfg, target, right, wrong = agreement_setup
    recipe = step_recipe(label_agreement=True)
    own, _ = _agreement(cfg, target, right, recipe)
    drifted, _ = _agreement(cfg, target, wrong, recipe)
    assert own == 1.0
    assert drifted < 0.5, drifted


def test_a_step_that_skips_the_agreement_computes_the_same_loss_and_target_labels_still_measure(agreement_setup):
    """On both target families: a step told not to measure the agreement (the trainer's steps between measurements)
    reports none and the same loss under data_ce; an objective that reads the target's labels measures it anyway."""
    cfg, target, right, _ = agreement_setup
    docs = pack_documents(right, 128)

    def step(recipe: TrainingRecipe, measure: bool):
        torch.manual_seed(0)
        return dflash_step(DFlashDrafter(cfg), target, docs, cfg, recipe, step_runtime(),
                           torch.Generator().manual_seed(0), measure_agreement=measure)

    data_ce = step_recipe(label_agreement=True)
    measured, skipped = step(data_ce, True), step(data_ce, False)
    assert measured.agreed > 0 and skipped.agreed == -1
    assert torch.equal(measured.loss, skipped.loss)
    assert step(step_recipe(objective="target_argmax_ce"), False).agreed == measured.agreed


def test_target_label_objectives_train_on_the_targets_tokens(agreement_setup):
    """On the target's own answers the argmax objective is the data objective; after the wrong template it is
    not (its labels are the target's, not the sampled data's), and KL is a finite non-negative loss."""
    cfg, target, right, wrong = agreement_setup
    data = _agreement(cfg, target, right, step_recipe(label_agreement=True))[1]
    argmax = _agreement(cfg, target, right, step_recipe(objective="target_argmax_ce"))[1]
    torch.testing.assert_close(argmax, data)
    assert not torch.equal(_agreement(cfg, target, wrong, step_recipe(objective="target_argmax_ce"))[1],
                           _agreement(cfg, target, wrong, step_recipe(label_agreement=True))[1])
    kl = _agreement(cfg, target, right, step_recipe(objective="target_kl"))[1]
    assert torch.isfinite(kl) and float(kl) >= 0


def test_a_target_without_its_output_layers_is_refused_for_target_labels(arch_target_dir: Path, target_arch: str,
                                                                        qwen_docs):
    cfg = DrafterConfig.debug(mask_token_id=qwen_special_ids(target_arch)["mask"],
                              target_layer_ids=ARCH_IDS[target_arch], num_target_layers=ARCH_LAYERS[target_arch])
    target = FrozenTarget.from_pretrained(arch_target_dir, cfg.target_layer_ids)
    with pytest.raises(ValueError, match="keep_output"):
        dflash_step(DFlashDrafter(cfg), target, pack_documents(qwen_docs[:2], 64), cfg,
                    step_recipe(objective="target_kl"), step_runtime())


def test_a_zero_mask_row_is_warned_about(tiny_target_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = FrozenTarget.from_pretrained(tiny_target_dir, [1, 2])
    mask = qwen_special_ids("qwen3")["mask"]
    with torch.no_grad():
        target.embed_tokens.weight[mask] = 0.0
    with caplog.at_level(logging.WARNING):
        assert warn_on_zero_mask_row(target, mask)
    assert f"mask token {mask} has an all-zero embedding row" in caplog.text
    with torch.no_grad():
        target.embed_tokens.weight[mask] = 0.01
    assert not warn_on_zero_mask_row(target, mask)


def test_the_label_agreement_on_one_step_in_n_changes_no_step_and_is_carried_between(tmp_path: Path) -> None:
    """label_agreement_every 4 measures steps 1 and 5 (the same figures as measuring every step), logs step 1's
    measurement in the windows between, and trains exactly as measuring every step does: under data_ce the
    target's greedy tokens feed no gradient."""
    from dflash_shared.storage import ObjectStore
    from dflash_train.config import debug
    from dflash_train.stage import run
    from dflash_train.training.metrics import read_scalars
    from tests.train.train_fixtures import generated_answers, identity_of, synthetic_docs, tiny_target, write_tokenized

    # The target's own greedy answers (agreement 1) among documents it would not write (agreement 0): each step's
    # share depends on its rows.
    own = [(p + c, [0] * len(p) + [1] * len(c)) for p, c in generated_answers()[:20]]
    store = ObjectStore()
    data = write_tokenized(store, str(tmp_path / "tok"), own + synthetic_docs(20, max_len=60),
                           identity_of(tiny_target()), shards=2)
    curves = {}
    for every in (1, 4):
        out = str(tmp_path / f"every{every}")
        run(debug(data, out, str(tiny_target()), scratch_dir=str(tmp_path / f"scratch{every}"), max_steps=5,
                  max_length=128, batch_tokens=256, log_every=1, checkpoint_every=5, label_agreement_every=every))
        curves[every] = (read_scalars(store, out, "train/loss"), read_scalars(store, out, "train/label_agreement"))
    (loss_all, agree_all), (loss_some, agree_some) = curves[1], curves[4]
    assert loss_some == loss_all and sorted(loss_all) == [1, 2, 3, 4, 5]
    assert sorted(agree_all) == sorted(agree_some) == [1, 2, 3, 4, 5]
    assert agree_some[1] == agree_all[1] and agree_some[5] == agree_all[5]
    assert agree_some[2] == agree_some[3] == agree_some[4] == agree_all[1]
    # Each step measured its own labels: were they all alike the carried windows could not be told apart.
    assert len(set(agree_all.values())) > 1, agree_all
