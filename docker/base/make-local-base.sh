#!/usr/bin/env bash
# Builds a local stand-in for the python:3.11-slim-bookworm base image when no container
# registry can be reached: a minimal Debian bookworm root filesystem (debootstrap) with Debian's
# python3 (3.11, the same minor as the official image), python3-venv and the CA certificates,
# imported as a single-layer image.
#
# Usage: docker/base/make-local-base.sh [IMAGE_REF]
#   IMAGE_REF        default localhost/dflash-base:bookworm-py311
# Environment:
#   ENGINE           podman (default) or docker: which engine imports the root filesystem
#   DEBIAN_MIRROR    optional mirror URL for debootstrap (debootstrap's default otherwise)
#   DFLASH_IMAGE_BUILD_DIR  scratch folder for the root filesystem (default <repo>/build/images)
#   FORCE=1          rebuild even when the image already exists
set -euo pipefail

REF="${1:-localhost/dflash-base:bookworm-py311}"
ENGINE="${ENGINE:-podman}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD_DIR="${DFLASH_IMAGE_BUILD_DIR:-$ROOT/build/images}"
SUITE="bookworm"
PACKAGES="python3,python3-venv,ca-certificates"

log() { printf 'make-local-base: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

image_exists() {
  if [[ "$ENGINE" == "podman" ]]; then
    podman image exists "$REF"
  else
    docker image inspect "$REF" >/dev/null 2>&1
  fi
}

if [[ "${FORCE:-0}" != "1" ]] && image_exists; then
  log "$REF already exists (cached; FORCE=1 rebuilds)"
  exit 0
fi

command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
[[ "$(id -u)" == "0" ]] || die "debootstrap needs root to build $REF"

mkdir -p "$BUILD_DIR"
ROOTFS="$(mktemp -d "$BUILD_DIR/base-rootfs.XXXXXX")"
# The root filesystem is only a staging area: remove it whatever happens.
trap 'rm -rf "$ROOTFS"' EXIT

start=$(date +%s)
log "debootstrap --variant=minbase $SUITE ($PACKAGES) -> $ROOTFS"
mirror_args=()
if [[ -n "${DEBIAN_MIRROR:-}" ]]; then mirror_args=("$DEBIAN_MIRROR"); fi
if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "${mirror_args[@]}" \
    >"$BUILD_DIR/base-debootstrap.log" 2>&1; then
  tail -n 30 "$BUILD_DIR/base-debootstrap.log" >&2 || true
  die "debootstrap of $SUITE failed (full log: $BUILD_DIR/base-debootstrap.log)"
fi

# Package caches and lists are not needed at run time and only grow the image.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
  "$ROOTFS"/var/log/*.log "$ROOTFS"/tmp/*

py_version="$(chroot "$ROOTFS" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[[ "$py_version" == "3.11" ]] || die "debootstrapped python3 is $py_version, expected 3.11"

changes=(
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
  --change 'ENV LANG=C.UTF-8'
  --change 'CMD ["/bin/bash"]'
)
log "importing $ROOTFS as $REF ($ENGINE)"
quiet=()
if [[ "$ENGINE" == "podman" ]]; then quiet=(--quiet); fi
tar --numeric-owner -C "$ROOTFS" -c . | "$ENGINE" import "${quiet[@]}" "${changes[@]}" - "$REF" >/dev/null \
  || die "$ENGINE import of $REF failed"
log "built $REF (python $py_version) in $(( $(date +%s) - start )) s"
