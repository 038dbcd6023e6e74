"""The long-answer speaking target: its corpus is the standard library's function bodies (about 112 tokens each,
asked for by signature and docstring), its loop probe tells a loop from code, and the target itself, once built,
answers at length without looping and beats a unigram model on bodies it never saw."""

from __future__ import annotations

import pytest

from tests.support import speaking_target as st
from tests.support import stdlib_code, stdlib_corpus
from tests.support.unigram import unigram_heldout_loss

pytestmark = pytest.mark.slow


def test_the_corpus_is_function_bodies_under_their_signature_and_docstring() -> None:
    pairs = stdlib_code.code_pairs()
    assert len(pairs) > 2000
    assert len({p.name for p in pairs}) == len(pairs)
    assert all(stdlib_code.MIN_BODY_CHARS <= len(p.answer) <= stdlib_code.MAX_BODY_CHARS for p in pairs)
    assert all(line.startswith("    ") for p in pairs for line in p.answer.splitlines() if line)
    assert not any(p.name.startswith("encodings.cp") for p in pairs)  # the generated codec tables
    join = {p.name: p for p in pairs}["posixpath.join"]
    assert join.question.startswith("Write the body of `posixpath.join`:\n\ndef join(a, *p):\n"
                                    '    """Join two or more pathname components')
    assert join.answer.startswith("    a = os.fspath(a)\n    sep = _get_sep(a)\n")
    assert join.answer.endswith("    return path")
    held = stdlib_code.split_pairs("heldout")
    assert 0.08 < len(held) / len(pairs) < 0.18
    # One split rule for both corpora: a name held out of the docstring target is held out of this one.
    doc_split = {p.name: p.split for p in stdlib_corpus.doc_pairs()}
    assert all(doc_split.get(p.name, p.split) == p.split for p in pairs)
    assert stdlib_code.corpus_digest() == stdlib_code.corpus_digest()


def test_the_loop_probe_tells_a_loop_from_real_code() -> None:
    from transformers import AutoTokenizer

    from tests.support.qwen_assets import shared_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(shared_tokenizer_dir("qwen3"))
    real = [tokenizer(p.answer, add_special_tokens=False)["input_ids"][:256]
            for p in stdlib_code.split_pairs("heldout")[:48]]
    real_probe = st.repetition_probe(real)
    assert real_probe["mean_answer_tokens"] >= 64
    assert st.probe_failures(st.CODE_TARGET, real_probe) == []
    loop = [tokenizer("    self._x = self._x\n", add_special_tokens=False)["input_ids"] * 20 for _ in range(4)]
    failures = st.probe_failures(st.CODE_TARGET, st.repetition_probe(loop))
    assert len(failures) == 1 and failures[0].startswith("repeated 4-gram share 0.9"), failures
    # The docstring target's bound, on distinct tokens, is the one code would fail by nature: each target has its own.
    assert st.repetition_probe(real)["distinct_token_ratio"] < 0.7


@pytest.mark.extended  # builds the long-answer target: about half an hour of one core (bench-quality builds it too)
def test_the_long_answer_target_answers_at_length_without_looping_and_beats_a_unigram_model() -> None:
    from transformers import AutoTokenizer

    target = st.build_speaking_target(st.CODE_TARGET)
    metrics = st.target_metrics(target)
    assert metrics["mean_answer_tokens"] >= 64, metrics
    assert st.probe_failures(st.CODE_TARGET, metrics) == []
    unigram = unigram_heldout_loss(AutoTokenizer.from_pretrained(target), stdlib_code)
    assert metrics["heldout_loss"] < unigram - 1.0, (metrics["heldout_loss"], unigram)


@pytest.mark.parametrize("name", sorted(st.TARGETS))
def test_every_targets_corpus_has_what_the_build_reads(name: str) -> None:
    # The build reads these only after minutes of training: a corpus module without one of them failed there.
    corpus = st.TARGETS[name].corpus
    assert isinstance(corpus.DESCRIPTION, str) and corpus.DESCRIPTION
    assert corpus.split_pairs("heldout") and corpus.split_pairs("train")
    assert isinstance(corpus.corpus_digest(), str) and corpus.corpus_digest()
