"""Tokenize-stage throughput, side by side in one run (`make bench-tokenize`).

On generated multi-turn conversations with the Qwen3.6 vocabulary (>= 50 MB of JSONL by default), measures
tokens per second PER CORE (each measurement pinned to one core with TOKENIZERS_PARALLELISM=false) for:
  (a) raw `tokenizers` encode_batch on the same rendered text: the limit of the tokenizer library;
  (b) the common way: `datasets` load + `map` over records, `apply_chat_template(tokenize=True)` per record,
      the prompt tokenised again separately to find the mask boundary, `save_to_disk`;
  (c) this stage in render mode, input files to written shards;
  (d) this stage in token-exact mode, input files to written shards;
then (c) with 2 worker processes on 2 cores against 1, and the peak RSS of (c) on twice the input.
Each stage measurement is a separate process, so its peak RSS and start-up are its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def conversation(rng: random.Random, i: int) -> dict:
    messages = [{"role": "system", "content": "You are a helpful assistant. " + sentence(rng, 8)}]
    for turn in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": paragraph(rng)})
        reasoning = "\n\n".join(paragraph(rng) for _ in range(rng.randint(2, 5)))
        answer = "\n\n".join(paragraph(rng) for _ in range(rng.randint(1, 4)))
        messages.append({"role": "assistant", "content": answer, "reasoning_content": reasoning})
    return {"id": f"bench-{i:07d}", "messages": messages, "enable_thinking": True, "finish_reason": "stop"}


def make_inputs(work: Path, megabytes: float, tok_dir: Path, files: int = 8) -> dict[str, Path]:
    """Completions prefixes for render mode (text only) and token-exact mode (engine-style ids)."""
    from dflash_shared.jsonl import encode_line
    from dflash_tokenize.chat import ChatFormat
    from tests.tokenize.stage_fixtures import engine_like, target_for, write_completions

    from dflash_shared.records import CompletionRecord, Message
    from dflash_shared.storage import ObjectStore

    chat = ChatFormat.from_dir(tok_dir)
    rng = random.Random(0)
    records, size, i = [], 0, 0
    while size < megabytes * 1e6:
        obj = conversation(rng, i)
        record = CompletionRecord.model_validate(obj)
        size += len(encode_line(record.model_dump(mode="json", exclude_none=True)))
        records.append(record)
        i += 1
    store = ObjectStore()
    render_prefix = write_completions(store, str(work / "render-in"), records, shards=files)
    exact = [engine_like(chat, [Message.model_validate(m) for m in r.model_dump()["messages"]]) for r in records]
    exact_prefix = write_completions(store, str(work / "exact-in"), exact, shards=files, target=target_for(chat))
    return {"render": Path(render_prefix), "exact": Path(exact_prefix), "records": len(records), "bytes": size}


def rendered_texts(prefix: Path, tok_dir: Path) -> list[str]:
    from dflash_shared.jsonl import iter_lines
    from dflash_shared.manifest_io import load_manifest
    from dflash_shared.manifests import Kind
    from dflash_shared.records import CompletionRecord
    from dflash_shared.storage import ObjectStore
    from dflash_tokenize.chat import ChatFormat

    store, chat = ObjectStore(), ChatFormat.from_dir(tok_dir)
    texts = []
    for shard in load_manifest(store, str(prefix), Kind.completions).manifest.shards:
        for _, line in iter_lines(store, shard.uri):
            record = CompletionRecord.model_validate_json(line)
            texts.append(chat.render_dicts([m.template_dict() for m in record.messages], enable_thinking=True))
    return texts


def timed_child(cmd: list[str], cores: str, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Run a command pinned to `cores`; return (wall seconds, stdout)."""
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    start = time.perf_counter()
    proc = subprocess.Popen(["taskset", "-c", cores, *cmd], env=full_env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"benchmark step failed ({' '.join(cmd[:4])}...):\n{err[-3000:]}")
    return elapsed, out


def stage_run(prefix: Path, out: Path, tok_dir: Path, cores: str, workers: int) -> tuple[float, float, int]:
    shutil.rmtree(out, ignore_errors=True)
    code = (
        "import json,resource,sys;from dflash_tokenize.config import TokenizeConfig;"
        "from dflash_tokenize.stage import run;"
        f"run(TokenizeConfig(input={str(prefix)!r},output={str(out)!r},tokenizer={str(tok_dir)!r},"
        f"workers={workers},run_id='bench'));"
        "m=json.load(open(" + repr(str(out / 'manifest.json')) + "));"
        "print(m['section']['total_tokens']);"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    elapsed, stdout = timed_child([sys.executable, "-c", code], cores)
    tokens, rss_kib = (int(x) for x in stdout.split())
    return elapsed, rss_kib / 1024, tokens


RAW_CODE = """
import sys, time, pickle
from tokenizers import Tokenizer
texts = pickle.load(open(sys.argv[1], "rb"))
tok = Tokenizer.from_file(sys.argv[2])
start = time.perf_counter()
n = 0
for i in range(0, len(texts), 256):
    n += sum(len(e.ids) for e in tok.encode_batch(texts[i:i + 256], add_special_tokens=False))
print(time.perf_counter() - start, n)
"""

COMMON_CODE = """
import sys, time, json
start = time.perf_counter()
import datasets
from transformers import PreTrainedTokenizerFast
datasets.disable_progress_bars()
tok = PreTrainedTokenizerFast.from_pretrained(sys.argv[2])
files = sys.argv[3:]
ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=sys.argv[1] + "/cache")
def encode(example):
    msgs = [{k: v for k, v in m.items() if v is not None} for m in example["messages"]]
    ids = tok.apply_chat_template(msgs, tokenize=True, enable_thinking=True, return_dict=False)
    prompt = tok.apply_chat_template(msgs[:-1], tokenize=True, add_generation_prompt=True, enable_thinking=True,
                                     return_dict=False)
    return {"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt))}
ds = ds.map(encode, remove_columns=ds.column_names)
ds.save_to_disk(sys.argv[1] + "/out")
print(time.perf_counter() - start, sum(len(x) for x in ds["input_ids"]))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=50.0, help="Size of the generated JSONL input.")
    parser.add_argument("--vocab", default="qwen3_6", choices=["qwen3", "qwen3_6"])
    parser.add_argument("--work-dir", default=None, help="Where inputs and outputs go (default: a temp dir).")
    args = parser.parse_args()
    from tests.support.qwen_assets import shared_tokenizer_dir

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-tokenize-"))
    tok_dir = shared_tokenizer_dir(args.vocab)
    print(f"generating {args.megabytes:.0f} MB of multi-turn conversations ({args.vocab} vocabulary) in {work}")
    one = make_inputs(work / "x1", args.megabytes, tok_dir)
    print(f"  {one['records']:,} records, {one['bytes'] / 1e6:.1f} MB of JSONL")

    import pickle

    texts = rendered_texts(one["render"], tok_dir)
    pickle.dump(texts, open(work / "texts.pkl", "wb"))
    _, raw = timed_child([sys.executable, "-c", RAW_CODE, str(work / "texts.pkl"), str(tok_dir / "tokenizer.json")],
                            "0")
    raw_s, raw_tokens = float(raw.split()[0]), int(raw.split()[1])

    jsonl_dir = work / "jsonl"
    jsonl_dir.mkdir(exist_ok=True)
    with open(jsonl_dir / "all.jsonl", "w") as handle:
        for text_record in iter_source_records(one["render"]):
            handle.write(text_record)
    _, common = timed_child([sys.executable, "-c", COMMON_CODE, str(work / "common"), str(tok_dir),
                                str(jsonl_dir / "all.jsonl")], "0")
    common_s, common_tokens = float(common.split()[0]), int(common.split()[1])

    render_s, render_rss, render_tokens = stage_run(one["render"], work / "out-render", tok_dir, "0", 1)
    exact_s, _, exact_tokens = stage_run(one["exact"], work / "out-exact", tok_dir, "0", 1)
    two_s, _, _ = stage_run(one["render"], work / "out-render-2", tok_dir, "0,1", 2)

    two = make_inputs(work / "x2", 2 * args.megabytes, tok_dir)
    _, double_rss, _ = stage_run(two["render"], work / "out-render-x2", tok_dir, "0", 1)

    rate = {
        "a": raw_tokens / raw_s,
        "b": common_tokens / common_s,
        "c": render_tokens / render_s,
        "d": exact_tokens / exact_s,
    }
    print()
    print(f"{'measurement (1 core unless said)':58s} {'tokens':>12s} {'seconds':>8s} {'Mtok/s/core':>12s}")
    rows = [
        ("(a) tokenizers encode_batch, rendered text", raw_tokens, raw_s, rate["a"]),
        ("(b) datasets.map + apply_chat_template x2, to disk", common_tokens, common_s, rate["b"]),
        ("(c) this stage, render mode, files to shards", render_tokens, render_s, rate["c"]),
        ("(d) this stage, token-exact mode, files to shards", exact_tokens, exact_s, rate["d"]),
        ("(c) with 2 processes on 2 cores (per core)", render_tokens, two_s, render_tokens / two_s / 2),
    ]
    for name, tokens, seconds, per_core in rows:
        print(f"{name:58s} {tokens:12,d} {seconds:8.2f} {per_core / 1e6:12.3f}")
    print()
    checks = [
        ("(c) / (a)", rate["c"] / rate["a"], ">= 0.8", rate["c"] / rate["a"] >= 0.8),
        ("(c) / (b)", rate["c"] / rate["b"], ">= 2.0", rate["c"] / rate["b"] >= 2.0),
        ("(d) Mtok/s per core", rate["d"] / 1e6, ">= 5.0", rate["d"] >= 5e6),
        ("2 processes / 1", render_s / two_s, ">= 1.7", render_s / two_s >= 1.7),
        ("peak RSS 2x input / 1x", double_rss / render_rss, "< 1.2", double_rss / render_rss < 1.2),
    ]
    for name, value, target, ok in checks:
        print(f"{name:28s} {value:8.2f}   target {target:8s} {'met' if ok else 'NOT MET'}")
    print(f"peak RSS: {render_rss:.0f} MiB for {one['bytes'] / 1e6:.0f} MB, {double_rss:.0f} MiB for "
          f"{two['bytes'] / 1e6:.0f} MB")
    print(json.dumps({"rates_tok_per_s": rate, "rss_mib": [render_rss, double_rss], "two_process_s": two_s}))


def iter_source_records(prefix: Path):  # type: ignore[no-untyped-def]
    """The completions as plain JSONL lines (the input of the common way)."""
    from dflash_shared.jsonl import iter_lines
    from dflash_shared.manifest_io import load_manifest
    from dflash_shared.manifests import Kind
    from dflash_shared.storage import ObjectStore

    store = ObjectStore()
    for shard in load_manifest(store, str(prefix), Kind.completions).manifest.shards:
        for _, line in iter_lines(store, shard.uri):
            yield line.decode() + "\n"


if __name__ == "__main__":
    main()
