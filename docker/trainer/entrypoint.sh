#!/bin/sh
# Default command of the trainer image. Every form reads DFLASH_TRAIN_* variables.
#
#   entrypoint.sh [FLAGS...]          `dflash-train run` in this process (one GPU, or CPU), which starts
#                                     with the checks `preflight` runs alone. exec hands the process to the stage, so SIGTERM
#                                     from the orchestrator reaches it directly.
#   entrypoint.sh preflight|run|evaluate|export [FLAGS...]
#                                     that command alone.
#   entrypoint.sh torchrun ARGS...    torchrun ARGS (several GPUs, or one pod of a multi-node Job); each rank
#                                     starts with the checks, for the GPUs of its pod (LOCAL_WORLD_SIZE).
#
# Under torchrun, SIGTERM is passed to the training processes themselves rather than to torchrun: torchrun
# would give them 30 s and then SIGKILL, where the stage needs the pod's whole grace period to finish the
# step and write its checkpoint. The ranks of every pod agree at the next step boundary to stop, write the
# checkpoint and exit PREEMPTED (75); a rank whose collective failed because a peer vanished exits 75 too,
# and a rank whose own work failed keeps its code (dflash_train.parallel.gang). torchrun exits 1 for any failed
# worker, so each rank also leaves its code in a folder of this pod ($DFLASH_RANK_EXITS), and this script
# exits with what the ranks say, not with torchrun's status:
#   a rank's bad config or input (64, 65)      -> that code: the Job's podFailurePolicy fails the Job;
#   this pod got SIGTERM                       -> 75;
#   every rank of this pod stopped for the gang -> 75: a peer pod was preempted or failed, this pod resumes
#                                                 without counting a retry;
#   otherwise (a rank failed, or died without  -> its code, else torchrun's: counted against the index's
#   leaving a code: OOM kill, segfault)           backoffLimitPerIndex.
set -eu
# With DFLASH_LOG_PREFIX set (every stage Job sets it), this script runs once more under dflash_shared.pod_log,
# which passes the output through, keeps a copy in the store (<run>/logs/<stage>/<pod>.log) and passes SIGTERM on.
if [ -n "${DFLASH_LOG_PREFIX:-}" ] && [ -z "${DFLASH_POD_LOG:-}" ]; then
  exec python -m dflash_shared.pod_log -- "$0" "$@"
fi

PREEMPTED=75

case "${1:-}" in
  preflight|run|evaluate|export) exec dflash-train "$@" ;;
  torchrun) ;;
  *) exec dflash-train run "$@" ;;
esac

# The ranks this pod starts (--nproc-per-node), whose exit codes the end of this script reads; a symbolic value
# (gpu, auto) counts as one.
nproc=1
for arg in "$@"; do
  case "$arg" in
    --nproc-per-node=*|--nproc_per_node=*) nproc="${arg#*=}" ;;
  esac
done
case "$nproc" in
  ''|*[!0-9]*) nproc=1 ;;
esac

# PIDs of the direct children of process $1 (torchrun's workers), read from /proc: the image has no ps.
# shellcheck disable=SC2317,SC2329  # reached through the SIGTERM trap
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
# shellcheck disable=SC2317,SC2329  # the SIGTERM trap
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

# Each rank writes rank-<RANK> here: "<exit code> <reason>" (dflash_train.parallel.gang.write_rank_exit).
DFLASH_RANK_EXITS="$(mktemp -d "${TMPDIR:-/tmp}/rank-exits.XXXXXX")"
export DFLASH_RANK_EXITS

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
[ "$status" -eq 0 ] && exit 0

# What the ranks of this pod said: the first deterministic code, whether all stopped for the gang, the
# first other failure.
deterministic="" others="" recorded=0 stopped=0
for record in "$DFLASH_RANK_EXITS"/rank-*; do
  [ -f "$record" ] || continue
  read -r code reason < "$record" || true
  recorded=$((recorded + 1))
  echo "entrypoint: ${record##*/} exited $code: $reason" >&2
  case "$code" in
    64|65) [ -n "$deterministic" ] || deterministic="$code" ;;
    "$PREEMPTED") stopped=$((stopped + 1)) ;;
    *) [ -n "$others" ] || others="$code" ;;
  esac
done

if [ -n "$deterministic" ]; then
  echo "entrypoint: a rank failed for good (torchrun exited $status): exit $deterministic" >&2
  exit "$deterministic"
fi
if [ "$stopping" = 1 ]; then
  echo "entrypoint: stopped by SIGTERM (torchrun exited $status): exit $PREEMPTED (PREEMPTED)" >&2
  exit "$PREEMPTED"
fi
# Every rank of this pod (as many as --nproc-per-node starts) stopped because the gang did.
if [ -z "$others" ] && [ "$stopped" -gt 0 ] && [ "$recorded" -ge "$nproc" ]; then
  echo "entrypoint: the gang stopped, every rank of this pod exited $PREEMPTED (torchrun exited $status):" \
    "exit $PREEMPTED (PREEMPTED)" >&2
  exit "$PREEMPTED"
fi
if [ -n "$others" ]; then
  echo "entrypoint: a rank of this pod failed (torchrun exited $status): exit $others" >&2
  exit "$others"
fi
echo "entrypoint: torchrun exited $status; $recorded of $nproc rank(s) left an exit code" >&2
exit "$status"
