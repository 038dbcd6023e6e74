"""The manifest contract: round trips, and a clear refusal for each way a manifest can be wrong."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from dflash_shared.manifest_io import ManifestError, load_manifest, write_manifest
from dflash_shared.manifests import (
    SCHEMA_VERSION,
    Accounting,
    HeldoutSplit,
    Kind,
    Manifest,
    Producer,
    Shard,
    SpecialTokens,
    TargetIdentity,
    TokenizedSection,
)
from dflash_shared.schemas import export
from dflash_shared.storage import ObjectStore, join

TARGET = TargetIdentity(
    model_id="Qwen/Qwen3-8B",
    revision="abc123",
    tokenizer_sha256="t" * 64,
    chat_template_sha256="c" * 64,
    enable_thinking=True,
    special_tokens=SpecialTokens(end_of_turn=151645, think_start=151667, think_end=151668, mask=151669),
)

# What a tokenize-reading stage (the trainer) is configured with, as dotted paths into the section.
EXPECTED = {
    "target.model_id": "Qwen/Qwen3-8B",
    "target.revision": "abc123",
    "target.tokenizer_sha256": "t" * 64,
    "target.chat_template_sha256": "c" * 64,
    "target.enable_thinking": True,
    "target.special_tokens.end_of_turn": 151645,
    "target.special_tokens.think_start": 151667,
    "target.special_tokens.think_end": 151668,
    "target.special_tokens.mask": 151669,
}


def make_manifest(prefix: str, store: ObjectStore, target: TargetIdentity = TARGET) -> Manifest:
    data = b"shard bytes " * 100
    shard_uri = join(prefix, "data", "shard-00000.arrow")
    store.write_bytes(shard_uri, data)
    return Manifest(
        kind=Kind.tokenized,
        run_id="run-1",
        producer=Producer(stage="tokenize", git_revision="deadbeef", config={"max_length": 4096}),
        shards=[
            Shard(
                uri=shard_uri,
                bytes=len(data),
                sha256=hashlib.sha256(data).hexdigest(),
                records=10,
                tokens=1000,
            )
        ],
        accounting=Accounting(
            input_records=12,
            succeeded=10,
            failed=2,
            skipped=0,
            failures_by_reason={"empty_response": 2},
            examples={"empty_response": ["id-1", "id-2"]},
        ),
        section=TokenizedSection(
            target=target,
            mode="render",
            mask_policy="final_turn",
            max_length=4096,
            total_tokens=1000,
            loss_tokens=600,
            length_histogram={"0-128": 10},
        ),
    )


@pytest.fixture
def written(tmp_path: Path) -> tuple[ObjectStore, str, Manifest]:
    store = ObjectStore()
    prefix = str(tmp_path / "tokenized")
    manifest = make_manifest(prefix, store)
    _, created = write_manifest(store, prefix, manifest)
    assert created
    return store, prefix, manifest


def rewrite(store: ObjectStore, prefix: str, edit) -> None:  # type: ignore[no-untyped-def]
    uri = join(prefix, "manifest.json")
    data = json.loads(store.read_bytes(uri))
    edit(data)
    store.delete(uri)
    store.write_bytes(uri, json.dumps(data).encode())


def test_round_trip(written: tuple[ObjectStore, str, Manifest]) -> None:
    store, prefix, manifest = written
    loaded = load_manifest(store, prefix, Kind.tokenized, expected=EXPECTED)
    assert loaded.manifest == manifest
    assert loaded.sha256 == hashlib.sha256(store.read_bytes(loaded.uri)).hexdigest()
    assert loaded.as_input().kind is Kind.tokenized


def test_manifest_is_written_once(written: tuple[ObjectStore, str, Manifest]) -> None:
    store, prefix, manifest = written
    changed = manifest.model_copy(update={"run_id": "run-2"})
    _, created = write_manifest(store, prefix, changed)
    assert not created
    assert load_manifest(store, prefix, Kind.tokenized).manifest.run_id == "run-1"


@pytest.mark.parametrize("path,wrong", [(path, "something-else") for path in EXPECTED])
def test_each_compatibility_field_is_checked(
    written: tuple[ObjectStore, str, Manifest], path: str, wrong: object
) -> None:
    store, prefix, _ = written
    expected = dict(EXPECTED, **{path: wrong})
    with pytest.raises(ManifestError) as err:
        load_manifest(store, prefix, Kind.tokenized, expected=expected)
    assert err.value.field == path
    assert path in str(err.value) and "something-else" in str(err.value)


def test_unknown_field_is_rejected(written: tuple[ObjectStore, str, Manifest]) -> None:
    store, prefix, _ = written
    rewrite(store, prefix, lambda d: d["section"].update(tokeniser_sha="x"))
    with pytest.raises(ManifestError, match="section.tokenized.tokeniser_sha") as err:
        load_manifest(store, prefix, Kind.tokenized)
    assert "Extra inputs are not permitted" in str(err.value)


def test_wrong_schema_version_is_rejected(written: tuple[ObjectStore, str, Manifest]) -> None:
    store, prefix, _ = written
    rewrite(store, prefix, lambda d: d.update(schema_version=1))
    with pytest.raises(ManifestError, match="schema_version is 1, this build reads 2"):
        load_manifest(store, prefix, Kind.tokenized)


def test_wrong_kind_is_rejected(written: tuple[ObjectStore, str, Manifest]) -> None:
    store, prefix, _ = written
    with pytest.raises(ManifestError, match="is a tokenized manifest, expected completions"):
        load_manifest(store, prefix, Kind.completions)


def test_corrupted_shard_is_rejected(written: tuple[ObjectStore, str, Manifest]) -> None:
    store, prefix, manifest = written
    shard = manifest.shards[0]
    corrupted = bytearray(store.read_bytes(shard.uri))
    corrupted[5] ^= 0xFF  # same size, different bytes: only the checksum can tell
    store.delete(shard.uri)
    store.write_bytes(shard.uri, bytes(corrupted))
    with pytest.raises(ManifestError, match="sha256 is .* the manifest says .*corrupted") as err:
        load_manifest(store, prefix, Kind.tokenized)
    assert shard.uri in str(err.value)
    # Compatibility-only reads (preflight) skip the expensive re-hash on purpose.
    load_manifest(store, prefix, Kind.tokenized, verify=False)


def test_missing_shard_is_rejected(written: tuple[ObjectStore, str, Manifest]) -> None:
    store, prefix, manifest = written
    store.delete(manifest.shards[0].uri)
    with pytest.raises(ManifestError, match="cannot be read"):
        load_manifest(store, prefix, Kind.tokenized)


def test_missing_manifest_says_so(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="has the producing stage finished"):
        load_manifest(ObjectStore(), str(tmp_path / "nothing"), Kind.completions)


def test_malformed_json_is_rejected(written: tuple[ObjectStore, str, Manifest]) -> None:
    store, prefix, _ = written
    uri = join(prefix, "manifest.json")
    store.delete(uri)
    store.write_bytes(uri, b"{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(store, prefix, Kind.tokenized)


def test_unbalanced_accounting_is_rejected() -> None:
    with pytest.raises(ValueError, match="accounting does not balance"):
        Accounting(input_records=10, succeeded=5, failed=1, skipped=0, failures_by_reason={"x": 1})
    with pytest.raises(ValueError, match="does not sum to failed"):
        Accounting(input_records=10, succeeded=8, failed=2, skipped=0, failures_by_reason={"x": 1})


def test_kind_must_match_section(tmp_path: Path) -> None:
    store = ObjectStore()
    manifest = make_manifest(str(tmp_path), store)
    with pytest.raises(ValueError, match="kind is 'completions' but the section is 'tokenized'"):
        Manifest.model_validate(manifest.model_dump() | {"kind": "completions"})


def test_heldout_split_names_its_shards(tmp_path: Path) -> None:
    manifest = make_manifest(str(tmp_path), ObjectStore())
    # No split recorded (or every shard marked train): all shards are training data.
    assert manifest.split_shards("train") == manifest.shards and manifest.split_shards("heldout") == []
    (shard,) = manifest.shards
    held = shard.model_copy(update={"uri": shard.uri + ".heldout", "records": 3, "split": "heldout"})
    split = HeldoutSplit(fraction=0.01, min_records=2, input_records=13, effective_fraction=2 / 13, records=3,
                         tokens=90, loss_tokens=40)
    data = manifest.model_dump() | {"shards": [shard.model_dump(), held.model_dump()]}
    data["section"] = data["section"] | {"heldout": split.model_dump()}
    data["accounting"] = data["accounting"] | {"input_records": 15, "succeeded": 13}
    split_manifest = Manifest.model_validate(data)
    assert split_manifest.split_shards("heldout") == [held] and split_manifest.split_shards("train") == [shard]
    data["section"]["heldout"]["records"] = 4
    with pytest.raises(ValueError, match="the held-out shards hold 3 records, the split says 4"):
        Manifest.model_validate(data)


def test_manifest_is_frozen(tmp_path: Path) -> None:
    manifest = make_manifest(str(tmp_path), ObjectStore())
    with pytest.raises(ValueError):
        manifest.run_id = "other"  # type: ignore[misc]


def test_schemas_export_one_file_per_kind(tmp_path: Path) -> None:
    paths = export(tmp_path)
    assert sorted(p.name for p in paths) == sorted(f"{k.value}.v{SCHEMA_VERSION}.schema.json" for k in Kind)
    tokenized = json.loads((tmp_path / f"tokenized.v{SCHEMA_VERSION}.schema.json").read_text())
    assert tokenized["properties"]["kind"]["const"] == "tokenized"
    assert tokenized["additionalProperties"] is False


def test_sections_written_before_the_window_accounting_still_parse() -> None:
    """Manifests made before tokens were counted against the training window read as 'not counted'."""
    from dflash_shared.manifests import CompletionsSection, DrafterSection, TokenizedSection

    target = TARGET.model_dump(mode="json")
    completions = CompletionsSection.model_validate({"kind": "completions", "target": target, "has_token_ids": True,
                                                     "output_tokens": 10})
    assert (completions.training_window, completions.truncated_by_budget, completions.window_fraction,
            completions.capped_to_window) == (None, None, None, False)
    tokenized = TokenizedSection.model_validate({"kind": "tokenized", "target": target, "mode": "token_exact",
                                                 "mask_policy": "final_turn", "max_length": 64, "total_tokens": 9,
                                                 "loss_tokens": 4})
    assert (tokenized.truncated_by_budget, tokenized.loss_tokens_before_truncation, tokenized.window_fraction) == (
        None, None, None)
    drafter = DrafterSection.model_validate({"kind": "drafter", "target": target, "target_layer_ids": [1],
                                             "block_size": 16, "mask_token_id": 5, "checkpoint_uri": "c"})
    assert drafter.data is None
