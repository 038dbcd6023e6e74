"""Block labels and weights, position decay, chunked CE against the plain one, acceptance length."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from dflash_train.data.batch import pack_row, stack_rows
from dflash_train.training.loss import (
    block_targets,
    dflash_loss,
    expected_acceptance_length,
    linear_cross_entropy,
    linear_token_loss,
    per_position_accuracy,
    position_decay,
)


def test_slot_k_is_labelled_with_the_token_at_anchor_plus_k():
    docs = [(list(range(100, 110)), [0, 0, 1, 1, 1, 1, 0, 1, 1, 1]), (list(range(200, 204)), [1, 1, 1, 1])]
    batch = stack_rows([pack_row(docs, 16)])  # doc 0 at 0..9, doc 1 at 10..13, padding 14..15
    anchor_pos = torch.tensor([[2, 7, 12, 0]])
    keep = torch.tensor([[True, True, True, False]])
    labels, weight = block_targets(batch.input_ids, batch.loss_mask, batch.document_ids, anchor_pos, keep, 4)
    ids = batch.input_ids[0]
    for j, p in enumerate(anchor_pos[0].tolist()):
        for k in range(4):
            assert int(labels[0, j, k]) == int(ids[min(p + k, 15)])
    assert weight[0, 0].tolist() == [False, True, True, True]  # slot 0 never; 3,4,5 loss-masked
    assert weight[0, 1].tolist() == [False, True, True, False]  # 8, 9 in doc 0; 10 is the next document
    assert weight[0, 2].tolist() == [False, True, False, False]  # 13 in doc 1; 14, 15 padding
    assert not weight[0, 3].any()  # padded anchor


def test_block_that_runs_past_the_row_end_is_cut():
    batch = stack_rows([pack_row([(list(range(8)), [1] * 8)], 8)])
    labels, weight = block_targets(batch.input_ids, batch.loss_mask, batch.document_ids, torch.tensor([[5]]),
                                   torch.tensor([[True]]), 4)
    assert weight[0, 0].tolist() == [False, True, True, False]
    assert labels[0, 0, :3].tolist() == [5, 6, 7]


def test_position_decay():
    d = position_decay(16, 7.0)
    assert d[0] == 0 and d[1] == 1
    torch.testing.assert_close(d[5], torch.tensor(math.exp(-4 / 7)))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_ce_equals_plain_ce_in_value_and_gradient(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(53, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(97, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 97, (53,), generator=gen)
    tw = torch.rand(53, generator=gen, dtype=torch.float64)
    loss, pred = linear_cross_entropy(hidden, weight, labels, tw, chunk)
    loss.backward()
    g_h, g_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden @ weight.t()
    ref = (F.cross_entropy(logits, labels, reduction="none") * tw).sum()
    (ref * 3.0).backward()  # a non-unit upstream gradient is scaled through
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(pred, logits.argmax(-1))
    torch.testing.assert_close(g_h * 3.0, hidden.grad, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(g_w * 3.0, weight.grad, rtol=1e-6, atol=1e-9)


def test_chunked_ce_passes_gradcheck():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (5,), generator=gen)
    tw = torch.rand(5, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h, w: linear_cross_entropy(h, w, labels, tw, 2)[0], (hidden, weight))


@pytest.mark.parametrize("sharpness", [0.3, 10.0])
def test_a_bf16_head_keeps_its_logits_in_bf16_and_the_loss_close_to_their_exact_cross_entropy(sharpness):
    """A bf16 LM head (the GPU's, and the CPU's with target_dtype bf16) works on bf16 logits in place. Against the
    float64 cross-entropy of the same bf16 logits: the loss within 2^-8 (its rounded share: the non-argmax mass),
    the hidden states' gradient within bf16's own rounding. At 10x sharpness the drafter is confident (the label's
    probability ~0.96), where a plainly rounded row sum would be off by as much as the gradient at the label
    (0.7% of the gradient's norm measured that way, against 0.25% here)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(5000, 64, generator=gen).bfloat16()
    hidden = (torch.randn(64, 64, generator=gen) * sharpness).bfloat16().requires_grad_(True)
    logits = (hidden.detach() @ weight.t()).double()
    labels = logits.argmax(-1)
    loss, pred = linear_token_loss(hidden, weight, labels)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and torch.equal(pred, labels)
    ref = F.cross_entropy(logits, labels, reduction="none")
    assert float((loss.detach().double() - ref).abs().max()) < 2**-8
    probs = torch.softmax(logits, -1)
    probs[torch.arange(64), labels] -= 1.0
    ref_grad = probs @ weight.double()
    assert float((hidden.grad.double() - ref_grad).norm() / ref_grad.norm()) < 0.004


def test_dflash_loss_is_the_decayed_weighted_mean_with_slot_accuracy():
    gen = torch.Generator().manual_seed(1)
    rows, n, block, h, vocab = 2, 3, 4, 8, 50
    hidden = torch.randn(rows, n * block, h, generator=gen, requires_grad=True)
    head = torch.randn(vocab, h, generator=gen)
    labels = torch.randint(0, vocab, (rows, n, block), generator=gen)
    weight = torch.rand(rows, n, block, generator=gen) > 0.3
    weight[..., 0] = False
    labels[0, 0, 1] = int((hidden[0, 1] @ head.t()).argmax())  # at least one correct slot
    weight[0, 0, 1] = True
    out = dflash_loss(hidden, head, labels, weight, gamma=2.0, chunk_tokens=5)
    logits = hidden.view(rows, n, block, h) @ head.t()
    ce = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="none").view(rows, n, block)
    d = torch.exp(-(torch.arange(block) - 1) / 2.0)
    wd = weight.float() * d
    torch.testing.assert_close(out.loss, (ce * wd).sum() / wd.sum())
    right = (logits.argmax(-1) == labels) & weight
    assert out.counted.tolist() == weight.sum((0, 1)).tolist()
    assert out.correct.tolist() == right.sum((0, 1)).tolist()
    assert out.correct[1] >= 1 and out.counted[0] == 0
    out.loss.backward()
    assert hidden.grad[0, 0].abs().sum() == 0  # slot 0 gets no gradient


def test_no_trained_slot_gives_a_zero_loss_that_still_backpropagates():
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    out = dflash_loss(hidden, torch.randn(10, 8), torch.zeros(1, 1, 4, dtype=torch.long),
                      torch.zeros(1, 1, 4, dtype=torch.bool), gamma=4.0)
    out.loss.backward()
    assert float(out.loss) == 0.0 and torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert out.counted.sum() == 0


def test_expected_acceptance_length():
    assert expected_acceptance_length([1.0] * 15) == 16.0
    assert expected_acceptance_length([0.0] * 15) == 1.0
    assert expected_acceptance_length([0.5, 0.5]) == 1.75
    assert per_position_accuracy([9, 3, 2, 0], [9, 4, 4, 0]) == [0.75, 0.5, 0.0]
    with pytest.raises(ValueError, match="not in"):
        expected_acceptance_length([1.5])


def test_feature_noise_is_uniform_with_the_requested_std():
    from dflash_train.training.step import uniform_noise_like

    x = torch.zeros(200_000)
    noise = uniform_noise_like(x, 0.05, torch.Generator().manual_seed(0))
    assert abs(float(noise.std()) - 0.05) < 1e-3 and abs(float(noise.mean())) < 1e-3
    assert float(noise.abs().max()) <= 0.05 * math.sqrt(3) + 1e-6
