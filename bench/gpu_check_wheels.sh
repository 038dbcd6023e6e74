#!/usr/bin/env bash
# Wheels that bench/gpu_check.py needs on a GPU machine whose image lacks them, downloaded into .whl/.
#
# The lent H200 machine has Python 3.12, torch 2.11 (CUDA 13), transformers 5.17 and triton 3.6 but no
# pydantic (dflash_train.drafter.config is a pydantic model) and no flash-linear-attention (the fast Gated
# DeltaNet kernels of the hybrid target), and it reaches no package index. These wheels travel with the
# working tree instead (a few MiB; the tree that travels is capped at 64 MiB) and install there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site
# Versions are the trainer image's (jobs/train/requirements.lock). fla-core 0.6.0 asks for torch >= 2.7 and
# triton >= 3.3, which the machine's torch 2.11 / triton 3.6 satisfy; typing-extensions is carried because
# pydantic 2.14 needs >= 4.16. --no-deps: every wheel is named, one version each (two stop the install).
#
# Usage (from the repository root; pip must reach the package index): bash bench/gpu_check_wheels.sh [DIR]
set -euo pipefail

cd "$(dirname "$0")/.."
dest="${1:-.whl}"
wheels=(
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  fla-core==0.6.0
  flash-linear-attention==0.6.0
)

# The wheel folder must not be committed, yet it must travel: an ignored path travels when named in carry.
if [ "$dest" = ".whl" ] && [ -d .git ] && ! grep -qx '/.whl/' .git/info/exclude 2>/dev/null; then
  mkdir -p .git/info
  echo '/.whl/' >>.git/info/exclude
fi
mkdir -p "$dest"
rm -f "$dest"/*.whl

# The device machine's interpreter and platform, not this one's.
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${wheels[@]}"

count=$(find "$dest" -maxdepth 1 -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#wheels[@]}" ]; then
  echo "expected ${#wheels[@]} wheels in $dest, found $count" >&2
  exit 69
fi
du -sh "$dest"
