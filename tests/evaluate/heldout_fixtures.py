"""Inputs of the evaluate tests that hold a split: a tokenized manifest with train and held-out shards, a prompt set.

Kept apart from `eval_fixtures` on purpose: that module's bytes key the cached trained drafters, and these
helpers do not change what the drafters are trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from dflash_shared.manifests import Accounting, HeldoutSplit, Kind, Manifest, Producer, Shard, TokenizedSection
from dflash_shared.storage import ObjectStore, join
from tests.evaluate import eval_fixtures as ef


def _arrow_rows(ids: list[str], prompts: list[list[int]], answer: list[int]) -> bytes:
    batch = pa.RecordBatch.from_pydict({
        "id": ids,
        "input_ids": [p + answer for p in prompts],
        "loss_mask": [[0] * len(p) + [1] * len(answer) for p in prompts],
    })
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def write_split_tokenized(store: ObjectStore, prefix: str, target_dir: Path, train: int = 8,
                          heldout: int = 16) -> str:
    """A tokenized manifest as the tokenize stage writes it: the first training prompts in a train shard,
    the held-out prompts (ef.heldout_texts) in a held-out shard under data/heldout/."""
    answer = [ef.stop_ids(target_dir)[0]]
    parts = [("part-00000-0000.arrow", "train", ef.train_texts()[:train]),
             ("heldout/part-00000-0000.arrow", "heldout", ef.heldout_texts(heldout))]
    shards = []
    for name, split, texts in parts:
        data = _arrow_rows([f"{split}-{i}" for i in range(len(texts))], ef.chat_prompts(target_dir, texts), answer)
        uri = join(prefix, "data", name)
        store.write_bytes(uri, data)
        shards.append(Shard(uri=uri, bytes=len(data), sha256=store.sha256(uri), records=len(texts),
                            split=split))  # type: ignore[arg-type]
    total = train + heldout
    manifest = Manifest(
        kind=Kind.tokenized, run_id="eval-test", producer=Producer(stage="tokenize"), shards=shards,
        accounting=Accounting(input_records=total, succeeded=total, failed=0, skipped=0),
        section=TokenizedSection(
            target=ef.target_identity(target_dir), mode="render", mask_policy="final_turn", max_length=512,
            total_tokens=0, loss_tokens=total,
            heldout=HeldoutSplit(fraction=0.01, min_records=heldout, input_records=total,
                                 effective_fraction=heldout / total, records=heldout, tokens=0, loss_tokens=heldout)),
    )
    store.write_bytes(join(prefix, "manifest.json"), manifest.to_json())
    return prefix


# One prompt of each style the evaluation reads, and one line it cannot use (line 3).
PROMPT_SET_LINES = [
    json.dumps({"question": ef.question(100), "answer": "#### 42"}),                   # GSM8K
    json.dumps({"question_id": 81, "turns": [ef.question(101), "And a follow-up?"]}),  # MT-Bench
    json.dumps({"answer": "no prompt field at all"}),                                   # unusable
    json.dumps({"messages": [{"role": "user", "content": ef.question(102)},
                             {"role": "assistant", "content": "dropped: the drafter answers"}]}),
]


def write_prompt_set(store: ObjectStore, uri: str) -> str:
    store.write_bytes(uri, ("\n".join(PROMPT_SET_LINES) + "\n").encode())
    return uri
