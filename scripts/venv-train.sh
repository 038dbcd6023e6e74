#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Build the train-stage environment (.venv-train): the CPU build of torch, transformers, the shared library,
# the train package (editable), the tokenize package (its tests reuse the tokenizer) and the test packages.
# Usage: scripts/venv-train.sh [--recreate]   (VENV=path overrides the location; see venv-common.sh)
set -euo pipefail
# shellcheck source=venv-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv-common.sh"

NAME=venv-train
VENV="${VENV:-$ROOT/.venv-train}"
INPUTS=(
  "$ROOT/scripts/venv-train.sh"
  "$ROOT/jobs/train/requirements-cpu.in"
  "$ROOT/jobs/train/requirements-test.in"
  "$ROOT/jobs/train/pyproject.toml"
  "$ROOT/jobs/tokenize/pyproject.toml"
  "$ROOT/shared/pyproject.toml"
)
venv_begin "$@"

# torch alone first, so that nothing installed after it can pull a CUDA build in its place.
"${pip[@]}" install -q "${extra[@]}" "$(grep -E '^torch==' "$ROOT/jobs/train/requirements-cpu.in")"
"${pip[@]}" install -q "${extra[@]}" -r "$ROOT/jobs/train/requirements-cpu.in"
"${pip[@]}" install -q -e "$ROOT/shared" -e "$ROOT/jobs/tokenize[stage]" -e "$ROOT/jobs/train[stage]" \
  -r "$ROOT/jobs/train/requirements-test.in"

# Fail here, not in the first test, if torch is a CUDA build or the packages cannot be imported.
"$VENV/bin/python" -c "import torch, transformers, dflash_train, dflash_tokenize; \
assert not torch.version.cuda, torch.__version__; \
print('venv-train: torch', torch.__version__, 'transformers', transformers.__version__)"

venv_finish
