"""The mask token a drafter fills its block with, when neither the config nor the data names one: the reference
drafters' choice for the target (torch-free: the stage resolves it before any model is built)."""

from __future__ import annotations

import logging
import os
from typing import Any

from dflash_shared.errors import ConfigError
from dflash_shared.target_family import config_view, family_of_config

log = logging.getLogger(__name__)


def reference_mask_token(hf_config: Any) -> int | None:
    """The mask token the reference drafters use on this target where its family says it without the tokenizer
    (Qwen3.5/3.6's 248070 on their vocabulary); None elsewhere (the first unused row, `first_unused_row`)."""
    family = family_of_config(config_view(hf_config))
    return None if family is None else family.mask_token_for(int(hf_config.vocab_size))


def default_mask_token(target_dir: str, hf_config: Any) -> int:
    """The reference drafters' mask token: Qwen3.5/3.6's 248070 on their vocabulary, else the first unused row."""
    known = reference_mask_token(hf_config)
    return known if known is not None else first_unused_row(target_dir, int(hf_config.vocab_size))


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


def warn_on_zero_mask_row(target: Any, mask_token_id: int) -> bool:
    """Warn when the mask token's input-embedding row is all zeros (returns whether it is).

    A zero row makes every MASK slot's query in the drafter's first layer exactly zero: that layer then averages
    its visible context uniformly, the same for every slot of a block, and only later layers can tell the slots
    apart (measured on the project's speaking targets: the spread of layer-1 outputs across a block's MASK slots
    3.7e-9 with a zero row, 8.5e-3 with a non-zero one). The reference drafters' mask tokens sit in rows a released
    model trained or initialised; an untrained padding row is zero in some checkpoints.
    """
    row = target.embed_tokens.weight[mask_token_id]
    if bool((row == 0).all()):
        log.warning("mask token %d has an all-zero embedding row in this target: every MASK slot's first-layer "
                    "query is zero (the drafter learns more slowly and its slots start alike). Pick a mask token "
                    "whose row is non-zero (--mask-token-id, an existing token the data never uses), or give the "
                    "row a non-zero value in the target checkpoint", mask_token_id)
        return True
    return False
