"""The floor a language model must clear on held-out text: a unigram model of the training answers."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any


def unigram_heldout_loss(tokenizer: Any, corpus: Any) -> float:
    """Mean cross-entropy per held-out answer token of an add-one unigram model of the training answers
    (`corpus`: `stdlib_corpus` or `stdlib_code`)."""
    counts: Counter[int] = Counter()
    for pair in corpus.split_pairs("train"):
        counts.update(tokenizer(pair.answer, add_special_tokens=False)["input_ids"])
    total = sum(counts.values())
    held = [token for pair in corpus.split_pairs("heldout")
            for token in tokenizer(pair.answer, add_special_tokens=False)["input_ids"]]
    return -sum(math.log((counts[t] + 1) / (total + len(counts))) for t in held) / len(held)
