"""The mask token a drafter fills its block with, when neither the config nor the data names one: the reference
drafters' choice for the target (torch-free: the stage resolves it before any model is built)."""

from __future__ import annotations

import logging
import os
from typing import Any

from dflash_shared.errors import ConfigError
from dflash_train.drafter.config import QWEN3_6_MASK_TOKEN_ID, QWEN3_6_VOCAB_ROWS, is_hybrid_family

log = logging.getLogger(__name__)


def default_mask_token(target_dir: str, hf_config: Any) -> int:
    """The reference drafters' mask token: Qwen3.5/3.6's 248070 on their vocabulary, else the first unused row."""
    rows = int(hf_config.vocab_size)
    if is_hybrid_family(hf_config) and rows == QWEN3_6_VOCAB_ROWS:
        return QWEN3_6_MASK_TOKEN_ID
    return first_unused_row(target_dir, rows)


def first_unused_row(target_dir: str, embedding_rows: int) -> int:
    """The reference drafters' mask token: the first embedding row past the tokenizer (Qwen3: 151669).

    Only where the embedding has such padding rows; otherwise no row is known to be unused.
    """
    from tokenizers import Tokenizer

    tokens = Tokenizer.from_file(os.path.join(target_dir, "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    if tokens >= embedding_rows:
        raise ConfigError(
            f"no mask token id: the target's {embedding_rows} embedding rows are all tokenizer tokens; set "
            "--mask-token-id (an existing token the data never uses), or record one in the tokenized manifest"
        )
    log.info("mask_token_id %d: the first of the target's embedding rows past its %d tokenizer tokens", tokens,
             tokens)
    return tokens
