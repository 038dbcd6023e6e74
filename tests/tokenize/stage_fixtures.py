"""Completions manifests for stage tests, made the way the generate stage and the importer make them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_shared.manifests import (
    CompletionsSection,
    Kind,
    SpecialTokens,
    TargetIdentity,
)
from dflash_shared.records import CompletionRecord, Message, record_id
from dflash_shared.storage import ObjectStore
from dflash_tokenize.chat import ChatFormat
from tests.support.jsonl_manifests import write_jsonl_manifest

TOPICS = ["prime numbers", "binary search", "the French revolution", "photosynthesis", "熱力学", "emoji 🎉 parsing"]


def conversation(i: int, thinking: bool = True, answer: str | None = None,
                 reasoning: str | None = None) -> list[Message]:
    topic = TOPICS[i % len(TOPICS)]
    return [
        Message(role="system", content="You are a careful assistant."),
        Message(role="user", content=f"Question {i}: explain {topic} in a few sentences."),
        Message(
            role="assistant",
            reasoning_content=(reasoning if reasoning is not None else
                               f"The user asks about {topic}. Plan: define it, give an example {i}.")
            if thinking else None,
            content=answer if answer is not None else
            f"{topic.capitalize()} is a topic with a long history; example number {i} shows the idea well.",
        ),
    ]


def completion(messages: list[Message], **fields: Any) -> CompletionRecord:
    return CompletionRecord(id=record_id(messages[:-1]), messages=tuple(messages), **fields)


def engine_like(chat: ChatFormat, messages: list[Message], thinking: bool = True,
                template_kwargs: dict[str, Any] | None = None, **fields: Any) -> CompletionRecord:
    """A record with token ids as an engine produces them: the generation prompt, then the completion.

    The completion is the text after the generation prompt (with Qwen3.6, after its opening <think>).
    """
    dicts = [m.template_dict() for m in messages]
    kwargs = template_kwargs or {}
    prompt = chat.render_dicts(dicts[:-1], add_generation_prompt=True, enable_thinking=thinking, **kwargs)
    full = chat.render_dicts(dicts, enable_thinking=thinking, **kwargs)
    completion_text = full[len(prompt):].rsplit(chat.end_of_turn, 1)[0] + chat.end_of_turn
    return completion(
        messages,
        prompt_token_ids=tuple(chat.encode(prompt)),
        completion_token_ids=tuple(chat.encode(completion_text)),
        finish_reason="stop",
        enable_thinking=thinking,
        **fields,
    )


def write_completions(
    store: ObjectStore, prefix: str, records: Sequence[CompletionRecord | bytes], shards: int = 1,
    target: TargetIdentity | None = None,
) -> str:
    """A completions manifest with `shards` JSONL.zst shards; raw bytes entries are written as bad lines."""
    section = CompletionsSection(target=target, has_token_ids=target is not None)
    return write_jsonl_manifest(store, prefix, records, kind=Kind.completions, producer="generate", section=section,
                               shards=shards)


def target_for(chat: ChatFormat, thinking: bool = True) -> TargetIdentity:
    return TargetIdentity(
        model_id="tiny-qwen3",
        tokenizer_sha256=chat.tokenizer_sha256,
        chat_template_sha256=chat.chat_template_sha256,
        enable_thinking=thinking,
        special_tokens=SpecialTokens(end_of_turn=chat.eot_id, think_start=chat.think_start_id,
                                     think_end=chat.think_end_id),
    )


def output_files(root: Path | str, store: ObjectStore) -> dict[str, bytes]:
    return {uri[len(str(root)):]: store.read_bytes(uri) for uri in store.list(str(root))}
