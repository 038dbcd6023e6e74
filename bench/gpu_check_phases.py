"""Per-phase timing of the DFlash step for bench/gpu_check.py, and its projection to the full-depth target.

The step stays the project's own (`dflash_step`, then backward and AdamW); the phases are marked from the
outside, so nothing is timed that training does not run:
- target_features: from the step's start until `target.forward` returns (a wrapper on the instance);
- anchors_and_masks: anchor sampling, block inputs, embedding, feature noise and the drafter masks, until
  the drafter's forward pre-hook;
- drafter_forward: until the drafter's forward hook;
- loss: the chunked LM-head cross-entropy (it also computes the hidden-state gradient, see
  gpu_check_flops), until `dflash_step` returns;
- backward: `loss.backward()` (the drafter's backward);
- optimizer: gradient clipping and the AdamW step.
On CUDA each mark is a CUDA event recorded on the current stream, so a phase is the GPU time between two
marks (read after one synchronisation at the end, no sync inside the step to distort it); on a CPU every
op is synchronous and a mark is `time.perf_counter()` (wall time).

The target's decoder layers are timed too, per layer kind (forward pre-hook and hook on each kept layer),
because the check keeps only a few of the real target's layers: the full-depth step adds, for each kind,
the missing layers at the measured time per layer of that kind,
    T_full = T + sum_kind (L_full,kind - L_kept,kind) * t_kind,
and its FLOPs are the measured ones with the target terms counted at full depth (F_full). The projected
MFU keeps the measured MFU's clock and peak: MFU_full = MFU * (F_full / F) * (T / T_full), which is
F_full / (T_full * peak) where MFU = F / (T * peak) (CUDA: wall time against the datasheet peak).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import gpu_check_flops as flops
import torch

PHASES = ("target_features", "anchors_and_masks", "drafter_forward", "loss", "backward", "optimizer")


class PhaseTimer:
    """Marks of the timed steps; `active` only between `start` and `end` (warm-up steps are not marked)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.active = False
        self.steps: list[list[tuple[str, Any]]] = []
        self.layer_spans: list[list[tuple[str, Any, Any]]] = []
        self._marks: list[tuple[str, Any]] = []
        self._spans: list[tuple[str, Any, Any]] = []
        self._open: dict[int, Any] = {}

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.active = True
        self._marks, self._spans, self._open = [("start", self._now())], [], {}

    def mark(self, name: str) -> None:
        if self.active:
            self._marks.append((name, self._now()))

    def end(self) -> None:
        self.steps.append(self._marks)
        self.layer_spans.append(self._spans)
        self.active = False

    def layer_begin(self, layer: torch.nn.Module) -> None:
        if self.active:
            self._open[id(layer)] = self._now()

    def layer_end(self, layer: torch.nn.Module, kind: str) -> None:
        if self.active and id(layer) in self._open:
            self._spans.append((kind, self._open.pop(id(layer)), self._now()))

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def summary(self) -> dict[str, Any]:
        """Per phase: mean and median seconds per step; per target layer kind: seconds per step."""
        if self.cuda:
            torch.cuda.synchronize()
        per_phase: dict[str, list[float]] = {p: [] for p in PHASES}
        problems = []
        for marks in self.steps:
            names = [name for name, _ in marks[1:]]
            if names != list(PHASES):
                problems.append(f"a step marked {names}, not {list(PHASES)}: a hook did not fire")
                continue
            for (_, a), (name, b) in zip(marks, marks[1:], strict=False):
                per_phase[name].append(self._seconds(a, b))
        kinds: dict[str, list[float]] = {}
        for spans in self.layer_spans:
            step: dict[str, float] = {}
            for kind, a, b in spans:
                step[kind] = step.get(kind, 0.0) + self._seconds(a, b)
            for kind, seconds in step.items():
                kinds.setdefault(kind, []).append(seconds)
        return {
            "phase_s_mean": {p: round(statistics.fmean(v), 5) for p, v in per_phase.items() if v},
            "phase_s_median": {p: round(statistics.median(v), 5) for p, v in per_phase.items() if v},
            "step_s_phases_mean": round(sum(statistics.fmean(v) for v in per_phase.values() if v), 5),
            "target_layer_s_per_step": {k: round(statistics.fmean(v), 5) for k, v in kinds.items()},
            "timed_steps": len(self.steps), "problems": problems,
            "clock": "CUDA events (GPU time between marks)" if self.cuda else "wall time (CPU ops are synchronous)",
        }


def instrument(timer: PhaseTimer, target: Any, drafter: torch.nn.Module) -> list[Any]:
    """Hooks and the features wrapper that mark the phases; returns the undo handles for `remove`."""
    original = target.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        timer.mark("target_features")
        return out

    target.forward = forward  # an instance attribute: shadows the method until `remove`
    handles: list[Any] = [("forward", target)]
    handles.append(drafter.register_forward_pre_hook(lambda *_: timer.mark("anchors_and_masks")))
    handles.append(drafter.register_forward_hook(lambda *_: timer.mark("drafter_forward")))
    decoder = target.model.get_decoder()
    for kind, layer in zip(target.layer_types, decoder.layers, strict=False):
        handles.append(layer.register_forward_pre_hook(lambda m, *_: timer.layer_begin(m)))
        handles.append(layer.register_forward_hook(lambda m, *_, kind=kind: timer.layer_end(m, kind)))
    return handles


def remove(handles: list[Any]) -> None:
    for handle in handles:
        if isinstance(handle, tuple):
            del handle[1].forward  # the class's method again
        else:
            handle.remove()


def phase_rates(phase_s: dict[str, float], terms: dict[str, float]) -> dict[str, float]:
    """Achieved TFLOP/s of each phase that does model FLOPs (gpu_check_flops.PHASE_TERMS)."""
    out = {}
    for phase, weights in flops.PHASE_TERMS.items():
        seconds = phase_s.get(phase)
        if seconds:
            out[phase] = round(sum(terms.get(t, 0.0) * w for t, w in weights.items()) / seconds / 1e12, 4)
    return out


def project_full_depth(kept_kinds: list[str], full_kinds: list[str], layer_s: dict[str, float], step_s: float,
                       terms: dict[str, float], full_target_terms: dict[str, float], mfu: float) -> dict[str, Any]:
    """The step at the real target depth from the measured one (see the module docstring)."""
    added_s = 0.0
    per_kind = {}
    for kind in sorted(set(full_kinds) | set(kept_kinds)):
        kept, full = kept_kinds.count(kind), full_kinds.count(kind)
        if full != kept and (kept == 0 or kind not in layer_s):
            raise ValueError(f"no measured {kind} layer to project {full - kept} more from")
        per_layer = layer_s.get(kind, 0.0) / kept if kept else 0.0
        per_kind[kind] = {"kept": kept, "full": full, "s_per_layer": round(per_layer, 6)}
        added_s += (full - kept) * per_layer
    measured_flop = sum(terms.values())
    target_now = sum(v for k, v in terms.items() if k.startswith("target_"))
    full_flop = measured_flop - target_now + sum(full_target_terms.values())
    step_full = step_s + added_s
    mfu_full = mfu * (full_flop / measured_flop) * (step_s / step_full)
    return {
        "layers": per_kind,
        "step_s": round(step_s, 5), "step_s_full_depth": round(step_full, 5),
        "flops_tflop": round(measured_flop / 1e12, 4), "flops_full_depth_tflop": round(full_flop / 1e12, 4),
        "target_flops_full_depth_tflop": {k: round(v / 1e12, 4) for k, v in full_target_terms.items()},
        "mfu": round(mfu, 4), "mfu_full_depth": round(mfu_full, 4),
        "formula": ("T_full = T + sum_kind (L_full,kind - L_kept,kind) * t_kind;"
                    " MFU_full = MFU * (F_full / F) * (T / T_full)  [= F_full / (T_full * peak)]"),
        "worked": (f"T_full = {step_s:.4g} + "
                   + " + ".join(f"({v['full']} - {v['kept']}) * {v['s_per_layer']:.4g}" for v in per_kind.values())
                   + f" = {step_full:.4g} s; MFU_full = {mfu:.4g} * ({full_flop / 1e12:.4g}"
                   f" / {measured_flop / 1e12:.4g}) * ({step_s:.4g} / {step_full:.4g}) = {mfu_full:.4g}"),
    }
