"""Fixtures of the evaluate tests (and `bench/bench_eval.py`): the tiny target's answers, a drafter trained on them.

Every helper takes the target directory (or its architecture, `arch_of`): the dense Qwen3 and the
Qwen3.6-architecture tiny targets each get their own special ids, stop ids, mask token and drafter shape.

- `chat_prompts`: real chat prompts rendered with the target's template (real Qwen vocabulary); prompts
  0..47 train the drafter, later ones of the same kind are held out for evaluation;
- `target_answers`: the tiny target's greedy answers to them (transformers `generate`), cached on disk;
- `train_drafter`: a drafter trained on those answers with the train stage's own step (`dflash_step`,
  AdamW, 200 steps on CPU), cached on disk keyed by the training sources, so a change to the model, loss
  or step code trains afresh. Its folder looks like a training checkpoint (model.safetensors,
  drafter_config.json) plus the per-slot accuracies training would report (metrics.json);
- `write_trained`, `write_prompts`: the drafter prefix and prompts prefix the export and evaluate stages
  read, with their manifests.

Caches live under `$DFLASH_CACHE` (default `~/.cache/dflash-pipeline`) like the tiny target itself.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_shared.identity import chat_template_sha256, tokenizer_sha256
from dflash_shared.manifests import (
    Accounting,
    DrafterSection,
    Kind,
    Manifest,
    Producer,
    PromptsSection,
    Shard,
    SpecialTokens,
    TargetIdentity,
)
from dflash_shared.records import Message, PromptRecord, record_id
from dflash_shared.storage import ObjectStore, join
from tests.support.qwen_assets import cache_root, qwen_special_ids
from tests.support.tiny_target import TargetArch

if TYPE_CHECKING:
    from dflash_train.drafter.config import DrafterConfig

_VERSION = "1"
TRAIN_TOPICS = ["prime numbers", "binary search", "rivers", "photosynthesis", "chess openings", "compilers",
                "tides", "volcanoes", "glaciers", "hash tables", "orbits", "bread baking"]
HELDOUT_TOPICS = ["lighthouses", "sorting networks", "coral reefs", "bicycles", "thunderstorms", "origami",
                  "submarines", "the printing press"]
NEW_TOKENS = 64
SPECIAL = qwen_special_ids("qwen3")
STOP_IDS = (SPECIAL["im_end"], SPECIAL["endoftext"])
MASK_ID = SPECIAL["mask"]


def arch_of(target_dir: Path) -> TargetArch:
    """Which tiny target's vocabulary a directory holds, from its config.json (qwen3_5 = the Qwen3.6 architecture,
    qwen2 = Qwen2.5's; the others Qwen3's)."""
    model_type = json.loads((Path(target_dir) / "config.json").read_text())["model_type"]
    return {"qwen3_5": "qwen3_6", "qwen2": "qwen2"}.get(model_type, "qwen3")  # type: ignore[return-value]


def special_ids(target_dir: Path) -> dict[str, int]:
    return qwen_special_ids(arch_of(target_dir))


def stop_ids(target_dir: Path) -> tuple[int, int]:
    special = special_ids(target_dir)
    return special["im_end"], special["endoftext"]


TRAIN_PROMPTS = 48


def question(i: int) -> str:
    """User prompt i; 0..TRAIN_PROMPTS-1 train the drafter, later ones are held out (same distribution)."""
    return f"Question {i}: tell me about {TRAIN_TOPICS[i % len(TRAIN_TOPICS)]}, part {i // len(TRAIN_TOPICS)}."


def train_texts() -> list[str]:
    return [question(i) for i in range(TRAIN_PROMPTS)]


def heldout_texts(count: int = 16) -> list[str]:
    return [question(TRAIN_PROMPTS + i) for i in range(count)]


def chat_prompts(target_dir: Path, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of single-turn user prompts rendered with the target's chat template (thinking off)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    out = []
    for text in texts:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      enable_thinking=False, tokenize=True, return_dict=False)
        out.append([int(i) for i in ids])
    return out


def _sources_digest(*extra: str) -> str:
    import dflash_train

    h = hashlib.sha256(_VERSION.encode())
    root = Path(dflash_train.__file__).parent
    for name in ("drafter/model.py", "training/step.py", "training/loss.py", "drafter/attention.py",
                 "training/anchors.py", "data/batch.py", "target_model/frozen.py", "drafter/config.py", "sections.py"):
        h.update((root / name).read_bytes())
    h.update(Path(__file__).read_bytes())
    h.update((Path(__file__).parents[1] / "support" / "step_recipe.py").read_bytes())
    for item in extra:
        h.update(item.encode())
    return h.hexdigest()[:16]


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def target_answers(target_dir: Path, prompts: Sequence[Sequence[int]], new_tokens: int = NEW_TOKENS,
                   ) -> list[list[int]]:
    """The target's greedy completions (stop token included when reached), cached per target and prompts.

    Prompts are decoded in left-padded batches: training data only has to be what the target says, and
    one batched pass per token is many times faster on CPU than one pass per prompt and token.
    """
    stops = stop_ids(target_dir)
    key = hashlib.sha256(json.dumps([target_dir.name, list(map(list, prompts)), new_tokens, stops]).encode())
    path = cache_root() / "evaluate-data" / f"answers-{key.hexdigest()[:16]}.json"
    if path.is_file():
        return json.loads(path.read_text())
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    pad = special_ids(target_dir)["endoftext"]
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=list(stops),
                              pad_token_id=pad)
    answers: list[list[int]] = []
    for start in range(0, len(prompts), 32):
        chunk = [list(p) for p in prompts[start : start + 32]]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=attention, generation_config=config)
        for row in out[:, width:].tolist():
            ends = [i for i, t in enumerate(row) if t in stops]
            answers.append(row[: ends[0] + 1] if ends else row)
    _atomic_write(path, json.dumps(answers).encode())
    return answers


def train_drafter(target_dir: Path, docs: Sequence[tuple[list[int], list[int]]], block_size: int = 8,
                  steps: int = 200, seed: int = 0, log: Callable[[str], None] | None = None,
                  num_anchors: int = 2) -> Path:
    """A checkpoint-like folder of a drafter trained on `docs` ((prompt, answer) pairs), cached.

    It holds what a training checkpoint holds for export: `model.safetensors` (float32, export names) and
    `drafter_config.json`, plus `metrics.json` with the per-slot accuracies of the last steps
    ('acc_1', ...), the keys training writes into the drafter manifest's final_metrics.
    """
    digest = _sources_digest(target_dir.name, json.dumps([list(map(list, d)) for d in docs]), str(block_size),
                             str(steps), str(seed), *([f"anchors={num_anchors}"] if num_anchors != 2 else []))
    folder = cache_root() / "evaluate-data" / f"drafter-{digest}"
    if (folder / "metrics.json").is_file():
        return folder
    import torch
    from safetensors.torch import save_file

    from dflash_train.data.batch import PackedBatch, pack_documents
    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.target_model.frozen import FrozenTarget
    from dflash_train.training.loss import per_position_accuracy
    from dflash_train.training.step import dflash_step
    from tests.support.step_recipe import step_recipe, step_runtime

    cfg = drafter_config(block_size, arch_of(target_dir))
    recipe, runtime = step_recipe(num_anchors=num_anchors), step_runtime()
    target = FrozenTarget.from_pretrained(target_dir, cfg.target_layer_ids, dtype=torch.float32)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).train()
    packed = pack_documents([(p + a, [0] * len(p) + [1] * len(a)) for p, a in docs], max_length=384)
    optim = torch.optim.AdamW(drafter.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup)
                                              * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    rows = packed.input_ids.shape[0]
    correct = torch.zeros(block_size)
    counted = torch.zeros(block_size)
    for step in range(steps):
        row = slice(step % rows, step % rows + 1)
        batch = PackedBatch(packed.input_ids[row], packed.position_ids[row], packed.document_ids[row],
                            packed.loss_mask[row])
        out = dflash_step(drafter, target, batch, cfg, recipe, runtime, gen)
        optim.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optim.step()
        sched.step()
        if step >= steps - rows:  # the last pass over the data: what training would report at the end
            correct += out.correct.float()
            counted += out.counted.float()
        if log is not None and (step % 25 == 0 or step == steps - 1):
            log(f"step {step} loss {out.loss.item():.3f}")
    accuracies = per_position_accuracy(correct, counted)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in drafter.state_dict().items()}, str(tmp / "model.safetensors"))
    (tmp / "drafter_config.json").write_text(cfg.model_dump_json(indent=1))
    (tmp / "metrics.json").write_text(json.dumps({f"acc_{k}": a for k, a in enumerate(accuracies, start=1)}))
    try:
        os.rename(tmp, folder)
    except OSError:  # another process finished first: its folder is as good
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def trained_checkpoint(target_dir: Path) -> Path:
    """The cached drafter trained on the target's greedy answers to the training prompts."""
    prompts = chat_prompts(target_dir, train_texts())
    return train_drafter(target_dir, list(zip(prompts, target_answers(target_dir, prompts), strict=True)))


def load_target(target_dir: Path) -> Any:
    """The target as the evaluate stage loads it (AutoModelForCausalLM, float32, eval)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()


def load_checkpoint_drafter(checkpoint: Path) -> Any:
    """The drafter of a checkpoint-like folder (drafter_config.json + model.safetensors), frozen."""
    from safetensors.torch import load_file

    from dflash_train.drafter.config import DrafterConfig
    from dflash_train.drafter.model import DFlashDrafter

    cfg = DrafterConfig.model_validate_json((checkpoint / "drafter_config.json").read_text())
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(load_file(str(checkpoint / "model.safetensors")))
    return drafter.eval().requires_grad_(False)


def untrained_like(drafter: Any) -> Any:
    """A randomly initialised (seeded) drafter of the same shape: the baseline."""
    import torch

    from dflash_train.drafter.model import DFlashDrafter

    torch.manual_seed(1234)
    return DFlashDrafter(drafter.config).eval().requires_grad_(False)


def drafter_config(block_size: int = 8, arch: TargetArch = "qwen3") -> DrafterConfig:
    """The tiny drafter: 2 full-attention layers over target layers 1 and 2 of the 4-layer Qwen3 (or Qwen2.5, with
    its own mask token) target, or over layers 1, 3 and 5 (linear, full, linear attention) of the 8-layer
    Qwen3.6-architecture target."""
    from dflash_train.drafter.config import DrafterConfig

    if arch == "qwen3_6":
        return DrafterConfig.debug(block_size=block_size, num_target_layers=8,
                                   target_layer_ids=[1, 3, 5], mask_token_id=qwen_special_ids(arch)["mask"])
    if arch == "qwen2":
        return DrafterConfig.debug(block_size=block_size, mask_token_id=qwen_special_ids(arch)["mask"])
    return DrafterConfig.debug(block_size=block_size, mask_token_id=MASK_ID)


# ----------------------------------------------------------------------------------- stage inputs


def target_identity(target_dir: Path) -> TargetIdentity:
    special = special_ids(target_dir)
    return TargetIdentity(
        model_id=f"tiny-{arch_of(target_dir)}", tokenizer_sha256=tokenizer_sha256(target_dir),
        chat_template_sha256=chat_template_sha256(target_dir), enable_thinking=False,
        special_tokens=SpecialTokens(end_of_turn=special["im_end"], mask=special["mask"]),
    )


def write_prompts(store: ObjectStore, prefix: str, texts: list[str]) -> str:
    """A prompts manifest (one JSONL shard) of single-turn user prompts."""
    lines = []
    for text in texts:
        messages = (Message(role="user", content=text),)
        lines.append(PromptRecord(id=record_id(messages), messages=messages).model_dump_json(exclude_none=True))
    data = ("\n".join(lines) + "\n").encode()
    uri = join(prefix, "data", "part-00000.jsonl")
    store.write_bytes(uri, data)
    manifest = Manifest(
        kind=Kind.prompts, run_id="eval-test", producer=Producer(stage="import"),
        shards=[Shard(uri=uri, bytes=len(data), sha256=store.sha256(uri), records=len(lines))],
        accounting=Accounting(input_records=len(lines), succeeded=len(lines), failed=0, skipped=0),
        section=PromptsSection(sources=["tests"], duplicates=0),
    )
    store.write_bytes(join(prefix, "manifest.json"), manifest.to_json())
    return prefix


def write_trained(store: ObjectStore, prefix: str, checkpoint: Path, target_dir: Path) -> str:
    """A drafter prefix as training leaves it: a checkpoint folder and the drafter manifest naming it."""
    from dflash_train.drafter.config import DrafterConfig

    cfg = DrafterConfig.model_validate_json((checkpoint / "drafter_config.json").read_text())
    ckpt = join(prefix, "checkpoints", "step-00000200")
    shards = []
    for name in ("model.safetensors", "drafter_config.json"):
        store.upload_from(str(checkpoint / name), join(ckpt, name))
        shards.append(Shard(uri=join(ckpt, name), bytes=(checkpoint / name).stat().st_size,
                            sha256=store.sha256(join(ckpt, name)), records=0))
    metrics = json.loads((checkpoint / "metrics.json").read_text())
    manifest = Manifest(
        kind=Kind.drafter, run_id="eval-test", producer=Producer(stage="train"), shards=shards,
        accounting=Accounting(input_records=48, succeeded=48, failed=0, skipped=0),
        section=DrafterSection(target=target_identity(target_dir), target_layer_ids=list(cfg.target_layer_ids),
                               block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, checkpoint_uri=ckpt,
                               final_metrics=metrics),
    )
    store.write_bytes(join(prefix, "manifest.json"), manifest.to_json())
    return prefix
