"""`dflash-tokenize` as an operator runs it: exit codes, one-line errors, import -> run, kill -9 and rerun."""

from __future__ import annotations

import json
import os
import re
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
    assert proc.returncode == 64 and "usage: dflash-tokenize {import|import-prompts|preflight|run}" in proc.stderr


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


@pytest.mark.slow
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
    tried = re.search(r"tried on (\d+) rejected record\(s\): (\d+) become usable", proc.stderr)
    assert tried and tried.group(1) == tried.group(2), proc.stderr[-2000:]
    # Every record is unusable: accepting more bad records is no way out, so it is not offered.
    assert "--max-bad-fraction" not in proc.stderr
    fixed = cli("run", "--input", src, "--output", str(tmp_path / "t"), "--tokenizer", tok, "--enable-thinking",
                "false")
    assert fixed.returncode == 0, fixed.stderr[-2000:]


def test_preflight_reports_every_broken_check(tmp_path: Path) -> None:
    proc = cli("preflight", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "o"),
               "--tokenizer", str(tmp_path / "no-tokenizer"), "--disk-need-gib", "100000")
    assert proc.returncode == 64  # the wrong tokenizer path is the setting to fix first
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
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args = ["--tokenizer", tok, "--shard-bytes", str(48 * 1024), "--batch-records", "16", "--workers", "1",
            "--run-id", "fixed", "--scratch-dir", str(scratch)]
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

    assert len(os.listdir(scratch)) == 1  # what kill -9 left behind
    rerun = cli("run", "--input", src, "--output", str(crashed), *args)
    assert rerun.returncode == 0
    assert "removed 1 scratch directory left by earlier runs that were killed" in rerun.stderr
    assert os.listdir(scratch) == []
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


@pytest.mark.slow
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


def unwritable(tmp_path: Path) -> str:
    """An output location this process may not write to, even as root (sysfs refuses new entries)."""
    target = Path("/sys/dflash-test-output")
    try:
        target.mkdir()
    except PermissionError:
        return str(target / "out")
    except OSError:
        pass
    target.rmdir() if target.exists() else None
    if os.geteuid() == 0:
        pytest.skip("no location here refuses writes to root")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    return str(locked / "out")


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if " ERROR " in line]


@pytest.mark.parametrize("case", ["missing", "no_tokenizer_json"])
def test_a_wrong_tokenizer_path_is_a_usage_error_before_any_record(case: str, tmp_path: Path,
                                                                     store: ObjectStore) -> None:
    src = write_completions(store, str(tmp_path / "c"), [completion(conversation(i)) for i in range(3)])
    tok = tmp_path / "tok"
    if case == "no_tokenizer_json":
        tok.mkdir()
    proc = cli("run", "--input", src, "--output", str(tmp_path / "t"), "--tokenizer", str(tok))
    assert proc.returncode == 64, proc.stderr
    (line,) = error_lines(proc)
    assert f"tokenizer directory {tok} {'does not exist' if case == 'missing' else 'has no tokenizer.json'}" in line
    assert "Error" not in line  # no exception class names
    assert "processing" not in proc.stderr and not (tmp_path / "t" / "data").exists()


@pytest.mark.parametrize("command", ["import", "run"])
def test_an_unwritable_output_is_an_environment_error_before_any_record(command: str, tmp_path: Path, tok: str,
                                                                          store: ObjectStore) -> None:
    out = unwritable(tmp_path)
    if command == "import":
        source = tmp_path / "external"
        source.mkdir()
        (source / "a.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi?"},
                                                               {"role": "assistant", "content": "Hello."}]}) + "\n")
        proc = cli("import", "--source", str(source), "--output", out)
    else:
        src = write_completions(store, str(tmp_path / "c"), [completion(conversation(i)) for i in range(3)])
        proc = cli("run", "--input", src, "--output", out, "--tokenizer", tok)
    assert proc.returncode == 69, proc.stderr
    (line,) = error_lines(proc)
    assert f"the output {out} cannot be written: cannot use " in line
    assert "Errno" not in line and "PermissionError" not in line
    assert "processing" not in proc.stderr  # found before any record was read


def test_a_missing_import_source_is_a_usage_error(tmp_path: Path) -> None:
    proc = cli("import", "--source", str(tmp_path / "nowhere"), "--output", str(tmp_path / "c"))
    assert proc.returncode == 64, proc.stderr
    assert f"source {tmp_path / 'nowhere'} does not exist" in error_lines(proc)[0]


def test_a_successful_import_says_what_it_left_out(tmp_path: Path) -> None:
    source = tmp_path / "external"
    source.mkdir()
    good = [json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                     {"role": "assistant", "content": f"Answer {i}."}]}) for i in range(39)]
    (source / "a.jsonl").write_text("\n".join([*good[:16], "{not json", *good[16:]]) + "\n")
    proc = cli("import", "--source", str(source), "--output", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "left out" in x]
    assert f"left out 1 of 40 records: malformed_record 1 (e.g. {source / 'a.jsonl'}:17: " in line


def test_help_describes_each_command_with_an_example() -> None:
    proc = cli("--help")
    assert proc.returncode == 0
    for command in ("import", "preflight", "run"):
        assert re.search(rf"^  {command} +\S", proc.stdout, re.MULTILINE), proc.stdout
    assert "examples:\n  dflash-tokenize " in proc.stdout and "exit codes: 0 done" in proc.stdout
    sub = cli("run", "--help")
    assert sub.returncode == 0 and "example:\n  dflash-tokenize run --input " in sub.stdout


@pytest.mark.slow
def test_an_interrupted_run_reuses_its_published_files(tmp_path: Path, tok: str, store: ObjectStore) -> None:
    records = [completion(conversation(i)) for i in range(2400)]
    src = write_completions(store, str(tmp_path / "c"), records, shards=4)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args = ["--tokenizer", tok, "--shard-bytes", str(48 * 1024), "--batch-records", "16", "--workers", "1",
            "--run-id", "fixed", "--scratch-dir", str(scratch)]
    clean, stopped = tmp_path / "clean", tmp_path / "stopped"
    assert cli("run", "--input", src, "--output", str(clean), *args).returncode == 0
    proc = subprocess.Popen([sys.executable, "-m", "dflash_tokenize", "run", "--input", src, "--output",
                             str(stopped), *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while len(published(stopped)) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be stopped; make the input larger"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    assert os.listdir(scratch) == []
    # A file whose progress record the signal cut off is rewritten; every recorded one is reused.
    recorded = len(list((stopped / "_progress").rglob("*.json")))
    assert recorded >= len(published(stopped)) - 1 >= 3
    rerun = cli("run", "--input", src, "--output", str(stopped), *args)
    assert rerun.returncode == 0, rerun.stderr
    reused = re.search(r"reusing (\d+) file\(s\) published before the interruption", rerun.stderr)
    assert reused and int(reused.group(1)) == recorded, rerun.stderr
    assert normalized(stopped) == normalized(clean)  # progress records removed, the same bytes as one run
