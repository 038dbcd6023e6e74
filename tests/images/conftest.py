"""Fixtures for the container image tests: each image built once per session, and a runner.

See image_support.py for the helpers behind them. For later tests (preflight, tokenisation
against the moto server): ``run_in_image`` and ``moto_container_env``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from image_support import (
    ContainerEngine,
    RunInImage,
    build_image,
    container_s3_env,
    make_runner,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave the `cuda_image` tier out unless the -m expression names it: every other selection (`make test`,
    `make test-all`, `make test-images`, `-m slow`) would otherwise pull in builds of many minutes and GB."""
    if "cuda_image" in (config.getoption("markexpr") or ""):
        return
    tier = [item for item in items if item.get_closest_marker("cuda_image")]
    if tier:
        config.hook.pytest_deselected(items=tier)
        items[:] = [item for item in items if not item.get_closest_marker("cuda_image")]


@pytest.fixture(scope="session")
def image_build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per-session folder for build logs, containers.conf and the build results."""
    return tmp_path_factory.mktemp("image-build")


@pytest.fixture(scope="session")
def tokenizer_build(image_build_dir: Path) -> tuple[ContainerEngine, str]:
    """The tokenizer image, built once per session."""
    return build_image("tokenizer", image_build_dir)


@pytest.fixture(scope="session")
def container_engine(tokenizer_build: tuple[ContainerEngine, str]) -> ContainerEngine:
    """The engine the session's images were built with."""
    return tokenizer_build[0]


@pytest.fixture(scope="session")
def tokenizer_image(tokenizer_build: tuple[ContainerEngine, str]) -> str:
    """Exact tag of the session's tokenizer image (localhost/dflash-tokenizer:<sha>)."""
    return tokenizer_build[1]


# --- helper for later tests: run one container ------------------------------------------------
@pytest.fixture(scope="session")
def run_in_image(container_engine: ContainerEngine) -> RunInImage:
    """Callable ``run_in_image(image, args, env=None, network_host=True, entrypoint=None,
    volumes=(), timeout=RUN_TIMEOUT_S)`` returning the CompletedProcess (text, never raises on a
    non-zero exit). Only ``env`` reaches the container, never the test process's environment.
    ``volumes`` are "host:container[:options]" bind mounts.
    """

    return make_runner(container_engine)


# --- helper for later tests: the moto endpoint as seen from a container -----------------------
@pytest.fixture
def moto_container_env(moto_endpoint: str) -> dict[str, str]:
    """Container environment for the session's moto server (reachable with --network host)."""
    return container_s3_env(moto_endpoint)
