#!/bin/sh
# Default command of the generator image: run the stage, which checks the node first (engine imports, GPUs,
# /dev/shm, disk, S3 access, prompts manifest, model files: the list `preflight` runs alone); it reads
# DFLASH_GENERATE_* variables. `import`, `preflight`, `run` or `serve-check` as the first argument runs only
# that command. exec hands the process to the stage so that SIGTERM from the orchestrator reaches it directly.
set -eu
# With DFLASH_LOG_PREFIX set (every stage Job sets it), this script runs once more under dflash_shared.pod_log,
# which passes the output through, keeps a copy in the store (<run>/logs/<stage>/<pod>.log) and passes SIGTERM on.
if [ -n "${DFLASH_LOG_PREFIX:-}" ] && [ -z "${DFLASH_POD_LOG:-}" ]; then
  exec python -m dflash_shared.pod_log -- "$0" "$@"
fi
case "${1:-}" in
  import|preflight|run|serve-check) exec dflash-generate "$@" ;;
esac
exec dflash-generate run "$@"
