"""`dflash-generate import | preflight | run` as a pod runs them: a subprocess, settings from flags and env."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_shared.jsonl import iter_lines
from dflash_shared.manifest_io import load_manifest
from dflash_shared.manifests import Kind, PromptsSection
from dflash_shared.records import PromptRecord
from dflash_shared.storage import ObjectStore, join
from tests.generate.stage_support import ONE_ARCH, varied_prompts, write_prompts
from tests.support import exit_policy

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_GENERATE_")}
    return subprocess.run([sys.executable, "-m", "dflash_generate", *args], env={**base, **(env or {})},
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


def test_import_turns_conversations_into_prompts(s3_bucket: str, store: ObjectStore) -> None:
    conversations = [
        {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]},
        {"messages": [{"role": "user", "content": "What is 2+2?"}]},  # same prompt once the answer is dropped
        {"messages": "not a list"},
        {"messages": [{"role": "user", "content": "Weather?"}],
         "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]},
    ]
    source = join(s3_bucket, "raw")
    store.write_bytes(join(source, "chats.jsonl"), "".join(json.dumps(c) + "\n" for c in conversations).encode())
    out = join(s3_bucket, "prompts")
    done = cli("import", "--source", source, "--output", out, "--run-id", "r1", "--max-bad-fraction", "0.5")
    assert done.returncode == 0, done.stderr
    m = load_manifest(store, out, Kind.prompts).manifest
    assert isinstance(m.section, PromptsSection) and m.section.duplicates == 1 and m.run_id == "r1"
    acc = m.accounting
    assert (acc.input_records, acc.succeeded, acc.failed, acc.skipped) == (5, 3, 1, 1)
    lines = b"".join(store.read_bytes(s.uri) for s in m.shards)
    assert m.shards[0].uri.endswith(".jsonl.zst") and lines  # compressed shards
    records = [PromptRecord.model_validate_json(line) for s in m.shards for _, line in iter_lines(store, s.uri)]
    assert [r.messages[-1].role for r in records] == ["user", "user", "user"]
    assert records[2].tools is not None


def test_usage_and_config_errors_exit_64() -> None:
    assert cli().returncode == 64
    bad = cli("run", "--input", "x", "--output", "y", "--model", "a/b", "--max-new-tokenz", "3")
    assert bad.returncode == 64 and "unknown flag(s) --max-new-tokenz" in bad.stderr


@pytest.mark.slow
@ONE_ARCH
def test_preflight_checks_model_input_and_node(s3_bucket: str, store: ObjectStore, tiny_target_dir: Path,
                                               tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="preflight of the engine stack needs the generate environment")
    src = write_prompts(store, join(s3_bucket, "prompts"), varied_prompts(4))
    env = {"DFLASH_GENERATE_INPUT": src, "DFLASH_GENERATE_OUTPUT": join(s3_bucket, "completions"),
           "DFLASH_GENERATE_MODEL": str(tiny_target_dir), "DFLASH_GENERATE_MIN_SHM_GIB": "0.01"}
    ok = cli("preflight", env=env)
    assert ok.returncode == 0, ok.stderr
    for line in ("OK imports", "OK credentials", "OK storage_write", "OK input_manifest: prompts",
                 "OK model: local model", "OK gpus: none required (CPU stage)", "OK shm", "OK disk"):
        assert f"preflight generate {line}" in ok.stderr
    # A model directory without weights and a prompts prefix that does not exist: both named, exit 65.
    empty = tmp_path / "model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    failed = cli("preflight", env={**env, "DFLASH_GENERATE_MODEL": str(empty),
                                   "DFLASH_GENERATE_INPUT": join(s3_bucket, "nothing")})
    assert failed.returncode == 65, failed.stderr
    assert f"FAIL model: model {empty} lacks tokenizer.json, *.safetensors weights" in failed.stderr
    assert "FAIL input_manifest: manifest " + join(s3_bucket, "nothing", "manifest.json") in failed.stderr


@pytest.mark.parametrize("case", exit_policy.CASES)
def test_unusable_storage_exits_69_in_run_as_in_preflight(case: str, s3_bucket: str, store: ObjectStore) -> None:
    from tests.support.tiny_target import build_tiny_target

    write_prompts(store, join(s3_bucket, "prompts"), varied_prompts(2))
    bucket = exit_policy.bucket_for(case, s3_bucket)
    argv = [sys.executable, "-m", "dflash_generate", "run", "--input", f"{bucket}/prompts",
            "--output", f"{bucket}/completions", "--model", str(build_tiny_target("qwen3"))]
    exit_policy.assert_environment_exit(exit_policy.run_case(argv, case, REPO), case)
