"""Export format: config fields and tensor names exactly as the engines load them, round trip, layer ids, and
each layer's attention (window, causal) as vLLM resolves it from both formats."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dflash_shared.errors import BadInputError
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_shared.storage import ObjectStore
from dflash_train.drafter.config import QWEN3_MASK_TOKEN_ID, DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.evaluate.speculate import speculative_generate
from dflash_train.export.files import (
    load_export,
    load_export_dir,
    read_target_config,
    write_export_dir,
    write_speculators_dir,
)
from dflash_train.export.format import (
    ExportError,
    LayerAttention,
    config_from_export,
    drafter_hf_config,
    export_speculators_config,
    trained_layer_attention,
)
from tests.evaluate import eval_fixtures as ef

QWEN3_8B = SimpleNamespace(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, intermediate_size=12288, rms_norm_eps=1e-6, max_position_embeddings=40960,
                           rope_theta=1_000_000.0, vocab_size=151936, bos_token_id=151643, eos_token_id=151645,
                           architectures=["Qwen3ForCausalLM"])


def _drafter_inputs(cfg: DrafterConfig, seq: int = 12) -> tuple[torch.Tensor, ...]:
    from dflash_train.drafter.attention import build_drafter_mask

    gen = torch.Generator().manual_seed(7)
    block = cfg.block_size
    embeds = torch.randn(1, block, cfg.hidden_size, generator=gen)
    features = torch.randn(1, seq, cfg.feature_size, generator=gen)
    anchor = torch.tensor([[seq - 1]])
    positions = (seq - 1 + torch.arange(block)).unsqueeze(0)
    mask = build_drafter_mask(anchor, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, seq, dtype=torch.int32),
                              block, cfg.layer_types, cfg.sliding_window, "sdpa")
    return embeds, positions, features, torch.arange(seq).unsqueeze(0), mask


def test_config_has_every_field_of_the_native_format() -> None:
    cfg = DrafterConfig.from_target(QWEN3_8B, mask_token_id=QWEN3_MASK_TOKEN_ID, num_target_features=5)
    config = drafter_hf_config(cfg, QWEN3_8B, "bfloat16")
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 16
    assert config["num_target_layers"] == 36
    assert config["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert config["layer_types"] == ["full_attention"] * 5
    assert config["sliding_window"] is None and config["use_sliding_window"] is False
    # The drafter's own Qwen3 shape (the reference Qwen3-8B drafter's numbers).
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (
        5, 4096, 32, 8, 128, 12288)
    assert config["vocab_size"] == 151936 and config["tie_word_embeddings"] is False
    assert config["rope_parameters"]["rope_theta"] == config["rope_theta"] == 1_000_000.0


# A Qwen3.6-like target: RoPE over a quarter of each head, its base in rope_parameters (transformers 5).
QWEN3_6_LIKE = SimpleNamespace(**{**vars(QWEN3_8B), "rope_theta": None, "partial_rotary_factor": 0.25,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                                                      "partial_rotary_factor": 0.25}})


def test_rotary_fraction_is_stated_and_equals_training_for_a_partial_rotary_target() -> None:
    # Pitfall: the target's partial_rotary_factor leaking into the drafter on one side only.
    cfg = DrafterConfig.from_target(QWEN3_6_LIKE, mask_token_id=QWEN3_MASK_TOKEN_ID, num_target_features=5)
    config = drafter_hf_config(cfg, QWEN3_6_LIKE)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10_000_000.0
    assert config["partial_rotary_factor"] == config["rope_parameters"]["partial_rotary_factor"] == 1.0
    # Training rotates every dimension of the head, as the export says.
    rotary = DFlashDrafter(DrafterConfig.debug()).rotary
    cos, sin = rotary(torch.tensor([[5]]))
    assert cos.shape[-1] == DrafterConfig.debug().head_dim and bool((sin[0, 0] != 0).all())
    assert config_from_export(config).rope_theta == 10_000_000.0


@pytest.mark.parametrize("rope", [{"partial_rotary_factor": 0.25}, {"rope_parameters": {
    "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}, {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0}}])
def test_an_export_with_another_rope_is_refused(rope: dict[str, Any]) -> None:
    cfg = DrafterConfig.from_target(QWEN3_8B, mask_token_id=QWEN3_MASK_TOKEN_ID)
    config = {**drafter_hf_config(cfg, QWEN3_8B), "partial_rotary_factor": 1.0, **rope}
    if "rope_parameters" not in rope:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    with pytest.raises(ExportError, match="RoPE .* not what this drafter trains with"):
        config_from_export(config, "export/config.json")


def test_sliding_window_drafter_config() -> None:
    layer_types = ["sliding_attention"] * 4 + ["full_attention"]
    cfg = DrafterConfig.from_target(QWEN3_8B, mask_token_id=QWEN3_MASK_TOKEN_ID, layer_types=layer_types,
                                    sliding_window=2048)
    config = drafter_hf_config(cfg, QWEN3_8B)
    assert config["layer_types"] == layer_types
    assert config["sliding_window"] == 2048 and config["use_sliding_window"] is True


def test_weight_names_are_exactly_the_drafters_own(tmp_path: Path, trained_drafter: Any, tiny_target_dir: Path
                                                   ) -> None:
    from transformers import AutoConfig

    write_export_dir(trained_drafter, AutoConfig.from_pretrained(tiny_target_dir), str(tmp_path), "bfloat16")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight"]
    want = {f"layers.{i}.{n}" for i in range(2) for n in per_layer} | {"fc.weight", "hidden_norm.weight",
                                                                        "norm.weight"}
    assert set(tensors) == want  # no embedding, no LM head
    cfg = trained_drafter.config
    assert tensors["fc.weight"].shape == (cfg.hidden_size, cfg.hidden_size * len(cfg.target_layer_ids))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    # transformers reads the config as a Qwen3 config of the drafter's shape.
    hf = AutoConfig.from_pretrained(tmp_path)
    assert (hf.model_type, hf.num_hidden_layers, hf.hidden_size) == ("qwen3", 2, 128)
    assert hf.dflash_config["target_layer_ids"] == [1, 2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_reproduces_the_drafter_exactly(tmp_path: Path, trained_drafter: Any, tiny_target_dir: Path,
                                                   dtype: str) -> None:
    from transformers import AutoConfig

    write_export_dir(trained_drafter, AutoConfig.from_pretrained(tiny_target_dir), str(tmp_path), dtype)
    loaded = load_export_dir(str(tmp_path))
    torch_dtype = getattr(torch, dtype)
    reference = DFlashDrafter(trained_drafter.config).eval()
    reference.load_state_dict(trained_drafter.state_dict())
    reference = reference.to(torch_dtype)
    assert loaded.config == trained_drafter.config
    with torch.no_grad():
        inputs = _drafter_inputs(loaded.config)
        cast = [t.to(torch_dtype) if t.is_floating_point() else t for t in inputs[:4]]
        assert torch.equal(loaded(*cast, inputs[4]), reference(*cast, inputs[4]))


def test_round_trip_decodes_identically(tmp_path: Path, trained_drafter: Any, tiny_target_dir: Path,
                                        hooked_target: Any, heldout_prompts: list[list[int]]) -> None:
    from transformers import AutoConfig

    write_export_dir(trained_drafter, AutoConfig.from_pretrained(tiny_target_dir), str(tmp_path), "float32")
    loaded = load_export_dir(str(tmp_path))
    a = speculative_generate(trained_drafter, hooked_target, heldout_prompts[0], 24, ef.STOP_IDS)
    b = speculative_generate(loaded, hooked_target, heldout_prompts[0], 24, ef.STOP_IDS)
    assert (a.tokens, a.accepted) == (b.tokens, b.accepted)
    assert sum(a.accepted) > 0  # a trained drafter: the comparison covers accepted drafts


def test_speculators_format_keeps_the_layer_id_convention(trained_drafter: Any) -> None:
    """vLLM's own converter must turn aux ids (L + 1) back into the native target_layer_ids (L)."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    cfg = trained_drafter.config
    target = SimpleNamespace(vocab_size=151936, architectures=["Qwen3ForCausalLM"])
    spec = export_speculators_config(cfg, target, verifier="tiny-qwen3")
    assert spec["aux_hidden_state_layer_ids"] == [2, 3]
    assert spec["sliding_window_non_causal"] is True  # all full attention: bidirectional blocks, as trained
    converted = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(spec)))
    assert converted["dflash_config"]["target_layer_ids"] == cfg.target_layer_ids == [1, 2]
    assert converted["dflash_config"]["mask_token_id"] == cfg.mask_token_id
    assert converted["architectures"] == ["DFlashDraftModel"]
    assert SpeculatorsConfig.extract_vllm_speculative_config(spec) == {"method": "dflash",
                                                                      "num_speculative_tokens": cfg.block_size - 1}


def test_native_layer_ids_are_what_vllm_captures_plus_one(tmp_path: Path, trained_drafter: Any,
                                                          tiny_target_dir: Path) -> None:
    """vLLM reads dflash_config.target_layer_ids L and captures auxiliary state L + 1 = HF hidden_states[L+1]."""
    from transformers import AutoConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    write_export_dir(trained_drafter, AutoConfig.from_pretrained(tiny_target_dir), str(tmp_path), "float32")
    hf = AutoConfig.from_pretrained(tmp_path)
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
    assert get_eagle3_aux_layers_from_config(spec) == (2, 3)
    # ...and our features are HF hidden_states[L + 1] of the same target.
    from transformers import AutoModelForCausalLM

    from dflash_train.evaluate.speculate import HookedTarget

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32)
    hooked = HookedTarget(model, [1, 2])
    ids = torch.tensor([151644, 872, 198, 9707])
    _, features = hooked.forward(ids, hooked.new_cache())
    states = model(ids.unsqueeze(0), output_hidden_states=True).hidden_states
    assert torch.equal(features, torch.cat([states[2][0], states[3][0]], dim=-1))


def test_export_refuses_foreign_weights(trained_drafter: Any) -> None:
    from dflash_train.export.files import export_state_dict

    drafter = DFlashDrafter(trained_drafter.config)
    drafter.embed_tokens = torch.nn.Embedding(4, drafter.config.hidden_size)
    with pytest.raises(ExportError, match="unexpected.*embed_tokens.weight"):
        export_state_dict(drafter)


def test_load_refuses_a_missing_tensor(tmp_path: Path, trained_drafter: Any, tiny_target_dir: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig

    write_export_dir(trained_drafter, AutoConfig.from_pretrained(tiny_target_dir), str(tmp_path), "float32")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ExportError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        load_export_dir(str(tmp_path))


def test_export_stage_writes_a_drafter_manifest_naming_the_export(offline_run: Any, tiny_target_dir: Path,
                                                                 trained_drafter: Any) -> None:
    """The session's `dflash-train export` on S3: files, manifest (verified hashes), exact round trip."""
    store = offline_run.store
    loaded = load_manifest(store, offline_run.export, Kind.drafter)  # verifies every shard's sha256
    section = loaded.manifest.section
    assert section.export_uri == offline_run.export
    assert loaded.manifest.inputs[0].uri.startswith(offline_run.drafter)
    names = sorted(s.uri.rsplit("/", 2)[-1] if "speculators" not in s.uri else "speculators/" +
                   s.uri.rsplit("/", 1)[-1] for s in loaded.manifest.shards)
    assert names == ["config.json", "model.safetensors", "speculators/config.json", "speculators/model.safetensors"]
    drafter = load_export(offline_run.export, store)
    for name, tensor in trained_drafter.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], tensor), name


def test_export_refuses_a_checkpoint_that_does_not_fit_the_target(tmp_path: Path, offline_run: Any) -> None:
    from dflash_train.export.config import ExportConfig
    from dflash_train.export.stage import run_export
    from tests.support.tiny_target import build_tiny_qwen3

    other = build_tiny_qwen3(num_layers=6)  # a different target: 6 layers, the drafter was built for 4
    with pytest.raises(BadInputError, match="num_target_layers 4 != target's 6"):
        run_export(ExportConfig(drafter=offline_run.drafter, output=str(tmp_path / "export"), target=str(other)),
                   offline_run.store)
    assert not (tmp_path / "export" / "manifest.json").exists()


# --------------------------------------------- attention per layer: training vs what vLLM serves from the export
#
# Training masks a sliding-window layer causally inside the block and a full-attention layer bidirectionally
# (dflash_train.drafter.attention). vLLM's DFlash model asks `_resolve_layer_attention(config, i)`
# (models/qwen3_dflash.py)
# for each layer's (sliding_window, causal); these tests feed it the config vLLM builds from each export.

FORMATS = ("native", "speculators")


def _preset(target_dir: Path) -> DrafterConfig:
    """The drafter preset training picks for a tiny target (the from_target path of drafter.resolve.resolve_drafter).

    The 4-layer dense target is too shallow for the default spread of 5 feature layers, so it names two.
    """
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(target_dir)
    text = getattr(hf, "text_config", None) or hf
    ids = {"target_layer_ids": [1, 2]} if ef.arch_of(target_dir) == "qwen3" else {}
    return DrafterConfig.from_target(text, mask_token_id=ef.special_ids(target_dir)["mask"], **ids)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_6"])
def preset(request: pytest.FixtureRequest) -> tuple[Path, DrafterConfig]:
    """(target directory, drafter preset) of the dense Qwen3 target and of the Qwen3.6 hybrid target."""
    fixture = "tiny_target_dir" if request.param == "qwen3" else "hybrid_target_dir"
    target_dir = request.getfixturevalue(fixture)
    return target_dir, _preset(target_dir)


def _trained_from_masks(cfg: DrafterConfig) -> list[LayerAttention]:
    """Each layer's (window, causal) read off the masks training builds (`build_drafter_mask`, SDPA backend).

    One block anchored past the window: slot 0's visible context keys plus itself give the window (None when
    it sees all the context before the anchor); whether slot 0 sees slot 1 tells causal from bidirectional.
    """
    from dflash_train.drafter.attention import build_drafter_mask

    block = cfg.block_size
    seq = (cfg.sliding_window or 0) + block + 8
    anchor = seq - 1
    masks = build_drafter_mask(torch.tensor([[anchor]]), torch.ones(1, 1, dtype=torch.bool),
                               torch.zeros(1, seq, dtype=torch.int32), block, cfg.layer_types, cfg.sliding_window,
                               "sdpa")
    result = []
    for layer_type in cfg.layer_types:
        row = masks.for_layer(layer_type).bias[0, 0, 0] == 0  # slot 0 of the block; 0 = allowed
        context, in_block = int(row[:seq].sum()), row[seq:]
        assert bool(in_block[0]), "slot 0 must see itself"
        window = None if context == anchor else context + 1
        result.append(LayerAttention(window, not bool(in_block[1:].any())))
    return result


def _export(fmt: str, target_dir: Path, cfg: DrafterConfig, directory: Path) -> None:
    """Export a (random) drafter of `cfg` in `fmt` as the export stage does (target config from read_target_config)."""
    target_config = read_target_config(ObjectStore(), str(target_dir))
    drafter = DFlashDrafter(cfg)
    if fmt == "native":
        write_export_dir(drafter, target_config, str(directory), "bfloat16")
    else:
        write_speculators_dir(drafter, target_config, str(directory), verifier=str(target_dir), dtype="bfloat16")


def _vllm_draft_config(directory: Path) -> Any:
    """The draft hf_config vLLM serves from an export directory, built by vLLM's own code.

    `get_config` parses config.json (a speculators config becomes a `SpeculatorsConfig` through the converter
    of transformers_utils/configs/speculators); for method dflash `SpeculativeConfig` then wraps any other
    config in `EAGLEConfig(config, method="dflash", model_type="eagle")` (config/speculative.py).
    """
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    config = get_config(str(directory), trust_remote_code=False)
    if isinstance(config, SpeculatorsConfig):
        return config
    return EAGLEConfig(config, method="dflash", model_type="eagle")


def _vllm_layer_attention(hf_config: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int | None, bool]]:
    """Each layer's (sliding_window, causal) as vLLM's DFlash decoder layers resolve it.

    For a drafter mixing sliding and full layers, `_resolve_layer_attention` also asks the current vLLM config
    whether the V2 model runner is on (it refuses the mix otherwise; see
    `test_vllm_needs_the_v2_runner_for_a_mixed_drafter`). A V2 config cannot be built on this CPU (no Triton),
    so that one answer is given here: serving runs with VLLM_USE_V2_MODEL_RUNNER=1 on a GPU.
    """
    from vllm.model_executor.models import qwen3_dflash

    monkeypatch.setattr(qwen3_dflash, "get_current_vllm_config", lambda: SimpleNamespace(use_v2_model_runner=True))
    return [qwen3_dflash._resolve_layer_attention(hf_config, i) for i in range(hf_config.num_hidden_layers)]


def test_the_presets_are_the_ones_under_test(preset: tuple[Path, DrafterConfig]) -> None:
    target_dir, cfg = preset
    if ef.arch_of(target_dir) == "qwen3":
        assert cfg.layer_types == ["full_attention"] * cfg.num_layers
    else:
        assert (cfg.layer_types, cfg.sliding_window) == (["sliding_attention"] * 4 + ["full_attention"], 2048)


def test_trained_layer_attention_is_what_the_training_masks_do(preset: tuple[Path, DrafterConfig]) -> None:
    _, cfg = preset
    assert trained_layer_attention(cfg) == _trained_from_masks(cfg)


def _servable(fmt: str, cfg: DrafterConfig) -> bool:
    """Whether `fmt` can carry `cfg`: the speculators format only a drafter whose layers are all of one kind."""
    return fmt == "native" or len(set(cfg.layer_types)) == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_vllm_serves_every_layer_and_target_layer_as_trained_or_the_export_refuses(
        tmp_path: Path, preset: tuple[Path, DrafterConfig], fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Export, load with vLLM's config code, resolve each layer as vLLM's model does: equal to training. The
    one combination a format cannot carry (hybrid preset, speculators format) is refused, nothing written."""
    from vllm.model_executor.models.qwen3_dflash import _get_dflash_fc_input_size
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    target_dir, cfg = preset
    if not _servable(fmt, cfg):
        with pytest.raises(ExportError, match="serve the native export"):
            _export(fmt, target_dir, cfg, tmp_path)
        assert not any(tmp_path.iterdir())
        return
    _export(fmt, target_dir, cfg, tmp_path)
    hf = _vllm_draft_config(tmp_path)
    assert hf.architectures == ["DFlashDraftModel"] and hf.num_hidden_layers == cfg.num_layers
    assert _vllm_layer_attention(hf, monkeypatch) == _trained_from_masks(cfg)
    # Target layers: the model reads L (our ids); the runner captures aux layer L + 1, which is HF
    # hidden_states[L + 1] = the output of decoder layer L (test_native_layer_ids_are_what_vllm_captures_plus_one).
    assert hf.dflash_config["target_layer_ids"] == cfg.target_layer_ids
    assert hf.dflash_config["mask_token_id"] == cfg.mask_token_id
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
    assert get_eagle3_aux_layers_from_config(spec) == tuple(i + 1 for i in cfg.target_layer_ids)
    assert _get_dflash_fc_input_size(SimpleNamespace(speculative_config=spec)) == cfg.feature_size


def test_an_all_sliding_drafter_is_served_causally_in_both_formats(tmp_path: Path, tiny_target_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The one other layout the speculators flag can carry: every layer sliding, so every layer causal."""
    cfg = DrafterConfig.debug(layer_types=["sliding_attention"] * 2, sliding_window=64, mask_token_id=ef.MASK_ID)
    for fmt in FORMATS:
        _export(fmt, tiny_target_dir, cfg, tmp_path / fmt)
        resolved = _vllm_layer_attention(_vllm_draft_config(tmp_path / fmt), monkeypatch)
        assert resolved == _trained_from_masks(cfg) == [(64, True), (64, True)], fmt


def test_speculators_refuses_a_mixed_drafter(tmp_path: Path, hybrid_target_dir: Path) -> None:
    cfg = _preset(hybrid_target_dir)
    with pytest.raises(ExportError, match=r"layers \[0, 1, 2, 3\] \(sliding_attention\).* layers \[4\] "
                                          r"\(full_attention\).*native export"):
        _export("speculators", hybrid_target_dir, cfg, tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("non_causal", [True, False])
def test_no_speculators_flag_serves_a_mixed_drafter_as_trained(hybrid_target_dir: Path, non_causal: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the refusal: vLLM's converter makes sliding_window_non_causal one causal flag for all layers."""
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    cfg = _preset(hybrid_target_dir)
    target = read_target_config(ObjectStore(), str(hybrid_target_dir))
    layer = drafter_hf_config(cfg, target)
    spec = {"speculators_model_type": "dflash", "transformer_layer_config": layer, "mask_token_id": cfg.mask_token_id,
            "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
            "sliding_window_non_causal": non_causal}
    hf = SpeculatorsConfig(**SpeculatorsConfig.extract_transformers_pre_trained_config(spec))
    resolved = _vllm_layer_attention(hf, monkeypatch)
    assert {causal for _, causal in resolved} == {not non_causal}  # every layer alike
    assert resolved != _trained_from_masks(cfg)


def test_vllm_needs_the_v2_runner_for_a_mixed_drafter(tmp_path: Path, hybrid_target_dir: Path) -> None:
    """Serving fact for the hybrid preset: vLLM 0.32 refuses mixed sliding/full drafter layers on the V1 runner."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention

    _export("native", hybrid_target_dir, _preset(hybrid_target_dir), tmp_path)
    hf = _vllm_draft_config(tmp_path)
    runner_v1 = VllmConfig()
    if runner_v1.use_v2_model_runner:
        pytest.skip("this vLLM build picks the V2 runner by default")
    with set_current_vllm_config(runner_v1), pytest.raises(NotImplementedError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        _resolve_layer_attention(hf, 0)


def test_export_stage_refuses_speculators_for_a_mixed_drafter_before_writing(tmp_path: Path,
                                                                          hybrid_target_dir: Path) -> None:
    from safetensors.torch import save_file

    from dflash_train.export.config import ExportConfig
    from dflash_train.export.stage import run_export

    cfg = _preset(hybrid_target_dir)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    save_file(DFlashDrafter(cfg).state_dict(), str(checkpoint / "model.safetensors"))
    (checkpoint / "drafter_config.json").write_text(cfg.model_dump_json())
    (checkpoint / "metrics.json").write_text("{}")
    store = ObjectStore()
    drafter = ef.write_trained(store, str(tmp_path / "drafter"), checkpoint, hybrid_target_dir)
    output = tmp_path / "export"
    with pytest.raises(ExportError, match="cannot describe this drafter"):
        run_export(ExportConfig(drafter=drafter, output=str(output), target=str(hybrid_target_dir), speculators=True),
                   store)
    assert not output.exists() or not any(output.rglob("*"))
