#!/usr/bin/env bash
# Run every test suite, each in the environment of the code it tests, and fail if any failed.
#
# The torch-free suites (shared library, tokenize, pipeline, images) run in .venv; the generate stage's in
# .venv-generate (vLLM on CPU); the train stage's in .venv-train (PyTorch on CPU); evaluation, which needs
# the drafter and vLLM together, in .venv-generate. Every suite runs even after another failed, so one report
# shows everything that is broken; each suite's wall time is printed at the end.
#
# Two lanes run side by side (DFLASH_TEST_LANES=1 runs them one after the other): much of every suite waits
# on something other than its own core (image builds on the network and disk, engine start-ups, subprocesses,
# the moto server), so two lanes on two cores take far less than their sum. A lane's suites run in order and
# its output goes to build/test-logs/<suite>.log, printed whole when the suite ends, so lines never interleave.
# The fixtures' caches (tiny targets, tokenizers, the speaking target) are shared between lanes: they are built
# beside their place and renamed into it (tests/support/tiny_target.py), so two lanes never see half a build.
set -uo pipefail
cd "$(dirname "$0")/.."

# Tests marked `extended` repeat a covered path at a large cost (the dense target's end-to-end run): left out
# unless DFLASH_TESTS=all (`make test-all`), so the default suite, which CI runs, stays well inside its time.
# A -m given on the command line comes later and wins. Tests marked `gpu` skip where torch sees no CUDA device;
# on a GPU machine `scripts/run-tests.sh -m gpu` runs only them (the .venv-generate suites have a CUDA build of
# torch; .venv-train's CPU build skips its own, naming why).
marks=()
[ "${DFLASH_TESTS:-default}" = all ] || marks=(-m "not extended")
logs=build/test-logs
mkdir -p "$logs"
rm -f "$logs"/*.log "$logs"/*.result

# run_suite NAME PYTHON PYTEST-ARGS...: one suite, its log and its result line ("<name> <rc> <seconds>").
run_suite() {
  local name=$1 python=$2 rc began; shift 2
  began=$(date +%s)
  {
    echo "=== ${name} ($python) ==="
    # --durations: the slowest tests name themselves in every CI log, so time is found before it runs out.
    "$python" -m pytest "${marks[@]}" --durations=15 "$@"
  } >"$logs/$name.log" 2>&1
  rc=$?
  cat "$logs/$name.log"
  echo "$name $rc $(( $(date +%s) - began ))" >"$logs/$name.result"
}

# The lanes, balanced by the suites' wall times in CI's log (the torch-free suite and train about as long as
# generate and evaluate together).
lane_torch_free_and_train() {
  run_suite torch-free .venv/bin/python --ignore=tests/generate --ignore=tests/train --ignore=tests/evaluate "$@"
  [ -d tests/train ] && run_suite train .venv-train/bin/python tests/train "$@"
}
lane_engines() {
  [ -d tests/generate ] && run_suite generate .venv-generate/bin/python tests/generate "$@"
  # Evaluation needs the trainer's drafter and vLLM together: .venv-generate holds both.
  [ -d tests/evaluate ] && run_suite evaluate .venv-generate/bin/python tests/evaluate "$@"
}

began=$(date +%s)
if [ "${DFLASH_TEST_LANES:-2}" = 1 ]; then
  lane_torch_free_and_train "$@"
  lane_engines "$@"
else
  lane_torch_free_and_train "$@" &
  first=$!
  lane_engines "$@" &
  second=$!
  # The suites stop with the script: an interrupted run leaves no pytest behind.
  trap 'kill "$first" "$second" 2>/dev/null' INT TERM
  wait "$first" "$second"
fi

status=0
# A suite whose lane died before it ended has no result: that is a failure, not a pass.
for suite in torch-free train generate evaluate; do
  if [ "$suite" = torch-free ] || [ -d "tests/$suite" ]; then
    [ -e "$logs/$suite.result" ] || { echo "$suite 1 0" >"$logs/$suite.result"; echo "=== $suite: no result ==="; }
  fi
done
echo "=== wall time per suite (seconds; lanes side by side: ${DFLASH_TEST_LANES:-2}) ==="
for result in "$logs"/*.result; do
  [ -e "$result" ] || continue
  read -r name rc seconds <"$result"
  # 5: the -m matched no test of this suite (-m gpu in the torch-free one), which is not a failure.
  if [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]; then verdict=passed; else verdict="FAILED (exit $rc)"; status=1; fi
  printf '  %-12s %6d  %s\n' "$name" "$seconds" "$verdict"
done
printf '  %-12s %6d\n' total "$(( $(date +%s) - began ))"
exit $status
