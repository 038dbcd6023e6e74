"""The training loop: micro-batches -> dflash_step -> AdamW, with checkpoints, metrics and preemption.

One optimizer step consumes `rows_per_step` packed rows over all ranks (see `data`); rank r runs its
micro-batches one after the other, gradients accumulate (reduced across ranks on the last one) and the
loss of each is divided by their count, so the update is the mean over all micro-batches of the step
whatever the world size. Anchor sampling and feature noise draw from a generator seeded by
(seed, step, micro-batch), never from a global RNG: a resumed run, or one with another world size, draws
exactly what the uninterrupted run would have.

SIGTERM/SIGINT during the loop only set a flag; at the next step boundary all ranks agree (one
all-reduce) to stop, save a checkpoint and raise `Preempted`, so the process exits 75 with nothing lost.
A kill -9 loses the steps since the last periodic checkpoint and nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash_shared.errors import ConfigError, Preempted
from dflash_shared.stage_identity import refuse_changed
from dflash_shared.storage import ObjectStore
from dflash_train.config import TrainConfig, settings_identity
from dflash_train.data.loader import DataPlan, ShardCache, StepLoader
from dflash_train.drafter.attention import compile_drafter_layers
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.parallel.distributed import DistEnv, Parallelism, accumulate, wrap_drafter
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training import checkpoint as ckpt
from dflash_train.training.anchors import anchor_count_buckets
from dflash_train.training.metrics import MetricsSink, MetricWindow
from dflash_train.training.optim import autocast, build_optimizer, build_scheduler, clip_gradients
from dflash_train.training.step import dflash_step

log = logging.getLogger(__name__)
FINAL_METRIC_PREFIXES = ("loss", "tau", "accuracy", "acc_")


def micro_seed(seed: int, step: int, micro: int) -> int:
    """Seed of the anchor/noise generator of one micro-batch: independent of rank and world size."""
    digest = hashlib.sha256(f"{seed}:{step}:{micro}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@contextlib.contextmanager
def deferred_stop() -> Iterator[threading.Event]:
    """SIGTERM/SIGINT set the returned event instead of interrupting a step (main thread only)."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, _frame: object) -> None:
        if not stop.is_set():
            log.warning("%s received: stopping after this step with a checkpoint", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@dataclass
class TrainResult:
    """What a finished run produced: the final checkpoint, its metrics and every logged window."""

    checkpoint_uri: str
    steps: int
    final_metrics: dict[str, float]
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)


def build_drafter(cfg: DrafterConfig, config: TrainConfig, device: torch.device) -> DFlashDrafter:
    """A freshly initialised drafter (the same on every rank: the init is seeded)."""
    torch.manual_seed(config.seed)
    drafter = DFlashDrafter(cfg).to(device)
    if config.activation_checkpointing:
        drafter.set_gradient_checkpointing(True)
    if config.compile:
        # Static shapes: per ladder rung two training graphs (the first layer, the rest) and one for
        # no_grad evaluation; the recompile limit is raised before the first compile (dflash_train.drafter.attention).
        compile_drafter_layers(drafter.layers, len(anchor_count_buckets(cfg.block_size, cfg.max_anchors_per_row)))
    return drafter


def refuse_other_settings(store: ObjectStore, ref: ckpt.CheckpointRef, config: TrainConfig) -> None:
    """SettingsChangedError (exit 64) when `ref` was saved under other settings than `config`'s (those that change
    what a step computes: see dflash_train.config.RESUMABLE_CHANGES), naming each and the ways out."""
    refuse_changed(ckpt.read_state(store, ref).identity, settings_identity(config),
                   f"checkpoint {ref.uri} was saved by a run with other settings",
                   "`python -m dflash_pipeline restart --config RUN.toml --stage train` (it deletes the checkpoints "
                   "and the later stages' outputs), or write to a new output prefix (a new run_id)")


@dataclass(frozen=True)
class TrainerSetup:
    """What the stage decided before the first step, and the trainer is built from: its settings, the resolved
    drafter, the data plan and cache, where it writes, how the drafter is distributed, and how long it trains."""

    config: TrainConfig
    drafter: DrafterConfig
    plan: DataPlan
    cache: ShardCache
    scratch: str
    parallelism: Parallelism
    total_steps: int
    rows_per_step: int


class Trainer:
    """Owns the drafter, optimiser, scheduler, data loader and metrics of one run on one rank."""

    def __init__(self, setup: TrainerSetup, target: FrozenTarget, env: DistEnv, store: ObjectStore) -> None:
        config, drafter_cfg, rows_per_step = setup.config, setup.drafter, setup.rows_per_step
        self.config, self.cfg, self.target, self.plan, self.cache = config, drafter_cfg, target, setup.plan, setup.cache
        self.env, self.store, self.scratch = env, store, setup.scratch
        self.total_steps, self.rows_per_step = setup.total_steps, rows_per_step
        parallelism, total_steps = setup.parallelism, setup.total_steps
        groups = rows_per_step // config.micro_batch_rows
        if rows_per_step % config.micro_batch_rows or groups % env.world_size:
            raise ConfigError(
                f"batch_tokens gives {rows_per_step} rows per step, which must split into micro-batches of "
                f"micro_batch_rows={config.micro_batch_rows} rows, the same number on each of {env.world_size} "
                "rank(s): change batch_tokens or micro_batch_rows"
            )
        self.accumulation = groups // env.world_size
        try:
            target.check_drafter_config(drafter_cfg)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        self.drafter = build_drafter(drafter_cfg, config, env.device)
        self.model: nn.Module = wrap_drafter(self.drafter, parallelism, env, bf16=config.precision == "bf16")
        self.optimizer = build_optimizer(self.model.parameters(), config, env.device)
        self.scheduler = build_scheduler(self.optimizer, config, total_steps)
        self.step = 0
        self.metrics: dict[str, float] = {}
        self.history: list[tuple[int, dict[str, float]]] = []
        self.last_checkpoint: str | None = None
        # Timings the drafter manifest records (a pilot's report compares them with the plan).
        self.save_seconds: float | None = None
        self.resume_seconds: float | None = None
        self.resumed_from: int | None = None

    # ------------------------------------------------------------------ state

    def state(self) -> ckpt.TrainState:
        consumed = self.step * self.rows_per_step
        return ckpt.TrainState(
            step=self.step, total_steps=self.total_steps, rows_per_step=self.rows_per_step, consumed_rows=consumed,
            data_position=self.plan.position(consumed), plan_fingerprint=self.plan.fingerprint,
            scheduler=self.scheduler.state_dict(), world_size=self.env.world_size, metrics=self.metrics,
            identity=settings_identity(self.config),
        )

    def save(self) -> str:
        started = time.perf_counter()
        uri = ckpt.save_checkpoint(self.model, self.optimizer, self.state(), self.cfg.model_dump_json(indent=1),
                                   self.store, self.config.output, self.env, self.scratch, self.config.keep_checkpoints)
        self.last_checkpoint = uri
        self.save_seconds = time.perf_counter() - started
        return uri

    def resume(self, ref: ckpt.CheckpointRef) -> None:
        started = time.perf_counter()
        refuse_other_settings(self.store, ref, self.config)  # before a tensor is read
        saved = ckpt.read_config_json(self.store, ref)
        if saved != self.cfg.model_dump(mode="json"):
            raise ConfigError(f"checkpoint {ref.uri} was trained with another drafter config; start a new output "
                              "prefix or set resume=never")
        state = ckpt.load_checkpoint(ref, self.model, self.optimizer, self.store, self.env, self.scratch)
        if state.plan_fingerprint != self.plan.fingerprint or state.rows_per_step != self.rows_per_step:
            raise ConfigError(
                f"checkpoint {ref.uri} continues another data order (plan {state.plan_fingerprint}, "
                f"{state.rows_per_step} rows/step; now {self.plan.fingerprint}, {self.rows_per_step}): keep "
                "input, max_length, seed and batch_tokens of the interrupted run"
            )
        if state.total_steps != self.total_steps:
            log.warning("keeping the checkpoint's schedule of %d steps (the config now gives %d)",
                        state.total_steps, self.total_steps)
            self.total_steps = state.total_steps
            self.scheduler = build_scheduler(self.optimizer, self.config, self.total_steps)
        self.scheduler.load_state_dict(state.scheduler)
        self.step, self.metrics, self.last_checkpoint = state.step, dict(state.metrics), ref.uri
        self.resume_seconds, self.resumed_from = time.perf_counter() - started, state.step

    # ------------------------------------------------------------------ loop

    def train(self, sink: MetricsSink) -> TrainResult:
        env, config = self.env, self.config
        loader = StepLoader(self.plan, self.cache, self.rows_per_step, config.micro_batch_rows, env.rank,
                            env.world_size, self.step, self.total_steps, config.prefetch_steps,
                            pin_memory=env.device.type == "cuda")
        window = MetricWindow(self.cfg.block_size, env.device)
        grad_norm = 0.0
        if self.last_checkpoint is not None:
            sink.checkpoint_saved(self.step, self.last_checkpoint)
        log.info("training steps %d..%d of %d: %d rows of %d tokens per step, %d micro-batch(es) per rank",
                 self.step + 1, self.total_steps, self.total_steps, self.rows_per_step, self.plan.max_length,
                 self.accumulation)
        cfg = self.cfg
        log.info("anchors: up to %d per document, at most %d per row; blocks per micro-batch row on the ladder %s"
                 " (at most that many drafter attention shapes, each compiled once)", cfg.num_anchors,
                 cfg.max_anchors_per_row, list(anchor_count_buckets(cfg.block_size, cfg.max_anchors_per_row)))
        try:
            with deferred_stop() as stop:
                for item in loader:
                    if item.step != self.step:
                        raise RuntimeError(f"data loader at step {item.step}, trainer at {self.step}")
                    self.model.train()
                    count = len(item.micro)
                    for i, (micro_id, cpu_batch) in enumerate(zip(item.micro_ids, item.micro, strict=True)):
                        batch = cpu_batch.to(env.device, non_blocking=True)
                        gen = torch.Generator(device=env.device).manual_seed(
                            micro_seed(config.seed, self.step, micro_id))
                        with accumulate(self.model, sync=i == count - 1):
                            with autocast(config, env.device):
                                out = dflash_step(self.model, self.target, batch, self.cfg, gen,  # type: ignore[arg-type]
                                                  noise=True, chunk_tokens=config.chunk_tokens)
                            (out.loss / count).backward()
                        window.add_micro(out, int((cpu_batch.document_ids >= 0).sum()))
                    grad_norm = clip_gradients(self.model.parameters(), config.grad_clip)
                    lr = float(self.scheduler.get_last_lr()[0])
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    self.step += 1
                    window.steps += 1
                    if self.step % config.log_every == 0 or self.step == self.total_steps:
                        self.metrics = window.finish(env, lr, grad_norm)
                        self.history.append((self.step, self.metrics))
                        sink.write(self.step, self.total_steps, self.metrics)
                    if self.step % config.checkpoint_every == 0 or self.step == self.total_steps:
                        # Metrics first: once a checkpoint is complete, the loss curve up to it is stored too,
                        # so a kill -9 right after the checkpoint loses no logged step.
                        sink.upload(self.store, config.output)
                        sink.checkpoint_saved(self.step, self.save())
                    if self.step < self.total_steps and env.any(stop.is_set()):
                        self._stop_for_preemption(sink)
                    if self.step < self.total_steps and self._restart_due():
                        self._stop_for_preemption(sink, "restart_after_step")
        except Preempted:
            raise
        except BaseException:
            sink.state = "failed"
            raise
        finally:
            loader.close()
        if self.last_checkpoint is None or not self.last_checkpoint.endswith(f"step-{self.step:08d}"):
            sink.checkpoint_saved(self.step, self.save())
        assert self.last_checkpoint is not None
        sink.state = "finished"
        final = {k: v for k, v in self.metrics.items() if k.startswith(FINAL_METRIC_PREFIXES)}
        return TrainResult(self.last_checkpoint, self.step, final, self.history)

    def _restart_due(self) -> bool:
        """restart_after_step reached in this process (the same on every rank: no collective needed). A run that
        resumed past it never stops again, so the restart happens once."""
        return self.config.restart_after_step == self.step and (self.resumed_from or 0) < self.step

    def _stop_for_preemption(self, sink: MetricsSink, why: str = "SIGTERM") -> None:
        started = time.perf_counter()
        if self.last_checkpoint is None or not self.last_checkpoint.endswith(f"step-{self.step:08d}"):
            self.save()
        assert self.last_checkpoint is not None
        sink.checkpoint_saved(self.step, self.last_checkpoint)
        sink.state = "stopped"
        if self.env.is_main:
            sink.upload(self.store, self.config.output)
        log.warning("stopped at step %d (%s); checkpoint %s written in %.1f s; a rerun resumes from it", self.step,
                    why, self.last_checkpoint, time.perf_counter() - started)
        raise Preempted(why)
