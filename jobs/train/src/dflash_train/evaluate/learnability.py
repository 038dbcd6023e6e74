"""The learnability gate: a fresh drafter of the run's shape memorises a handful of the target's own answers, and
the exported copy of it must then have nearly every drafted token accepted on those prompts.

A recipe, export or serving defect that leaves learning possible but bent (labels or positions off by one, a wrong
target layer id, a weight dropped from the export) shows after a full run only as a lower tau, indistinguishable
from a hard dataset. Memorising a few answers is the one task whose right result is known: a drafter that has seen
exactly these continuations, decoding exactly these prompts, drafts what the target then says. So the gate

1. decodes the first `documents` prompts greedily with the target: its own answers, so the gate holds whatever
   sampling the data was generated with (the label agreement in training measures that drift);
2. trains a fresh drafter with the run drafter's shape (block size, layers, target layer ids, mask token) on them
   with the train stage's own step (`dflash_step`: anchors, block inputs, attention mask, labels, loss) at every
   anchor position, until it has memorised them (`MEMORISED_LOSS`, `MEMORISED_STEPS`) or `steps` run out;
3. exports it with the export stage's writer to the store and loads it back from there, as the engines will;
4. decodes the same prompts with the offline speculative loop, reading the target layers the export names.

The share of drafted tokens accepted must reach `min_acceptance`. The serving check replays the same prompts in
the engine with the same export (`OfflineReport.learnability`) and holds the engine to the same share: the
engine half of the gate. The gate costs one short training on a few hundred tokens and one decode of a few
prompts; the run's own drafter is not touched.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_shared.evaluation_report import Acceptance, LearnabilityGate, PromptResult
from dflash_shared.storage import ObjectStore
from dflash_train.sections import TrainingRecipe, TrainingRuntime

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

EXPORT_FOLDER = "learnability-export"
# When the answers count as memorised: every trained label predicted, and either the loss below MEMORISED_LOSS
# (about 99% on each label) or MEMORISED_STEPS steps in a row that predicted them all. A drafter that has only just
# memorised them flips on the last bits in which the decode's target states differ from training's; the second
# rule ends it on a target whose LM head is nearly flat (a random one), whose loss stays high however right its
# argmax. The drafter exported is the one whose forward met the rule: no update follows it (at the gate's constant
# rate one more update can undo a memorised label: the loss bounced between 0.001 and 0.2 from step to step once
# every label was predicted, and the verdict hung on the step it stopped at).
MEMORISED_LOSS = 0.01
MEMORISED_STEPS = 10


@dataclass(frozen=True)
class GateSettings:
    """What the gate trains and requires (EvaluateConfig's `learnability_*` fields)."""

    documents: int
    new_tokens: int
    steps: int
    lr: float
    min_acceptance: float
    seed: int = 0


@dataclass(frozen=True)
class Memorised:
    """The trained drafter and how far training got."""

    drafter: Any  # as it was at the last step's forward: no update follows it
    steps: int
    accuracy: float  # trained labels predicted at the last step
    loss: float  # the last step's loss


def acceptance_rate(acceptance: Acceptance, block_size: int) -> float:
    """Drafted tokens accepted, over drafted tokens (block_size - 1 per verification step)."""
    drafted = acceptance.steps * (block_size - 1)
    return acceptance.accepted_tokens / drafted if drafted else 0.0


def memorising_sections(longest: int, documents: int) -> tuple[TrainingRecipe, TrainingRuntime]:
    """The step's recipe and runtime for memorising: an anchor at every position of every document (every block
    seen at every step), no feature noise (it would only slow it), CE on the data with D-PACE weights."""
    recipe = TrainingRecipe(num_anchors=longest, feature_noise_std=0.0, objective="data_ce",
                            position_weighting="dpace", label_agreement=False)
    return recipe, TrainingRuntime(max_anchors_per_row=longest * documents)


def memorise(model: Any, cfg: Any, docs: Sequence[tuple[list[int], list[int]]], settings: GateSettings,
             device: torch.device) -> Memorised:
    """Train a fresh drafter of `cfg`'s shape on `docs` ((prompt, answer) pairs) with the train stage's step."""
    import torch

    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.training.step import dflash_step

    target, batch, recipe, runtime = memorising_step_inputs(model, cfg, docs, device)
    torch.manual_seed(settings.seed)
    drafter = DFlashDrafter(cfg).to(device).train()
    optim = torch.optim.AdamW(drafter.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, settings.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup))
    generator = torch.Generator().manual_seed(settings.seed)
    # A bfloat16 target trains an fp32 drafter under autocast, as the trainer does.
    low_precision = next(model.parameters()).dtype == torch.bfloat16
    accuracy, loss, step, streak = 0.0, float("nan"), 0, 0
    for step in range(1, settings.steps + 1):
        amp = torch.autocast(device_type=device.type, dtype=torch.bfloat16) if low_precision else nullcontext()
        with amp:
            out = dflash_step(drafter, target, batch, cfg, recipe, runtime, generator)
        accuracy, loss = float(out.correct.sum()) / max(1, int(out.counted.sum())), out.loss.item()
        if step % 50 == 0:
            log.info("learnability gate: step %d/%d, loss %.4f, labels predicted %.1f%%", step, settings.steps,
                     loss, 100 * accuracy)
        streak = streak + 1 if accuracy == 1.0 else 0
        if streak and (loss < MEMORISED_LOSS or streak >= MEMORISED_STEPS):
            break  # before the update: these are the weights that met the rule
        optim.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optim.step()
        sched.step()
    return Memorised(drafter.eval().requires_grad_(False), step, accuracy, loss)


def memorising_step_inputs(model: Any, cfg: Any, docs: Sequence[tuple[list[int], list[int]]], device: torch.device
                           ) -> tuple[Any, Any, TrainingRecipe, TrainingRuntime]:
    """(target, batch, recipe, runtime) of `dflash_step` on `docs`, packed into one row each, every position an
    anchor."""
    from dflash_train.data.batch import pack_documents
    from dflash_train.target_model.frozen import FrozenTarget

    longest = max(len(p) + len(a) for p, a in docs)
    recipe, runtime = memorising_sections(longest, len(docs))
    # keep_output: the evaluation decodes with the whole model afterwards, so no layer may be dropped.
    target = FrozenTarget(model, cfg.target_layer_ids, keep_output=True)
    target.check_drafter_config(cfg)
    batch = pack_documents([(p + a, [0] * len(p) + [1] * len(a)) for p, a in docs], max_length=longest).to(device)
    return target, batch, recipe, runtime


def run_gate(model: Any, run_drafter_cfg: Any, prompts: Sequence[tuple[str, list[int]]], stop: Sequence[int],
             settings: GateSettings, device: torch.device, dtype: torch.dtype, store: ObjectStore,
             export_uri: str) -> LearnabilityGate:
    """The gate (module docstring) on the first `settings.documents` of `prompts`; its report, pass or fail."""
    from dflash_train.evaluate.acceptance import summarize
    from dflash_train.evaluate.speculate import HookedTarget, greedy_with_logprobs, speculative_generate
    from dflash_train.export.files import export_drafter, load_export

    chosen = list(prompts[: settings.documents])
    references = [greedy_with_logprobs(model, ids, settings.new_tokens, stop) for _, ids in chosen]
    docs = [(list(ids), list(ref.tokens)) for (_, ids), ref in zip(chosen, references, strict=True)]
    log.info("learnability gate: a fresh drafter memorises the target's answers to %d prompts (%d tokens)",
             len(docs), sum(len(a) for _, a in docs))
    memorised = memorise(model, run_drafter_cfg, docs, settings, device)
    export_dtype = str(dtype).removeprefix("torch.")
    export_drafter(memorised.drafter, model.config, export_uri, store, export_dtype)
    exported = load_export(export_uri, store, device, dtype)  # read back from the store, as the engines will
    block = exported.config.block_size
    target = HookedTarget(model, exported.config.target_layer_ids)
    try:
        results = [speculative_generate(exported, target, ids, settings.new_tokens, stop, block)
                   for _, ids in chosen]
    finally:
        target.close()
    acceptance: Acceptance = summarize(results, block, [len(ids) for _, ids in chosen])
    rate = acceptance_rate(acceptance, block)
    gate = LearnabilityGate(
        documents=len(chosen), new_tokens=settings.new_tokens, train_steps=memorised.steps,
        train_accuracy=memorised.accuracy, min_acceptance=settings.min_acceptance, acceptance_rate=rate,
        drafter_export=export_uri, acceptance=acceptance,
        results=[PromptResult(id=rid, prompt_token_ids=ids, output_token_ids=r.tokens, accepted=r.accepted)
                 for (rid, ids), r in zip(chosen, results, strict=True)])
    log.info("learnability gate: %s", gate.summary())
    return gate
