# shellcheck shell=bash disable=SC2034  # pip and extra are for the sourcing script
# Shared steps of the stage environments that are built with plain `python -m venv` + pip
# (scripts/venv-generate.sh, scripts/venv-train.sh); sourced, not run.
#
# Plain pip on purpose: pip resolves torch==2.13.0 to the CPU wheel (from the configured find-links or an index
# given in TORCH_INDEX_URL), where other resolvers pick a CUDA build. Idempotent: a stamp holding the hash of
# every input (the Python version, the listed files, TORCH_INDEX_URL) skips a rebuild when nothing changed.
#
# The sourcing script sets NAME, VENV and INPUTS, calls `venv_begin "$@"` (which exits 0 when the environment
# is current), installs with "${pip[@]}" and "${extra[@]}", checks the imports, then calls `venv_finish`.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"

venv_begin() {
  STAMP="$VENV/.dflash-inputs.sha256"
  want="$( { "$PYTHON" --version 2>&1; cat "${INPUTS[@]}" "$ROOT/scripts/venv-common.sh"; \
             echo "${TORCH_INDEX_URL:-}"; } | sha256sum | cut -d' ' -f1)"
  if [[ "${1:-}" == "--recreate" ]]; then
    rm -rf "$VENV"
  elif [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
    echo "$NAME: $VENV is up to date"
    exit 0
  fi
  start=$(date +%s)
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  rm -f "$STAMP"  # a failed run below must not leave a stamp that claims success
  pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
  extra=()
  if [[ -n "${TORCH_INDEX_URL:-}" ]]; then extra=(--extra-index-url "$TORCH_INDEX_URL"); fi
  "${pip[@]}" install -q --upgrade pip
}

venv_finish() {
  echo "$want" > "$STAMP"
  echo "$NAME: built $VENV in $(( $(date +%s) - start )) s"
}
