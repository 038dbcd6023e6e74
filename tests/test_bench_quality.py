"""`bench/bench_quality.py --prompts FILE`: a bad prompts file is named by file and line, nothing is guessed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench():  # bench/ is not a package: load the script as a module (its heavy imports are inside functions)
    spec = importlib.util.spec_from_file_location("bench_quality", REPO / "bench" / "bench_quality.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are defined
    spec.loader.exec_module(module)
    return module


def test_prompts_are_read_as_conversations_without_the_answers(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "old answer"}]}) + "\n\n"
                    + json.dumps({"prompt": "why?"}) + "\n" + json.dumps({"prompt": "third"}) + "\n")
    assert _bench().prompts_from_file(path, 2) == [[{"role": "user", "content": "hi"}],
                                                   [{"role": "user", "content": "why?"}]]


@pytest.mark.parametrize(("content", "message"), [
    ('{"prompt": "a"}\n{"prompt": \n', "prompts.jsonl:2: not a JSON record"),
    ('{"text": "a"}\n', "prompts.jsonl:1: expected 'messages' or 'prompt'"),
    ('["a"]\n', "prompts.jsonl:1: expected a JSON object"),
    ("\n", "prompts.jsonl: no prompts"),
])
def test_a_bad_prompts_file_names_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        _bench().prompts_from_file(path, 10)


def test_each_speaking_bench_drafts_from_a_run_file_the_stages_accept(tmp_path: Path) -> None:
    """The long-answer bench changes the demo's run file (longer answers, rows and training): every changed
    setting must be a field of its stage's config model, as a cluster run's render checks it."""
    from dflash_pipeline import parse_run_config, render_documents
    from dflash_shared.errors import ConfigError

    sys.path.insert(0, str(REPO / "demo"))
    from run_demo import run_file

    def rendered(overrides: dict[str, dict[str, object]]) -> list[dict[str, object]]:
        config = run_file(tmp_path, "s3://bench/quality", overrides, "speaking")  # a local target: sized by its files
        return render_documents(parse_run_config({**config, "images": {"tag": "bench"}}))

    bench = _bench()
    assert set(bench.SPEAKING_BENCHES) == {"docs", "code"}
    for speaking in bench.SPEAKING_BENCHES.values():
        assert rendered(speaking.overrides)
    code = bench.SPEAKING_BENCHES["code"].overrides
    with pytest.raises(ConfigError, match="max_lenght"):
        rendered({**code, "train": {**code["train"], "max_lenght": 512}})


def test_each_drafter_trial_changes_only_the_train_settings_it_names(tmp_path: Path) -> None:
    """bench_drafter_trials.py: every trial's run file is its speaking bench's (both targets) with one change to
    the train stage's config, which the stages accept (its drafter overrides included), reading the bench's own
    completions."""
    sys.path.insert(0, str(REPO / "demo"))
    from run_demo import run_file

    trials = _trials()
    for key, speaking in _bench().SPEAKING_BENCHES.items():
        bench_run = run_file(tmp_path, "s3://bench/quality", speaking.overrides, "speaking")
        for name, changes in trials.TRIALS.items():
            _check_trial(trials.trial_run(bench_run, tmp_path / key, name, changes), bench_run, tmp_path / key,
                         name, changes)


def _check_trial(run: dict, bench_run: dict, bench_dir: Path, name: str, changes: dict) -> None:
    from dflash_pipeline import parse_run_config, render_documents
    from dflash_train.config import TrainConfig

    assert run["source"] == {"kind": "completions",
                             "uri": str(bench_dir / "store" / "bench-quality" / "completions")}
    assert run["root"] == str(bench_dir.parent / "trials" / bench_dir.name / name / "store")
    train = run["stages"]["train"]["config"]
    before = bench_run["stages"]["train"]["config"]
    assert {k: v for k, v in train.items() if k not in changes} == {
        k: v for k, v in before.items() if k not in changes}
    for k, v in changes.items():  # a dict change (drafter_overrides) replaces only the keys it names
        if isinstance(v, str):  # a path under the bench's --work-dir (a warm start's export, maybe the other
            # speaking target's)
            other = _trials().OTHER_TARGET[bench_dir.name]
            v = v.format(work_dir=bench_dir.parent, other=other)
            assert "{other}" not in changes[k] or f"/trials/{other}/" in v, (name, v)
        assert train[k] == ({**before.get(k, {}), **v} if isinstance(v, dict) else v), (name, k)
    assert {k: v for k, v in run["stages"].items() if k != "train"} == {
        k: v for k, v in bench_run["stages"].items() if k != "train"}
    config = TrainConfig.model_validate({**train, "input": "/in", "output": "/out", "target": "/t"})
    assert config.max_steps == train["max_steps"], name
    assert render_documents(parse_run_config({**run, "root": "s3://bench/trials", "images": {"tag": "bench"}}))


def test_the_long_answer_prompts_are_held_out_of_the_target_and_the_drafter() -> None:
    from tests.support import stdlib_code

    heldout, train = _bench().speaking_prompts(stdlib_code, 48, 4200)
    target_heldout = {p.question for p in stdlib_code.split_pairs("heldout")}
    assert len(heldout) == 48 and set(heldout) <= target_heldout
    assert not set(heldout) & set(train)
    assert len(train) == len(stdlib_code.code_pairs()) - 48  # every other question trains the drafter


def _run(bench: Any, tau: float, per_step: float, per_position: list[float] | None = None) -> Any:
    # tokens_per_step follows from tokens, accepted and drafts: 100 tokens, 0 drafts beyond the prompts.
    accepted = round(100 - 100 / per_step)
    return bench.MethodRun(method="m", settings="s", tau=tau, drafts=0, accepted_per_position=per_position or [],
                           accepted=accepted, tokens=100, seconds=1.0, start_seconds=0.0, outputs=[], prompts=1)


def test_goals_print_met_or_missed_and_by_how_much(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    trained = _run(bench, 3.3, 2.5, [0.8, 0.6, 0.4])
    ngram, untrained = _run(bench, 1.5, 1.25), _run(bench, 1.0, 1.0)
    goals = (bench.Goal("tau", 3.0), bench.Goal("tok/step", 2.0, "n-gram"), bench.Goal("tau", 4.0, "untrained"))
    bench.print_goals(goals, trained, ngram, untrained)
    out = capsys.readouterr().out
    assert "trained tau" in out and "3.30   goal >= 3.0: met by 10%" in out
    assert "trained tok/step / n-gram tok/step" in out and "2.00x  goal >= 2.0x: met by 0%" in out
    assert "3.30x  goal >= 4.0x: MISSED by 18%" in out
    assert "1:1.80 2:2.40 3:2.80" in out  # tau by drafted positions: 1 + the first k acceptance rates


def _trials() -> Any:
    spec = importlib.util.spec_from_file_location("bench_drafter_trials", REPO / "bench" / "bench_drafter_trials.py")
    assert spec is not None and spec.loader is not None
    trials = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trials)
    return trials


def test_trials_compare_cost_in_cpu_seconds_where_both_have_them() -> None:
    """A busy machine stretches wall-clock seconds, not CPU seconds: the equal-time rule compares CPU seconds when the
    trial and its baseline both recorded them, and falls back to the training's wall-clock time only otherwise; the
    CPU seconds counted are those of the processes the script waited for."""
    import subprocess

    trials = _trials()
    baseline = {"train_seconds": 1200.0, "cpu_seconds": 1000.0}
    busier = {"train_seconds": 1800.0, "cpu_seconds": 1050.0}  # same work per step, on busier cores
    assert trials.training_cost(busier, baseline) == (1050.0, 1000.0)
    assert trials.training_cost({"train_seconds": 1800.0, "cpu_seconds": float("nan")}, baseline) == (1800.0, 1200.0)
    before = trials.children_cpu_seconds()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    assert trials.children_cpu_seconds() - before > 0.05


def test_a_trials_pace_is_timed_over_spans_of_log_lines(tmp_path: Path) -> None:
    """The train log's stamps are whole seconds: steps of 0.4 s, each on a line of its own, are not 0 s a step."""
    trials = _trials()
    log = tmp_path / "train-0.log"
    log.write_text("".join(f"2026-12-07T13:00:{int(step * 0.4):02d}Z INFO [train rank=0] x.metrics: step {step}/100 "
                           "(1%) loss 1.0\n" for step in range(1, 101)))
    assert trials.seconds_per_step(log) == pytest.approx(0.4, abs=0.03)


def test_the_trials_run_the_quality_benchs_setup_with_every_option_it_reads() -> None:
    """The trials call `speaking_measured` with options of their own making: each option it reads must be there,
    with the bench's default (an option added to the bench once broke every trial before its first step)."""
    import ast
    import inspect

    bench = _bench()
    setup = _trials().trials_setup(bench.build_parser())
    tree = ast.parse(inspect.getsource(bench.speaking_measured))
    read = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args"}
    assert {"heldout", "train_prompts", "fixture_drafter", "drafter", "max_new_tokens"} <= read
    assert all(hasattr(setup, name) for name in read), read - set(vars(setup))
    assert setup.heldout == 48 and setup.drafter is None and not setup.fixture_drafter
