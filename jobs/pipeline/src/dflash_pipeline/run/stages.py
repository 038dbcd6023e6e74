"""The stages a run is made of: image, command, config model, and how each is wired to the layout.

A `StageDef` says everything the Job builder needs to know about one stage; adding a stage is one more
`StageDef` (and a `JobSettings` field in `StagesSettings`). `wiring` returns the stage config fields the
pipeline sets itself (input and output prefixes, target model, run id); run files cannot override those,
so two stages can never disagree about where data is.

Each stage's config is its package's own model (`config_class`), imported as it is: its field names check the
run file's overrides, its defaults size the plan, its env_prefix names the variables. The stage packages are
installed beside the pipeline for this, without their runtime dependencies (the pipeline image installs them
with --no-deps): their config modules import no torch, vLLM or tokenizer library. Where one is missing, every
command that needs its config fails with a ConfigError naming the package, never skipping the check.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_pipeline.run.config import JobSettings, RunConfig, quantity_value
from dflash_pipeline.run.layout import EXPORT_FOLDER, SERVING_FOLDER, RunLayout, layout
from dflash_shared.errors import ConfigError
from dflash_shared.manifests import Kind
from dflash_shared.settings import StageSettings, env_name, env_value
from dflash_shared.target_family import TargetFamily, family_of_model_id

# Entry point of every stage image: preflight, then the stage, both configured by environment variables (with
# a command as its first argument, that command alone); it keeps the pod's log in the store (`jobs.log_env`).
IMAGE_ENTRYPOINT = "/opt/dflash/entrypoint.sh"
# Settings every sharded command reads from the Job instead (JOB_COMPLETION_INDEX, DFLASH_NUM_SHARDS).
SHARD_FIELDS = frozenset({"shard_index", "num_shards"})

Wiring = Callable[[RunConfig, RunLayout, JobSettings], dict[str, Any]]


def _no_defaults(run: RunConfig, lay: RunLayout, settings: JobSettings) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class StageDef:
    """One stage as the cluster sees it."""

    name: str  # Job name suffix and the key of its settings in RunConfig.stages
    image: str  # image name: docker/<image>/Dockerfile, tagged dflash-<image>
    command: tuple[str, ...]  # container command
    config_class: str  # "module:Class" of the stage's config (its package's own model)
    input_kind: Kind | None  # the upstream manifest kind (None: reads external data)
    output_kind: Kind
    wiring: Wiring
    # Config values derived from the run and the Job's settings that a run file may still override.
    defaults: Wiring = _no_defaults
    # Run folders of the input and the output where they are not named by the manifest kind (export).
    input_folder: str | None = None
    output_folder: str | None = None
    # False: one process group per Job instead of independent shards (no DFLASH_NUM_SHARDS, shards = 1).
    sharded: bool = True
    # What torchrun starts on every rank ("-m", "<package>", "<command>") when a pod has several GPUs or
    # the Job several nodes; None: the stage is never launched with torchrun.
    rank_command: tuple[str, ...] | None = None
    # True: the stage copies the target model into its scratch emptyDir, which is then sized for it.
    copies_target: bool = False

    def config_model(self) -> type[StageSettings]:
        """The stage's config model; a ConfigError naming the package to install where it cannot be imported."""
        return _config_model(self.name, self.config_class)

    def config_fields(self) -> set[str]:
        return set(self.config_model().model_fields)

    def config_defaults(self) -> dict[str, Any]:
        """The stage config's own defaults, by field (fields without a default are left out)."""
        return {name: info.get_default(call_default_factory=True)
                for name, info in self.config_model().model_fields.items() if not info.is_required()}

    def env_name(self, field: str) -> str:
        """The environment variable the stage reads `field` from (its config's env_prefix + the field)."""
        return env_name(self.config_model(), field)

    def output_prefix(self, lay: RunLayout) -> str:
        return lay.folders[self.output_folder or self.output_kind.value]

    def output_manifest(self, lay: RunLayout) -> str:
        return lay.manifests[self.output_folder or self.output_kind.value]

    def input_manifest(self, lay: RunLayout) -> str | None:
        """The upstream manifest this stage waits for (None: it reads external data)."""
        if self.input_kind is None:
            return None
        return lay.manifests[self.input_folder or self.input_kind.value]

    def environment(self, config: dict[str, Any]) -> dict[str, str]:
        """`config` as the variables the stage reads it from (its DFLASH_<STAGE>_* names)."""
        return {self.env_name(key): env_value(value) for key, value in config.items()}


@functools.cache
def _config_model(stage: str, config_class: str) -> type[StageSettings]:
    module_name, _, class_name = config_class.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        package = module_name.partition(".")[0]
        source = "shared" if package == "dflash_shared" else f"jobs/{package.removeprefix('dflash_')}"
        raise ConfigError(
            f"the {stage} stage's config {config_class} cannot be imported ({err}): install "
            f"{package.replace('_', '-')} ({source}) beside dflash-pipeline; its config needs neither torch nor "
            f"vLLM (`pip install --no-deps {source}`)"
        ) from err
    model: type[StageSettings] = getattr(module, class_name)
    return model


def _import_wiring(kind: Kind) -> Wiring:
    def wiring(run: RunConfig, lay: RunLayout, _settings: JobSettings) -> dict[str, Any]:
        wired: dict[str, Any] = {"source": run.source.uri, "output": lay.prefix(kind), "run_id": run.run_id}
        if kind is Kind.prompts:
            # Each prompt counted as generate will render it; one generate could not answer is refused here.
            context = generation_budget(run)[1]
            wired.update(tokenizer=run.target.uri, enable_thinking=run.target.enable_thinking,
                         max_prompt_tokens=context - 1)
        return wired

    return wiring


def target_family(run: RunConfig) -> TargetFamily:
    """The target's family from its model id alone (the pipeline reads no target files)."""
    return family_of_model_id(run.target.model_id)


def generation_budget(run: RunConfig) -> tuple[int, int]:
    """(max_new_tokens, max_model_len) as the generate stage will settle them for this run (its own rule,
    `generation_limits`, over the run file's values)."""
    generate = stage_values(run, GENERATE)
    # The generate config's module is importable once stage_values has read its model.
    from dflash_generate.config import generation_limits

    max_new, context = generation_limits(target_family(run).name, bool(generate["cap_to_training_window"]),
                                         int(generate["training_window"]), generate["max_new_tokens"],
                                         generate["max_model_len"])
    return int(max_new), int(context)


def _generate_wiring(run: RunConfig, lay: RunLayout, settings: JobSettings) -> dict[str, Any]:
    return {
        "input": lay.prompts,
        "output": lay.completions,
        "model": run.target.uri,
        "enable_thinking": run.target.enable_thinking,
        # One engine per pod spanning all of its GPUs.
        "tensor_parallel_size": settings.gpus or None,
    }


def training_window(run: RunConfig) -> int | None:
    """The run file's training window: the train stage's max_length, else the tokenize stage's; None when
    neither sets one (the stages' shared default, dflash_shared.window.DEFAULT_TRAINING_WINDOW, holds then)."""
    for settings in (run.stages.train, run.stages.tokenize):
        value = settings.config.get("max_length")
        if value is not None:
            return int(value)  # type: ignore[arg-type]
    return None


def _generate_defaults(run: RunConfig, _: RunLayout, __: JobSettings) -> dict[str, Any]:
    # The budget follows the window training reads, so no token is generated that no step reads (the stage
    # caps each completion to its training_window by default).
    window = training_window(run)
    return {} if window is None else {"training_window": window}


def _tokenize_wiring(run: RunConfig, lay: RunLayout, _: JobSettings) -> dict[str, Any]:
    return {
        "input": lay.completions,
        "output": lay.tokenized,
        "tokenizer": run.target.uri,
        "model_id": run.target.model_id,
        "model_revision": run.target.revision,
        "run_id": run.run_id,
        "enable_thinking": run.target.enable_thinking,
    }


def _tokenize_defaults(run: RunConfig, __: RunLayout, settings: JobSettings) -> dict[str, Any]:
    # Inside a pod the CPU affinity spans the whole node; the request is what the pod may really use.
    defaults: dict[str, Any] = {"workers": max(1, math.floor(quantity_value(settings.cpu)))}
    # Records are cut where the train stage's rows end, not shorter (train reads the tokenized max_length).
    window = training_window(run)
    if window is not None:
        defaults["max_length"] = window
    return defaults


def _train_wiring(run: RunConfig, lay: RunLayout, _: JobSettings) -> dict[str, Any]:
    return {"input": lay.tokenized, "output": lay.drafter, "target": run.target.uri, "run_id": run.run_id}


def _on_gpus(_: RunConfig, __: RunLayout, settings: JobSettings) -> dict[str, Any]:
    # A GPU pod that came up without its GPUs must fail, not run on the CPU for weeks.
    return {"device": "cuda"} if settings.gpus else {}


def _export_wiring(run: RunConfig, lay: RunLayout, _: JobSettings) -> dict[str, Any]:
    return {"drafter": lay.drafter, "output": lay.export, "target": run.target.uri}


def _evaluate_wiring(run: RunConfig, lay: RunLayout, _: JobSettings) -> dict[str, Any]:
    return {"drafter": lay.export, "output": lay.evaluation, "target": run.target.uri, "run_id": run.run_id}


def _evaluate_defaults(run: RunConfig, lay: RunLayout, settings: JobSettings) -> dict[str, Any]:
    # The run's own tokenized data, of which evaluate decodes the held-out split (records of the training
    # distribution that training never read); `split: train` in a run file measures on trained records instead.
    return {"prompts": lay.tokenized, **_on_gpus(run, lay, settings)}


def _serve_check_wiring(run: RunConfig, lay: RunLayout, settings: JobSettings) -> dict[str, Any]:
    return {"evaluation": lay.evaluation, "output": lay.serving, "target": run.target.uri, "run_id": run.run_id,
            # One engine per pod spanning all of its GPUs, like generate.
            "tensor_parallel_size": settings.gpus or None}


IMPORT_COMPLETIONS = StageDef(
    name="import", image="tokenizer", command=(IMAGE_ENTRYPOINT, "import"),
    config_class="dflash_shared.importing:ImportConfig", input_kind=None, output_kind=Kind.completions,
    wiring=_import_wiring(Kind.completions),
)
# Prompts are imported in the tokenizer image too: import needs neither torch nor vLLM, and the target's tokenizer
# counts each prompt there.
IMPORT_PROMPTS = StageDef(
    name="import", image="tokenizer", command=(IMAGE_ENTRYPOINT, "import-prompts"),
    config_class="dflash_shared.importing:ImportConfig", input_kind=None, output_kind=Kind.prompts,
    wiring=_import_wiring(Kind.prompts),
)
GENERATE = StageDef(
    name="generate", image="generator", command=(IMAGE_ENTRYPOINT,),
    config_class="dflash_generate.config:GenerateConfig", input_kind=Kind.prompts, output_kind=Kind.completions,
    wiring=_generate_wiring, defaults=_generate_defaults, copies_target=True,
)
TOKENIZE = StageDef(
    name="tokenize", image="tokenizer", command=(IMAGE_ENTRYPOINT,),
    config_class="dflash_tokenize.config:TokenizeConfig", input_kind=Kind.completions, output_kind=Kind.tokenized,
    wiring=_tokenize_wiring, defaults=_tokenize_defaults,
)

TRAIN = StageDef(
    name="train", image="trainer", command=(IMAGE_ENTRYPOINT,),
    config_class="dflash_train.config:TrainConfig", input_kind=Kind.tokenized, output_kind=Kind.drafter,
    wiring=_train_wiring, defaults=_on_gpus, sharded=False, rank_command=("-m", "dflash_train", "run"),
    copies_target=True,
)
# The serving files of the trained drafter (CPU): what engines load, and what evaluate measures.
EXPORT = StageDef(
    name="export", image="trainer", command=(IMAGE_ENTRYPOINT, "export"),
    config_class="dflash_train.export.config:ExportConfig", input_kind=Kind.drafter, output_kind=Kind.drafter,
    wiring=_export_wiring, sharded=False, output_folder=EXPORT_FOLDER,
)
# Acceptance of the exported drafter with the offline speculative loop (one GPU); below `min_tau` it exits
# BAD_INPUT and the Job fails without retries.
EVALUATE = StageDef(
    name="evaluate", image="trainer", command=(IMAGE_ENTRYPOINT, "evaluate"),
    config_class="dflash_train.evaluate.config:EvaluateConfig", input_kind=Kind.drafter,
    output_kind=Kind.evaluation, wiring=_evaluate_wiring, defaults=_evaluate_defaults, sharded=False,
    input_folder=EXPORT_FOLDER, copies_target=True,
)

# The exported drafter in the real engine (generator image, one GPU): engine tau from vLLM's own counters
# against the offline tau, and output with speculation against output without; a disagreement exits
# BAD_INPUT (training and serving differ) and the Job fails without retries.
SERVE_CHECK = StageDef(
    name="serve-check", image="generator", command=(IMAGE_ENTRYPOINT, "serve-check"),
    config_class="dflash_generate.serve_check.config:ServeCheckConfig",
    input_kind=Kind.evaluation, output_kind=Kind.evaluation, wiring=_serve_check_wiring, sharded=False,
    output_folder=SERVING_FOLDER, copies_target=True,
)


def plan(run: RunConfig) -> list[StageDef]:
    """The stages of the run, upstream first."""
    if run.source.kind == "prompts":
        return [IMPORT_PROMPTS, GENERATE, TOKENIZE, TRAIN, EXPORT, EVALUATE, SERVE_CHECK]
    return [IMPORT_COMPLETIONS, TOKENIZE, TRAIN, EXPORT, EVALUATE, SERVE_CHECK]


def selected_stages(run: RunConfig, only: list[str] | None = None) -> list[StageDef]:
    """The stages of the run, upstream first; `only` restricts them to the named stages."""
    stages = plan(run)
    names = [s.name for s in stages]
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise ConfigError(f"unknown stage(s) {', '.join(unknown)}; this run has {', '.join(names)}")
    return [s for s in stages if not only or s.name in only]


@dataclass(frozen=True)
class StageWiring:
    """A stage as its workload gets it: its config (and as the variables the stage reads), and the prefixes it
    reads, writes and keeps its logs in."""

    config: dict[str, Any]  # `stage_config`
    environment: dict[str, str]  # `config` by variable name (`StageDef.environment`)
    output_prefix: str
    input_manifest: str | None  # None: the stage reads external data
    log_prefix: str


def stage_wiring(stage: StageDef, run: RunConfig, settings: JobSettings, lay: RunLayout) -> StageWiring:
    """The stage's config and prefixes in this run (laid out as `lay`), resolved once for its Job (or JobSet)
    and pods."""
    config = _checked_config(stage, run, lay, settings)
    return StageWiring(config=config, environment=stage.environment(config), output_prefix=stage.output_prefix(lay),
                       input_manifest=stage.input_manifest(lay), log_prefix=lay.logs(stage.name))


def stage_config(stage: StageDef, run: RunConfig, settings: JobSettings) -> dict[str, Any]:
    """The stage config the pipeline passes: its wiring, its defaults, then the run file's overrides, checked.

    Overrides may replace defaults but not wired fields or the shard fields, and every key must be one of the stage
    config's fields (the stage would refuse the variable at start anyway, but a render-time error names the run
    file instead of a pod log).
    """
    return _checked_config(stage, run, layout(run.root, run.run_id), settings)


def _checked_config(stage: StageDef, run: RunConfig, lay: RunLayout, settings: JobSettings) -> dict[str, Any]:
    wired = {k: v for k, v in stage.wiring(run, lay, settings).items() if v is not None}
    where = f"stages.{stage.name}.config"
    for key in settings.config:
        top = key.split("__")[0]
        if top in wired:
            # The usual reason to set an input: data another run made, which the import reads (and copies).
            hint = ("; to start from another run's output, set [source] uri to its prefix (source.kind = "
                    "\"completions\" keeps its token ids)" if top in ("input", "source") else "")
            raise ConfigError(f"{where}.{key} is set by the pipeline ({stage.env_name(top)}={wired[top]}); remove "
                              f"it{hint}")
        if top in SHARD_FIELDS:
            raise ConfigError(f"{where}.{key}: shards come from stages.{stage.name}.shards and the Job's index")
    chosen = {**stage.defaults(run, lay, settings), **settings.config}
    fields = stage.config_fields()
    unknown = sorted(k for k in [*wired, *chosen] if k.split("__")[0] not in fields)
    if unknown:
        raise ConfigError(
            f"{where}: {', '.join(unknown)} not a field of {stage.config_class} (fields: {', '.join(sorted(fields))})"
        )
    return {**wired, **dict(sorted(chosen.items()))}


def stage_values(run: RunConfig, stage: StageDef) -> dict[str, Any]:
    """The stage config's values for sizing and progress, as far as the run settles them: the run file's
    overrides, over the pipeline's defaults for the stage (`StageDef.defaults`, such as generate's
    training_window), over the config's own defaults. Wired fields and fields without a default are absent."""
    settings = run.stages.for_stage(stage.name)
    derived = stage.defaults(run, layout(run.root, run.run_id), settings)
    given = {k: v for k, v in {**derived, **settings.config}.items() if v is not None}
    return {**stage.config_defaults(), **_preset(stage, given.get("preset")), **given}


def _preset(stage: StageDef, name: Any) -> dict[str, Any]:
    """A named preset's values (train's `debug`: DEBUG_PRESET beside its config), which the stage applies under
    the given settings; the plan must size with them, not with the defaults they replace."""
    if name in (None, "none"):
        return {}
    module = importlib.import_module(stage.config_class.partition(":")[0])
    preset = getattr(module, f"{str(name).upper()}_PRESET", None)
    return dict(preset) if isinstance(preset, dict) else {}
