"""Fixtures of the evaluate tests: tiny target, trained and untrained drafters, and one offline evaluation.

These tests run in the generate environment (.venv-generate: torch, transformers and vLLM on CPU) with the
train package installed, because the serving check needs the engine and the rest needs the train code.

Both tiny targets (dense Qwen3 and the Qwen3.6-architecture hybrid) go through one chain, `TinyTarget`: target ->
its greedy answers -> a drafter trained on them -> the loaded drafters and the hooked target. The tests ask for
its parts by name (`FIXTURES`: `trained_drafter` on the dense target, `hybrid_trained_drafter` on the hybrid).

`offline_run` runs the real stage chain once per session on a moto S3 bucket: drafter manifest +
checkpoint (as training writes them) -> `dflash-train export` -> `dflash-train evaluate` on held-out
prompts (on the dense target: the held-out split of a tokenized manifest, which evaluate picks by default,
plus a small user prompt set). The serving-check tests start from its output.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from dflash_shared.storage import ObjectStore, join
from tests.evaluate import eval_fixtures as ef
from tests.evaluate import heldout_fixtures as hf
from tests.support.tiny_target import TARGET_ARCHS, TargetArch

# Outside the generate environment (no torch, no train package) there is nothing here to run.
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("dflash_train") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    """One torch thread: on two shared cores, thread spinning costs more than the second thread gains."""
    import torch

    torch.set_num_threads(1)


class TinyTarget:
    """One tiny target and what the tests build on it, each made on first use and kept for the session.

    The target and its trained drafter come from caches on disk (tests.support.tiny_target, eval_fixtures):
    built once, then read back by every later session.
    """

    def __init__(self, arch: TargetArch) -> None:
        self.arch = arch

    @functools.cached_property
    def target_dir(self) -> Path:
        from tests.support.tiny_target import build_tiny_target

        return Path(build_tiny_target(self.arch))

    @functools.cached_property
    def model(self) -> Any:
        return ef.load_target(self.target_dir)

    @functools.cached_property
    def heldout_prompts(self) -> list[list[int]]:
        """Chat prompts the drafter never saw in training (same distribution as its training prompts)."""
        return ef.chat_prompts(self.target_dir, ef.heldout_texts())

    @functools.cached_property
    def trained_checkpoint(self) -> Path:
        """Folder with model.safetensors + drafter_config.json + metrics.json of the trained tiny drafter."""
        return ef.trained_checkpoint(self.target_dir)

    @functools.cached_property
    def trained_drafter(self) -> Any:
        return ef.load_checkpoint_drafter(self.trained_checkpoint)

    @functools.cached_property
    def untrained_drafter(self) -> Any:
        return ef.untrained_like(self.trained_drafter)

    @functools.cached_property
    def hooked_target(self) -> Any:
        from dflash_train.evaluate.speculate import HookedTarget

        return HookedTarget(self.model, self.trained_drafter.config.target_layer_ids)


@pytest.fixture(scope="session")
def tiny_targets() -> dict[TargetArch, TinyTarget]:
    return {arch: TinyTarget(arch) for arch in TARGET_ARCHS}


# The fixture the tests ask for, per target and part: the dense Qwen3 target's under plain names, the
# Qwen3.6-architecture (hybrid) one's prefixed.
FIXTURES: dict[TargetArch, dict[str, str]] = {
    "qwen3": {"target_dir": "tiny_target_dir", "model": "target_model", "heldout_prompts": "heldout_prompts",
              "trained_checkpoint": "trained_checkpoint", "trained_drafter": "trained_drafter",
              "untrained_drafter": "untrained_drafter", "hooked_target": "hooked_target"},
    "qwen3_6": {"target_dir": "hybrid_target_dir", "model": "hybrid_model",
                "heldout_prompts": "hybrid_heldout_prompts", "trained_checkpoint": "hybrid_trained_checkpoint",
                "trained_drafter": "hybrid_trained_drafter", "untrained_drafter": "hybrid_untrained_drafter",
                "hooked_target": "hybrid_hooked_target"},
}


def _part_fixture(arch: TargetArch, part: str, name: str) -> Any:
    def fixture(tiny_targets: dict[TargetArch, TinyTarget]) -> Any:
        return getattr(tiny_targets[arch], part)

    fixture.__name__ = name
    fixture.__doc__ = f"TinyTarget.{part} of the {arch} tiny target."
    return pytest.fixture(scope="session", name=name)(fixture)


for _arch, _parts in FIXTURES.items():
    for _part, _name in _parts.items():
        globals()[f"_fixture_{_name}"] = _part_fixture(_arch, _part, _name)
del _arch, _parts, _part, _name


# ----------------------------------------------------------------------------------- stage chain
@dataclass(frozen=True)
class OfflineRun:
    """Where the session's chain put things."""

    store: ObjectStore
    root: str
    drafter: str
    export: str
    prompts: str
    evaluation: str
    checkpoint: Path


@pytest.fixture(scope="session")
def session_bucket(moto_endpoint: str) -> Iterator[str]:
    name = f"eval-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    yield f"s3://{name}"


def _offline_chain(bucket: str, target_dir: Path, checkpoint: Path, lossless_prompts: int,
                   split_data: bool = False, name: str | None = None, **evaluate: Any) -> OfflineRun:
    """export + evaluate (float32, debug preset, unless `evaluate` says otherwise) of a trained drafter on S3, as
    the stages run them; with `split_data` the prompts are a tokenized manifest's held-out split (the default
    one) and a prompt set."""
    from dflash_train.evaluate.config import EvaluateConfig
    from dflash_train.evaluate.stage import run as run_evaluate
    from dflash_train.export.config import ExportConfig
    from dflash_train.export.stage import run_export

    store = ObjectStore()
    root = join(bucket, name or f"run-{ef.arch_of(target_dir)}")
    drafter = ef.write_trained(store, join(root, "drafter"), checkpoint, target_dir)
    if split_data:
        prompts = hf.write_split_tokenized(store, join(root, "tokenized"), target_dir)
        sets = {"mixed": hf.write_prompt_set(store, join(root, "sets", "mixed.jsonl"))}
    else:
        prompts, sets = ef.write_prompts(store, join(root, "heldout"), ef.heldout_texts()), {}
    export = join(root, "export")
    run_export(ExportConfig(drafter=drafter, output=export, target=str(target_dir), dtype="float32",
                            speculators=True), store)
    evaluation = join(root, "evaluation-offline")
    run_evaluate(EvaluateConfig(preset="debug", drafter=export, prompts=prompts, target=str(target_dir),
                                output=evaluation, threads=1, lossless_prompts=lossless_prompts,
                                prompt_sets=sets, **{"min_tau": 2.0, **evaluate}),
                 store)
    return OfflineRun(store, root, drafter, export, prompts, evaluation, checkpoint)


@pytest.fixture(scope="session")
def offline_run(session_bucket: str, tiny_target_dir: Path, trained_checkpoint: Path) -> OfflineRun:
    """The session's evaluation of the trained dense-target drafter."""
    return _offline_chain(session_bucket, tiny_target_dir, trained_checkpoint, lossless_prompts=2, split_data=True)


@pytest.fixture(scope="session")
def hybrid_offline_run(session_bucket: str, hybrid_target_dir: Path, hybrid_trained_checkpoint: Path) -> OfflineRun:
    """The same chain on the Qwen3.6-architecture target; every held-out prompt is checked for losslessness."""
    return _offline_chain(session_bucket, hybrid_target_dir, hybrid_trained_checkpoint, lossless_prompts=16)


# ------------------------------------------------ bfloat16, as on a GPU (the numerics policy of "lossless")
# bfloat16 matmuls are emulated on CPUs without AVX512-BF16 (the tiny target's 152K-row LM head then dominates:
# about 3x float32's time; the hybrid target's reference Gated DeltaNet kernels more), so these chains are short:
# 8 prompts (hybrid: 4) of 32 new tokens, every one checked against the target's own greedy output, the first 2
# (hybrid: 1) also with the untrained drafter.
BF16_EVALUATE: dict[str, Any] = {"dtype": "bfloat16", "num_prompts": 8, "max_new_tokens": 32, "baseline_prompts": 2}
HYBRID_BF16_EVALUATE: dict[str, Any] = {**BF16_EVALUATE, "num_prompts": 4, "baseline_prompts": 1}


@pytest.fixture(scope="session")
def bf16_run(session_bucket: str, tiny_target_dir: Path, trained_checkpoint: Path) -> OfflineRun:
    """The dense chain in bfloat16."""
    return _offline_chain(session_bucket, tiny_target_dir, trained_checkpoint, lossless_prompts=8,
                          name="run-qwen3-bf16", **BF16_EVALUATE)


@pytest.fixture(scope="session")
def hybrid_bf16_run(session_bucket: str, hybrid_target_dir: Path, hybrid_trained_checkpoint: Path) -> OfflineRun:
    """The Qwen3.6-architecture chain in bfloat16."""
    return _offline_chain(session_bucket, hybrid_target_dir, hybrid_trained_checkpoint, lossless_prompts=4,
                          name="run-qwen3_6-bf16", **HYBRID_BF16_EVALUATE)


@contextlib.contextmanager
def vllm_test_env(cache_root: Path, in_process: bool = False) -> Iterator[None]:
    """The environment vLLM's CPU engine runs under in these tests (a 1 GiB KV cache, no hub, a private cache);
    `in_process` keeps the engine core in this process (where a test double patches it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("VLLM_CACHE_ROOT", str(cache_root))
    if in_process:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        yield
    finally:
        mp.undo()
