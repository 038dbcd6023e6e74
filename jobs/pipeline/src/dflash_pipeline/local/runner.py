"""Run a pipeline on this machine: every stage in order, with exactly the settings its Kubernetes Job gets.

The same `RunConfig`, the same wiring (`stages.stage_config`) and the same environment variables as the
rendered Jobs; only the process launcher differs. Each stage runs in the Python environment that holds its
package (the images' contents, as virtual environments; each starts with its checks), once per shard index with
JOB_COMPLETION_INDEX set, like the pods of an Indexed Job. A stage whose manifest already exists is skipped,
so rerunning a run resumes it; a stage killed midway resumes from its committed shards. A skipped stage whose
manifest records other values of the settings the run file gives it now is named with each difference (a changed
run file does not redo a committed stage: its output stays what it was), with the two ways to redo it.

With a `Console` (the `local` command always gives one), each stage's output goes to its own log file and the
console shows the stages, their progress and their verdicts (see `dflash_pipeline.local.console`). Each log file is
copied to `<root>/<run_id>/logs/<stage>/<stage>-<shard>.log` while it grows and when the shard ends, where a
pod's log goes, so `pipeline logs` reads a local run as it reads a cluster's.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash_pipeline.local.console import Console, run_logged
from dflash_pipeline.render.pods import storage_env
from dflash_pipeline.run.config import JobSettings, RunConfig
from dflash_pipeline.run.layout import layout
from dflash_pipeline.run.stages import IMAGE_ENTRYPOINT, StageDef, plan, stage_config
from dflash_shared.errors import ConfigError
from dflash_shared.exit_codes import ExitCode, describe
from dflash_shared.manifest_io import manifest_prefix, recorded_otherwise
from dflash_shared.pod_log import LogShipper, exit_line
from dflash_shared.runner import COUNT_ENV, INDEX_ENV
from dflash_shared.storage import ObjectStore, join

log = logging.getLogger(__name__)

# Which Python module is the CLI of each image, and which local environment stands in for the image.
IMAGE_MODULES = {"tokenizer": "dflash_tokenize", "generator": "dflash_generate", "trainer": "dflash_train"}
# The object store's variables: the environment's win over the run file's, for the stages as for this process.
STORE_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_REGION")
IMAGE_ENVIRONMENTS = {"tokenizer": ".venv", "generator": ".venv-generate", "trainer": ".venv-train"}
# A local store is cheap to write: the shards' logs are copied to it more often than a pod's.
LOG_UPLOAD_S = 30.0


class StageFailedError(RuntimeError):
    def __init__(self, stage: str, index: int, code: int) -> None:
        super().__init__(f"stage {stage} shard {index} exited {describe(code)}")
        self.stage, self.index, self.code = stage, index, code


@dataclass(frozen=True)
class StageRun:
    stage: str
    skipped: bool
    seconds: float
    manifest: str
    started: float = 0.0  # epoch seconds


def run_command(command: list[str], env: dict[str, str], repo: Path, console: Console | None, log_path: Path,
                retries: int) -> int:
    """One command of a shard, run again after a preemption exit (75) as a Job's podFailurePolicy does (Ignore:
    the pod is replaced without counting against its retries), at most `retries` times."""
    for _ in range(retries + 1):
        if console is None:
            code = subprocess.run(command, env=env, cwd=repo, check=False).returncode
        else:
            code = run_logged(command, env, repo, log_path, console)
        if code != ExitCode.PREEMPTED:
            return code
        (console.say if console is not None else log.info)(
            f"  {' '.join(command[2:4])}: exited {describe(code)}; started again, as the Job would, to resume")
    return code


def local_commands(stage: StageDef, python: str) -> list[list[str]]:
    """What the image would run, as local commands: its entrypoint runs the stage, which starts with its checks."""
    module = IMAGE_MODULES[stage.image]
    if stage.command == (IMAGE_ENTRYPOINT,):
        return [[python, "-m", module, "run"]]
    return [[python, "-m", module, *stage.command[1:]]]


def stage_environment(run: RunConfig, stage: StageDef, settings: JobSettings) -> dict[str, str]:
    """The environment variables the stage's Job sets (config, shard count, storage), minus pod plumbing."""
    env = stage.environment(stage_config(stage, run, settings))
    if stage.sharded:
        env[COUNT_ENV] = str(settings.shards)
    env.update({item["name"]: item["value"] for item in storage_env(run)})
    env.update(settings.env)
    return env


def run_local(
    run: RunConfig,
    repo: Path,
    environments: Mapping[str, str] | None = None,
    only: Sequence[str] | None = None,
    extra_env: Mapping[str, str] | None = None,
    console: Console | None = None,
    log_dir: Path | None = None,
) -> list[StageRun]:
    """Run (or resume) every stage of `run`; raises StageFailedError with the stage's exit code on failure.

    Without a console the stages write to this process's stdout and stderr; with one, to files in `log_dir`.
    """
    store = ObjectStore()
    lay = layout(run.root, run.run_id)
    envs = {**IMAGE_ENVIRONMENTS, **(environments or {})}
    logs = log_dir or repo / "logs" / run.run_id
    done: list[StageRun] = []
    stages = [stage for stage in plan(run) if not only or stage.name in only]
    for number, stage in enumerate(stages, 1):
        manifest = stage.output_manifest(lay)
        say = console.say if console is not None else log.info
        settings = run.stages.for_stage(stage.name)
        if store.exists(manifest):
            say(f"[{number}/{len(stages)}] {stage.name}: complete, skipped ({manifest})")
            changed = recorded_otherwise(store, manifest, stage_config(stage, run, settings))
            if changed:
                say(f"  {stage.name}: its committed output was made with other settings than the run file gives now "
                    f"({'; '.join(changed)}), and stays as it was. To make it with these: a new run_id, or delete "
                    f"{manifest_prefix(manifest)} and the later stages' outputs, which were made from it, and run "
                    "again")
            done.append(StageRun(stage.name, True, 0.0, manifest))
            continue
        python = str(repo / envs[stage.image] / "bin" / "python")
        if not os.path.exists(python):
            raise ConfigError(f"stage {stage.name} needs the environment {envs[stage.image]} (make venv-*)")
        stage_env = stage_environment(run, stage, settings)
        for key in STORE_VARIABLES:  # set from the run file where the environment had none (`local`'s entry)
            if os.environ.get(key):
                stage_env.pop(key, None)
        env = {**os.environ, **stage_env, **(extra_env or {})}
        shards = settings.shards if stage.sharded else 1
        start, started = time.monotonic(), time.time()
        for index in range(shards):
            env[INDEX_ENV] = str(index)
            log_path = logs / f"{stage.name}-{index}.log"
            if console is not None:
                # Lines reach the console as they are written, and progress comes often enough to watch.
                env.update(PYTHONUNBUFFERED="1", DFLASH_PROGRESS_INTERVAL_S="10")
                console.say(f"[{number}/{len(stages)}] {stage.name}" + (f" shard {index + 1}/{shards}" if shards > 1
                            else "") + f": running (log: {log_path})")
            # The shard's log goes to the store too, as a pod's does (`dflash_shared.pod_log`).
            shipper = (LogShipper(store, str(log_path), join(lay.logs(stage.name), log_path.name), LOG_UPLOAD_S,
                                  warn=log.warning).start() if console is not None else None)
            try:
                for command in local_commands(stage, python):
                    if console is None:
                        log.info("stage %s shard %d/%d: %s", stage.name, index, shards, " ".join(command[2:]))
                    code = run_command(command, env, repo, console, log_path, settings.retries_per_shard)
                    if code != 0:
                        if shipper is not None:
                            with open(log_path, "a", encoding="utf-8") as fh:
                                fh.write(exit_line(command[2:], code, "") + "\n")
                        raise StageFailedError(stage.name, index, code)
            finally:
                if shipper is not None:
                    shipper.close()
        if not store.exists(manifest):
            raise StageFailedError(stage.name, shards - 1, 1)
        seconds = time.monotonic() - start
        say(f"[{number}/{len(stages)}] {stage.name}: done in {seconds:.0f} s ({manifest})")
        done.append(StageRun(stage.name, False, seconds, manifest, started))
    if run.pilot_of is not None and not only:
        _write_pilot_report(run, store, done, console)
    return done


def _write_pilot_report(run: RunConfig, store: ObjectStore, done: list[StageRun], console: Console | None) -> None:
    from dflash_pipeline.pilot.report import build_report, format_report, write_report

    report = build_report(store, run, {r.stage: r.started for r in done if not r.skipped})
    uri = write_report(store, run, report)
    text = format_report(report) + f"pilot report written to {uri}\n"
    if console is not None:
        for line in text.splitlines():
            console.say(line)
    else:
        log.info("%s", text)


def run_local_and_report(config: RunConfig, repo: Path, only: Sequence[str] | None = None,
                         log_dir: Path | None = None, verbose: bool = False) -> int:
    logs = log_dir or repo / "logs" / config.run_id
    console = Console(verbose=verbose, transcript=logs / "console.log")
    try:
        runs = run_local(config, repo, only=only, console=console, log_dir=logs)
    except StageFailedError as err:
        if config.pilot_of is not None and not only:
            from dflash_pipeline.pilot.report import build_report, write_report

            reason = f"shard {err.index} exited {describe(err.code)} (log: {logs / f'{err.stage}-{err.index}.log'})"
            uri = write_report(ObjectStore(), config, build_report(ObjectStore(), config, failures={err.stage: reason}))
            print(f"pilot report written to {uri}", file=sys.stderr)
        if err.code in (ExitCode.USAGE, ExitCode.BAD_INPUT):  # a rerun of the same settings and data fails alike
            then = ("fix what its log names (a setting, or the data), then rerun the same command; finished stages "
                    "are skipped")
        else:
            then = "rerun the same command to resume"
        print(f"pipeline stopped: {err}; {then}", file=sys.stderr)
        return err.code
    for item in runs:
        state = "skipped (complete)" if item.skipped else f"ran in {item.seconds:.0f} s"
        print(f"{item.stage:12s} {state:22s} {item.manifest}")
    return 0
