"""A local run keeps each shard's log where a pod keeps its log, so `pipeline logs` reads a local run too."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from dflash_pipeline import layout, parse_run_config
from dflash_pipeline.drive.run_logs import collect_logs
from dflash_pipeline.local.console import Console
from dflash_pipeline.local.runner import IMAGE_ENVIRONMENTS, StageFailedError, run_local
from dflash_pipeline.run.config import read_run_file
from dflash_pipeline.run.stages import plan, stage_config
from dflash_shared.storage import ObjectStore, join
from tests.pipeline.k8s_support import EXAMPLE_RUN

# Stands in for the stage environment's python: says what it runs, and fails the import with bad input (65).
FAKE_PYTHON = """#!/bin/sh
echo "running $2 $3 (shard $JOB_COMPLETION_INDEX)"
echo "quality gate: 9 of 10 conversations are empty" >&2
exit 65
"""


def test_a_local_run_keeps_each_shards_log_in_the_store_with_how_it_ended(tmp_path: Path) -> None:
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = str(tmp_path / "store")
    run = parse_run_config(data)
    python = tmp_path / "repo" / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    console = Console(io.StringIO(), is_tty=False)
    with pytest.raises(StageFailedError) as failed:
        run_local(run, tmp_path / "repo", environments=dict.fromkeys(IMAGE_ENVIRONMENTS, "env"), only=["import"],
                  console=console, log_dir=tmp_path / "logs")
    assert failed.value.code == 65
    kept = ObjectStore().read_bytes(join(layout(run.root, run.run_id).logs("import"), "import-0.log")).decode()
    assert kept.splitlines() == ["running dflash_tokenize import-prompts (shard 0)",
                                 "quality gate: 9 of 10 conversations are empty",
                                 "pod-log: dflash_tokenize exited 65 (BAD_INPUT)"]
    assert kept == (tmp_path / "logs" / "import-0.log").read_text()
    (log,), notes = collect_logs(run, ObjectStore(), "import")
    assert (log.stage, log.pod, notes) == ("import", "import-0", [])


@pytest.mark.parametrize(("environment", "expected"), [("http://127.0.0.1:9", "http://127.0.0.1:9"),
                                                       (None, "http://run-file-store:9000")])
def test_the_environments_store_endpoint_wins_for_the_stages_as_for_every_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, environment: str | None, expected: str) -> None:
    """A port-forward to the store (AWS_ENDPOINT_URL) reaches the stages too, not only this process; without one
    the stages get the run file's endpoint."""
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = str(tmp_path / "store")
    data["storage"] = {**data.get("storage", {}), "endpoint_url": "http://run-file-store:9000"}
    run = parse_run_config(data)
    if environment is None:
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", environment)
    python = tmp_path / "repo" / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "endpoint $AWS_ENDPOINT_URL"\nexit 65\n')
    python.chmod(0o755)
    with pytest.raises(StageFailedError):
        run_local(run, tmp_path / "repo", environments=dict.fromkeys(IMAGE_ENVIRONMENTS, "env"), only=["import"],
                  console=Console(io.StringIO(), is_tty=False), log_dir=tmp_path / "logs")
    assert (tmp_path / "logs" / "import-0.log").read_text().splitlines()[0] == f"endpoint {expected}"


def test_a_committed_stage_is_skipped_naming_each_setting_the_run_file_now_gives_otherwise(tmp_path: Path) -> None:
    """A run file changed after a stage committed its output does not redo the stage: the console says which of
    the settings given now its manifest recorded otherwise, and how to redo it; settings it did not record, and
    the unchanged ones, are not named."""
    data = read_run_file(EXAMPLE_RUN)
    data["root"] = str(tmp_path / "store")
    data["stages"]["train"]["config"] = {"max_length": 8192, "max_steps": 707, "drafter_overrides": {"num_layers": 3}}
    run = parse_run_config(data)
    stage = next(s for s in plan(run) if s.name == "train")
    manifest = stage.output_manifest(layout(run.root, run.run_id))
    given = stage_config(stage, run, run.stages.for_stage("train"))
    recorded = {**given, "max_steps": 400, "drafter_overrides": {"num_layers": 5}}
    recorded.pop("max_length")  # recorded before the setting existed: not compared
    ObjectStore().write_bytes(manifest, json.dumps({"producer": {"config": recorded}}).encode())
    out = io.StringIO()
    done = run_local(run, tmp_path / "repo", only=["train"], console=Console(out, is_tty=False),
                     log_dir=tmp_path / "logs")
    assert [(r.stage, r.skipped) for r in done] == [("train", True)]
    said = out.getvalue()
    assert "train: complete, skipped" in said
    assert ('train: its committed output was made with other settings than the run file gives now '
            '(drafter_overrides {"num_layers": 5} there, {"num_layers": 3} now; max_steps 400 there, 707 now)') in said
    assert f"delete {manifest.rsplit('/', 1)[0]} and the later stages' outputs, which were made from it" in said
    # The same settings: skipped without a word about them.
    ObjectStore().write_bytes(manifest, json.dumps({"producer": {"config": given}}).encode())
    out = io.StringIO()
    run_local(run, tmp_path / "repo", only=["train"], console=Console(out, is_tty=False), log_dir=tmp_path / "logs")
    assert "complete, skipped" in out.getvalue() and "other settings" not in out.getvalue()
