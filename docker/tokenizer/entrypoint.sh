#!/bin/sh
# Default command of the tokenizer image: check the environment (credentials, input manifest,
# output prefix, tokenizer) first, then run the stage. Both read their configuration from
# DFLASH_* environment variables; extra arguments are passed to both. exec hands PID 1 to the
# stage so that SIGTERM from the orchestrator reaches it directly.
set -eu
dflash-tokenize preflight "$@"
exec dflash-tokenize run "$@"
