#!/usr/bin/env bash
# Build REAL llama.cpp peers for several ggml RPC protocol versions (the version matrix).
#
# Usage: matrix.sh [VERSION...]      protocol versions, default: 7.0.0 5.0.0 4.0.2 4.0.0 3.6.1 2.0.0
#   Each version is the newest llama-cpp-python PyPI release vendoring it (see VERSIONS below),
#   built by setup.sh (same wheel cache $REALPEER_HOME/wheels/<key>/, same CMake args, same
#   extra ggml-rpc-server target) into its own venv $REALPEER_HOME/matrix/<version>/.
#   7.0.0 (the default pin) reuses setup.sh's default venv $REALPEER_HOME/venv.
#   Builds run one at a time (~4-6 min each on 2 cores; cached re-runs take seconds).
# Writes REALPEER_PYTHON_<X_Y_Z>=<python> lines into $REALPEER_HOME/matrix.env (read by
# tests/support/realpeer.py realpeer_python(version)); the last output lines repeat them.
# Env: REALPEER_HOME, REALPEER_JOBS, REALPEER_NATIVE, PYTHON: as for setup.sh.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REALPEER_HOME="${REALPEER_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/rpcguard-realpeer}"
export REALPEER_HOME
declare -A VERSIONS=([7.0.0]=0.3.36 [5.0.0]=0.3.35 [4.0.2]=0.3.34 [4.0.0]=0.3.28 [3.6.1]=0.3.20 [2.0.0]=0.3.16)
ALL=(7.0.0 5.0.0 4.0.2 4.0.0 3.6.1 2.0.0)
case "${1:-}" in -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -gt 0 ] || set -- "${ALL[@]}"
for v in "$@"; do
  [ -n "${VERSIONS[$v]:-}" ] || { echo "matrix.sh: unknown protocol version $v (known: ${ALL[*]})" >&2; exit 2; }
done
log() { echo "[matrix] $*" >&2; }
mkdir -p "$REALPEER_HOME/matrix" "$REALPEER_HOME/wheels"
ENVFILE="$REALPEER_HOME/matrix.env"

set_env() {  # set_env KEY VALUE: replace/add one line of matrix.env (locked, atomic rename)
  (
    flock 9
    tmp=$(mktemp "$ENVFILE.XXXX")
    { [ -f "$ENVFILE" ] && grep -v "^$1=" "$ENVFILE" || true; echo "$1=$2"; } | sort > "$tmp"
    mv "$tmp" "$ENVFILE"
  ) 9>"$ENVFILE.lock"
}

failed=()
for v in "$@"; do
  pkg=${VERSIONS[$v]}; key="REALPEER_PYTHON_${v//./_}"; t0=$(date +%s)
  log "protocol $v = llama-cpp-python $pkg"
  if [ "$v" = 7.0.0 ]; then
    # the default pin: setup.sh's own venv (and its env.sh), nothing else to do
    out=$(LLAMA_CPP_PYTHON_VERSION=$pkg bash "$HERE/setup.sh") || { failed+=("$v"); continue; }
  else
    # setup.sh writes env.sh and build.log into $REALPEER_HOME: give it a private home per version
    # (so the default env.sh is never overwritten) that shares the wheel cache.
    home="$REALPEER_HOME/matrix/.home-$v"; mkdir -p "$home"
    ln -sfn "$REALPEER_HOME/wheels" "$home/wheels"
    out=$(REALPEER_HOME="$home" LLAMA_CPP_PYTHON_VERSION=$pkg \
          bash "$HERE/setup.sh" --venv "$REALPEER_HOME/matrix/$v") \
      || { log "protocol $v FAILED (build log: $home/build.log)"; failed+=("$v"); continue; }
  fi
  py=$(printf '%s\n' "$out" | sed -n 's/^REALPEER_PYTHON=//p' | tail -1)
  [ -x "$py" ] || { log "protocol $v: setup.sh printed no python"; failed+=("$v"); continue; }
  set_env "$key" "$py"
  log "protocol $v ready in $(( $(date +%s) - t0 )) s: $key=$py"
done
[ -f "$ENVFILE" ] && cat "$ENVFILE"
if [ ${#failed[@]} -gt 0 ]; then log "failed: ${failed[*]}"; exit 1; fi
