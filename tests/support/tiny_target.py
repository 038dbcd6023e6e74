"""A tiny random-weight Qwen3 target with the real Qwen vocabulary, for engine tests on CPU.

The model is a `Qwen3ForCausalLM` with a few small layers and random (seeded) weights, saved as bf16
safetensors next to the tokenizer directory from `tests.support.qwen_assets`. Its output is noise, which
is all the generate tests need: real token ids, a real chat template, a real engine. vLLM's CPU backend
accepts head_dim 64 (not 16), so heads stay that wide while the hidden size stays small.

Builds are cached under `$DFLASH_CACHE` (default `~/.cache/dflash-pipeline`), keyed by the parameters
and the sources that shape the result, so a test session builds each variant once.
Needs torch and transformers (the generate environment has both).

CLI: `python -m tests.support.tiny_target OUT_DIR [--vocab qwen3|qwen3_6] [--seed N]`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from tests.support import qwen_assets
from tests.support.qwen_assets import Vocab, build_tokenizer_dir, qwen_embedding_rows, qwen_special_ids

# Bump when the way the model is built changes, so stale caches are not reused.
_BUILD_VERSION = "1"
_DONE = ".complete"


def _cache_key(params: dict[str, object]) -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(json.dumps(params, sort_keys=True).encode())
    # The random init and file layout depend on these versions; the tokenizer on qwen_assets' sources.
    h.update(f"{_BUILD_VERSION}|{torch.__version__}|{transformers.__version__}".encode())
    for source in (Path(qwen_assets.__file__), qwen_assets.CHAT_TEMPLATE_PATH):
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def _write_model(out_dir: Path, vocab: Vocab, seed: int, shape: dict[str, int]) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    build_tokenizer_dir(out_dir, vocab)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    ids = qwen_special_ids(vocab)
    rows = qwen_embedding_rows(vocab)
    if rows < len(tokenizer) or rows % 64:
        raise RuntimeError(f"embedding rows {rows} do not cover the {len(tokenizer)} tokens of {vocab}")
    config = Qwen3Config(
        vocab_size=rows,
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=shape["max_position"],
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=ids["endoftext"],
        eos_token_id=ids["im_end"],
        pad_token_id=ids["endoftext"],
        dtype="bfloat16",
    )
    # Initialise in float32 from a fixed seed, then cast: the same seed gives the same file.
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids["endoftext"],
        eos_token_id=[ids["im_end"], ids["endoftext"]],
        pad_token_id=ids["endoftext"],
    ).save_pretrained(out_dir)
    # Readable by any user: container tests mount the directory into images that run as non-root.
    for path in out_dir.iterdir():
        path.chmod(0o644)


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
    key = _cache_key({"vocab": vocab, "seed": seed, **shape})
    cached = qwen_assets.cache_root() / "tiny-qwen3" / f"{vocab}-s{seed}-{key}"
    if not (cached / _DONE).is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the cache entry and rename: concurrent builders never see a half-written model.
        tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent))
        try:
            _write_model(tmp, vocab, seed, shape)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    parser.add_argument("--vocab", choices=qwen_assets.VOCABS, default="qwen3", help="Qwen vocabulary")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    args = parser.parse_args(argv)
    print(build_tiny_qwen3(args.out_dir, vocab=args.vocab, seed=args.seed))


if __name__ == "__main__":
    main()
