"""Fixtures of the generate-stage tests: a real Qwen tokenizer directory and the tiny Qwen3 target."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.qwen_assets import build_tokenizer_dir


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 tokenizer directory (real vocabulary, our Qwen3-style chat template)."""
    return build_tokenizer_dir(tmp_path_factory.mktemp("qwen3-tokenizer"), "qwen3")


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    """The cached tiny random Qwen3 target (needs torch; only engine tests ask for it)."""
    from tests.support.tiny_target import build_tiny_qwen3

    return build_tiny_qwen3()
