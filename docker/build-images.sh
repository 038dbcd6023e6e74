#!/usr/bin/env bash
# Builds the stage images: every docker/<name>/Dockerfile, with the repository root as context.
#
# Usage: docker/build-images.sh [NAME...]      build all images, or only the named ones
#        docker/build-images.sh --ensure-tools install the container tools (apt) and exit
#        docker/build-images.sh --containers-conf
#                                              write the podman settings file, print its path
#        docker/build-images.sh --digests-json [NAME...]
#                                              build nothing: collect the <name>.digest files already in the
#                                              build folder into digests.json (CI merges its per-image jobs'
#                                              files so); fails when a named image has none
#
# Tags:  localhost/dflash-<name>:<git short sha> and :latest.
# Digests: each image's digest is recorded in $DFLASH_IMAGE_BUILD_DIR/digests.json (a run file's
#         images.digests_file), so rendered Jobs name the exact build, whatever a node has cached under a tag.
#         DFLASH_PUSH_TO=<registry>/<path> also pushes each image as <that>/dflash-<name>:<git short sha>
#         and records the digest the registry serves (without it: the local manifest digest, "pushed": false).
# Engine: docker when a daemon answers and buildx is present, podman otherwise (installed with
#         apt-get when missing and running as root). DFLASH_CONTAINER_ENGINE=docker|podman forces one.
# Base:  BASE_IMAGE, when set, is passed to every build. Otherwise each Dockerfile's default
#         (ARG BASE_IMAGE=...) is used if it is present or can be pulled; when no registry is
#         reachable a python:3.11-slim-bookworm default is replaced by a local debootstrap image of
#         the same Debian release and Python minor (docker/base/make-local-base.sh).
#         DFLASH_LOCAL_BASE=1 always uses the local base, =0 never does.
# Secret: the CA bundle named by PIP_CERT, REQUESTS_CA_BUNDLE or SSL_CERT_FILE (the first that is
#         a file) is passed as the build secret "cacert" for TLS-intercepting proxies; it is
#         mounted only while dependencies install and never stored in an image.
# Wheels: a Dockerfile that declares the "wheels" and "wheels-extra" stages (the CUDA images) gets up to two
#         local package indexes as those build contexts, so its GB of CUDA wheels install from disk where a
#         machine keeps them: the folders named in DFLASH_LOCAL_INDEXES (dir[:dir], each holding simple/; empty:
#         none), else the file://.../simple extra indexes of this machine's pip configuration (`pip config list`).
#         A --build-context in DFLASH_BUILD_EXTRA_ARGS replaces them. Wheels a local index lacks come from the
#         package index; every wheel is hash-checked against the lock either way.
# Other: DFLASH_IMAGE_BUILD_DIR (default <repo>/build/images) holds logs and containers.conf;
#         VERBOSE=1 streams build output instead of writing it only to the log;
#         DFLASH_BUILD_EXTRA_ARGS adds engine flags (e.g. "--no-cache").
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${DFLASH_IMAGE_BUILD_DIR:-$ROOT/build/images}"
PREFIX="localhost/dflash-"
LOCAL_BASE_REF="localhost/dflash-base:bookworm-py311"
TOOL_PACKAGES=(podman buildah runc fuse-overlayfs uidmap debootstrap)

log() { printf 'build-images: %s\n' "$*" >&2; }
die() { printf 'build-images: ERROR: %s\n' "$*" >&2; exit 1; }

# Installs the named Debian packages whose main binary is missing; a no-op when all are there.
ensure_packages() {
  local pkg bin missing=()
  for pkg in "$@"; do
    case "$pkg" in
      uidmap) bin=newuidmap ;;
      *) bin="$pkg" ;;
    esac
    command -v "$bin" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if [[ "$(id -u)" != "0" ]] || ! command -v apt-get >/dev/null 2>&1; then
    die "missing tools: ${missing[*]} (install them; automatic installation needs root and apt-get)"
  fi
  mkdir -p "$BUILD_DIR"
  log "installing ${missing[*]} with apt-get (log: $BUILD_DIR/apt.log)"
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"; } \
       >"$BUILD_DIR/apt.log" 2>&1; then
    tail -n 20 "$BUILD_DIR/apt.log" >&2
    die "apt-get install ${missing[*]} failed"
  fi
}

# The host needs runc, cgroupfs and explicit ulimits: crun cannot raise RLIMIT_NOFILE here and
# the systemd cgroup manager rejects the hybrid cgroup layout.
write_containers_conf() {
  mkdir -p "$BUILD_DIR"
  cat >"$BUILD_DIR/containers.conf" <<'EOF'
# Written by docker/build-images.sh; used through CONTAINERS_CONF for podman builds and runs.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
EOF
  export CONTAINERS_CONF="$BUILD_DIR/containers.conf"
}

pick_engine() {
  local forced="${DFLASH_CONTAINER_ENGINE:-auto}"
  case "$forced" in
    docker|podman) ENGINE="$forced" ;;
    auto)
      if command -v docker >/dev/null 2>&1 && timeout 30 docker info >/dev/null 2>&1 \
          && docker buildx version >/dev/null 2>&1; then
        ENGINE=docker
      else
        ENGINE=podman
      fi ;;
    *) die "DFLASH_CONTAINER_ENGINE must be docker, podman or auto, not '$forced'" ;;
  esac
  if [[ "$ENGINE" == "podman" ]]; then
    ensure_packages podman runc fuse-overlayfs uidmap
    write_containers_conf
  fi
}

image_present() {
  if [[ "$ENGINE" == "podman" ]]; then podman image exists "$1"
  else docker image inspect "$1" >/dev/null 2>&1; fi
}

declare -A BASE_CHOICE=()
# Sets RESOLVED_BASE to the BASE_IMAGE build argument for a Dockerfile whose default base is $1
# (empty: keep the Dockerfile's default). Decided once per distinct default.
resolve_base() {
  local default="$1"
  RESOLVED_BASE=""
  if [[ -n "${BASE_IMAGE:-}" ]]; then RESOLVED_BASE="$BASE_IMAGE"; return; fi
  [[ -z "$default" ]] && return
  if [[ -z "${BASE_CHOICE[$default]+set}" ]]; then
    local mode="${DFLASH_LOCAL_BASE:-auto}" choice=""
    if [[ "$mode" != "1" ]] && { image_present "$default" \
        || timeout 180 "$ENGINE" pull -q "$default" >"$BUILD_DIR/pull.log" 2>&1; }; then
      choice=""
    elif [[ "$mode" == "0" ]]; then
      die "base image $default is neither present nor pullable (DFLASH_LOCAL_BASE=0): $(tail -n 1 "$BUILD_DIR/pull.log" 2>/dev/null)"
    elif [[ "$default" =~ (^|/)python:3\.11-slim-bookworm(@|$) ]]; then
      [[ "$mode" == "1" ]] || log "no registry reachable for $default: using the local base $LOCAL_BASE_REF"
      if ! image_present "$LOCAL_BASE_REF"; then
        ensure_packages debootstrap
        local t0=$SECONDS
        ENGINE="$ENGINE" DFLASH_IMAGE_BUILD_DIR="$BUILD_DIR" \
          "$ROOT/docker/base/make-local-base.sh" "$LOCAL_BASE_REF" \
          || die "local base image $LOCAL_BASE_REF failed to build"
        log "base $LOCAL_BASE_REF built in $((SECONDS - t0)) s"
      fi
      choice="$LOCAL_BASE_REF"
    else
      die "base image $default cannot be pulled and has no local stand-in; set BASE_IMAGE"
    fi
    BASE_CHOICE[$default]="$choice"
  fi
  RESOLVED_BASE="${BASE_CHOICE[$default]}"
}

# Every rebuild moves :latest and leaves the image it replaced untagged: remove that one so
# repeated builds do not pile up. An image still in use is kept (rmi fails quietly).
drop_if_untagged() {
  local id="$1" tags
  [[ -n "$id" ]] || return 0
  tags="$("$ENGINE" image inspect --format '{{len .RepoTags}}' "$id" 2>/dev/null || true)"
  if [[ "$tags" == "0" ]]; then "$ENGINE" rmi "$id" >/dev/null 2>&1 || true; fi
}

ca_bundle() {
  local var
  for var in PIP_CERT REQUESTS_CA_BUNDLE SSL_CERT_FILE; do
    if [[ -n "${!var:-}" && -f "${!var}" && -r "${!var}" ]]; then printf '%s' "${!var}"; return; fi
  done
}

# Prints the local package indexes (folders holding simple/) for the wheel build contexts, one per line, at
# most two. pip's own configuration is where a machine with local mirrors already names them.
local_indexes() {
  local roots=() root seen="" pip_cmd listed
  if [[ -n "${DFLASH_LOCAL_INDEXES+set}" ]]; then
    IFS=: read -r -a roots <<<"$DFLASH_LOCAL_INDEXES"
  else
    pip_cmd="$(command -v pip3 || command -v pip || true)"
    [[ -n "$pip_cmd" ]] || return 0
    listed="$("$pip_cmd" config list 2>/dev/null || true)"
    mapfile -t roots < <(grep -oE "file://(/[^ '\"]+)/simple/?" <<<"$listed" | sed -E 's#^file://##; s#/simple/?$##')
  fi
  local n=0
  for root in "${roots[@]}"; do
    [[ -n "$root" && -d "$root/simple" ]] || continue
    case " $seen " in *" $root "*) continue ;; esac
    seen="$seen $root"
    printf '%s\n' "$root"
    n=$((n + 1))
    [[ $n -lt 2 ]] || break
  done
}

build_one() {
  local name="$1" dockerfile="docker/$1/Dockerfile" default base cacert log_file t0 size
  default="$(sed -n 's/^ARG BASE_IMAGE=//p' "$ROOT/$dockerfile" | head -n 1)"
  resolve_base "$default"
  base="$RESOLVED_BASE"
  local tag="$PREFIX$name:$SHORT_SHA" latest="$PREFIX$name:latest"
  local args=(--network host -f "$dockerfile" -t "$tag" -t "$latest"
              --build-arg "GIT_REVISION=$GIT_REVISION" --build-arg "SOURCE_URL=$SOURCE_URL"
              --build-arg "IMAGE_REF=$tag")
  [[ -n "$base" ]] && args+=(--build-arg "BASE_IMAGE=$base")
  local wheels="none" contexts=() root
  if grep -q '^FROM scratch AS wheels$' "$ROOT/$dockerfile" \
      && [[ "${DFLASH_BUILD_EXTRA_ARGS:-}" != *--build-context* ]]; then
    mapfile -t contexts < <(local_indexes)
    local stages=(wheels wheels-extra) i=0
    for root in "${contexts[@]}"; do
      args+=(--build-context "${stages[$i]}=$root")
      i=$((i + 1))
    done
    if [[ ${#contexts[@]} -gt 0 ]]; then wheels="${contexts[*]}"; fi
  fi
  # shellcheck disable=SC2206  # a list of engine flags, e.g. "--no-cache --pull"
  [[ -n "${DFLASH_BUILD_EXTRA_ARGS:-}" ]] && args+=(${DFLASH_BUILD_EXTRA_ARGS})
  # Without a bundle the secret is simply not given: the mount is optional in the Dockerfiles.
  cacert="$(ca_bundle)"
  [[ -n "$cacert" ]] && args+=(--secret "id=cacert,src=$cacert")

  local cmd=("$ENGINE" build)
  [[ "$ENGINE" == "docker" ]] && cmd=(docker buildx build --load)
  mkdir -p "$BUILD_DIR/logs"
  log_file="$BUILD_DIR/logs/$name.log"
  local previous
  previous="$("$ENGINE" image inspect --format '{{.Id}}' "$latest" 2>/dev/null || true)"
  t0=$SECONDS
  local rc=0
  if [[ "${VERBOSE:-0}" == "1" ]]; then
    (cd "$ROOT" && "${cmd[@]}" "${args[@]}" .) 2>&1 | tee "$log_file" || rc=$?
  else
    (cd "$ROOT" && "${cmd[@]}" "${args[@]}" .) >"$log_file" 2>&1 || rc=$?
  fi
  if [[ $rc -ne 0 ]]; then
    tail -n 40 "$log_file" >&2
    die "image '$name' FAILED to build ($dockerfile, $ENGINE, exit $rc; full log: $log_file)"
  fi
  if [[ "$ENGINE" == "podman" ]]; then size="$(podman image inspect --format '{{.Size}}' "$tag")"
  else size="$(docker image inspect --format '{{.Size}}' "$tag")"; fi
  drop_if_untagged "$previous"
  # Machine-readable results for callers (the image tests): which engine, which exact tag.
  printf '%s\n' "$tag" >"$BUILD_DIR/$name.image"
  record_digest "$name" "$tag"
  log "$name OK: $tag (+latest), $((size / 1000000)) MB, $((SECONDS - t0)) s, $ENGINE, base ${base:-${default:-from Dockerfile}}, local wheel indexes: $wheels"
}

# Writes $BUILD_DIR/<name>.digest: the image's reference and digest as one JSON object. Pushed (DFLASH_PUSH_TO),
# the digest is the registry's, the one a kubelet resolves; a local manifest digest can differ from it.
record_digest() {
  local name="$1" tag="$2" ref="$2" digest="" pushed=false digest_file="$BUILD_DIR/$1.pushed-digest"
  if [[ -n "${DFLASH_PUSH_TO:-}" ]]; then
    ref="${DFLASH_PUSH_TO%/}/dflash-$name:$SHORT_SHA"
    "$ENGINE" tag "$tag" "$ref"
    rm -f "$digest_file"
    if [[ "$ENGINE" == "podman" ]]; then
      podman push --digestfile "$digest_file" "$ref" >>"$BUILD_DIR/logs/$name.log" 2>&1 \
        || die "push of $ref failed (log: $BUILD_DIR/logs/$name.log)"
      digest="$(cat "$digest_file")"
    else
      docker push "$ref" >>"$BUILD_DIR/logs/$name.log" 2>&1 || die "push of $ref failed"
      digest="$(docker image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' "$ref" \
        | sed -n "s#^${DFLASH_PUSH_TO%/}/dflash-$name@##p" | head -n 1)"
    fi
    pushed=true
  elif [[ "$ENGINE" == "podman" ]]; then
    digest="$(podman image inspect --format '{{.Digest}}' "$tag")"
  else
    # A docker image that was never pushed has no manifest digest; its image id stands in, marked unpushed.
    digest="$(docker image inspect --format '{{.Id}}' "$tag")"
  fi
  [[ "$digest" =~ ^sha256:[0-9a-f]{64}$ ]] || die "no digest for $ref (got '$digest')"
  printf '{"ref": "%s", "digest": "%s", "pushed": %s}\n' "$ref" "$digest" "$pushed" >"$BUILD_DIR/$name.digest"
  log "$name digest $digest${DFLASH_PUSH_TO:+ (pushed as $ref)}"
}

# Collects every <name>.digest of the build folder into digests.json, images built earlier included, so a
# build of one image keeps the others' digests.
write_digests_json() {
  local out="$BUILD_DIR/digests.json" tmp="$BUILD_DIR/.digests.json.tmp" f sep=""
  {
    printf '{"schema": 1, "revision": "%s", "images": {' "$GIT_REVISION"
    for f in "$BUILD_DIR"/*.digest; do
      [[ -f "$f" ]] || continue
      printf '%s\n  "%s": %s' "$sep" "$(basename "$f" .digest)" "$(cat "$f")"
      sep=","
    done
    printf '\n}}\n'
  } >"$tmp"
  mv "$tmp" "$out"
  log "digests recorded in $out (images.digests_file of a run file)"
}

set_revision() {
  GIT_REVISION="$(git -C "$ROOT" rev-parse --verify --quiet HEAD 2>/dev/null || true)"
  SHORT_SHA="$(git -C "$ROOT" rev-parse --verify --quiet --short HEAD 2>/dev/null || true)"
  GIT_REVISION="${GIT_REVISION:-unknown}"
  SHORT_SHA="${SHORT_SHA:-unknown}"
}

main() {
  case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; return ;;
    --ensure-tools) ensure_packages "${TOOL_PACKAGES[@]}"; log "tools present: ${TOOL_PACKAGES[*]}"; return ;;
    --containers-conf) write_containers_conf; printf '%s\n' "$CONTAINERS_CONF"; return ;;
    --digests-json)
      shift
      local name
      for name in "$@"; do
        [[ -f "$BUILD_DIR/$name.digest" ]] || die "no digest recorded for '$name' ($BUILD_DIR/$name.digest is missing)"
      done
      set_revision
      write_digests_json
      return ;;
    -*) die "unknown option $1 (see --help)" ;;
  esac

  local names=() d
  if [[ $# -gt 0 ]]; then
    for d in "$@"; do
      [[ -f "$ROOT/docker/$d/Dockerfile" ]] || die "no image '$d': docker/$d/Dockerfile does not exist"
      names+=("$d")
    done
  else
    for d in "$ROOT"/docker/*/Dockerfile; do
      [[ -f "$d" ]] && names+=("$(basename "$(dirname "$d")")")
    done
  fi
  [[ ${#names[@]} -gt 0 ]] || die "no docker/*/Dockerfile found"

  set_revision
  # Credentials embedded in a remote URL must not end up in an image label.
  SOURCE_URL="$(git -C "$ROOT" config --get remote.origin.url 2>/dev/null | sed -E 's#://[^/@]*@#://#' || true)"
  SOURCE_URL="${SOURCE_URL:-unknown}"

  mkdir -p "$BUILD_DIR"
  pick_engine
  printf '%s\n' "$ENGINE" >"$BUILD_DIR/engine"
  log "building ${names[*]} with $ENGINE at revision $GIT_REVISION"
  for d in "${names[@]}"; do build_one "$d"; done
  write_digests_json
}

main "$@"
