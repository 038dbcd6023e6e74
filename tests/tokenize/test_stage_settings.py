"""The tokenize stage holds one configuration per output, and trains on another run's completions as generated.

A second shard under another max_length is refused before it tokenises a record (its workers may differ: they
change no byte); the completions of an earlier run, imported as a new run's source, keep the engine's token ids,
so the new run tokenises them token_exact, with lineage back to the earlier run's manifest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_shared.errors import exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.importing import ImportSpec, run_import
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind, Producer, TokenizedSection
from dflash_shared.stage_identity import SettingsChangedError
from dflash_shared.storage import ObjectStore, join
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.config import TokenizeConfig
from dflash_tokenize.stage import run, settings_identity
from tests.tokenize.stage_fixtures import conversation, engine_like, target_for, write_completions


def config(src: str, out: str, tok: Path, **kw: object) -> TokenizeConfig:
    kw.setdefault("heldout_fraction", 0)
    kw.setdefault("workers", 1)
    return TokenizeConfig(input=src, output=out, tokenizer=str(tok), **kw)  # type: ignore[arg-type]


def test_a_shard_under_another_max_length_is_refused(tmp_path: Path, tok_dir: Path, chat: ChatFormat) -> None:
    store = ObjectStore()
    src = write_completions(store, str(tmp_path / "completions"), [engine_like(chat, conversation(i))
                                                                   for i in range(8)], shards=2,
                            target=target_for(chat))
    out = str(tmp_path / "tokenized")
    first = config(src, out, tok_dir, num_shards=2, shard_index=0, max_length=512)
    assert run(first, store) is None
    data = sorted(store.list(join(out, "data")))
    with pytest.raises(SettingsChangedError) as refused:
        run(config(src, out, tok_dir, num_shards=2, shard_index=1, max_length=256), store)
    assert exit_code_for(refused.value) is ExitCode.USAGE
    assert [d.field for d in refused.value.changed] == ["max_length"]
    assert "max_length 512 there, 256 now" in str(refused.value)
    assert sorted(store.list(join(out, "data"))) == data  # refused before a record was tokenised
    # The process count changes no byte of the output: another value is no other configuration.
    assert run(config(src, out, tok_dir, num_shards=2, shard_index=1, max_length=512, workers=2), store)
    manifest = load_manifest(store, out, Kind.tokenized).manifest
    assert manifest.producer.settings_sha256 == settings_identity(first).sha256


def test_another_runs_completions_are_tokenized_with_their_token_ids(tmp_path: Path, tok_dir: Path,
                                                                    chat: ChatFormat) -> None:
    store = ObjectStore()
    records = [engine_like(chat, conversation(i)) for i in range(6)]
    earlier = write_completions(store, str(tmp_path / "run1" / "completions"), records, target=target_for(chat))
    # The new run's import reads the earlier run's completions prefix (its [source] uri) and copies them.
    copied = str(tmp_path / "run2" / "completions")
    assert run_import(store, ImportSpec(kind=Kind.completions, source_prefix=earlier, output_prefix=copied,
                                        run_id="run2"), Producer(stage="import"))
    out = str(tmp_path / "run2" / "tokenized")
    assert run(config(copied, out, tok_dir), store)
    manifest = load_manifest(store, out, Kind.tokenized).manifest
    section = manifest.section
    assert isinstance(section, TokenizedSection) and section.mode == "token_exact"
    assert manifest.accounting.succeeded == 6
    # Lineage: tokenized -> the copy -> the earlier run's manifest, each by sha256.
    copy = load_manifest(store, copied, Kind.completions)
    assert manifest.inputs[0].sha256 == copy.sha256
    assert copy.manifest.inputs[0].sha256 == load_manifest(store, earlier, Kind.completions).sha256
