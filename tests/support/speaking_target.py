"""Small Qwen3 targets that really speak: trained by the project on the standard library's own text.

A random target loops ("wb wb wb ..."): a prompt lookup then predicts it better than any drafter, and the
drafter's figures say nothing about whether training works. This target is a real language model at toy
size, with the real Qwen3 vocabulary and chat template: asked "What does `json.dumps(obj, ...)` do?" it
answers in the docstrings' English and ends its turn (`tests.support.stdlib_corpus` has the text and its
licence). Those answers are 7-9 tokens, one or two drafted blocks; the long-answer target (`CODE_TARGET`) is
the same model trained on the library's function bodies, asked for by signature and docstring
(`tests.support.stdlib_code`), whose answers run to a hundred tokens and more. Each target's held-out loss and
a repetition probe of its greedy answers (the distinct-token ratio, and the share of 4-grams an answer repeats
from itself, beside the same figures of the real held-out text) are written beside the weights
(`speaking_target.json`) and checked against the target's own bound: a looping target fails the build.

Why it trains in minutes on 2 CPU cores: the corpus uses about 10K of the 151,936 vocabulary rows, and the
LM head over all rows would cost 15x the rest of the model. Training therefore keeps only the rows (of an
embedding tied to the LM head) the corpus uses; every other row of the saved LM head is zero, so its logit is exactly 0, and the loss is the exact full-vocabulary
cross-entropy all the same: logsumexp over the used rows' logits and `n_unused` logits of 0 (a constant column
of log n_unused). The saved checkpoint scatters the trained rows into the full matrix, so vLLM and
transformers load the very model that was trained.

Deterministic: one thread, a fixed seed, a fixed order; cached under `$DFLASH_CACHE/<target folder>/` by a key
of the recipe, the corpus digest, this file and the library versions, so a change of any rebuilds it.

CLI: `python -m tests.support.speaking_target [--corpus code] OUT_DIR` (prints the metrics); needs torch and
transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tests.support import qwen_assets, stdlib_code, stdlib_corpus
from tests.support.qwen_assets import build_tokenizer_dir, qwen_embedding_rows, qwen_special_ids
from tests.support.tiny_target import cached_model_build, finish_model_dir

METRICS_NAME = "speaking_target.json"
# Real prose of 48 tokens has a distinct-token ratio of about 0.6-0.8; a target stuck in a loop is under 0.2.
MIN_DISTINCT_TOKEN_RATIO = 0.45


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that decides the weights (the corpus aside: its digest joins the cache key)."""

    num_layers: int = 4
    hidden: int = 128
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64  # vLLM's CPU attention takes 64, not 16
    intermediate: int = 384
    max_position: int = 2048
    seed: int = 0
    steps: int = 1000
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    # Tokens of the chat prompt count a little in the loss: the model learns the names' words, which its
    # answers reuse, without spending its capacity on predicting the question.
    prompt_loss_weight: float = 0.1
    # Held-out answers decoded greedily for the distinct-token ratio.
    probe_prompts: int = 24
    probe_new_tokens: int = 48
    # Torch threads while training: 1 gives the same bits on every machine; the long-answer target's build, four
    # times the docstring target's tokens per step, takes 2 (the same bits on every machine with 2 threads).
    threads: int = 1


class Pair(Protocol):
    """A question and the answer the target learns for it (`stdlib_corpus.DocPair`, `stdlib_code.CodePair`)."""

    @property
    def question(self) -> str: ...
    @property
    def answer(self) -> str: ...


class Corpus(Protocol):
    """What a target is trained on: a module such as `stdlib_corpus` or `stdlib_code`."""

    DESCRIPTION: str

    def split_pairs(self, split: stdlib_corpus.Split) -> Sequence[Pair]: ...
    def corpus_digest(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """One speaking target: its cache folder, its corpus, its recipe, and the repetition bounds its build enforces."""

    folder: str
    corpus: Corpus
    recipe: Recipe
    min_distinct_token_ratio: float | None = None
    max_repeated_4gram_share: float | None = None


# The docstring target: 7-9 token answers of prose, where a loop shows as few distinct tokens.
DOCS_TARGET = TargetSpec("speaking-qwen3", stdlib_corpus, Recipe(), min_distinct_token_ratio=MIN_DISTINCT_TOKEN_RATIO)
# The long-answer target: the same model shape (the demo's drafter preset fits both), trained on function bodies
# (about 112 tokens each). Code repeats its own tokens by nature (indentation, names), so the distinct-token
# ratio says little (0.54 for real held-out bodies cut to 256 tokens); a loop shows as an answer repeating its
# own 4-grams, which real held-out bodies do for 6.6% of theirs and a loop for nearly all (the metrics'
# `reference` holds the real bodies' figures).
CODE_TARGET = TargetSpec(
    "speaking-code-qwen3", stdlib_code,
    # 800 steps (loss 3.20, still falling) left greedy answers repeating 73% of their 4-grams.
    Recipe(steps=2000, batch_size=16, probe_prompts=24, probe_new_tokens=256, threads=2),
    max_repeated_4gram_share=0.5,
)
TARGETS = {"docs": DOCS_TARGET, "code": CODE_TARGET}


def _cache_key(spec: TargetSpec) -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(spec.recipe), sort_keys=True).encode())
    h.update(spec.folder.encode())  # the bounds judge the weights, they do not decide them
    # The release, not the build: the CPU and CUDA wheels of one torch release (the train and generate
    # environments) train the same model on a CPU, and both should find it in the cache.
    release = torch.__version__.split("+")[0]
    h.update(f"{release}|{transformers.__version__}|{spec.corpus.corpus_digest()}".encode())
    # The corpus enters by its digest (pairs and splits), not its module's source: its CLI may change freely.
    for source in (Path(__file__), Path(qwen_assets.__file__), qwen_assets.CHAT_TEMPLATE_PATHS["qwen3"]):
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


@dataclasses.dataclass
class _Example:
    ids: list[int]
    weights: list[float]  # loss weight of predicting ids[i + 1] from ids[:i + 1]


def _examples(tokenizer: Any, pairs: Sequence[Pair], recipe: Recipe) -> list[_Example]:
    im_end = qwen_special_ids("qwen3")["im_end"]
    out = []
    for pair in pairs:
        prompt = chat_prompt_ids(tokenizer, pair.question)
        answer = tokenizer(pair.answer, add_special_tokens=False)["input_ids"] + [im_end]
        ids = prompt + answer
        # weights[i] weighs the prediction of ids[i + 1]: the answer's tokens and its end of turn in full.
        weights = [recipe.prompt_loss_weight] * (len(prompt) - 1) + [1.0] * len(answer)
        out.append(_Example(ids, weights))
    return out


def chat_prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The prompt as the pipeline sends it: the chat template, thinking off, the assistant turn opened."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                        add_generation_prompt=True, enable_thinking=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns an encoding


class _SmallVocabLM:
    """The trainable parts: a Qwen3 body and the used rows of the tied embedding."""

    def __init__(self, recipe: Recipe, used: list[int]) -> None:
        import torch
        from transformers import Qwen3Config, Qwen3Model

        self.config = qwen3_config(recipe)
        small = Qwen3Config(**{**self.config.to_dict(), "vocab_size": 1, "pad_token_id": None,
                               "bos_token_id": None, "eos_token_id": None})  # no 151K-row matrix while training
        torch.manual_seed(recipe.seed)
        self.body = Qwen3Model(small)
        self.rows = torch.nn.Parameter(torch.randn(len(used), recipe.hidden) * 0.02)
        self.used = torch.tensor(used)
        self.n_unused = self.config.vocab_size - len(used)
        self.index = torch.full((self.config.vocab_size,), -1, dtype=torch.long)
        self.index[self.used] = torch.arange(len(used))
        self.mask_token = qwen_special_ids("qwen3")["mask"]
        self.seed = recipe.seed

    def parameters(self) -> list[Any]:
        return [*self.body.parameters(), self.rows]

    def loss(self, ids: Any, weights: Any, mask: Any) -> tuple[Any, Any]:
        """Summed weighted full-vocabulary cross-entropy of next-token prediction, and the weight total."""
        import torch

        local = self.index[ids]
        hidden = self.body(inputs_embeds=self.rows[local], attention_mask=mask).last_hidden_state
        logits = hidden[:, :-1] @ self.rows.T
        unused = torch.full((*logits.shape[:-1], 1), math.log(self.n_unused))
        lse = torch.logsumexp(torch.cat([logits, unused], dim=-1), dim=-1)
        nll = lse - logits.gather(-1, local[:, 1:, None]).squeeze(-1)
        return (nll * weights).sum(), weights.sum()

    def full_state_dict(self) -> dict[str, Any]:
        """The checkpoint's tensors: the body, the LM head with the unused rows zero, and the input embedding:
        the same rows plus a non-zero row for the drafter's mask token (see `mask_token_row`)."""
        import torch

        state = {f"model.{k}": v.detach().clone() for k, v in self.body.state_dict().items()}
        head = torch.zeros(self.config.vocab_size, self.config.hidden_size)
        head[self.used] = self.rows.detach()
        embed = head.clone()
        embed[self.mask_token] = mask_token_row(self.rows.detach(), self.seed)
        state["model.embed_tokens.weight"] = embed
        state["lm_head.weight"] = head
        return state


def mask_token_row(rows: Any, seed: int) -> Any:
    """The input embedding of the drafter's mask token: a fixed random row of the trained rows' scale.

    The mask token never occurs in the corpus, so training leaves its row zero; a zero row makes every MASK slot's
    query in the drafter's first layer exactly zero (it then averages its context uniformly). The row is set in the
    input embedding only: the LM head's mask row stays zero, so the token's logit is 0 as every unused row's, and
    the full-vocabulary loss is the exact one the small-vocabulary training computed. Hence untied weights."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(rows.shape[1], generator=gen) * rows.std()


def qwen3_config(recipe: Recipe) -> Any:
    from transformers import Qwen3Config

    ids = qwen_special_ids("qwen3")
    return Qwen3Config(
        vocab_size=qwen_embedding_rows("qwen3"), hidden_size=recipe.hidden, intermediate_size=recipe.intermediate,
        num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.heads, num_key_value_heads=recipe.kv_heads,
        head_dim=recipe.head_dim, max_position_embeddings=recipe.max_position, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=ids["endoftext"], eos_token_id=ids["im_end"],
        pad_token_id=ids["endoftext"], dtype="bfloat16",
    )


def _batch(examples: list[_Example], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    weights = torch.zeros(len(examples), width - 1)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for row, e in enumerate(examples):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
        weights[row, : len(e.weights)] = torch.tensor(e.weights)
        mask[row, : len(e.ids)] = 1
    return ids, weights, mask


def _batches(examples: list[_Example], recipe: Recipe) -> list[list[_Example]]:
    """Batches of similar lengths (little padding), in a seeded order, enough for `recipe.steps`."""
    rng = random.Random(recipe.seed)
    out: list[list[_Example]] = []
    while len(out) < recipe.steps:
        order = sorted(examples, key=lambda e: (len(e.ids), rng.random()))
        epoch = [order[i : i + recipe.batch_size] for i in range(0, len(order), recipe.batch_size)]
        rng.shuffle(epoch)
        out.extend(epoch)
    return out[: recipe.steps]


def _train(model: _SmallVocabLM, train: list[_Example], recipe: Recipe, pad_id: int, log: Any) -> list[float]:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95),
                                  weight_decay=recipe.weight_decay)

    def lr_at(step: int) -> float:  # linear warm-up, cosine to a tenth
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.body.train()
    losses: list[float] = []
    began = time.monotonic()
    for step, batch in enumerate(_batches(train, recipe)):
        total, weight = model.loss(*_batch(batch, pad_id))
        (total / weight).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total.detach() / weight))
        if (step + 1) % 100 == 0 or step + 1 == recipe.steps:
            recent = sum(losses[-100:]) / len(losses[-100:])
            log(f"speaking target: step {step + 1}/{recipe.steps}, loss {recent:.3f}, "
                f"{time.monotonic() - began:.0f} s")
    return losses


def _heldout_loss(model: _SmallVocabLM, heldout: list[_Example], pad_id: int) -> float:
    """Mean full-vocabulary cross-entropy per answer token on the held-out pairs (prompt tokens unweighted)."""
    import torch

    answer_only = [_Example(e.ids, [1.0 if w == 1.0 else 0.0 for w in e.weights]) for e in heldout]
    model.body.eval()
    total = weight = 0.0
    with torch.no_grad():
        for i in range(0, len(answer_only), 32):
            t, w = model.loss(*_batch(answer_only[i : i + 32], pad_id))
            total, weight = total + float(t), weight + float(w)
    return total / weight


def distinct_token_ratio(tokens: list[int]) -> float:
    """Distinct tokens over tokens: about 0.6-0.8 for prose of a few dozen tokens, near 0 for a loop."""
    return len(set(tokens)) / len(tokens) if tokens else 0.0


def repeated_ngram_share(tokens: list[int], n: int = 4) -> float:
    """The share of an answer's n-grams that it already said: near 1 for a loop, whatever its period."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams) if grams else 0.0


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def repetition_probe(answers: list[list[int]]) -> dict[str, float]:
    """The loop figures of greedy answers (or of the real text, for reference)."""
    return {"distinct_token_ratio": round(_mean([distinct_token_ratio(a) for a in answers]), 4),
            "repeated_4gram_share": round(_mean([repeated_ngram_share(a) for a in answers]), 4),
            "mean_answer_tokens": round(_mean([len(a) for a in answers]), 1)}


def probe_failures(spec: TargetSpec, probe: dict[str, float]) -> list[str]:
    """Why a target's greedy answers count as looping, by its own bounds (none: it speaks)."""
    failures = []
    if spec.min_distinct_token_ratio is not None and probe["distinct_token_ratio"] < spec.min_distinct_token_ratio:
        failures.append(f"distinct-token ratio {probe['distinct_token_ratio']} is under "
                        f"{spec.min_distinct_token_ratio}")
    if spec.max_repeated_4gram_share is not None and probe["repeated_4gram_share"] > spec.max_repeated_4gram_share:
        failures.append(f"repeated 4-gram share {probe['repeated_4gram_share']} is over "
                        f"{spec.max_repeated_4gram_share}")
    return failures


def probe_generations(model_dir: Path, questions: list[str], new_tokens: int) -> list[list[int]]:
    """Greedy answers (float32, transformers) to `questions`, without the end-of-turn token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stops = {qwen_special_ids("qwen3")["im_end"], qwen_special_ids("qwen3")["endoftext"]}
    answers = []
    with torch.no_grad():
        for question in questions:
            prompt = torch.tensor([chat_prompt_ids(tokenizer, question)])
            out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 eos_token_id=sorted(stops))
            answers.append([t for t in out[0, prompt.shape[1]:].tolist() if t not in stops])
    return answers


def _write(out_dir: Path, spec: TargetSpec, log: Any) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    recipe = spec.recipe
    torch.set_num_threads(recipe.threads)
    began = time.monotonic()
    build_tokenizer_dir(out_dir, "qwen3")
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    train = _examples(tokenizer, spec.corpus.split_pairs("train"), recipe)
    heldout_pairs = spec.corpus.split_pairs("heldout")
    heldout = _examples(tokenizer, heldout_pairs, recipe)
    special = qwen_special_ids("qwen3")
    used = sorted({t for e in train + heldout for t in e.ids} | {special["endoftext"], special["im_end"]})
    model = _SmallVocabLM(recipe, used)
    log(f"speaking target {spec.folder}: {len(train)} training pairs ({sum(len(e.ids) for e in train)} tokens), "
        f"{len(heldout)} held out, {len(used)} of {model.config.vocab_size} vocabulary rows used")
    losses = _train(model, train, recipe, special["endoftext"], log)
    heldout_loss = _heldout_loss(model, heldout, special["endoftext"])

    full = Qwen3ForCausalLM(model.config)
    missing, unexpected = full.load_state_dict(model.full_state_dict(), strict=False)
    if unexpected or missing:
        raise RuntimeError(f"speaking target: checkpoint keys do not match ({missing}, {unexpected})")
    full.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    finish_model_dir(out_dir, special)

    probed = heldout_pairs[: recipe.probe_prompts]
    answers = probe_generations(out_dir, [p.question for p in probed], recipe.probe_new_tokens)
    probe = repetition_probe(answers)
    # The same figures of the real answers, cut to the probe's length: what text of this kind looks like.
    real = [tokenizer(p.answer, add_special_tokens=False)["input_ids"][: recipe.probe_new_tokens] for p in probed]
    metrics = {
        "recipe": dataclasses.asdict(recipe),
        "corpus": {"source": spec.corpus.DESCRIPTION, "python_stdlib": str(stdlib_corpus.stdlib_root()),
                   "digest": spec.corpus.corpus_digest(), "train_pairs": len(train), "heldout_pairs": len(heldout),
                   "vocabulary_rows_used": len(used),
                   "mean_answer_tokens": round(_mean([sum(w == 1.0 for w in e.weights) - 1 for e in train]), 1)},
        "final_train_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
        "heldout_loss": round(heldout_loss, 4),
        "heldout_perplexity": round(math.exp(heldout_loss), 2),
        **probe,
        # Answers that ended their turn inside the probe's budget (the rest were cut at probe_new_tokens).
        "ended_turn_share": round(_mean([len(a) < recipe.probe_new_tokens for a in answers]), 4),
        "reference": repetition_probe(real),
        "min_distinct_token_ratio": spec.min_distinct_token_ratio,
        "max_repeated_4gram_share": spec.max_repeated_4gram_share,
        "sample": {"question": probed[0].question, "answer": tokenizer.decode(answers[0])},
        "build_seconds": round(time.monotonic() - began, 1),
    }
    (out_dir / METRICS_NAME).write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    (out_dir / METRICS_NAME).chmod(0o644)
    failures = probe_failures(spec, probe)
    if failures:  # the build's folder goes with the failure: its figures stay in the log
        log(json.dumps({k: v for k, v in metrics.items() if k != "recipe"}, indent=1))
        raise RuntimeError(f"speaking target {spec.folder} loops: of its greedy answers, {'; '.join(failures)} "
                           f"(see {out_dir / METRICS_NAME})")


def build_speaking_target(spec: TargetSpec, out_dir: Path | None = None, log: Any = print) -> Path:
    """Directory of a trained speaking target (built once per recipe and corpus, then cached)."""
    key = _cache_key(spec)
    return cached_model_build(qwen_assets.cache_root() / spec.folder / key, key,
                              lambda tmp: _write(tmp, spec, log), out_dir)


def build_speaking_qwen3(out_dir: Path | None = None, recipe: Recipe | None = None, log: Any = print) -> Path:
    """Directory of the docstring target (`recipe`: another recipe of it, as tests use)."""
    spec = DOCS_TARGET if recipe is None else dataclasses.replace(DOCS_TARGET, recipe=recipe)
    return build_speaking_target(spec, out_dir, log)


def target_metrics(model_dir: Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / METRICS_NAME).read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, nargs="?", default=None, help="copy the model here (default: cache)")
    parser.add_argument("--corpus", choices=sorted(TARGETS), default="docs",
                        help="docs: docstring answers of 7-9 tokens (default); code: function bodies of about 112")
    args = parser.parse_args(argv)
    model_dir = build_speaking_target(TARGETS[args.corpus], args.out_dir)
    print(json.dumps({k: v for k, v in target_metrics(model_dir).items() if k != "recipe"}, indent=2))
    print(model_dir)


if __name__ == "__main__":
    main()
