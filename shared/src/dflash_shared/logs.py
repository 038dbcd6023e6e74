"""One log format for every stage, and secret redaction for anything that leaves the process.

Every line carries the stage and, where they apply, the shard and rank, so lines of 1,000 pods can be
merged and still be read::

    2026-11-30T05:10:00Z INFO [tokenize shard=3] dflash_tokenize.runner: wrote shard 3 (12,345 records)

Ranks other than 0 log at WARNING only: N identical progress lines from N data-parallel workers are
noise, while a warning from any rank matters.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

# Values of these variables never appear in a log line or an error message.
SECRET_ENV_VARS = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
)
REDACTED = "***"
# Libraries that log every request at INFO/DEBUG; their detail is available by raising their level.
_CHATTY = ("botocore", "boto3", "s3transfer", "urllib3", "smart_open", "filelock", "werkzeug")
_MARK = "_dflash_handler"


def redact(text: str) -> str:
    """`text` with the values of secret environment variables replaced by '***'."""
    for name in SECRET_ENV_VARS:
        value = os.environ.get(name, "")
        # Very short values would redact ordinary words; real secrets are 16+ characters.
        if len(value) >= 4:
            text = text.replace(value, REDACTED)
    return text


class StageFormatter(logging.Formatter):
    """The stage format, in UTC, with secrets redacted from the finished line (tracebacks included)."""

    converter = staticmethod(time.gmtime)

    def __init__(self, stage: str, shard: int | None = None, rank: int | None = None) -> None:
        tags = [stage]
        if shard is not None:
            tags.append(f"shard={shard}")
        if rank is not None:
            tags.append(f"rank={rank}")
        context = " ".join(tags).replace("%", "%%")
        super().__init__(f"%(asctime)s %(levelname)s [{context}] %(name)s: %(message)s", datefmt="%Y-%m-%dT%H:%M:%SZ")

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def setup_logging(
    stage: str, shard: int | None = None, rank: int | None = None, level: str | int = "INFO"
) -> logging.Logger:
    """Configure the root logger for a stage process; calling it again updates stage/shard/rank.

    Idempotent: one handler (on stderr) is installed and then reconfigured, so a stage can call this
    once early (before its config is parsed) and again once it knows its shard and rank.
    Returns the stage's logger (`dflash.<stage>`).
    """
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, _MARK, False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        setattr(handler, _MARK, True)
        root.addHandler(handler)
    elif isinstance(handler, logging.StreamHandler) and handler.stream is not sys.stderr:
        # stderr was replaced since (a test's capture, a redirect): follow it rather than write to the old one,
        # which may be closed by now (so no flush of it, as setStream would do).
        with handler.lock or contextlib.nullcontext():
            handler.stream = sys.stderr
    handler.setFormatter(StageFormatter(stage, shard, rank))
    if isinstance(level, str):
        names = logging.getLevelNamesMapping()
        if level.upper() not in names:
            raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
        wanted = names[level.upper()]
    else:
        wanted = level
    if rank not in (None, 0):
        wanted = max(wanted, logging.WARNING)
    root.setLevel(wanted)
    for name in _CHATTY:
        logging.getLogger(name).setLevel(max(wanted, logging.WARNING))
    return logging.getLogger(f"dflash.{stage}")


def logging_configured() -> bool:
    """Whether `setup_logging` has installed its handler in this process."""
    return any(getattr(h, _MARK, False) for h in logging.getLogger().handlers)
