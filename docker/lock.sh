#!/usr/bin/env bash
# Regenerates the project's hashed lock files (scripts/locks.py lists them and what each is made from):
#   images        jobs/<stage>/requirements*.in -> requirements*.lock beside it, every lock a docker/*/Dockerfile
#                 installs; they target the images' platform (CPython 3.11, x86_64 manylinux_2_28), not the host's.
#   environments  requirements/<env>.in -> requirements/<env>.lock: .venv (dev, every platform), .venv-train
#                 (train) and .venv-generate (generate), both x86_64 Linux. The images' locks come first: the
#                 generate environment is constrained to the CPU generator image's lock.
# Each lock's header records the hash of its inputs; `make check-locks` (and the test suite) fails on a lock whose
# inputs changed since. uv keeps the versions of an existing lock unless its inputs need others
# (UV_COMPILE_ARGS=--upgrade takes the newest allowed).
#
# Usage: docker/lock.sh [NAME...]     (default: all; NAME: a stage's image locks and the environment of that
#                                      name, e.g. generate, train, dev; `make lock LOCKS="..."`)
# An input may come with X.overrides and X.excludes beside X.in (passed to uv as --overrides / --excludes):
# replacements for a dependency's own pins, and dependencies to leave out.
# Environment: UV=/path/to/uv to pick a uv binary; extra arguments for uv in UV_COMPILE_ARGS
#              (e.g. UV_COMPILE_ARGS=--upgrade); PYTHON (default python3) runs scripts/locks.py.
#              The train environment's torch is the CPU wheel, which the package index does not have: uv looks
#              for it where pip would, in pip's find-links (PIP_FIND_LINKS, else pip's configuration) and in
#              TORCH_INDEX_URL (an index serving it, e.g. https://download.pytorch.org/whl/cpu).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

UV="${UV:-}"
if [[ -z "$UV" ]]; then
  if command -v uv >/dev/null; then UV="$(command -v uv)"
  elif [[ -x .venv/bin/uv ]]; then UV=.venv/bin/uv
  else echo "lock: uv not found (pip install uv, or set UV=/path/to/uv)" >&2; exit 1
  fi
fi
PYTHON="${PYTHON:-python3}"

plan="$("$PYTHON" scripts/locks.py plan "$@")"

# Where pip finds wheels that are on no index (the environments are installed with pip): uv reads no pip setting.
sources=()
links="${PIP_FIND_LINKS:-$("$PYTHON" -m pip config get global.find-links 2>/dev/null || true)}"
for link in $links; do sources+=(--find-links "$link"); done
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then sources+=(--extra-index-url "$TORCH_INDEX_URL"); fi

while IFS=$'\t' read -r -a fields; do
  in="${fields[0]}" out="${fields[1]}" flags=("${fields[@]:2}")
  extra=()
  [[ "$in" == requirements/* ]] && extra=("${sources[@]}")
  # shellcheck disable=SC2086  # UV_COMPILE_ARGS is a list of flags on purpose
  if ! "$UV" pip compile --quiet --generate-hashes --custom-compile-command docker/lock.sh \
      "${flags[@]}" "${extra[@]}" ${UV_COMPILE_ARGS:-} "$in" -o "$out"; then
    echo "lock: FAILED for $in" >&2
    exit 1
  fi
  # The hash of the inputs, under uv's two header lines: what `make check-locks` compares.
  header="$("$PYTHON" scripts/locks.py digest "$in")"
  { head -n 2 "$out"; echo "$header"; tail -n +3 "$out" | grep -v '^# inputs-sha256: '; } > "$out.tmp"
  mv "$out.tmp" "$out"
  echo "lock: $in -> $out ($(grep -c '^[a-z0-9]' "$out") packages)"
done <<< "$plan"
