"""Fixtures of the evaluate tests: tiny target, trained and untrained drafters, and one offline evaluation.

These tests run in the generate environment (.venv-generate: torch, transformers and vLLM on CPU) with the
train package installed, because the serving check needs the engine and the rest needs the train code.

`offline_evaluation` runs the real chain once per session on a moto S3 bucket: drafter manifest +
checkpoint (as training writes them) -> `dflash-train export` -> `dflash-train evaluate` on held-out
prompts (on the dense target: the held-out split of a tokenized manifest, which evaluate picks by default,
plus a small user prompt set). The serving-check tests start from its output.
"""

from __future__ import annotations

import contextlib
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

# Outside the generate environment (no torch, no train package) there is nothing here to run.
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("dflash_train") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    """One torch thread: on two shared cores, thread spinning costs more than the second thread gains."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    from tests.support.tiny_target import build_tiny_qwen3

    return Path(build_tiny_qwen3())


@pytest.fixture(scope="session")
def target_model(tiny_target_dir: Path) -> Any:
    return ef.load_target(tiny_target_dir)


@pytest.fixture(scope="session")
def heldout_prompts(tiny_target_dir: Path) -> list[list[int]]:
    """Chat prompts the drafter never saw in training (same distribution as its training prompts)."""
    return ef.chat_prompts(tiny_target_dir, ef.heldout_texts())


@pytest.fixture(scope="session")
def trained_checkpoint(tiny_target_dir: Path) -> Path:
    """Folder with model.safetensors + drafter_config.json + metrics.json of the trained tiny drafter."""
    return ef.trained_checkpoint(tiny_target_dir)


@pytest.fixture(scope="session")
def trained_drafter(trained_checkpoint: Path) -> Any:
    return ef.load_checkpoint_drafter(trained_checkpoint)


@pytest.fixture(scope="session")
def untrained_drafter(trained_drafter: Any) -> Any:
    return ef.untrained_like(trained_drafter)


@pytest.fixture(scope="session")
def hooked_target(target_model: Any, trained_drafter: Any) -> Any:
    from dflash_train.speculate import HookedTarget

    return HookedTarget(target_model, trained_drafter.config.target_layer_ids)


# ------------------------------------------------------------ the Qwen3.6-architecture (hybrid) target
@pytest.fixture(scope="session")
def hybrid_target_dir() -> Path:
    from tests.support.tiny_target import build_tiny_qwen3_6

    return Path(build_tiny_qwen3_6())


@pytest.fixture(scope="session")
def hybrid_model(hybrid_target_dir: Path) -> Any:
    return ef.load_target(hybrid_target_dir)


@pytest.fixture(scope="session")
def hybrid_heldout_prompts(hybrid_target_dir: Path) -> list[list[int]]:
    return ef.chat_prompts(hybrid_target_dir, ef.heldout_texts())


@pytest.fixture(scope="session")
def hybrid_trained_checkpoint(hybrid_target_dir: Path) -> Path:
    return ef.trained_checkpoint(hybrid_target_dir)


@pytest.fixture(scope="session")
def hybrid_trained_drafter(hybrid_trained_checkpoint: Path) -> Any:
    return ef.load_checkpoint_drafter(hybrid_trained_checkpoint)


@pytest.fixture(scope="session")
def hybrid_untrained_drafter(hybrid_trained_drafter: Any) -> Any:
    return ef.untrained_like(hybrid_trained_drafter)


@pytest.fixture(scope="session")
def hybrid_hooked_target(hybrid_model: Any, hybrid_trained_drafter: Any) -> Any:
    from dflash_train.speculate import HookedTarget

    return HookedTarget(hybrid_model, hybrid_trained_drafter.config.target_layer_ids)


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
    from dflash_train.evaluate import run as run_evaluate
    from dflash_train.evaluate_config import EvaluateConfig, ExportConfig
    from dflash_train.export import run_export

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
