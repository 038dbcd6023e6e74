"""A worker killed mid-run (kill -9, as when a node disappears) loses only its unfinished chunks.

The stage runs as `python -m dflash_generate run` in its own process group, configured through
DFLASH_GENERATE_* variables as in a pod. Once two chunk receipts are visible the whole group is killed
with SIGKILL; the rerun adopts every committed chunk untouched and generates only the rest, so each
prompt is completed exactly once.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="resume tests need the generate environment (.venv-generate)")

from dflash_generate.parallel import child_env  # noqa: E402
from dflash_shared.manifest_io import load_manifest  # noqa: E402
from dflash_shared.manifests import Kind  # noqa: E402
from dflash_shared.storage import ObjectStore, join  # noqa: E402
from tests.generate.stage_support import (  # noqa: E402
    ONE_ARCH,
    completions,
    in_shard_order,
    stage_config,
    varied_prompts,
    write_prompts,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def start(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as sink:
        return subprocess.Popen([sys.executable, "-m", "dflash_generate", "run"], env=env, cwd=REPO,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_receipts(store: ObjectStore, out: str, count: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while len(store.list(join(out, "_chunks"))) < count:
        if proc.poll() is not None:
            pytest.fail(f"the stage exited {proc.returncode} before {count} chunks were committed:\n"
                        f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {count} chunk receipts after 300 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def data_files(store: ObjectStore, out: str) -> dict[str, str]:
    return {uri: hashlib.sha256(store.read_bytes(uri)).hexdigest() for uri in store.list(join(out, "data"))}


@ONE_ARCH
def test_killed_worker_resumes_and_completes_every_prompt_once(tmp_path: Path, tiny_target_dir: Path,
                                                               vllm_env: dict[str, str]) -> None:
    store = ObjectStore()
    prompts = varied_prompts(24)
    src = write_prompts(store, str(tmp_path / "prompts"), prompts, shards=2)
    out = str(tmp_path / "completions")
    # Eight chunks of three prompts, one chunk in the engine at a time: there is a moment to strike.
    config = stage_config(src, out, tiny_target_dir, max_new_tokens=48, chunk_records=3, max_inflight=3)
    env = {**child_env(config, 0, None), **vllm_env, "PYTHONPATH": str(REPO)}
    log = tmp_path / "stage.log"

    first = start(env, log)
    try:
        wait_for_receipts(store, out, 2, first, log)
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the stage and its engine processes, as a node loss would
        first.wait()
    assert first.returncode == -signal.SIGKILL
    receipts = store.list(join(out, "_chunks"))
    # Only files with a receipt are committed; a file written just before the kill is redone.
    names = {uri.rsplit("/", 1)[-1].removesuffix(".json") + ".jsonl.zst" for uri in receipts}
    committed = {uri: sha for uri, sha in data_files(store, out).items() if uri.rsplit("/", 1)[-1] in names}
    assert len(receipts) >= 2 and not store.exists(join(out, "manifest.json"))

    second = start(env, log)
    try:
        assert second.wait(timeout=400) == 0, log.read_text()[-3000:]
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    text = log.read_text()
    assert f"{len(receipts)} committed by an earlier attempt" in text

    manifest = load_manifest(store, out, Kind.completions).manifest
    assert manifest.accounting.input_records == manifest.accounting.succeeded == len(prompts)
    ids = [r.id for r in completions(store, out)]
    assert ids == [p.id for p in in_shard_order(prompts, 2)]  # type: ignore[union-attr]
    # The chunks committed before the kill were adopted as they were, not generated again.
    after = data_files(store, out)
    assert {uri: after[uri] for uri in committed} == committed
    assert len(after) == 8 and len(store.list(join(out, "_chunks"))) == 8
