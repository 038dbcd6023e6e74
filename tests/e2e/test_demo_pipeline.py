"""The demo pipeline end to end on a real S3 endpoint (moto): every stage, every manifest's lineage, a rerun."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import MANIFEST_NAME, Kind
from dflash_shared.storage import ObjectStore, join

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]

# Output folder under the run -> manifest kind, upstream first (export is a drafter-kind manifest).
STAGES = [("prompts", Kind.prompts), ("completions", Kind.completions), ("tokenized", Kind.tokenized),
          ("drafter", Kind.drafter), ("export", Kind.drafter), ("evaluation", Kind.evaluation)]


def demo(out: Path, root: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "demo/run_demo.py", "--out", str(out), "--root", root], cwd=REPO,
                          capture_output=True, text=True, timeout=2400, check=False, env=dict(os.environ))


def test_demo_on_s3_with_lineage_and_resume(s3_bucket: str, store: ObjectStore, tmp_path: Path) -> None:
    for env in (".venv-generate", ".venv-train"):
        if not (REPO / env / "bin" / "python").exists():
            pytest.fail(f"{env} is missing: `make test` builds it before the suites run")
    root = join(s3_bucket, "runs")
    proc = demo(tmp_path / "out", root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = join(root, "demo")
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
    assert evaluation.tau > (evaluation.tau_untrained or 1.0)  # type: ignore[union-attr]
    assert "tau" in proc.stdout and "evaluation" in proc.stdout  # the summary was printed

    # A rerun finds every stage complete and changes nothing.
    before = {uri: store.read_bytes(uri) for uri in store.list(run) if uri.endswith(MANIFEST_NAME)}
    again = demo(tmp_path / "out", root)
    assert again.returncode == 0, again.stderr[-4000:]
    assert again.stderr.count("skipped") >= len(STAGES)
    assert {uri: store.read_bytes(uri) for uri in store.list(run) if uri.endswith(MANIFEST_NAME)} == before
