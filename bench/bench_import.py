"""Import throughput, side by side in one run (`make bench-import`): one JSONL file of prompts, the way users
bring them.

Measures, each in its own process (CPU time of the process from os.wait4, wall time beside it):
  (a) one worker over the whole file;
  (b) the same file striped over 2 workers run at once (each reads the whole file, decodes only its stripe);
  (c) one worker drawing a 256-record sample (the pilot's import: every record read, 256 written);
  (d) one worker counting every prompt's tokens with the Qwen3 tokenizer and chat template (the pipeline's
      import of prompts, `--tokenizer`).
Records per second per core is CPU-bound work / CPU seconds; the plan's import rate
(`run_plan.IMPORT_RECORDS_PER_S_PER_POD`) assumes fewer, for object-store reads and longer conversations.

    .venv/bin/python bench/bench_import.py [--records 40000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = ("the of and to in is that for it with as was on be by this are or an which function return value list "
         "error file data time code how why what when explain write").split()


def write_source(path: Path, records: int, seed: int = 0) -> int:
    """`records` conversations of a system prompt and a ~150-word question; returns the file's bytes."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as out:
        for i in range(records):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 260)))
            out.write(json.dumps({"id": i, "messages": [{"role": "system", "content": "You are helpful."},
                                                        {"role": "user", "content": f"{i}: {question}?"}]}) + "\n")
    return path.stat().st_size


def _worker(source: str, output: str, index: int, count: int, options: dict) -> list[str]:
    script = (
        f"import sys, json; sys.path.insert(0, {str(REPO)!r})\n"
        "from dflash_shared.importing import ImportConfig, run_import\n"
        "from dflash_shared.manifests import Kind, Producer\n"
        "from dflash_shared.storage import ObjectStore\n"
        f"config = ImportConfig(source={source!r}, output={output!r}, run_id='bench', "
        f"**json.loads({json.dumps(options)!r}))\n"
        "run_import(ObjectStore(), config.spec(Kind.prompts), Producer(stage='import'), "
        f"index={index}, count={count})\n"
    )
    return [sys.executable, "-c", script]


def measure(name: str, source: Path, work: Path, records: int, workers: int = 1, **options: object) -> dict:
    """Run `workers` import processes at once over `source`; CPU seconds of each, wall time of all."""
    output = work / name
    began = time.perf_counter()
    procs = [subprocess.Popen(_worker(str(source), str(output), i, workers, options)) for i in range(workers)]
    cpu = []
    for proc in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{name}: worker exited {os.waitstatus_to_exitcode(status)}")
        cpu.append(usage.ru_utime + usage.ru_stime)
    wall = time.perf_counter() - began
    manifest = json.loads((output / "manifest.json").read_text())
    return {"name": name, "workers": workers, "wall_s": wall, "cpu_s": sum(cpu), "busiest_cpu_s": max(cpu),
            "kept": manifest["accounting"]["succeeded"], "read": manifest["accounting"]["input_records"],
            "records_per_cpu_s": records / sum(cpu), "records_per_wall_s": records / wall,
            "prompt_tokens": manifest["section"].get("prompt_tokens")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=40_000)
    args = parser.parse_args()
    from tests.support.qwen_assets import shared_tokenizer_dir

    tokenizer = str(shared_tokenizer_dir("qwen3"))
    with tempfile.TemporaryDirectory(prefix="bench-import-") as tmp:
        work = Path(tmp)
        source = work / "prompts.jsonl"
        size = write_source(source, args.records)
        print(f"source: {args.records:,} prompts in one JSONL file, {size / 2**20:.1f} MiB; load before "
              f"{os.getloadavg()[0]:.2f}")
        rows = [measure("one worker", source, work, args.records),
                measure("2 workers, striped", source, work, args.records, workers=2),
                measure("sample of 256", source, work, args.records, workers=1, sample_records=256),
                measure("counting tokens", source, work, args.records, tokenizer=tokenizer, max_prompt_tokens=4096)]
        print("| import | workers | wall s | CPU s (busiest worker) | records/CPU-s | records/wall-s | kept | "
              "prompt tokens |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['name']} | {r['workers']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} ({r['busiest_cpu_s']:.1f}) | "
                  f"{r['records_per_cpu_s']:,.0f} | {r['records_per_wall_s']:,.0f} | {r['kept']:,} | "
                  f"{r['prompt_tokens'] if r['prompt_tokens'] is not None else '-'} |")
        one, two = rows[0], rows[1]
        print(f"striped over 2 workers: wall {one['wall_s'] / two['wall_s']:.2f}x faster, busiest worker "
              f"{one['cpu_s'] / two['busiest_cpu_s']:.2f}x less CPU than one worker (load after "
              f"{os.getloadavg()[0]:.2f})")
        print(f"counting tokens costs {rows[3]['cpu_s'] / one['cpu_s']:.1f}x the CPU of importing alone")


if __name__ == "__main__":
    main()
