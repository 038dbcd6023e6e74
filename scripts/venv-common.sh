# shellcheck shell=bash disable=SC2034  # pip and extra are for the sourcing script
# Shared steps of the stage environments that are built with plain `python -m venv` + pip
# (scripts/venv-generate.sh, scripts/venv-train.sh); sourced, not run.
#
# Each environment is installed from its lock (requirements/<env>.lock, made by `make lock` from
# requirements/<env>.in): `pip install --require-hashes --no-deps`, so what is installed is exactly the lock and
# nothing is resolved here. Plain pip on purpose: it finds the wheels that are on no index (the CPU build of torch)
# where the machine keeps them (its configured find-links, or an index given in TORCH_INDEX_URL), and the hashes
# decide which file of a version is taken. Idempotent: a stamp holding the hash of every input (the Python
# version, the listed files, TORCH_INDEX_URL) skips a rebuild when nothing changed.
#
# The sourcing script sets NAME, VENV and INPUTS (its lock and input among them), calls `venv_begin "$@"` (which
# exits 0 when the environment is current), installs with `venv_install_locked`, checks the imports, then calls
# `venv_finish`.

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

# venv_install_locked LOCK INPUT: the lock with hashes required and without resolution, then INPUT's -e packages
# (the project's own, editable) without dependencies (the lock holds theirs), then removes what neither names
# (left by an earlier lock), except pip and setuptools that seeded the environment.
venv_install_locked() {
  local lock="$1" input="$2" name
  "${pip[@]}" install -q "${extra[@]}" --require-hashes --no-deps -r "$lock"
  "${pip[@]}" install -q --no-deps -r <("$VENV/bin/python" "$ROOT/scripts/locks.py" editables "$input")
  local stale=()
  while read -r name; do stale+=("$name"); done < <("$VENV/bin/python" "$ROOT/scripts/locks.py" extraneous "$lock" "$input")
  if [[ ${#stale[@]} -gt 0 ]]; then
    echo "$NAME: removing what $(basename "$lock") does not name: ${stale[*]}"
    "${pip[@]}" uninstall -q -y "${stale[@]}"
  fi
}

venv_finish() {
  echo "$want" > "$STAMP"
  echo "$NAME: built $VENV in $(( $(date +%s) - start )) s"
}
