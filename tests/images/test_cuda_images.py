"""The CUDA images a cluster pulls (generator FLAVOR=cuda, trainer), built on a host without a GPU and smoke-tested
on its CPU: the entrypoint starts and `--help` runs, `preflight` names the missing GPU and exits 69 (ENVIRONMENT,
a node fault: the Job may retry elsewhere) with every other check passing, torch imports as the CUDA build and
sees no device, the generator's CUDA vLLM imports and finds no platform to run on (its kernel libraries need the
driver's libcuda.so.1, absent without a GPU), and what is installed is exactly the image's lock.

Marked `cuda_image` and nothing else that selects tests (not `image`): an uncached build takes many minutes
and GB of wheels (docs/benchmarks.md, image section), so `make test`, `make test-images` and CI's test job
leave this tier out; `make test-cuda-images` runs it. tests/images/conftest.py deselects these tests whenever
the -m expression does not name the marker.

Each image is built once per session with docker/build-images.sh (the script `make build-images` runs, which
takes the CUDA wheels from the machine's local package indexes where its pip configuration names some). An
image already tagged with the checkout's revision (localhost/dflash-<name>:<git short sha>, its revision label
HEAD, the generator's flavour label cuda) is used as it is when nothing that goes into it differs from HEAD;
DFLASH_REBUILD_IMAGES=1 builds anyway.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from image_support import (
    BUILD_SCRIPT,
    REPO_ROOT,
    ContainerEngine,
    build_image,
    container_s3_env,
    git_revision,
    lock_pins,
    make_runner,
)
from packaging.utils import canonicalize_name
from packaging.version import Version

from dflash_shared.exit_codes import ExitCode
from dflash_shared.storage import ObjectStore, join
from tests.generate.stage_support import varied_prompts, write_prompts
from tests.pipeline.train_inputs import tiny_target_dir, tokenized_for, upload_dir

F = TypeVar("F", bound=Callable[..., Any])
NON_ROOT_UID = 10001
GB = 10**9
# An uncached generator build downloads several GB of wheels the local indexes lack.
BUILD_TIMEOUT_S = 3600


@dataclass(frozen=True)
class CudaImage:
    """What an image of this tier is made of, and the stage it runs."""

    name: str
    stage: str  # its folder under jobs/ and the prefix of its settings' variables
    lock: Path
    build_args: str  # DFLASH_BUILD_EXTRA_ARGS for docker/build-images.sh
    own_packages: frozenset[str]  # installed besides the lock: the venv's pip and the project's packages

    @property
    def sources(self) -> tuple[str, ...]:
        """Paths whose content goes into the image (a change there makes a HEAD-tagged image stale)."""
        return (f"docker/{self.name}", "shared", f"jobs/{self.stage}")


IMAGES = {
    "generator": CudaImage("generator", "generate", REPO_ROOT / "jobs" / "generate" / "requirements.lock",
                           "--build-arg FLAVOR=cuda", frozenset({"pip", "dflash-shared", "dflash-generate"})),
    "trainer": CudaImage("trainer", "train", REPO_ROOT / "jobs" / "train" / "requirements.lock", "",
                         frozenset({"pip", "dflash-shared", "dflash-train"})),
}


def cuda_image_test(test: F) -> F:
    """The marks of a test of this tier; its timeout covers a first, uncached build."""
    return pytest.mark.cuda_image(pytest.mark.timeout(BUILD_TIMEOUT_S + 900)(test))


@dataclass(frozen=True)
class Built:
    engine: ContainerEngine
    tag: str
    image: CudaImage
    how: str  # "built in N s" or "reused"


def _short_revision() -> str:
    done = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--verify", "--quiet", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def _unchanged_since_head(paths: tuple[str, ...]) -> bool:
    done = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", *paths],
                          capture_output=True, text=True, check=False)
    return done.returncode == 0 and not done.stdout.strip()


def _reusable(image: CudaImage, build_dir: Path) -> tuple[ContainerEngine, str] | None:
    """The engine and tag of an image of this revision already built, when it can stand for a fresh build."""
    if os.environ.get("DFLASH_REBUILD_IMAGES") == "1" or git_revision() == "unknown":
        return None
    if not _unchanged_since_head(image.sources):
        return None
    # The engine settings file the build script writes (podman needs it on this kind of host).
    subprocess.run(["bash", str(BUILD_SCRIPT), "--containers-conf"], env={**os.environ,
                   "DFLASH_IMAGE_BUILD_DIR": str(build_dir)}, capture_output=True, check=False)
    tag = f"localhost/dflash-{image.name}:{_short_revision()}"
    forced = os.environ.get("DFLASH_CONTAINER_ENGINE")
    for name in [forced] if forced in ("docker", "podman") else ["podman", "docker"]:
        engine = ContainerEngine(name, build_dir)
        try:
            done = engine.command("image", "inspect", "--format", "{{json .Labels}}", tag, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode != 0:
            continue
        labels = json.loads(done.stdout or "{}") or {}
        if labels.get("org.opencontainers.image.revision") != git_revision():
            continue
        if image.name == "generator" and labels.get("io.dflash.flavor") != "cuda":
            continue  # the CPU flavour's test builds under the same tag
        return engine, tag
    return None


@pytest.fixture(scope="module", params=sorted(IMAGES))
def cuda_build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    image = IMAGES[request.param]
    build_dir = tmp_path_factory.mktemp(f"{image.name}-cuda-build")
    found = _reusable(image, build_dir)
    if found is not None:
        built = Built(*found, image, "reused")
    else:
        mp = pytest.MonkeyPatch()
        mp.setenv("DFLASH_BUILD_EXTRA_ARGS", image.build_args)
        try:
            started = time.monotonic()
            engine, tag = build_image(image.name, build_dir, timeout=BUILD_TIMEOUT_S)
            built = Built(engine, tag, image, f"built in {time.monotonic() - started:.0f} s")
        finally:
            mp.undo()
    size = int(built.engine.command("image", "inspect", "--format", "{{.Size}}", built.tag).stdout.strip() or 0)
    print(f"{built.tag}: {size / GB:.2f} GB, {built.how}")
    return built


def _python(built: Built, code: str, env: dict[str, str] | None = None) -> Any:
    """Runs `code` with the image's python as its user, without network; returns its last line as JSON."""
    done = make_runner(built.engine)(built.tag, ["-c", code], env=env, entrypoint="python", network_host=False,
                                     timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the tests --------------------------------------------------------------------------------
@cuda_image_test
def test_entrypoint_starts_and_help_runs(cuda_build: Built) -> None:
    # The default command with --help: the entrypoint passes it to preflight and then to the stage's run, both
    # of which print their flags and exit 0, so the entrypoint, the console script and the settings all load.
    done = make_runner(cuda_build.engine)(cuda_build.tag, ["--help"], network_host=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    prog = f"dflash-{cuda_build.image.stage}"
    assert f"usage: {prog} preflight" in out and f"usage: {prog} run" in out, out[-4000:]
    assert f"DFLASH_{cuda_build.image.stage.upper()}_INPUT" in out


@cuda_image_test
def test_installed_packages_are_exactly_the_lock(cuda_build: Built) -> None:
    code = ("import importlib.metadata as m, json, os; "
            "print(json.dumps([os.getuid()] + [[d.metadata['Name'], d.version] for d in m.distributions()]))")
    listed = _python(cuda_build, code)
    uid, dists = listed[0], listed[1:]
    assert uid == NON_ROOT_UID
    installed: dict[str, list[str]] = {}
    for name, version in dists:
        installed.setdefault(canonicalize_name(name), []).append(version)
    assert {n: v for n, v in installed.items() if len(v) > 1} == {}, "a package is installed twice"
    pins = lock_pins(cuda_build.image.lock)
    wrong = {n: (v, installed.get(n, ["absent"])[0]) for n, (v, _) in pins.items()
             if n not in installed or Version(installed[n][0]) != Version(v)}
    assert wrong == {}, f"locked -> installed versions that differ: {wrong}"
    assert set(installed) - set(pins) == cuda_build.image.own_packages


@cuda_image_test
def test_torch_is_the_cuda_build_and_sees_no_gpu(cuda_build: Built) -> None:
    code = ("import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
            "'available': torch.cuda.is_available(), 'count': torch.cuda.device_count(), "
            "'cpu_sum': float(torch.ones(3).sum())}))")
    probe = _python(cuda_build, code)
    # The module names its build (2.14.1+cu130) where the package metadata, which the lock pins, does not.
    assert probe["torch"].split("+")[0] == lock_pins(cuda_build.image.lock)["torch"][0], probe
    assert probe["cuda"] and probe["cuda"].startswith("13."), probe
    assert probe == {**probe, "available": False, "count": 0, "cpu_sum": 3.0}


# What the CUDA build of vLLM does on a host without a GPU: its Python package imports (the engine class, the
# custom-ops wrappers) and platform detection finds neither CUDA (NVML has no driver to talk to) nor any other
# platform, so no engine could start. Its compiled kernel libraries do not load at all: they link the driver's
# libcuda.so.1, which exists only where the NVIDIA container toolkit mounts it into a container given GPUs. So
# the import is checked down to the Python layer, and the kernel library's refusal is checked as what it is.
VLLM_PROBE = """
import importlib, importlib.metadata as m, json, logging
logging.disable(logging.WARNING)
import vllm
import vllm._custom_ops
from vllm import LLM
from vllm.platforms import current_platform
from dflash_generate.engine import engine_flavour
try:
    importlib.import_module("vllm._C_stable_libtorch")
    kernels = "loaded"
except ImportError as err:
    kernels = str(err)
print(json.dumps({"dist": m.version("vllm"), "flavour": engine_flavour(), "llm": LLM.__name__,
                  "platform": type(current_platform).__name__, "is_cuda": current_platform.is_cuda(),
                  "device_type": current_platform.device_type, "kernels": kernels}))
"""


@pytest.mark.parametrize("cuda_build", ["generator"], indirect=True)
@cuda_image_test
def test_cuda_vllm_imports_and_detects_no_gpu_platform(cuda_build: Built) -> None:
    probe = _python(cuda_build, VLLM_PROBE)
    assert probe["dist"] == lock_pins(cuda_build.image.lock)["vllm"][0] and probe["flavour"] == "cuda", probe
    assert probe["llm"] == "LLM", probe
    assert probe["platform"] == "UnspecifiedPlatform" and probe["is_cuda"] is False, probe
    assert probe["device_type"] == "", probe
    assert "libcuda.so.1: cannot open shared object file" in probe["kernels"], probe


@cuda_image_test
def test_preflight_names_the_missing_gpu_and_exits_69(
    cuda_build: Built, s3_bucket: str, moto_endpoint: str, store: ObjectStore
) -> None:
    target = upload_dir(store, tiny_target_dir(), join(s3_bucket, "models", "tiny"))
    stage = cuda_build.image.stage
    prefix = f"DFLASH_{stage.upper()}_"
    env = container_s3_env(moto_endpoint)
    if stage == "generate":
        env |= {prefix + "INPUT": write_prompts(store, join(s3_bucket, "prompts"), varied_prompts(2)),
                prefix + "MODEL": target, prefix + "OUTPUT": join(s3_bucket, "completions")}
    else:
        env |= {prefix + "INPUT": tokenized_for(store, join(s3_bucket, "run"), tiny_target_dir()),
                prefix + "TARGET": target, prefix + "OUTPUT": join(s3_bucket, "drafter"),
                # On the GPU, as a cluster runs it; the scratch need of a debug run, not of a real one.
                prefix + "DEVICE": "cuda", prefix + "DISK_NEED_GIB": "0.5"}
    done = cuda_build.engine.command("run", "--rm", "--network", "host", "--shm-size=1g",
                                     *(f"--env={k}={v}" for k, v in env.items()), cuda_build.tag, "preflight",
                                     timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == ExitCode.ENVIRONMENT == 69, out[-6000:]
    assert "Traceback" not in out, out[-6000:]
    # The GPU check is the one that failed, and it says why: no driver on this host, not a crash or a config.
    assert f"preflight {stage} FAIL gpus: need 1 GPU(s), found 0" in out, out[-6000:]
    assert "no NVIDIA driver loaded: /proc/driver/nvidia/version does not exist" in out, out[-6000:]
    assert f"preflight {stage}: 1 of " in out and "check(s) failed (gpus); exit 69 (ENVIRONMENT)" in out, out[-6000:]
