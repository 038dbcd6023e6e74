"""Inputs of a train-stage run, made the way the pipeline makes them: a tiny target and tokenized data.

- `train_python()`: the train environment's interpreter (.venv-train, with torch), or a skip;
- `tiny_target_dir()`: the tiny random Qwen3 target with the real Qwen3 vocabulary, built once by
  tests/support/tiny_target.py in that environment (building it needs torch; this one does not);
- `upload_dir(store, local, prefix)`: a local directory copied under an S3 prefix;
- `tokenized_for(store, root, target_dir)`: completions written as the generate stage writes them, then
  the tokenize stage itself run on them with the target's tokenizer, so the tokenized manifest carries
  the target's tokenizer and chat template hashes that the train stage insists on.

Used by the train Job emulation (tests/pipeline) and the trainer image test (tests/images).
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest

from dflash_shared.storage import ObjectStore, join
from dflash_tokenize.config import TokenizeConfig
from dflash_tokenize.stage import run as run_tokenize
from tests.tokenize.stage_fixtures import completion, conversation, write_completions

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_VENV = REPO_ROOT / ".venv-train"
# Enough packed tokens for a few debug-preset steps (1,024 tokens a step) without a long tokenize run.
RECORDS = 32


def train_python() -> Path:
    python = TRAIN_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{TRAIN_VENV} is missing: `make venv-train` builds the train environment (torch on CPU)")
    return python


@functools.cache
def tiny_target_dir() -> Path:
    """The cached tiny target directory (config, bf16 weights, tokenizer, chat template)."""
    code = "from tests.support.tiny_target import build_tiny_qwen3; print(build_tiny_qwen3())"
    done = subprocess.run([str(train_python()), "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, f"building the tiny target failed:\n{done.stderr[-4000:]}"
    return Path(done.stdout.strip().splitlines()[-1])


def upload_dir(store: ObjectStore, local: Path, prefix: str) -> str:
    for path in sorted(p for p in local.iterdir() if p.is_file() and not p.name.startswith(".")):
        store.upload_from(str(path), join(prefix, path.name))
    return prefix


def tokenized_for(store: ObjectStore, root: str, target_dir: Path, records: int = RECORDS) -> str:
    """A tokenized prefix under `root`, made by the tokenize stage from thinking-mode completions."""
    completions = write_completions(store, join(root, "completions"),
                                    [completion(conversation(i)) for i in range(records)])
    output = join(root, "tokenized")
    # No held-out split: the train-stage tests need every record's tokens for their steps.
    run_tokenize(TokenizeConfig(input=completions, output=output, tokenizer=str(target_dir), workers=1,
                                num_shards=1, heldout_fraction=0), store)
    return output
