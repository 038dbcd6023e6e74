"""The pipeline reads each stage's settings from the stage's own config model: names, defaults, variables.

Render checks the run file's overrides against the model's fields and names the variables by its env_prefix;
plan and status size the run with its defaults. Each test holds the pipeline's figure against the model imported
here directly from its package, so a default or a prefix changed in a stage shows up in the pipeline at once.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from typing import Any

import pytest

from dflash_generate.config import GenerateConfig
from dflash_generate.serve_check.config import ServeCheckConfig
from dflash_generate.target import TargetInfo
from dflash_pipeline import parse_run_config, render_documents
from dflash_pipeline.plan.run_plan import build_plan
from dflash_pipeline.run.config import RunConfig, read_run_file
from dflash_pipeline.run.stages import (
    EVALUATE,
    EXPORT,
    GENERATE,
    IMPORT_COMPLETIONS,
    IMPORT_PROMPTS,
    SERVE_CHECK,
    TOKENIZE,
    TRAIN,
    StageDef,
    plan,
    stage_config,
    stage_values,
)
from dflash_shared.errors import ConfigError
from dflash_shared.importing import ImportConfig
from dflash_shared.settings import StageSettings, env_name
from dflash_tokenize.config import TokenizeConfig
from dflash_train.config import TrainConfig
from dflash_train.evaluate.config import EvaluateConfig
from dflash_train.export.config import ExportConfig
from tests.pipeline.k8s_support import EXAMPLE_RUN, REPO_ROOT, containers, env_of, jobs

MODELS: dict[str, type[StageSettings]] = {
    "import": ImportConfig, "generate": GenerateConfig, "tokenize": TokenizeConfig, "train": TrainConfig,
    "export": ExportConfig, "evaluate": EvaluateConfig, "serve-check": ServeCheckConfig,
}
ALL_STAGES = (IMPORT_PROMPTS, IMPORT_COMPLETIONS, GENERATE, TOKENIZE, TRAIN, EXPORT, EVALUATE, SERVE_CHECK)
# What the stage images hold and the pipeline image does not: no config module may need one of these.
HEAVY = ("torch", "vllm", "transformers", "tokenizers", "huggingface_hub", "safetensors", "numpy", "jinja2",
         "zstandard", "orjson", "tqdm", "tensorboard", "fla", "triton")


def default(model: type[StageSettings], field: str) -> Any:
    return model.model_fields[field].get_default(call_default_factory=True)


def bare_run() -> RunConfig:
    """The example run without any stage config override: every stage on its config's defaults."""
    data = read_run_file(EXAMPLE_RUN)
    data["stages"] = {name: {k: v for k, v in table.items() if k != "config"} for name, table in data["stages"].items()}
    return parse_run_config(data)


@pytest.mark.parametrize("stage", ALL_STAGES, ids=lambda s: s.config_class)
def test_each_stage_reads_its_packages_own_config(stage: StageDef) -> None:
    model = MODELS[stage.name]
    assert stage.config_model() is model
    assert stage.config_fields() == set(model.model_fields)
    assert stage.env_name("output") == env_name(model, "output") == f"{model.model_config['env_prefix']}OUTPUT"


def test_rendered_variables_are_named_by_each_configs_own_prefix() -> None:
    run = parse_run_config(read_run_file(EXAMPLE_RUN))
    by_stage = jobs(render_documents(run))
    for stage in plan(run):
        config = stage_config(stage, run, run.stages.for_stage(stage.name))
        own = {env_name(MODELS[stage.name], key) for key in config}
        prefix = str(MODELS[stage.name].model_config["env_prefix"])
        (main,) = containers(by_stage[stage.name])
        rendered = {name for name in env_of(main) if name.startswith(prefix)}
        assert rendered == own, stage.name


def test_sizing_values_are_the_configs_defaults_where_the_run_file_sets_none() -> None:
    run = bare_run()
    derived = {"generate": {"training_window"}, "tokenize": {"workers"}, "evaluate": {"prompts", "device"},
               "train": {"device"}}
    for stage in plan(run):
        model, values = MODELS[stage.name], stage_values(run, stage)
        for field, info in model.model_fields.items():
            if field in derived.get(stage.name, set()):
                continue
            if info.is_required():
                assert field not in values, (stage.name, field)
            else:
                assert values[field] == default(model, field), (stage.name, field)


def test_the_plan_decodes_and_trains_as_the_stage_defaults_say() -> None:
    run = bare_run()
    rows = {s.stage: s for s in build_plan(run).stages}
    decoded = f"{default(EvaluateConfig, 'num_prompts')} prompts x {default(EvaluateConfig, 'max_new_tokens')} tokens"
    # The serving check replays the offline evaluation's prompts at its budget.
    assert rows["evaluate"].work == rows["serve-check"].work == decoded
    assert f", {default(TrainConfig, 'epochs')} epochs" in rows["train"].work
    keep, cache = default(TrainConfig, "keep_checkpoints"), default(TrainConfig, "cache_gib")
    assert rows["train"].store_bytes == keep * 2e9 * 16
    assert rows["train"].scratch_bytes_per_pod == pytest.approx(build_plan(run).figures["target bytes"].value
                                                               + cache * 2**30)


def test_the_plan_budgets_generation_as_the_generate_stage_settles_it() -> None:
    run = bare_run()
    figures = build_plan(run).figures
    # Neither the run file nor the pipeline sets generate's limits or window: the config's defaults settle them.
    settled = GenerateConfig(input="s3://b/p", output="s3://b/c", model="s3://b/m").settle(TargetInfo(family="qwen3"))
    prompt = figures["mean prompt tokens"].value
    budget = min(settled.max_new_tokens, settled.max_model_len - prompt)
    assert figures["completion budget per prompt"].value == pytest.approx(budget)


def test_a_stage_config_that_cannot_be_imported_names_the_package_to_install() -> None:
    run = parse_run_config(read_run_file(EXAMPLE_RUN))
    absent = dataclasses.replace(TRAIN, config_class="dflash_absent.config:AbsentConfig")
    for check in (lambda: stage_config(absent, run, run.stages.train), lambda: stage_values(run, absent)):
        with pytest.raises(ConfigError, match=re.escape("install dflash-absent (jobs/absent)")):
            check()


def test_every_stage_config_imports_without_the_stages_runtime_libraries() -> None:
    """The pipeline image installs the stage packages without their runtime dependencies (pyproject's `stage`
    extra): importing their config modules must not need any of them."""
    code = f"""
import sys
HEAVY = {HEAVY!r}
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HEAVY:
            raise ImportError(f"{{name}} is not in the pipeline image", name=name)
sys.meta_path.insert(0, Refuse())
from dflash_pipeline.run import stages
for stage in (stages.IMPORT_PROMPTS, stages.GENERATE, stages.TOKENIZE, stages.TRAIN, stages.EXPORT,
              stages.EVALUATE, stages.SERVE_CHECK):
    assert stage.config_fields(), stage.name
import dflash_generate.chunks, dflash_generate.config
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
