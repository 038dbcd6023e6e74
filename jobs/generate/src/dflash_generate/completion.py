"""Pure pieces of the generate stage: prompt checks, chat rendering, reasoning split, record building.

Nothing here imports vLLM or torch: the functions take any Hugging Face style tokenizer, so unit tests run
them against the real Qwen tokenizer without an engine, and the engine wrapper stays thin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from dflash_shared.records import CompletionRecord, Message, PromptRecord

# Qwen's think markers; both Qwen3 (<think> emitted by the model) and Qwen3.5+/thinking-2507 templates
# (<think> already at the end of the generation prompt) use the same strings.
THINK_START = "<think>"
THINK_END = "</think>"

FailureReason = Literal[
    "empty_prompt",  # no message with text or tool calls
    "invalid_prompt",  # breaks the PromptRecord contract (ends with an assistant turn)
    "template_error",  # the chat template refused the conversation
    "prompt_too_long",  # the rendered prompt leaves no room for a completion token
    "engine_error",  # the engine rejected or failed this record
]


class ChatTokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the stage uses (vLLM's tokenizer provides it too)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Any, skip_special_tokens: bool = ...) -> str: ...


class GenerationOutcome(BaseModel):
    """The result for one prompt record: a completion, or the reason there is none."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_id: str = Field(description="Id of the prompt record this outcome belongs to.")
    record: CompletionRecord | None = Field(default=None, description="The completion; None on failure.")
    failure: FailureReason | None = Field(default=None, description="Why there is no completion.")
    detail: str | None = Field(default=None, description="Human-readable detail of the failure.")
    thinking_closed: bool | None = Field(
        default=None,
        description=(
            "Thinking mode only: whether the completion closed its think block. False means the block was "
            "never closed (usually a length cut): the raw text, opening marker included, is kept as content "
            "and reasoning_content is None, which is how the shared quality gate recognises it."
        ),
    )

    @property
    def ok(self) -> bool:
        return self.record is not None


def failed(prompt_id: str, reason: FailureReason, detail: str) -> GenerationOutcome:
    """Shorthand for a failure outcome."""
    return GenerationOutcome(prompt_id=prompt_id, failure=reason, detail=detail)


def check_prompt(record: PromptRecord) -> GenerationOutcome | None:
    """A failure outcome when the record cannot be rendered at all, else None."""
    has_text = any(m.content.strip() or m.tool_calls for m in record.messages)
    if not record.messages or not has_text:
        return failed(record.id, "empty_prompt", f"prompt {record.id} has no message with text")
    if record.messages[-1].role == "assistant":
        return failed(
            record.id,
            "invalid_prompt",
            f"prompt {record.id} ends with an assistant message; there is no turn to generate",
        )
    return None


def template_messages(record: PromptRecord) -> list[dict[str, Any]]:
    """The record's messages as chat-template dicts (the same list is sent to the engine)."""
    return [m.template_dict() for m in record.messages]


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt record rendered by the chat template, ready for the engine."""

    record: PromptRecord
    messages: list[dict[str, Any]]
    text: str
    token_ids: list[int]

    @property
    def opens_thinking(self) -> bool:
        """True when the generation prompt itself opens the think block (Qwen3.5+/2507 templates)."""
        return self.text.rstrip().endswith(THINK_START)


def render_prompt(
    tokenizer: ChatTokenizer, record: PromptRecord, enable_thinking: bool
) -> RenderedPrompt | GenerationOutcome:
    """Render and tokenise the record as the engine will; a failure outcome if the template refuses."""
    messages = template_messages(record)
    tools = [dict(tool) for tool in record.tools] if record.tools else None
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )
    except Exception as exc:  # noqa: BLE001 - jinja raises many kinds; all mean "cannot render"
        return failed(record.id, "template_error", f"prompt {record.id}: chat template failed: {exc}")
    # The template writes the special tokens itself, as the engine's chat path assumes.
    ids = tokenizer.encode(text, add_special_tokens=False)
    return RenderedPrompt(record=record, messages=messages, text=str(text), token_ids=list(ids))


def check_length(rendered: RenderedPrompt, max_model_len: int) -> GenerationOutcome | None:
    """Failure when the prompt leaves no room for one completion token (the engine would reject it)."""
    n = len(rendered.token_ids)
    if n > max_model_len - 1:
        return failed(
            rendered.record.id,
            "prompt_too_long",
            f"prompt {rendered.record.id} has {n} tokens; max_model_len {max_model_len} leaves no room "
            "for a completion",
        )
    return None


@dataclass(frozen=True)
class ThinkingSplit:
    """A completion text cut into reasoning and answer."""

    reasoning: str | None
    content: str
    closed: bool | None  # None when no think block was involved


def split_reasoning(text: str, *, enable_thinking: bool, prompt_opens_thinking: bool) -> ThinkingSplit:
    """Cut a completion at the think markers, normalising newlines the way Qwen's template does.

    Thinking off: the template already closed an empty think block, so everything is content. Thinking on:
    the text starts inside the block (the prompt opened it) or with the model's own `<think>`; the part
    before `</think>` is reasoning, the rest content. A block never closed is not split at all: the raw
    text becomes the content, starting with `<think>` (prefixed when the prompt opened the block), so that
    `dflash_shared.quality.classify` counts it as thinking_unclosed, exactly as it does for imported data.
    """
    if not enable_thinking:
        return ThinkingSplit(reasoning=None, content=text, closed=None)
    body = text
    stripped = body.lstrip()
    model_opened = stripped.startswith(THINK_START)
    if model_opened:
        body = stripped[len(THINK_START) :]
    if THINK_END in body:
        reasoning, content = body.split(THINK_END, 1)
        return ThinkingSplit(reasoning=reasoning.strip("\n"), content=content.lstrip("\n"), closed=True)
    if model_opened:
        return ThinkingSplit(reasoning=None, content=text, closed=False)
    if prompt_opens_thinking:
        return ThinkingSplit(reasoning=None, content=THINK_START + text, closed=False)
    # Thinking was allowed but the model answered directly (possible with Qwen3's original template).
    return ThinkingSplit(reasoning=None, content=text, closed=None)


def completion_text(
    tokenizer: ChatTokenizer,
    token_ids: list[int],
    finish_reason: str | None,
    stop_reason: int | str | None,
) -> str:
    """Decode completion ids to text, leaving out the end-of-turn token the engine stopped on.

    Special tokens inside the completion are kept as text: think markers may be special in some
    vocabularies, and keeping them makes the text re-tokenise to the same ids.
    """
    ids = list(token_ids)
    # Stopped on a token (eos: stop_reason None; stop_token_ids: the id), not on a stop string.
    if ids and finish_reason == "stop" and not isinstance(stop_reason, str):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def build_outcome(
    rendered: RenderedPrompt,
    *,
    prompt_token_ids: list[int],
    completion_token_ids: list[int],
    text: str,
    finish_reason: str | None,
    enable_thinking: bool,
    sampling: dict[str, Any],
) -> GenerationOutcome:
    """The CompletionRecord for one engine output, with the assistant turn split into its parts."""
    split = split_reasoning(text, enable_thinking=enable_thinking, prompt_opens_thinking=rendered.opens_thinking)
    answer = Message(role="assistant", content=split.content, reasoning_content=split.reasoning)
    record = CompletionRecord(
        id=rendered.record.id,
        messages=(*rendered.record.messages, answer),
        tools=rendered.record.tools,
        prompt_token_ids=tuple(prompt_token_ids),
        completion_token_ids=tuple(completion_token_ids),
        finish_reason=finish_reason,
        enable_thinking=enable_thinking,
        sampling=sampling,
        source=rendered.record.source,
        source_id=rendered.record.source_id,
    )
    return GenerationOutcome(prompt_id=rendered.record.id, record=record, thinking_closed=split.closed)
