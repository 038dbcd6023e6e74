"""Progress reports: written off the caller's thread, newest wins, a failure is a warning, the last one is kept."""

from __future__ import annotations

import logging
import threading

import pytest

from dflash_shared.progress_report import BackgroundWriter, Every, read_report, write_report
from dflash_shared.storage import ObjectStore, join


def test_a_slow_write_never_holds_up_the_caller_and_only_the_newest_pending_report_is_written() -> None:
    release, started = threading.Event(), threading.Event()
    written: list[int] = []

    def slow() -> None:
        started.set()
        release.wait(10)
        written.append(0)

    writer = BackgroundWriter("test report")
    writer.submit(slow)
    assert started.wait(10) and not writer.idle
    for n in (1, 2, 3):  # the store is slow: the caller goes on, and each report replaces the one waiting
        writer.submit(lambda n=n: written.append(n))
    release.set()
    writer.close()
    assert written == [0, 3] and writer.idle


def test_a_failed_write_is_one_warning_and_the_next_report_is_written(caplog: pytest.LogCaptureFixture) -> None:
    written: list[str] = []
    writer = BackgroundWriter("train progress report")

    def refused() -> None:
        raise OSError("403 AccessDenied")

    with caplog.at_level(logging.WARNING):
        writer.submit(refused)
        writer.close()
    assert writer.failures == 1
    assert "train progress report: could not write (403 AccessDenied); the stage goes on" in caplog.text
    again = BackgroundWriter("again")
    again.submit(lambda: written.append("next"))
    again.close()
    assert written == ["next"]


def test_every_is_due_at_once_then_once_per_interval() -> None:
    now = [0.0]
    every = Every(300.0, clock=lambda: now[0])
    assert every.due() and not every.due()
    now[0] = 299.0
    assert not every.due()
    now[0] = 300.0
    assert every.due() and not every.due()
    with pytest.raises(ValueError, match="must be positive"):
        Every(0)


def test_a_report_reads_back_and_a_broken_one_is_named(storage_root: str) -> None:
    store = ObjectStore()
    uri = join(storage_root, "drafter", "progress.json")
    assert read_report(store, uri) is None
    write_report(store, uri, {"step": 3, "state": "training"})
    assert read_report(store, uri) == {"step": 3, "state": "training"}
    store.write_bytes(uri, b'{"step": ')
    with pytest.raises(ValueError):
        read_report(store, uri)
    store.write_bytes(uri, b"[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        read_report(store, uri)
