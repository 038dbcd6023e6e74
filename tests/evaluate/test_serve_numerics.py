"""The numerics policy of "lossless" in the serving check: vLLM on CPU in bfloat16, as on a GPU.

On the dense bfloat16 chain's prompts (conftest `bf16_run`), one plain engine and two speculative ones (trained and
untrained drafter) run the serving check's own passes (`speculative_pass`: generation, the engine's counters, the
teacher-forced comparison) and its commit. The trained and the untrained drafter (whose drafts are nearly all
rejected: the verification path at its busiest) pass. Then each engine gets a deliberately lossy greedy rejection
sampler (tests/support/lossy_verifiers.py): the trained drafter's accepts wrong draft tokens at near-ties, the
untrained drafter's at 1% of random positions (it is rejected about once a token: a few hundred chances). Both
fail the check (exit 65), naming the parting, and commit nothing. The double replaces
vLLM's `rejection_sample` inside the engine, so the engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0). The stage's own `run` in bfloat16 is the end-to-end test's Qwen3.6 run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the serving check needs the generate environment (.venv-generate)")

from dflash_generate.serve_check import config as sc_config  # noqa: E402
from dflash_generate.serve_check import engine_passes  # noqa: E402
from dflash_generate.serve_check import report as sc_report  # noqa: E402
from dflash_generate.serve_check import stage as sc_stage  # noqa: E402
from dflash_shared.errors import BadInputError, exit_code_for  # noqa: E402
from dflash_shared.lossless import DEFAULT_TIE_MARGIN, ENGINE_LOGPROBS, NumericsPolicy  # noqa: E402
from dflash_shared.manifest_io import load_manifest  # noqa: E402
from dflash_shared.manifests import Kind  # noqa: E402
from dflash_shared.storage import join  # noqa: E402
from tests.evaluate.conftest import vllm_test_env  # noqa: E402
from tests.support.lossy_verifiers import (  # noqa: E402
    NearTieRule,
    RandomRule,
    patched_vllm_rejection,
    werkzeug_proxies_hidden,
)

pytestmark = pytest.mark.slow
POLICY = NumericsPolicy.at("bfloat16")


class _Switch:
    """A rule that is exact greedy until `rule` is set (one engine serves the honest and the lossy passes)."""

    def __init__(self) -> None:
        self.rule: Any = None
        self.wrong_accepts = 0

    def accepts_wrong(self, token: int, logits: Any) -> bool:
        return self.rule is not None and self.rule.accepts_wrong(token, logits)


@contextlib.contextmanager
def _in_process_engine(engine: Any, speculative: dict[str, Any] | None) -> Iterator[Any]:
    """The serving check's engine, its core in this process (started beside flask: see werkzeug_proxies_hidden)."""
    with contextlib.ExitStack() as stack:
        with werkzeug_proxies_hidden():
            llm, _ = stack.enter_context(engine_passes.started_engine(engine, speculative))
        yield llm


@pytest.fixture(scope="module")
def in_process_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with vllm_test_env(tmp_path_factory.mktemp("vllm-cache"), in_process=True):
        yield


@pytest.fixture(scope="module")
def setting(bf16_run: Any, tiny_target_dir: Path, in_process_vllm: None) -> Any:
    """(serve-check config, offline report, engine config) of the bfloat16 chain."""
    config = sc_config.ServeCheckConfig(evaluation=bf16_run.evaluation, target=str(tiny_target_dir),
                                 output=join(bf16_run.root, "evaluation"), gpu_memory_utilization=0.3,
                                 enforce_eager=True)
    _, _, report = sc_stage._inputs(bf16_run.store, config)
    engine = engine_passes.engine_config(config, report, str(tiny_target_dir))
    assert engine.dtype == report.dtype == "bfloat16"
    return config, report, engine


@pytest.fixture(scope="module")
def plain(setting: Any) -> list[Any]:
    _, report, engine = setting
    with _in_process_engine(engine, None) as llm:
        return engine_passes.generate(llm, report, logprobs=ENGINE_LOGPROBS, label="plain")


def _passes(setting: Any, plain: list[Any], chain: Any, export: str, rules: dict[str, Any],
            scratch: Path) -> dict[str, tuple[Any, Any]]:
    """label -> (speculative pass, rule) of one speculative engine serving `export`, once per rule."""
    _, report, engine = setting
    switch = _Switch()
    out = {}
    speculative = engine_passes.speculative_config(sc_stage._export_dir(chain.store, export, str(scratch)), report)
    with _in_process_engine(engine, speculative) as llm, patched_vllm_rejection(switch):
        for label, rule in rules.items():
            switch.rule = rule
            out[label] = (engine_passes.speculative_pass(llm, report, plain, POLICY), rule)
    return out


@pytest.fixture(scope="module")
def trained_passes(setting: Any, plain: list[Any], bf16_run: Any,
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """The trained drafter: exact greedy, then accepting wrong drafts at near-ties."""
    return _passes(setting, plain, bf16_run, bf16_run.export,
                   {"honest": None, "wrong-at-near-ties": NearTieRule(DEFAULT_TIE_MARGIN)},
                   tmp_path_factory.mktemp("trained-export"))


@pytest.fixture(scope="module")
def untrained_passes(setting: Any, plain: list[Any], bf16_run: Any, tiny_target_dir: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """An untrained drafter of the same shape: exact greedy, then accepting wrong drafts at 1% of the rejected
    positions (about one a token: a few hundred chances)."""
    import shutil

    from safetensors.torch import save_file

    from dflash_train.export.config import ExportConfig
    from dflash_train.export.stage import run_export
    from tests.evaluate import eval_fixtures as ef

    folder = tmp_path_factory.mktemp("untrained-checkpoint")
    for name in ("drafter_config.json", "metrics.json"):
        shutil.copy(bf16_run.checkpoint / name, folder / name)
    untrained = ef.untrained_like(ef.load_checkpoint_drafter(bf16_run.checkpoint))
    save_file({k: v.contiguous() for k, v in untrained.state_dict().items()}, str(folder / "model.safetensors"))
    prefix = str(tmp_path_factory.mktemp("untrained"))
    drafter = ef.write_trained(bf16_run.store, join(prefix, "drafter"), folder, tiny_target_dir)
    export = join(prefix, "export")
    run_export(ExportConfig(drafter=drafter, output=export, target=str(tiny_target_dir)), bf16_run.store)
    return _passes(setting, plain, bf16_run, export,
                   {"honest": None, "wrong-at-1pct-random": RandomRule(0.01, seed=3)},
                   tmp_path_factory.mktemp("untrained-export"))


def _commit(setting: Any, served: Any, chain: Any, output: Path) -> str:
    config, report, engine = setting
    config = config.model_copy(update={"output": str(output)})
    offline = load_manifest(chain.store, chain.evaluation, Kind.evaluation)
    drafter = load_manifest(chain.store, chain.export, Kind.drafter)
    check = sc_report.check_report(config, report, engine.dtype, served, {})
    return sc_stage.commit(config, chain.store, check, offline, drafter)


def test_the_trained_drafter_passes(setting: Any, plain: list[Any], trained_passes: dict[str, Any], bf16_run: Any,
                                    tmp_path: Path) -> None:
    served, _ = trained_passes["honest"]
    assert served.comparison.failure() is None and served.comparison.prompts == 8
    assert served.comparison.positions == sum(len(p.token_ids) for p in plain)
    assert served.acceptance.tau > 2.0
    assert _commit(setting, served, bf16_run, tmp_path / "evaluation").endswith("manifest.json")


def test_the_untrained_drafter_passes(untrained_passes: dict[str, Any]) -> None:
    served, _ = untrained_passes["honest"]
    assert served.acceptance.tau < 1.5  # its drafts are (almost) never accepted
    assert served.comparison.failure() is None and served.comparison.prompts == 8


@pytest.mark.parametrize(("drafter", "label"), [("trained", "wrong-at-near-ties"),
                                                ("untrained", "wrong-at-1pct-random")])
def test_a_lossy_engine_fails_the_serving_check(drafter: str, label: str, setting: Any, bf16_run: Any,
                                                tmp_path: Path, request: pytest.FixtureRequest) -> None:
    served, rule = request.getfixturevalue(f"{drafter}_passes")[label]
    assert rule.wrong_accepts >= 1  # the engine did accept wrong drafts
    with pytest.raises(BadInputError) as err:
        _commit(setting, served, bf16_run, tmp_path / "evaluation")
    assert int(exit_code_for(err.value)) == 65
    message = str(err.value)
    assert "greedy output with speculative decoding differs from output without it on" in message
    assert "(bfloat16: near-ties in both runs within 0.25 nats" in message and "speculative margin" in message
    written = (tmp_path / "evaluation" / sc_config.REPORT_NAME).read_bytes()
    check = sc_report.ServeCheckReport.model_validate_json(written)
    assert check.outputs.mismatches and not (tmp_path / "evaluation" / "manifest.json").exists()
    # The engine's own log-probabilities rank the wrongly accepted token below the plain run's.
    first = check.outputs.mismatches[0]
    assert first.speculative_margin is None or first.speculative_margin < 0
