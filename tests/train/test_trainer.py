"""Training runs on the tiny target: learning, and resuming after SIGTERM or kill -9 without a trace."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import DrafterSection, Kind
from dflash_shared.storage import ObjectStore, join
from dflash_train.config import debug
from dflash_train.data.batch import pack_documents
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.sections import TrainingRecipe
from dflash_train.stage import run
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training.checkpoint import MODEL, complete_checkpoints
from dflash_train.training.metrics import read_scalars
from dflash_train.training.optim import warmup_cosine
from dflash_train.training.step import dflash_step
from tests.support.step_recipe import step_recipe, step_runtime
from tests.train.train_fixtures import (
    RESUME_STEPS,
    generated_answers,
    resume_args,
    resume_config,
    resume_reference,
    target_generated,
    tiny_target,
)


def evaluate(drafter: DFlashDrafter, target: FrozenTarget, cfg: DrafterConfig, recipe: TrainingRecipe,
             ) -> tuple[float, list[float]]:
    """(mean loss, per-slot accuracy) on fixed batches of the generated answers, fixed anchors."""
    docs = [(p + c, [0] * len(p) + [1] * len(c)) for p, c in generated_answers()]
    losses, correct, counted = [], torch.zeros(cfg.block_size), torch.zeros(cfg.block_size)
    drafter.eval()
    with torch.no_grad():
        for i in range(0, 32, 8):
            out = dflash_step(drafter, target, pack_documents(docs[i:i + 8], 128), cfg, recipe, step_runtime(),
                              torch.Generator().manual_seed(i), noise=False)
            losses.append(float(out.loss))
            correct += out.correct
            counted += out.counted
    return sum(losses) / len(losses), (correct[1:] / counted[1:].clamp(min=1)).tolist()


@pytest.mark.slow
def test_training_on_target_generated_data_learns(tmp_path: Path) -> None:
    store = ObjectStore()
    data = target_generated(store, str(tmp_path))
    out = str(tmp_path / "drafter")
    config = debug(data, out, str(tiny_target()), scratch_dir=str(tmp_path / "scratch"), max_steps=24, lr=3e-3,
                   max_length=128, batch_tokens=256, micro_batch_rows=2, checkpoint_every=12, log_every=6,
                   num_anchors=2, drafter_overrides={"num_key_value_heads": 2})
    uri = run(config, store)
    section = load_manifest(store, out, Kind.drafter).manifest.section
    assert uri == join(out, "manifest.json") and isinstance(section, DrafterSection)

    cfg = DrafterConfig.from_saved(store.read_bytes(join(section.checkpoint_uri, "drafter_config.json")))
    recipe = step_recipe(num_anchors=config.num_anchors)  # the run's anchors per document, fixed ones to compare
    target = FrozenTarget.from_pretrained(tiny_target(), cfg.target_layer_ids)
    torch.manual_seed(config.seed)
    untrained = DFlashDrafter(cfg)  # the trainer's own initialisation (same seed)
    before_loss, before_acc = evaluate(untrained, target, cfg, recipe)
    trained = DFlashDrafter(cfg)
    trained.load_state_dict(load_file(join(section.checkpoint_uri, MODEL)))
    after_loss, after_acc = evaluate(trained, target, cfg, recipe)
    assert after_loss < before_loss - 0.3, (before_loss, after_loss)
    mean_before, mean_after = sum(before_acc) / len(before_acc), sum(after_acc) / len(after_acc)
    assert mean_after > 0.15 and mean_after > 10 * max(mean_before, 0.005), (before_acc, after_acc)
    assert section.final_metrics["tau"] > 1.0 and "acc_1" in section.final_metrics


def start_cli(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log_file:
        return subprocess.Popen([sys.executable, "-m", "dflash_train", "run", *args], stdout=log_file,
                                stderr=subprocess.STDOUT)


def wait_for_checkpoint(store: ObjectStore, output: str, step: int, proc: subprocess.Popen[bytes],
                        log_path: Path) -> None:
    deadline = time.monotonic() + 180
    while not any(ref.step >= step for ref in complete_checkpoints(store, output)):
        assert proc.poll() is None, f"training exited early ({proc.returncode}):\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.1)


def assert_same_curve(store: ObjectStore, output: str) -> None:
    """The interrupted-and-resumed run logged the uninterrupted run's loss at every step."""
    reference = resume_reference()
    losses = read_scalars(store, output, "train/loss")
    assert sorted(losses) == sorted(reference) == list(range(1, RESUME_STEPS + 1))
    for step, loss in sorted(losses.items()):
        assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), f"step {step}"


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_and_resume_continues_the_curve(tmp_path: Path) -> None:
    store = ObjectStore()
    resume_reference()
    out, log_path = str(tmp_path / "out"), tmp_path / "train.log"
    proc = start_cli(resume_args(out), log_path)
    wait_for_checkpoint(store, out, 2, proc, log_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=180) == 75, log_path.read_text()[-3000:]
    text = log_path.read_text()
    stopped = complete_checkpoints(store, out)[-1].step
    assert 2 <= stopped < RESUME_STEPS and f"stopped at step {stopped}" in text
    assert not store.exists(join(out, "manifest.json"))
    assert run(resume_config(out), store) == join(out, "manifest.json")
    assert_same_curve(store, out)


@pytest.mark.slow
def test_kill_9_loses_only_the_steps_since_the_last_checkpoint(tmp_path: Path) -> None:
    store = ObjectStore()
    resume_reference()
    out, log_path = str(tmp_path / "out"), tmp_path / "train.log"
    proc = start_cli(resume_args(out, **{"checkpoint-every": "3"}), log_path)
    wait_for_checkpoint(store, out, 3, proc, log_path)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    saved = complete_checkpoints(store, out)[-1].step
    assert 3 <= saved < RESUME_STEPS
    config = resume_config(out, **{"checkpoint-every": "3"})
    run(config, store)
    assert_same_curve(store, out)
    final = load_manifest(store, out, Kind.drafter).manifest
    assert isinstance(final.section, DrafterSection)
    assert final.section.checkpoint_uri.endswith(f"step-{RESUME_STEPS:08d}")


@pytest.mark.slow
def test_activation_checkpointing_follows_the_same_curve(tmp_path: Path) -> None:
    """Recomputing the drafter layers in backward changes how the step runs, not what it computes."""
    store = ObjectStore()
    reference = resume_reference()
    out = str(tmp_path / "out")
    run(resume_config(out, **{"max-steps": "2", "activation-checkpointing": ""}), store)
    losses = read_scalars(store, out, "train/loss")
    assert sorted(losses) == [1, 2]
    for step in (1, 2):
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), step


def test_warmup_then_cosine_schedule() -> None:
    lrs = [warmup_cosine(step, warmup_steps=4, total_steps=20, min_ratio=0.1) for step in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warmup, the peak reached at its last step
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))  # then only down
    assert lrs[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16)))
    assert warmup_cosine(20, 4, 20, 0.1) == pytest.approx(0.1)  # the floor, also past the end
