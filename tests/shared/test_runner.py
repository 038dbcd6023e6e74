"""Tests of the sharded runner: assignment, merging, markers, crash-and-rerun and concurrent finalize.

The crash and concurrency tests run real worker processes (tests/shared/runner_worker.py) against a temp
directory and the moto S3 server, kill one with SIGKILL mid-shard, and compare every output object with an
uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_shared.errors import exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Accounting, Kind, Shard
from dflash_shared.runner import (
    ShardContext,
    ShardingError,
    ShardOutcome,
    assign,
    finalize,
    marker_uri,
    merge_outcomes,
    resolve_shard,
    run_shard,
)
from dflash_shared.storage import ObjectStore, is_s3, join

WORKER_PATH = Path(__file__).with_name("runner_worker.py")
_spec = importlib.util.spec_from_file_location("runner_worker", WORKER_PATH)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------------------ helpers


_launched: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _reap_workers() -> Iterator[None]:
    """A failing test must not leave workers behind (they would wait at a barrier for a minute)."""
    yield
    while _launched:
        proc = _launched.pop()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def launch(prefix: str, index: int, count: int, *extra: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(WORKER_PATH), "--prefix", prefix, "--index", str(index), "--count", str(count)]
    # The moto endpoint and test credentials are in os.environ for the whole session.
    proc = subprocess.Popen(
        [*cmd, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    _launched.append(proc)
    return proc


def finish(proc: subprocess.Popen[str]) -> tuple[dict[str, Any], str]:
    out, err = proc.communicate(timeout=45)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{err}"
    return json.loads(out.strip().splitlines()[-1]), err


def wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"worker exited early ({proc.returncode}):\n{proc.communicate()[1]}")
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def snapshot(store: ObjectStore, prefix: str) -> dict[str, bytes]:
    """Every object below prefix, by relative key, with the prefix itself masked out of the contents."""
    return {
        uri[len(prefix) + 1 :]: store.read_bytes(uri).replace(prefix.encode(), b"<PREFIX>")
        for uri in store.list(prefix)
    }


def assert_no_temp_leftovers(store: ObjectStore, root: str) -> None:
    if is_s3(root):
        bucket = root[len("s3://") :].split("/", 1)[0]
        assert store.client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
        raw = store.client.list_objects_v2(Bucket=bucket).get("Contents", [])
        assert len(raw) == len(store.list(root))
    else:
        names = [n for _d, _s, files in os.walk(root) for n in files]
        assert not [n for n in names if n.endswith(".tmp") or n.startswith(".")]
        assert len(names) == len(store.list(root))


def expected_accounting(n_items: int) -> tuple[int, int, int]:
    fates = [worker.fate(i) for i in worker.make_items(n_items)]
    return fates.count("kept"), fates.count("bad-input"), fates.count("duplicate")


def run_worker_shard(
    store: ObjectStore, prefix: str, index: int, count: int, items: int = 60, parts: int = 3
) -> ShardOutcome:
    """The worker's shard, run in this process (same items and output as the subprocess)."""
    process = worker.make_process(parts)
    return run_shard(worker.STAGE, store, prefix, worker.make_items(items, seed=index), index, count, process)


def tiny_process(ctx: ShardContext) -> ShardOutcome:
    ctx.publish("\n".join(ctx.items).encode(), ctx.part_name(0, ".txt"), records=len(ctx.items))
    n = len(ctx.items)
    return ctx.outcome(Accounting(input_records=n, succeeded=n, failed=0, skipped=0), totals={"items": n})


def must_not_run(ctx: ShardContext) -> ShardOutcome:
    raise AssertionError(f"process called for shard {ctx.index}, which was already complete")


ITEMS = [f"doc-{i:03d}" for i in range(10)]


# ------------------------------------------------------------------------------------------ assignment


def test_resolve_shard_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    monkeypatch.delenv("DFLASH_NUM_SHARDS", raising=False)
    assert resolve_shard(None, None) == (0, 1)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    monkeypatch.setenv("DFLASH_NUM_SHARDS", "8")
    assert resolve_shard(None, None) == (3, 8)
    assert resolve_shard(5, None) == (5, 8)
    assert resolve_shard(1, 2) == (1, 2)
    with pytest.raises(ShardingError, match=r"shard index 3 \(from JOB_COMPLETION_INDEX\) is out of range for 2"):
        resolve_shard(None, 2)
    monkeypatch.delenv("JOB_COMPLETION_INDEX")
    with pytest.raises(ShardingError, match=r"no shard index was given.*JOB_COMPLETION_INDEX"):
        resolve_shard(None, None)
    monkeypatch.setenv("DFLASH_NUM_SHARDS", "eight")
    with pytest.raises(ShardingError, match="DFLASH_NUM_SHARDS='eight' is not an integer"):
        resolve_shard(0, None)
    with pytest.raises(ShardingError, match="must be at least 1"):
        resolve_shard(0, 0)


def test_assign_is_a_stable_partition() -> None:
    rng = random.Random(7)
    items = [f"s3://bucket/in/{rng.randrange(10**9):09d}.jsonl" for _ in range(103)]
    assert len(set(items)) == len(items)
    for count in (1, 2, 5, 7, 200):
        parts = [assign(items, i, count) for i in range(count)]
        flat = [item for part in parts for item in part]
        assert sorted(flat) == sorted(items), f"count={count}: not every item exactly once"
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        shuffled = items[:]
        rng.shuffle(shuffled)
        assert [assign(shuffled, i, count) for i in range(count)] == parts
    with pytest.raises(ShardingError, match="'b' is listed more than once"):
        assign(["a", "b", "c", "b"], 0, 2)
    with pytest.raises(ShardingError, match="out of range"):
        assign(items, 3, 3)


def _outcome(index: int, count: int, shard_names: list[str], reasons: dict[str, int]) -> ShardOutcome:
    shards = [Shard(uri=f"/p/data/{n}", bytes=10, sha256="0" * 64, records=2) for n in shard_names]
    failed = sum(reasons.values())
    acc = Accounting(
        input_records=2 * len(shards) + failed + 1,
        succeeded=2 * len(shards),
        failed=failed,
        skipped=1,
        failures_by_reason=reasons,
        skips_by_reason={"dup": 1},
        examples={r: [f"s{index}-{k}" for k in range(n)] for r, n in reasons.items()},
    )
    return ShardOutcome(
        shard_index=index,
        shard_count=count,
        shards=shards,
        accounting=acc,
        totals={"tokens": 100 * (index + 1), "weight": 0.25},
        histograms={"len": {"0-10": index, f"only-{index}": 1}},
    )


def test_merge_outcomes_sums_and_orders() -> None:
    a = _outcome(0, 3, ["a0", "a1"], {"bad": 4})
    b = _outcome(1, 3, ["b0"], {"bad": 3, "empty": 1})
    c = _outcome(2, 3, [], {})
    merged = merge_outcomes([c, a, b])
    assert [s.uri for s in merged.shards] == ["/p/data/a0", "/p/data/a1", "/p/data/b0"]
    acc = merged.accounting
    assert (acc.input_records, acc.succeeded, acc.failed, acc.skipped) == (17, 6, 8, 3)
    assert acc.failures_by_reason == {"bad": 7, "empty": 1}
    assert acc.skips_by_reason == {"dup": 3}
    assert acc.examples["bad"] == ["s0-0", "s0-1", "s0-2", "s0-3", "s1-0"]
    assert acc.examples["empty"] == ["s1-0"]
    assert merged.totals == {"tokens": 600, "weight": 0.75}
    assert isinstance(merged.totals["tokens"], int)
    assert merged.histograms == {"len": {"0-10": 3, "only-0": 1, "only-1": 1, "only-2": 1}}
    assert merged.shard_count == 3
    with pytest.raises(ShardingError, match="shard 1 of a 2-shard run with a 3-shard run"):
        merge_outcomes([a, _outcome(1, 2, ["x"], {})])
    with pytest.raises(ShardingError, match="/p/data/a0 is listed by shard 0 and by shard 1"):
        merge_outcomes([a, _outcome(1, 3, ["a0"], {})])
    with pytest.raises(ShardingError, match="shard 0 appears twice"):
        merge_outcomes([a, a])


# ------------------------------------------------------------------------------------------ in process


def test_publish_scratch_and_marker(storage_root: str, store: ObjectStore) -> None:
    prefix = join(storage_root, "out")
    seen: dict[str, Any] = {}

    def process(ctx: ShardContext) -> ShardOutcome:
        seen["scratch"] = ctx.scratch_dir
        local = Path(ctx.scratch_dir) / "big.bin"
        local.write_bytes(os.urandom(300_000))
        ctx.publish(local, "nested/big.bin", records=3, tokens=7)
        ctx.publish(b"small object", "small.txt", records=1)
        assert not store.exists(marker_uri(prefix, ctx.index, ctx.count)), "marker written before process ended"
        return ctx.outcome(Accounting(input_records=4, succeeded=4, failed=0, skipped=0))

    outcome = run_shard("unit", store, prefix, ITEMS, 1, 2, process)
    assert not os.path.exists(seen["scratch"]), "scratch dir was not cleaned"
    assert [s.uri for s in outcome.shards] == [
        join(prefix, "data", "nested/big.bin"),
        join(prefix, "data", "small.txt"),
    ]
    for shard in outcome.shards:
        assert store.sha256(shard.uri) == shard.sha256
        assert store.size(shard.uri) == shard.bytes
    assert outcome.shards[0].tokens == 7
    assert store.exists(marker_uri(prefix, 1, 2))
    # The marker is what a rerun returns, without processing again.
    assert run_shard("unit", store, prefix, ITEMS, 1, 2, must_not_run) == outcome


def test_failed_process_leaves_no_marker(storage_root: str, store: ObjectStore) -> None:
    prefix = join(storage_root, "out")
    seen: dict[str, str] = {}

    def process(ctx: ShardContext) -> ShardOutcome:
        seen["scratch"] = ctx.scratch_dir
        ctx.publish(b"first part", ctx.part_name(0, ".txt"), records=1)
        raise RuntimeError("input file corrupt")

    with pytest.raises(RuntimeError, match="input file corrupt"):
        run_shard("unit", store, prefix, ITEMS, 0, 1, process)
    assert not os.path.exists(seen["scratch"])
    assert store.list(join(prefix, "_markers")) == []
    assert finalize(store, prefix, 1, worker.build_manifest) is None
    outcome = run_shard("unit", store, prefix, ITEMS, 0, 1, tiny_process)
    assert outcome.totals == {"items": len(ITEMS)}


def test_refuses_another_shard_count(storage_root: str, store: ObjectStore) -> None:
    prefix = join(storage_root, "out")
    run_shard("unit", store, prefix, ITEMS, 0, 2, tiny_process)
    expected = r"holds marker .*shard-00000-of-00002\.json of a 2-shard run, but this run uses 3 shards"
    with pytest.raises(ShardingError, match=expected) as err:
        run_shard("unit", store, prefix, ITEMS, 0, 3, tiny_process)
    # Rerunning cannot fix this, so the pod must fail without retries.
    assert exit_code_for(err.value) is ExitCode.USAGE
    with pytest.raises(ShardingError, match="refusing to mix shardings"):
        finalize(store, prefix, 3, worker.build_manifest)
    assert len(store.list(join(prefix, "data"))) == 1


def test_refuses_changed_items_or_stage(tmp_path: Path, store: ObjectStore) -> None:
    prefix = str(tmp_path / "out")
    run_shard("unit", store, prefix, ITEMS, 0, 2, tiny_process)
    with pytest.raises(ShardingError, match=r"written for 5 items .* but 6 items .* the input listing changed"):
        run_shard("unit", store, prefix, [*ITEMS, "doc-000a"], 0, 2, tiny_process)
    with pytest.raises(ShardingError, match="written by stage 'unit', not 'other'"):
        run_shard("other", store, prefix, ITEMS, 0, 2, tiny_process)


def test_process_contract_is_checked(tmp_path: Path, store: ObjectStore) -> None:
    def wrong_index(ctx: ShardContext) -> ShardOutcome:
        acc = Accounting(input_records=0, succeeded=0, failed=0, skipped=0)
        return ShardOutcome(shard_index=0, shard_count=ctx.count, accounting=acc)

    def unlisted(ctx: ShardContext) -> ShardOutcome:
        ctx.publish(b"x", "orphan.txt", records=1)
        return ShardOutcome(
            shard_index=ctx.index,
            shard_count=ctx.count,
            accounting=Accounting(input_records=0, succeeded=0, failed=0, skipped=0),
        )

    prefix = str(tmp_path / "out")
    with pytest.raises(ShardingError, match="returned the outcome of shard 0 of 2"):
        run_shard("unit", store, prefix, ITEMS, 1, 2, wrong_index)
    with pytest.raises(ShardingError, match=r"published .*orphan\.txt but did not list it"):
        run_shard("unit", store, prefix, ITEMS, 1, 2, unlisted)
    with pytest.raises(ShardingError, match=r"invalid shard file name '\.\./escape'"):
        run_shard("unit", store, prefix, ITEMS, 1, 2, lambda ctx: tiny_process_named(ctx, "../escape"))
    assert store.list(join(prefix, "_markers")) == []


def tiny_process_named(ctx: ShardContext, name: str) -> ShardOutcome:
    ctx.publish(b"x", name, records=1)
    raise AssertionError("publish accepted a bad name")


def test_finalize_waits_for_all_shards(storage_root: str, store: ObjectStore, caplog: pytest.LogCaptureFixture) -> None:
    prefix = join(storage_root, "out")
    for index in (0, 2, 5):
        run_shard("unit", store, prefix, ITEMS, index, 8, tiny_process)
    with caplog.at_level(logging.INFO, logger="dflash_shared.runner"):
        assert finalize(store, prefix, 8, worker.build_manifest) is None
    assert "3/8 shards complete; waiting on shard(s) 1, 3, 4, 6, 7" in caplog.text
    assert not store.exists(join(prefix, "manifest.json"))

    for index in (1, 3, 4, 6, 7):
        run_shard("unit", store, prefix, ITEMS, index, 8, tiny_process)

    def drops_one(merged: Any) -> Any:
        return worker.build_manifest(merged).model_copy(update={"shards": merged.shards[1:]})

    with pytest.raises(ShardingError, match="must list every shard file exactly once"):
        finalize(store, prefix, 8, drops_one)
    uri = finalize(store, prefix, 8, worker.build_manifest)
    loaded = load_manifest(store, prefix, Kind.prompts)
    assert uri == loaded.uri
    assert loaded.manifest.accounting.input_records == len(ITEMS)
    assert sorted(i for s in loaded.manifest.shards for i in store.read_bytes(s.uri).decode().split("\n") if i) == ITEMS


# ------------------------------------------------------------------------------------------ processes


def test_kill_mid_shard_then_rerun_is_byte_identical(storage_root: str, store: ObjectStore, tmp_path: Path) -> None:
    crashed, clean = join(storage_root, "crashed"), join(storage_root, "clean")
    control = tmp_path / "control"
    control.mkdir()
    victim = launch(crashed, 1, 2, "--pause-after", "0", "--control", str(control), "--no-finalize")
    wait_for(control / "published-1-0", victim)
    os.kill(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=10)
    assert victim.returncode == -signal.SIGKILL
    # Killed with one part published: the part is there, the shard is not complete, nothing is committed.
    assert store.list(join(crashed, "data")) == [join(crashed, "data", "part-00001-0000.tsv")]
    assert store.list(join(crashed, "_markers")) == []

    # The pod restarts; meanwhile the other shard and an uninterrupted run of both shards run here.
    restarted = launch(crashed, 1, 2)
    run_worker_shard(store, crashed, 0, 2)
    for index in range(2):
        run_worker_shard(store, clean, index, 2)
    assert finalize(store, clean, 2, worker.build_manifest) == join(clean, "manifest.json")
    result, _err = finish(restarted)
    assert result["processed"]
    assert finalize(store, crashed, 2, worker.build_manifest) == join(crashed, "manifest.json")

    got, want = snapshot(store, crashed), snapshot(store, clean)
    parts = [f"data/part-{i:05d}-{k:04d}.tsv" for i in range(2) for k in range(3)]
    markers = [f"_markers/shard-{i:05d}-of-00002.json" for i in range(2)]
    assert sorted(got) == sorted([*parts, *markers, "manifest.json"])
    assert got == want
    assert_no_temp_leftovers(store, storage_root)
    manifest = load_manifest(store, crashed, Kind.prompts).manifest
    assert [s.uri for s in manifest.shards] == [join(crashed, p) for p in parts]
    kept, failed, skipped = expected_accounting(60)
    acc = manifest.accounting
    assert (acc.input_records, acc.succeeded, acc.failed, acc.skipped) == (60, kept, failed, skipped)
    assert manifest.total_records == kept


def test_a_finished_shard_removes_the_temp_files_its_killed_writes_left(tmp_path: Path, store: ObjectStore) -> None:
    """kill -9 between a local write's temp file and its rename leaves the temp file behind (listings never show
    it). When the shard that owns it completes, its own temp files go: its progress records', its parts' and its
    marker's; another shard's, which may still be in flight, stay."""
    prefix = str(tmp_path / "out")
    progress, data = Path(prefix, "_progress", "shard-00001-of-00002"), Path(prefix, "data")
    progress.mkdir(parents=True)
    data.mkdir(parents=True)
    hexes = iter(f"{i:032x}" for i in range(10))
    markers = Path(prefix, "_markers")
    markers.mkdir()
    own = [progress / f".part-00001-0000.txt.json.{next(hexes)}.tmp", data / f".part-00001-0000.txt.{next(hexes)}.tmp",
           markers / f".shard-00001-of-00002.json.{next(hexes)}.tmp"]
    others = [data / f".part-00000-0000.txt.{next(hexes)}.tmp",
              markers / f".shard-00000-of-00002.json.{next(hexes)}.tmp"]
    for path in [*own, *others]:
        path.write_bytes(b"half written")

    run_shard("unit", store, prefix, ITEMS, 1, 2, tiny_process)
    assert not any(p.exists() for p in own)
    assert all(p.exists() for p in others)
    assert store.list(join(prefix, "data")) == [join(prefix, "data", "part-00001-0000.txt")]


@pytest.mark.slow
def test_four_workers_race_to_finalize_once(
    storage_root: str, store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = join(storage_root, "out")
    control = tmp_path / "control"
    control.mkdir()
    common = ("--items", "90", "--parts", "2", "--control", str(control), "--barrier", "4")
    procs = [launch(prefix, i, 4, *common) for i in range(4)]
    results = [finish(p) for p in procs]
    manifest_uri = join(prefix, "manifest.json")
    assert all(r["manifest"] == manifest_uri and r["processed"] for r, _ in results)
    writers = [err for _, err in results if "wrote manifest" in err]
    losers = [err for _, err in results if "already written by another worker" in err]
    assert len(writers) == 1, "exactly one worker must create the manifest"
    assert len(losers) == 3

    loaded = load_manifest(store, prefix, Kind.prompts)
    uris = [s.uri for s in loaded.manifest.shards]
    assert uris == [join(prefix, "data", f"part-{i:05d}-{k:04d}.tsv") for i in range(4) for k in range(2)]
    kept, failed, skipped = expected_accounting(90)
    acc = loaded.manifest.accounting
    assert (acc.input_records, acc.succeeded, acc.failed, acc.skipped) == (90, kept, failed, skipped)
    assert acc.skips_by_reason == {"duplicate": skipped}
    assert len(acc.examples["bad-input"]) == 5
    assert loaded.manifest.total_records == kept

    before = snapshot(store, prefix)
    with caplog.at_level(logging.INFO, logger="dflash_shared.runner"):
        assert run_worker_shard(store, prefix, 2, 4, items=90, parts=2).shard_index == 2
    assert "[runner-test shard 2/4] stage complete" in caplog.text and "nothing to do" in caplog.text
    for index in range(4):
        items = worker.make_items(90, seed=index + 10)
        assert run_shard(worker.STAGE, store, prefix, items, index, 4, must_not_run).shard_index == index
    assert finalize(store, prefix, 4, worker.build_manifest) == manifest_uri
    assert snapshot(store, prefix) == before
    assert_no_temp_leftovers(store, storage_root)


def test_the_left_out_line_names_each_reason_with_an_example() -> None:
    from dflash_shared.runner import left_out_line

    acc = Accounting(input_records=40, succeeded=37, failed=2, skipped=1, failures_by_reason={"malformed_record": 2},
                     skips_by_reason={"duplicate": 1},
                     examples={"malformed_record": ["a.jsonl:17: not valid JSON"], "duplicate": ["a.jsonl:3: same"]})
    assert left_out_line(acc) == ("left out 3 of 40 records: malformed_record 2 (e.g. a.jsonl:17: not valid JSON); "
                                  "duplicate 1 (e.g. a.jsonl:3: same)")
    assert left_out_line(Accounting(input_records=5, succeeded=5, failed=0, skipped=0)) == (
        "left out nothing: 5 of 5 records kept")
