"""The prompts `dflash-train evaluate` decodes: a manifest's prompts, and user prompt sets.

- A tokenized manifest (the run's own data) gives the prompt part of one split: by default the held-out
  records that training never read (`--split train`: the trained ones, an optimistic figure). A prompts or
  completions manifest is used whole.
- A user prompt set is a JSONL file with one prompt a line, recognised by its first known field:
  `messages` (an OpenAI-style conversation; trailing assistant turns are dropped: the drafter answers),
  `turns` (MT-Bench: the first user turn is asked), or one user message in `question` (GSM8K), `problem`
  (MATH500) or `prompt` (HumanEval). A line that cannot be used is counted with its file and line, never
  fatal: the set's accounting says how many.

Conversations are rendered with the target's chat template and thinking mode (dflash_shared.chat_render), so
every set measures acceptance on the served distribution. Everything here runs before a model loads: a bad
input fails in seconds.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from dflash_shared.chat_render import ChatRenderer
from dflash_shared.conversations import RecordError, parse_messages, parse_tools
from dflash_shared.errors import BadInputError
from dflash_shared.jsonl import iter_lines
from dflash_shared.manifest_io import LoadedManifest, check_compatible, load_manifest
from dflash_shared.manifests import Accounting, Kind, PromptsSection
from dflash_shared.records import CompletionRecord, Message, PromptRecord, record_id
from dflash_shared.storage import ObjectStore

if TYPE_CHECKING:
    from dflash_train.evaluate.config import EvaluateConfig

# Field -> the style it marks, in the order they are tried.
TEXT_FIELDS = {"question": "gsm8k", "problem": "math500", "prompt": "humaneval"}
BAD_LINE = "bad_prompt_line"

Tools = tuple[dict[str, Any], ...] | None


# ------------------------------------------------------------------------------- a manifest's prompts


def prompt_split(loaded: LoadedManifest, split: Literal["heldout", "train"]) -> Literal["heldout", "train", "all"]:
    """The split `split` names in this manifest: tokenized manifests have one, the others are used whole."""
    if loaded.manifest.kind is not Kind.tokenized:
        return "all"
    if split == "heldout" and not loaded.manifest.split_shards("heldout"):
        raise BadInputError(
            f"{loaded.uri} holds no held-out records (tokenized with heldout_fraction 0, or before the split "
            "existed): tokenize again with a held-out split, point --prompts at prompts of your own, or pass "
            "--split train to measure on trained records (an optimistic tau)")
    return split


class PromptSource:
    """Prompts from a prompts, completions or tokenized manifest (one split of it), as (id, token ids)."""

    def __init__(self, store: ObjectStore, loaded: LoadedManifest, render: ChatRenderer,
                 split: Literal["heldout", "train", "all"] = "all") -> None:
        self.store, self.loaded, self.render, self.split = store, loaded, render, split
        self.where = loaded.uri if split == "all" else f"the {split} split of {loaded.uri}"

    def __iter__(self) -> Any:
        kind, manifest = self.loaded.manifest.kind, self.loaded.manifest
        for shard in manifest.shards if self.split == "all" else manifest.split_shards(self.split):
            if kind is Kind.tokenized:
                yield from self._tokenized(shard.uri)
                continue
            for number, line in iter_lines(self.store, shard.uri):
                where = f"{shard.uri}:{number}"
                try:
                    data = json.loads(line)
                    if kind is Kind.prompts:
                        record = PromptRecord.model_validate(data)
                        yield record.id, self.render(record.messages, record.tools)
                    else:
                        done = CompletionRecord.model_validate(data)
                        ids = done.prompt_token_ids or self.render(done.messages[:-1], done.tools)
                        yield done.id, list(ids)
                except ValueError as err:
                    raise BadInputError(f"prompt {where} cannot be read: {err}") from err

    def _tokenized(self, uri: str) -> Any:
        import pyarrow as pa

        with tempfile.TemporaryDirectory(prefix="dflash-eval-") as tmp:
            path = os.path.join(tmp, "shard.arrow")
            self.store.download_to(uri, path)
            with pa.ipc.open_stream(pa.memory_map(path)) as reader:
                table = reader.read_all()
            for rid, ids, mask in zip(table.column("id").to_pylist(), table.column("input_ids").to_pylist(),
                                      table.column("loss_mask").to_pylist(), strict=True):
                # The prompt is everything before the first trained (assistant) token.
                first = next((i for i, m in enumerate(mask) if m), len(ids))
                yield rid, ids[:first]


def load_prompts_manifest(store: ObjectStore, uri: str, identity: Any) -> LoadedManifest:
    """The prompts, completions or tokenized manifest at `uri`, refused when made for another template."""
    for kind in (Kind.prompts, Kind.completions, Kind.tokenized):
        try:
            loaded = load_manifest(store, uri, kind, verify=False)
        except ValueError as err:
            if getattr(err, "field", None) == "kind":
                continue
            raise
        if not isinstance(loaded.section, PromptsSection) and loaded.section.target is not None:
            # Prompts rendered under another template or thinking mode are not the served distribution.
            check_compatible(loaded.uri, loaded.manifest, {
                "target.tokenizer_sha256": identity.tokenizer_sha256,
                "target.chat_template_sha256": identity.chat_template_sha256,
                "target.enable_thinking": identity.enable_thinking,
            })
        return loaded
    raise BadInputError(f"{uri} is not a prompts, completions or tokenized manifest")


# ------------------------------------------------------------------------------------ prompt sets


def conversation(obj: Any) -> tuple[list[Message], Tools]:
    """The conversation of one prompt-set line (its messages up to the turn to generate, and its tools)."""
    if not isinstance(obj, dict):
        raise RecordError(BAD_LINE, f"a {type(obj).__name__}, not a JSON object")
    if "messages" in obj:
        messages = parse_messages(obj)
        while messages and messages[-1].role == "assistant":
            messages.pop()
        if not messages:
            raise RecordError(BAD_LINE, "'messages' holds no turn before the assistant's")
        return messages, parse_tools(obj)
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise RecordError(BAD_LINE, "'turns' is not a list starting with a non-empty string")
        return [Message(role="user", content=turns[0])], None
    for field in TEXT_FIELDS:
        if field in obj:
            text = obj[field]
            if not isinstance(text, str) or not text.strip():
                raise RecordError(BAD_LINE, f"'{field}' is not a non-empty string")
            return [Message(role="user", content=text)], None
    raise RecordError(BAD_LINE, f"none of 'messages', 'turns', {', '.join(map(repr, TEXT_FIELDS))} (keys: "
                                f"{sorted(obj)[:8]})")


class PromptSetSource:
    """The prompts of one set as (content id, prompt token ids); unusable lines land in `bad` as 'file:line: why'."""

    def __init__(self, store: ObjectStore, name: str, uri: str, render: ChatRenderer) -> None:
        self.store, self.name, self.where, self.render = store, name, uri, render
        self.bad: list[str] = []

    def __iter__(self) -> Iterator[tuple[str, list[int]]]:
        for number, line in iter_lines(self.store, self.where):
            try:
                messages, tools = conversation(json.loads(line))
            except ValueError as err:  # bad JSON, or a RecordError naming what is wrong
                self.bad.append(f"{self.where}:{number}: {err}")
                continue
            yield record_id(messages, tools), self.render(messages, tools)


# ---------------------------------------------------------------------------------------- picking


@dataclass(frozen=True)
class PickedSet:
    """A user prompt set's prompts, read and rendered before any model loads."""

    uri: str
    prompts: list[tuple[str, list[int]]]
    bad_lines: list[str]


def pick_prompts(source: PromptSource | PromptSetSource, config: EvaluateConfig,
                 skip: int | None = None) -> tuple[list[tuple[str, list[int]]], Accounting]:
    """The evaluated prompts (skip, then take num_prompts usable ones) and how every record read went (a
    prompt set's unusable lines are failed records)."""
    picked: list[tuple[str, list[int]]] = []
    skips: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    skip = config.skip_prompts if skip is None else skip
    for index, (rid, ids) in enumerate(source):
        if len(picked) >= config.num_prompts:
            break
        reason = "before_start" if index < skip else None
        if reason is None and not ids:
            reason = "empty_prompt"
        if reason is None and len(ids) > config.max_prompt_tokens:
            reason = "too_long"
        if reason is None:
            picked.append((rid, ids))
            continue
        skips[reason] += 1
        if len(examples.setdefault(reason, [])) < 3:
            examples[reason].append(rid)
    bad = getattr(source, "bad", [])
    if not picked:
        raise BadInputError(f"no usable prompt in {source.where} ({len(bad)} unusable line(s), e.g. {bad[:2]})",
                            counts={**skips, **({BAD_LINE: len(bad)} if bad else {})})
    if bad:
        examples[BAD_LINE] = bad[:3]
    accounting = Accounting(input_records=len(picked) + sum(skips.values()) + len(bad), succeeded=len(picked),
                            failed=len(bad), skipped=sum(skips.values()), skips_by_reason=dict(skips),
                            failures_by_reason={BAD_LINE: len(bad)} if bad else {}, examples=examples)
    return picked, accounting
