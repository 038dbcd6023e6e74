"""Real text that every machine has: the docstrings of the Python standard library, as question/answer pairs.

The speaking target (`tests.support.speaking_target`) learns to answer "What does `json.dumps(obj, *,
skipkeys=False, ...)` do?" with the leading prose paragraphs of that function's docstring. The text is the standard
library's own documentation (Python Software Foundation License), read from the running interpreter's
`stdlib` folder with `ast` (nothing is imported or executed), so no download is needed and the same Python
gives the same pairs; `corpus_digest()` names the exact text for cache keys.

Each pair has a stable `split`: "train" (what the target learns) or "heldout" (about 1 in 8, by a hash of
the name: the target's held-out perplexity, and the prompts a drafter is measured on, are text the target
never saw).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DESCRIPTION = "Python standard library docstrings (Python Software Foundation License)"
# Test suites, the IDLE GUI, the retired 2to3 and vendored packages are not the library's own API docs.
_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip",
                        "turtledemo", "__pycache__", "tkinter", "pydoc_data"})
# An answer is the docstring's leading prose, at most this many characters: long enough to say something (and
# for a drafter to draft several blocks of), short enough that a 2-core training run sees each pair a few times.
MIN_ANSWER_CHARS = 24
MAX_ANSWER_CHARS = 640
# 1 in HELDOUT_EVERY names (by hash) is held out of the target's training.
HELDOUT_EVERY = 8

Split = Literal["train", "heldout"]


@dataclass(frozen=True)
class DocPair:
    """One documented standard-library name: the question about it and its docstring's prose."""

    name: str  # dotted, e.g. "json.dumps" or "collections.OrderedDict.move_to_end"
    signature: str  # "(obj, *, skipkeys=False)"; "" for classes without an __init__ of their own
    answer: str

    @property
    def question(self) -> str:
        return f"What does `{self.name}{self.signature}` do?"

    @property
    def split(self) -> Split:
        return split_of(self.name)


def split_of(name: str) -> Split:
    """A name's split, by its hash: the same in every corpus read from the library."""
    digest = hashlib.sha256(name.encode()).digest()
    return "heldout" if digest[0] % HELDOUT_EVERY == 0 else "train"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_files(root: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _SKIP_DIRS or part.startswith(("_", ".")) and part != "__init__.py" for part in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            yield ".".join(parts), path


def _prose(paragraph: str) -> str | None:
    """A paragraph as one line of prose, or None for code, doctests, reST directives, tables and signatures."""
    lines = paragraph.splitlines()
    if not lines or any(line.startswith((" ", "\t", ">>>")) for line in lines):
        return None
    text = " ".join(line.strip() for line in lines)
    if not text[0].isalpha() or text.startswith(("..", "(")) or "---" in text or "===" in text:
        return None
    return text


def _answer(doc: str) -> str | None:
    """The docstring's leading prose paragraphs, up to MAX_ANSWER_CHARS; None when the first is not prose."""
    kept: list[str] = []
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        text = _prose(paragraph.strip("\n"))
        if text is None or len(" ".join([*kept, text])) > MAX_ANSWER_CHARS:
            break
        kept.append(text)
    answer = " ".join(kept)
    return answer if len(answer) >= MIN_ANSWER_CHARS else None


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    return f"({args})" if len(args) <= 80 else "(...)"


def _pairs_of(module: str, tree: ast.Module) -> Iterator[DocPair]:
    yield from _pair(module, "", tree)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield from _pair(f"{module}.{node.name}", _signature(node), node)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from _pair(f"{module}.{node.name}", "", node)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    yield from _pair(f"{module}.{node.name}.{item.name}", _signature(item), item)


def _pair(name: str, signature: str, node: ast.AST) -> Iterator[DocPair]:
    doc = ast.get_docstring(node, clean=False)  # type: ignore[arg-type]
    answer = _answer(doc) if doc else None
    if answer:
        yield DocPair(name, signature.replace("self, ", "").replace("(self)", "()"), answer)


@functools.cache
def doc_pairs() -> tuple[DocPair, ...]:
    """Every pair, sorted by name; the same interpreter gives the same tuple."""
    seen: dict[str, DocPair] = {}
    for module, path in module_files(stdlib_root()):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a few stdlib files are templates or latin-1
            continue
        for pair in _pairs_of(module, tree):
            seen.setdefault(pair.name, pair)
    return tuple(sorted(seen.values(), key=lambda p: p.name))


def split_pairs(split: Split) -> list[DocPair]:
    return [pair for pair in doc_pairs() if pair.split == split]


def corpus_digest() -> str:
    """A digest of the exact pairs and their splits (they differ between Python versions): part of every cache
    key, so a change of the extraction or the split rebuilds what was trained on the corpus."""
    h = hashlib.sha256()
    for pair in doc_pairs():
        h.update(f"{pair.name}\0{pair.signature}\0{pair.answer}\0{pair.split}\n".encode())
    return h.hexdigest()[:16]


def write_prompts(path: Path, split: Split | None = None) -> int:
    """A prompts JSONL file (one user turn per record) of the split's questions (None: all); returns the count."""
    import json

    pairs = doc_pairs() if split is None else split_pairs(split)
    lines = [json.dumps({"messages": [{"role": "user", "content": pair.question}], "topic": "stdlib"})
             for pair in pairs]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-prompts", type=Path, default=None,
                        help="write the questions as a prompts JSONL file here")
    parser.add_argument("--split", choices=["train", "heldout"], default=None, help="only this split's questions")
    args = parser.parse_args(argv)
    if args.write_prompts is not None:
        print(f"{write_prompts(args.write_prompts, args.split)} prompts -> {args.write_prompts}")
        return
    pairs = doc_pairs()
    held = split_pairs("heldout")
    print(f"{len(pairs)} pairs ({len(held)} held out) from {stdlib_root()}, digest {corpus_digest()}")
    for pair in pairs[:: max(1, len(pairs) // 5)]:
        print(f"  [{pair.split}] {pair.question}\n    {pair.answer}")


if __name__ == "__main__":
    main()
