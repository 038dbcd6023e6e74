"""Chat layouts of external records: which columns hold the conversation and the record's own id.

Public chat data comes in a few shapes. `messages` (OpenAI role/content) and `conversations` (ShareGPT
from/value) are lists of turns that `conversations.parse_messages` reads as they are; prompt/response pairs
(prompt/response, instruction/output, question/answer, with an optional system column) are turned into
such a list here, so every layout then goes through one parser, one gate and one de-duplication. The same
mapping applies to JSONL lines, Parquet rows and dataset rows alike.

The record's own id (`id` unless `id_field` says otherwise) becomes `source_id`: any JSON scalar, as a
string, so tokenized rows can be joined back to the user's data.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from dflash_shared.conversations import RecordError
from dflash_shared.quality import MALFORMED

# Turn-list columns, in the order they are looked for.
TURN_COLUMNS = ("messages", "conversations")
# (prompt, response) column pairs recognised without configuration, in the order they are looked for.
PAIR_COLUMNS = (("prompt", "response"), ("instruction", "output"), ("question", "answer"))
SYSTEM_COLUMN = "system"
# Alpaca's optional second half of the instruction, appended after a blank line.
ALPACA_INPUT = "input"


@dataclass(frozen=True)
class Layout:
    """Column names of one import (None: recognised automatically). Built from ImportConfig.

    `response_field` applies with `prompt_field`; without it, the first pair of PAIR_COLUMNS present in a
    record is used. A pair layout takes its system prompt from `system_field` (default `system`) when set.
    """

    id_field: str = "id"
    messages_field: str | None = None
    prompt_field: str | None = None
    response_field: str | None = None
    system_field: str | None = None

    def conversation(self, obj: Any) -> tuple[Any, str | None]:
        """(the record with its conversation under `messages`, its source id); raises RecordError.

        Other keys (tools, finish_reason, ...) are kept. A record that is not an object is returned as it is,
        for the parser to refuse with its usual message.
        """
        if not isinstance(obj, dict):
            return obj, None
        return self._turns(obj), source_id(obj.get(self.id_field), self.id_field)

    def _turns(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.messages_field is not None:
            if self.messages_field not in obj:
                raise RecordError(MALFORMED, f"record has no {self.messages_field!r} column")
            return {**obj, "messages": obj[self.messages_field]}
        if self.prompt_field is None:
            turns_column = next((column for column in TURN_COLUMNS if obj.get(column) is not None), None)
            if turns_column is not None:
                return {**obj, "messages": obj[turns_column]}
        prompt_field, response_field = self._pair(obj)
        if prompt_field is None:
            return obj  # no known layout: the parser says the record has no 'messages' list
        prompt = _text(obj, prompt_field)
        if prompt_field == "instruction" and self.prompt_field is None and obj.get(ALPACA_INPUT):
            prompt = f"{prompt}\n\n{_text(obj, ALPACA_INPUT)}"
        system_column = self.system_field or SYSTEM_COLUMN
        turns = [{"role": "system", "content": _text(obj, system_column)}] if obj.get(system_column) else []
        turns.append({"role": "user", "content": prompt})
        if response_field is not None and obj.get(response_field) is not None:
            turns.append({"role": "assistant", "content": _text(obj, response_field)})
        return {**obj, "messages": turns}

    def _pair(self, obj: dict[str, Any]) -> tuple[str | None, str | None]:
        if self.prompt_field is not None:
            if self.prompt_field not in obj:
                raise RecordError(MALFORMED, f"record has no {self.prompt_field!r} column")
            return self.prompt_field, self.response_field
        return next(((p, r) for p, r in PAIR_COLUMNS if obj.get(p) is not None), (None, None))


def _text(obj: dict[str, Any], column: str) -> str:
    value = obj[column]
    if not isinstance(value, str):
        raise RecordError(MALFORMED, f"column {column!r} is a {type(value).__name__}, not text")
    return value


def source_id(value: Any, field: str = "id") -> str | None:
    """The record's own id as a string: str kept, int/float/bool in their JSON spelling; None when absent."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value:
            raise RecordError(MALFORMED, f"{field!r} is an empty string")
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise RecordError(MALFORMED, f"{field!r} is {value}, not an id")
    if isinstance(value, bool | int | float):
        return json.dumps(value)  # true, 42, 4.5: what the user wrote in the JSON line
    raise RecordError(MALFORMED, f"{field!r} is a {type(value).__name__}, not a string or number")
