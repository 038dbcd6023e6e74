"""Print what a run produced, read from its manifests: records and tokens per stage, loss, acceptance (and on
which prompts: the held-out split that training never read, by default).

It runs in the trainer's environment (the loss curve comes from the trainer's TensorBoard files), which has the
stage contract library but not the orchestration: run_demo.py passes the run's prefixes as JSON
(`{"run_id", "run_prefix", "model_id", "outputs": [[name, prefix, kind], ...]}`).
"""

from __future__ import annotations

import json
import sys

from dflash_shared.manifest_io import ManifestError, load_manifest
from dflash_shared.manifests import (
    MANIFEST_NAME,
    CompletionsSection,
    DrafterSection,
    EvaluationSection,
    Kind,
    Shard,
    TokenizedSection,
)
from dflash_shared.storage import ObjectStore, join


def loss_curve(store: ObjectStore, drafter_prefix: str, points: int = 8) -> str:
    """A few (step, loss) points from the TensorBoard scalars the trainer writes beside its manifest."""
    from dflash_train.training.metrics import read_scalars  # the trainer's environment runs this summary

    losses = read_scalars(store, drafter_prefix, "train/loss")
    if not losses:
        return "(no loss recorded)"
    steps = sorted(losses)
    stride = max(1, len(steps) // points)
    picked = sorted(set(steps[::stride]) | {steps[-1]})
    return "  ".join(f"{step}:{losses[step]:.3f}" for step in picked)


def serving_note(store: ObjectStore, shards: list[str]) -> str:
    """Where the engine ran at another dtype than the offline loop: the comparison over prompts decoded alike."""
    report = next((uri for uri in shards if uri.endswith("serve-check.json")), None)
    if report is None:
        return ""
    check = json.loads(store.read_bytes(report))
    if check.get("dtype") == check.get("offline_dtype", check.get("dtype")):
        return ""
    matched = check["matched"]
    alike = f"{matched['prompts']}/{check['prompts']} prompts decoded alike"
    if matched.get("engine_tau") is not None:
        alike += f": engine {matched['engine_tau']:.2f} vs offline {matched['offline_tau']:.2f}"
    return f" ({check['dtype']} vs {check['offline_dtype']}; {alike})"


def speculation_rows(store: ObjectStore, section: EvaluationSection, shards: list[str]) -> list[str]:
    """The trained drafter beside vLLM's n-gram speculation and the untrained drafter, when the serving check ran
    the n-gram baseline: the same prompts, the same engine settings.

    Engine tau is vLLM's 1 + accepted / drafts, over the steps that drafted something; tok/step counts every
    step (n-gram drafts nothing without a match, which its tau leaves out).
    """
    report = next((uri for uri in shards if uri.endswith("serve-check.json")), None)
    if report is None:
        return []
    check = json.loads(store.read_bytes(report))
    ngram = check.get("ngram")
    if ngram is None:
        return []
    settings = ngram["settings"]
    label = (f"n-gram (lookup {settings['prompt_lookup_min']}-{settings['prompt_lookup_max']}, "
             f"{settings['num_speculative_tokens']} drafted)")
    per_step = check.get("engine_tokens_per_step")
    rows = [f"speculation on the {check['prompts']} prompts  {'offline tau':>12}{'engine tau':>12}{'tok/step':>10}",
            f"  {'DFlash, trained':<38}{section.tau:>12.2f}{check['engine']['tau']:>12.2f}"
            f"{per_step if per_step is not None else float('nan'):>10.2f}",
            f"  {label:<38}{'-':>12}{ngram['tau']:>12.2f}{ngram['tokens_per_step']:>10.2f}"]
    if section.tau_untrained is not None:
        rows.append(f"  {'DFlash, untrained':<38}{section.tau_untrained:>12.2f}{'-':>12}{'-':>10}")
    rows.append(f"  trained / n-gram engine tau {check['engine']['tau'] / ngram['tau']:.2f}x"
                + (f", tokens per step {per_step / ngram['tokens_per_step']:.2f}x" if per_step else ""))
    return rows


SPLIT_NAMES = {"heldout": "held-out", "train": "trained-on"}


def evaluated_prompts(section: EvaluationSection, shards: list[Shard]) -> str:
    """'16 held-out prompts': how many prompts the offline figures are over, and which ones."""
    report = next((s for s in shards if s.uri.endswith("evaluation.json")), None)
    words = [str(report.records) if report is not None else "", SPLIT_NAMES.get(section.prompt_split or "", "")]
    return " ".join([*(w for w in words if w), "prompts"])


def main(run_json: str) -> int:
    run = json.loads(run_json)
    store = ObjectStore()
    print(f"\nrun {run['run_id']} under {run['run_prefix']} (target {run['model_id']})")
    outputs = [(name, prefix, Kind(kind)) for name, prefix, kind in run["outputs"]]
    for name, prefix, kind in outputs:
        try:
            m = load_manifest(store, prefix, kind, verify=False).manifest
        except ManifestError:
            print(f"  {name:12s} not written")
            continue
        acc = m.accounting
        line = f"  {name:12s} {acc.succeeded:6d} ok, {acc.failed} failed, {acc.skipped} skipped"
        section = m.section
        if isinstance(section, CompletionsSection):
            line += f"; {section.output_tokens:,} output tokens"
        if isinstance(section, TokenizedSection):
            held = section.heldout
            trained = section.loss_tokens - (held.loss_tokens if held else 0)
            line += f"; {section.total_tokens:,} tokens, {trained:,} trained"
            if held is not None:
                line += f"; {held.records} records ({held.tokens:,} tokens) held out for evaluation"
        if isinstance(section, DrafterSection):
            metrics = ", ".join(f"{k} {v:.3f}" for k, v in sorted(section.final_metrics.items()))
            line += f"; {metrics}"
        if isinstance(section, EvaluationSection):
            line += (f"; tau {section.tau:.2f} trained vs {section.tau_untrained or 0:.2f} untrained on "
                     f"{evaluated_prompts(section, m.shards)}")
            if section.engine_tau is not None:
                line += f", engine tau {section.engine_tau:.2f}"
                line += serving_note(store, [shard.uri for shard in m.shards])
        print(line)
        if isinstance(section, EvaluationSection):
            for row in speculation_rows(store, section, [shard.uri for shard in m.shards]):
                print(f"  {'':12s} {row}")
        if acc.failures_by_reason:
            print(f"  {'':12s} failures: {acc.failures_by_reason}")
        print(f"  {'':12s} {join(prefix, MANIFEST_NAME)}")
        if kind is Kind.drafter:
            print(f"  {'':12s} loss by step: {loss_curve(store, prefix)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
