#!/bin/sh
# Default command of the generator image: check the node first (engine imports, GPUs, /dev/shm, disk,
# S3 access, prompts manifest, model files), then run the stage; both read DFLASH_GENERATE_* variables
# and get the same extra arguments. `import`, `preflight`, `run` or `serve-check` as the first argument
# runs only that command. exec hands PID 1 to the stage so that SIGTERM from the orchestrator reaches it directly.
set -eu
case "${1:-}" in
  import|preflight|run|serve-check) exec dflash-generate "$@" ;;
esac
dflash-generate preflight "$@"
exec dflash-generate run "$@"
