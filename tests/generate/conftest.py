"""Fixtures of the generate-stage tests: a real Qwen tokenizer directory, the tiny targets and their transformers
tokenizers, one engine.

The target fixtures are parametrized over the supported architectures (`TARGET_ARCHS`: dense Qwen3 and the
hybrid Qwen3.6 layout), so every test that uses them runs once per architecture. Starting a vLLM engine
takes tens of seconds on CPU, so the tests of one architecture share the session's engine (same model and
context length; thinking mode and sampling are per request); pytest groups the tests by architecture and
closes one engine before it starts the next. A test about the stage's bookkeeping rather than the model
runs on one architecture (`stage_support.ONE_ARCH`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.generate.stage_support import ENGINE_SETTINGS
from tests.support.qwen_assets import build_tokenizer_dir
from tests.support.tiny_target import TARGET_ARCHS, TargetArch


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 tokenizer directory (real vocabulary, our Qwen3-style chat template)."""
    return build_tokenizer_dir(tmp_path_factory.mktemp("qwen3-tokenizer"), "qwen3")


@pytest.fixture(scope="session", params=TARGET_ARCHS)
def target_arch(request: pytest.FixtureRequest) -> TargetArch:
    """The architecture of the session's tiny target (each in turn)."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def tiny_target_dir(target_arch: TargetArch) -> Path:
    """The cached tiny random target of `target_arch` (needs torch; only engine tests ask for it)."""
    pytest.importorskip("torch", reason="the tiny targets are built with torch (the generate environment)")
    from tests.support.tiny_target import build_tiny_target

    return build_tiny_target(target_arch)


@pytest.fixture(scope="session")
def hf_tok(tiny_target_dir: Path) -> Any:
    """transformers' tokenizer of the session's tiny target: the reference for the ids the engine saw and said."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Small KV cache, no hub, a private compile cache: for engines in this process and in subprocesses."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm-cache")),
    }
    mp = pytest.MonkeyPatch()
    for key, value in env.items():
        mp.setenv(key, value)
    yield env
    mp.undo()


@pytest.fixture(scope="session")
def engine(tiny_target_dir: Path, vllm_env: dict[str, str]) -> Iterator[Any]:
    """One started vLLM engine on the tiny target for the whole session."""
    pytest.importorskip("vllm", reason="engine tests need the generate environment (.venv-generate)")
    from dflash_generate.engine import EngineConfig, VllmEngine

    eng = VllmEngine(EngineConfig(model=str(tiny_target_dir), **ENGINE_SETTINGS))
    try:
        yield eng
    finally:
        eng.close()
