"""Fixtures of the tokenize tests: each tokenizer directory is parsed once per session.

Parsing a real Qwen tokenizer.json takes most of a second (the Qwen3.6 vocabulary about twice that), and these
tests load the same few directories well over a hundred times, through the stage's own `ChatFormat.from_dir`.
For the session that call keeps the first parse of a directory, keyed by its path and the bytes of its files (a
test that writes into a directory gets a fresh parse), and hands out a copy as a new parse would leave it: the
lazily built byte-length table dropped, so each test picks its encoding path as it would on its own. The copies
share the parsed tokenizer and its lock, as threads share one ChatFormat in the stage. Worker processes the
stage spawns parse for themselves.
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_tokenize.chat import ChatFormat
from tests.support.qwen_assets import shared_tokenizer_dir

# A parsed Qwen3.6 tokenizer holds a few hundred MB; the suite uses about this many directories at a time.
_KEEP = 6


@pytest.fixture(scope="session", autouse=True)
def _tokenizers_parsed_once() -> Iterator[None]:
    parse = ChatFormat.from_dir.__func__  # type: ignore[attr-defined]
    parsed: OrderedDict[tuple[str, str, str], ChatFormat] = OrderedDict()

    def from_dir(cls: type[ChatFormat], directory: str | Path, **kwargs: Any) -> ChatFormat:
        path = Path(directory)
        try:
            files = sorted(p for p in path.iterdir() if p.is_file())
            digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()
        except OSError:  # a missing or unreadable directory: the real call says what is wrong
            return parse(cls, directory, **kwargs)  # type: ignore[no-any-return]
        key = (str(path), digest, repr(sorted(kwargs.items())))
        if key not in parsed:
            parsed[key] = parse(cls, directory, **kwargs)
            while len(parsed) > _KEEP:
                parsed.popitem(last=False)
        parsed.move_to_end(key)
        fresh = copy.copy(parsed[key])
        fresh.__dict__.pop("token_byte_lengths", None)
        return fresh

    mp = pytest.MonkeyPatch()
    mp.setattr(ChatFormat, "from_dir", classmethod(from_dir))
    try:
        yield
    finally:
        mp.undo()


# The real Qwen3 vocabulary and chat template most stage tests use (a module may define its own instead).
@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return shared_tokenizer_dir("qwen3")


@pytest.fixture(scope="module")
def chat(tok_dir: Path) -> ChatFormat:
    return ChatFormat.from_dir(tok_dir)
