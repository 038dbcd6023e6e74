"""Token-exact mode at array speed: the engine's ids go from JSON to int32 arrays in one call each.

The per-record path validates the whole record with pydantic, which makes every id a Python int in a
tuple; `masking.token_exact` then copies them into lists, and the worker copies those into numpy. Here
each line is parsed once with orjson, each id list becomes an int32 array directly, and pydantic
validates the rest of the record with the two id lists set aside (about a tenth of the work).

The verdict on every record is the per-record path's, message for message: a line this path cannot
prove equivalent (not an object, a record lacking either id list, ids that are not JSON integers within
int32, or a record whose validation without its ids fails) is validated whole by pydantic and tokenised
by `token_exact`, as before. Integers are what pydantic keeps as they are; booleans mixed into an
integer list become 1 and 0 in both paths. A line that fails in any way, foreseen or not, is a MALFORMED
verdict naming the error and quoting the line, never an exception out of the batch.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import orjson
from pydantic import ValidationError

from dflash_shared.jsonl import excerpt, printable
from dflash_shared.quality import MALFORMED
from dflash_shared.records import CompletionRecord
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.masking import MaskingError, Tokenized, token_exact, try_render_batch

# The C int of array("i") is the int32 the shards store on every platform this stage runs on.
assert array("i").itemsize == 4, "array('i') is not 32-bit here"


def malformed_detail(err: Exception, line: bytes | None = None) -> str:
    """The one-line reason a line is not a record, as the stage reports it, with a quote of the line."""
    at = 0
    if isinstance(err, orjson.JSONDecodeError):
        detail, at = str(err).splitlines()[0], err.pos
    elif isinstance(err, ValidationError):
        first = err.errors()[0]
        detail = f"{err.error_count()} schema error(s), first: {first['loc']}: {first['msg']}"
    else:  # nothing known raises here; if something does, it costs the line, not the stage
        detail = f"unexpected {type(err).__name__}: {str(err)[:200]}"
    detail = printable(detail)
    return detail if line is None else f"{detail}: {excerpt(line, start=at - 20)}"


@dataclass(frozen=True, slots=True)
class ExactIds:
    """The engine's prompt and completion ids of one record (loss on the completion)."""

    prompt: np.ndarray  # int32
    completion: np.ndarray  # int32


@dataclass(frozen=True, slots=True)
class Parsed:
    """One valid line. With `ids` set, `record` was validated with its id lists set aside."""

    where: str
    record: CompletionRecord
    ids: ExactIds | None = None

    def full_record(self) -> CompletionRecord:
        """The record with its ids, as the per-record path validates it."""
        if self.ids is None:
            return self.record
        return self.record.model_copy(update={"prompt_token_ids": tuple(self.ids.prompt.tolist()),
                                               "completion_token_ids": tuple(self.ids.completion.tolist())})


def _int32_array(values: list[Any]) -> np.ndarray | None:
    """The list as int32 when every item is a JSON integer (or boolean) within int32; else None."""
    try:
        # array("i") takes ints (and bools, as 1 and 0, like pydantic) within C int range and refuses
        # floats, strings and everything else, which pydantic might coerce: those go the per-record way.
        return np.frombuffer(array("i", values), dtype=np.int32)
    except (TypeError, OverflowError):
        return None


def _fast(where: str, obj: Any) -> Parsed | None:
    if type(obj) is not dict:
        return None
    prompt, completion = obj.get("prompt_token_ids"), obj.get("completion_token_ids")
    # A record without both lists is rejected by token_exact; it takes the per-record path.
    if type(prompt) is not list or type(completion) is not list:
        return None
    prompt_ids, completion_ids = _int32_array(prompt), _int32_array(completion)
    if prompt_ids is None or completion_ids is None:
        return None
    ids = ExactIds(prompt_ids, completion_ids)
    try:
        record = CompletionRecord.model_validate({**obj, "prompt_token_ids": None, "completion_token_ids": None})
    except ValidationError:
        return None  # validated whole below, for the per-record path's exact message
    # Only arrays outlive the line: lists of Python ints kept for a batch would make every garbage
    # collection walk hundreds of thousands of items.
    return Parsed(where, record, ids)


def parse_lines(lines: list[tuple[str, bytes]]) -> tuple[list[Parsed], list[tuple[str, str, str]]]:
    """Valid records (ids as arrays where possible) and a MALFORMED verdict for every other line."""
    parsed: list[Parsed] = []
    rejected: list[tuple[str, str, str]] = []
    for where, line in lines:
        try:
            obj = orjson.loads(line)
            item = _fast(where, obj) or Parsed(where, CompletionRecord.model_validate(obj))
        except MemoryError:
            raise
        except Exception as err:  # orjson's and pydantic's errors, and any other one line's values cause
            rejected.append((where, MALFORMED, malformed_detail(err, line)))
            continue
        parsed.append(item)
    return parsed, rejected


def tokenize_exact(
    parsed: list[Parsed],
    chat: ChatFormat,
    enable_thinking: bool,
    verify_records: int,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[ExactIds | Tokenized | MaskingError]:
    """The engine's ids per record, then the render spot check on the first good records."""
    out: list[ExactIds | Tokenized | MaskingError] = []
    for item in parsed:
        if item.ids is not None:
            out.append(item.ids)
            continue
        try:
            out.append(token_exact(item.record))
        except MaskingError as err:
            out.append(err)
    # Spot check: the template we were given must render the prompt to the very ids the engine saw;
    # if not, the tokenizer or template differs from the generator's and every record is suspect.
    good = (item for item, t in zip(parsed, out, strict=True) if not isinstance(t, MaskingError))
    sample = [item.full_record() for item in islice(good, verify_records)]
    checks = try_render_batch(sample, chat, enable_thinking=enable_thinking, mask_policy="final_turn",
                              template_kwargs=template_kwargs)
    for checked in checks:
        if isinstance(checked, MaskingError):
            index = next(i for i, item in enumerate(parsed) if item.record.id == checked.record_id)
            out[index] = checked
    return out
