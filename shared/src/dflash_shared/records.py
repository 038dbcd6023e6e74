"""Record types that cross stage boundaries inside shards.

A prompts shard holds `PromptRecord` lines; a completions shard holds `CompletionRecord` lines (JSONL,
zstd-compressed). The generate stage writes completions, the tokenize stage reads them, and the `import`
commands build either from external conversations. Keeping the record shapes here, next to the manifests,
means both sides of a boundary validate the same schema.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["system", "user", "assistant", "tool"]


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ToolCallFunction(_Record):
    name: str = Field(description="Name of the called function.")
    arguments: dict[str, Any] | str = Field(description="Arguments as an object or a JSON string.")


class ToolCall(_Record):
    id: str | None = Field(default=None, description="Call id, when the source had one.")
    type: Literal["function"] = Field(default="function", description="Only function calls exist today.")
    function: ToolCallFunction = Field(description="The called function and its arguments.")


class Message(_Record):
    """One chat message, OpenAI-style, with the assistant's reasoning kept apart from its answer."""

    role: Role = Field(description="Who speaks.")
    content: str = Field(default="", description="Visible text (for the assistant: the answer only).")
    reasoning_content: str | None = Field(
        default=None, description="Assistant thinking, without the think markers; None when absent."
    )
    tool_calls: tuple[ToolCall, ...] | None = Field(default=None, description="Assistant tool calls.")
    tool_call_id: str | None = Field(default=None, description="For tool messages: the call answered.")
    name: str | None = Field(default=None, description="Optional speaker or tool name.")

    def template_dict(self) -> dict[str, Any]:
        """The dict a Hugging Face chat template expects (None fields left out)."""
        return self.model_dump(mode="json", exclude_none=True)


def record_id(
    messages: list[Message] | tuple[Message, ...], tools: tuple[dict[str, Any], ...] | None = None
) -> str:
    """Stable content id: identical conversations get identical ids, so duplicates can be counted."""
    content: Any = [m.model_dump(mode="json", exclude_none=True) for m in messages]
    if tools:  # tools change what the model sees, but records without them keep their historical ids
        content = {"messages": content, "tools": list(tools)}
    canonical = json.dumps(
        content,
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:32]


class PromptRecord(_Record):
    """A conversation to be answered by the target: the last message is never an assistant turn."""

    id: str = Field(description="Stable content id (see record_id).")
    messages: tuple[Message, ...] = Field(description="The conversation up to the turn to generate.")
    tools: tuple[dict[str, Any], ...] | None = Field(
        default=None, description="Tool definitions offered to the model (OpenAI function schema)."
    )
    source: str | None = Field(default=None, description="Where the record came from (file and line).")
    source_id: str | None = Field(
        default=None, description="The source's own id of the conversation (as a string), when it had one."
    )


class CompletionRecord(_Record):
    """A conversation whose final assistant turn was produced by the target (or imported)."""

    id: str = Field(description="Id of the prompt this completes.")
    messages: tuple[Message, ...] = Field(
        description="The prompt messages followed by the final assistant message."
    )
    tools: tuple[dict[str, Any], ...] | None = Field(
        default=None, description="Tool definitions offered to the model (OpenAI function schema)."
    )
    prompt_token_ids: tuple[int, ...] | None = Field(
        default=None, description="Prompt ids exactly as the engine saw them; None for imported data."
    )
    completion_token_ids: tuple[int, ...] | None = Field(
        default=None, description="Completion ids exactly as the engine produced them (end-of-turn included)."
    )
    finish_reason: str | None = Field(default=None, description="'stop', 'length', ... as the engine said.")
    enable_thinking: bool | None = Field(default=None, description="Whether thinking mode was requested.")
    sampling: dict[str, Any] | None = Field(default=None, description="Sampling parameters used.")
    source: str | None = Field(default=None, description="Where the record came from (file and line).")
    source_id: str | None = Field(
        default=None, description="The source's own id of the conversation (its prompt's, for generated ones)."
    )

    @property
    def final_assistant(self) -> Message:
        return self.messages[-1]
