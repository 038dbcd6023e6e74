#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Build the train-stage environment (.venv-train) from its lock, requirements/train.lock: the CPU build of torch,
# transformers, the test packages; then the shared library, the train package and the tokenize package (its tests
# reuse the tokenizer), editable.
# Usage: scripts/venv-train.sh [--recreate]   (VENV=path overrides the location; see venv-common.sh)
set -euo pipefail
# shellcheck source=venv-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv-common.sh"

NAME=venv-train
VENV="${VENV:-$ROOT/.venv-train}"
INPUTS=(
  "$ROOT/scripts/venv-train.sh"
  "$ROOT/requirements/train.lock"
  "$ROOT/requirements/train.in"
  "$ROOT/jobs/train/pyproject.toml"
  "$ROOT/jobs/tokenize/pyproject.toml"
  "$ROOT/shared/pyproject.toml"
)
venv_begin "$@"

# torch is the lock's torch==2.13.0+cpu: only the CPU wheel has that version and its hash.
venv_install_locked "$ROOT/requirements/train.lock" "$ROOT/requirements/train.in"
"${pip[@]}" check

# Fail here, not in the first test, if torch is a CUDA build or the packages cannot be imported.
"$VENV/bin/python" -c "import torch, transformers, moto, dflash_train, dflash_tokenize; \
assert not torch.version.cuda, torch.__version__; \
print('venv-train: torch', torch.__version__, 'transformers', transformers.__version__, 'moto', moto.__version__)"

venv_finish
