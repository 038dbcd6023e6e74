"""Training metrics: loss, per-slot accuracy, expected acceptance length, throughput and peak memory.

Each rank sums its micro-batch results over a logging window; at the end of the window the sums are
all-reduced, so the logged numbers cover every rank. The expected acceptance length is derived from the
per-slot accuracies (`loss.expected_acceptance_length`): what those accuracies would give a served
drafter if slot errors were independent. Rank 0 writes one log line per window and the same scalars to
TensorBoard event files, which are uploaded under `<output>/tensorboard/` every `progress_every_s` seconds, at
every checkpoint and at the end. As often, it writes `<output>/progress.json` (step/total, tokens, loss, tau,
tokens/s, ETA, the last checkpoint, when it was written), which `pipeline status` shows. Both go through a
background thread (`dflash_shared.progress_report`): a slow store never holds up a step, a failed write is a
warning.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from dflash_shared.progress import human_count, human_duration
from dflash_shared.progress_report import (
    DEFAULT_INTERVAL_S,
    SCHEMA_VERSION,
    TRAIN_PROGRESS_NAME,
    BackgroundWriter,
    Every,
    utc_stamp,
    write_report,
)
from dflash_shared.storage import ObjectStore, join
from dflash_train.parallel.distributed import DistEnv, peak_memory_bytes
from dflash_train.training.loss import expected_acceptance_length, per_position_accuracy
from dflash_train.training.step import StepOutput

log = logging.getLogger(__name__)
TENSORBOARD_DIR = "tensorboard"
# The metrics a progress report carries (the per-slot accuracies and per-rank memory stay in TensorBoard).
_REPORTED = ("loss", "tau", "accuracy", "label_agreement", "heldout_tau", "lr", "tokens_per_s", "steps_per_s",
             "peak_memory_gib_max")
_HEAD = 6  # the window's scalar sums before the per-slot counts (see MetricWindow.reset)


class MetricWindow:
    """Sums of one logging window on this rank."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size, self.device = block_size, device
        self.reset()

    def reset(self) -> None:
        # [loss sum, loss weight, label tokens, input tokens, agreed labels, labels checked] then correct[block],
        # counted[block]
        self.sums = torch.zeros(_HEAD + 2 * self.block_size, dtype=torch.float64, device=self.device)
        self.steps = 0
        self.started = time.perf_counter()

    def add_micro(self, out: StepOutput, input_tokens: int) -> None:
        # The window's loss is the weighted mean over all its trained tokens (loss numerator over denominator).
        loss_sum = out.loss_sum if out.loss_sum is not None else out.loss * max(out.weight_sum, 1.0)
        weight = out.weight_sum if out.loss_sum is not None else max(out.weight_sum, 1.0)
        checked = float(out.tokens) if out.agreed >= 0 else 0.0
        head = torch.tensor([0.0, weight, float(out.tokens), float(input_tokens), float(max(out.agreed, 0)), checked],
                            dtype=torch.float64, device=self.device)
        head[0] = loss_sum.detach().double().to(self.device)
        self.sums += torch.cat([head, out.correct.double().to(self.device), out.counted.double().to(self.device)])

    def finish(self, env: DistEnv, lr: float, grad_norm: float) -> dict[str, float]:
        """All-reduce the window (a collective) and return its metrics; the window starts anew."""
        sums = env.all_reduce_sum(self.sums.clone()).cpu().tolist()
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        loss_sum, loss_weight, labels, inputs, agreed, checked = sums[:_HEAD]
        correct = sums[_HEAD:_HEAD + self.block_size]
        counted = sums[_HEAD + self.block_size:]
        acc = per_position_accuracy(correct, counted)
        peaks = env.all_gather_object(peak_memory_bytes(env.device))
        metrics: dict[str, float] = {
            "loss": loss_sum / loss_weight if loss_weight > 0 else 0.0,
            "tau": expected_acceptance_length(acc),
            "accuracy": sum(correct[1:]) / max(sum(counted[1:]), 1.0),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": inputs / elapsed,
            "label_tokens_per_s": labels / elapsed,
            "steps_per_s": self.steps / elapsed,
            "peak_memory_gib_max": max(peaks) / 2**30,
        }
        if checked > 0:
            metrics["label_agreement"] = agreed / checked
        metrics.update({f"acc_{k}": a for k, a in enumerate(acc, start=1)})
        metrics.update({f"peak_memory_gib_rank{r}": p / 2**30 for r, p in enumerate(peaks)})
        self.reset()
        return metrics


def format_line(step: int, total: int, m: dict[str, float], eta_s: float | None = None) -> str:
    accs = [m[k] for k in sorted((k for k in m if k.startswith("acc_")), key=lambda k: int(k[4:]))]
    shown = " ".join(f"{a:.2f}" for a in accs[:8]) + (" ..." if len(accs) > 8 else "")
    eta = f", ETA {human_duration(eta_s)}" if eta_s is not None else ""
    agree = f" labels=target {100 * m['label_agreement']:.1f}%" if "label_agreement" in m else ""
    agree += f" heldout tau {m['heldout_tau']:.2f}" if "heldout_tau" in m else ""
    return (f"step {step}/{total} ({100.0 * step / max(total, 1):.0f}%) loss {m['loss']:.4f} tau {m['tau']:.2f} "
            f"acc[1..] {shown}{agree} lr {m['lr']:.2e} gnorm {m['grad_norm']:.3f} "
            f"{human_count(m['tokens_per_s'])} tok/s peak mem {m['peak_memory_gib_max']:.2f} GiB (max over ranks){eta}")


class MetricsSink:
    """Log lines, TensorBoard scalars and the progress report on rank 0; nothing on the others.

    With `store` and `output` the progress report and the TensorBoard files go to the store every
    `progress_every_s` seconds (see the module docstring); `state` is what the last report says the run is
    doing (training, then finished, stopped or failed, set by the trainer).
    """

    def __init__(self, env: DistEnv, local_dir: str, enabled_tensorboard: bool, run_tag: str,
                 store: ObjectStore | None = None, output: str | None = None,
                 progress_every_s: float = DEFAULT_INTERVAL_S, tokens_per_step: int = 0) -> None:
        self.env = env
        self.local_dir = os.path.join(local_dir, run_tag)
        self._writer: Any = None
        self._first: tuple[int, float] | None = None
        if env.is_main and enabled_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.local_dir, exist_ok=True)
            self._writer = SummaryWriter(log_dir=self.local_dir, flush_secs=30)
        self.store, self.output, self.tokens_per_step = store, output, tokens_per_step
        self._reports = (BackgroundWriter("train progress report")
                         if env.is_main and store is not None and output is not None else None)
        self._due, self.every_s = Every(progress_every_s), progress_every_s
        self.state = "training"
        self.last_checkpoint: dict[str, Any] | None = None
        self._latest: dict[str, Any] | None = None

    def write(self, step: int, total: int, metrics: dict[str, float]) -> None:
        if not self.env.is_main:
            return
        now = time.monotonic()
        if self._first is None:
            # The ETA runs from the first step this process logged (a resumed run starts its clock there).
            self._first = (step, now)
        first_step, first_time = self._first
        eta = (now - first_time) / (step - first_step) * (total - step) if step > first_step else None
        log.info(format_line(step, total, metrics, eta))
        if self._writer is not None:
            for name, value in metrics.items():
                group = "perf" if name.startswith(("peak_", "tokens_", "label_", "steps_")) else "train"
                self._writer.add_scalar(f"{group}/{name}", value, step)
        self._latest = {"step": step, "total": total, "tokens": step * self.tokens_per_step,
                        "eta_s": None if eta is None else round(eta, 1),
                        **{k: round(metrics[k], 6) for k in _REPORTED if k in metrics}}
        # A report still being written (a slow store) is not queued behind: the next window tries again.
        if self._reports is not None and self._reports.idle and self._due.due():
            self._reports.submit(self._publisher(self.record(), self._snapshot()))

    def checkpoint_saved(self, step: int, uri: str) -> None:
        """Name the newest complete checkpoint in the reports, and report it now (in the background) if idle."""
        if not self.env.is_main:
            return
        self.last_checkpoint = {"step": step, "uri": uri, "saved": utc_stamp()}
        if self._reports is not None and self._reports.idle and self._latest is not None:
            self._reports.submit(self._publisher(self.record(), []))

    def record(self) -> dict[str, Any]:
        """The progress report as it stands: the last logged window, the state and the last checkpoint."""
        return {"schema": SCHEMA_VERSION, "stage": "train", "state": self.state, **(self._latest or {}),
                "last_checkpoint": self.last_checkpoint, "every_s": self.every_s, "updated": utc_stamp()}

    def _snapshot(self) -> list[tuple[str, str]]:
        """Copies of the event files as they are now, for an upload that cannot race the writer's appends."""
        if self._writer is None or self.output is None:
            return []
        self._writer.flush()
        folder = tempfile.mkdtemp(prefix="tensorboard-", dir=os.path.dirname(self.local_dir))
        out = []
        for name in sorted(os.listdir(self.local_dir)):
            path = os.path.join(self.local_dir, name)
            if os.path.isfile(path):
                shutil.copyfile(path, os.path.join(folder, name))
                out.append((os.path.join(folder, name), join(self.output, TENSORBOARD_DIR, name)))
        return out

    def _publisher(self, record: dict[str, Any], events: list[tuple[str, str]]) -> Any:
        store, output = self.store, self.output
        assert store is not None and output is not None

        def publish() -> None:
            try:
                for path, uri in events:
                    store.upload_from(path, uri)
            finally:
                if events:
                    shutil.rmtree(os.path.dirname(events[0][0]), ignore_errors=True)
            write_report(store, join(output, TRAIN_PROGRESS_NAME), record)

        return publish

    def upload(self, store: ObjectStore, output: str) -> None:
        """Copy the event files to `<output>/tensorboard/` (the whole file each time: S3 cannot append)."""
        if self._writer is None:
            return
        self._writer.flush()
        for name in sorted(os.listdir(self.local_dir)):
            path = os.path.join(self.local_dir, name)
            if os.path.isfile(path):
                store.upload_from(path, join(output, TENSORBOARD_DIR, name))

    def close(self, store: ObjectStore, output: str) -> None:
        """The last uploads: the event files, and the progress report with the run's final state."""
        if self._reports is not None:
            self._reports.close()
            if self._latest is not None:
                try:
                    write_report(store, join(output, TRAIN_PROGRESS_NAME), self.record())
                except Exception as err:  # noqa: BLE001 - the report is for people; the run's outcome stands
                    log.warning("train progress report: could not write the last one (%s)", err)
            self._reports = None
        if self._writer is not None:
            self.upload(store, output)
            self._writer.close()
            self._writer = None


def read_scalars(store: ObjectStore, output: str, tag: str) -> dict[int, float]:
    """step -> value of a TensorBoard scalar over every event file under the output (later files win)."""
    import tempfile

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for uri in store.list(join(output, TENSORBOARD_DIR)):
            local = os.path.join(tmp, uri.rsplit("/", 1)[-1])
            store.download_to(uri, local)
            acc = EventAccumulator(local, size_guidance={"scalars": 0})
            acc.Reload()
            if tag in acc.Tags().get("scalars", []):
                values.update({int(e.step): float(e.value) for e in acc.Scalars(tag)})
    return values
