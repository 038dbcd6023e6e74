"""Fixtures of the train-stage tests: the tiny random targets and real-vocabulary documents.

The targets are `tests.support.tiny_target`'s: the dense Qwen3 one (4 layers, hidden 128, the real Qwen3
vocabulary of 151,936 embedding rows, tied embeddings) and, for the tests that run on both architectures
(`target_arch`), the Qwen3.6-architecture hybrid (8 layers, 3 x Gated DeltaNet + 1 x full attention twice,
untied 248,320-row head). They are loaded in float32 so comparisons can be tight. Documents are real text
encoded with the real Qwen3 tokenizer: prompt tokens unmasked, completion tokens loss-masked.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.qwen_assets import qwen_special_ids, shared_tokenizer_dir
from tests.support.tiny_target import TARGET_ARCHS, build_tiny_target
from tests.train.train_fixtures import tiny_target

_TEXTS = [
    ("What is the capital of France?", "The capital of France is Paris, a city on the Seine."),
    ("Add 17 and 25.", "17 + 25 = 42. So the answer is 42."),
    ("Name a prime number above ten.", "Eleven is prime: it has no divisors other than one and itself."),
    ("Write a haiku about rain.", "Soft rain on the roof,\nthe garden drinks quietly,\nclouds drift to the east."),
    ("Translate 'good morning' into German.", "Guten Morgen."),
    ("Why is the sky blue?", "Sunlight scatters off air molecules, and blue light scatters the most."),
]


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    """Directory of the cached tiny random Qwen3 target (train_fixtures.tiny_target, for the tests' helpers)."""
    return tiny_target()


@pytest.fixture(scope="session", params=TARGET_ARCHS)
def target_arch(request: pytest.FixtureRequest) -> str:
    """Each target architecture the pipeline supports, for tests that must hold on both."""
    return str(request.param)


@pytest.fixture(scope="session")
def arch_target_dir(target_arch: str) -> Path:
    """Directory of the cached tiny target of `target_arch`."""
    return build_tiny_target(target_arch)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def mask_token_id() -> int:
    """The reference mask token of Qwen3 drafters: an existing, unused row of the embedding."""
    return qwen_special_ids("qwen3")["mask"]


@pytest.fixture(scope="session")
def qwen_docs() -> list[tuple[list[int], list[bool]]]:
    """Real-vocabulary documents as (token ids, loss mask): completion tokens are the trained ones."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(shared_tokenizer_dir("qwen3") / "tokenizer.json"))
    docs = []
    for prompt, answer in _TEXTS:
        p = tok.encode(prompt, add_special_tokens=False).ids
        a = tok.encode(" " + answer, add_special_tokens=False).ids
        docs.append((p + a, [False] * len(p) + [True] * len(a)))
    return docs


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """No compiled graphs or counts from earlier tests, flex's once-per-process fallback warning re-armed (a
    test that makes warnings errors then sees it), and the recompile limit put back afterwards."""
    import torch._dynamo
    import torch.nn.attention.flex_attention as flex_module
    from torch._dynamo.utils import counters

    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    counters.clear()
    flex_module._WARNINGS_SHOWN.discard("flex_attention_performance")
    yield
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = limit


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same global RNG state (drafter init, noise)."""
    torch.manual_seed(0)
