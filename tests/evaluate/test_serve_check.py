"""`dflash-generate serve-check`: the exported drafter in vLLM (CPU) against the offline evaluation.

One run per target architecture and module (two engine start-ups each: with and without speculation): the
dense Qwen3 target, and the Qwen3.6-architecture (hybrid) one (`make test-all`; the default suite serves the hybrid
target in the end-to-end test). Outputs are held to the numerics policy (dflash_shared.lossless) at the engine's
dtype: float32 on the dense target, where they must be identical; vLLM's CPU build runs the hybrid target in
bfloat16 only, against the float32 offline evaluation, so that run compares acceptance across dtypes (over the
prompts both sides decoded alike). The bfloat16 runs of the dense target are test_serve_numerics.py's. The
bookkeeping tests run on the dense target only. The drafters are full-attention ones: the CPU runner refuses
drafters that mix sliding-window and full-attention layers. test_serve_numerics.py holds the untrained and the
lossy runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the serving check needs the generate environment (.venv-generate)")

from dflash_generate.serve_check.config import REPORT_NAME, ServeCheckConfig  # noqa: E402
from dflash_generate.serve_check.engine_passes import engine_acceptance, spec_counters  # noqa: E402
from dflash_generate.serve_check.report import (  # noqa: E402
    Generated,
    MatchedAcceptance,
    ServeCheckReport,
    relative_gap,
    tau_failure,
)
from dflash_generate.serve_check.stage import run  # noqa: E402
from dflash_shared.errors import BadInputError  # noqa: E402
from dflash_shared.evaluation_report import OfflineReport  # noqa: E402
from dflash_shared.lossless import DEFAULT_TIE_MARGIN, Equivalence, NumericsPolicy, Parting  # noqa: E402
from dflash_shared.manifest_io import load_manifest  # noqa: E402
from dflash_shared.manifests import Kind  # noqa: E402
from dflash_shared.storage import join  # noqa: E402
from tests.evaluate.conftest import vllm_test_env  # noqa: E402

pytestmark = pytest.mark.slow
# Engine dtype on vLLM's CPU build: the offline evaluation's (float32), except for the hybrid target.
ENGINE_DTYPE = {"qwen3": "float32", "qwen3_6": "bfloat16"}


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with vllm_test_env(tmp_path_factory.mktemp("vllm-cache")):
        yield


# The hybrid target's served run (bfloat16 on CPU: ~8 minutes of engine time here) is `extended`: the end-to-end
# test (tests/e2e) runs the same serve check on the Qwen3.6-architecture demo in the default suite, with its
# dtypes, the comparison over prompts decoded alike and the bfloat16 output policy asserted there.
ARCHS = ("qwen3", pytest.param("qwen3_6", marks=pytest.mark.extended))


@pytest.fixture(scope="module", params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def chain(arch: str, request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("offline_run" if arch == "qwen3" else "hybrid_offline_run")


@pytest.fixture(scope="module")
def served(chain: Any, arch: str, request: pytest.FixtureRequest, vllm_env: None) -> tuple[Any, str]:
    target_dir = request.getfixturevalue("tiny_target_dir" if arch == "qwen3" else "hybrid_target_dir")
    output = join(chain.root, "evaluation")
    # The n-gram baseline on the dense target only: one more engine start, and the same code on either target.
    config = ServeCheckConfig(evaluation=chain.evaluation, target=str(target_dir), output=output,
                              gpu_memory_utilization=0.3, enforce_eager=True, ngram_baseline=arch == "qwen3")
    return run(config, chain.store), output


def _check(chain: Any, output: str) -> ServeCheckReport:
    return ServeCheckReport.model_validate_json(chain.store.read_bytes(join(output, REPORT_NAME)))


def test_engine_tau_agrees_with_offline_tau(chain: Any, arch: str, served: tuple[Any, str]) -> None:
    check = _check(chain, served[1])
    offline = OfflineReport.model_validate_json(chain.store.read_bytes(join(chain.evaluation, "evaluation.json")))
    assert check.offline_dtype == offline.dtype == "float32"
    assert check.dtype == ENGINE_DTYPE[arch]
    assert check.num_speculative_tokens == offline.block_size - 1 == 7
    assert check.offline_tau == offline.trained.tau > 2.5
    assert abs(check.engine.tau - offline.trained.tau) / offline.trained.tau == pytest.approx(check.relative_gap)
    if arch == "qwen3":
        assert check.compared == "all" and check.relative_gap <= 0.10
        # Enough drafts for the figure to be stable: every offline step has an engine counterpart.
        assert check.engine.drafts >= 0.9 * offline.trained.steps
    else:
        # Across dtypes: the prompts decoded alike carry the comparison, and they are most of them.
        assert check.compared == "matched"
        assert check.matched.prompts >= 12 and check.matched.relative_gap is not None
        assert check.matched.relative_gap <= 0.10
    assert check.matched.prompts == check.engine_equals_offline
    assert check.engine.draft_tokens == 7 * check.engine.drafts
    assert len(check.engine.acceptance_per_position) == 7
    # Step by step over the prompts decoded alike (serve_steps.py): in float32 every step as offline.
    steps = check.steps
    assert steps is not None and steps.prompts == check.matched.prompts and steps.failure() is None
    if arch == "qwen3":
        assert steps.offline_steps == offline.trained.steps and (steps.differing, steps.first) == (0, None)


def test_the_ngram_baseline_ran_on_the_same_prompts_and_its_figures_add_up(
        chain: Any, arch: str, served: tuple[Any, str]) -> None:
    check = _check(chain, served[1])
    if arch != "qwen3":
        assert check.ngram is None
        return
    ngram = check.ngram
    assert ngram is not None and ngram.settings.prompt_lookup_min <= ngram.settings.prompt_lookup_max
    # Prompt lookup is lossless: float32 greedy output with it equals plain output on every prompt.
    assert ngram.outputs_identical == check.prompts == 16
    assert ngram.output_tokens >= 16 * 8 and 0 < ngram.drafts and 0 <= ngram.accepted_tokens
    assert ngram.tau == pytest.approx(1 + ngram.accepted_tokens / ngram.drafts)
    steps = max(ngram.output_tokens - ngram.accepted_tokens, ngram.drafts + check.prompts)
    assert ngram.tokens_per_step == pytest.approx(ngram.output_tokens / steps)
    # Steps that drafted nothing, and the prefills, count in tokens per step, not in vLLM's tau.
    assert ngram.tokens_per_step <= ngram.tau
    # DFlash drafts on every step after the prefill: its steps are drafts + prompts, a whole number of tokens each.
    per_step = check.engine_tokens_per_step
    assert per_step is not None and 1 < per_step <= check.engine.tau
    tokens = per_step * (check.engine.drafts + check.prompts)
    assert tokens == pytest.approx(round(tokens)) and check.prompts * 8 <= round(tokens) <= check.prompts * 64
    assert "ngram" in check.start_seconds


def test_speculative_output_equals_plain_output(chain: Any, arch: str, served: tuple[Any, str]) -> None:
    check = _check(chain, served[1])
    assert check.prompts == 16
    assert check.output_mismatches == []
    outputs = check.outputs
    assert outputs.policy == NumericsPolicy.at(ENGINE_DTYPE[arch])
    if arch == "qwen3":  # float32: identical token for token
        assert outputs.policy.tie_margin is None and check.outputs_identical == 16 and outputs.partings == []
    assert outputs.prompts == 16 and outputs.identical == check.outputs_identical and outputs.failure() is None
    assert outputs.mismatches == [] and len(outputs.ties) <= outputs.policy.allowed_ties(outputs.near_tie_positions)
    # Every position of the plain outputs was compared; each near-tie was seen by both runs.
    assert outputs.positions >= 16 * 8
    for p in outputs.partings:
        assert p.tie and 0 <= p.speculative_margin <= DEFAULT_TIE_MARGIN  # type: ignore[operator]
        assert 0 <= p.plain_margin <= DEFAULT_TIE_MARGIN  # type: ignore[operator]
    assert check.forced_rounds >= (1 if outputs.partings else 0)


def test_manifest_records_engine_tau_beside_offline_tau(chain: Any, served: tuple[Any, str]) -> None:
    uri, output = served
    loaded = load_manifest(chain.store, output, Kind.evaluation)  # re-hashes both report shards
    offline = load_manifest(chain.store, chain.evaluation, Kind.evaluation)
    check = _check(chain, output)
    section = loaded.manifest.section
    assert uri == join(output, "manifest.json")
    assert section.engine_tau == check.engine.tau
    assert section.tau == offline.manifest.section.tau
    # The same prompts as the offline evaluation: on the dense run, the held-out split of its tokenized data.
    assert section.prompt_split == offline.manifest.section.prompt_split == check.prompt_split
    assert [i.kind for i in loaded.manifest.inputs] == [Kind.evaluation, Kind.drafter]
    assert loaded.manifest.inputs[0].sha256 == offline.sha256


class _Continuations:
    """Below the engine: answers `generate` with fixed continuations per prompt (the forced rounds' requests)."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers, self.requests = answers, []

    def generate(self, prompts: list[Any], params: list[Any], use_tqdm: bool = False) -> list[Any]:
        from types import SimpleNamespace

        del use_tqdm
        out = []
        for prompt, param in zip(prompts, params, strict=True):
            ids = tuple(prompt["prompt_token_ids"])
            self.requests.append((ids, param.max_tokens))
            tokens = self.answers[ids]
            logprobs = [{t: SimpleNamespace(logprob=-0.5)} for t in tokens]
            out.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=logprobs)]))
        return out


def test_the_comparison_goes_on_teacher_forced_past_a_near_tie(offline_run: Any) -> None:
    """After a near-tie at token 2 the speculative engine is asked again from the plain prefix, and the parting
    it then shows at token 5 (not a tie) is found: every position is compared, not only the first parting."""
    from dflash_generate.serve_check.engine_passes import forced_comparison
    from dflash_shared.evaluation_report import OfflineReport

    report = OfflineReport.model_validate_json(offline_run.store.read_bytes(
        join(offline_run.evaluation, "evaluation.json")))
    n = len(report.results)
    near = {9: -0.700, 7: -0.825}
    plain = [Generated(token_ids=[5, 6, 9, 10, 11, 12], top_logprobs=[{5: -0.1}, {6: -0.1}, near, {10: -0.1},
                                                                      {11: -0.1}, {12: -0.1, 13: -3.0}])] * n
    spec = list(plain)
    spec[3] = Generated(token_ids=[5, 6, 7, 1, 2, 3], top_logprobs=[{5: -0.1}, {6: -0.1}, {7: -0.69, 9: -0.80},
                                                                    {1: -0.1}, {2: -0.1}, {3: -0.1}])
    prompt = report.results[3].prompt_token_ids
    llm = _Continuations({(*prompt, 5, 6, 9): [10, 11, 13]})
    outputs, rounds = forced_comparison(llm, report, plain, spec, NumericsPolicy.at("bfloat16"))
    assert rounds == 1 and llm.requests == [((*prompt, 5, 6, 9), report.max_new_tokens - 3)]
    tie, wrong = outputs.partings
    assert (tie.prompt_id, tie.index, tie.speculative_token, tie.plain_token, tie.tie) == (
        report.results[3].id, 2, 7, 9, True)
    assert tie.speculative_margin == pytest.approx(0.11) and tie.plain_margin == pytest.approx(0.125)
    assert (wrong.index, wrong.speculative_token, wrong.plain_token, wrong.tie) == (5, 13, 12, False)
    assert outputs.identical == n - 1 and outputs.positions == 6 * n
    assert "prompt " + report.results[3].id + " at token 5: speculative 13, plain 12" in str(outputs.failure())
    exact, rounds = forced_comparison(_Continuations({}), report, plain, spec, NumericsPolicy.at("float32"))
    assert rounds == 0 and [p.index for p in exact.mismatches] == [2]


def test_across_dtypes_the_gap_is_taken_over_the_prompts_decoded_alike(offline_run: Any) -> None:
    check = _fake_check(offline_run, 2.0, []).model_copy(update={
        "dtype": "bfloat16", "compared": "matched", "relative_gap": 0.5,
        "matched": MatchedAcceptance(prompts=12, offline_tau=3.0, engine_tau=2.9, relative_gap=1 / 30)})
    assert tau_failure(check, 0.5) is None
    few = check.model_copy(update={"matched": check.matched.model_copy(update={"prompts": 7})})
    assert "decoded only 7/16 prompts as the offline loop did (< 50%)" in str(tau_failure(few, 0.5))
    far = check.model_copy(update={"matched": check.matched.model_copy(update={"relative_gap": 0.2})})
    assert "over the 12/16 prompts decoded alike (engine bfloat16, offline float32)" in str(tau_failure(far, 0.5))


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
    (None, ["p7"], r"differs from output without it on 1/16 prompts \(float32: exact equality required\); first: "
                   r"prompt p7 at token 4: speculative 11, plain 12 \(speculative margin not in its top "
                   r"log-probabilities, plain margin 0.5 nats\); prompts \['p7'\]; report: .*serve-check.json"),
])
def test_a_gap_or_an_output_difference_fails_without_committing(
        offline_run: Any, tmp_path: Path, engine_tau: float | None, mismatches: list[str], expected: str) -> None:
    from dflash_generate.serve_check.stage import commit

    offline = load_manifest(offline_run.store, offline_run.evaluation, Kind.evaluation)
    drafter = load_manifest(offline_run.store, offline_run.export, Kind.drafter)
    check = _fake_check(offline_run, engine_tau, mismatches)
    config = ServeCheckConfig(evaluation=offline_run.evaluation, target="unused", output=str(tmp_path / "eval"))
    with pytest.raises(BadInputError, match=expected):
        commit(config, offline_run.store, check, offline, drafter)
    assert (tmp_path / "eval" / REPORT_NAME).is_file()
    assert not (tmp_path / "eval" / "manifest.json").exists()


def test_a_step_difference_fails_naming_the_first_prompt_and_step(offline_run: Any, tmp_path: Path) -> None:
    """The averaged tau agrees here (the fake engine's tau is the offline one); the steps do not."""
    from dflash_generate.serve_check.stage import commit
    from dflash_generate.serve_steps import StepComparison, StepDifference

    offline = load_manifest(offline_run.store, offline_run.evaluation, Kind.evaluation)
    drafter = load_manifest(offline_run.store, offline_run.export, Kind.drafter)
    first = StepDifference(prompt_id="p3", step=2, position=16, offline_accepted=6, engine_accepted=7,
                           engine_drafted=7)
    steps = StepComparison(prompts=16, offline_steps=140, engine_steps=160, differing=28,
                           prompts_differing=["p3", "p7"], first=first, max_step_mismatch_fraction=0.02)
    check = _fake_check(offline_run, None, []).model_copy(update={"steps": steps})
    assert tau_failure(check, 0.5) is None
    config = ServeCheckConfig(evaluation=offline_run.evaluation, target="unused", output=str(tmp_path / "eval"))
    with pytest.raises(BadInputError, match=r"drafter steps differ from the offline loop's on 28/300 steps \(9.3% > "
                       r"2.0%; offline 140, engine 160\) of 2/16 prompts decoded alike; first: prompt p3 step 2 \(at "
                       r"token 16\): offline accepted 6, engine accepted 7 of 7 drafted: training and serving "
                       r"disagree"):
        commit(config, offline_run.store, check, offline, drafter)
    assert not (tmp_path / "eval" / "manifest.json").exists()


def _fake_check(offline_run: Any, engine_tau: float | None, mismatches: list[str]) -> ServeCheckReport:
    """A float32 report on the dense run's offline tau; engine_tau None = the offline tau."""
    from dflash_generate.serve_check.report import EngineAcceptance

    tau = load_manifest(offline_run.store, offline_run.evaluation, Kind.evaluation).manifest.section.tau
    engine_tau = tau if engine_tau is None else engine_tau
    partings = [Parting(prompt_id=m, index=4, speculative_token=11, plain_token=12, speculative_margin=None,
                        plain_margin=0.5, tie=False) for m in mismatches]
    outputs = Equivalence(policy=NumericsPolicy.at("float32"), prompts=16, positions=16 * 64,
                          identical=16 - len(mismatches), partings=partings)
    return ServeCheckReport(
        dtype="float32", offline_dtype="float32", num_speculative_tokens=7, offline_tau=tau,
        engine=EngineAcceptance(tau=engine_tau, drafts=100, draft_tokens=700,
                                accepted_tokens=round(100 * (engine_tau - 1)), acceptance_per_position=[0.5] * 7),
        relative_gap=relative_gap(tau, engine_tau), max_tau_gap=0.1, prompts=16, outputs_identical=16 - len(mismatches),
        output_mismatches=mismatches, outputs=outputs, engine_equals_offline=16, compared="all",
        start_seconds={},
        matched=MatchedAcceptance(prompts=16, offline_tau=tau, engine_tau=engine_tau,
                                  relative_gap=relative_gap(tau, engine_tau)),
    )


def test_an_ngram_lookup_range_upside_down_is_refused_before_any_engine_starts() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="ngram_prompt_lookup_min 5 is above ngram_prompt_lookup_max 2"):
        ServeCheckConfig(evaluation="e", target="t", output="o", ngram_baseline=True, ngram_prompt_lookup_min=5,
                         ngram_prompt_lookup_max=2)
    settings = ServeCheckConfig(evaluation="e", target="t", output="o", ngram_baseline=True).ngram_settings()
    assert settings is not None and settings.speculative_config()["method"] == "ngram"
    assert ServeCheckConfig(evaluation="e", target="t", output="o").ngram_settings() is None
