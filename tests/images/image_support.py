"""Helpers for the container image tests: build an image with the project script, run containers.

The images are built by docker/build-images.sh, the same script `make build-images` runs, into a
per-session build folder (logs, containers.conf, the engine it chose). Tests run containers with
the engine the script used; with podman, `--network host` lets a container reach servers the
tests start on 127.0.0.1 (the moto S3 endpoint).

Helpers for later tests (preflight, tokenisation against moto):
  * ``make_runner(engine)`` gives ``run_in_image(image, args, env=None, network_host=True, ...)``
    (also the ``run_in_image`` fixture), which runs one container and returns the process;
  * ``container_s3_env(endpoint)`` (also the ``moto_container_env`` fixture) is the environment
    that points boto3, smart_open and pyarrow inside a container at a moto server.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "docker" / "build-images.sh"
# An uncached build downloads ~500 MB of wheels; a cached one takes seconds.
BUILD_TIMEOUT_S = 900
RUN_TIMEOUT_S = 300
F = TypeVar("F", bound=Callable[..., Any])


def in_image(test: F) -> F:
    """Marks of a test that builds or runs an image (an uncached build takes minutes)."""
    return pytest.mark.image(pytest.mark.slow(pytest.mark.timeout(1800)(test)))


def lock_pins(path: Path) -> dict[str, tuple[str, int]]:
    """Package -> (pinned version, number of hashes) of a hashed pip/uv lock file."""
    pins: dict[str, tuple[str, int]] = {}
    current = ""
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s\\;]+)", line)
        if match:
            current = canonicalize_name(match.group(1))
            pins[current] = (match.group(2), 0)
        elif "--hash=sha256:" in line and current:
            pins[current] = (pins[current][0], pins[current][1] + 1)
    return pins


def unlocked_dependencies(lock: Path, pyprojects: Sequence[Path], *, extras: Sequence[str]) -> list[str]:
    """What the lock misses of the projects' dependencies and of their optional groups `extras` (the stage
    images need a stage package's `stage` extra; the pipeline image, which reads their configs only, does not),
    other dflash packages aside, one line each.

    The images install the project packages with --no-deps: a dependency missing from the lock would only
    show up as an ImportError inside a running job.
    """
    pins = lock_pins(lock)
    problems = []
    for pyproject in pyprojects:
        project = tomllib.loads(pyproject.read_text())["project"]
        optional = project.get("optional-dependencies", {})
        for spec in [*project["dependencies"], *(s for extra in extras for s in optional.get(extra, []))]:
            req = Requirement(spec)
            name = canonicalize_name(req.name)
            if name.startswith("dflash-"):
                continue
            if name not in pins:
                problems.append(f"{lock.name} lacks {name} (required by {pyproject.relative_to(REPO_ROOT)})")
            elif not req.specifier.contains(pins[name][0], prereleases=True):
                problems.append(f"{lock.name} pins {name}=={pins[name][0]}, outside {spec!r} ({pyproject.name})")
    return problems


def git_revision() -> str:
    """The checkout's HEAD, which the build script writes into the image's revision label."""
    done = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--verify", "--quiet", "HEAD"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


@dataclass(frozen=True)
class ContainerEngine:
    """The engine docker/build-images.sh built with, and the settings its commands need."""

    name: str
    build_dir: Path

    def env(self) -> dict[str, str]:
        """Process environment for engine commands: podman needs the host-quirk settings file."""
        env = dict(os.environ)
        if self.name == "podman":
            env["CONTAINERS_CONF"] = str(self.build_dir / "containers.conf")
        return env

    def command(
        self, *args: str, timeout: float = RUN_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """Run `<engine> args...`, capturing text output; the caller checks the exit code."""
        return subprocess.run(
            [self.name, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


RunInImage = Callable[..., subprocess.CompletedProcess[str]]


def _require_engine() -> None:
    if shutil.which("podman") is None and shutil.which("docker") is None:
        pytest.skip(
            "neither podman nor docker is installed: the image tests need a container engine "
            "(docker/build-images.sh --ensure-tools installs podman)"
        )


def build_image(name: str, build_dir: Path, timeout: float = BUILD_TIMEOUT_S) -> tuple[ContainerEngine, str]:
    """Build docker/<name>/Dockerfile with the project's script; return the engine and the tag."""
    _require_engine()
    env = dict(os.environ, DFLASH_IMAGE_BUILD_DIR=str(build_dir))
    try:
        proc = subprocess.run(
            ["bash", str(BUILD_SCRIPT), name],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"building image '{name}' took longer than {timeout:.0f} s (logs: {build_dir})"
        )
    if proc.returncode != 0:
        pytest.fail(
            f"docker/build-images.sh {name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    engine = ContainerEngine((build_dir / "engine").read_text().strip(), build_dir)
    tag = (build_dir / f"{name}.image").read_text().strip()
    return engine, tag


def container_s3_env(endpoint_url: str) -> dict[str, str]:
    """Environment that sends every S3 client in a container to ``endpoint_url`` with test
    credentials, and never to a real account (no metadata service, no proxy for loopback)."""
    return {
        "AWS_ENDPOINT_URL": endpoint_url,
        "AWS_ENDPOINT_URL_S3": endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def make_runner(engine: ContainerEngine) -> RunInImage:
    """``run_in_image(image, args, env=None, network_host=True, entrypoint=None, volumes=(),
    timeout=RUN_TIMEOUT_S)``: run one container, return the CompletedProcess (text; a non-zero
    exit does not raise). Only ``env`` reaches the container, never the test process's
    environment; ``volumes`` are "host:container[:options]" bind mounts; ``entrypoint`` replaces
    the image's default command (e.g. "python" with args ["-c", code]).
    """

    def run(
        image: str,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        network_host: bool = True,
        entrypoint: str | None = None,
        volumes: Sequence[str] = (),
        timeout: float = RUN_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        cmd = ["run", "--rm"]
        if network_host:
            cmd += ["--network", "host"]
        if entrypoint is not None:
            cmd += ["--entrypoint", entrypoint]
        for volume in volumes:
            cmd += ["--volume", volume]
        for key, value in (env or {}).items():
            cmd += ["--env", f"{key}={value}"]
        return engine.command(*cmd, image, *args, timeout=timeout)

    return run
