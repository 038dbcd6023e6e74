"""Operations layer: exit codes through the real entrypoint wrapper, log format, progress lines, settings."""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import SettingsConfigDict

import dflash_shared.exit_codes as exit_codes_module
from dflash_shared.errors import ConfigError, exit_code_for
from dflash_shared.exit_codes import ExitCode
from dflash_shared.logs import redact, setup_logging
from dflash_shared.manifest_io import ManifestError
from dflash_shared.progress import Progress
from dflash_shared.settings import StageSettings, parse_settings, public_dict, settings_reference_markdown
from dflash_shared.storage import ObjectNotFoundError, StorageError

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCY-EXAMPLEKEY"

# ---------------------------------------------------------------------- exit codes, in real processes

STAGE_SCRIPT = textwrap.dedent(
    """
    import errno, os, sys, time
    from dflash_shared.cli import run_stage_main
    from dflash_shared.errors import BadInputError, ConfigError, PreflightError
    from dflash_shared.logs import setup_logging

    # Heavy modules are imported only by the cases that need them, to keep the many processes quick.
    def fn():
        setup_logging("demo", shard=7, level=os.environ.get("LEVEL", "INFO"))
        kind = sys.argv[1]
        if kind == "ok":
            return None
        if kind == "own_code":
            return 3
        if kind == "bad_input":
            raise BadInputError("2 of 10 records failed the quality gate",
                                counts={"empty_completion": 2}, examples={"empty_completion": ["rec-4", "rec-9"]})
        if kind == "manifest":
            from dflash_shared.manifest_io import ManifestError
            raise ManifestError("s3://b/c/manifest.json", "schema_version is 2, this build reads 1", "schema_version")
        if kind == "config":
            raise ConfigError("unknown flag(s) --max-lenght")
        if kind == "validation":
            from pydantic import BaseModel
            class Limits(BaseModel):
                max_length: int
            Limits(max_length="many")
        if kind == "preflight":
            raise PreflightError("need 8 GPU(s), found 0")
        if kind == "storage":
            from dflash_shared.storage import StorageError
            raise StorageError("S3 get_object failed for s3://b/k: SlowDown")
        if kind == "unexpected":
            raise RuntimeError("boom with " + os.environ["AWS_SECRET_ACCESS_KEY"])
        if kind == "permission":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/out/data")
        if kind == "read_only":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), "/out")
        if kind == "wrapped_access":
            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/scratch/part")
            except OSError as err:
                raise RuntimeError("could not publish the shard") from err
        if kind == "sigterm":
            try:
                print("ready", flush=True)  # inside the try: a signal right after it must still unwind
                time.sleep(60)
            finally:
                print("committed", flush=True)
        raise AssertionError(kind)

    run_stage_main("demo", fn)
    """
)

CASES = {
    # case: (exit code, text the single error line must contain)
    "ok": (ExitCode.OK, None),
    "own_code": (3, None),
    "bad_input": (ExitCode.BAD_INPUT, "demo failed, exit 65 (BAD_INPUT): 2 of 10 records failed the quality gate"),
    "manifest": (ExitCode.BAD_INPUT, "exit 65 (BAD_INPUT): manifest s3://b/c/manifest.json: schema_version is 2"),
    "config": (ExitCode.USAGE, "demo failed, exit 64 (USAGE): unknown flag(s) --max-lenght"),
    "validation": (ExitCode.USAGE, "exit 64 (USAGE): invalid Limits: max_length: Input should be a valid integer"),
    "preflight": (ExitCode.ENVIRONMENT, "demo failed, exit 69 (ENVIRONMENT): need 8 GPU(s), found 0"),
    "storage": (ExitCode.RETRYABLE, "demo failed, exit 1 (RETRYABLE): S3 get_object failed for s3://b/k: SlowDown"),
    "unexpected": (ExitCode.RETRYABLE,
                   "demo failed, exit 1 (RETRYABLE): unexpected failure (traceback at DEBUG level): boom with ***"),
    # Plain words, no class name nor errno: the path and what the system said.
    "permission": (ExitCode.ENVIRONMENT, "demo failed, exit 69 (ENVIRONMENT): cannot use /out/data: permission denied"),
    "read_only": (ExitCode.ENVIRONMENT, "exit 69 (ENVIRONMENT): cannot use /out: read-only file system"),
    "wrapped_access": (ExitCode.ENVIRONMENT, "exit 69 (ENVIRONMENT): could not publish the shard"),
}


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    """Every case run once as its own process, all started together to keep the wall time low."""
    root = tmp_path_factory.mktemp("stage")
    script = root / "stage.py"
    script.write_text(STAGE_SCRIPT)
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": SECRET}
    procs = {}
    for case in [*CASES, "unexpected_debug"]:
        termination_log = root / f"{case}.termination-log"
        termination_log.write_text("")
        level = "DEBUG" if case == "unexpected_debug" else "INFO"
        case_env = {**env, "LEVEL": level, "DFLASH_TERMINATION_LOG": str(termination_log)}
        argv = [sys.executable, str(script), case.removesuffix("_debug")]
        procs[case] = subprocess.Popen(argv, env=case_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for case, proc in procs.items():
        _out, err = proc.communicate(timeout=60)
        results[case] = (proc.returncode, err, (root / f"{case}.termination-log").read_text())
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_exit_code_and_error_line(stage_runs: dict[str, tuple[int, str, str]], case: str) -> None:
    code, stderr, termination = stage_runs[case]
    want_code, want_line = CASES[case]
    assert code == want_code, stderr
    errors = [line for line in stderr.splitlines() if " ERROR " in line]
    assert SECRET not in stderr
    assert "Traceback" not in stderr
    if want_line is None:
        assert errors == []
        return
    assert re.match(r"\S+Z ERROR \[demo shard=7\] dflash.cli: demo failed, exit ", errors[0]), errors[0]
    assert want_line in errors[0]
    assert termination.startswith(f"exit {int(want_code)} (")
    if case == "bad_input":
        assert errors[1].endswith("empty_completion: 2 record(s), e.g. rec-4; rec-9")
    else:
        assert len(errors) == 1, stderr


def test_traceback_only_at_debug(stage_runs: dict[str, tuple[int, str, str]]) -> None:
    code, stderr, _ = stage_runs["unexpected_debug"]
    assert code == ExitCode.RETRYABLE
    assert "DEBUG [demo shard=7] dflash.cli: traceback of the failure above" in stderr
    assert 'raise RuntimeError("boom with " + os.environ["AWS_SECRET_ACCESS_KEY"])' in stderr
    # The traceback quotes source lines, not values; the value in the message stays redacted.
    assert SECRET not in stderr


def test_sigterm_unwinds_and_exits_75(tmp_path: Path) -> None:
    script = tmp_path / "stage.py"
    script.write_text(STAGE_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), "sigterm"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == ExitCode.PREEMPTED, err
    assert out == "committed\n"  # the finally block ran before the exit
    assert "demo stopped: SIGTERM received; exit 75 (PREEMPTED), a rerun resumes" in err


def test_storage_failure_behind_a_manifest_error_is_retryable() -> None:
    def manifest_error(cause: StorageError) -> ManifestError:
        try:
            raise ManifestError("s3://b/manifest.json", "cannot be read") from cause
        except ManifestError as err:
            return err

    assert exit_code_for(manifest_error(StorageError("SlowDown"))) is ExitCode.RETRYABLE
    assert exit_code_for(manifest_error(ObjectNotFoundError("no object"))) is ExitCode.BAD_INPUT


def test_docstring_table_matches_the_enum() -> None:
    doc = exit_codes_module.__doc__ or ""
    rows = re.findall(r"^(\d+)\s+([A-Z_]+)\s", doc, flags=re.M)
    assert {name: int(value) for value, name in rows} == {c.name: c.value for c in ExitCode}
    assert [c for c in ExitCode if c.retryable] == [ExitCode.RETRYABLE, ExitCode.ENVIRONMENT, ExitCode.PREEMPTED]


# ---------------------------------------------------------------------- logging


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_log_format_and_idempotence(root_logger: logging.Logger, capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("tokenize")
    setup_logging("tokenize", shard=3, rank=0)
    logging.getLogger("dflash_tokenize.runner").info("wrote shard %d", 3)
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ INFO \[tokenize shard=3 rank=0\] dflash_tokenize.runner: wrote shard 3\n", err
    ), err
    assert sum(1 for h in root_logger.handlers if getattr(h, "_dflash_handler", False)) == 1


def test_nonzero_ranks_log_warnings_only(root_logger: logging.Logger, capsys: pytest.CaptureFixture[str]) -> None:
    log = setup_logging("train", rank=3)
    log.info("step 10 loss 2.1")
    log.warning("loss spike at step 11")
    err = capsys.readouterr().err
    assert "step 10" not in err
    assert "WARNING [train rank=3] dflash.train: loss spike at step 11" in err
    with pytest.raises(ValueError, match="unknown log level 'LOUD'"):
        setup_logging("train", level="LOUD")


def test_secrets_are_redacted(
    root_logger: logging.Logger, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", "FwoGZXIvYXdzEJr-session-token")
    assert redact(f"sig={SECRET}&t=FwoGZXIvYXdzEJr-session-token") == "sig=***&t=***"
    setup_logging("generate").error("request failed: %s", f"Credential={SECRET}")
    err = capsys.readouterr().err
    assert "request failed: Credential=***" in err
    assert SECRET not in err


# ---------------------------------------------------------------------- progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_log_lines(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger="dflash.progress"):
        with Progress(2_000_000, "records", "tokenize", interval_s=30, is_tty=False, clock=clock) as bar:
            clock.now += 10
            bar.update(456_000, tokens=780_000)
            clock.now += 20
            bar.update(912_000, tokens=1_560_000)
            clock.now += 10
            bar.update(632_000, tokens=100_000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "progress tokenize: 1,368,000/2,000,000 records (68.4%), 45.6 krec/s, tokens 2.34M (78 k/s), ETA 0:00:14",
        "done tokenize: 2,000,000 records in 0:00:40, 50 krec/s, tokens 2.44M (61 k/s)",
    ]


def test_progress_without_total_and_on_error(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger="dflash.progress"), pytest.raises(RuntimeError):
        with Progress(None, "shards", "upload", interval_s=5, is_tty=False, clock=clock) as bar:
            clock.now += 6
            bar.update(3)
            raise RuntimeError("disk full")
    assert [r.getMessage() for r in caplog.records] == [
        "progress upload: 3 shards, 0.5 shards/s",
        "stopped upload: 3 shards in 0:00:06, 0.5 shards/s (by the error below)",
    ]


def test_progress_live_line_on_a_tty(caplog: pytest.LogCaptureFixture) -> None:
    clock, stream = FakeClock(), io.StringIO()
    with caplog.at_level(logging.INFO, logger="dflash.progress"):
        with Progress(100, "records", "eval", stream=stream, is_tty=True, clock=clock) as bar:
            for _ in range(10):
                clock.now += 0.125
                bar.update(10)
    text = stream.getvalue()
    frames = text.split("\r")[1:]
    # Redrawn every 0.2 s, never more often; one newline, at the end.
    assert len(frames) == 6
    assert frames[0] == "progress eval: 20/100 records (20.0%), 80 rec/s, ETA 0:00:01"
    assert text.count("\n") == 1 and text.endswith("\n")
    assert frames[-1] == "progress eval: 100/100 records (100.0%), 80 rec/s, ETA 0:00:00\n"
    assert [r.getMessage() for r in caplog.records] == ["done eval: 100 records in 0:00:01, 80 rec/s"]


def test_disabled_progress_counts_silently(caplog: pytest.LogCaptureFixture) -> None:
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="dflash.progress"):
        with Progress(10, "records", "x", interval_s=0, stream=stream, is_tty=True, enabled=False) as bar:
            bar.update(4, tokens=9)
    assert (bar.n, bar.extra) == (4, {"tokens": 9})
    assert stream.getvalue() == ""
    assert caplog.records == []


# ---------------------------------------------------------------------- settings


class DemoConfig(StageSettings):
    """A stand-in stage config."""

    model_config = SettingsConfigDict(env_prefix="DFLASH_DEMO_")

    input_uri: str = Field(description="Prefix to read.")
    workers: int = Field(default=4, gt=0, description="Worker threads.")
    mode: Literal["token_exact", "render"] = Field(default="token_exact", description="How ids are made.")
    resume: bool = Field(default=False, description="Skip finished shards.")
    sources: list[str] = Field(default_factory=list, description="Extra sources.")
    hf_token: str | None = Field(default=None, description="Hub token (should come from the environment).")
    signing_key: SecretStr | None = Field(default=None, description="A secret value.")


@pytest.fixture
def demo_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in list(os.environ):
        if key.startswith("DFLASH_DEMO_"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_flag_over_env_over_default(demo_env: pytest.MonkeyPatch) -> None:
    assert parse_settings(DemoConfig, ["--input-uri", "s3://b/in"]).workers == 4
    demo_env.setenv("DFLASH_DEMO_WORKERS", "8")
    assert parse_settings(DemoConfig, ["--input-uri", "s3://b/in"]).workers == 8
    config = parse_settings(
        DemoConfig, ["--input-uri", "s3://b/in", "--workers", "16", "--resume", "--sources", "a", "--sources", "b"]
    )
    assert (config.workers, config.resume, config.sources) == (16, True, ["a", "b"])
    demo_env.setenv("DFLASH_DEMO_INPUT_URI", "/data/in")
    assert parse_settings(DemoConfig, []).input_uri == "/data/in"
    with pytest.raises(ValidationError, match="frozen"):
        config.workers = 2


def test_unknown_flag_is_refused(demo_env: pytest.MonkeyPatch) -> None:
    expected = r"unknown flag\(s\) --wokers \(did you mean --workers\?\); DemoConfig accepts --input-uri, --workers"
    with pytest.raises(ConfigError, match=expected):
        parse_settings(DemoConfig, ["--input-uri", "x", "--wokers", "3"])
    # Prefixes of real flags are refused too: `--work 3` must not silently mean `--workers 3`.
    with pytest.raises(ConfigError, match="--work"):
        parse_settings(DemoConfig, ["--input-uri", "x", "--work", "3"])


def test_unknown_env_var_with_the_prefix_is_refused(demo_env: pytest.MonkeyPatch) -> None:
    demo_env.setenv("DFLASH_DEMO_WORKRS", "3")
    expected = r"unknown environment variable.s. DFLASH_DEMO_WORKRS \(did you mean DFLASH_DEMO_WORKERS\?\); DemoConfig"
    with pytest.raises(ConfigError, match=expected):
        parse_settings(DemoConfig, ["--input-uri", "x"])


def test_invalid_and_missing_values_name_flag_and_env_var(demo_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ConfigError, match=r"missing required setting input_uri \(--input-uri / DFLASH_DEMO_INPUT_URI\)"
    ):
        parse_settings(DemoConfig, [])
    demo_env.setenv("DFLASH_DEMO_WORKERS", "0")
    with pytest.raises(ConfigError, match=r"invalid workers \(--workers / DFLASH_DEMO_WORKERS\): .*greater than 0"):
        parse_settings(DemoConfig, ["--input-uri", "x"])


def test_reference_table_and_public_dict(demo_env: pytest.MonkeyPatch) -> None:
    table = settings_reference_markdown(DemoConfig).splitlines()
    assert table[0] == "| Setting | Type | Default | Environment variable | Description |"
    assert table[2] == "| `--input-uri` | `str` | required | `DFLASH_DEMO_INPUT_URI` | Prefix to read. |"
    assert table[4] == (
        "| `--mode` | `'token_exact' \\| 'render'` | `'token_exact'` | `DFLASH_DEMO_MODE` | How ids are made. |"
    )
    assert len(table) == 2 + len(DemoConfig.model_fields)

    demo_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    config = parse_settings(
        DemoConfig, ["--input-uri", f"s3://b/in?sig={SECRET}", "--hf-token", "hf_abcdef", "--signing-key", "pw"]
    )
    public = public_dict(config)
    assert public["input_uri"] == "s3://b/in?sig=***"
    assert public["hf_token"] == "***"
    assert public["signing_key"] == "**********"
    assert public["workers"] == 4


def test_settings_class_without_prefix_is_a_programming_error() -> None:
    class NoPrefix(StageSettings):
        value: int = Field(default=1, description="A value.")

    with pytest.raises(TypeError, match="must set model_config env_prefix"):
        parse_settings(NoPrefix, [])
