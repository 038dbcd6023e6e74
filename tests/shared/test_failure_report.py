"""How a stage's failure is reported (dflash_shared.cli.report_failure): one headline naming the stage, the exit
code and the cause; a message of several lines keeps its lines below it."""

from __future__ import annotations

import pytest


def test_a_failure_of_several_lines_is_logged_line_by_line_under_its_headline(caplog: pytest.LogCaptureFixture,
                                                                             ) -> None:
    """A fit refusal carries its plan table: it stays a table, not one line thousands of characters long."""
    import logging

    from dflash_shared.cli import report_failure
    from dflash_shared.errors import ConfigError
    from dflash_shared.exit_codes import ExitCode

    caplog.set_level(logging.ERROR)
    message = "predicted peak memory 91.0 GiB does not fit the 79.0 GiB available\n  term      GiB\n  weights  54.0"
    assert report_failure("train", ConfigError(message)) == ExitCode.USAGE
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["train failed, exit 64 (USAGE): predicted peak memory 91.0 GiB does not fit the 79.0 GiB "
                     "available", "    term      GiB", "    weights  54.0"]
    assert not any(" | " in line for line in lines)
