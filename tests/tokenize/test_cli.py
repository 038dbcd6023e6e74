"""`dflash-tokenize` as an operator runs it: exit codes, one-line errors, import -> run, kill -9 and rerun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_shared.storage import ObjectStore
from tests.support import exit_policy
from tests.support.qwen_assets import shared_tokenizer_dir
from tests.tokenize.stage_fixtures import completion, conversation, write_completions

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_TOKENIZE_")}
    return subprocess.run([sys.executable, "-m", "dflash_tokenize", *args], capture_output=True, text=True,
                          timeout=timeout, env={**clean, **(env or {})}, cwd=REPO, check=False)


@pytest.fixture(scope="module")
def tok() -> str:
    return str(shared_tokenizer_dir("qwen3"))


def test_no_command_is_a_usage_error() -> None:
    proc = cli()
    assert proc.returncode == 64 and "usage: dflash-tokenize {import|preflight|run}" in proc.stderr


def test_unknown_flag_names_the_flag(tmp_path: Path, tok: str) -> None:
    proc = cli("run", "--input", str(tmp_path), "--output", str(tmp_path / "o"), "--tokenizer", tok,
               "--max-lenght", "10")
    assert proc.returncode == 64
    assert "--max-lenght" in proc.stderr


def test_misspelled_env_var_is_refused(tmp_path: Path, tok: str) -> None:
    proc = cli("run", env={"DFLASH_TOKENIZE_INPUT": str(tmp_path), "DFLASH_TOKENIZE_OUTPUT": str(tmp_path / "o"),
                           "DFLASH_TOKENIZE_TOKENISER": tok})
    assert proc.returncode == 64
    assert "DFLASH_TOKENIZE_TOKENISER" in proc.stderr


def test_import_preflight_run(tmp_path: Path, tok: str, store: ObjectStore) -> None:
    source = tmp_path / "external"
    source.mkdir()
    lines = [{"messages": [{"role": "user", "content": f"Explain idea {i} briefly."},
                           {"role": "assistant",
                            "content": f"<think>\nIdea {i} needs a short plan.\n</think>\n\nIdea {i} means "
                                       "that each part is checked before the next one starts."}]}
             for i in range(30)]
    (source / "a.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    completions, tokenized = str(tmp_path / "completions"), str(tmp_path / "tokenized")
    proc = cli("import", "--source", str(source), "--output", completions)
    assert proc.returncode == 0, proc.stderr
    args = ["--input", completions, "--output", tokenized, "--tokenizer", tok]
    proc = cli("preflight", *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("preflight tokenize OK") == 5
    proc = cli("run", *args)
    assert proc.returncode == 0, proc.stderr
    manifest = load_manifest(store, tokenized, Kind.tokenized).manifest
    assert manifest.accounting.succeeded == 30
    assert manifest.section.mode == "render"  # type: ignore[union-attr]
    # A rerun finds the stage complete and changes nothing.
    before = (Path(tokenized) / "manifest.json").read_bytes()
    assert cli("run", *args).returncode == 0
    assert (Path(tokenized) / "manifest.json").read_bytes() == before


def test_gate_failure_exits_65_with_a_report(tmp_path: Path, tok: str, store: ObjectStore) -> None:
    records = [completion(conversation(i, answer="" if i % 10 else None)) for i in range(50)]
    src = write_completions(store, str(tmp_path / "c"), records)
    proc = cli("run", "--input", src, "--output", str(tmp_path / "t"), "--tokenizer", tok)
    assert proc.returncode == 65
    assert "45 of 50 records are unusable (90.0%)" in proc.stderr
    assert "empty_response: 45" in proc.stderr


def test_a_gate_failure_names_the_settings_that_change_the_verdict(tmp_path: Path, tok: str,
                                                                   store: ObjectStore) -> None:
    # Ordinary chat data without reasoning, tokenized with the import default (thinking on).
    records = [completion(conversation(i, thinking=False)) for i in range(12)]
    src = write_completions(store, str(tmp_path / "c"), records)
    proc = cli("run", "--input", src, "--output", str(tmp_path / "t"), "--tokenizer", tok)
    assert proc.returncode == 65
    assert "thinking_missing: 12" in proc.stderr
    assert "--enable-thinking false / DFLASH_TOKENIZE_ENABLE_THINKING=false" in proc.stderr
    assert "--max-bad-fraction <fraction> / DFLASH_TOKENIZE_MAX_BAD_FRACTION=<fraction>" in proc.stderr
    fixed = cli("run", "--input", src, "--output", str(tmp_path / "t"), "--tokenizer", tok, "--enable-thinking",
                "false")
    assert fixed.returncode == 0, fixed.stderr[-2000:]


def test_preflight_reports_every_broken_check(tmp_path: Path) -> None:
    proc = cli("preflight", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "o"),
               "--tokenizer", str(tmp_path / "no-tokenizer"), "--disk-need-gib", "100000")
    assert proc.returncode in (65, 69)
    for check in ("disk", "tokenizer", "input_manifest"):
        assert f"preflight tokenize FAIL {check}" in proc.stderr
    assert "Traceback" not in proc.stderr


def published(out: Path) -> list[Path]:
    return sorted((out / "data").glob("*.arrow")) if (out / "data").exists() else []


def normalized(out: Path) -> dict[str, bytes]:
    """Every file under a prefix with the prefix itself masked, and the manifest's timestamp dropped."""
    files = {}
    for path in sorted(out.rglob("*")):
        if path.is_file():
            data = path.read_bytes().replace(str(out).encode(), b"<OUT>")
            if path.name == "manifest.json":
                doc = json.loads(data)
                doc.pop("created_at")
                data = json.dumps(doc, sort_keys=True).encode()
            files[str(path.relative_to(out))] = data
    return files


@pytest.mark.slow
def test_kill_9_mid_run_then_rerun_is_identical(tmp_path: Path, tok: str, store: ObjectStore) -> None:
    records = [completion(conversation(i)) for i in range(2400)]
    src = write_completions(store, str(tmp_path / "c"), records, shards=4)
    args = ["--tokenizer", tok, "--shard-bytes", str(48 * 1024), "--batch-records", "16", "--workers", "1",
            "--run-id", "fixed"]
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    assert cli("run", "--input", src, "--output", str(clean), *args).returncode == 0

    proc = subprocess.Popen([sys.executable, "-m", "dflash_tokenize", "run", "--input", src, "--output",
                             str(crashed), *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(published(crashed)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed; make the input larger"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (crashed / "manifest.json").exists()
    assert 2 <= len(published(crashed)) < len(published(clean))

    assert cli("run", "--input", src, "--output", str(crashed), *args).returncode == 0
    assert normalized(crashed) == normalized(clean)
    manifest = load_manifest(store, str(crashed), Kind.tokenized).manifest
    ids = [row for shard in manifest.shards for row in [shard.records]]
    assert sum(ids) == 2400 == manifest.accounting.succeeded


@pytest.mark.parametrize("case", exit_policy.CASES)
@pytest.mark.parametrize("command", ["import", "run"])
def test_unusable_storage_exits_69_in_run_as_in_preflight(
    command: str, case: str, tok: str, s3_bucket: str, store: ObjectStore
) -> None:
    bucket = exit_policy.bucket_for(case, s3_bucket)
    if command == "import":
        args = ["import", "--source", f"{bucket}/external", "--output", f"{bucket}/completions"]
    else:
        write_completions(store, f"{s3_bucket}/completions", [completion(conversation(0))])
        args = ["run", "--input", f"{bucket}/completions", "--output", f"{bucket}/tokenized", "--tokenizer", tok]
    proc = exit_policy.run_case([sys.executable, "-m", "dflash_tokenize", *args], case, REPO)
    exit_policy.assert_environment_exit(proc, case)


def test_workers_die_with_a_killed_stage(tmp_path: Path, tok: str, store: ObjectStore) -> None:
    psutil = pytest.importorskip("psutil")
    src = write_completions(store, str(tmp_path / "c"), [completion(conversation(i)) for i in range(4000)], shards=4)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_tokenize", "run", "--input", src, "--output",
                             str(tmp_path / "out"), "--tokenizer", tok, "--workers", "2", "--batch-records", "16"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stage = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    while len(stage.children()) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = stage.children()
    assert len(workers) >= 2 and proc.poll() is None, "the pool did not start before the run ended"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, f"workers outlived the killed stage: {[p.pid for p in alive]}"
