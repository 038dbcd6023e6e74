"""Is the trained drafter good? It against vLLM's n-gram speculation and the untrained drafter (`make bench-quality`).

Every method decodes the same held-out prompts greedily in the same vLLM engine settings, and vLLM's own
spec-decode counters give its acceptance: tau = 1 + accepted / drafts, and accepted tokens per draft position.
The methods:
- DFlash, trained: the drafter trained on the target's own answers to other prompts;
- n-gram (prompt lookup): vLLM's `ngram` method, which needs no training, at each setting of a sweep over
  `prompt_lookup_min/max` and speculative tokens; the best setting is its row in the comparison;
- DFlash, untrained: the same drafter shape with random weights (the floor);
- plain decoding: the reference for wall-clock tokens/s.
The offline speculative loop's tau (the evaluate stage's) is printed beside the engine's for both drafters.

Default setting (CPU, about an hour the first time): both speaking targets (`tests.support.speaking_target`:
small Qwen3s trained by the project on the Python standard library), the docstring target (answers of 7-9
tokens) and the long-answer target (function bodies from their signature and docstring, about 112 tokens);
for each, prompts that neither it nor the drafter trained on, and a debug-size drafter made by the product
itself from the other prompts: the demo's run file with them as its source, its import, generate, tokenize,
train (`dflash-train run`) and export stages run by `dflash-pipeline local` (resumed with `--work-dir`).
`--speaking docs` or `--speaking code` measures one; with `--drafter EXPORT_DIR` too, it measures that export (a
recipe trial's, `bench/bench_drafter_trials.py`) instead of training the product's. Each target has its goals
(`SPEAKING_BENCHES`), printed as met or missed and by how much. On a GPU, the same script measures a real
target and drafter:

    python bench/bench_quality.py --target /models/Qwen3-8B --drafter /exports/dflash-qwen3-8b \\
        --prompts prompts.jsonl --device cuda --dtype bfloat16

(`--drafter` is an exported drafter directory, as `dflash-train export` writes; `--prompts` a JSONL file of
{"messages": [...]} or {"prompt": "..."} records; the untrained baseline is then its random re-initialisation.)
Wall-clock figures on the CPU are CPU figures: they show the methods' order at toy size, not a GPU's speed-up.

Runs in the generate environment with the train package installed (.venv-generate).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The n-gram sweep: (prompt_lookup_min, prompt_lookup_max, num_speculative_tokens). vLLM's default is 5 / 5
# (match exactly 5 tokens); short matches find more drafts in short answers, long ones fewer but surer, and
# fewer drafted tokens waste less verification when a match runs out. The best setting by tokens per step is
# the n-gram row of the comparison.
NGRAM_SWEEP = ((1, 2, 3), (1, 4, 3), (2, 4, 3), (1, 2, 7), (2, 4, 7), (3, 6, 7))
HELDOUT_EVERY = 10  # held-out prompts are at most every 10th of the target's held-out questions (spread over modules)


@dataclass(frozen=True)
class Goal:
    """A figure the trained drafter should reach: its engine tau or tokens per step, alone (`against` None) or
    as a ratio over the best n-gram setting or the untrained drafter."""

    figure: str  # "tau" or "tok/step"
    target: float
    against: str | None = None  # "n-gram", "untrained" or None

    def label(self) -> str:
        return f"trained {self.figure}" + (f" / {self.against} {self.figure}" if self.against else "")


@dataclass(frozen=True)
class SpeakingBench:
    """One speaking target's bench: which target, how long its answers may run, what its drafter's run file
    changes of the demo's, and the goals."""

    key: str  # speaking_target.TARGETS' key
    max_new_tokens: int
    overrides: dict[str, dict[str, Any]]
    goals: tuple[Goal, ...]


_RATIO_GOALS = (Goal("tau", 1.5, "n-gram"), Goal("tok/step", 1.5, "n-gram"),
                Goal("tau", 2.0, "untrained"), Goal("tok/step", 2.0, "untrained"))
SPEAKING_BENCHES = {
    # The demo's own run file, unchanged: bench-quality's figures for it are the demo's drafter's.
    # Goals: tokens per target step at least twice the best n-gram's.
    "docs": SpeakingBench("docs", 64, {}, (Goal("tok/step", 2.0, "n-gram"), Goal("tau", 2.0, "untrained"),
                                           Goal("tok/step", 2.0, "untrained"))),
    # Answers of about 112 tokens (up to 330): generate up to 256, 128 prompts in the engine at once (the demo's
    # 16 leave the CPU engine idle between short batches), train on rows of prompt and answer (up to 512),
    # 16 anchors per document (of ~145 valid positions: the CPU's budget), in bf16 as on a GPU (a bf16 target and
    # LM head under autocast), and 1,305 steps: the CPU time 760 steps took in float32 (bench_drafter_trials.py,
    # `dpace_wsd_bf16@time`; 760 were themselves 600's time before the label agreement was measured one step in ten).
    "code": SpeakingBench(
        "code", 256,
        {"generate": {"max_new_tokens": 256, "chunk_records": 128},
         "train": {"max_length": 512, "max_steps": 1305, "num_anchors": 16, "precision": "bf16",
                   "target_dtype": "bf16"}},
        # Goals: a trained tau of at least 2.0 and at least the best n-gram's tokens per target step.
        (Goal("tau", 2.0), Goal("tok/step", 1.0, "n-gram"), Goal("tau", 2.5, "untrained"),
         Goal("tok/step", 2.5, "untrained")),
    ),
}


@dataclass
class MethodRun:
    """One engine's pass over the held-out prompts."""

    method: str
    settings: str
    tau: float | None  # None for plain decoding
    drafts: int
    accepted_per_position: list[float]
    accepted: int
    tokens: int
    seconds: float
    start_seconds: float
    outputs: list[list[int]]
    offline_tau: float | None = None

    prompts: int = 0

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per target step, steps without a draft and the prefills included
        (`dflash_generate.ngram_baseline` says how the steps are counted)."""
        from dflash_generate.ngram_baseline import tokens_per_step

        return tokens_per_step(self.tokens, self.accepted, self.drafts, self.prompts)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def speaking_prompts(corpus: Any, heldout: int, train: int) -> tuple[list[str], list[str]]:
    """Held-out and drafter-training questions of a target's corpus: none of the held-out ones in the target's
    own training split, nor in the drafter's."""
    target_heldout = [p.question for p in corpus.split_pairs("heldout")]
    every = max(1, min(HELDOUT_EVERY, len(target_heldout) // heldout))
    evaluation = target_heldout[::every][:heldout]
    chosen = set(evaluation)
    rest = [q for q in target_heldout if q not in chosen]
    # The target's training questions too: the drafter should see the target's answers to many prompts.
    rest += [p.question for p in corpus.split_pairs("train")]
    return evaluation, rest[:train]


def prompts_from_file(path: Path, count: int) -> list[list[dict[str, str]]]:
    out = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            sys.exit(f"{path}:{line_no}: not a JSON record ({err.msg} at column {err.colno})")
        if not isinstance(record, dict):
            sys.exit(f"{path}:{line_no}: expected a JSON object with 'messages' or 'prompt'")
        if "messages" in record:
            out.append([m for m in record["messages"] if m["role"] != "assistant"])
        elif "prompt" in record:
            out.append([{"role": "user", "content": record["prompt"]}])
        else:
            sys.exit(f"{path}:{line_no}: expected 'messages' or 'prompt'")
        if len(out) == count:
            break
    if not out:
        sys.exit(f"{path}: no prompts")
    return out


def chat_ids(target_dir: Path, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    return [[int(i) for i in tok.apply_chat_template(c, add_generation_prompt=True, enable_thinking=False,
                                                     tokenize=True, return_dict=False)] for c in conversations]


def engine_pass(engine: Any, speculative: dict[str, Any] | None, prompts: list[list[int]], max_new_tokens: int,
                stops: list[int], method: str, settings: str) -> MethodRun:
    """Start an engine, warm it up, decode every prompt in one batch, read the counters around that batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from dflash_generate.serve_check.engine_passes import engine_acceptance, spec_counters, started_engine

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=stops, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    with started_engine(engine, speculative) as (llm, start_seconds):
        llm.generate(requests[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        before = spec_counters(llm.get_metrics()) if speculative else {}
        began = time.perf_counter()
        results = llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        outputs = [list(r.outputs[0].token_ids) for r in results]
        acceptance = engine_acceptance(before, spec_counters(llm.get_metrics())) if speculative else None
    return MethodRun(method=method, settings=settings, tau=acceptance.tau if acceptance else None,
                     drafts=acceptance.drafts if acceptance else 0,
                     accepted=acceptance.accepted_tokens if acceptance else 0,
                     accepted_per_position=acceptance.acceptance_per_position if acceptance else [],
                     tokens=sum(len(o) for o in outputs), seconds=seconds, start_seconds=start_seconds,
                     outputs=outputs, prompts=len(prompts))


def offline_tau(target_dir: Path, export_dir: Path, prompts: list[list[int]], max_new_tokens: int,
                stops: list[int], device: str, dtype: str) -> float:
    """The evaluate stage's offline speculative loop over the prompts: tau = (accepted + steps) / steps."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_train.evaluate.speculate import HookedTarget, speculative_generate
    from dflash_train.export.files import load_export_dir

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch_dtype).to(device).eval()
    drafter = load_export_dir(str(export_dir), device=device, dtype=torch_dtype)
    target = HookedTarget(model, drafter.config.target_layer_ids)
    steps = accepted = 0
    try:
        for prompt in prompts:
            result = speculative_generate(drafter, target, prompt, max_new_tokens, frozenset(stops))
            steps += len(result.accepted)
            accepted += sum(result.accepted)
    finally:
        target.close()
    return (accepted + steps) / steps if steps else float("nan")


# The stages that make the drafter, as `make demo` and a cluster run them; evaluate and the serving check are what
# this script measures itself, on its own held-out prompts.
PRODUCT_STAGES = ("import", "generate", "tokenize", "train", "export")


def product_drafter(target_dir: Path, train_questions: list[str], work: Path,
                    overrides: dict[str, dict[str, Any]]) -> Path:
    """The export of a drafter made by the product itself: the demo's run file for the speaking target (its
    generate, tokenize, train and export settings, as `make demo` runs them), with these questions as its source,
    run stage by stage by `dflash-pipeline local` (each stage in its own environment, through its own CLI). The
    target regenerates its answers, the tokenize stage holds a part out, `dflash-train run` trains on the rest.
    `overrides` change the run file's stage settings (as `make demo --overrides` does). A rerun with the same
    work dir resumes (committed stages are skipped)."""
    import subprocess

    sys.path.insert(0, str(REPO / "demo"))
    from run_demo import run_file

    from dflash_shared.manifest_io import load_manifest
    from dflash_shared.manifests import Kind
    from dflash_shared.storage import ObjectStore

    root = work / "store"
    source = root / "sources-bench-quality"
    source.mkdir(parents=True, exist_ok=True)
    (source / "prompts.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q}], "topic": "stdlib"}) + "\n"
        for q in train_questions), encoding="utf-8")
    config = run_file(target_dir, str(root), overrides, "speaking")
    config.update(run_id="bench-quality", source={"kind": "prompts", "uri": str(source)})
    run_path = work / "run.json"
    run_path.write_text(json.dumps(config, indent=2) + "\n")
    stages = [arg for stage in PRODUCT_STAGES for arg in ("--stage", stage)]
    print(f"  drafter: the product's stages ({', '.join(PRODUCT_STAGES)}) on {len(train_questions)} questions, "
          f"train settings {config['stages']['train']['config']}; logs in {work / 'logs'}", flush=True)
    subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "dflash_pipeline", "local", "--config",
                    str(run_path), "--log-dir", str(work / "logs"), *stages], cwd=REPO, check=True)
    drafter = load_manifest(ObjectStore(), str(root / "bench-quality" / "export"), Kind.drafter, verify=False)
    section = drafter.section
    metrics = section.final_metrics
    print(f"  drafter trained by `dflash-train run`: loss {metrics.get('loss', float('nan')):.3f}, "
          f"training tau {metrics.get('tau', float('nan')):.2f}; export {section.export_uri}")
    assert section.export_uri is not None
    return Path(section.export_uri)


def trained_drafter(target_dir: Path, train_questions: list[str], max_new_tokens: int, steps: int,
                    work: Path) -> tuple[Path, Path]:
    """Export directories of a drafter trained by a test fixture's own loop on the target's answers (cached) and
    of its untrained twin (`--fixture-drafter`: the figures before the product trained bench-quality's drafter)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from dflash_train.drafter.config import DrafterConfig
    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.export.files import write_export_dir
    from tests.evaluate import eval_fixtures as ef

    prompts = ef.chat_prompts(target_dir, train_questions)
    answers = ef.target_answers(target_dir, prompts, new_tokens=max_new_tokens)
    tokens = sum(len(a) for a in answers)
    print(f"  drafter data: {len(prompts)} prompts, {tokens} answer tokens from the target (cached)")
    # 16 anchors per row, as the train stage's debug preset: the fixture's default of 2 suits its 48 prompts.
    checkpoint = ef.train_drafter(target_dir, list(zip(prompts, answers, strict=True)), steps=steps,
                                  log=lambda line: print(f"  drafter training: {line}", flush=True), num_anchors=16)
    cfg = DrafterConfig.from_saved((checkpoint / "drafter_config.json").read_text())
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(load_file(str(checkpoint / "model.safetensors")))
    target_config = AutoConfig.from_pretrained(str(target_dir))
    trained, untrained = work / "export-trained", work / "export-untrained"
    write_export_dir(drafter.eval(), target_config, str(trained), dtype="float32")
    write_export_dir(ef.untrained_like(drafter), target_config, str(untrained), dtype="float32")
    return trained, untrained


def untrained_twin(export_dir: Path, target_dir: Path, work: Path) -> Path:
    """A random re-initialisation of an exported drafter (same config), exported the same way."""
    from transformers import AutoConfig

    from dflash_train.export.files import load_export_dir, write_export_dir
    from tests.evaluate import eval_fixtures as ef

    drafter = load_export_dir(str(export_dir))
    out = work / "export-untrained"
    write_export_dir(ef.untrained_like(drafter), AutoConfig.from_pretrained(str(target_dir)), str(out),
                     dtype="float32")
    return out


def print_table(runs: list[MethodRun], best_ngram: MethodRun, prompts: int, max_new_tokens: int,
                device: str) -> None:
    plain = next(r for r in runs if r.tau is None)
    print(f"\nheld-out prompts: {prompts} x up to {max_new_tokens} tokens, greedy, one batch per engine; "
          f"wall clock on {device}{' (CPU figures)' if device == 'cpu' else ''}")
    print(f"  {'method':<20}{'settings':<26}{'engine tau':>11}{'tok/step':>9}{'offline tau':>12}{'drafts':>7}"
          f"{'tokens':>7}{'tokens/s':>9}{'vs plain':>9}")
    for r in runs:
        tau = f"{r.tau:.3f}" if r.tau is not None else "-"
        off = f"{r.offline_tau:.3f}" if r.offline_tau is not None else "-"
        best = " *" if r is best_ngram else ""
        print(f"  {r.method:<20}{r.settings + best:<26}{tau:>11}{r.tokens_per_step:>9.3f}{off:>12}{r.drafts:>7}"
              f"{r.tokens:>7}{r.tokens_per_second:>9.1f}{r.tokens_per_second / plain.tokens_per_second:>8.2f}x")
    print("  engine tau = 1 + accepted / drafts (vLLM's counters; steps that drafted nothing are not counted);")
    print("  tok/step = tokens / max(tokens - accepted, drafts + prompts): every target step counted, prefills too")
    print("  * the n-gram setting with the most tokens per step: the n-gram row of the comparison")
    for r in runs:
        if r.accepted_per_position:
            print(f"  accepted per position, {r.method} {r.settings}: "
                  + " ".join(f"{a:.2f}" for a in r.accepted_per_position))
    differing = [r.method + " " + r.settings for r in runs if r.outputs != plain.outputs]
    print(f"  outputs equal to plain decoding: {len(runs) - 1 - len(differing)}/{len(runs) - 1} methods"
          + (f" (differ: {', '.join(differing)})" if differing else ""))


def figure(run: MethodRun, name: str) -> float:
    return run.tokens_per_step if name == "tok/step" else float(run.tau or 0.0)


def print_goals(goals: tuple[Goal, ...], trained: MethodRun, best_ngram: MethodRun, untrained: MethodRun) -> None:
    """Each goal as measured: met or missed, and by how much of the goal."""
    others = {"n-gram": best_ngram, "untrained": untrained}
    print("\n  goals (engine figures)")
    for goal in goals:
        value = figure(trained, goal.figure)
        if goal.against is not None:
            value /= figure(others[goal.against], goal.figure)
        unit = "x" if goal.against else ""
        margin = value / goal.target - 1
        verdict = f"met by {margin:.0%}" if margin >= 0 else f"MISSED by {-margin:.0%}"
        print(f"  {goal.label():<36}{value:>7.2f}{unit:<2} goal >= {goal.target}{unit}: {verdict}")
    # Acceptance is a prefix: drafting only the first k positions would have given 1 + the first k rates.
    cumulative = [1 + sum(trained.accepted_per_position[: k + 1]) for k in range(len(trained.accepted_per_position))]
    print("  trained tau by drafted positions (1 + accepted rates up to k): "
          + " ".join(f"{k + 1}:{t:.2f}" for k, t in enumerate(cumulative)))


@dataclass(frozen=True)
class Measured:
    """A target and drafter pair to measure: where they are, the held-out prompts, their decoding budget."""

    name: str
    target_dir: Path
    conversations: list[list[dict[str, str]]]
    trained: Path
    untrained: Path
    max_new_tokens: int
    stops: list[int]
    goals: tuple[Goal, ...]


def measure(m: Measured, device: str, dtype: str, skip_offline: bool) -> list[MethodRun]:
    """Every method over the held-out prompts in the same engine settings; prints the table and the goals."""
    from dflash_generate.engine import EngineConfig, engine_flavour
    from dflash_generate.target import read_target
    from dflash_train.export.format import config_from_export

    block_size = config_from_export(json.loads((m.trained / "config.json").read_text())).block_size
    prompts = chat_ids(m.target_dir, m.conversations)
    longest = max(len(p) for p in prompts)
    engine = EngineConfig(model=str(m.target_dir), dtype=dtype, max_model_len=longest + m.max_new_tokens + 32,
                          gpu_memory_utilization=0.3 if device == "cpu" else 0.85,
                          enforce_eager=device == "cpu").for_target(read_target(str(m.target_dir)), engine_flavour())

    def dflash(export: Path) -> dict[str, Any]:
        return {"method": "dflash", "model": str(export), "num_speculative_tokens": block_size - 1}

    def run(speculative: dict[str, Any] | None, method: str, settings: str) -> MethodRun:
        return engine_pass(engine, speculative, prompts, m.max_new_tokens, m.stops, method, settings)

    runs = [run(None, "plain decoding", "-"), run(dflash(m.trained), "DFlash, trained", f"{block_size - 1} drafted")]
    ngram_runs = [run({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low,
                       "prompt_lookup_max": high}, "n-gram", f"min {low} max {high}, {k} drafted")
                  for low, high, k in NGRAM_SWEEP]
    runs += ngram_runs
    runs.append(run(dflash(m.untrained), "DFlash, untrained", f"{block_size - 1} drafted"))
    if not skip_offline:
        for measured, export in ((runs[1], m.trained), (runs[-1], m.untrained)):
            measured.offline_tau = offline_tau(m.target_dir, export, prompts, m.max_new_tokens, m.stops, device,
                                               dtype)
    best_ngram = max(ngram_runs, key=lambda r: r.tokens_per_step)
    print(f"\n=== {m.name} ===")
    print_table(runs, best_ngram, len(prompts), m.max_new_tokens, device)
    trained_run, untrained_run = runs[1], runs[-1]
    assert trained_run.tau and best_ngram.tau and untrained_run.tau
    print_goals(m.goals, trained_run, best_ngram, untrained_run)
    print(f"  engine start-up: {sum(r.start_seconds for r in runs):.0f} s over {len(runs)} engines")
    return runs


def speaking_measured(bench: SpeakingBench, args: argparse.Namespace, work: Path) -> Measured:
    """A speaking target (built or cached), its held-out prompts, and its drafter made by the product."""
    from tests.evaluate import eval_fixtures as ef
    from tests.support.speaking_target import TARGETS, build_speaking_target, target_metrics

    spec = TARGETS[bench.key]
    target_dir = build_speaking_target(spec)
    t = target_metrics(target_dir)
    print(f"speaking target '{bench.key}' ({t['corpus']['source']}): held-out loss {t['heldout_loss']:.3f} "
          f"(perplexity {t['heldout_perplexity']:.1f}), {t['corpus']['train_pairs']} training pairs of "
          f"{t['corpus']['mean_answer_tokens']} answer tokens on average; its greedy answers: "
          f"{t['mean_answer_tokens']} tokens, distinct-token ratio {t['distinct_token_ratio']:.3f}, repeated "
          f"4-gram share {t['repeated_4gram_share']:.3f} (real text: {t['reference']['distinct_token_ratio']:.3f}, "
          f"{t['reference']['repeated_4gram_share']:.3f})", flush=True)
    heldout_q, train_q = speaking_prompts(spec.corpus, args.heldout, args.train_prompts)
    own = work / bench.key
    if args.fixture_drafter:
        trained, untrained = trained_drafter(target_dir, train_q, bench.max_new_tokens, args.train_steps, own)
    elif args.drafter is not None:  # an export made elsewhere (a recipe trial's): measured, not trained
        trained, untrained = args.drafter, untrained_twin(args.drafter, target_dir, own)
    else:
        trained = product_drafter(target_dir, train_q, own, bench.overrides)
        untrained = untrained_twin(trained, target_dir, own)
    return Measured(f"speaking target '{bench.key}'", target_dir, [[{"role": "user", "content": q}] for q in heldout_q],
                    trained, untrained, args.max_new_tokens or bench.max_new_tokens, list(ef.stop_ids(target_dir)),
                    bench.goals)


def build_parser() -> argparse.ArgumentParser:
    """The bench's options; `bench_drafter_trials.py` takes its defaults from here, so an option added here reaches
    the trials' call of `speaking_measured` too."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=None, help="target directory (default: speaking targets)")
    parser.add_argument("--speaking", choices=["both", *SPEAKING_BENCHES], default="both",
                        help="which speaking target(s) to measure without --target (default: both)")
    parser.add_argument("--drafter", type=Path, default=None,
                        help="exported drafter directory (required with --target; with one --speaking target, "
                        "measured instead of the product's own)")
    parser.add_argument("--prompts", type=Path, default=None, help="held-out prompts, JSONL (with --target)")
    parser.add_argument("--heldout", type=int, default=48, help="held-out prompts")
    parser.add_argument("--train-prompts", type=int, default=4200, help="prompts whose answers train the drafter")
    parser.add_argument("--train-steps", type=int, default=1200, help="--fixture-drafter: its training steps")
    parser.add_argument("--fixture-drafter", action="store_true",
                        help="train the drafter with the test fixture's loop instead of the product's stages")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="tokens per prompt (default: the speaking target's, 64 or 256; 64 with --target)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="engine and offline dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--skip-offline", action="store_true", help="engine figures only")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the exports here (default: temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("HF_HUB_OFFLINE", "1")):
        os.environ.setdefault(key, value)
    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)  # two shared cores: thread spinning costs more than the second thread gains
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    if args.target is not None:
        if args.prompts is None or args.drafter is None:
            sys.exit("--target needs --prompts (a JSONL file of held-out prompts) and --drafter (an exported drafter)")
        pairs = [Measured(str(args.target), args.target, prompts_from_file(args.prompts, args.heldout),
                          args.drafter, untrained_twin(args.drafter, args.target, work), args.max_new_tokens or 64,
                          _stop_ids(args.target), _RATIO_GOALS)]
    else:
        if args.drafter is not None and args.speaking == "both":
            sys.exit("--drafter without --target measures one speaking target's drafter: name it with --speaking")
        keys = list(SPEAKING_BENCHES) if args.speaking == "both" else [args.speaking]
        pairs = []
        for key in keys:  # every target and drafter first: the engines then run back to back
            began = time.monotonic()
            pairs.append(speaking_measured(SPEAKING_BENCHES[key], args, work))
            print(f"  setup of '{key}' (target, drafter data and training; cached after the first run): "
                  f"{time.monotonic() - began:.0f} s", flush=True)
    figures = {m.name: measure(m, args.device, dtype, args.skip_offline) for m in pairs}
    if args.json:
        args.json.write_text(json.dumps({name: [{k: v for k, v in vars(r).items() if k != "outputs"} for r in runs]
                                         for name, runs in figures.items()}, indent=1) + "\n")


def _stop_ids(target_dir: Path) -> list[int]:
    """End-of-turn ids of a real target: its generation config's eos ids."""
    config = json.loads((target_dir / "generation_config.json").read_text())
    eos = config.get("eos_token_id")
    return sorted(set(eos if isinstance(eos, list) else [eos]))


if __name__ == "__main__":
    main()
