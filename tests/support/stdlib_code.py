"""Long answers that every machine has: the standard library's function bodies, asked for by signature and docstring.

The long-answer speaking target (`tests.support.speaking_target.CODE_TARGET`) learns to answer

    Write the body of `textwrap.TextWrapper.wrap`:

    def wrap(self, text):
        \"\"\"wrap(text : string) -> [string]\"\"\"

with that function's own body (its source lines, indented as under the `def`). The docstring targets' answers
are 7-9 tokens, one or two drafts; a body is about 110 tokens (`MIN_BODY_CHARS`..`MAX_BODY_CHARS`), many
16-token blocks, which is what a block drafter is for. The text is the Python Software Foundation's, read from
the running interpreter's `stdlib` folder with `ast` (nothing is imported or executed); the split rule and the
files read are `tests.support.stdlib_corpus`'s, so a name held out of one corpus is held out of the other.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

from tests.support.stdlib_corpus import Split, module_files, split_of, stdlib_root

DESCRIPTION = "Python standard library function bodies (Python Software Foundation License)"
# A body of 256-1024 characters is about 35-330 Qwen tokens, 112 on average (code packs about 3 characters
# per token; runs of spaces are one token): long enough for many drafted blocks, short enough that a 2-core
# build trains on each a few times.
MIN_BODY_CHARS = 256
MAX_BODY_CHARS = 1024
# The codecs of `encodings` are generated: 100 copies of the same few bodies would teach a table, not code.
GENERATED_PACKAGES = ("encodings.",)
# A docstring's first paragraph says what the body does; more of it would make the prompt longer than the answer.
MAX_SUMMARY_CHARS = 240


@dataclass(frozen=True)
class CodePair:
    """One function of the standard library: its `def` line and docstring summary, and its body."""

    name: str  # module and qualified name, e.g. "textwrap.TextWrapper.wrap"
    header: str  # "def wrap(self, text):" plus the docstring summary as the body's first line, if it has one
    answer: str  # the body, indented by 4 spaces as under the def

    @property
    def question(self) -> str:
        return f"Write the body of `{self.name}`:\n\n{self.header}"

    @property
    def split(self) -> Split:
        return split_of(self.name)


def _summary(doc: str) -> str | None:
    """The docstring's first paragraph on one line, or None when it is too long to be a summary."""
    first = " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())
    return first if first and len(first) <= MAX_SUMMARY_CHARS and '"""' not in first else None


def _body(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef, has_doc: bool) -> str | None:
    """The body's source under the def, re-indented to 4 spaces; None where a line sits left of the body (a
    string literal's continuation) or uses tabs, or the body is outside the length band."""
    statements = node.body[1:] if has_doc else node.body
    if not statements or node.end_lineno is None:
        return None
    indent = " " * (node.col_offset + 4)
    body = lines[statements[0].lineno - 1 : node.end_lineno]
    if any("\t" in line or line.strip() and not line.startswith(indent) for line in body):
        return None
    text = "\n".join("    " + line[len(indent):] if line.strip() else "" for line in body)
    return text if MIN_BODY_CHARS <= len(text) <= MAX_BODY_CHARS else None


def _pair(qualname: str, lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> CodePair | None:
    doc = ast.get_docstring(node)
    body = _body(lines, node, has_doc=doc is not None)
    if body is None:
        return None
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    header = f"{keyword} {node.name}({ast.unparse(node.args)}):"
    summary = _summary(doc) if doc else None
    if summary:
        header += f'\n    """{summary}"""'
    return CodePair(qualname, header, body)


def _functions(prefix: str, scope: list[ast.stmt]) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Functions of a module and of its classes (nested classes too), not closures inside functions."""
    for node in scope:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # Dunder methods other than __init__ are mostly one-line protocol glue.
            if not node.name.startswith("__") or node.name == "__init__":
                yield f"{prefix}.{node.name}", node
        elif isinstance(node, ast.ClassDef):
            yield from _functions(f"{prefix}.{node.name}", node.body)


@functools.cache
def code_pairs() -> tuple[CodePair, ...]:
    """Every pair, sorted by name; the same interpreter gives the same tuple."""
    seen: dict[str, CodePair] = {}
    for module, path in module_files(stdlib_root()):
        if module.startswith(GENERATED_PACKAGES):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source, filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a few stdlib files are templates or latin-1
            continue
        lines = source.splitlines()
        for qualname, node in _functions(module, tree.body):
            pair = _pair(qualname, lines, node)
            if pair is not None:
                seen.setdefault(pair.name, pair)  # a name defined twice (platform branches): the first
    return tuple(sorted(seen.values(), key=lambda p: p.name))


def split_pairs(split: Split) -> list[CodePair]:
    return [pair for pair in code_pairs() if pair.split == split]


def corpus_digest() -> str:
    """A digest of the exact pairs and their splits: part of the long-answer target's cache key."""
    h = hashlib.sha256()
    for pair in code_pairs():
        h.update(f"{pair.name}\0{pair.header}\0{pair.answer}\0{pair.split}\n".encode())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    pairs = code_pairs()
    held = split_pairs("heldout")
    chars = sum(len(p.answer) for p in pairs)
    print(f"{len(pairs)} pairs ({len(held)} held out, {chars / len(pairs):.0f} body characters on average) from "
          f"{stdlib_root()}, digest {corpus_digest()}")
    for pair in pairs[:: max(1, len(pairs) // 3)]:
        print(f"[{pair.split}] {pair.question}\n{pair.answer}\n")


if __name__ == "__main__":
    main()

