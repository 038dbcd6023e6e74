"""The local run's console: the project's own lines reach the person, engines' and installers' go to the log."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from dflash_pipeline.local.console import Console, classify, run_logged

OWN = "2026-12-01T12:25:05Z {level} [tokenize shard=0] {logger}: {message}"


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (OWN.format(level="WARNING", logger="dflash_tokenize.stage", message="3 records over max_length"), "show"),
        (OWN.format(level="WARNING", logger="vllm.triton_utils.importing", message="Triton lacks a CPU backend"),
         "log"),
        (OWN.format(level="ERROR", logger="vllm.engine", message="engine core died"), "show"),
        (OWN.format(level="ERROR", logger="dflash.cli", message="tokenize run failed, exit 65"), "show"),
        (OWN.format(level="INFO", logger="dflash.preflight", message="preflight tokenize: all 5 check(s) passed"),
         "show"),
        (OWN.format(level="INFO", logger="dflash.preflight", message="preflight tokenize OK disk: 33 GiB free"), "log"),
        (OWN.format(level="INFO", logger="dflash_shared.runner", message="[finalize x] wrote manifest x/m.json"),
         "show"),
        (OWN.format(level="INFO", logger="dflash_shared.runner", message="[tokenize 0/1] published x (65 records)"),
         "log"),
        (OWN.format(level="INFO", logger="dflash.progress", message="progress tokenize: 10/80 rec (12.5%), ETA 0:01"),
         "progress"),
        (OWN.format(level="INFO", logger="dflash_train.training.metrics",
                    message="step 3/48 (6%) loss 10.3 ETA 0:02:00"),
         "progress"),
        ("(MainProcess pid=26127) INFO 12-01 12:25:00 [core_client.py:774] MPClient: engine manager stopped", "log"),
        ("Loading weights: 100%|██████████| 46/46 [00:00<00:00, 1605.82it/s]", "log"),
        ("  warnings.warn('resource_tracker: There appear to be %d '", "log"),
    ],
)
def test_classify(line: str, kind: str) -> None:
    assert classify(line) == kind


def test_progress_shares_one_live_line_on_a_terminal() -> None:
    out = io.StringIO()
    console = Console(out, is_tty=True)
    for n in (1, 2, 3):
        console.feed(OWN.format(level="INFO", logger="dflash.progress", message=f"progress tokenize: {n}/3 rec"))
    console.feed(OWN.format(level="WARNING", logger="dflash_tokenize.stage", message="careful"))
    console.close()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 2  # the live line ends before the warning
    assert "progress tokenize: 3/3 rec" in text and console.lines_shown == 2


def test_progress_lines_are_thinned_out_elsewhere_and_verbose_passes_everything() -> None:
    out = io.StringIO()
    console = Console(out, is_tty=False)
    for step in range(1, 49):  # a training run logging a step a moment: one line now, the next after 10 s
        console.feed(OWN.format(level="INFO", logger="dflash_train.training.metrics",
                                message=f"step {step}/48 loss 9.1"))
    console.feed("(MainProcess pid=1) INFO engine noise")
    assert out.getvalue().count("\n") == 1 and "step 1/48" in out.getvalue() and "\r" not in out.getvalue()
    verbose = io.StringIO()
    Console(verbose, verbose=True, is_tty=False).feed("(MainProcess pid=1) INFO engine noise")
    assert verbose.getvalue() == "(MainProcess pid=1) INFO engine noise\n"


def test_run_logged_keeps_everything_in_the_log_and_shows_its_tail_on_failure(tmp_path: Path) -> None:
    script = "; ".join([
        "import sys",
        "print('engine: loading 1,000 things')",
        f"print({OWN.format(level='INFO', logger='dflash_shared.runner', message='wrote manifest m.json')!r})",
        "print('Traceback: the real cause', file=sys.stderr)",
        "sys.exit(65)",
    ])
    out = io.StringIO()
    log = tmp_path / "logs" / "tokenize-0.log"
    console = Console(out, is_tty=False)
    code = run_logged([sys.executable, "-c", script], {"PYTHONUNBUFFERED": "1"}, tmp_path, log, console)
    assert code == 65
    logged = log.read_text()
    assert "engine: loading" in logged and "wrote manifest" in logged and "the real cause" in logged
    shown = out.getvalue().splitlines()
    assert shown[0].endswith("wrote manifest m.json")
    assert f"--- last 3 lines of {log} ---" in shown and "Traceback: the real cause" in shown
