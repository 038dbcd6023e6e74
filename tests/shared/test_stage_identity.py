"""One configuration per output: shard markers record the settings and image, and another configuration is refused.

The measured case first: `dflash-tokenize import` over two shards, the second run with another --id-field
(what "fix the run file and apply again" does on a cluster), used to merge into one manifest recording only
the last shard's settings. Now the second shard exits 64 before it reads a record, naming the field, both
values and the ways out; restored, it completes the manifest, which records the one configuration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_shared.errors import ConfigError, exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.importing import ImportConfig
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Accounting, Kind, Manifest, Producer, PromptsSection
from dflash_shared.provenance import IMAGE_ENV
from dflash_shared.runner import (
    MergedOutcome,
    ShardContext,
    ShardingError,
    ShardMarker,
    ShardOutcome,
    finalize,
    marker_uri,
    run_shard,
)
from dflash_shared.stage_identity import NOT_SETTINGS, SettingsChangedError, differences, stage_identity
from dflash_shared.storage import ObjectStore, join

REPO = Path(__file__).resolve().parents[2]
ITEMS = ["a", "b", "c", "d"]


def conversations(folder: Path) -> Path:
    folder.mkdir()
    for part in range(2):
        lines = [{"id": f"{part}-{i}", "messages": [{"role": "user", "content": f"question {part} {i}"},
                                                     {"role": "assistant", "content": f"answer {part} {i}"}]}
                 for i in range(3)]
        (folder / f"part-{part}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def tokenize_import(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dflash_tokenize", "import", *args], capture_output=True,
                          text=True, cwd=REPO, env=env or os.environ.copy(), timeout=120, check=False)


@pytest.mark.slow
def test_a_shard_under_other_settings_exits_64_before_any_work_and_the_manifest_has_one_config(
        tmp_path: Path) -> None:
    source, out = conversations(tmp_path / "chats"), tmp_path / "completions"
    common = ["--source", str(source), "--output", str(out), "--num-shards", "2"]
    first = tokenize_import(*common, "--shard-index", "0", "--id-field", "id")
    assert first.returncode == 0, first.stderr
    data_before = sorted(p.name for p in (out / "data").iterdir())

    refused = tokenize_import(*common, "--shard-index", "1", "--id-field", "nope")
    assert refused.returncode == ExitCode.USAGE == 64, refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert "exit 64 (USAGE)" in line and "marker shard-00000-of-00002.json" in line
    assert 'id_field "id" there, "nope" now' in line
    assert "restore this setting and run again" in line  # the first way out
    assert "restart --config RUN.toml --stage import" in line and "a new output prefix" in line  # the second
    assert sorted(p.name for p in (out / "data").iterdir()) == data_before  # no record was read or written
    assert not (out / "manifest.json").exists()

    # A setting that only decides whether a shard passes may differ; the restored one completes the output.
    done = tokenize_import(*common, "--shard-index", "1", "--id-field", "id", "--max-bad-fraction", "0.5")
    assert done.returncode == 0, done.stderr
    manifest = load_manifest(ObjectStore(), str(out), Kind.completions).manifest
    markers = [ShardMarker.model_validate_json((out / "_markers" / f"shard-0000{i}-of-00002.json").read_bytes())
               for i in range(2)]
    assert {m.identity.sha256 for m in markers if m.identity} == {manifest.producer.settings_sha256}
    assert manifest.producer.config["id_field"] == "id"


def process(ctx: ShardContext) -> ShardOutcome:
    ctx.publish(",".join(ctx.items).encode(), ctx.part_name(0, ".txt"), records=len(ctx.items))
    return ctx.outcome(Accounting(input_records=len(ctx.items), succeeded=len(ctx.items), failed=0, skipped=0))


def refuse_process(ctx: ShardContext) -> ShardOutcome:
    raise AssertionError("a refused shard must not start processing")


def build(merged: MergedOutcome) -> Manifest:
    return Manifest(kind=Kind.prompts, run_id="r", producer=Producer(stage="test"), shards=merged.shards,
                    accounting=merged.accounting, section=PromptsSection(sources=["x"], duplicates=0))


def config(**fields: object) -> ImportConfig:
    return ImportConfig(source="src", output="out", **fields)  # type: ignore[arg-type]


def test_the_identity_leaves_out_what_may_differ_between_shards() -> None:
    base = stage_identity(config(shard_index=0, num_shards=2), image="img:1")
    same = stage_identity(config(shard_index=1, num_shards=2, max_bad_fraction=0.5), image="img:1")
    assert base == same and not NOT_SETTINGS & set(base.settings)
    moved = stage_identity(ImportConfig(source="src", output="/elsewhere/out"), image="img:1")
    assert moved.sha256 == base.sha256  # a run root read from another place is the same output
    changed = stage_identity(config(id_field="key"), image="img:2")
    assert [(d.field, d.recorded, d.now) for d in differences(base, changed)] == [
        ("id_field", "id", "key"), ("image", "img:1", "img:2")]


def test_run_shard_refuses_before_processing_and_finalize_records_the_digest(
        storage_root: str, store: ObjectStore) -> None:
    out = join(storage_root, "out")
    made = stage_identity(config(), image="img:1")
    run_shard("test", store, out, ITEMS, 0, 2, process, identity=made)
    marker = ShardMarker.model_validate_json(store.read_bytes(marker_uri(out, 0, 2)))
    assert marker.identity == made

    other = stage_identity(config(sample_records=10), image="img:1")
    with pytest.raises(SettingsChangedError) as refused:
        run_shard("test", store, out, ITEMS, 1, 2, refuse_process, identity=other)
    assert exit_code_for(refused.value) is ExitCode.USAGE
    assert [d.field for d in refused.value.changed] == ["sample_records"]
    assert "sample_records null there, 10 now" in str(refused.value)
    # The shard that is done refuses a rerun under the other settings too (its own marker is compared).
    with pytest.raises(SettingsChangedError):
        run_shard("test", store, out, ITEMS, 0, 2, refuse_process, identity=other)
    image = stage_identity(config(), image="img:2")
    with pytest.raises(SettingsChangedError, match='image "img:1" there, "img:2" now'):
        run_shard("test", store, out, ITEMS, 1, 2, refuse_process, identity=image)

    run_shard("test", store, out, ITEMS, 1, 2, process, identity=made)
    uri = finalize(store, out, 2, build, identity=made)
    assert uri is not None
    assert load_manifest(store, out, Kind.prompts).manifest.producer.settings_sha256 == made.sha256


def test_finalize_refuses_shards_that_ran_with_different_settings(storage_root: str, store: ObjectStore) -> None:
    """Two shards that started together under different settings each found no marker to compare with; their
    markers disagree, and the merge refuses them rather than record one of the two configurations."""
    out = join(storage_root, "out")
    first, second = stage_identity(config(), image=None), stage_identity(config(id_field="key"), image=None)
    run_shard("test", store, out, ITEMS, 0, 2, process, identity=first)
    racing = ShardMarker(stage="test", item_count=0, items_sha256="x", identity=second, outcome=ShardOutcome(
        shard_index=1, shard_count=2, accounting=Accounting(input_records=0, succeeded=0, failed=0, skipped=0)))
    store.write_bytes(marker_uri(out, 1, 2), racing.model_dump_json().encode())
    with pytest.raises(ShardingError) as refused:
        finalize(store, out, 2, build)
    assert isinstance(refused.value, ConfigError)
    assert 'id_field "id" in shard 0, "key" in shard 1' in str(refused.value)
    assert not store.exists(join(out, "manifest.json"))


def test_markers_made_before_identities_are_not_compared(storage_root: str, store: ObjectStore) -> None:
    out = join(storage_root, "out")
    run_shard("test", store, out, ITEMS, 0, 2, process)  # no identity: an older build's marker
    made = stage_identity(config(), image=None)
    run_shard("test", store, out, ITEMS, 1, 2, process, identity=made)
    assert finalize(store, out, 2, build, identity=made) is not None


def test_the_image_comes_from_the_images_own_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IMAGE_ENV, "registry/dflash-tokenizer:abc123")
    assert stage_identity(config()).image == "registry/dflash-tokenizer:abc123"
    monkeypatch.delenv(IMAGE_ENV)
    assert stage_identity(config()).image is None
