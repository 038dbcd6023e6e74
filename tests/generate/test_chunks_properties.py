"""Generate's prompt reader under hostile prompts lines (hypothesis): a record or a reason, never a crash.

Lines come from tests.support.noise: PromptRecord-shaped records right or with one fault at any depth,
external conversations, damaged bytes. `parse_prompt` must return a record the engine's tokenizer can
take (valid Unicode throughout) or a MALFORMED rejection with a printable reason; `PromptReader` must give
every line of a shard one entry, in order, and keep each valid prompt once. No engine is needed.
"""

from __future__ import annotations

import json
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_generate.chunks import DUPLICATE, PromptReader, Rejected, parse_prompt, plan_chunks
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_shared.quality import MALFORMED
from dflash_shared.records import PromptRecord
from dflash_shared.storage import ObjectStore, join
from tests.generate.stage_support import varied_prompts, write_prompts
from tests.support.noise import (
    PROPERTY,
    no_fsync,  # noqa: F401 - the fixture pytestmark asks for
    noisy_lines,
    with_crashers,
)

prompt_lines = st.one_of(noisy_lines("prompts"), noisy_lines("conversations"))


pytestmark = pytest.mark.usefixtures("no_fsync")


@PROPERTY
@with_crashers({"id": "p", "messages": [{"role": "user", "content": "Hello?"}]})
@given(line=prompt_lines)
def test_a_prompt_line_is_a_record_or_a_reason(line: bytes) -> None:
    parsed = parse_prompt(line)
    if isinstance(parsed, Rejected):
        assert parsed.reason == MALFORMED and not parsed.skipped and parsed.detail.isprintable()
        return
    # What reaches the engine encodes as UTF-8 (no lone surrogate) and reads back as the same record.
    text = json.dumps(parsed.model_dump(mode="json"), ensure_ascii=False).encode("utf-8")
    assert PromptRecord.model_validate_json(text) == parsed


@settings(PROPERTY, max_examples=60)  # a shard written and read per example
@given(noise=st.lists(prompt_lines.filter(bytes.strip), max_size=6), at=st.integers(0, 6),
       chunk_records=st.integers(1, 4))
def test_the_reader_gives_every_line_one_entry_and_keeps_each_valid_prompt(noise: list[bytes], at: int,
                                                                           chunk_records: int) -> None:
    good = varied_prompts(3)
    lines: list[PromptRecord | bytes] = [*noise[:at], *good, *noise[at:]]
    store = ObjectStore()
    with tempfile.TemporaryDirectory() as root:
        prefix = write_prompts(store, join(root, "prompts"), lines)
        shards = load_manifest(store, prefix, Kind.prompts).manifest.shards
        reader = PromptReader(store, shards, root)
        try:
            entries = [entry for chunk in plan_chunks(shards, chunk_records) for entry in reader.read(chunk)]
        finally:
            reader.close()
    assert [where for where, _ in entries] == [f"{shards[0].uri}:{n}" for n in range(1, len(lines) + 1)]
    for _, entry in entries:
        assert isinstance(entry, PromptRecord) or entry.reason in (MALFORMED, DUPLICATE)
    kept = [entry.id for _, entry in entries if isinstance(entry, PromptRecord)]
    assert len(kept) == len(set(kept)) and {g.id for g in good} <= set(kept)
