"""The generate stage end to end on a real vLLM engine (CPU build) and each tiny random target.

Thinking on (local storage) and off (moto S3), the records checked against the chat template and the
tokenizer, bad input counted by reason, the fail-fast detector, resumption from committed chunks, and
the tokenize stage accepting the output in token_exact mode. The session's engine serves every run.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pyarrow as pa
import pytest

pytest.importorskip("vllm", reason="stage tests need the generate environment (.venv-generate)")


from dflash_generate.sampling import default_sampling  # noqa: E402
from dflash_generate.stage import run  # noqa: E402
from dflash_shared import identity  # noqa: E402
from dflash_shared.cli import preemption_handler  # noqa: E402
from dflash_shared.errors import BadInputError, Preempted  # noqa: E402
from dflash_shared.manifest_io import load_manifest  # noqa: E402
from dflash_shared.manifests import CompletionsSection, Kind  # noqa: E402
from dflash_shared.records import CompletionRecord, PromptRecord  # noqa: E402
from dflash_shared.runner import ShardingError  # noqa: E402
from dflash_shared.storage import ObjectStore, join  # noqa: E402
from tests.generate.stage_support import (  # noqa: E402
    MAX_MODEL_LEN,
    ONE_ARCH,
    completions,
    in_shard_order,
    prompt_record,
    stage_config,
    user,
    varied_prompts,
    write_prompts,
)
from tests.support.qwen_assets import qwen_special_ids  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPTS = varied_prompts(10)
# Which tiny target is a Qwen3.5/3.6 (its family's sampling preset) and whose vocabulary it has.
FAMILY = {"qwen3": "qwen3", "qwen3_6": "qwen3_5"}


@pytest.fixture(scope="module")
def ids(target_arch: str) -> dict[str, int]:
    return qwen_special_ids(target_arch)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def bucket(moto_endpoint: str) -> Iterator[str]:
    name = f"gen-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    yield f"s3://{name}"


@pytest.fixture(scope="module")
def runs(engine: Any, tiny_target_dir: Path, bucket: str, tmp_path_factory: pytest.TempPathFactory,
         moto_endpoint: str) -> dict[bool, str]:
    """One completed run per thinking mode: on (local directory), off (S3); the output prefixes."""
    store = ObjectStore()
    local = tmp_path_factory.mktemp("generate")
    out = {}
    # One S3 prefix per target: the bucket outlives this fixture, which runs once per target architecture.
    for thinking, root in ((True, str(local)), (False, join(bucket, "run", tiny_target_dir.name))):
        src = write_prompts(store, join(root, "prompts"), PROMPTS, shards=2)
        config = stage_config(src, join(root, "completions"), tiny_target_dir, enable_thinking=thinking)
        assert run(config, store, engine=engine) == join(root, "completions", "manifest.json")
        out[thinking] = join(root, "completions")
    return out


def raw_text(hf_tok: Any, record: CompletionRecord) -> str:
    """The completion decoded independently of the stage: every id but the end-of-turn it stopped on."""
    ids = list(record.completion_token_ids or ())
    if record.finish_reason == "stop":
        assert hf_tok.convert_ids_to_tokens(ids[-1]) in ("<|im_end|>", "<|endoftext|>")
        ids = ids[:-1]
    return str(hf_tok.decode(ids, skip_special_tokens=False))


def template_ids(hf_tok: Any, prompt: PromptRecord, thinking: bool) -> list[int]:
    return list(hf_tok.apply_chat_template(
        [m.template_dict() for m in prompt.messages], tools=list(prompt.tools) if prompt.tools else None,
        add_generation_prompt=True, enable_thinking=thinking, tokenize=True, return_dict=False,
    ))


@pytest.mark.parametrize("thinking", [True, False])
def test_manifest_records_target_sampling_and_throughput(runs: dict[bool, str], tiny_target_dir: Path,
                                                         target_arch: str, ids: dict[str, int],
                                                         thinking: bool) -> None:
    store = ObjectStore()
    loaded = load_manifest(store, runs[thinking], Kind.completions)  # shards re-hashed
    m, section = loaded.manifest, loaded.manifest.section
    assert isinstance(section, CompletionsSection) and section.target is not None
    assert section.target.tokenizer_sha256 == identity.tokenizer_sha256(tiny_target_dir)
    assert section.target.chat_template_sha256 == identity.chat_template_sha256(tiny_target_dir)
    assert section.target.enable_thinking is thinking and section.has_token_ids
    special = section.target.special_tokens
    assert (special.end_of_turn, special.think_start, special.think_end) == (
        ids["im_end"], ids["think_start"], ids["think_end"])
    # The tiny targets' generation_config.json sets no sampling values: every one is the family's preset.
    family = FAMILY[target_arch]
    recommended = default_sampling(thinking, family)  # type: ignore[arg-type]
    assert section.sampling == recommended.with_overrides(max_tokens=16, seed=7).as_record_dict()
    assert section.target_family == family
    mode = "thinking" if thinking else "non_thinking"
    assert set(section.sampling_sources.values()) == {f"preset:{family}/{mode}"}
    assert "presence_penalty" in section.sampling_sources and "repetition_penalty" in section.sampling
    assert (section.max_new_tokens, section.max_model_len) == (16, MAX_MODEL_LEN)
    records = completions(store, runs[thinking])
    assert section.output_tokens == sum(len(r.completion_token_ids or ()) for r in records) > 0
    # Completions stopped at the budget are kept and counted; the whole context lies inside the default window.
    assert (section.training_window, section.capped_to_window) == (4096, True)
    assert section.truncated_by_budget == sum(r.finish_reason == "length" for r in records)
    assert (section.output_tokens_in_window, section.window_fraction) == (section.output_tokens, 1.0)
    assert section.throughput["output_tokens_per_s_per_cpu_engine"] > 0 and section.throughput["engine_seconds"] > 0
    assert m.accounting.input_records == m.accounting.succeeded == len(PROMPTS)
    assert m.inputs[0].uri == join(runs[thinking].rsplit("/", 1)[0], "prompts", "manifest.json")
    # Chunk files of 3 prompts, in input order; a receipt commits each.
    names = [s.uri.rsplit("/", 1)[-1] for s in m.shards]
    assert names == sorted(names) and len(names) == 4 and names[0] == "chunk-00000-000000000.jsonl.zst"
    assert len(store.list(join(runs[thinking], "_chunks"))) == 4
    assert m.producer.config["model"] == str(tiny_target_dir) and m.producer.stage == "generate"


@pytest.mark.parametrize("thinking", [True, False])
def test_records_are_what_the_engine_saw_and_said(runs: dict[bool, str], hf_tok: Any, target_arch: str,
                                                  thinking: bool) -> None:
    # Qwen3.6's thinking prompt opens the think block; a block never closed keeps that marker in the content.
    opened = "<think>" if thinking and target_arch == "qwen3_6" else ""
    records = completions(ObjectStore(), runs[thinking])
    prompts = in_shard_order(PROMPTS, 2)
    assert [r.id for r in records] == [p.id for p in prompts]  # type: ignore[union-attr]
    for prompt, record in zip(prompts, records, strict=True):
        assert isinstance(prompt, PromptRecord)
        assert record.messages[:-1] == prompt.messages and record.tools == prompt.tools
        assert record.enable_thinking is thinking and record.source == prompt.source
        # Prompt ids are the chat template's rendering of the messages and tools as stored (shards keep JSON
        # keys sorted, and a template renders a tool schema in its key order).
        stored = PromptRecord(id=record.id, messages=record.messages[:-1], tools=record.tools)
        assert list(record.prompt_token_ids or ()) == template_ids(hf_tok, stored, thinking)
        ids = record.completion_token_ids or ()
        assert 1 <= len(ids) <= 16 and (record.finish_reason == "stop" or len(ids) == 16)
        # The recorded ids decode to the recorded text: reasoning and answer put back together.
        text, answer = raw_text(hf_tok, record), record.final_assistant
        if answer.reasoning_content is None:
            assert answer.content == opened + text
        else:
            assert thinking and "</think>" in text
            head, _, tail = text.partition("</think>")
            assert head.lstrip().removeprefix("<think>").strip("\n") == answer.reasoning_content
            assert tail.lstrip("\n") == answer.content


@ONE_ARCH
def test_bad_input_is_counted_by_reason_and_nothing_else_lost(tmp_path: Path, engine: Any,
                                                              tiny_target_dir: Path) -> None:
    store = ObjectStore()
    good = varied_prompts(7)
    lines: list[PromptRecord | bytes] = [
        good[0], b"{this is not json", good[1],
        prompt_record(user("")),                                   # empty_prompt
        good[2], good[0],                                          # duplicate
        prompt_record(user("lorem ipsum " * MAX_MODEL_LEN)),       # prompt_too_long
        b'{"id": "x", "messages": "not a list"}',                  # malformed_record
        good[3], good[4], good[5], good[6],
    ]
    src = write_prompts(store, str(tmp_path / "prompts"), lines)
    out = str(tmp_path / "completions")
    strict = stage_config(src, out, tiny_target_dir)
    # 3 of 12 failed is over the default 5% limit: the worker fails, its chunks stay committed.
    with pytest.raises(BadInputError, match="4 of 12 prompts could not be generated") as err:
        run(strict, store, engine=engine)
    assert err.value.counts == {"malformed_record": 2, "empty_prompt": 1, "prompt_too_long": 1}
    assert not store.exists(join(out, "manifest.json")) and len(store.list(join(out, "_chunks"))) == 4
    # Another sampling would mix two distributions in one output: refused.
    with pytest.raises(ShardingError, match="other generation settings"):
        run(strict.model_copy(update={"temperature": 0.1}), store, engine=engine)
    # Accepting the bad fraction adopts the committed chunks: nothing is generated twice.
    run(strict.model_copy(update={"max_bad_fraction": 1.0}), store, engine=engine)
    m = load_manifest(store, out, Kind.completions).manifest
    acc = m.accounting
    assert (acc.input_records, acc.succeeded, acc.failed, acc.skipped) == (12, 7, 4, 1)
    assert acc.failures_by_reason == {"malformed_record": 2, "empty_prompt": 1, "prompt_too_long": 1}
    assert acc.skips_by_reason == {"duplicate": 1}
    shard_uri = load_manifest(store, src, Kind.prompts).manifest.shards[0].uri
    assert acc.examples["malformed_record"][0].startswith(f"{shard_uri}:2: not valid JSON")
    assert acc.examples["duplicate"][0].startswith(f"{shard_uri}:6: ")
    assert acc.examples["prompt_too_long"][0].startswith(f"{shard_uri}:7: prompt ")
    assert [r.id for r in completions(store, out)] == [g.id for g in good]
    marker = store.read_bytes(join(out, "_markers", "shard-00000-of-00001.json")).decode()
    assert '"chunks_resumed": 4' in marker


@ONE_ARCH
def test_the_worker_reports_its_progress_to_the_store(tmp_path: Path, engine: Any, tiny_target_dir: Path) -> None:
    """`<output>/_status/worker-N.json`, what `pipeline status` adds up: chunks, prompts, tokens, rate."""
    store = ObjectStore()
    src = write_prompts(store, str(tmp_path / "prompts"), PROMPTS[:6])
    out = str(tmp_path / "completions")
    run(stage_config(src, out, tiny_target_dir, chunk_records=2, progress_every_s=0.001), store, engine=engine)
    report = json.loads(store.read_bytes(join(out, "_status", "worker-00000.json")))
    assert (report["state"], report["worker"], report["workers"]) == ("done", 0, 1)
    assert (report["chunks"], report["chunks_committed"], report["chunks_resumed"]) == (3, 3, 0)
    assert report["prompts"] == report["prompts_done"] == 6
    assert report["output_tokens"] > 0 and report["tokens_per_s"] > 0 and report["eta_s"] is None
    assert report["updated"].endswith("Z")


@ONE_ARCH
def test_tokens_past_an_uncapped_window_are_counted(tmp_path: Path, engine: Any, tiny_target_dir: Path) -> None:
    """Generating past the training window on purpose: the manifest says how many generated tokens it holds."""
    store = ObjectStore()
    src = write_prompts(store, str(tmp_path / "prompts"), PROMPTS[:4])
    out = str(tmp_path / "completions")
    run(stage_config(src, out, tiny_target_dir, training_window=40, cap_to_training_window=False), store,
        engine=engine)
    section = load_manifest(store, out, Kind.completions).manifest.section
    assert isinstance(section, CompletionsSection)
    records = completions(store, out)
    inside = sum(min(len(r.completion_token_ids or ()), max(0, 40 - len(r.prompt_token_ids or ()))) for r in records)
    assert (section.training_window, section.capped_to_window) == (40, False)
    assert section.output_tokens_in_window == inside < section.output_tokens
    assert section.window_fraction == pytest.approx(inside / section.output_tokens, abs=1e-6)


@ONE_ARCH
def test_degenerate_outputs_stop_the_worker_early(tmp_path: Path, engine: Any, tiny_target_dir: Path) -> None:
    store = ObjectStore()
    src = write_prompts(store, str(tmp_path / "prompts"), varied_prompts(24))
    out = str(tmp_path / "completions")
    config = stage_config(src, out, tiny_target_dir, enable_thinking=False, max_new_tokens=1, chunk_records=8,
                          fail_fast_window=6, fail_fast_max_bad_fraction=0.5)
    with pytest.raises(BadInputError, match="the first completions are degenerate, stopping early") as err:
        run(config, store, engine=engine)
    # One token per completion: cut off, or an immediate end of turn (empty answer).
    assert set(err.value.counts) <= {"truncated", "empty_response"} and sum(err.value.counts.values()) == 6
    assert store.list(join(out, "_chunks")) == []  # stopped inside the first chunk
    assert engine._llm.llm_engine.get_num_unfinished_requests() == 0  # noqa: SLF001


@pytest.mark.parametrize("thinking", [True, False])
def test_tokenize_stage_accepts_the_completions(runs: dict[bool, str], tiny_target_dir: Path, tmp_path: Path,
                                                thinking: bool) -> None:
    pytest.importorskip("dflash_tokenize", reason="install jobs/tokenize into the environment")
    from dflash_tokenize.arrow_shards import read_shard
    from dflash_tokenize.config import TokenizeConfig
    from dflash_tokenize.stage import run as tokenize

    store = ObjectStore()
    out = str(tmp_path / "tokenized")
    # A random model's answers fail most quality rules; the gate is opened so every record is tokenised.
    config = TokenizeConfig(input=runs[thinking], output=out, tokenizer=str(tiny_target_dir), mode="token_exact",
                            workers=1, max_bad_fraction=1.0, allow_truncated=True, min_content_tokens=0)
    assert tokenize(config, store) == join(out, "manifest.json")
    generated = load_manifest(store, runs[thinking], Kind.completions).manifest.section
    tokenized = load_manifest(store, out, Kind.tokenized).manifest
    assert isinstance(generated, CompletionsSection) and generated.target is not None
    target = tokenized.section.target  # type: ignore[union-attr]
    assert (target.tokenizer_sha256, target.chat_template_sha256, target.enable_thinking) == (
        generated.target.tokenizer_sha256, generated.target.chat_template_sha256, thinking)
    assert tokenized.section.mode == "token_exact"  # type: ignore[union-attr]
    assert tokenized.accounting.input_records == len(PROMPTS)
    by_id = {r.id: r for r in completions(store, runs[thinking])}
    rows = [row for shard in tokenized.shards
            for row in read_shard(pa.py_buffer(store.read_bytes(shard.uri))).to_pylist()]
    if not thinking:  # without thinking most random answers pass the opened gate
        assert len(rows) >= len(PROMPTS) // 2
    for row in rows:
        record = by_id[row["id"]]
        assert row["input_ids"] == [*record.prompt_token_ids, *record.completion_token_ids]  # type: ignore[misc]


@ONE_ARCH
def test_sigterm_keeps_committed_chunks_and_a_rerun_finishes(tmp_path: Path, engine: Any,
                                                             tiny_target_dir: Path) -> None:
    """SIGTERM (a preempted pod) unwinds to the last committed chunk; the rerun generates only the rest."""
    store = ObjectStore()
    prompts = varied_prompts(18)
    src = write_prompts(store, str(tmp_path / "prompts"), prompts)
    out = str(tmp_path / "completions")
    config = stage_config(src, out, tiny_target_dir, max_new_tokens=32, chunk_records=3, max_inflight=3)

    def strike() -> None:
        deadline = time.monotonic() + 300
        while len(store.list(join(out, "_chunks"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    striker = threading.Thread(target=strike, daemon=True)
    striker.start()
    with pytest.raises(Preempted), preemption_handler():
        run(config, store, engine=engine)
    striker.join()
    receipts = store.list(join(out, "_chunks"))
    assert 2 <= len(receipts) < 6 and not store.exists(join(out, "manifest.json"))
    assert engine._llm.llm_engine.get_num_unfinished_requests() == 0  # noqa: SLF001
    run(config, store, engine=engine)
    assert [r.id for r in completions(store, out)] == [p.id for p in prompts]
    marker = store.read_bytes(join(out, "_markers", "shard-00000-of-00001.json")).decode()
    assert f'"chunks_resumed": {len(receipts)}' in marker
