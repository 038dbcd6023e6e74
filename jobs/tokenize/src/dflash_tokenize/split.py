"""The held-out split: which tokenized records training never reads, decided by their content id alone.

The evaluation measures acceptance on prompts the drafter never trained on. Choosing them by a hash of the
record id (not by position or by shard) makes the choice deterministic and independent of sharding, worker
count and input order, and keeps repeated ids (several samples of one prompt) on one side. The fraction is
raised on small inputs so that the evaluation still gets about `min_records` prompts; the total it is based on
is the input manifest's record count, which every worker knows before it reads a line.
"""

from __future__ import annotations

import hashlib

import numpy as np

from dflash_shared.manifests import Split
from dflash_tokenize.arrow_shards import Sequences

__all__ = ["MAX_FRACTION", "Split", "effective_fraction", "heldout_position", "is_heldout", "partition"]

_SALT = b"dflash-heldout:"
# At most this share of the input is held out, however large min_records is against a tiny input.
MAX_FRACTION = 0.5


def effective_fraction(fraction: float, min_records: int, input_records: int) -> float:
    """max(fraction, min_records / input_records), at most MAX_FRACTION; 0 when the split is off."""
    if fraction <= 0 or input_records <= 0:
        return 0.0
    return min(MAX_FRACTION, max(fraction, min_records / input_records))


def heldout_position(record_id: str) -> float:
    """Where the id falls in [0, 1): the first 8 bytes of sha256(salt + id) over 2**64."""
    digest = hashlib.sha256(_SALT + record_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_heldout(record_id: str, fraction: float) -> bool:
    return fraction > 0 and heldout_position(record_id) < fraction


def partition(sequences: Sequences, fraction: float) -> tuple[Sequences, Sequences]:
    """(train, held-out) rows of a batch, each in input order."""
    if fraction <= 0:
        return sequences, sequences.take(np.zeros(0, dtype=np.int64))
    flags = np.fromiter((is_heldout(rid, fraction) for rid in sequences.ids), dtype=bool, count=len(sequences))
    return sequences.take(np.flatnonzero(~flags)), sequences.take(np.flatnonzero(flags))
