"""The numerics policy of "lossless" in the evaluate stage, in bfloat16 on CPU (as it runs on a GPU).

The session's bfloat16 chains (conftest: dense Qwen3 and Qwen3.6 hybrid targets) check every prompt of the trained
drafter and the first 2 of the untrained one against the target's own greedy output: both pass. Then the stage runs
again with a deliberately lossy verifier (tests/support/lossy_verifiers.py) in place of exact greedy acceptance,
once accepting wrong drafts at near-ties and once at 1% of random positions: both runs fail (exit 65), naming the
parting, and commit nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dflash_shared.errors import BadInputError, exit_code_for
from dflash_shared.evaluation_report import OfflineReport
from dflash_shared.lossless import DEFAULT_TIE_MARGIN
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind
from dflash_shared.storage import join
from dflash_train.evaluate import speculate
from tests.support.lossy_verifiers import LossyVerifier, NearTieRule, RandomRule

pytestmark = pytest.mark.slow


def _report(run: Any) -> OfflineReport:
    loaded = load_manifest(run.store, run.evaluation, Kind.evaluation)
    return OfflineReport.model_validate_json(run.store.read_bytes(loaded.manifest.shards[0].uri))


@pytest.mark.parametrize(("chain", "checked", "untrained"), [("bf16_run", 8, 2), ("hybrid_bf16_run", 4, 1)])
def test_trained_and_untrained_drafters_pass_in_bfloat16(chain: str, checked: int, untrained: int,
                                                         request: pytest.FixtureRequest) -> None:
    report = _report(request.getfixturevalue(chain))
    assert report.dtype == "bfloat16"
    for check, prompts in ((report.lossless, checked), (report.lossless_untrained, untrained)):
        assert check is not None and check.failure() is None
        assert check.policy.tie_margin == DEFAULT_TIE_MARGIN and check.prompts == prompts
        # Every position of every checked prompt was compared (teacher-forced past any near-tie).
        assert check.positions == sum(len(r.output_token_ids) for r in report.results[:prompts])
        assert check.mismatches == [] and all(p.tie for p in check.partings)
    assert report.lossless_checked == checked and report.lossless_mismatches == []


# The random rule gets its chances where drafts are rejected: with the untrained drafter on every prompt too
# (about one rejection per token), it meets a few hundred of them.
@pytest.mark.parametrize(("rule", "baseline_prompts"), [(NearTieRule(DEFAULT_TIE_MARGIN), 0),
                                                        (RandomRule(0.01, seed=3), 8)],
                         ids=["wrong-at-near-ties", "wrong-at-1pct-random"])
def test_a_lossy_verifier_fails_the_evaluate_stage(rule: Any, baseline_prompts: int, bf16_run: Any,
                                                   tiny_target_dir: Path,
                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_train.evaluate.config import EvaluateConfig
    from dflash_train.evaluate.stage import run
    from tests.evaluate.conftest import BF16_EVALUATE

    monkeypatch.setattr(speculate, "greedy_verifier", LossyVerifier(rule))
    out = str(tmp_path / "evaluation")
    config = EvaluateConfig(preset="debug", drafter=bf16_run.export, prompts=bf16_run.prompts,
                            target=str(tiny_target_dir), output=out, threads=1, lossless_prompts=8, min_tau=0,
                            **{**BF16_EVALUATE, "baseline_prompts": baseline_prompts})
    with pytest.raises(BadInputError) as err:
        run(config, bf16_run.store)
    assert rule.wrong_accepts >= 1  # the double did accept wrong drafts
    message = str(err.value)
    assert "drafter) is not lossless: greedy output with speculative decoding differs from output without it on" \
        in message
    assert "(bfloat16: near-ties in both runs within 0.25 nats" in message and "speculative margin" in message
    assert int(exit_code_for(err.value)) == 65
    assert not (tmp_path / "evaluation" / "manifest.json").exists()
    report = OfflineReport.model_validate_json(bf16_run.store.read_bytes(join(out, "evaluation.json")))
    found = [p for check in (report.lossless, report.lossless_untrained) if check is not None
             for p in check.mismatches]
    assert found
    # A wrong acceptance the verifier's own distribution ranks below the target's token: never a near-tie.
    first = found[0]
    assert first.speculative_margin is None or first.speculative_margin < 0
