"""The speaking target is a real language model: it does not loop, it beats a unigram model on text it never
saw, and the checkpoint vLLM loads is the model that was trained (the small-vocabulary loss is exact)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from tests.support import speaking_target as st
from tests.support import stdlib_corpus
from tests.support.qwen_assets import qwen_special_ids
from tests.support.unigram import unigram_heldout_loss

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def speaking() -> Path:
    return st.build_speaking_qwen3()  # cached: built once per recipe and corpus (minutes on 2 cores)


def test_the_corpus_is_the_standard_library_docs_and_its_split_is_stable() -> None:
    pairs = stdlib_corpus.doc_pairs()
    assert len(pairs) > 2000
    assert len({p.name for p in pairs}) == len(pairs)
    held = stdlib_corpus.split_pairs("heldout")
    assert 0.08 < len(held) / len(pairs) < 0.18  # 1 in 8 by hash
    by_name = {p.name: p for p in pairs}
    assert by_name["textwrap.dedent"].question == "What does `textwrap.dedent(text)` do?"
    assert by_name["textwrap.dedent"].answer.startswith("Remove any common leading whitespace from every line")
    assert by_name["json.dumps"].question == "What does `json.dumps(...)` do?"  # a long signature is elided
    assert by_name["json.dumps"].answer.startswith("Serialize ``obj`` to a JSON formatted ``str``.")
    assert stdlib_corpus.corpus_digest() == stdlib_corpus.corpus_digest()


def test_its_greedy_answers_do_not_loop_and_it_beats_a_unigram_model(speaking: Path) -> None:
    metrics = st.target_metrics(speaking)
    assert metrics["distinct_token_ratio"] >= st.MIN_DISTINCT_TOKEN_RATIO
    # A unigram model of the training answers: the floor any language model must clear on held-out text.
    from transformers import AutoTokenizer

    unigram = unigram_heldout_loss(AutoTokenizer.from_pretrained(speaking), stdlib_corpus)
    assert metrics["heldout_loss"] < unigram - 0.5, (metrics["heldout_loss"], unigram)


def test_a_looping_target_fails_the_threshold() -> None:
    from tests.support.tiny_target import build_tiny_qwen3

    random_target = build_tiny_qwen3()  # random weights: greedy decoding loops
    questions = [p.question for p in stdlib_corpus.split_pairs("heldout")[:6]]
    answers = st.probe_generations(random_target, questions, 48)
    ratio = sum(st.distinct_token_ratio(a) for a in answers) / len(answers)
    assert ratio < st.MIN_DISTINCT_TOKEN_RATIO, ratio


def test_the_saved_checkpoint_is_the_trained_model(speaking: Path) -> None:
    """The full-vocabulary loss of the saved model equals the training loss over the used rows plus the
    n_unused zero logits, so the rows left out of training cost nothing and change nothing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(speaking)
    model = AutoModelForCausalLM.from_pretrained(speaking, dtype=torch.float32).eval()
    embed = model.get_output_embeddings().weight  # the LM head: the rows training used, the rest zero
    zero_rows = int((embed.abs().sum(dim=1) == 0).sum())
    assert 100_000 < zero_rows < embed.shape[0]  # most of the 151,936 rows are unused, and exactly zero
    # The drafter's mask token: a non-zero input row (its MASK queries are not all zero), a zero head row.
    mask = qwen_special_ids("qwen3")["mask"]
    assert model.get_input_embeddings().weight[mask].abs().sum() > 0
    assert embed[mask].abs().sum() == 0
    pair = stdlib_corpus.split_pairs("heldout")[0]
    ids = st.chat_prompt_ids(tokenizer, pair.question) + tokenizer(pair.answer, add_special_tokens=False)["input_ids"]
    batch = torch.tensor([ids])
    with torch.no_grad():
        logits = model(batch).logits[0, :-1]
        full = torch.nn.functional.cross_entropy(logits, batch[0, 1:])
        used = (embed.abs().sum(dim=1) != 0).nonzero().squeeze(1)
        small = logits[:, used]
        unused = torch.full((small.shape[0], 1), math.log(embed.shape[0] - len(used)))
        lse = torch.logsumexp(torch.cat([small, unused], dim=-1), dim=-1)
        index = torch.full((embed.shape[0],), -1, dtype=torch.long)
        index[used] = torch.arange(len(used))
        exact = (lse - small.gather(-1, index[batch[0, 1:]][:, None]).squeeze(-1)).mean()
    assert abs(float(full) - float(exact)) < 1e-4


def test_the_cache_key_follows_the_recipe_and_the_target() -> None:
    docs = st.DOCS_TARGET
    assert st._cache_key(docs) == st._cache_key(docs)
    longer = dataclasses.replace(docs, recipe=dataclasses.replace(docs.recipe, steps=docs.recipe.steps + 1))
    assert st._cache_key(docs) != st._cache_key(longer)
    assert st._cache_key(docs) != st._cache_key(st.CODE_TARGET)


def test_a_wrong_thinking_mode_drops_the_label_agreement(speaking: Path) -> None:
    """The trainer's label agreement on a target that speaks: its greedy answers behind the prompt they were
    generated from (thinking off, as the pipeline renders it) are its own argmax; the same answers behind the
    thinking-on rendering of the same question (the tokenize stage's classic drift) are not."""
    import torch
    from transformers import AutoTokenizer

    from dflash_train.data.batch import pack_documents
    from dflash_train.drafter.config import DrafterConfig
    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.target_model.frozen import FrozenTarget
    from dflash_train.training.step import dflash_step
    from tests.support.step_recipe import step_recipe, step_runtime

    tokenizer = AutoTokenizer.from_pretrained(speaking)
    questions = [p.question for p in stdlib_corpus.split_pairs("heldout")[:4]]
    answers = st.probe_generations(speaking, questions, 24)

    def thinking_on(question: str) -> list[int]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                            add_generation_prompt=True, enable_thinking=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    cfg = DrafterConfig.debug(mask_token_id=qwen_special_ids("qwen3")["mask"], target_layer_ids=[1, 2],
                              num_target_layers=4)
    target = FrozenTarget.from_pretrained(speaking, cfg.target_layer_ids, keep_output=True)
    shares = {}
    for mode, render in (("as generated", lambda q: st.chat_prompt_ids(tokenizer, q)), ("thinking on", thinking_on)):
        docs = [(render(q) + a, [False] * len(render(q)) + [True] * len(a)) for q, a in zip(questions, answers,
                                                                                             strict=True)]
        out = dflash_step(DFlashDrafter(cfg), target, pack_documents(docs, 256), cfg,
                          step_recipe(label_agreement=True), step_runtime(), torch.Generator().manual_seed(0))
        shares[mode] = out.agreed / out.tokens
    assert shares["as generated"] >= 0.95, shares  # float32 both times: near-ties aside, exactly the argmax
    assert shares["thinking on"] < shares["as generated"] - 0.2, shares
