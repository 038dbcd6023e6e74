#!/usr/bin/env bash
# Run every test suite, each in the environment of the code it tests, and fail if any failed.
#
# The torch-free suites (shared library, tokenize, pipeline, images) run in .venv; the generate stage's in
# .venv-generate (vLLM on CPU); the train stage's in .venv-train (PyTorch on CPU); evaluation, which needs
# the drafter and vLLM together, in .venv-generate. Every suite runs even
# after another failed, so one report shows everything that is broken.
set -uo pipefail
cd "$(dirname "$0")/.."

# Tests marked `extended` repeat a covered path at a large cost (the dense target's end-to-end run): left out
# unless DFLASH_TESTS=all (`make test-all`), so the default suite, which CI runs, stays well inside its time.
# A -m given on the command line comes later and wins. Tests marked `gpu` skip where torch sees no CUDA device;
# on a GPU machine `scripts/run-tests.sh -m gpu` runs only them (the .venv-generate suites have a CUDA build of
# torch; .venv-train's CPU build skips its own, naming why).
marks=()
[ "${DFLASH_TESTS:-default}" = all ] || marks=(-m "not extended")

status=0
run_suite() {
  local name=$1 python=$2 rc; shift 2
  echo "=== ${name} ($python) ==="
  "$python" -m pytest "${marks[@]}" "$@"
  rc=$?
  # 5: the -m matched no test of this suite (-m gpu in the torch-free one), which is not a failure.
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || { echo "=== ${name}: FAILED ==="; status=1; }
}

run_suite "shared, tokenize, pipeline, images" .venv/bin/python --ignore=tests/generate --ignore=tests/train \
  --ignore=tests/evaluate "$@"
[ -d tests/generate ] && run_suite "generate" .venv-generate/bin/python tests/generate "$@"
[ -d tests/train ] && run_suite "train" .venv-train/bin/python tests/train "$@"
# Evaluation needs the trainer's drafter and vLLM together: .venv-generate holds both.
[ -d tests/evaluate ] && run_suite "evaluate" .venv-generate/bin/python tests/evaluate "$@"
exit $status
