"""The learnability gate (dflash_train.evaluate.learnability): a fresh drafter memorises the target's answers to a
few prompts, is exported, and decodes them with nearly every drafted token accepted; in the engine too.

The targets are the tiny ones made to say something that takes context to predict (`build_varied_target`): at the
default initialisation their answers repeat one token, which a drafter predicts without learning anything. Each
defect the gate exists for is put in on purpose, one at a time, and the gate must fail on it: labels shifted by
one slot, block positions shifted against the context, target layer ids off by one between training and the
export, a weight dropped from the export.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from dflash_shared.errors import BadInputError
from dflash_shared.evaluation_report import REPORT_NAME, LearnabilityGate, OfflineReport
from dflash_shared.storage import join
from tests.support.gate_defects import BREAKS, DROPPED_WEIGHT, gate_on, weight_dropped
from tests.support.tiny_target import TargetArch

# Two answers of 24 tokens: enough that a token does not say what follows it, small enough to memorise in seconds.
DOCUMENTS, NEW_TOKENS, STEPS = 2, 24, 100
GATE = {"learnability_documents": DOCUMENTS, "learnability_new_tokens": NEW_TOKENS, "learnability_steps": STEPS}


@pytest.fixture(scope="module")
def varied_targets() -> dict[TargetArch, Path]:
    from tests.support.tiny_target import build_varied_target

    return {arch: build_varied_target(arch) for arch in ("qwen3", "qwen3_6")}


def run_gate(target_dir: Path, tmp_path: Path, steps: int = STEPS) -> LearnabilityGate:
    return gate_on(target_dir, tmp_path, DOCUMENTS, NEW_TOKENS, steps)


def test_a_fresh_drafter_memorises_and_the_export_has_nearly_every_drafted_token_accepted(
        varied_targets: dict[TargetArch, Path], tmp_path: Path) -> None:
    """On the hybrid target (the dense one passes through the stage below)."""
    gate = run_gate(varied_targets["qwen3_6"], tmp_path)
    assert_memorised(gate)
    assert (tmp_path / "gate-export" / "config.json").is_file()


def assert_memorised(gate: LearnabilityGate) -> None:
    assert gate.passed, gate.summary()
    assert gate.train_accuracy == 1.0 and gate.train_steps < STEPS
    assert gate.acceptance_rate >= 0.9 and gate.acceptance.prompts == DOCUMENTS
    # The answers vary: a drafter repeating one token would not pass on them.
    for result in gate.results:
        assert len(set(result.output_token_ids)) >= NEW_TOKENS // 3, result.output_token_ids


# The default tier fails the gate with shifted labels and wrong layer ids on the dense target; the other cases
# (positions shifted, an off-by-one of the same kind as the labels'; every hybrid case, whose defects are code both
# families share) run in the extended tier (`make test-all`), and each one's figure is in bench/bench_learnability.py
# and docs/quality.md.
DEFAULT_TIER = {("qwen3", "labels shifted"), ("qwen3", "layer ids off by one")}
CASES = [(arch, defect, [] if (arch, defect) in DEFAULT_TIER else [pytest.mark.extended])
         for arch in ("qwen3", "qwen3_6") for defect in BREAKS]


@pytest.mark.parametrize(("arch", "defect"), [pytest.param(a, d, marks=m, id=f"{a}-{d}") for a, d, m in CASES])
def test_the_gate_fails_on_each_defect(arch: TargetArch, defect: str, varied_targets: dict[TargetArch, Path],
                                       tmp_path: Path) -> None:
    with BREAKS[defect]():
        gate = run_gate(varied_targets[arch], tmp_path)
    assert not gate.passed, f"{defect}: {gate.summary()}"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_6"])
def test_the_gate_fails_on_a_weight_dropped_from_the_export(arch: TargetArch, varied_targets: dict[TargetArch, Path],
                                                            tmp_path: Path) -> None:
    # One training step is enough: the export is refused however well the drafter learned.
    with weight_dropped(), pytest.raises(BadInputError, match=f"missing.*{DROPPED_WEIGHT}"):
        run_gate(varied_targets[arch], tmp_path, steps=1)


# The run's own evaluation kept small: the gate is what these chains are for.
CHAIN = {**GATE, "min_tau": 0.0, "num_prompts": 4, "baseline_prompts": 0}


@pytest.fixture(scope="module")
def gate_chain(session_bucket: str, varied_targets: dict[TargetArch, Path], trained_checkpoint: Path) -> Any:
    """export + evaluate with the gate on the varied dense target; any drafter of its shape serves as the run's
    (the standard tiny target's trained one): the gate trains its own."""
    from tests.evaluate.conftest import _offline_chain

    return _offline_chain(session_bucket, varied_targets["qwen3"], trained_checkpoint, lossless_prompts=1,
                          name="gate-pass", **CHAIN)


def test_the_evaluate_stage_runs_the_gate_and_fails_without_committing_when_it_fails(
        gate_chain: Any, varied_targets: dict[TargetArch, Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """Through the stage: the report holds the gate and its export; a failed gate exits 65 and commits nothing."""
    from dflash_train.__main__ import main as train_main

    store = gate_chain.store
    report = OfflineReport.model_validate_json(store.read_bytes(join(gate_chain.evaluation, REPORT_NAME)))
    gate = report.learnability
    assert gate is not None and gate.documents == DOCUMENTS
    assert_memorised(gate)
    assert gate.results[0].prompt_token_ids == report.results[0].prompt_token_ids
    assert store.exists(join(gate.drafter_export, "model.safetensors"))
    manifest = json.loads(store.read_bytes(join(gate_chain.evaluation, "manifest.json")))
    assert manifest["section"]["metrics"]["learnability_acceptance"] == gate.acceptance_rate

    # One training step memorises nothing: the stage's failure path, without a defect's full training.
    out = tmp_path / "gated"
    argv = ["--drafter", gate_chain.export, "--prompts", gate_chain.prompts, "--target", str(varied_targets["qwen3"]),
            "--output", str(out), "--preset", "debug", "--num-prompts", "2", "--max-new-tokens", "16",
            "--baseline-prompts", "0", "--lossless-prompts", "0", "--min-tau", "0", "--learnability-documents", "2",
            "--learnability-steps", "1"]
    caplog.set_level(logging.ERROR)
    with pytest.raises(SystemExit) as exit_info:
        train_main(["evaluate", *argv])
    assert exit_info.value.code == 65
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "learnability gate FAILED" in message and "layer ids" in message
    assert not (out / "manifest.json").exists()
    assert json.loads((out / REPORT_NAME).read_text())["learnability"]["train_steps"] == 1


@pytest.mark.slow
def test_the_engine_accepts_what_the_gate_drafter_memorised(gate_chain: Any, varied_targets: dict[TargetArch, Path],
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """The serving check replays the gate's prompts in vLLM with the gate's export: the same steps as the offline
    loop, and nearly every drafted token accepted."""
    pytest.importorskip("vllm", reason="the serving check needs the generate environment (.venv-generate)")
    from dflash_generate.serve_check.config import REPORT_NAME as SERVE_REPORT
    from dflash_generate.serve_check.config import ServeCheckConfig
    from dflash_generate.serve_check.report import ServeCheckReport
    from dflash_generate.serve_check.stage import run
    from tests.evaluate.conftest import vllm_test_env

    output = join(gate_chain.root, "evaluation")
    config = ServeCheckConfig(evaluation=gate_chain.evaluation, target=str(varied_targets["qwen3"]), output=output,
                              gpu_memory_utilization=0.3, enforce_eager=True)
    with vllm_test_env(tmp_path_factory.mktemp("vllm-cache")):
        run(config, gate_chain.store)
    check = ServeCheckReport.model_validate_json(gate_chain.store.read_bytes(join(output, SERVE_REPORT)))
    gate = check.learnability
    assert gate is not None and gate.prompts == DOCUMENTS and gate.min_acceptance == 0.9
    assert gate.engine_acceptance_rate >= 0.9, gate.engine
    assert gate.outputs_identical == DOCUMENTS and gate.steps is not None and not gate.steps.failure()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_6"])
def test_the_gate_keeps_the_drafter_whose_forward_met_the_rule(arch: TargetArch,
                                                               varied_targets: dict[TargetArch, Path]) -> None:
    """No update follows the step that memorised the answers: the drafter the gate exports gives that step's loss
    and predicts every label (an update after it could undo a label: the verdict then hung on the stopping step)."""
    import torch

    from dflash_train.evaluate.config import EvaluateConfig
    from dflash_train.evaluate.learnability import GateSettings, memorise, memorising_step_inputs
    from dflash_train.evaluate.speculate import greedy_with_logprobs
    from dflash_train.evaluate.stage import stop_token_ids
    from dflash_train.training.step import dflash_step
    from tests.evaluate import eval_fixtures as ef

    target_dir = varied_targets[arch]
    model, cfg = ef.load_target(target_dir), ef.drafter_config(8, ef.arch_of(target_dir))
    prompts = ef.chat_prompts(target_dir, ef.heldout_texts(DOCUMENTS))
    docs = [(ids, list(greedy_with_logprobs(model, ids, NEW_TOKENS, stop_token_ids(model)).tokens)) for ids in prompts]
    lr = EvaluateConfig.model_fields["learnability_lr"].default
    memorised = memorise(model, cfg, docs, GateSettings(DOCUMENTS, NEW_TOKENS, STEPS, lr, 0.9), torch.device("cpu"))
    assert memorised.accuracy == 1.0 and memorised.steps < STEPS
    target, batch, recipe, runtime = memorising_step_inputs(model, cfg, docs, torch.device("cpu"))
    with torch.no_grad():
        out = dflash_step(memorised.drafter, target, batch, cfg, recipe, runtime, torch.Generator().manual_seed(0))
    assert int(out.correct.sum()) == int(out.counted.sum()) > 0
    assert out.loss.item() == pytest.approx(memorised.loss, rel=1e-4, abs=1e-6)
