"""Tokenize-stage throughput, side by side in one run (`make bench-tokenize`).

On generated multi-turn conversations with the Qwen3.6 vocabulary (>= 50 MB of JSONL by default), measures
tokens per second PER CORE for:
  (a) raw `tokenizers` encode_batch on the same rendered text: the limit of the tokenizer library
      (the encode loop alone, input already in memory);
  (b) the common way: `datasets` load + `map` over records, `apply_chat_template(tokenize=True)` per record,
      the prompt tokenised again separately to find the mask boundary, `save_to_disk`;
  (c) this stage in render mode, input files to written shards;
  (d) this stage in token-exact mode, input files to written shards;
then (c) with 2 worker processes on 2 cores against 1, and (c) and (d) on twice the input: the peak RSS,
and the marginal rate (what the second half of the input cost, start-up cancelled out).

The machine this runs on may be shared, so wall-clock rates are noisy. The primary figure is therefore the
CPU time (user + system) of the measured process and every process it started, taken from os.wait4 when it
exits; (b), (c) and (d) count the whole process (start-up, imports, tokenizer load, reading, writing), (a)
only its encode loop. Wall time is printed beside it, with the load average before and after each step.
Every measurement is its own process, pinned with taskset (one core, or two for the scaling run), with
tokenizer threads off.

The 2-process figure: with the pool's processes sharing 2 cores, the run cannot finish faster than
max(total CPU / 2, the busiest single process's CPU), so `1-process CPU / that bound` is the speed-up the
code allows whatever else the machine runs; the wall-clock ratio is printed next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an which have not can one all were "
    "their has more when there been some would about into than them these its only other new could time also two "
    "first may after any most where through over such between system model value function data result number each "
    "because however therefore consider suppose compute derive prove assume integer matrix vector gradient token "
    "sequence probability distribution expectation variance algorithm complexity memory cache latency throughput"
).split()
CODE = [
    "def solve(n: int) -> int:\n    total = 0\n    for i in range(n):\n        total += i * i\n    return total\n",
    "for (let i = 0; i < items.length; i++) {\n  if (items[i].ok) count++;\n}\n",
    "SELECT user_id, COUNT(*) AS n FROM events WHERE ts > NOW() - INTERVAL '1 day' GROUP BY user_id;\n",
]
CJK = "機械学習のモデルは大量のデータから規則を学びます。数学的な証明を一歩ずつ確認しましょう。"
# Bump when the generated inputs change, so a reused --work-dir is regenerated.
INPUT_VERSION = 1


def sentence(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n)]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", ".", "?", ":"])


def paragraph(rng: random.Random) -> str:
    parts = [sentence(rng, rng.randint(6, 24)) for _ in range(rng.randint(2, 6))]
    roll = rng.random()
    if roll < 0.2:
        parts.append("```python\n" + rng.choice(CODE) + "```")
    elif roll < 0.3:
        parts.append(f"$$\\sum_{{k=1}}^{{{rng.randint(2, 99)}}} k^2 = {rng.randint(100, 99999)}$$")
    elif roll < 0.35:
        parts.append(CJK)
    return " ".join(parts)


def conversation(rng: random.Random, i: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You are a helpful assistant. " + sentence(rng, 8)}]
    for _ in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": paragraph(rng)})
        reasoning = "\n\n".join(paragraph(rng) for _ in range(rng.randint(2, 5)))
        answer = "\n\n".join(paragraph(rng) for _ in range(rng.randint(1, 4)))
        messages.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
    return {"id": f"bench-{i:07d}", "messages": messages, "enable_thinking": True, "finish_reason": "stop"}


def make_inputs(work: Path, megabytes: float, tok_dir: Path, vocab: str, files: int = 8) -> dict[str, Any]:
    """Completions prefixes for render mode (text only) and token-exact mode (engine-style ids).

    Kept in `work` with a stamp, so a rerun with the same --work-dir and size reuses them.
    """
    stamp = work / "inputs.json"
    wanted = {"version": INPUT_VERSION, "megabytes": megabytes, "vocab": vocab, "files": files}
    if stamp.is_file():
        done = json.loads(stamp.read_text())
        if done.get("wanted") == wanted:
            return done
    from dflash_shared.jsonl import encode_line
    from dflash_shared.records import CompletionRecord, Message
    from dflash_shared.storage import ObjectStore
    from dflash_tokenize.chat import ChatFormat
    from tests.tokenize.stage_fixtures import engine_like, target_for, write_completions

    shutil.rmtree(work, ignore_errors=True)
    chat = ChatFormat.from_dir(tok_dir)
    rng = random.Random(0)
    records, size, i = [], 0, 0
    while size < megabytes * 1e6:
        record = CompletionRecord.model_validate(conversation(rng, i))
        size += len(encode_line(record.model_dump(mode="json", exclude_none=True)))
        records.append(record)
        i += 1
    store = ObjectStore()
    render_prefix = write_completions(store, str(work / "render-in"), records, shards=files)
    exact = [engine_like(chat, [Message.model_validate(m) for m in r.model_dump()["messages"]]) for r in records]
    exact_prefix = write_completions(store, str(work / "exact-in"), exact, shards=files, target=target_for(chat))
    done = {"wanted": wanted, "render": render_prefix, "exact": exact_prefix, "records": len(records), "bytes": size}
    stamp.write_text(json.dumps(done))
    return done


def source_lines(prefix: str) -> list[bytes]:
    """The completions of a prefix as plain JSONL lines, in shard order."""
    from dflash_shared.jsonl import iter_lines
    from dflash_shared.manifest_io import load_manifest
    from dflash_shared.manifests import Kind
    from dflash_shared.storage import ObjectStore

    store = ObjectStore()
    return [line for shard in load_manifest(store, prefix, Kind.completions).manifest.shards
            for _, line in iter_lines(store, shard.uri)]


def rendered_texts(lines: list[bytes], tok_dir: Path) -> list[str]:
    from dflash_shared.records import CompletionRecord
    from dflash_tokenize.chat import ChatFormat

    chat = ChatFormat.from_dir(tok_dir)
    return [chat.render_dicts([m.template_dict() for m in CompletionRecord.model_validate_json(line).messages],
                              enable_thinking=True) for line in lines]


@dataclass
class Child:
    """What one measured process cost: wall and CPU seconds (itself plus its waited-for children)."""

    wall_s: float
    cpu_s: float
    stdout: str
    load_before: float
    load_after: float


def run_child(cmd: list[str], cores: str) -> Child:
    """Run a command pinned to `cores` and take its resource usage from the kernel when it exits."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(["taskset", "-c", cores, *cmd], env=env, cwd=REPO, stdout=out, stderr=err)
        # wait4 rather than Popen.wait: it returns the rusage of this child and its reaped descendants.
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"benchmark step failed ({' '.join(cmd[:4])}...):\n{stderr[-3000:]}")
    return Child(wall, usage.ru_utime + usage.ru_stime, stdout, load_before,
                 os.getloadavg()[0])


# Prints: total tokens, the CPU seconds of the main process and of its (pool) children, then the main
# process's peak RSS in kB. That peak is VmHWM, the high-water mark of this program's own memory: the
# kernel's ru_maxrss would also count the image of the benchmark process that forked it, which can be
# larger than the stage itself.
STAGE_CODE = """
import json, resource, sys
from dflash_tokenize.config import TokenizeConfig
from dflash_tokenize.stage import run
src, out, tok, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
run(TokenizeConfig(input=src, output=out, tokenizer=tok, workers=workers, run_id="bench"))
print(json.load(open(out + "/manifest.json"))["section"]["total_tokens"])
for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
    usage = resource.getrusage(who)
    print(usage.ru_utime + usage.ru_stime)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""


@dataclass
class StageRun:
    child: Child
    tokens: int
    main_cpu_s: float
    pool_cpu_s: float
    peak_rss_mib: float  # the main process's own high-water mark (its pool, if any, not included)


def stage_run(prefix: str, out: Path, tok_dir: Path, cores: str, workers: int) -> StageRun:
    shutil.rmtree(out, ignore_errors=True)
    child = run_child([sys.executable, "-c", STAGE_CODE, prefix, str(out), str(tok_dir), str(workers)], cores)
    tokens, main_cpu, pool_cpu, peak_kb = child.stdout.split()
    shutil.rmtree(out, ignore_errors=True)
    return StageRun(child, int(tokens), float(main_cpu), float(pool_cpu), int(peak_kb) / 1024)


# Prints: encode-loop CPU seconds, encode-loop wall seconds, tokens.
RAW_CODE = """
import sys, time, pickle
from tokenizers import Tokenizer
texts = pickle.load(open(sys.argv[1], "rb"))
tok = Tokenizer.from_file(sys.argv[2])
cpu, wall = time.process_time(), time.perf_counter()
n = 0
for i in range(0, len(texts), 256):
    n += sum(len(e.ids) for e in tok.encode_batch(texts[i:i + 256], add_special_tokens=False))
print(time.process_time() - cpu, time.perf_counter() - wall, n)
"""

COMMON_CODE = """
import sys
import datasets
from transformers import PreTrainedTokenizerFast
datasets.disable_progress_bars()
tok = PreTrainedTokenizerFast.from_pretrained(sys.argv[2])
ds = datasets.load_dataset("json", data_files=sys.argv[3:], split="train", cache_dir=sys.argv[1] + "/cache")
def encode(example):
    msgs = [{k: v for k, v in m.items() if v is not None} for m in example["messages"]]
    ids = tok.apply_chat_template(msgs, tokenize=True, enable_thinking=True, return_dict=False)
    prompt = tok.apply_chat_template(msgs[:-1], tokenize=True, add_generation_prompt=True, enable_thinking=True,
                                     return_dict=False)
    return {"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt))}
ds = ds.map(encode, remove_columns=ds.column_names)
ds.save_to_disk(sys.argv[1] + "/out")
print(sum(len(x) for x in ds["input_ids"]))
"""


@dataclass
class Row:
    name: str
    tokens: int
    cpu_s: float
    wall_s: float
    load: tuple[float, float]
    cores: int = 1

    @property
    def cpu_rate(self) -> float:
        return self.tokens / self.cpu_s

    @property
    def wall_rate(self) -> float:
        return self.tokens / self.wall_s / self.cores


def best(rows: list[Row]) -> Row:
    """The repetition with the least CPU time (the one least disturbed by other work)."""
    return min(rows, key=lambda r: r.cpu_s)


def measure_raw(work: Path, tok_dir: Path, texts_file: Path) -> Row:
    child = run_child([sys.executable, "-c", RAW_CODE, str(texts_file), str(tok_dir / "tokenizer.json")], "0")
    cpu, wall, tokens = child.stdout.split()
    return Row("(a) tokenizers encode_batch, rendered text", int(tokens), float(cpu), float(wall),
               (child.load_before, child.load_after))


def measure_common(work: Path, tok_dir: Path, jsonl: Path) -> Row:
    shutil.rmtree(work / "common", ignore_errors=True)
    child = run_child([sys.executable, "-c", COMMON_CODE, str(work / "common"), str(tok_dir), str(jsonl)], "0")
    shutil.rmtree(work / "common", ignore_errors=True)
    return Row("(b) datasets.map + apply_chat_template x2, to disk", int(child.stdout.split()[-1]),
               child.cpu_s, child.wall_s, (child.load_before, child.load_after))


def stage_row(name: str, run: StageRun, cores: int = 1) -> Row:
    return Row(name, run.tokens, run.child.cpu_s, run.child.wall_s, (run.child.load_before, run.child.load_after),
               cores)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=50.0, help="Size of the generated JSONL input.")
    parser.add_argument("--vocab", default="qwen3_6", choices=["qwen3", "qwen3_6"])
    parser.add_argument("--work-dir", default=None, help="Where inputs and outputs go (default: a temp dir); "
                        "generated inputs found there are reused.")
    parser.add_argument("--repeat", type=int, default=1, help="Rounds of all measurements, interleaved; each "
                        "keeps its run with the least CPU time.")
    parser.add_argument("--only", default="a,b,c,d,2,rss", help="Comma-separated subset of a,b,c,d,2,rss "
                        "(rss: twice the input, for the RSS and the marginal rates).")
    args = parser.parse_args()
    only = set(args.only.split(","))
    from tests.support.qwen_assets import shared_tokenizer_dir

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-tokenize-"))
    work.mkdir(parents=True, exist_ok=True)
    tok_dir = shared_tokenizer_dir(args.vocab)
    print(f"inputs: {args.megabytes:.0f} MB of multi-turn conversations ({args.vocab} vocabulary) in {work}")
    one = make_inputs(work / "x1", args.megabytes, tok_dir, args.vocab)
    print(f"  {one['records']:,} records, {one['bytes'] / 1e6:.1f} MB of JSONL; load average "
          f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores", flush=True)

    # Each round runs every selected step once, in this order; --repeat rounds interleave the steps, so a
    # change in the machine's load mid-run touches all of them, and each keeps its least-CPU repetition.
    steps: dict[str, Callable[[], Row | StageRun]] = {}
    if only & {"a", "b"}:
        lines = source_lines(one["render"])
        texts_file, jsonl = work / "texts.pkl", work / "all.jsonl"
        with open(texts_file, "wb") as handle:
            pickle.dump(rendered_texts(lines, tok_dir), handle)
        jsonl.write_bytes(b"".join(line + b"\n" for line in lines))
        if "a" in only:
            steps["a"] = lambda: measure_raw(work, tok_dir, texts_file)
        if "b" in only:
            steps["b"] = lambda: measure_common(work, tok_dir, jsonl)
    if only & {"c", "2", "rss"}:
        steps["c"] = lambda: stage_run(one["render"], work / "out", tok_dir, "0", 1)
    if "d" in only:
        steps["d"] = lambda: stage_run(one["exact"], work / "out", tok_dir, "0", 1)
    if "2" in only:
        steps["2"] = lambda: stage_run(one["render"], work / "out", tok_dir, "0,1", 2)
    if "rss" in only:
        two = make_inputs(work / "x2", 2 * args.megabytes, tok_dir, args.vocab)
        steps["c2"] = lambda: stage_run(two["render"], work / "out", tok_dir, "0", 1)
        if "d" in only:
            steps["d2"] = lambda: stage_run(two["exact"], work / "out", tok_dir, "0", 1)
    done: dict[str, list[Row | StageRun]] = {key: [] for key in steps}
    for round_index in range(args.repeat):
        for key, step in steps.items():
            done[key].append(step())
        print(f"  round {round_index + 1}/{args.repeat} done; load average {os.getloadavg()[0]:.1f}", flush=True)
    rows: dict[str, Row] = {key: best([r for r in done[key] if isinstance(r, Row)]) for key in ("a", "b")
                            if key in done}
    runs: dict[str, StageRun] = {key: min((r for r in results if isinstance(r, StageRun)),
                                          key=lambda r: r.child.cpu_s)
                                 for key, results in done.items() if key not in ("a", "b")}
    names = {"c": "(c) this stage, render mode, files to shards",
             "d": "(d) this stage, token-exact mode, files to shards",
             "2": "(c) 2 worker processes on 2 cores",
             "c2": "(c) on twice the input", "d2": "(d) on twice the input"}
    for key, name in names.items():
        if key in runs:
            rows[key] = stage_row(name, runs[key], cores=2 if key == "2" else 1)
    print()
    print(f"{'measurement (1 core unless said)':52s} {'tokens':>11s} {'CPU s':>7s} {'wall s':>7s} "
          f"{'Mtok/s/core CPU':>15s} {'wall':>6s}  load before/after")
    for row in rows.values():
        print(f"{row.name:52s} {row.tokens:11,d} {row.cpu_s:7.2f} {row.wall_s:7.2f} {row.cpu_rate / 1e6:15.3f} "
              f"{row.wall_rate / 1e6:6.3f}  {row.load[0]:.1f}/{row.load[1]:.1f}")
    print()
    checks: list[tuple[str, float, str, bool]] = []
    rate = {k: r.cpu_rate for k, r in rows.items() if k in ("a", "b", "c", "d")}
    if "a" in rate and "c" in rate:
        checks.append(("(c) / (a), CPU", rate["c"] / rate["a"], ">= 0.8", rate["c"] / rate["a"] >= 0.8))
    if "b" in rate and "c" in rate:
        checks.append(("(c) / (b), CPU", rate["c"] / rate["b"], ">= 2.0", rate["c"] / rate["b"] >= 2.0))
    if "d" in rate:
        checks.append(("(d) Mtok/s per core, CPU", rate["d"] / 1e6, ">= 5.0", rate["d"] >= 5e6))
    summary: dict[str, Any] = {"cpu_rates_tok_per_s": {k: r.cpu_rate for k, r in rows.items()},
                               "wall_rates_tok_per_s_per_core": {k: r.wall_rate for k, r in rows.items()}}
    if "2" in runs:
        one_run, pair = runs["c"], runs["2"]
        # The pool's workers share the two cores with the main process (reading, writing): the run
        # cannot be shorter than half the total CPU, nor than the main process's own CPU.
        bound = max(pair.child.cpu_s / 2, pair.main_cpu_s, pair.pool_cpu_s / 2)
        speedup = one_run.child.cpu_s / bound
        checks.append(("2 processes / 1, CPU bound", speedup, ">= 1.7", speedup >= 1.7))
        wall_ratio = one_run.child.wall_s / pair.child.wall_s
        print(f"2-process run: total CPU {pair.child.cpu_s:.2f} s (main {pair.main_cpu_s:.2f}, pool "
              f"{pair.pool_cpu_s:.2f}), wall {pair.child.wall_s:.2f} s; 1-process run: CPU "
              f"{one_run.child.cpu_s:.2f} s, wall {one_run.child.wall_s:.2f} s; wall ratio {wall_ratio:.2f} "
              f"(load {pair.child.load_before:.1f} before, {pair.child.load_after:.1f} after)")
        summary["two_process"] = {"cpu_bound_speedup": speedup, "wall_ratio": wall_ratio}
    if "rss" in only:
        rss_one, rss_two = runs["c"].peak_rss_mib, runs["c2"].peak_rss_mib
        ratio = rss_two / rss_one
        checks.append(("peak RSS 2x input / 1x", ratio, "< 1.2", ratio < 1.2))
        print(f"peak RSS: {rss_one:.0f} MiB for {one['bytes'] / 1e6:.0f} MB, {rss_two:.0f} MiB for "
              f"{two['bytes'] / 1e6:.0f} MB")
        summary["rss_mib"] = [rss_one, rss_two]
        # What the second half of the input cost: start-up (interpreter, imports, tokenizer load) cancels.
        marginal = {k: (runs[k + "2"].tokens - runs[k].tokens) / (runs[k + "2"].child.cpu_s - runs[k].child.cpu_s)
                    for k in ("c", "d") if k + "2" in runs}
        for k, value in marginal.items():
            print(f"({k}) marginal rate, 2x input minus 1x: {value / 1e6:.3f} Mtok/s per core (CPU); start-up "
                  f"{runs[k].child.cpu_s - runs[k].tokens / value:.2f} CPU s")
        if "a" in rate and "c" in marginal:
            checks.append(("(c) marginal / (a), CPU", marginal["c"] / rate["a"], ">= 0.8",
                           marginal["c"] / rate["a"] >= 0.8))
        if "d" in marginal:
            checks.append(("(d) marginal Mtok/s, CPU", marginal["d"] / 1e6, ">= 5.0", marginal["d"] >= 5e6))
        summary["marginal_cpu_rates_tok_per_s"] = marginal
    for name, value, target, ok in checks:
        print(f"{name:28s} {value:8.2f}   target {target:8s} {'met' if ok else 'NOT MET'}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
