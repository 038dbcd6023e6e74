"""Data parallelism inside a pod: one engine process per group of `tensor_parallel_size` GPUs.

vLLM's offline engine serves one data-parallel rank per process, so a pod with G GPUs and tensor
parallelism T runs G / T copies of the stage, each seeing only its own GPUs (CUDA_VISIBLE_DEVICES) and
working as its own worker: pod p's engine r is worker p * D + r of P * D. Each child gets the parent's
resolved settings as DFLASH_GENERATE_* variables (so flags, environment and defaults resolve exactly as
in the parent) plus its rank. A SIGTERM to the pod is passed on to every child, which commits what it
can and exits 75; the first child that fails with bad input or bad config stops the others, because
their work would be thrown away with the Job.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from dflash_generate.config import GenerateConfig
from dflash_generate.engine import engine_flavour
from dflash_shared.errors import BadInputError, ConfigError, Preempted, PreflightError
from dflash_shared.exit_codes import ExitCode, describe
from dflash_shared.manifests import MANIFEST_NAME
from dflash_shared.processes import die_with_this_process
from dflash_shared.settings import env_value
from dflash_shared.storage import ObjectStore, join

log = logging.getLogger(__name__)
ENV_PREFIX = "DFLASH_GENERATE_"
# How long children get to commit and exit after the pod was asked to stop.
STOP_GRACE_S = 60.0
_FATAL = (ExitCode.USAGE, ExitCode.BAD_INPUT)


def child_env(config: GenerateConfig, rank: int, devices: Sequence[str] | None,
              base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of engine process `rank`: the parent's settings as variables, its rank, its GPUs."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.upper().startswith(ENV_PREFIX)}
    for name, value in config.model_dump(mode="json").items():
        if value is not None:
            env[ENV_PREFIX + name.upper()] = env_value(value)
    env[ENV_PREFIX + "DATA_PARALLEL_RANK"] = str(rank)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env


def visible_devices(needed: int) -> list[str] | None:
    """The GPUs the pod may use (CUDA_VISIBLE_DEVICES, else 0..needed-1); None for the CPU engine."""
    if engine_flavour() == "cpu":
        return None
    listed = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    devices = [d.strip() for d in listed.split(",") if d.strip()] if listed else [str(i) for i in range(needed)]
    if len(devices) < needed:
        raise PreflightError(f"data_parallel_size x tensor_parallel_size needs {needed} GPUs, but only "
                             f"{len(devices)} are visible (CUDA_VISIBLE_DEVICES={listed!r})")
    return devices


def raise_for_exit_codes(codes: Sequence[int]) -> None:
    """Nothing when every engine process succeeded; else the exception whose exit code fits the worst one."""
    failed = {rank: code for rank, code in enumerate(codes) if code != 0}
    if not failed:
        return
    summary = ", ".join(f"engine process {rank} exited {describe(code)}" for rank, code in failed.items())
    codes_seen = set(failed.values())
    message = f"{summary}; see their log lines above"
    if ExitCode.USAGE in codes_seen:
        raise ConfigError(message)
    if ExitCode.BAD_INPUT in codes_seen:
        raise BadInputError(message)
    if codes_seen == {ExitCode.PREEMPTED}:
        raise Preempted("SIGTERM (engine processes)")
    if codes_seen <= {ExitCode.ENVIRONMENT, ExitCode.PREEMPTED}:
        raise PreflightError(message)
    raise RuntimeError(message)


def _stop(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def supervise(commands: Sequence[tuple[list[str], dict[str, str]]], poll_s: float = 0.5) -> list[int]:
    """Run the engine processes to the end; returns their exit codes in rank order.

    A fatal failure (bad config or input) of one stops the others; a Preempted in this process (SIGTERM)
    is passed on to them before it propagates.
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for argv, env in commands:
            procs.append(subprocess.Popen(argv, env=env, preexec_fn=die_with_this_process()))
        while any(p.poll() is None for p in procs):
            if any(p.returncode in _FATAL for p in procs):
                log.error("an engine process failed with bad config or input: stopping the others")
                _stop(procs, STOP_GRACE_S)
                break
            time.sleep(poll_s)
    except BaseException:
        _stop(procs, STOP_GRACE_S)
        raise
    return [int(p.returncode) for p in procs]


def run_engines(config: GenerateConfig, store: ObjectStore) -> str | None:
    """Run `data_parallel_size` engine processes for this pod; returns the manifest URI once written."""
    dp, tp = config.data_parallel_size, config.tensor_parallel_size
    devices = visible_devices(dp * tp)
    argv = [sys.executable, "-m", "dflash_generate", "run"]
    commands = [
        (argv, child_env(config, rank, devices[rank * tp : (rank + 1) * tp] if devices else None))
        for rank in range(dp)
    ]
    log.info("starting %d engine processes of %d GPU(s) each%s", dp, tp,
             f" on GPUs {','.join(devices)}" if devices else " (CPU engine)")
    raise_for_exit_codes(supervise(commands))
    manifest = join(config.output, MANIFEST_NAME)
    return manifest if store.exists(manifest) else None
