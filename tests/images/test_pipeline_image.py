"""The run driver's image (docker/pipeline): static checks only, no build.

Building it takes about 3 minutes here (its lock installs boto3, pyarrow and the kubernetes client from
scratch), over the budget for an image test, so these checks read the Dockerfile and the locks instead: the
lock covers every dependency of what the image installs (the stage packages without their `stage` extra: the
orchestration reads their config models only), it stays torch-free, the image runs as the non-root user, and
no stage image carries the cluster client or the orchestration package.
"""

from __future__ import annotations

import re

from image_support import REPO_ROOT, lock_pins, unlocked_dependencies

DOCKERFILE = REPO_ROOT / "docker" / "pipeline" / "Dockerfile"
LOCK = REPO_ROOT / "jobs" / "pipeline" / "requirements.lock"
STAGE_PACKAGES = ("tokenize", "generate", "train")
PYPROJECTS = (REPO_ROOT / "shared" / "pyproject.toml", REPO_ROOT / "jobs" / "pipeline" / "pyproject.toml",
              *(REPO_ROOT / "jobs" / name / "pyproject.toml" for name in STAGE_PACKAGES))


def test_lock_covers_every_dependency_and_stays_torch_free() -> None:
    assert unlocked_dependencies(LOCK, PYPROJECTS, extras=[]) == []
    pins = lock_pins(LOCK)
    assert "kubernetes" in pins
    assert all(hashes >= 1 for _, hashes in pins.values()), "every pin needs its hashes (--require-hashes)"
    forbidden = sorted(n for n in pins if n in {"torch", "triton", "vllm", "transformers"} or n.startswith("nvidia-"))
    assert forbidden == []


def test_dockerfile_installs_the_lock_the_orchestration_and_the_stage_configs_as_the_non_root_user() -> None:
    text = DOCKERFILE.read_text()
    copies = re.findall(r"^COPY (\S+) ", text, re.MULTILINE)
    assert copies == ["jobs/pipeline/requirements.lock", "shared", "jobs/pipeline",
                      *(f"jobs/{name}" for name in STAGE_PACKAGES)]
    assert "--require-hashes --no-deps -r /opt/dflash/requirements.lock" in text
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}$", text, re.MULTILINE)
    assert 'org.opencontainers.image.revision="${GIT_REVISION}"' in text
    # The driver Job runs `dflash-pipeline drive`: the console script of the package installed here.
    assert 'ENTRYPOINT ["dflash-pipeline"]' in text


def test_no_stage_image_carries_the_cluster_client() -> None:
    for dockerfile in sorted((REPO_ROOT / "docker").glob("*/Dockerfile")):
        if dockerfile == DOCKERFILE:
            continue
        assert "jobs/pipeline" not in dockerfile.read_text(), f"{dockerfile} installs the orchestration package"
    for lock in sorted((REPO_ROOT / "jobs").glob("*/requirements*.lock")):
        if lock == LOCK:
            continue
        assert "kubernetes" not in lock_pins(lock), f"{lock} pins the Kubernetes client"
