"""`dflash-train evaluate`: acceptance of an exported drafter on held-out prompts, with a gate.

The prompts are by default the held-out split of the run's tokenized data: records of the training
distribution that training never read (`--split train` measures on trained records instead, an optimistic
figure; a prompts or completions manifest is used whole). User prompt sets (`--prompt-sets`, JSONL files of
GSM8K/MATH500/HumanEval/MT-Bench-style questions, see `evaluate.prompts`) are rendered with the target's chat
template and reported beside them, one tau per set.

The drafter is loaded FROM ITS EXPORT (what the engines will load), the target from its directory, and
every prompt is decoded greedily by the offline speculative loop (`speculate`). Reported:
mean acceptance length tau (pooled over all verification steps, as an engine counts it), its histogram,
acceptance per block position (fraction of steps whose draft was accepted at least that far), tokens per
target forward, tau by context position (buckets of `position_bucket_tokens`: does acceptance hold up on long
contexts?); beside them an untrained drafter of the same shape on the first prompts, the per-position
accuracies that training logged, and a losslessness check on the first prompts: the loop's output against the
target's own greedy output under the numerics policy of `dflash_shared.lossless` (exact in float32; in
bfloat16 partings only at near-ties that both runs show, teacher-forced past them), for the trained and the
untrained drafter alike.

Output: `<output>/evaluation.json` (the full report, including the prompts' token ids, which the serving
check replays in the engine) and `<output>/manifest.json` (kind evaluation, engine_tau None), written
last. A tau below `min_tau`, or outputs that break the numerics policy (a parting that is not a near-tie, or
more near-tie partings than rounding explains), fail the run with BadInputError (exit 65) after the report is
written, and no manifest is committed: a loop that is not lossless measures a tau that no engine would reproduce.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dflash_shared.errors import BadInputError
from dflash_shared.evaluation_report import (
    REPORT_NAME,
    Acceptance,
    OfflineReport,
    PromptResult,
    PromptSetReport,
)
from dflash_shared.identity import chat_template_sha256, tokenizer_sha256
from dflash_shared.lossless import Comparing, Equivalence
from dflash_shared.manifest_io import LoadedManifest, committed, load_manifest, write_manifest
from dflash_shared.manifests import MANIFEST_NAME, Accounting, DrafterSection, EvaluationSection, Kind, Manifest, Shard
from dflash_shared.progress import Progress
from dflash_shared.provenance import producer
from dflash_shared.runner import merge_accounting
from dflash_shared.settings import public_dict
from dflash_shared.storage import ObjectStore, is_s3, join
from dflash_train.evaluate.acceptance import summarize
from dflash_train.evaluate.config import EvaluateConfig
from dflash_train.evaluate.learnability import EXPORT_FOLDER
from dflash_train.evaluate.prompts import (
    ChatRenderer,
    PickedSet,
    PromptSetSource,
    PromptSource,
    load_prompts_manifest,
    pick_prompts,
    prompt_split,
)

log = logging.getLogger(__name__)
STAGE = "evaluate"
PACKAGES = ["dflash-train", "torch", "transformers", "safetensors"]
_ACC_KEY = re.compile(r"^(?:train_)?acc(?:uracy)?_(?:pos_)?(\d+)$")


def training_accuracies(final_metrics: dict[str, float]) -> list[float]:
    """Per-slot accuracies from a drafter manifest's final_metrics ('acc_1', 'acc_2', ... ; slot 1 first)."""
    found = {int(m.group(1)): float(v) for k, v in final_metrics.items() if (m := _ACC_KEY.match(k))}
    return [found[k] for k in sorted(found) if k >= 1]


# ------------------------------------------------------------------------------------------ inputs


def _progress(items: list[Any], desc: str) -> Iterator[Any]:
    with Progress(total=len(items), unit="prompts", desc=desc) as progress:
        for item in items:
            yield item
            progress.update(1)


def local_dir(store: ObjectStore, uri: str, scratch: str, name: str) -> str:
    """`uri` itself when local, else a copy of the s3:// prefix under scratch/name."""
    if not is_s3(uri):
        return uri
    dest = os.path.join(scratch, name)
    prefix = uri.rstrip("/") + "/"
    for obj in store.list(prefix):
        store.download_to(obj, os.path.join(dest, obj[len(prefix) :]))
    return dest


def check_target_files(target_dir: str, drafter: LoadedManifest[DrafterSection]) -> None:
    """The target directory must have the tokenizer and template the drafter was trained with."""
    identity = drafter.section.target
    checks = {"tokenizer_sha256": tokenizer_sha256(target_dir),
              "chat_template_sha256": chat_template_sha256(target_dir)}
    for name, have in checks.items():
        want = getattr(identity, name)
        if have != want:
            raise BadInputError(f"target {target_dir}: {name} is {have}, the drafter {drafter.uri} was trained "
                                f"with {want} (a different tokenizer or chat template collapses acceptance)")


# ---------------------------------------------------------------------------------------- decoding


def resolve_device_dtype(config: EvaluateConfig) -> tuple[Any, Any]:
    """(torch device, torch dtype) from the config: auto = CUDA when present, bf16 on CUDA, fp32 on CPU."""
    import torch

    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if config.device == "auto" else config.device)
    if config.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]


def stop_token_ids(model: Any) -> list[int]:
    """End-of-sequence ids of the target: its generation config's and its model config's (as engines do)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return sorted(int(i) for i in ids)


@dataclass(frozen=True)
class GateOutput:
    """Where the learnability gate exports its drafter."""

    store: ObjectStore
    export_uri: str


def evaluate_drafter(config: EvaluateConfig, target_dir: str, export_dir: str, export_uri: str,
                     final_metrics: dict[str, float], prompts: list[tuple[str, list[int]]],
                     split: Literal["heldout", "train", "all"] = "all",
                     sets: dict[str, PickedSet] | None = None, gate_output: GateOutput | None = None) -> OfflineReport:
    """Decode `prompts` (and each prompt set) with the exported drafter, and the baselines; the report of the
    offline loop. With `config.learnability_documents` (and `gate_output`) the learnability gate runs first."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.evaluate.speculate import HookedTarget, greedy_with_logprobs, speculative_generate
    from dflash_train.export.files import load_export_dir
    from dflash_train.training.loss import expected_acceptance_length

    if config.threads:
        torch.set_num_threads(config.threads)
    device, dtype = resolve_device_dtype(config)
    drafter = load_export_dir(export_dir, device, dtype)
    cfg = drafter.config
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    target = HookedTarget(model, cfg.target_layer_ids)
    if not 0 <= cfg.mask_token_id < target.vocab_rows:
        raise BadInputError(f"mask_token_id {cfg.mask_token_id} is not a row of the target embedding "
                            f"(0..{target.vocab_rows - 1})")
    block = config.block_size or cfg.block_size
    stop = stop_token_ids(model)
    gate = None
    if config.learnability_documents and gate_output is not None:
        from dflash_train.evaluate.learnability import GateSettings, run_gate

        settings = GateSettings(config.learnability_documents,
                                min(config.learnability_new_tokens, config.max_new_tokens),
                                config.learnability_steps, config.learnability_lr,
                                config.learnability_min_acceptance, config.seed)
        gate = run_gate(model, cfg, prompts, stop, settings, device, dtype, gate_output.store,
                        gate_output.export_uri)

    policy = config.numerics_policy(str(dtype).removeprefix("torch."))
    checked = prompts[: config.lossless_prompts]
    # The target's own greedy outputs of the checked prompts, with their log-probabilities: each checked
    # prompt's speculative decode is compared with it as it goes (teacher-forced past near-ties).
    references = [greedy_with_logprobs(model, ids, config.max_new_tokens, stop)
                  for _, ids in _progress(checked, "evaluate greedy reference")]

    def decode(which: Any, items: list[tuple[str, list[int]]], label: str,
               checked_against: Sequence[Any] = ()) -> tuple[list[Any], Equivalence]:
        """Speculative outputs of `items`; the first ones compared with `checked_against` (their references)."""
        out, comparing = [], Comparing(policy)
        with Progress(total=len(items), unit="prompts", desc=f"evaluate {label} drafter") as progress:
            for i, (rid, ids) in enumerate(items):
                reference = checked_against[i] if i < len(checked_against) else None
                result = speculative_generate(which, target, ids, config.max_new_tokens, stop, block,
                                              reference=reference, policy=policy, prompt_id=rid)
                if reference is not None:
                    comparing.add(reference.logprobs, result.partings)
                out.append(result)
                progress.update(1, tokens=len(result.tokens))
        return out, comparing.result()

    def acceptance(results: list[Any], items: list[tuple[str, list[int]]]) -> Acceptance:
        return summarize(results, block, [len(ids) for _, ids in items], config.position_bucket_tokens)

    results, lossless = decode(drafter, prompts, "exported", references)
    untrained = lossless_untrained = None
    if config.baseline_prompts:
        torch.manual_seed(config.seed)
        baseline = DFlashDrafter(cfg).to(device=device, dtype=dtype).eval()
        items = prompts[: config.baseline_prompts]
        baseline_results, lossless_untrained = decode(baseline, items, "untrained", references)
        untrained = acceptance(baseline_results, items)
    for name, one in (("exported", lossless), ("untrained", lossless_untrained)):
        if one is not None and one.prompts:
            log.info("lossless check, %s drafter: %s", name, one.summary())
        for parting in one.mismatches if one is not None else ():
            log.error("%s drafter: %s", name, parting.describe())
    per_set = {name: PromptSetReport(uri=picked.uri, bad_lines=picked.bad_lines,
                                     acceptance=acceptance(decode(drafter, picked.prompts, f"{name}: exported")[0],
                                                           picked.prompts))
               for name, picked in (sets or {}).items()}
    accuracies = training_accuracies(final_metrics)
    return OfflineReport(
        block_size=block,
        max_new_tokens=config.max_new_tokens,
        stop_token_ids=stop,
        dtype=str(dtype).removeprefix("torch."),
        drafter_export=export_uri,
        prompt_split=split,
        trained=acceptance(results, prompts),
        untrained=untrained,
        training_acceptance_per_position=accuracies,
        training_expected_tau=expected_acceptance_length(accuracies) if accuracies else None,
        lossless_checked=len(checked),
        lossless_mismatches=sorted({p.prompt_id for p in lossless.mismatches}),
        lossless=lossless,
        lossless_untrained=lossless_untrained,
        results=[PromptResult(id=rid, prompt_token_ids=ids, output_token_ids=r.tokens, accepted=r.accepted)
                 for (rid, ids), r in zip(prompts, results, strict=True)],
        prompt_sets=per_set,
        learnability=gate,
    )


# ------------------------------------------------------------------------------------------- stage


def run(config: EvaluateConfig, store: ObjectStore | None = None) -> str:
    """Run the evaluation; returns the URI of the evaluation manifest (existing one: nothing is redone)."""
    store = store or ObjectStore()
    if done := committed(store, config.output, STAGE):
        return done
    drafter = load_manifest(store, config.drafter, Kind.drafter, verify=False)
    section = drafter.section
    export_uri = section.export_uri
    if not export_uri:
        raise BadInputError(f"drafter manifest {drafter.uri} names no export_uri: run `dflash-train export` first")
    identity = section.target
    prompts_loaded = load_prompts_manifest(store, config.prompts, identity)
    split = prompt_split(prompts_loaded, config.split)
    if split == "all" and "split" in config.model_fields_set:
        log.warning("--split %s ignored: %s is a %s manifest, used whole (only tokenized data is split)",
                    config.split, prompts_loaded.uri, prompts_loaded.manifest.kind.value)
    with tempfile.TemporaryDirectory(prefix="dflash-evaluate-", dir=config.scratch_dir) as scratch:
        from dflash_shared.model_copy import fetch_model

        target_dir = fetch_model(store, config.target, scratch)
        check_target_files(target_dir, drafter)
        render = ChatRenderer(target_dir, identity.enable_thinking)
        picked, accounting = pick_prompts(PromptSource(store, prompts_loaded, render, split), config)
        log.info("%d %s prompts from %s", len(picked), split, prompts_loaded.uri)
        sets, parts = {}, [accounting]
        for name, uri in config.prompt_sets.items():
            # Read (and rendered) before any model loads: an unusable set fails in seconds, not after decoding.
            source = PromptSetSource(store, name, uri, render)
            prompts, part = pick_prompts(source, config, skip=0)
            sets[name], parts = PickedSet(uri, prompts, source.bad), [*parts, part]
            for line in source.bad:
                log.warning("prompt set %s: unusable line %s", name, line)
        export_dir = local_dir(store, export_uri, scratch, "export")
        gate_output = GateOutput(store, join(config.output, EXPORT_FOLDER))
        report = evaluate_drafter(config, target_dir, export_dir, export_uri, section.final_metrics,
                                  picked, split, sets, gate_output)
    return commit(config, store, report, drafter, prompts_loaded, merge_accounting(parts), identity)


def commit(config: EvaluateConfig, store: ObjectStore, report: OfflineReport,
           drafter: LoadedManifest[DrafterSection], prompts: LoadedManifest[Any], accounting: Accounting,
           identity: Any) -> str:
    """Write the report, apply the gate, then commit the manifest (the gate failing commits nothing)."""
    data = report.model_dump_json(indent=1).encode()
    report_uri = join(config.output, REPORT_NAME)
    store.write_bytes(report_uri, data)
    trained, untrained = report.trained, report.untrained
    log.info("offline tau %.3f over %d %s prompts / %d steps (untrained %s); per position %s", trained.tau,
             trained.prompts, report.prompt_split, trained.steps, f"{untrained.tau:.3f}" if untrained else "not run",
             [round(a, 3) for a in trained.acceptance_per_position])
    metrics: dict[str, float] = {}
    for name, result in report.prompt_sets.items():
        got = result.acceptance
        log.info("prompt set %s: tau %.3f over %d prompts / %d steps, %d unusable line(s) (%s)", name, got.tau,
                 got.prompts, got.steps, len(result.bad_lines), result.uri)
        metrics.update({f"tau_{name}": got.tau, f"prompts_{name}": got.prompts,
                        f"bad_lines_{name}": len(result.bad_lines)})
    for name, check in (("exported", report.lossless), ("untrained", report.lossless_untrained)):
        failure = check.failure() if check is not None else None
        if failure:
            raise BadInputError(f"the speculative loop ({name} drafter) is not lossless: {failure}; its tau would "
                                f"not match an engine's. Report: {report_uri}")
    gate = report.learnability
    if gate is not None:
        metrics.update({"learnability_acceptance": gate.acceptance_rate, "learnability_tau": gate.acceptance.tau})
        if not gate.passed:
            raise BadInputError(
                f"learnability gate {gate.summary()}. A drafter that memorised these answers drafts what the target "
                f"says unless training and decoding disagree: labels or positions shifted in training, target layer "
                f"ids that differ between training and the export, or weights lost in the export; per position "
                f"{[round(a, 3) for a in gate.acceptance.acceptance_per_position]}; report: {report_uri}")
    if trained.tau < config.min_tau:
        raise BadInputError(
            f"offline acceptance length tau {trained.tau:.3f} is below min_tau {config.min_tau} (untrained "
            f"{untrained.tau if untrained else 'n/a'}, per position "
            f"{[round(a, 3) for a in trained.acceptance_per_position]}, training accuracies "
            f"{[round(a, 3) for a in report.training_acceptance_per_position]}; {trained.prompts} prompts, "
            f"{trained.steps} steps); report: {report_uri}"
        )
    manifest = Manifest(
        kind=Kind.evaluation,
        run_id=config.run_id or drafter.manifest.run_id,
        producer=producer(STAGE, public_dict(config), PACKAGES),
        inputs=[drafter.as_input(), prompts.as_input()],
        shards=[Shard(uri=report_uri, bytes=len(data), sha256=store.sha256(report_uri), records=trained.prompts,
                      tokens=trained.generated_tokens)],
        accounting=accounting,
        section=EvaluationSection(
            target=identity,
            tau=trained.tau,
            tau_untrained=untrained.tau if untrained else None,
            engine_tau=None,
            acceptance_per_position=trained.acceptance_per_position,
            tau_histogram=trained.tau_histogram,
            prompt_split=report.prompt_split,
            metrics=metrics,
        ),
    )
    write_manifest(store, config.output, manifest)
    return join(config.output, MANIFEST_NAME)
