"""Prompts manifests and settings for generate-stage tests, made the way the `import` command makes them.

`write_prompts` writes the lines it is given as they are (raw bytes for malformed lines, the same record
twice for a duplicate), so a test can put exactly the bad input it wants in front of the stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from dflash_generate.config import GenerateConfig
from dflash_shared.jsonl import iter_lines
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind, PromptsSection
from dflash_shared.records import CompletionRecord, Message, PromptRecord, ToolCall, ToolCallFunction, record_id
from dflash_shared.storage import ObjectStore
from tests.support.jsonl_manifests import write_jsonl_manifest

TOPICS = ["prime numbers", "binary search", "la Révolution française", "photosynthesis", "熱力学", "emoji 🎉"]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# For tests about the stage's bookkeeping (resumption, failures, the CLI): the dense target is enough, and
# its engine is the one the other Qwen3 tests started already.
ONE_ARCH = pytest.mark.parametrize("target_arch", ["qwen3"], indirect=True)
# Engine settings every stage test uses, so the tests can share one engine.
MAX_MODEL_LEN = 256
ENGINE_SETTINGS: dict[str, Any] = {
    "max_model_len": MAX_MODEL_LEN,
    "dtype": "bfloat16",
    "gpu_memory_utilization": 0.3,
    "enforce_eager": True,
    "max_num_seqs": 16,
}


def prompt_record(*messages: Message, tools: tuple[dict[str, Any], ...] | None = None,
                  source: str | None = None) -> PromptRecord:
    return PromptRecord(id=record_id(messages, tools), messages=messages, tools=tools, source=source)


def user(text: str) -> Message:
    return Message(role="user", content=text)


def varied_prompts(n: int) -> list[PromptRecord]:
    """n distinct prompts: plain, with a system turn, multi-turn with reasoning, tool use, tool offers."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        kind = i % 4
        if kind == 0:
            messages: tuple[Message, ...] = (user(f"Question {i}: explain {topic} briefly."),)
        elif kind == 1:
            messages = (Message(role="system", content="Answer in one sentence."), user(f"What is {topic}? ({i})"))
        elif kind == 2:
            messages = (
                user(f"Hi, prompt {i}."),
                Message(role="assistant", content="Hello!", reasoning_content="Greet back."),
                user(f"Now tell me about {topic}."),
            )
        else:
            call = ToolCall(function=ToolCallFunction(name="get_weather", arguments={"city": f"City {i}"}))
            messages = (
                user(f"Weather in City {i}?"),
                Message(role="assistant", tool_calls=(call,)),
                Message(role="tool", content='{"temp_c": 11}'),
            )
        out.append(prompt_record(*messages, tools=(WEATHER_TOOL,) if kind == 3 else None, source=f"test:{i}"))
    return out


def write_prompts(store: ObjectStore, prefix: str, records: Sequence[PromptRecord | bytes], shards: int = 1) -> str:
    """A prompts manifest over `shards` JSONL.zst files (records dealt round-robin); returns the prefix."""
    return write_jsonl_manifest(store, prefix, records, kind=Kind.prompts, producer="import",
                               section=PromptsSection(sources=["test"], duplicates=0), shards=shards)


def in_shard_order(records: Sequence[PromptRecord | bytes], shards: int) -> list[PromptRecord | bytes]:
    """The records in the order the stage reads them back: shard by shard, line by line."""
    return [r for k in range(shards) for r in records[k::shards]]


def stage_config(src: str, out: str, model: Path | str, **overrides: Any) -> GenerateConfig:
    settings: dict[str, Any] = {
        **ENGINE_SETTINGS,
        "input": src,
        "output": out,
        "model": str(model),
        "max_new_tokens": 16,
        "chunk_records": 3,
        "seed": 7,
        # A random model's outputs are all "degenerate": only the fail-fast test turns the check on.
        "fail_fast_max_bad_fraction": 1.0,
        "min_shm_gib": 0.0,
        **overrides,
    }
    return GenerateConfig(**settings)


def completions(store: ObjectStore, prefix: str) -> list[CompletionRecord]:
    """Every completion record of a completions manifest, in manifest order (shards re-hashed)."""
    manifest = load_manifest(store, prefix, Kind.completions).manifest
    return [
        CompletionRecord.model_validate_json(line)
        for shard in manifest.shards
        for _, line in iter_lines(store, shard.uri)
    ]
