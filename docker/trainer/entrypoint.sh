#!/bin/sh
# Default command of the trainer image. Every form reads DFLASH_TRAIN_* variables.
#
#   entrypoint.sh [FLAGS...]          preflight, then `dflash-train run` in this process (one GPU, or CPU);
#                                     the flags go to both. exec hands PID 1 to the stage, so SIGTERM
#                                     from the orchestrator reaches it directly.
#   entrypoint.sh preflight|run|evaluate|export [FLAGS...]
#                                     that command alone.
#   entrypoint.sh torchrun ARGS...    preflight once for this pod (for the GPUs --nproc-per-node names),
#                                     then torchrun ARGS (several GPUs, or one pod of a multi-node Job).
#
# Under torchrun, SIGTERM is passed to the training processes themselves rather than to torchrun: torchrun
# would give them 30 s and then SIGKILL, where the stage needs the pod's whole grace period to finish the
# step and write its checkpoint. The ranks then exit PREEMPTED, torchrun reports a failed worker group,
# and this script exits 75 (dflash_shared.exit_codes.ExitCode.PREEMPTED) so that the Job's
# podFailurePolicy resumes the pod without counting a retry.
set -eu

PREEMPTED=75

case "${1:-}" in
  preflight|run|evaluate|export) exec dflash-train "$@" ;;
  torchrun) ;;
  *)
    dflash-train preflight "$@"
    exec dflash-train run "$@" ;;
esac

# The preflight checks as many GPUs as the ranks of this pod will use (LOCAL_WORLD_SIZE, which torchrun
# sets for each rank); a symbolic --nproc-per-node (gpu, auto) is checked as one.
nproc=1
for arg in "$@"; do
  case "$arg" in
    --nproc-per-node=*|--nproc_per_node=*) nproc="${arg#*=}" ;;
  esac
done
case "$nproc" in
  ''|*[!0-9]*) nproc=1 ;;
esac
LOCAL_WORLD_SIZE="$nproc" dflash-train preflight

# PIDs of the direct children of process $1 (torchrun's workers), read from /proc: the image has no ps.
# shellcheck disable=SC2317  # reached through the SIGTERM trap
children() {
  parent="$1"
  for stat in /proc/[0-9]*/stat; do
    line="$(cat "$stat" 2>/dev/null)" || continue
    # Field 2 (the command name) may hold spaces; the fields after its closing parenthesis do not.
    # shellcheck disable=SC2086  # split on purpose
    set -- ${line##*") "}
    if [ "${2:-}" = "$parent" ]; then
      pid="${stat#/proc/}"
      echo "${pid%/stat}"
    fi
  done
}

stopping=0
# shellcheck disable=SC2317  # the SIGTERM trap
forward() {
  stopping=1
  workers="$(children "$launcher")"
  echo "entrypoint: SIGTERM: passing it to the training processes ${workers:-(none yet: to torchrun)}" >&2
  if [ -n "$workers" ]; then
    # shellcheck disable=SC2086  # a list of PIDs
    kill -TERM $workers 2>/dev/null || true
  else
    kill -TERM "$launcher" 2>/dev/null || true
  fi
}

"$@" &
launcher=$!
trap forward TERM INT

status=0
wait "$launcher" || status=$?
# A trapped signal cuts `wait` short (status > 128) while torchrun is still running: wait again.
while [ "$status" -gt 128 ] && kill -0 "$launcher" 2>/dev/null; do
  status=0
  wait "$launcher" || status=$?
done

if [ "$stopping" = 1 ] && [ "$status" -ne 0 ]; then
  echo "entrypoint: stopped by SIGTERM (torchrun exited $status): exit $PREEMPTED (PREEMPTED)" >&2
  exit "$PREEMPTED"
fi
exit "$status"
