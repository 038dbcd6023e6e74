"""FrozenTarget: hooked features, packed rows, tied LM head, mask-token validation, frozen weights.

The hooks, packing and frozen-weight tests run on both tiny targets (`target_arch`): dense Qwen3 and the
Qwen3.6-architecture hybrid, whose Gated DeltaNet layers carry state across a packed row unless the kernels
honour sequence boundaries. The tolerance between packings is 1e-5 (float32 targets): far below the 1e-3
by which a document that reads its neighbour differs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_train.data.batch import pack_documents, pack_row, stack_rows
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.target_model.frozen import FrozenTarget, varlen_segments
from dflash_train.target_model.linear_kernels import REFERENCE, kernel_status, use_fla_conv
from dflash_train.training.step import dflash_step
from tests.support.qwen_assets import qwen_embedding_rows, qwen_special_ids
from tests.support.step_recipe import step_recipe, step_runtime
from tests.support.tiny_target import MOE_ARCHS, QWEN2_ARCHS, TargetArch, build_tiny_target

ALL_IDS = [0, 1, 2]  # every id a 4-layer target allows (the last layer is excluded)
# Per architecture: layer ids (the hybrid's 3 is a full-attention layer, the others Gated DeltaNet) and
# the number of decoder layers.
ARCH_IDS = {"qwen3": ALL_IDS, "qwen3_6": [0, 2, 3, 5]}
ARCH_LAYERS = {"qwen3": 4, "qwen3_6": 8}
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def reference(arch_target_dir: Path) -> Any:
    """The unmodified HF model, for output_hidden_states comparisons."""
    return AutoModelForCausalLM.from_pretrained(arch_target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def arch_target(arch_target_dir: Path, target_arch: str) -> FrozenTarget:
    """The target of `target_arch` with the packing `auto` picks."""
    return FrozenTarget.from_pretrained(arch_target_dir, ARCH_IDS[target_arch])


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path) -> FrozenTarget:
    return FrozenTarget.from_pretrained(tiny_target_dir, ALL_IDS)


def _assert_hooks_read_the_hidden_states(target: FrozenTarget, reference: Any, ids: list[int]) -> None:
    """Each hooked layer id's features are transformers' hidden state of the next index (layer id + 1), and not the
    neighbouring one: an off-by-one would be caught."""
    tokens = torch.tensor([ids])
    pos = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        states = reference(input_ids=tokens, position_ids=pos, output_hidden_states=True).hidden_states
    feats = target.features(tokens, pos)
    h = target.hidden_size
    for n, layer_id in enumerate(target.layer_ids):
        got = feats[..., n * h : (n + 1) * h]
        torch.testing.assert_close(got, states[layer_id + 1], **TOL)
        assert (got - states[layer_id]).abs().max() > 1e-2


def test_hooks_equal_hf_hidden_states_of_next_index(arch_target: FrozenTarget, reference: Any, qwen_docs):
    _assert_hooks_read_the_hidden_states(arch_target, reference, qwen_docs[0][0])


def test_layers_after_the_last_id_are_dropped(arch_target_dir: Path, target_arch: str):
    t = FrozenTarget.from_pretrained(arch_target_dir, [1])
    assert t.num_layers == ARCH_LAYERS[target_arch]
    assert len(t.model.get_decoder().layers) == 2


@pytest.mark.parametrize("bad", [[4], [-1], [1, 1], []])
def test_layer_ids_outside_the_capturable_range_are_rejected(tiny_target_dir: Path, bad: list[int]):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="layer id|non-empty"):
        FrozenTarget(model, bad)


def test_the_last_layer_is_accepted_where_vllm_captures_it(tiny_target_dir: Path):
    """vLLM's Qwen2/Qwen3 decoder loop records the aux state after every layer, the last included (id N-1): the
    frozen target keeps the whole stack for it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    target = FrozenTarget(model, [1, 3])
    assert target.layer_ids == [1, 3] and len(target.model.get_decoder().layers) == 4


def _docs_alone(target: FrozenTarget, docs) -> list[torch.Tensor]:
    out = []
    for ids, _ in docs:
        t = torch.tensor([ids])
        out.append(target.features(t, torch.arange(len(ids)).unsqueeze(0))[0])
    return out


def _two_rows(docs) -> Any:
    length = sum(len(d[0]) for d in docs) + 5  # room for padding at the end
    return stack_rows([pack_row(docs, length), pack_row(docs[::-1], length)])


def _assert_rows_match(feats: torch.Tensor, alone: list[torch.Tensor], docs) -> None:
    for row, order in ((0, range(len(docs))), (1, range(len(docs) - 1, -1, -1))):
        start = 0
        for i in order:
            n = len(docs[i][0])
            torch.testing.assert_close(feats[row, start : start + n], alone[i], **TOL)
            start += n
        assert torch.isfinite(feats[row, start:]).all()  # padding rows are finite (no empty softmax)


# ---------------------------------------------------------------------------------------- packing

def test_auto_packing_follows_the_layer_types_and_the_active_kernels(arch_target: FrozenTarget, target_arch: str):
    if target_arch == "qwen3":
        assert arch_target.kernels is None and arch_target.packing == "mask"
        return
    status = arch_target.kernels
    assert status is not None and arch_target.has_linear_attention
    # What transformers chose for this process: on a CPU-only machine the PyTorch reference kernels.
    assert status == kernel_status(sys.modules[type(arch_target.model).__module__])
    assert arch_target.packing == ("varlen" if status.varlen else "per_document")


def test_varlen_is_refused_on_the_reference_kernels_and_for_dense_targets(arch_target_dir: Path, target_arch: str):
    if target_arch == "qwen3":
        with pytest.raises(ValueError, match="no linear-attention layers.*packing='mask'"):
            FrozenTarget.from_pretrained(arch_target_dir, [1], packing="varlen")
        return
    status = FrozenTarget.from_pretrained(arch_target_dir, [1]).kernels
    if status is not None and status.varlen:
        pytest.skip(f"fast kernels are active here ({status.describe()})")
    with pytest.raises(ValueError, match=r"refused: .*PyTorch reference.*leak into each other.*per_document"):
        FrozenTarget.from_pretrained(arch_target_dir, [1], packing="varlen")
    with pytest.raises(ValueError, match="packing='mask' needs layer types"):
        FrozenTarget.from_pretrained(arch_target_dir, [1], packing="mask")


def test_packed_row_features_equal_each_document_alone(arch_target: FrozenTarget, target_arch: str, qwen_docs):
    """The packing `auto` chose (mask / per_document here, varlen on fast kernels) is exact per document."""
    docs = qwen_docs[:4]
    batch = _two_rows(docs)
    feats = arch_target.features(batch.input_ids, batch.position_ids, batch.document_ids)
    _assert_rows_match(feats, _docs_alone(arch_target, docs), docs)


def test_dense_per_document_equals_mask(tiny_target_dir: Path, qwen_docs):
    target = FrozenTarget.from_pretrained(tiny_target_dir, [1, 2], packing="per_document")
    docs = qwen_docs[:4]
    batch = _two_rows(docs)
    feats = target.features(batch.input_ids, batch.position_ids, batch.document_ids)
    _assert_rows_match(feats, _docs_alone(target, docs), docs)
    # Treated as one document, the second document reads the first: the comparison can tell them apart.
    masked = FrozenTarget.from_pretrained(tiny_target_dir, [1, 2], packing="mask")
    plain = masked.features(batch.input_ids, batch.position_ids, torch.zeros_like(batch.document_ids))
    n0 = len(docs[0][0])
    alone = _docs_alone(target, docs)
    assert (plain[0, n0 : n0 + len(docs[1][0])] - alone[1]).abs().max() > 1e-3


def test_a_packed_forward_on_the_reference_kernels_leaks(arch_target_dir: Path, target_arch: str, qwen_docs):
    """The leak the packing choice prevents: one varlen forward on kernels that drop the boundaries."""
    if target_arch == "qwen3":
        pytest.skip("dense target: no recurrent state to leak")
    target = FrozenTarget.from_pretrained(arch_target_dir, ARCH_IDS[target_arch])
    if target.kernels is not None and target.kernels.varlen:
        pytest.skip("fast kernels active: the packed forward is right here")
    target.packing = "varlen"  # bypasses the refusal on purpose
    docs = qwen_docs[:3]
    batch = _two_rows(docs)
    leaky = target.features(batch.input_ids, batch.position_ids, batch.document_ids)
    alone = _docs_alone(target, docs)
    n0 = len(docs[0][0])
    torch.testing.assert_close(leaky[0, :n0], alone[0], **TOL)  # the first document has nothing before it
    assert (leaky[0, n0 : n0 + len(docs[1][0])] - alone[1]).abs().max() > 1e-3


def test_per_document_features_do_not_depend_on_the_previous_document(arch_target: FrozenTarget, qwen_docs):
    first, second = qwen_docs[0], qwen_docs[1]
    other = ([(t + 7) % 150_000 for t in first[0]], first[1])
    a = pack_documents([first, second], len(first[0]) + len(second[0]))
    b = pack_documents([other, second], len(first[0]) + len(second[0]))
    fa = arch_target.features(a.input_ids, a.position_ids, a.document_ids)
    fb = arch_target.features(b.input_ids, b.position_ids, b.document_ids)
    n0 = len(first[0])
    assert (fa[0, :n0] - fb[0, :n0]).abs().max() > 1e-3  # the first documents do differ
    torch.testing.assert_close(fa[0, n0:], fb[0, n0:], **TOL)


def _segmented(original: Any, calls: list[int], split_dim: int) -> Any:
    """A kernel that honours `cu_seq_lens_q`/`cu_seqlens` by running `original` on each sequence alone."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        cu = kwargs.pop("cu_seqlens", None)
        cu = kwargs.pop("cu_seq_lens_q", cu)
        for name in ("cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"):
            kwargs.pop(name, None)
        if cu is None:
            return original(*args, **kwargs)
        calls.append(len(cu) - 1)
        bounds = cu.tolist()
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        pieces = []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            sl = [slice(None)] * tensors[0].dim()
            sl[split_dim] = slice(lo, hi)
            cut = [a[tuple(sl)] if isinstance(a, torch.Tensor) and a.dim() == tensors[0].dim() else a for a in args]
            kw = {k: (v[:, lo:hi] if isinstance(v, torch.Tensor) and k in ("g", "beta") else v)
                  for k, v in kwargs.items()}
            pieces.append(original(*cut, **kw))
        if isinstance(pieces[0], tuple):
            return torch.cat([p[0] for p in pieces], dim=split_dim), None
        return torch.cat(pieces, dim=split_dim)

    kernel._dflash_kernel = "test-segmented"  # type: ignore[attr-defined]
    return kernel


def test_varlen_on_boundary_honouring_kernels_equals_per_document(monkeypatch: pytest.MonkeyPatch, qwen_docs):
    """The varlen plumbing (one row of sequences, boundaries, attention mask, scatter back) on CPU.

    The fast kernels need a GPU; here the reference kernels are made to honour the boundaries they are
    given by running each sequence alone, which is what flash-linear-attention and causal-conv1d do.
    """
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    from tests.support.tiny_target import build_tiny_qwen3_6

    calls: list[int] = []
    # The conv's input is [B, D, T]: sequences along dim 2; the delta rule's [B, T, H, K]: along dim 1.
    monkeypatch.setattr(modeling, "causal_conv1d_fn", _segmented(modeling.causal_conv1d_fn, calls, 2))
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule",
                        _segmented(modeling.torch_chunk_gated_delta_rule, calls, 1))
    target = FrozenTarget.from_pretrained(build_tiny_qwen3_6(), ARCH_IDS["qwen3_6"])
    assert target.kernels is not None and target.kernels.varlen and target.packing == "varlen"
    docs = qwen_docs[:4]
    batch = _two_rows(docs)
    feats = target.features(batch.input_ids, batch.position_ids, batch.document_ids)
    # 3 linear-attention layers up to id 5 (0, 1, 2, 4, 5 minus the full one at 3 -> 5), conv + delta rule
    # each, every call with the 8 sequences of both rows.
    assert calls == [8] * 10
    target.packing = "per_document"
    _assert_rows_match(feats, _docs_alone(target, docs), docs)


def test_varlen_segments_split_rows_and_documents_and_skip_padding():
    docs = torch.tensor([[0, 0, 1, 1, 1, -1], [2, 2, 2, 2, -1, -1], [5, -1, -1, -1, -1, -1]])
    assert varlen_segments(docs).tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2, 3]
    # The same document id in two rows is two sequences.
    assert varlen_segments(torch.tensor([[0, 0], [0, 0]])).tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="not contiguous"):
        varlen_segments(torch.tensor([[0, 1, 0, -1]]))


def test_kernel_status_reads_what_transformers_chose():
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_5 import modeling_qwen3_5

    assert kernel_status(modeling_qwen3) is None
    status = kernel_status(modeling_qwen3_5)
    assert status is not None
    import importlib.util

    fla = importlib.util.find_spec("fla") is not None
    conv = importlib.util.find_spec("causal_conv1d") is not None
    assert (status.delta_rule != REFERENCE) == fla and (status.conv != REFERENCE) == (conv or fla)
    # Without flash-linear-attention the Triton conv cannot stand in: the module is left as it is.
    if not fla:
        before = modeling_qwen3_5.causal_conv1d_fn
        assert use_fla_conv(modeling_qwen3_5) == status and modeling_qwen3_5.causal_conv1d_fn is before
        assert "PyTorch reference (flash-linear-attention not active)" in status.describe()


def test_sliding_window_target_layers_get_a_windowed_document_mask(tmp_path: Path, qwen_docs):
    config = Qwen3Config(
        vocab_size=qwen_embedding_rows("qwen3"), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config).eval()
    assert "sliding_attention" in config.layer_types
    model.save_pretrained(tmp_path)
    target = FrozenTarget.from_pretrained(tmp_path, [1, 2])
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    docs = qwen_docs[1:3]
    batch = pack_documents(docs, sum(len(d[0]) for d in docs))
    feats = target.features(batch.input_ids, batch.position_ids, batch.document_ids)
    start = 0
    for ids, _ in docs:
        with torch.no_grad():
            states = reference(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        expected = torch.cat([states[2], states[3]], dim=-1)[0]
        torch.testing.assert_close(feats[0, start : start + len(ids)], expected, rtol=1e-5, atol=1e-5)
        start += len(ids)


def test_tied_target_shares_the_embedding_as_lm_head(target: FrozenTarget):
    assert target.config.tie_word_embeddings
    assert target.lm_head_weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    assert target.vocab_rows == qwen_embedding_rows("qwen3")


def test_untied_target_uses_its_own_lm_head(tmp_path: Path):
    config = Qwen3Config(
        vocab_size=qwen_embedding_rows("qwen3"), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(tmp_path)
    saved_head = model.lm_head.weight.detach().clone()
    target = FrozenTarget.from_pretrained(tmp_path, [0, 1])
    assert target.lm_head_weight.data_ptr() != target.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(target.lm_head_weight, saved_head)
    assert (target.lm_head_weight - target.embed_tokens.weight).abs().max() > 1e-3


def test_mask_token_must_be_an_existing_row(target: FrozenTarget, mask_token_id: int):
    target.validate_token_id(mask_token_id)
    with pytest.raises(ValueError, match=r"mask_token_id 151936 is not a row .*never resized"):
        target.validate_token_id(qwen_embedding_rows("qwen3"))
    cfg = DrafterConfig.debug(target_layer_ids=ALL_IDS, mask_token_id=200_000)
    with pytest.raises(ValueError, match="not a row"):
        target.check_drafter_config(cfg)
    with pytest.raises(ValueError, match="target_layer_ids"):
        target.check_drafter_config(DrafterConfig.debug(mask_token_id=mask_token_id))


def test_step_leaves_the_target_frozen_and_its_embedding_unresized(arch_target_dir: Path, target_arch: str,
                                                                   qwen_docs):
    ids = ARCH_IDS[target_arch][1:]
    cfg = DrafterConfig.debug(mask_token_id=qwen_special_ids(target_arch)["mask"], target_layer_ids=ids,
                              num_target_layers=ARCH_LAYERS[target_arch])
    target = FrozenTarget.from_pretrained(arch_target_dir, cfg.target_layer_ids)
    target.check_drafter_config(cfg)
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    drafter = DFlashDrafter(cfg)
    batch = pack_documents(qwen_docs, 64)
    recipe, runtime = step_recipe(), step_runtime()
    out = dflash_step(drafter, target, batch, cfg, recipe, runtime, torch.Generator().manual_seed(0), noise=True)
    out.loss.backward()
    assert all(not p.requires_grad and p.grad is None for p in target.model.parameters())
    assert all(p.grad is not None for p in drafter.parameters())
    after = target.model.state_dict()
    noisy_recipe = step_recipe(feature_noise_std=0.05)
    clean = dflash_step(drafter, target, batch, cfg, noisy_recipe, runtime, torch.Generator().manual_seed(0),
                        noise=False)
    noisy = dflash_step(drafter, target, batch, cfg, noisy_recipe, runtime, torch.Generator().manual_seed(0),
                        noise=True)
    assert float(clean.loss) != float(noisy.loss)
    assert target.embed_tokens.weight.shape == (qwen_embedding_rows(target_arch), 128)
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name


# The other families' tiny targets: Qwen3-MoE (4 layers, all full attention), Qwen3.6-MoE (the hybrid pattern, a
# shared expert beside the routed ones) and Qwen2.5 (4 dense layers, biased q/k/v, no q/k norms).
FAMILY_IDS = {"qwen3_moe": [0, 1, 2], "qwen3_6_moe": [0, 2, 3, 5], "qwen2": [1, 2]}


@pytest.mark.parametrize("arch", MOE_ARCHS + QWEN2_ARCHS)
def test_the_other_families_targets_are_hooked_frozen_and_packed_exactly(arch: TargetArch, qwen_docs):
    """Hooks on the layer ids read what transformers' hidden states say; every weight is frozen (a mixture's router
    and experts included); a packed row's features equal each document's alone (routing is per token)."""
    target_dir = build_tiny_target(arch)
    target = FrozenTarget.from_pretrained(target_dir, FAMILY_IDS[arch])
    reference = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    _assert_hooks_read_the_hidden_states(target, reference, qwen_docs[0][0])
    expert_params = {name: p for name, p in target.model.named_parameters() if "experts" in name or ".gate." in name
                     or name.endswith("mlp.gate.weight")}
    assert bool(expert_params) == (arch in MOE_ARCHS)
    assert not any(p.requires_grad for p in target.model.parameters())
    docs = qwen_docs[:4]
    batch = _two_rows(docs)
    _assert_rows_match(target.features(batch.input_ids, batch.position_ids, batch.document_ids),
                       _docs_alone(target, docs), docs)
