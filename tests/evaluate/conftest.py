"""Fixtures of the evaluate tests: tiny target, trained and untrained drafters, and one offline evaluation.

These tests run in the generate environment (.venv-generate: torch, transformers and vLLM on CPU) with the
train package installed, because the serving check needs the engine and the rest needs the train code.

`offline_evaluation` runs the real chain once per session on a moto S3 bucket: drafter manifest +
checkpoint (as training writes them) -> `dflash-train export` -> `dflash-train evaluate` on held-out
prompts. The serving-check tests start from its output.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

torch = pytest.importorskip("torch", reason="evaluate tests need torch (.venv-generate)")

from dflash_shared.identity import chat_template_sha256, tokenizer_sha256  # noqa: E402
from dflash_shared.manifests import (  # noqa: E402
    Accounting,
    DrafterSection,
    Kind,
    Manifest,
    Producer,
    PromptsSection,
    Shard,
    SpecialTokens,
    TargetIdentity,
)
from dflash_shared.records import Message, PromptRecord, record_id  # noqa: E402
from dflash_shared.storage import ObjectStore, join  # noqa: E402
from tests.evaluate import eval_fixtures as ef  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    """One torch thread: on two shared cores, thread spinning costs more than the second thread gains."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    from tests.support.tiny_target import build_tiny_qwen3

    return Path(build_tiny_qwen3())


@pytest.fixture(scope="session")
def target_model(tiny_target_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def heldout_prompts(tiny_target_dir: Path) -> list[list[int]]:
    """Chat prompts the drafter never saw in training (same distribution as its training prompts)."""
    return ef.chat_prompts(tiny_target_dir, ef.heldout_texts())


@pytest.fixture(scope="session")
def trained_checkpoint(tiny_target_dir: Path) -> Path:
    """Folder with model.safetensors + drafter_config.json + metrics.json of the trained tiny drafter."""
    prompts = ef.chat_prompts(tiny_target_dir, ef.train_texts())
    return ef.train_drafter(tiny_target_dir, list(zip(prompts, ef.target_answers(tiny_target_dir, prompts),
                                                      strict=True)))


@pytest.fixture(scope="session")
def trained_drafter(trained_checkpoint: Path) -> Any:
    from safetensors.torch import load_file

    from dflash_train.drafter_config import DrafterConfig
    from dflash_train.model import DFlashDrafter

    cfg = DrafterConfig.model_validate_json((trained_checkpoint / "drafter_config.json").read_text())
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(load_file(str(trained_checkpoint / "model.safetensors")))
    return drafter.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def untrained_drafter(trained_drafter: Any) -> Any:
    from dflash_train.model import DFlashDrafter

    torch.manual_seed(1234)
    return DFlashDrafter(trained_drafter.config).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def hooked_target(target_model: Any, trained_drafter: Any) -> Any:
    from dflash_train.speculate import HookedTarget

    return HookedTarget(target_model, trained_drafter.config.target_layer_ids)


# ----------------------------------------------------------------------------------- stage chain


def target_identity(target_dir: Path) -> TargetIdentity:
    return TargetIdentity(
        model_id="tiny-qwen3", tokenizer_sha256=tokenizer_sha256(target_dir),
        chat_template_sha256=chat_template_sha256(target_dir), enable_thinking=False,
        special_tokens=SpecialTokens(end_of_turn=ef.SPECIAL["im_end"], mask=ef.MASK_ID),
    )


def write_prompts(store: ObjectStore, prefix: str, texts: list[str]) -> str:
    """A prompts manifest (one JSONL shard) of single-turn user prompts."""
    lines = []
    for text in texts:
        messages = (Message(role="user", content=text),)
        lines.append(PromptRecord(id=record_id(messages), messages=messages).model_dump_json(exclude_none=True))
    data = ("\n".join(lines) + "\n").encode()
    uri = join(prefix, "data", "part-00000.jsonl")
    store.write_bytes(uri, data)
    manifest = Manifest(
        kind=Kind.prompts, run_id="eval-test", producer=Producer(stage="import"),
        shards=[Shard(uri=uri, bytes=len(data), sha256=store.sha256(uri), records=len(lines))],
        accounting=Accounting(input_records=len(lines), succeeded=len(lines), failed=0, skipped=0),
        section=PromptsSection(sources=["tests"], duplicates=0),
    )
    store.write_bytes(join(prefix, "manifest.json"), manifest.to_json())
    return prefix


def write_trained(store: ObjectStore, prefix: str, checkpoint: Path, target_dir: Path) -> str:
    """A drafter prefix as training leaves it: a checkpoint folder and the drafter manifest naming it."""
    from dflash_train.drafter_config import DrafterConfig

    cfg = DrafterConfig.model_validate_json((checkpoint / "drafter_config.json").read_text())
    ckpt = join(prefix, "checkpoints", "step-00000200")
    shards = []
    for name in ("model.safetensors", "drafter_config.json"):
        store.upload_from(str(checkpoint / name), join(ckpt, name))
        shards.append(Shard(uri=join(ckpt, name), bytes=(checkpoint / name).stat().st_size,
                            sha256=store.sha256(join(ckpt, name)), records=0))
    metrics = json.loads((checkpoint / "metrics.json").read_text())
    manifest = Manifest(
        kind=Kind.drafter, run_id="eval-test", producer=Producer(stage="train"), shards=shards,
        accounting=Accounting(input_records=48, succeeded=48, failed=0, skipped=0),
        section=DrafterSection(target=target_identity(target_dir), target_layer_ids=list(cfg.target_layer_ids),
                               block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, checkpoint_uri=ckpt,
                               final_metrics=metrics),
    )
    store.write_bytes(join(prefix, "manifest.json"), manifest.to_json())
    return prefix


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


@pytest.fixture(scope="session")
def offline_run(session_bucket: str, tiny_target_dir: Path, trained_checkpoint: Path) -> OfflineRun:
    """export + evaluate (float32, debug preset) of the trained drafter, on S3; the session's evaluation."""
    from dflash_train.evaluate import run as run_evaluate
    from dflash_train.evaluate_config import EvaluateConfig, ExportConfig
    from dflash_train.export import run_export

    store = ObjectStore()
    root = join(session_bucket, "run")
    drafter = write_trained(store, join(root, "drafter"), trained_checkpoint, tiny_target_dir)
    prompts = write_prompts(store, join(root, "heldout"), ef.heldout_texts())
    export = join(root, "export")
    run_export(ExportConfig(drafter=drafter, output=export, target=str(tiny_target_dir), dtype="float32",
                            speculators=True), store)
    evaluation = join(root, "evaluation-offline")
    run_evaluate(EvaluateConfig(preset="debug", drafter=export, prompts=prompts, target=str(tiny_target_dir),
                                output=evaluation, min_tau=2.0, threads=1), store)
    return OfflineRun(store, root, drafter, export, prompts, evaluation, trained_checkpoint)
