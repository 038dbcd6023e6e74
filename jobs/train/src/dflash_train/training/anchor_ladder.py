"""The ladder of anchor counts N a training step may use, without torch (see `anchors` for why N is bucketed).

`anchors` samples the anchors and imports torch; the memory plan needs only the ladder, and so does the
pipeline's pre-submit fit check, which plans where torch is not installed. `anchors` imports these, so there is
one ladder; its bound on distinct drafter attention shapes is ceil(log2(ceil(cap / m))) + 1.
"""

from __future__ import annotations

# Query tiles of flex attention are 128 tokens; N * block_size is rounded up to a multiple of this so the
# number of query tokens is tile-aligned.
QUERY_TILE = 128


def anchor_count_multiple(block_size: int) -> int:
    """N is padded to a multiple of this, so that N * block_size fills whole query tiles where it can."""
    return max(1, QUERY_TILE // block_size) if QUERY_TILE % block_size == 0 else 1


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def anchor_count_buckets(block_size: int, max_anchors_per_row: int) -> tuple[int, ...]:
    """The ladder of anchor counts N a step may use: m * 2^k below the cap, then the cap rounded up to m."""
    if max_anchors_per_row < 1:
        raise ValueError(f"max_anchors_per_row must be >= 1, got {max_anchors_per_row}")
    multiple = anchor_count_multiple(block_size)
    top = _round_up(max_anchors_per_row, multiple)
    rungs = []
    rung = multiple
    while rung < top:
        rungs.append(rung)
        rung *= 2
    rungs.append(top)
    return tuple(rungs)


def bucket_anchor_count(count: int, block_size: int, max_anchors_per_row: int | None) -> int:
    """N for a step whose widest row has `count` anchors: the smallest ladder rung >= count (without a cap the
    ladder is m * 2^k without end; a count above the top rung is rounded up to the multiple)."""
    multiple = anchor_count_multiple(block_size)
    count = max(count, 1)
    if max_anchors_per_row is None:
        rung = multiple
        while rung < count:
            rung *= 2
        return rung
    for rung in anchor_count_buckets(block_size, max_anchors_per_row):
        if rung >= count:
            return rung
    return _round_up(count, multiple)
