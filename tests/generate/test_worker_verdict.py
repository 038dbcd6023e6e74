"""The whole-worker degenerate verdict: pods with fewer prompts than the fail-fast window are judged too."""

from __future__ import annotations

from collections import Counter

import pytest

from dflash_generate.generation import check_degenerate
from dflash_shared.errors import BadInputError


def test_mostly_degenerate_worker_fails_with_counts() -> None:
    totals = Counter({"completions": 48, "degenerate.truncated": 40, "degenerate.repetitive": 2, "output_tokens": 9})
    with pytest.raises(BadInputError, match="42 of 48 completions are degenerate") as err:
        check_degenerate(3, totals, 0.5)
    assert err.value.counts == {"truncated": 40, "repetitive": 2}


def test_healthy_worker_passes() -> None:
    check_degenerate(0, Counter({"completions": 48, "degenerate.truncated": 10}), 0.5)
    check_degenerate(0, Counter({"completions": 0}), 0.5)  # a worker with no prompts has nothing to judge
