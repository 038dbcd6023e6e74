"""The commands a person runs beside the cluster: the run file's [storage] endpoint, `wait` on a stage prefix,
`restart` of a stage's output, and their mistakes named with exit 64.

`status`, `plan` and `wait` used to reach only the default AWS endpoint from a laptop (the pods alone got the run
file's storage.endpoint_url), and `wait --manifest PREFIX` waited for an object named like the prefix until it
timed out (exit 65).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.drive.restart import restart_prefixes, restart_stage
from dflash_pipeline.run.config import parse_run_config, read_run_file
from dflash_shared.errors import ConfigError
from dflash_shared.exit_codes import ExitCode
from dflash_shared.manifests import MANIFEST_NAME
from dflash_shared.storage import ObjectStore, join
from tests.pipeline.k8s_support import EXAMPLE_RUN, REPO_ROOT


def run_file(tmp_path: Path, root: str, **changes: Any) -> Path:
    data = read_run_file(EXAMPLE_RUN)
    data.update(root=root, **changes)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def pipeline(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dflash_pipeline", *args], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=120, check=False)


@pytest.mark.slow
def test_laptop_commands_use_the_run_files_endpoint_and_say_so(tmp_path: Path, s3_bucket: str,
                                                               moto_endpoint: str, store: ObjectStore) -> None:
    data = read_run_file(EXAMPLE_RUN)
    path = run_file(tmp_path, f"{s3_bucket}/runs", storage={**data["storage"], "endpoint_url": moto_endpoint},
                    target={**data["target"], "uri": join(s3_bucket, "models", "Qwen3-8B")})
    completions = join(s3_bucket, "other-run", "completions")  # what a script waits for
    store.write_bytes(join(completions, MANIFEST_NAME), b"{}")
    laptop = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}  # only the run file names it
    said = f"S3 endpoint: {moto_endpoint} (from storage.endpoint_url of {path})"
    for args in (("status", "--config", str(path)), ("plan", "--config", str(path)),
                 ("wait", "--config", str(path), "--manifest", completions, "--timeout-seconds", "5",
                  "--poll-seconds", "1")):
        proc = pipeline(*args, env=laptop)
        assert proc.returncode == 0, (args, proc.stderr)
        assert proc.stderr.count(said) == 1, (args, proc.stderr)
        assert "Could not connect" not in proc.stderr and "amazonaws.com" not in proc.stderr
    # The environment's own endpoint wins, and is named as such.
    proc = pipeline("status", "--config", str(path), env=os.environ.copy())
    assert proc.returncode == 0 and f"S3 endpoint: {moto_endpoint} (from AWS_ENDPOINT_URL)" in proc.stderr


@pytest.mark.slow
def test_wait_takes_a_stage_prefix(s3_bucket: str, store: ObjectStore) -> None:
    prefix = join(s3_bucket, "runs", "r1", "completions")
    missing = pipeline("wait", "--manifest", prefix, "--timeout-seconds", "1", "--poll-seconds", "1",
                       env=os.environ.copy())
    assert missing.returncode == ExitCode.BAD_INPUT and f"{prefix}/manifest.json did not appear" in missing.stderr
    store.write_bytes(join(prefix, MANIFEST_NAME), b"{}")
    for given in (prefix, prefix + "/", join(prefix, MANIFEST_NAME)):
        proc = pipeline("wait", "--manifest", given, "--timeout-seconds", "5", "--poll-seconds", "1",
                        env=os.environ.copy())
        assert proc.returncode == 0, (given, proc.stderr)


def outputs(store: ObjectStore, root: str) -> dict[str, list[str]]:
    """Each stage output of the example run under `root`, with a manifest, data, a marker; and a pod's log."""
    found: dict[str, list[str]] = {}
    for folder in ("prompts", "completions", "tokenized", "drafter", "export", "evaluation", "serving"):
        prefix = join(root, "example", folder)
        found[folder] = [join(prefix, MANIFEST_NAME), join(prefix, "data", "part-00000-0000.bin"),
                         join(prefix, "_markers", "shard-00000-of-00001.json")]
        for uri in found[folder]:
            store.write_bytes(uri, b"x")
    store.write_bytes(join(root, "example", "logs", "tokenize", "pod-0.log"), b"kept")
    return found


def test_restart_deletes_the_stage_and_every_later_output(tmp_path: Path) -> None:
    store = ObjectStore()
    root = str(tmp_path / "runs")
    run = parse_run_config({**read_run_file(EXAMPLE_RUN), "root": root})
    made = outputs(store, root)
    assert [stage for stage, _ in restart_prefixes(run, "tokenize")] == [
        "tokenize", "train", "export", "evaluate", "serve-check"]
    dry = restart_stage(store, run, "tokenize", dry_run=True)
    assert [c.objects for c in dry] == [3] * 5 and all(store.exists(u) for uris in made.values() for u in uris)
    restart_stage(store, run, "tokenize")
    for folder, uris in made.items():
        kept = folder in ("prompts", "completions")
        assert [store.exists(u) for u in uris] == [kept] * 3, folder
    assert store.exists(join(root, "example", "logs", "tokenize", "pod-0.log"))  # not a stage output
    with pytest.raises(ConfigError, match="this run has the stages import, generate, tokenize"):
        restart_prefixes(run, "tokenise")


@pytest.mark.slow
def test_restart_and_cancel_from_the_command_line(tmp_path: Path) -> None:
    store = ObjectStore()
    root = str(tmp_path / "runs")
    path = run_file(tmp_path, root)
    made = outputs(store, root)
    proc = pipeline("restart", "--config", str(path), "--stage", "export", env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"deleted 3 object(s) under {join(root, 'example', folder)} ({stage})"
                                        for folder, stage in (("export", "export"), ("evaluation", "evaluate"),
                                                              ("serving", "serve-check"))]
    assert "resume --config" in proc.stderr and store.exists(made["drafter"][0])
    # cancel names its run once: a run file or a run id, not both and not neither (exit 64, not argparse's 2).
    for args in ((), ("example", "--config", str(path))):
        refused = pipeline("cancel", *args, "--dry-run", env=os.environ.copy())
        assert refused.returncode == ExitCode.USAGE, refused.stderr
        assert "cancel: name the run once: --config RUN.toml, or its RUN_ID" in refused.stderr


def test_local_finds_the_stage_environments_in_its_checkout_from_any_directory(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", "import dflash_pipeline.__main__ as m; print(m._checkout())"],
                          cwd=tmp_path, capture_output=True, text=True, check=True)
    assert Path(proc.stdout.strip()) == Path(__file__).resolve().parents[2]
