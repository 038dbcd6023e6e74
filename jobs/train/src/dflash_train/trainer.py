"""The training loop: one run of the drafter on one rank, from its first (or resumed) step to its last.

Each step is one call per concern, in this order:

1. `training.update.optimizer_step`: this rank's micro-batches and one AdamW update (the gradient weighting and
   the seeding that make a run independent of world size and interruptions are described there);
2. `training.heldout.heldout_acceptance`, every `heldout_every` steps and at the end;
3. `training.metrics.RunMetrics.after_step`: the logging window, the log line, TensorBoard and the progress report;
4. `training.checkpoint.save_checkpoint`, every `checkpoint_every` steps, at the end and when stopping.

SIGTERM/SIGINT during the loop only set a flag (`training.preemption`); at the next step boundary all ranks agree
(one all-reduce) to stop, save a checkpoint and raise `Preempted`, so the process exits 75 with nothing lost; so
does `restart_after_step`. A kill -9 loses the steps since the last periodic checkpoint and nothing else.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from dflash_shared.errors import ConfigError, Preempted
from dflash_shared.storage import ObjectStore
from dflash_train.config import TrainConfig, settings_identity
from dflash_train.data.batch import PackedBatch
from dflash_train.data.loader import StepLoader
from dflash_train.data.plan import DataPlan
from dflash_train.data.shards import ShardCache
from dflash_train.drafter.config import DrafterConfig
from dflash_train.parallel.distributed import DistEnv
from dflash_train.parallel.placement import Parallelism, wrap_drafter
from dflash_train.target_model.frozen import FrozenTarget
from dflash_train.training import checkpoint as ckpt
from dflash_train.training.heldout import heldout_acceptance
from dflash_train.training.metrics import Logging, RunMetrics
from dflash_train.training.optim import build_optimizer, build_scheduler
from dflash_train.training.preemption import deferred_stop
from dflash_train.training.update import StepParts, optimizer_step
from dflash_train.training.warm_start import initial_drafter

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished run produced: the final checkpoint, its metrics and every logged window."""

    checkpoint: ckpt.CheckpointRef
    steps: int
    final_metrics: dict[str, float]
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)


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
    init_from: str | None = None  # warm start of a fresh run (training.warm_start); None: random weights
    heldout: PackedBatch | None = None  # held-out rows for the acceptance measurement (training.heldout)


class Trainer:
    """Owns the drafter, optimiser, scheduler and data order of one run on one rank."""

    def __init__(self, setup: TrainerSetup, target: FrozenTarget, env: DistEnv, store: ObjectStore) -> None:
        config, runtime, rows_per_step = setup.config, setup.config.runtime, setup.rows_per_step
        groups = rows_per_step // runtime.micro_batch_rows
        if rows_per_step % runtime.micro_batch_rows or groups % env.world_size:
            raise ConfigError(
                f"batch_tokens gives {rows_per_step} rows per step, which must split into micro-batches of "
                f"micro_batch_rows={runtime.micro_batch_rows} rows, the same number on each of {env.world_size} "
                "rank(s): change batch_tokens or micro_batch_rows"
            )
        try:
            target.check_drafter_config(setup.drafter)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        drafter, self.warm_started = initial_drafter(setup.drafter, config.seed, runtime, env.device, store,
                                                     setup.init_from, target.vocab_rows)
        self.model = wrap_drafter(drafter, setup.parallelism, env, bf16=runtime.precision == "bf16")
        optimizer = build_optimizer(self.model.parameters(), config.recipe, env.device)
        self.scheduler = build_scheduler(optimizer, config.recipe, setup.total_steps)
        self.parts = StepParts(self.model, optimizer, target, setup.drafter, config.recipe, runtime, env, config.seed)
        self.setup, self.config, self.env, self.store = setup, config, env, store
        self.identity = settings_identity(config)
        self.accumulation = groups // env.world_size
        self.total_steps, self.rows_per_step, self.plan = setup.total_steps, rows_per_step, setup.plan
        self.step = 0
        self.recorded: dict[str, float] = {}  # the metrics the last checkpoint recorded (RunMetrics.after_step)
        self.last_checkpoint: ckpt.CheckpointRef | None = None
        # Timings the drafter manifest records (a pilot's report compares them with the plan).
        self.save_seconds: float | None = None
        self.resume_seconds: float | None = None
        self.resumed_from: int | None = None

    def resume(self, ref: ckpt.CheckpointRef) -> None:
        started = time.perf_counter()
        state = ckpt.resume_checkpoint(ref, self.identity, self.setup.drafter, self.model, self.parts.optimizer,
                                       self.store, self.env, self.setup.scratch)
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
            self.scheduler = build_scheduler(self.parts.optimizer, self.config.recipe, self.total_steps)
        self.scheduler.load_state_dict(state.scheduler)
        self.recorded, self.step, self.last_checkpoint = dict(state.metrics), state.step, ref
        self.resume_seconds, self.resumed_from = time.perf_counter() - started, state.step

    def train(self) -> TrainResult:
        """Steps `step + 1 .. total_steps` (module docstring); the final checkpoint and metrics."""
        env, config, setup = self.env, self.config, self.setup
        metrics = RunMetrics(env, setup.drafter.block_size, self.total_steps, config.recipe.label_agreement_warn,
                             Logging(config.log_every, config.tensorboard, setup.scratch, config.output,
                                     config.progress_every_s, self.rows_per_step * self.plan.max_length),
                             self.store, f"from-step-{self.step}", self.recorded or None,
                             None if self.last_checkpoint is None else (self.step, self.last_checkpoint.uri))
        loader = StepLoader(self.plan, setup.cache, self.rows_per_step, config.runtime.micro_batch_rows, env.rank,
                            env.world_size, self.step, self.total_steps, config.prefetch_steps,
                            pin_memory=env.device.type == "cuda")
        log.info("training steps %d..%d of %d: %d rows of %d tokens per step, %d micro-batch(es) per rank",
                 self.step + 1, self.total_steps, self.total_steps, self.rows_per_step, self.plan.max_length,
                 self.accumulation)
        outcome, saved = "failed", None
        try:
            with deferred_stop() as stop:
                for item in loader:
                    if item.step != self.step:
                        raise RuntimeError(f"data loader at step {item.step}, trainer at {self.step}")
                    stats = optimizer_step(self.parts, self.scheduler, item, self.step)
                    self.step += 1
                    heldout = None
                    if setup.heldout is not None and config.heldout_every and (
                            self.step % config.heldout_every == 0 or self.step == self.total_steps):
                        heldout = heldout_acceptance(self.model, self.parts.target, setup.heldout, setup.drafter,
                                                     config.recipe, config.runtime, env)
                    stopping = None
                    if self.step < self.total_steps:
                        if env.any(stop.is_set()):  # every rank asks (a collective): all stop at the same step
                            stopping = "SIGTERM"
                        elif config.restart_after_step == self.step and (self.resumed_from or 0) < self.step:
                            # The same on every rank; a run that resumed past it never stops again: it restarts once.
                            stopping = "restart_after_step"
                    due = self.step % config.checkpoint_every == 0 or self.step == self.total_steps or bool(stopping)
                    self.recorded = metrics.after_step(self.step, stats, heldout, due, saved)
                    if due:
                        started = time.perf_counter()
                        self.last_checkpoint = ckpt.save_checkpoint(
                            self.model, self.parts.optimizer, ckpt.TrainState(
                                step=self.step, total_steps=self.total_steps, rows_per_step=self.rows_per_step,
                                consumed_rows=item.rows_after, data_position=item.position,
                                plan_fingerprint=self.plan.fingerprint, scheduler=self.scheduler.state_dict(),
                                world_size=env.world_size, metrics=self.recorded, identity=self.identity),
                            setup.drafter.model_dump_json(indent=1), self.store, config.output, env,
                            setup.scratch, config.keep_checkpoints)
                        self.save_seconds = time.perf_counter() - started
                        saved = (self.step, self.last_checkpoint.uri)
                    if stopping:
                        assert saved is not None  # a stop is due: saved just now
                        log.warning("stopped at step %d (%s); checkpoint %s written in %.1f s; a rerun resumes "
                                    "from it", self.step, stopping, saved[1], self.save_seconds or 0.0)
                        raise Preempted(stopping)
            if self.step != self.total_steps or self.last_checkpoint is None:
                raise RuntimeError(f"the data loader ended at step {self.step} of {self.total_steps}")
            outcome = "finished"
        except Preempted:
            outcome = "stopped"
            raise
        finally:
            loader.close()
            final = metrics.close(outcome, None if self.last_checkpoint is None else (self.step,
                                                                                       self.last_checkpoint.uri))
        assert self.last_checkpoint is not None  # checked above; the finally does not narrow it
        return TrainResult(self.last_checkpoint, self.step, final, metrics.history)

