"""docs/first-run.md, run as a newcomer would: every `dflash-pipeline` command on the page that needs no cluster
(those marked `# on the cluster` do), in order, against the headline run file pointed at a local object store."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dflash_shared.storage import ObjectStore, join
from tests.pipeline.k8s_support import REPO_ROOT
from tests.support.published_configs import QWEN3_6_27B

PAGE = REPO_ROOT / "docs" / "first-run.md"
HEADLINE = REPO_ROOT / "k8s" / "examples" / "qwen3.6-27b.toml"
CLUSTER_MARK = "on the cluster"


def page_commands() -> list[tuple[str, bool]]:
    """Each command line of the page's bash blocks, and whether it needs the cluster."""
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.DOTALL)
    lines = [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
    return [(line.split("#", 1)[0].strip(), CLUSTER_MARK in line) for line in lines]


def test_the_page_runs_in_order_from_install_to_submit() -> None:
    commands = [command for command, _ in page_commands()]
    order = ["make venv", "make build-images", "cp k8s/examples", "--setup", "stage-model", "doctor",
             "plan --config", "pilot --config", "--from-pilot", "submit --config my-run.toml --dry-run"]
    found = [next(i for i, c in enumerate(commands) if step in c) for step in order]
    assert found == sorted(found), list(zip(order, found, strict=True))


@pytest.mark.slow
def test_every_command_without_a_cluster_succeeds(tmp_path: Path, s3_bucket: str, store: ObjectStore) -> None:
    data = tomllib.loads(HEADLINE.read_text(encoding="utf-8"))
    data["root"] = f"{s3_bucket}/runs"
    data["target"]["uri"] = f"{s3_bucket}/models/Qwen3.6-27B"
    store.write_bytes(join(data["target"]["uri"], "config.json"), json.dumps(QWEN3_6_27B).encode())
    # The same run file as JSON (a run file may be either): the commands' my-run.toml reads it.
    (tmp_path / "my-run.json").write_text(json.dumps(data))
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_6_27B))
    env = {**os.environ, "PATH": f"{REPO_ROOT / 'bin'}:{os.environ['PATH']}"}
    ran = []
    for command, on_cluster in page_commands():
        if on_cluster or not command.startswith("dflash-pipeline"):
            continue  # make and cp are what set this test up; the cluster's commands are the fake API's tests
        argv = shlex.split(command.replace("/models/Qwen3.6-27B/config.json", str(tmp_path / "config.json"))
                           .replace("my-run.toml", "my-run.json"))
        done = subprocess.run([sys.executable, "-m", "dflash_pipeline", *argv[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        ran.append(argv[1])
    assert ran == ["--help", "render", "plan", "plan", "plan", "pilot", "status", "submit", "status"], ran
