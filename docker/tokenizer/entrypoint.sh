#!/bin/sh
# Default command of the tokenizer image: run the stage, which checks the environment first (credentials,
# input manifest, output prefix, tokenizer: the list `preflight` runs alone). It reads its configuration from
# DFLASH_* environment variables and extra arguments. `import`, `preflight` or `run` as the first argument
# runs only that command. exec hands the process to the stage so that SIGTERM
# from the orchestrator reaches it directly.
set -eu
# With DFLASH_LOG_PREFIX set (every stage Job sets it), this script runs once more under dflash_shared.pod_log,
# which passes the output through, keeps a copy in the store (<run>/logs/<stage>/<pod>.log) and passes SIGTERM on.
if [ -n "${DFLASH_LOG_PREFIX:-}" ] && [ -z "${DFLASH_POD_LOG:-}" ]; then
  exec python -m dflash_shared.pod_log -- "$0" "$@"
fi
case "${1:-}" in
  import|preflight|run) exec dflash-tokenize "$@" ;;
esac
exec dflash-tokenize run "$@"
