"""Where the target model comes from: a local directory, an S3 prefix, or a model hub.

The engine reads weights from local disk only. An S3 prefix is copied there first, many files at once
(and each large file in parallel ranged parts) by dflash_shared.model_copy; a hub model is downloaded with
`huggingface_hub`, which reads its token from the HF_TOKEN environment variable itself, so the token never
passes through this code, a log line or a manifest. The tokenizer files are fetched on their own first: the
target identity (tokenizer and template hashes) is needed by every worker, the weights only by one that generates.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_shared.errors import ConfigError
from dflash_shared.model_copy import IDENTITY_FILES, copy_objects, s3_model_bytes, s3_objects
from dflash_shared.progress import human_rate
from dflash_shared.storage import ObjectStore, is_s3, join

log = logging.getLogger(__name__)

# The small files that identify the target and let the engine build its tokenizer.
TOKENIZER_FILES = IDENTITY_FILES
# What a hub download fetches: configs, tokenizer and safetensors weights (no duplicate .bin/.pth copies).
HUB_PATTERNS = ("*.json", "*.jinja", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.py")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

Kind = Literal["local", "s3", "hub"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved `model` setting: what kind of location it is, and the revision to record."""

    location: str
    kind: Kind
    revision: str | None = None

    @classmethod
    def parse(cls, location: str, revision: str | None = None) -> ModelSource:
        if is_s3(location):
            return cls(location.rstrip("/"), "s3", revision)
        if os.path.isdir(location):
            return cls(location, "local", revision)
        if _HUB_ID.match(location) and not location.startswith("."):
            return cls(location, "hub", revision)
        raise ConfigError(
            f"model {location!r} is not a directory, an s3:// prefix or a hub model id (owner/name)"
        )

    def cache_dir(self, root: str) -> str:
        """A local directory for this model under `root` (one per location, so two models never mix)."""
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", self.location.removeprefix("s3://")).strip("_")
        return os.path.join(root, safe + (f"@{self.revision}" if self.revision else ""))


def _hub_download(source: ModelSource, dest: str, patterns: tuple[str, ...], workers: int) -> str:
    """Download from the hub into `dest`; returns the commit it resolved to."""
    import huggingface_hub

    info: Any = huggingface_hub.model_info(source.location, revision=source.revision)
    huggingface_hub.snapshot_download(
        source.location, revision=info.sha, local_dir=dest, allow_patterns=list(patterns), max_workers=workers
    )
    return str(info.sha)


@dataclass
class ModelFiles:
    """The target on local disk: tokenizer files at once, weights on demand."""

    source: ModelSource
    cache_root: str
    store: ObjectStore
    workers: int = 16
    _resolved_revision: str | None = None

    @property
    def local_dir(self) -> str:
        if self.source.kind == "local":
            return self.source.location
        return self.source.cache_dir(self.cache_root)

    @property
    def revision(self) -> str | None:
        return self._resolved_revision or self.source.revision

    def tokenizer_dir(self) -> str:
        """A local directory holding the tokenizer, chat template and configs (no weights)."""
        if self.source.kind == "local":
            return self.local_dir
        dest = self.local_dir
        os.makedirs(dest, exist_ok=True)
        if self.source.kind == "s3":
            wanted = [(u, r) for u, r in s3_objects(self.store, self.source.location) if r in TOKENIZER_FILES]
            copy_objects(self.store, wanted, dest, self.workers)
        else:
            self._resolved_revision = _hub_download(self.source, dest, TOKENIZER_FILES, self.workers)
        return dest

    def model_dir(self) -> str:
        """A local directory with the whole model, copied first when it lives elsewhere."""
        if self.source.kind == "local":
            return self.local_dir
        dest = self.local_dir
        os.makedirs(dest, exist_ok=True)
        started = time.monotonic()
        if self.source.kind == "s3":
            copied = copy_objects(self.store, s3_objects(self.store, self.source.location), dest, self.workers)
        else:
            self._resolved_revision = _hub_download(self.source, dest, HUB_PATTERNS, self.workers)
            copied = sum(p.stat().st_size for p in Path(dest).rglob("*") if p.is_file())
        elapsed = max(time.monotonic() - started, 1e-9)
        log.info("model %s copied to %s: %.2f GiB in %.0f s (%s)", self.source.location, dest, copied / 2**30,
                 elapsed, human_rate(copied / elapsed, "B"))
        return dest


def s3_has(store: ObjectStore, prefix: str, name: str) -> bool:
    return store.exists(join(prefix, name))


__all__ = ["TOKENIZER_FILES", "ModelFiles", "ModelSource", "s3_has", "s3_model_bytes"]
