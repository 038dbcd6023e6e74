"""The demo summary's comparison rows: the trained drafter beside n-gram and the untrained drafter, from the
serving check's report, and nothing when the serving check ran no n-gram baseline."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

from dflash_shared.storage import ObjectStore

REPO = Path(__file__).resolve().parents[1]


def _summary_module():  # demo/ is not a package: load the script as a module
    spec = importlib.util.spec_from_file_location("demo_summary", REPO / "demo" / "summary.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(tmp_path: Path, ngram: dict | None) -> str:
    report = {"prompts": 48, "engine": {"tau": 1.6}, "engine_tokens_per_step": 1.5, "ngram": ngram}
    path = tmp_path / "serve-check.json"
    path.write_text(json.dumps(report))
    return str(path)


def test_rows_show_trained_ngram_and_untrained_with_their_ratios(tmp_path: Path) -> None:
    summary = _summary_module()
    ngram = {"settings": {"prompt_lookup_min": 1, "prompt_lookup_max": 4, "num_speculative_tokens": 3},
             "tau": 1.25, "tokens_per_step": 1.05}
    section = SimpleNamespace(tau=1.55, tau_untrained=1.0)
    rows = summary.speculation_rows(ObjectStore(), section, ["x/evaluation.json", _report(tmp_path, ngram)])
    text = "\n".join(rows)
    assert "on the 48 prompts" in rows[0]
    trained = next(r for r in rows if "DFlash, trained" in r).split()
    assert trained[-3:] == ["1.55", "1.60", "1.50"]  # offline tau, engine tau, tokens per step
    assert "n-gram (lookup 1-4, 3 drafted)" in text and "1.25" in text and "1.05" in text
    assert next(r for r in rows if "untrained" in r).split()[-3:] == ["1.00", "-", "-"]
    assert "trained / n-gram engine tau 1.28x, tokens per step 1.43x" in text


def test_no_rows_without_an_ngram_baseline(tmp_path: Path) -> None:
    summary = _summary_module()
    section = SimpleNamespace(tau=1.55, tau_untrained=1.0)
    assert summary.speculation_rows(ObjectStore(), section, [_report(tmp_path, None)]) == []
    assert summary.speculation_rows(ObjectStore(), section, ["x/evaluation.json"]) == []


def _run_demo_module():
    spec = importlib.util.spec_from_file_location("run_demo", REPO / "demo" / "run_demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_demo_targets_run_file_is_valid_with_its_stage_settings(tmp_path: Path) -> None:
    """The run file each `--target` writes loads with the real stage configs (a mistyped setting fails here,
    not minutes into `make demo`); the speaking target's serving check runs the n-gram baseline."""
    from dflash_pipeline.run.config import load_run_config
    from dflash_pipeline.run.stages import plan, stage_config

    demo = _run_demo_module()
    for target in demo.TARGETS:
        path = tmp_path / f"run-{target}.json"
        path.write_text(json.dumps(demo.run_file(tmp_path / "model", str(tmp_path / "store"), {}, target)))
        run = load_run_config(path)
        assert run.run_id == demo.PER_TARGET[target]["run_id"]
        configs = {stage.name: stage_config(stage, run, run.stages.for_stage(stage.name)) for stage in plan(run)}
        assert configs["serve-check"].get("ngram_baseline", False) is (target == "speaking")


def test_a_mistyped_stage_setting_is_refused(tmp_path: Path) -> None:
    import pytest

    from dflash_pipeline.run.config import load_run_config
    from dflash_pipeline.run.stages import SERVE_CHECK, stage_config
    from dflash_shared.errors import ConfigError

    demo = _run_demo_module()
    config = demo.run_file(tmp_path / "model", str(tmp_path / "store"), {"serve-check": {"ngram_basline": True}})
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    run = load_run_config(path)
    with pytest.raises(ConfigError, match="ngram_basline"):
        stage_config(SERVE_CHECK, run, run.stages.for_stage("serve-check"))
