"""Tiny random-weight targets with the real Qwen vocabularies, for engine and trainer tests on CPU.

Two architectures every stage's tests run on (`TARGET_ARCHS`), and the other families' (`MOE_ARCHS`, `QWEN2_ARCHS`)
that their own tests and the demo run end to end:
- "qwen3": a dense `Qwen3ForCausalLM` (tied embeddings, Qwen3 vocabulary and template);
- "qwen2": a dense `Qwen2ForCausalLM` (Qwen2.5-0.5B's layout at toy width: q/k/v biases, no q/k norms, tied
  embeddings), Qwen2.5's 151,665-token vocabulary and template (no thinking mode);
- "qwen3_moe": a `Qwen3MoeForCausalLM` (Qwen3-30B-A3B's layout at toy width: every layer a mixture of 8 experts, 2
  routed per token, no shared expert), Qwen3 vocabulary and template;
- "qwen3_6_moe": the "qwen3_6" layout below as a `Qwen3_5MoeForConditionalGeneration` (model_type `qwen3_5_moe`):
  every layer's MLP 8 routed experts and a gated shared expert;
- "qwen3_6": the Qwen3.6-27B layout at toy width: a `Qwen3_5ForConditionalGeneration` checkpoint
  (model_type `qwen3_5`, nested `text_config`), layers in the real 3 x Gated DeltaNet + 1 x gated full
  attention pattern, full attention with partial rotary 0.25 and interleaved mRoPE, an untied LM head over
  the padded 248,320-row Qwen3.6 vocabulary, a tiny vision tower and MTP weights, saved under the real key
  prefixes (`model.language_model.*`, `model.visual.*`, `mtp.*`, `lm_head.weight`).
Weights are random (seeded) bf16 safetensors next to the tokenizer directory from `tests.support.qwen_assets`.
The output is noise, which is all the tests need: real token ids, a real chat template, a real engine.
vLLM's CPU backend accepts attention head_dim 64 (not 16) and its Gated DeltaNet kernel linear-attention
head dim 128 (not 32), so those stay that wide while the hidden size stays small.

Builds are cached under `$DFLASH_CACHE` (default `~/.cache/dflash-pipeline`), keyed by the parameters
and the sources that shape the result, so a test session builds each variant once.
Needs torch and transformers (the generate environment has both).

CLI: `python -m tests.support.tiny_target OUT_DIR [--arch qwen2|qwen3|qwen3_6|qwen3_moe|qwen3_6_moe] [--seed N]`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from tests.support import qwen_assets
from tests.support.qwen_assets import Vocab, build_tokenizer_dir, qwen_embedding_rows, qwen_special_ids

TargetArch = Literal["qwen3", "qwen3_6", "qwen3_moe", "qwen3_6_moe", "qwen2"]
TARGET_ARCHS: tuple[TargetArch, ...] = ("qwen3", "qwen3_6")
MOE_ARCHS: tuple[TargetArch, ...] = ("qwen3_moe", "qwen3_6_moe")
QWEN2_ARCHS: tuple[TargetArch, ...] = ("qwen2",)
ALL_ARCHS: tuple[TargetArch, ...] = TARGET_ARCHS + MOE_ARCHS + QWEN2_ARCHS

# Bump when the way the model is built changes, so stale caches are not reused.
_BUILD_VERSION = "4"
_DONE = ".complete"


def _cache_key(params: dict[str, object]) -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(json.dumps(params, sort_keys=True).encode())
    # The random init and file layout depend on these versions; the tokenizer on qwen_assets' sources.
    h.update(f"{_BUILD_VERSION}|{torch.__version__}|{transformers.__version__}".encode())
    for source in (Path(qwen_assets.__file__), *qwen_assets.CHAT_TEMPLATE_PATHS.values()):
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def _write_model(out_dir: Path, vocab: Vocab, seed: int, shape: dict[str, int], experts: int = 0) -> None:
    """A dense Qwen3 target, or with `experts` > 0 its mixture-of-experts sibling (every layer sparse, 2 experts
    routed per token, each expert's MLP a quarter of the dense intermediate width); on the "qwen2" vocabulary a
    dense Qwen2 (Qwen2.5) target, whose config has no head_dim (hidden / heads)."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    build_tokenizer_dir(out_dir, vocab)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    ids = qwen_special_ids(vocab)
    rows = qwen_embedding_rows(vocab)
    if rows < len(tokenizer) or rows % 64:
        raise RuntimeError(f"embedding rows {rows} do not cover the {len(tokenizer)} tokens of {vocab}")
    moe = {"num_experts": experts, "num_experts_per_tok": 2, "moe_intermediate_size": shape["intermediate"] // 4,
           "decoder_sparse_step": 1, "mlp_only_layers": []} if experts else {}
    qwen2 = vocab == "qwen2"
    if qwen2 and shape["hidden"] != shape["heads"] * shape["head_dim"]:
        raise ValueError("a Qwen2 target's head_dim is hidden / heads")
    config_class, model_class = ((Qwen2Config, Qwen2ForCausalLM) if qwen2 else
                                 (Qwen3MoeConfig, Qwen3MoeForCausalLM) if experts else (Qwen3Config, Qwen3ForCausalLM))
    config = config_class(
        vocab_size=rows,
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        **({} if qwen2 else {"head_dim": shape["head_dim"]}),
        max_position_embeddings=shape["max_position"],
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=ids["endoftext"],
        eos_token_id=ids["im_end"],
        pad_token_id=ids["endoftext"],
        dtype="bfloat16",
        **moe,
    )
    # Initialise in float32 from a fixed seed, then cast: the same seed gives the same file.
    torch.manual_seed(seed)
    model = model_class(config).to(torch.bfloat16).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    finish_model_dir(out_dir, ids)


def finish_model_dir(out_dir: Path, ids: dict[str, int]) -> None:
    """The generation config every target ships, and file modes any user can read."""
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=ids["endoftext"],
        eos_token_id=[ids["im_end"], ids["endoftext"]],
        pad_token_id=ids["endoftext"],
    ).save_pretrained(out_dir)
    # Readable by any user: container tests mount the directory into images that run as non-root.
    for path in out_dir.iterdir():
        path.chmod(0o644)


def _write_qwen3_6(out_dir: Path, seed: int, shape: dict[str, int], experts: int = 0) -> None:
    """The Qwen3.6 layout; with `experts` > 0 its mixture-of-experts sibling's (Qwen3_5Moe: every layer's MLP
    `experts` routed experts of a quarter of the dense width, 2 per token, beside a gated shared expert)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    build_tokenizer_dir(out_dir, "qwen3_6")
    ids = qwen_special_ids("qwen3_6")
    hidden = shape["hidden"]
    head_dim = shape["head_dim"]
    rotary_half = int(head_dim * 0.25) // 2
    # The real split is [11, 11, 10] of 32 rotary frequencies (temporal, height, width); same proportions.
    base, extra = divmod(rotary_half, 3)
    mrope = [base + (1 if axis < extra else 0) for axis in range(3)]
    text_config = {
        "vocab_size": qwen_embedding_rows("qwen3_6"),
        "hidden_size": hidden,
        "intermediate_size": shape["intermediate"],
        "num_hidden_layers": shape["num_layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": shape["linear_head_dim"],
        "linear_value_head_dim": shape["linear_head_dim"],
        "linear_num_key_heads": shape["linear_k_heads"],
        "linear_num_value_heads": shape["linear_v_heads"],
        "full_attention_interval": 4,
        "max_position_embeddings": shape["max_position"],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": mrope,
        },
        "attn_output_gate": True,
        "mtp_num_hidden_layers": 1,
        "eos_token_id": ids["im_end"],
        "bos_token_id": ids["endoftext"],
        "pad_token_id": ids["endoftext"],
        "dtype": "bfloat16",
    }
    if experts:
        del text_config["intermediate_size"]
        text_config.update(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=shape["intermediate"] // 4,
                           shared_expert_intermediate_size=shape["intermediate"] // 2)
    vision_config = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": hidden,
        "num_position_embeddings": 64,
    }
    config_class, model_class, layer_class = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration,
                                               Qwen3_5MoeDecoderLayer) if experts else
                                              (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5DecoderLayer))
    config = config_class(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False)
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(config)
    # An independent random head makes a tiny model emit uniform noise that no drafter can learn. As in
    # trained models, whose head correlates with the embedding, the head starts as the embedding plus noise
    # (its own spread): greedy output then has runs and switches, which a drafter can partly learn, and
    # the two tensors still differ (a loader that confused them would produce other logits).
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        model.lm_head.weight.copy_(embed + 1.0 * embed.std() * torch.randn_like(embed))
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(out_dir, safe_serialization=True)

    # transformers builds no MTP module; the checkpoint has one (one full-attention decoder layer that reads
    # [norm(embedding); norm(hidden)] through `fc`), and loaders must skip it. Add it under its real names.
    text = config.text_config
    full_layer = text.layer_types.index("full_attention")
    mtp: dict[str, torch.Tensor] = {}
    for name, tensor in layer_class(text, full_layer).state_dict().items():
        mtp[f"mtp.layers.0.{name}"] = tensor
    mtp["mtp.fc.weight"] = torch.nn.Linear(2 * hidden, hidden, bias=False).weight.detach()
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = Qwen3_5RMSNorm(hidden).weight.detach()
    weights_path = out_dir / "model.safetensors"
    weights = load_file(str(weights_path))
    weights.update({k: v.to(torch.bfloat16).contiguous() for k, v in mtp.items()})
    save_file(weights, str(weights_path), metadata={"format": "pt"})
    finish_model_dir(out_dir, ids)


def _cached_build(family: str, params: dict[str, Any], write: Any, out_dir: Path | None) -> Path:
    """Build with `write(tmp_dir)` once per parameter set in the cache; copy into `out_dir` when given."""
    key = _cache_key({"family": family, **params})
    cached = qwen_assets.cache_root() / f"tiny-{family}" / f"s{params['seed']}-{key}"
    return cached_model_build(cached, key, write, out_dir)


def cached_model_build(cached: Path, key: str, write: Any, out_dir: Path | None) -> Path:
    """`cached`, built by `write(tmp_dir)` unless complete; copied into `out_dir` when given (returned then)."""
    if not (cached / _DONE).is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the cache entry and rename: concurrent builders never see a half-written model.
        tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent))
        try:
            write(tmp)
            (tmp / _DONE).write_text(key + "\n", encoding="utf-8")
            os.chmod(tmp, 0o755)
            try:
                os.rename(tmp, cached)
            except OSError:
                if not (cached / _DONE).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if out_dir is None:
        return cached
    out_dir = Path(out_dir)
    shutil.copytree(cached, out_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(_DONE))
    return out_dir


def build_tiny_qwen3(
    out_dir: Path | None = None,
    vocab: Vocab = "qwen3",
    seed: int = 0,
    num_layers: int = 4,
    hidden: int = 128,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 64,
    intermediate: int = 256,
    max_position: int = 2048,
) -> Path:
    """Directory of a random Qwen3 target (config, bf16 weights, tokenizer, generation config).

    The model is built once per parameter set in the cache; `out_dir` (if given) receives a copy.
    Returns `out_dir`, or the cached directory when `out_dir` is None.
    """
    shape = {
        "num_layers": num_layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate": intermediate,
        "max_position": max_position,
    }
    params = {"vocab": vocab, "seed": seed, **shape}
    return _cached_build("qwen3", params, lambda tmp: _write_model(tmp, vocab, seed, shape), out_dir)


def build_tiny_qwen3_6(
    out_dir: Path | None = None,
    seed: int = 0,
    num_layers: int = 8,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 1,
    head_dim: int = 64,
    linear_k_heads: int = 1,
    linear_v_heads: int = 3,
    linear_head_dim: int = 128,
    intermediate: int = 256,
    max_position: int = 2048,
) -> Path:
    """Directory of a random Qwen3.6-architecture target (see the module docstring); cached like Qwen3's.

    8 layers = the real 3:1 pattern twice, so drafter layer ids can read both kinds of layer. Heads keep
    Qwen3.6's ratios at toy width: 4 query / 1 KV (real 24 / 4), 1 QK / 3 V linear heads (real 16 / 48).
    """
    shape = {
        "num_layers": num_layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "linear_k_heads": linear_k_heads,
        "linear_v_heads": linear_v_heads,
        "linear_head_dim": linear_head_dim,
        "intermediate": intermediate,
        "max_position": max_position,
    }
    params = {"seed": seed, **shape}
    return _cached_build("qwen3_6", params, lambda tmp: _write_qwen3_6(tmp, seed, shape), out_dir)


def build_tiny_qwen3_moe(out_dir: Path | None = None, seed: int = 0, experts: int = 8) -> Path:
    """Directory of a random Qwen3 mixture-of-experts target: the tiny Qwen3's attention and width, each layer's
    MLP replaced by `experts` experts of a quarter of its width, 2 routed per token; cached like Qwen3's."""
    shape = {"num_layers": 4, "hidden": 128, "heads": 2, "kv_heads": 1, "head_dim": 64, "intermediate": 256,
             "max_position": 2048}
    params = {"vocab": "qwen3", "seed": seed, "experts": experts, **shape}
    return _cached_build("qwen3_moe", params, lambda tmp: _write_model(tmp, "qwen3", seed, shape, experts), out_dir)


def build_tiny_qwen3_6_moe(out_dir: Path | None = None, seed: int = 0, experts: int = 8) -> Path:
    """Directory of a random Qwen3.6-MoE-architecture target: the tiny Qwen3.6's layout with `experts` routed experts
    and a shared one in every layer (`_write_qwen3_6`); cached like the others."""
    shape = {"num_layers": 8, "hidden": 128, "heads": 4, "kv_heads": 1, "head_dim": 64, "linear_k_heads": 1,
             "linear_v_heads": 3, "linear_head_dim": 128, "intermediate": 256, "max_position": 2048}
    params = {"seed": seed, "experts": experts, **shape}
    return _cached_build("qwen3_6_moe", params, lambda tmp: _write_qwen3_6(tmp, seed, shape, experts), out_dir)


def build_tiny_qwen2(out_dir: Path | None = None, seed: int = 0) -> Path:
    """Directory of a random Qwen2 (Qwen2.5) target: the tiny Qwen3's width and depth (head_dim = hidden / heads,
    as Qwen2 configs state none) on Qwen2.5's vocabulary and template; cached like Qwen3's."""
    shape = {"num_layers": 4, "hidden": 128, "heads": 2, "kv_heads": 1, "head_dim": 64, "intermediate": 256,
             "max_position": 2048}
    params = {"vocab": "qwen2", "seed": seed, **shape}
    return _cached_build("qwen2", params, lambda tmp: _write_model(tmp, "qwen2", seed, shape), out_dir)


def build_tiny_target(arch: TargetArch = "qwen3", out_dir: Path | None = None, seed: int = 0) -> Path:
    """The default tiny target of `arch` ("qwen3" dense, "qwen3_6" hybrid, their mixtures of experts "qwen3_moe" and
    "qwen3_6_moe", "qwen2" the Qwen2.5 family's dense target)."""
    if arch == "qwen3":
        return build_tiny_qwen3(out_dir, seed=seed)
    if arch == "qwen3_6":
        return build_tiny_qwen3_6(out_dir, seed=seed)
    if arch == "qwen3_moe":
        return build_tiny_qwen3_moe(out_dir, seed=seed)
    if arch == "qwen3_6_moe":
        return build_tiny_qwen3_6_moe(out_dir, seed=seed)
    if arch == "qwen2":
        return build_tiny_qwen2(out_dir, seed=seed)
    raise ValueError(f"unknown target architecture {arch!r}; expected one of {ALL_ARCHS}")


# The varied targets' output alphabet: ordinary tokens of both vocabularies, none of them special.
VARIED_ALPHABET = range(1000, 1024)


# A layer's output projections: what it adds to the residual stream.
_OUTPUT_PROJECTION = re.compile(r"\.layers\.(\d+)\.(?:self_attn\.o_proj|linear_attn\.out_proj|mlp\.down_proj)\.weight$")
# Growth of the layers' output projections per layer (`build_varied_target`), where 1 leaves neighbouring layers'
# states too alike for the learnability gate: the hybrid fixture's consecutive hidden states had a cosine of
# 0.72-0.93, and a drafter memorising on layers 1, 3, 5 still had 83.7% of its tokens accepted reading layers 0, 2, 4
# (the gate caught it only just). At 2 (0.45-0.53) it has 6.7%. The dense fixture stays at 1: at 2 its answers
# collapse to 5-7 distinct tokens, and at 1 the gate already fails that defect at 31.4%.
VARIED_GROWTH: dict[str, float] = {"qwen3_6": 2.0}


def build_varied_target(arch: TargetArch = "qwen3", scale: float = 4.0, boost: float = 30.0,
                        growth: float | None = None) -> Path:
    """The default tiny target of `arch` made to say something that takes context to predict, cached.

    At the default initialisation the greedy output settles on one token repeated (a fixed point), which any
    drafter predicts from nothing. Here the decoder layers' weight matrices are multiplied by `scale` (the network
    is then far from linear: its output changes from token to token) and the LM head rows of a 24-token alphabet
    by `boost` (the output stays within it, so a token does not say what follows it, the target's hidden states
    do). The dense target's LM head is untied for this (as Qwen3-8B's is). The learnability gate's tests need it:
    memorising such answers depends on the target layers the drafter reads. Layer l's output projections are also
    multiplied by `growth` ** l (default `VARIED_GROWTH`), so that each layer's addition outweighs the stream it
    joins and neighbouring layers' states differ.
    """
    growth = VARIED_GROWTH.get(arch, 1.0) if growth is None else growth
    base = build_tiny_target(arch)

    def write(tmp: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        shutil.copytree(base, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(_DONE))
        weights = load_file(str(tmp / "model.safetensors"))
        for name, tensor in weights.items():
            # The text model's decoder layers only: the vision tower and the MTP head are not what is decoded.
            if ".layers." in name and tensor.ndim == 2 and not name.startswith(("mtp.", "model.visual.")):
                output = _OUTPUT_PROJECTION.search(name)
                factor = scale * (growth ** int(output.group(1)) if output else 1.0)
                weights[name] = (tensor.float() * factor).to(torch.bfloat16).contiguous()
        if "lm_head.weight" not in weights:  # tied: the head gets a copy of the embedding of its own
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
            config = json.loads((tmp / "config.json").read_text())
            config["tie_word_embeddings"] = False
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        head = weights["lm_head.weight"].float()
        head[list(VARIED_ALPHABET)] *= boost
        weights["lm_head.weight"] = head.to(torch.bfloat16).contiguous()
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for path in tmp.iterdir():
            path.chmod(0o644)

    key = _cache_key({"family": arch, "base": base.name, "scale": scale, "boost": boost,
                      "alphabet": [VARIED_ALPHABET.start, VARIED_ALPHABET.stop],
                      **({"growth": growth} if growth != 1.0 else {})})
    return cached_model_build(qwen_assets.cache_root() / f"tiny-{arch}" / f"varied-{key}", key, write, None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--arch", choices=ALL_ARCHS, default="qwen3", help="target architecture")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    args = parser.parse_args(argv)
    print(build_tiny_target(args.arch, args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
