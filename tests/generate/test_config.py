"""The generate config, the target identity and the pod's worker layout (no engine needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_generate.config import GenerateConfig
from dflash_generate.parallel import child_env
from dflash_generate.sampling import qwen_non_thinking, qwen_thinking
from dflash_generate.stage import target_identity, worker_shard
from dflash_shared import identity
from dflash_shared.errors import ConfigError
from dflash_shared.settings import parse_settings
from tests.support.qwen_assets import qwen_special_ids

IDS = qwen_special_ids("qwen3")
BASE = ["--input", "s3://b/prompts", "--output", "s3://b/completions", "--model", "Qwen/Qwen3-8B"]


def clear_stage_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.upper().startswith(("DFLASH_GENERATE_", "JOB_COMPLETION_INDEX", "DFLASH_NUM_SHARDS")):
            monkeypatch.delenv(key)


def test_flags_environment_and_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_stage_env(monkeypatch)
    monkeypatch.setenv("DFLASH_GENERATE_MAX_NEW_TOKENS", "2048")
    monkeypatch.setenv("DFLASH_GENERATE_ENABLE_THINKING", "false")
    config = parse_settings(GenerateConfig, [*BASE, "--temperature", "0.2", "--tensor-parallel-size", "2"])
    assert (config.max_new_tokens, config.enable_thinking, config.tensor_parallel_size) == (2048, False, 2)
    # Recommended non-thinking values, with the one override and the length budget.
    assert config.sampling() == qwen_non_thinking().with_overrides(temperature=0.2, max_tokens=2048)
    assert config.inflight == config.chunk_records == 512
    engine = config.engine_config("/models/q")
    # The engine's context is the training window (4,096 by default): completions stop where it ends.
    assert (engine.model, engine.tensor_parallel_size, engine.max_model_len) == ("/models/q", 2, 4096)


def test_thinking_defaults_to_the_recommended_thinking_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_stage_env(monkeypatch)
    config = parse_settings(GenerateConfig, BASE)
    # Unset: the family's default mode, thinking for Qwen3.
    assert config.enable_thinking is None and config.settle().enable_thinking is True
    # Qwen3's 8K budget, capped to what the default 4,096-token training window holds beside a prompt.
    assert config.sampling() == qwen_thinking().with_overrides(max_tokens=4095)


def test_inconsistent_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_stage_env(monkeypatch)
    with pytest.raises(ConfigError, match="max_new_tokens .* must be below max_model_len"):
        parse_settings(GenerateConfig, [*BASE, "--max-new-tokens", "16384", "--max-model-len", "16384"])
    with pytest.raises(ConfigError, match="data_parallel_rank 2 is out of range"):
        parse_settings(GenerateConfig, [*BASE, "--data-parallel-size", "2", "--data-parallel-rank", "2"])
    with pytest.raises(ConfigError, match="--top-p"):
        parse_settings(GenerateConfig, [*BASE, "--top-p", "1.5"])


def test_engine_processes_get_the_parents_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_stage_env(monkeypatch)
    parent = parse_settings(
        GenerateConfig, [*BASE, "--data-parallel-size", "2", "--no-enable-thinking", "--seed", "3", "--top-k", "5"]
    )
    env = child_env(parent, 1, ["6", "7"], base={"LANG": "C.UTF-8", "DFLASH_GENERATE_TYPO": "x"})
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and env["LANG"] == "C.UTF-8"
    assert "DFLASH_GENERATE_TYPO" not in env  # the parent's stray variables do not reach the child
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    child = parse_settings(GenerateConfig, [])
    assert child == parent.model_copy(update={"data_parallel_rank": 1})


def test_worker_layout_covers_every_engine_once(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_stage_env(monkeypatch)
    seen = []
    for pod in range(3):
        for rank in range(2):
            config = GenerateConfig(input="i", output="o", model="a/b", shard_index=pod, num_shards=3,
                                    data_parallel_size=2, data_parallel_rank=rank)
            seen.append(worker_shard(config))
    assert sorted(seen) == [(i, 6) for i in range(6)]


def test_target_identity_uses_the_shared_hashes(qwen3_tokenizer_dir: Path) -> None:
    config = GenerateConfig(input="i", output="o", model=str(qwen3_tokenizer_dir), model_id="org/tiny",
                            enable_thinking=False)
    target = target_identity(config, str(qwen3_tokenizer_dir), "abc123", enable_thinking=False)
    assert target.tokenizer_sha256 == identity.tokenizer_sha256(qwen3_tokenizer_dir)
    assert target.chat_template_sha256 == identity.chat_template_sha256(qwen3_tokenizer_dir)
    assert (target.model_id, target.revision, target.enable_thinking) == ("org/tiny", "abc123", False)
    special = target.special_tokens
    assert (special.end_of_turn, special.think_start, special.think_end) == (
        IDS["im_end"], IDS["think_start"], IDS["think_end"])
    with pytest.raises(ConfigError, match=re.escape("end_of_turn token '<|eot_id|>' is not in the vocabulary")):
        target_identity(config.model_copy(update={"end_of_turn": "<|eot_id|>"}), str(qwen3_tokenizer_dir), None,
                        enable_thinking=False)
