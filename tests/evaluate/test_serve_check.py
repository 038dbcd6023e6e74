"""`dflash-generate serve-check`: the exported drafter in vLLM (CPU) against the offline evaluation.

One run per module (two engine start-ups: with and without speculation). The drafter is a full-attention
one: the CPU runner refuses drafters that mix sliding-window and full-attention layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the serving check needs the generate environment (.venv-generate)")

from dflash_generate.serve_check import (  # noqa: E402
    REPORT_NAME,
    ServeCheckConfig,
    ServeCheckReport,
    engine_acceptance,
    relative_gap,
    run,
    spec_counters,
)
from dflash_shared.errors import BadInputError  # noqa: E402
from dflash_shared.manifest_io import load_manifest  # noqa: E402
from dflash_shared.manifests import Kind  # noqa: E402
from dflash_shared.storage import join  # noqa: E402
from dflash_train.evaluate import OfflineReport  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def served(offline_run: Any, tiny_target_dir: Path, vllm_env: None) -> tuple[Any, str]:
    output = join(offline_run.root, "evaluation")
    config = ServeCheckConfig(evaluation=offline_run.evaluation, target=str(tiny_target_dir), output=output,
                              gpu_memory_utilization=0.3, enforce_eager=True)
    return run(config, offline_run.store), output


def _check(offline_run: Any, output: str) -> ServeCheckReport:
    return ServeCheckReport.model_validate_json(offline_run.store.read_bytes(join(output, REPORT_NAME)))


def test_engine_tau_agrees_with_offline_tau(offline_run: Any, served: tuple[Any, str]) -> None:
    check = _check(offline_run, served[1])
    offline = OfflineReport.model_validate_json(offline_run.store.read_bytes(
        join(offline_run.evaluation, "evaluation.json")))
    assert check.dtype == offline.dtype == "float32"
    assert check.num_speculative_tokens == offline.block_size - 1 == 7
    assert check.offline_tau == offline.trained.tau > 2.5
    assert check.relative_gap <= 0.10
    assert abs(check.engine.tau - offline.trained.tau) / offline.trained.tau == pytest.approx(check.relative_gap)
    # Enough drafts for the figure to be stable: every offline step has an engine counterpart.
    assert check.engine.drafts >= 0.9 * offline.trained.steps
    assert check.engine.draft_tokens == 7 * check.engine.drafts
    assert len(check.engine.acceptance_per_position) == 7


def test_speculative_output_equals_plain_output(offline_run: Any, served: tuple[Any, str]) -> None:
    check = _check(offline_run, served[1])
    assert check.prompts == 16
    assert check.outputs_identical == 16 and check.output_mismatches == []


def test_manifest_records_engine_tau_beside_offline_tau(offline_run: Any, served: tuple[Any, str]) -> None:
    uri, output = served
    loaded = load_manifest(offline_run.store, output, Kind.evaluation)  # re-hashes both report shards
    offline = load_manifest(offline_run.store, offline_run.evaluation, Kind.evaluation)
    check = _check(offline_run, output)
    section = loaded.manifest.section
    assert uri == join(output, "manifest.json")
    assert section.engine_tau == check.engine.tau
    assert section.tau == offline.manifest.section.tau
    assert [i.kind for i in loaded.manifest.inputs] == [Kind.evaluation, Kind.drafter]
    assert loaded.manifest.inputs[0].sha256 == offline.sha256


def test_gap_and_counters_arithmetic() -> None:
    from vllm.v1.metrics.reader import Counter, Vector

    def snapshot(drafts: int, accepted: int, per_pos: list[int]) -> list[Any]:
        return [Counter("vllm:spec_decode_num_drafts", {}, drafts),
                Counter("vllm:spec_decode_num_draft_tokens", {}, drafts * 3),
                Counter("vllm:spec_decode_num_accepted_tokens", {}, accepted),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {}, per_pos),
                Counter("vllm:prompt_tokens", {}, 999)]

    before = spec_counters(snapshot(10, 5, [3, 1, 1]))
    after = spec_counters(snapshot(30, 25, [13, 7, 5]))
    acceptance = engine_acceptance(before, after)
    assert acceptance.drafts == 20 and acceptance.accepted_tokens == 20 and acceptance.tau == 2.0
    assert acceptance.acceptance_per_position == [0.5, 0.3, 0.2]
    assert relative_gap(2.5, acceptance.tau) == pytest.approx(0.2)
    with pytest.raises(BadInputError, match="no speculative drafts"):
        engine_acceptance(after, after)


@pytest.mark.parametrize(("engine_tau", "mismatches", "expected"), [
    (1.0, [], r"engine tau 1.000 and offline tau .* differ by .*% \(> 10.0%\): training and serving disagree"),
    (None, ["p7"], r"differs from output without it on 1/16 prompts \(e.g. \['p7'\]\)"),
])
def test_a_gap_or_an_output_difference_fails_without_committing(
        offline_run: Any, tmp_path: Path, engine_tau: float | None, mismatches: list[str], expected: str) -> None:
    from dflash_generate.serve_check import EngineAcceptance, commit

    offline = load_manifest(offline_run.store, offline_run.evaluation, Kind.evaluation)
    drafter = load_manifest(offline_run.store, offline_run.export, Kind.drafter)
    tau = offline.manifest.section.tau
    engine_tau = tau if engine_tau is None else engine_tau
    check = ServeCheckReport(
        dtype="float32", num_speculative_tokens=7, offline_tau=tau,
        engine=EngineAcceptance(tau=engine_tau, drafts=100, draft_tokens=700,
                                accepted_tokens=round(100 * (engine_tau - 1)), acceptance_per_position=[0.5] * 7),
        relative_gap=relative_gap(tau, engine_tau), max_tau_gap=0.1, prompts=16, outputs_identical=16 - len(mismatches),
        output_mismatches=mismatches, engine_equals_offline=16, start_seconds={},
    )
    config = ServeCheckConfig(evaluation=offline_run.evaluation, target="unused", output=str(tmp_path / "eval"))
    with pytest.raises(BadInputError, match=expected):
        commit(config, offline_run.store, check, offline, drafter)
    assert (tmp_path / "eval" / REPORT_NAME).is_file()
    assert not (tmp_path / "eval" / "manifest.json").exists()
