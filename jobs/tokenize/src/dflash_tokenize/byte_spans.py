"""Token positions from ids alone, for byte-level BPE tokenizers: the stage's fast path in render mode.

Finding which token starts at an assistant span boundary needs each token's position in the text. The
tokenizer can report offsets, but tracking them costs about a tenth of the encoding time. For a
byte-level BPE (Qwen, Llama 3, GPT-2 families) every id stands for a fixed string of bytes, so the
cumulative byte lengths of the ids ARE the token positions, provided that the text the tokenizer saw is
the text we hold: no normalizer, or NFC on text already in NFC, and no added token that swallowed
whitespace (lstrip/rstrip). The last condition shows as a total that differs from the text's length, so
a record is placed by bytes only when its total matches; any other record takes the offsets path.
"""

from __future__ import annotations

import unicodedata

import numpy as np
from tokenizers import Tokenizer, decoders, normalizers


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray | None:
    """Bytes of text each id stands for (int64, indexed by id), or None when that is not fixed."""
    model = tokenizer.model
    if not isinstance(tokenizer.decoder, decoders.ByteLevel) or type(model).__name__ != "BPE":
        return None
    if getattr(model, "byte_fallback", False):
        return None
    if tokenizer.normalizer is not None and not isinstance(tokenizer.normalizer, normalizers.NFC):
        return None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    # Byte-level vocabulary strings spell one character per byte; an id without a token gets -1.
    # (One id_to_token call per id is faster than get_vocab's 250k-entry dict.)
    tokens = map(tokenizer.id_to_token, range(size))
    lengths = np.fromiter((len(t) if t is not None else -1 for t in tokens), dtype=np.int64, count=size)
    for index, added in tokenizer.get_added_tokens_decoder().items():
        lengths[index] = len(str(added.content).encode("utf-8"))
    return lengths


def text_is_as_encoded(tokenizer: Tokenizer, text: str) -> bool:
    """Whether the tokenizer's normalizer leaves `text` unchanged (so byte positions carry over)."""
    return tokenizer.normalizer is None or unicodedata.is_normalized("NFC", text)


class BytePositions:
    """Where each token of one encoded text starts, in bytes of the text's UTF-8 form."""

    def __init__(self, text: str, ids: np.ndarray, lengths: np.ndarray) -> None:
        self.text = text
        per_token = lengths[ids]
        self.ends = np.cumsum(per_token)
        total = int(self.ends[-1]) if per_token.size else 0
        self.valid = bool((per_token.size == 0 or per_token.min() >= 0) and total == len(text.encode("utf-8")))

    def token_at(self, char: int) -> int | None:
        """Index of the token that starts exactly at character `char` (the count at the end); else None."""
        if char >= len(self.text):
            return int(self.ends.size)
        byte = len(self.text[:char].encode("utf-8"))
        index = int(np.searchsorted(self.ends, byte, side="right"))
        start = int(self.ends[index - 1]) if index else 0
        return index if start == byte else None
