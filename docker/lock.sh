#!/usr/bin/env bash
# Regenerates every stage's hashed lock files: jobs/<stage>/requirements*.in -> requirements*.lock.
# The locks target the images' platform (CPython 3.11, x86_64 manylinux_2_28), not the host's.
#
# Usage: docker/lock.sh [STAGE...]     (default: every jobs/*/requirements*.in)
# An input may come with X.overrides and X.excludes beside X.in (passed to uv as --overrides / --excludes):
# replacements for a dependency's own pins, and dependencies to leave out.
# Environment: UV=/path/to/uv to pick a uv binary; extra arguments for uv in UV_COMPILE_ARGS
#              (e.g. UV_COMPILE_ARGS=--upgrade).
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

# A stage may have several inputs (e.g. requirements.in and requirements-cpu.in for two image
# flavours): each requirements*.in gets the .lock of the same name beside it.
ins=()
if [[ $# -eq 0 ]]; then
  for f in jobs/*/requirements*.in; do [[ -e "$f" ]] && ins+=("$f"); done
else
  for stage in "$@"; do
    found=0
    for f in "jobs/$stage"/requirements*.in; do [[ -e "$f" ]] && { ins+=("$f"); found=1; }; done
    [[ $found == 1 ]] || { echo "lock: stage '$stage' has no jobs/$stage/requirements*.in" >&2; exit 1; }
  done
fi
[[ ${#ins[@]} -gt 0 ]] || { echo "lock: no jobs/*/requirements*.in found" >&2; exit 1; }

for in in "${ins[@]}"; do
  out="${in%.in}.lock"
  adjust=()
  [[ -f "${in%.in}.overrides" ]] && adjust+=(--overrides "${in%.in}.overrides")
  [[ -f "${in%.in}.excludes" ]] && adjust+=(--excludes "${in%.in}.excludes")
  # shellcheck disable=SC2086  # UV_COMPILE_ARGS is a list of flags on purpose
  if ! "$UV" pip compile --quiet --generate-hashes --python-version 3.11 \
      --python-platform x86_64-manylinux_2_28 --custom-compile-command docker/lock.sh \
      "${adjust[@]}" ${UV_COMPILE_ARGS:-} "$in" -o "$out"; then
    echo "lock: FAILED for $in" >&2
    exit 1
  fi
  echo "lock: $in -> $out ($(grep -c '^[a-z0-9]' "$out") packages)"
done
