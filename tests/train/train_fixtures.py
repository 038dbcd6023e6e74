"""Training data for the train-stage tests: tokenized manifests the way the tokenize stage makes them.

Two kinds:
- `write_tokenized`: shards written with the tokenize stage's own Arrow writer from given documents (a
  deterministic synthetic pattern for fast tests of loading, packing and loss decrease);
- `target_generated`: completions whose answers the tiny target itself produced (greedy decoding with
  transformers' `generate`), run through the real tokenize stage in token-exact mode. A drafter that reads
  the target's hidden states can learn to predict those answers, which is what DFlash training is for.

Generation takes a while on CPU, so its token ids are cached under `$DFLASH_CACHE`, keyed by the tiny
target's directory (itself keyed by its build parameters) and the generation settings.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dflash_shared.identity import chat_template_sha256, tokenizer_sha256
from dflash_shared.manifests import (
    Accounting,
    HeldoutSplit,
    Kind,
    Manifest,
    Producer,
    Shard,
    SpecialTokens,
    TargetIdentity,
    TokenizedSection,
)
from dflash_shared.records import CompletionRecord, Message, record_id
from dflash_shared.settings import parse_settings
from dflash_shared.storage import ObjectStore, join
from dflash_tokenize.arrow_shards import Sequences
from dflash_tokenize.chat import ChatFormat
from dflash_tokenize.config import TokenizeConfig
from dflash_tokenize.stage import run as run_tokenize
from dflash_train.config import TrainConfig
from dflash_train.stage import run as run_train
from dflash_train.training.metrics import read_scalars
from tests.support.qwen_assets import cache_root, cached_directory, qwen_special_ids
from tests.support.tiny_target import build_tiny_qwen3
from tests.tokenize.stage_fixtures import write_completions

_GENERATION_VERSION = "1"
TOPICS = ["prime numbers", "binary search", "rivers", "photosynthesis", "chess openings", "compilers", "tides",
          "volcanoes"]


@functools.cache
def tiny_target() -> Path:
    """The cached tiny Qwen3 target (4 layers, hidden 128, real Qwen3 vocabulary)."""
    return build_tiny_qwen3()


SMALL_VOCAB = 8192
SMALL_MASK_ID = SMALL_VOCAB - 1


@functools.cache
def small_vocab_target() -> Path:
    """The tiny target's shape and tokenizer files with an 8,192-row embedding (cached).

    For tests on synthetic data (ids below 8,192) that run many steps: the LM-head cross-entropy over
    the full 151,936-row vocabulary is what costs the time of a CPU step. The tokenizer (and so the
    identity hashes) are the full target's; only token ids the embedding covers may appear in the data.
    """
    full = tiny_target()

    def build(out: Path) -> None:
        import torch
        from transformers import AutoConfig, Qwen3ForCausalLM

        config = AutoConfig.from_pretrained(full)
        config.vocab_size = SMALL_VOCAB
        # The padding row must exist in the smaller table (it is never used: nothing pads).
        config.pad_token_id = config.bos_token_id = config.eos_token_id = 0
        torch.manual_seed(0)
        Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            shutil.copyfile(full / name, out / name)

    return cached_directory(cache_root() / "tiny-qwen3" / f"small-vocab-{SMALL_VOCAB}-{full.name}", build)


def identity_of(target_dir: Path, thinking: bool = False) -> TargetIdentity:
    ids = qwen_special_ids("qwen3")
    return TargetIdentity(
        model_id="tiny-qwen3",
        tokenizer_sha256=tokenizer_sha256(target_dir),
        chat_template_sha256=chat_template_sha256(target_dir),
        enable_thinking=thinking,
        special_tokens=SpecialTokens(end_of_turn=ids["im_end"], think_start=ids["think_start"],
                                     think_end=ids["think_end"], mask=ids["mask"]),
    )


def synthetic_docs(count: int, seed: int = 0, min_len: int = 24, max_len: int = 120,
                   ) -> list[tuple[list[int], list[int]]]:
    """Documents of a learnable pattern: a short prompt (no loss), then a run of consecutive token ids."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        n = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(4, 9))
        start = int(rng.integers(0, 64))
        ids = [100 + int(t) for t in rng.integers(0, 50, prompt)]
        ids += [1000 + (start + i) % 64 for i in range(n - prompt)]
        docs.append((ids, [0] * prompt + [1] * (n - prompt)))
    return docs


def write_tokenized(store: ObjectStore, prefix: str, docs: Sequence[tuple[Sequence[int], Sequence[int]]],
                    target: TargetIdentity, shards: int = 1, max_length: int = 4096,
                    heldout: Sequence[tuple[Sequence[int], Sequence[int]]] = ()) -> str:
    """A tokenized manifest over `docs` split into `shards` Arrow files (document i is in shard i % shards),
    plus `heldout` documents in one held-out shard (data/heldout/) when given."""
    written = []
    parts = [(f"part-{index:05d}-0000.arrow", "train", list(docs)[index::shards]) for index in range(shards)]
    if heldout:
        parts.append(("heldout/part-00000-0000.arrow", "heldout", list(heldout)))
    for index, (name, split, part) in enumerate(parts):
        lengths = [len(ids) for ids, _ in part]
        seqs = Sequences(
            ids=[f"{split}-{index}-{i}" for i in range(len(part))],
            input_ids=np.concatenate([np.asarray(ids, dtype=np.int32) for ids, _ in part]),
            loss_mask=np.concatenate([np.asarray(mask, dtype=np.int8) for _, mask in part]),
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        )
        import pyarrow as pa

        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, seqs.to_record_batch().schema) as writer:
            writer.write_batch(seqs.to_record_batch())
        data = sink.getvalue().to_pybytes()
        uri = join(prefix, "data", name)
        store.write_bytes(uri, data)
        written.append(Shard(uri=uri, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), records=len(part),
                             tokens=sum(lengths), split=split))  # type: ignore[arg-type]
    everything = [*docs, *heldout]
    total = sum(len(ids) for ids, _ in everything)
    split_of = HeldoutSplit(fraction=0.01, min_records=len(heldout), input_records=len(everything),
                            effective_fraction=len(heldout) / max(1, len(everything)), records=len(heldout),
                            tokens=sum(len(ids) for ids, _ in heldout),
                            loss_tokens=sum(int(sum(m)) for _, m in heldout))
    manifest = Manifest(
        kind=Kind.tokenized,
        run_id="test-run",
        producer=Producer(stage="tokenize"),
        shards=written,
        accounting=Accounting(input_records=len(everything), succeeded=len(everything), failed=0, skipped=0),
        section=TokenizedSection(target=target, mode="token_exact", mask_policy="final_turn", max_length=max_length,
                                 total_tokens=total, loss_tokens=sum(int(sum(m)) for _, m in everything),
                                 heldout=split_of),
    )
    store.write_bytes(join(prefix, "manifest.json"), manifest.to_json())
    return prefix


def _prompt(i: int) -> list[Message]:
    return [Message(role="user", content=f"Question {i}: tell me about {TOPICS[i % len(TOPICS)]}, part {i // 8}.")]


def generated_answers(count: int = 64, new_tokens: int = 40) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy completion ids + <|im_end|>) of the tiny target for `count` prompts (cached)."""
    target_dir = tiny_target()
    key = hashlib.sha256(f"{target_dir.name}|{count}|{new_tokens}|{_GENERATION_VERSION}".encode()).hexdigest()[:16]
    path = cache_root() / "train-data" / f"generated-{key}.json"
    if path.is_file():
        return [(list(p), list(c)) for p, c in json.loads(path.read_text())]
    import torch
    from transformers import AutoModelForCausalLM

    chat = ChatFormat.from_dir(target_dir)
    special = qwen_special_ids("qwen3")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    rows = int(model.config.vocab_size)
    # Control tokens and the unused embedding rows past the tokenizer would not decode to answer text.
    suppress = list(range(special["endoftext"], rows))
    prompts = [chat.encode(chat.render_dicts([m.template_dict() for m in _prompt(i)], add_generation_prompt=True,
                                             enable_thinking=False)) for i in range(count)]
    width = max(len(p) for p in prompts)
    pad = special["endoftext"]
    # Left padding: every row's answer starts at the same column of the batched output.
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        # A random model with tied embeddings mostly predicts its input token again; the repetition penalty
        # keeps the greedy answers varied (and they stay a deterministic function of the context).
        gen = model.generate(ids, attention_mask=attention, max_new_tokens=new_tokens, do_sample=False,
                             repetition_penalty=1.5, suppress_tokens=suppress, pad_token_id=pad)
    out = [(p, gen[i, width:].tolist() + [special["im_end"]]) for i, p in enumerate(prompts)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, path)
    return out


def target_generated(store: ObjectStore, root: str, count: int = 64) -> str:
    """Tokenized prefix (under `root`) of the tiny target's own answers, made by the tokenize stage."""
    target_dir = tiny_target()
    chat = ChatFormat.from_dir(target_dir)
    records = []
    for i, (prompt, completion) in enumerate(generated_answers(count)):
        messages = [*_prompt(i), Message(role="assistant", content=chat.decode(completion[:-1]))]
        records.append(CompletionRecord(
            id=record_id(messages[:-1]), messages=tuple(messages), prompt_token_ids=tuple(prompt),
            completion_token_ids=tuple(completion), finish_reason="stop", enable_thinking=False,
        ))
    identity = identity_of(target_dir)
    src = write_completions(store, join(root, "completions"), records, shards=2, target=identity)
    out = join(root, "tokenized")
    # Every answer trains: the learning test measures the drafter on this data itself.
    run_tokenize(TokenizeConfig(input=src, output=out, tokenizer=str(target_dir), workers=1, max_length=512,
                                max_bad_fraction=0.5, heldout_fraction=0), store)
    return out


# ---------------------------------------------------------------------------------------- resume runs

RESUME_STEPS = 8


@functools.cache
def session_root() -> str:
    """A scratch directory shared by the train test modules of this process, removed at exit."""
    root = tempfile.mkdtemp(prefix="dflash-train-tests-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def resume_data() -> str:
    """A small synthetic tokenized prefix for the interruption tests (short rows keep steps cheap)."""
    return write_tokenized(ObjectStore(), join(session_root(), "resume-tok"), synthetic_docs(100, max_len=60),
                           identity_of(tiny_target()), shards=2)


def resume_args(output: str, **flags: str) -> list[str]:
    """Command-line flags of the interruption tests' runs (the same for CLI and in-process runs)."""
    values = {"input": resume_data(), "output": output, "target": str(small_vocab_target()),
              "scratch-dir": join(session_root(), "scratch"), "max-steps": str(RESUME_STEPS), "max-length": "64",
              "batch-tokens": "128", "checkpoint-every": "2", "mask-token-id": str(SMALL_MASK_ID),
              "num-anchors": "2", **flags}
    # An empty value is a boolean flag given alone (`--compile`).
    return ["--preset", "debug", *(item for key, value in values.items() for item in (f"--{key}", value) if item)]


def resume_config(output: str, **flags: str) -> TrainConfig:
    return parse_settings(TrainConfig, resume_args(output, **flags))


@functools.cache
def resume_reference() -> dict[int, float]:
    """step -> loss of the uninterrupted run (world size 1) the interrupted ones must reproduce."""
    output = join(session_root(), "reference")
    run_train(resume_config(output), ObjectStore())
    return read_scalars(ObjectStore(), output, "train/loss")
