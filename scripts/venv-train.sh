#!/usr/bin/env bash
# Build the train-stage environment (.venv-train): the CPU build of torch, transformers, the shared library,
# the train package (editable), the tokenize package (its tests reuse the tokenizer) and the test packages.
#
# Plain `python -m venv` + pip on purpose: pip resolves torch==2.13.0 to the CPU wheel (from the configured
# find-links or an index given in TORCH_INDEX_URL), where other resolvers pick a CUDA build. Idempotent: a
# stamp holding the hash of every input skips a rebuild when nothing changed.
# Usage: scripts/venv-train.sh [--recreate]   (VENV=path overrides the location)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-train}"
PYTHON="${PYTHON:-python3.11}"
STAMP="$VENV/.dflash-inputs.sha256"
INPUTS=(
  "$ROOT/scripts/venv-train.sh"
  "$ROOT/jobs/train/requirements-cpu.in"
  "$ROOT/jobs/train/requirements-test.in"
  "$ROOT/jobs/train/pyproject.toml"
  "$ROOT/jobs/tokenize/pyproject.toml"
  "$ROOT/shared/pyproject.toml"
)

want="$( { "$PYTHON" --version 2>&1; cat "${INPUTS[@]}"; echo "${TORCH_INDEX_URL:-}"; } | sha256sum | cut -d' ' -f1)"

if [[ "${1:-}" == "--recreate" ]]; then
  rm -rf "$VENV"
elif [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
  echo "venv-train: $VENV is up to date"
  exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
rm -f "$STAMP"  # a failed run below must not leave a stamp that claims success
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
extra=()
[[ -n "${TORCH_INDEX_URL:-}" ]] && extra=(--extra-index-url "$TORCH_INDEX_URL")

"${pip[@]}" install -q --upgrade pip
# torch alone first, so that nothing installed after it can pull a CUDA build in its place.
"${pip[@]}" install -q "${extra[@]}" "$(grep -E '^torch==' "$ROOT/jobs/train/requirements-cpu.in")"
"${pip[@]}" install -q "${extra[@]}" -r "$ROOT/jobs/train/requirements-cpu.in"
"${pip[@]}" install -q -e "$ROOT/shared" -e "$ROOT/jobs/tokenize" -e "$ROOT/jobs/train" \
  -r "$ROOT/jobs/train/requirements-test.in"

# Fail here, not in the first test, if torch is a CUDA build or the packages cannot be imported.
"$VENV/bin/python" -c "import torch, transformers, dflash_train, dflash_tokenize; \
assert not torch.version.cuda, torch.__version__; \
print('venv-train: torch', torch.__version__, 'transformers', transformers.__version__)"

echo "$want" > "$STAMP"
echo "venv-train: built $VENV in $(( $(date +%s) - start )) s"
