"""The demo pipeline end to end on a real S3 endpoint (moto): killed midway, resumed, every manifest's lineage.

One demo run is killed with SIGKILL (its whole process group: pipeline, stage, vLLM engine processes) once
the generate stage has committed a chunk but not all of them; a rerun of the same command must finish the
run without losing or repeating a record, adopting the committed chunks as they were. A last rerun finds
every stage complete and changes nothing.

It runs on the dense Qwen3 target in the default tier: resuming, lineage and the no-op rerun do not depend on the
model, and the dense target's run costs about half the hybrid's on 2 cores. The same test on the Qwen3.6-architecture
(hybrid) target, which also checks the serving comparison across dtypes, is marked `extended` (`make test-all`);
every stage's own suite covers the hybrid target in the default tier.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import pyarrow as pa
import pytest

from dflash_shared.jsonl import iter_lines
from dflash_shared.manifest_io import LoadedManifest, load_manifest
from dflash_shared.manifests import MANIFEST_NAME, Kind
from dflash_shared.storage import ObjectStore, join

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]

# Output folder under the run -> manifest kind, upstream first (export is a drafter-kind manifest).
STAGES = [("prompts", Kind.prompts), ("completions", Kind.completions), ("tokenized", Kind.tokenized),
          ("drafter", Kind.drafter), ("export", Kind.drafter), ("evaluation", Kind.evaluation),
          ("serving", Kind.evaluation)]
# The generate stage's commit point for a chunk is its receipt (dflash_generate.chunks).
RECEIPTS_DIR = "_chunks"
# Model build, vLLM start-up and the first chunk on 2 shared cores take a few minutes at most.
FIRST_CHUNK_TIMEOUT_S = 1200
POLL_S = 0.2
# The tiny target commits a 16-prompt chunk about a second after the engine is up, so the demo's 3 chunks
# leave little time to strike between the first commit and the last. 6 chunks of 8 widen that window for a
# few seconds of generation; every run of the test, the no-op rerun included, uses the same settings.
OVERRIDES = {"generate": {"chunk_records": 8}}
RESUMED = re.compile(r"(\d+) chunk\(s\), (\d+) committed by an earlier attempt, (\d+) to generate")


def demo_command(out: Path, root: str, target: str = "qwen3") -> list[str]:
    overrides = out.parent / "overrides.json"
    overrides.write_text(json.dumps(OVERRIDES))
    return [sys.executable, "demo/run_demo.py", "--out", str(out), "--root", root, "--overrides", str(overrides),
            "--target", target]


def demo_env(tmp: Path) -> dict[str, str]:
    # A killed stage cannot remove its scratch folders: keep them inside the test's directory.
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp)}


def demo(out: Path, root: str, tmp: Path, target: str = "qwen3") -> subprocess.CompletedProcess[str]:
    return subprocess.run(demo_command(out, root, target), cwd=REPO, capture_output=True, text=True, timeout=2400,
                          check=False, env=demo_env(tmp))


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:]


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the demo's whole process group and wait until every member is gone."""
    try:
        members = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        members = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)
    _, alive = psutil.wait_procs(members, timeout=60)
    assert not alive, f"processes of the killed demo survived SIGKILL: {[p.pid for p in alive]}"


def kill_after_first_chunk(proc: subprocess.Popen[bytes], store: ObjectStore, run: str, log: Path) -> dict[str, bytes]:
    """Wait until generate has committed a chunk, kill the demo, return the receipts committed by then."""
    completions = join(run, "completions")
    deadline = time.monotonic() + FIRST_CHUNK_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the demo exited {proc.returncode} before generate committed a chunk:\n{tail(log)}")
            if store.exists(join(completions, MANIFEST_NAME)):
                pytest.fail(f"generate finished every chunk between two polls, no chance to kill it midway "
                            f"(chunk_records too large for the demo's prompts?):\n{tail(log)}")
            if store.list(join(completions, RECEIPTS_DIR)):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"no generate chunk receipt under {completions}/{RECEIPTS_DIR} after "
                            f"{FIRST_CHUNK_TIMEOUT_S} s:\n{tail(log)}")
            time.sleep(POLL_S)
    finally:
        kill_group(proc)
    return {uri: store.read_bytes(uri) for uri in store.list(join(completions, RECEIPTS_DIR))}


def jsonl_ids(store: ObjectStore, loaded: LoadedManifest) -> list[str]:
    return [json.loads(line)["id"] for shard in loaded.manifest.shards for _, line in iter_lines(store, shard.uri)]


def arrow_ids(store: ObjectStore, loaded: LoadedManifest, split: str | None = None) -> list[str]:
    ids: list[str] = []
    for shard in loaded.manifest.shards if split is None else loaded.manifest.split_shards(split):  # type: ignore[arg-type]
        table = pa.ipc.open_stream(pa.BufferReader(store.read_bytes(shard.uri))).read_all()
        assert table.num_rows == shard.records, f"{shard.uri}: {table.num_rows} rows, the manifest says {shard.records}"
        ids.extend(table.column("id").to_pylist())
    return ids


def check_nothing_lost_or_repeated(store: ObjectStore, loaded: dict[str, LoadedManifest]) -> None:
    """Every prompt is accounted for exactly once through generate and tokenize."""
    prompt_ids = jsonl_ids(store, loaded["prompts"])
    assert len(set(prompt_ids)) == len(prompt_ids), "the prompts shards repeat a record id"
    generated = loaded["completions"].manifest.accounting  # balanced by construction (validator); counts checked
    assert generated.input_records == len(prompt_ids), (
        f"generate read {generated.input_records} prompts, the prompts shards hold {len(prompt_ids)}")
    assert generated.succeeded + generated.failed + generated.skipped == generated.input_records
    completion_ids = jsonl_ids(store, loaded["completions"])
    repeated = sorted(i for i, n in Counter(completion_ids).items() if n > 1)
    assert not repeated, f"completions repeat record ids after the resume: {repeated[:5]}"
    assert len(completion_ids) == generated.succeeded, (
        f"completions shards hold {len(completion_ids)} records, the manifest says {generated.succeeded} succeeded")
    strangers = set(completion_ids) - set(prompt_ids)
    assert not strangers, f"completions for ids that are not prompts: {sorted(strangers)[:5]}"
    # Exactly the prompts that were neither failed nor skipped got a completion.
    assert len(set(prompt_ids) - set(completion_ids)) == generated.failed + generated.skipped
    tokenized = loaded["tokenized"].manifest.accounting
    assert tokenized.input_records == generated.succeeded, (
        f"tokenize read {tokenized.input_records} records, generate wrote {generated.succeeded}")
    token_ids = arrow_ids(store, loaded["tokenized"])
    assert len(set(token_ids)) == len(token_ids), "tokenized shards repeat a record id"
    assert set(token_ids) <= set(completion_ids), "tokenized shards hold ids that have no completion"
    assert len(token_ids) == tokenized.succeeded == generated.succeeded - tokenized.failed - tokenized.skipped
    # The held-out split: its own shards, no id on both sides, and exactly the prompts the evaluation decoded.
    heldout, train = set(arrow_ids(store, loaded["tokenized"], "heldout")), set(arrow_ids(store, loaded["tokenized"],
                                                                                          "train"))
    assert heldout and not heldout & train and heldout | train == set(token_ids)
    assert len(heldout) == loaded["tokenized"].manifest.section.heldout.records  # type: ignore[union-attr]
    (report,) = [s.uri for s in loaded["evaluation"].manifest.shards if s.uri.endswith("evaluation.json")]
    evaluated = {r["id"] for r in json.loads(store.read_bytes(report))["results"]}
    assert evaluated == heldout, f"the evaluation decoded {len(evaluated)} prompts, {len(heldout)} are held out"


def check_generate_resumed(store: ObjectStore, run: str, committed: dict[str, bytes], rerun_log: str) -> None:
    """The rerun adopted the chunks committed before the kill, byte for byte, and generated only the rest."""
    for uri, before in committed.items():
        assert store.read_bytes(uri) == before, f"chunk receipt {uri} was rewritten by the rerun"
    resumed = RESUMED.search(rerun_log)
    assert resumed, f"the rerun's generate stage did not report which chunks it resumed:\n{rerun_log[-4000:]}"
    chunks, adopted, pending = map(int, resumed.groups())
    assert adopted == len(committed), f"the rerun adopted {adopted} chunk(s), {len(committed)} were committed"
    assert pending == chunks - adopted
    completions = load_manifest(store, join(run, "completions"), Kind.completions).manifest
    receipts = store.list(join(run, "completions", RECEIPTS_DIR))
    assert len(receipts) == chunks, f"{chunks} chunks planned, {len(receipts)} receipts: {receipts}"
    # No file of an interrupted chunk is left beside the ones the manifest names.
    listed = {uri for uri in store.list(join(run, "completions")) if uri.endswith(".jsonl.zst")}
    assert listed == {shard.uri for shard in completions.shards}


def require_environments() -> None:
    for env in (".venv-generate", ".venv-train"):
        if not (REPO / env / "bin" / "python").exists():
            pytest.fail(f"{env} is missing: `make test` builds it before the suites run")


def check_lineage_and_acceptance(store: ObjectStore, run: str, summary: str) -> dict[str, LoadedManifest]:
    """Every manifest loads (re-hashing its shards) and names its upstream; tau rose; the engine agreed."""
    loaded = {}
    for folder, kind in STAGES:
        loaded[folder] = load_manifest(store, join(run, folder), kind)  # re-hashes every shard
    # Lineage: each manifest names its input by URI and by the sha256 of that manifest's bytes.
    for (upstream, _), (folder, _) in zip(STAGES[:-1], STAGES[1:], strict=True):
        inputs = loaded[folder].manifest.inputs
        assert inputs, f"{folder} names no input"
        named = {ref.uri: ref.sha256 for ref in inputs}
        upstream_uri = join(run, upstream, MANIFEST_NAME)
        assert upstream_uri in named, f"{folder} does not name {upstream_uri}: {named}"
        assert named[upstream_uri] == hashlib.sha256(store.read_bytes(upstream_uri)).hexdigest()
    evaluation = loaded["evaluation"].manifest.section
    # On prompts training never read, the drafter still at least doubles the untrained one's acceptance.
    assert evaluation.prompt_split == "heldout"  # type: ignore[union-attr]
    assert evaluation.tau_untrained is not None and evaluation.tau >= 2 * evaluation.tau_untrained  # type: ignore[union-attr]
    # The serving check: vLLM with the exported drafter counted about the same acceptance as the offline loop.
    serving = loaded["serving"].manifest.section
    assert serving.engine_tau is not None and serving.tau == evaluation.tau  # type: ignore[union-attr]
    assert "tau" in summary and "engine tau" in summary  # the summary was printed
    assert re.search(r"untrained on \d+ held-out prompts", summary), summary[-2000:]
    return loaded


# The run folder each demo target writes under the root (demo/run_demo.py).
RUN_NAMES = {"qwen3": "demo", "qwen3_6": "demo-qwen36"}


# Three demo runs (killed, resumed, the no-op rerun): about 12 minutes on 2 idle cores, the hybrid target's bf16
# generation on CPU being the slow part; the suite's 15-minute default is too close.
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("target", [
    "qwen3",
    # Gated DeltaNet + full attention, a vision-language checkpoint: the same paths, the serving check across
    # dtypes besides (`make test-all`).
    pytest.param("qwen3_6", marks=pytest.mark.extended),
])
def test_demo_killed_midway_resumes_with_lineage(target: str, s3_bucket: str, store: ObjectStore,
                                                 tmp_path: Path) -> None:
    require_environments()
    root = join(s3_bucket, "runs")
    run = join(root, RUN_NAMES[target])
    out, tmp = tmp_path / "out", tmp_path / "tmp"

    # The first run dies by SIGKILL in the middle of generate, like a preempted node.
    log = tmp_path / "killed.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(demo_command(out, root, target), cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                env=demo_env(tmp), start_new_session=True)
        committed = kill_after_first_chunk(proc, store, run, log)
    assert not store.exists(join(run, "completions", MANIFEST_NAME)), "generate completed before the kill"
    chunks = RESUMED.search(log.read_text(errors="replace"))
    assert chunks and len(committed) < int(chunks.group(1)), (
        f"every chunk was committed before the kill ({len(committed)}): nothing was left to resume")

    # The same command again resumes the run and completes it.
    proc_resumed = demo(out, root, tmp, target)
    assert proc_resumed.returncode == 0, proc_resumed.stderr[-4000:]
    check_generate_resumed(store, run, committed, proc_resumed.stderr)
    loaded = check_lineage_and_acceptance(store, run, proc_resumed.stdout)
    check_nothing_lost_or_repeated(store, loaded)
    if target == "qwen3_6":
        check_hybrid_run(loaded, store, proc_resumed.stdout)
    else:
        serving = loaded["serving"].manifest.section  # same dtype on both sides: the gap over all prompts
        assert abs(serving.engine_tau - serving.tau) / serving.tau <= 0.10  # type: ignore[union-attr,operator]

    # A rerun finds every stage complete and changes nothing.
    before = {uri: store.read_bytes(uri) for uri in store.list(run) if uri.endswith(MANIFEST_NAME)}
    again = demo(out, root, tmp, target)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stderr.count("skipped") >= len(STAGES)
    assert {uri: store.read_bytes(uri) for uri in store.list(run) if uri.endswith(MANIFEST_NAME)} == before


def check_hybrid_run(loaded: dict[str, LoadedManifest], store: ObjectStore, summary: str) -> None:
    """The Qwen3.6-architecture run: its layer ids, its target, and the serving check across dtypes."""
    assert loaded["drafter"].manifest.section.target_layer_ids == [1, 3, 5]  # type: ignore[union-attr]
    assert loaded["evaluation"].manifest.section.target.model_id == "tiny-qwen3_6-demo"  # type: ignore[union-attr]
    (report,) = [s.uri for s in loaded["serving"].manifest.shards if s.uri.endswith("serve-check.json")]
    check = json.loads(store.read_bytes(report))
    # vLLM's CPU build runs the hybrid target in bfloat16 only; the offline loop ran float32.
    assert (check["dtype"], check["offline_dtype"], check["compared"]) == ("bfloat16", "float32", "matched")
    assert check["matched"]["relative_gap"] <= 0.10 and check["output_mismatches"] == []
    # The bfloat16 numerics policy (dflash_shared.lossless): outputs part only at near-ties both runs show, on
    # few of the compared positions.
    outputs = check["outputs"]
    assert outputs["policy"] == {"dtype": "bfloat16", "tie_margin": 0.25, "max_near_tie_share": 0.25}
    assert outputs["prompts"] == check["prompts"] and outputs["positions"] >= outputs["prompts"]
    # At most a quarter of the plain run's own near-tie positions, rounded up (a parting is one of them).
    assert len(outputs["partings"]) <= -(-outputs["near_tie_positions"] // 4)
    assert outputs["near_tie_positions"] <= outputs["positions"]
    assert all(p["tie"] and 0 <= p["speculative_margin"] <= 0.25 and 0 <= p["plain_margin"] <= 0.25
               for p in outputs["partings"])
    assert "bfloat16 vs float32" in summary
