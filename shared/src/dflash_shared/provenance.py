"""Who produced an artifact: stage, image, source revision, package versions, resolved config."""

from __future__ import annotations

import os
import subprocess
from functools import lru_cache
from importlib import metadata
from typing import Any

from dflash_shared.manifests import Producer

# Images set these at build time (see docker/*/Dockerfile); outside an image git answers.
IMAGE_ENV = "DFLASH_IMAGE"
REVISION_ENV = "DFLASH_GIT_REVISION"


@lru_cache(maxsize=1)
def git_revision() -> str | None:
    if os.environ.get(REVISION_ENV):
        return os.environ[REVISION_ENV]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=5,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def package_versions(names: list[str]) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def producer(stage: str, config: dict[str, Any], packages: list[str], settings_sha256: str | None = None
             ) -> Producer:
    return Producer(
        stage=stage,
        image=os.environ.get(IMAGE_ENV),
        git_revision=git_revision(),
        package_versions=package_versions(["dflash-shared", *packages]),
        config=config,
        settings_sha256=settings_sha256,
    )
