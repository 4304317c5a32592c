# Sourced by scripts/*.sh: the project venv and the real llama.cpp peer, both cached.
# Installs only from Debian and PyPI. Idempotent: a second run takes seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { printf '\033[1m[rpcguard]\033[0m %s\n' "$*" >&2; }
need_apt=()
command -v python3 >/dev/null || need_apt+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
command -v g++ >/dev/null || need_apt+=(g++)
# the compiled protocol core (setup.py, mypyc) needs Python's C headers; without them it installs pure
python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  2>/dev/null || need_apt+=(python3-dev)
command -v stdbuf >/dev/null || need_apt+=(coreutils)
# serve's sandbox for the server it runs (docs/containment.md): bubblewrap, util-linux's setpriv
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
command -v setpriv >/dev/null || need_apt+=(util-linux)
if [ ${#need_apt[@]} -gt 0 ]; then
  say "installing ${need_apt[*]} from Debian"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
VENV="${RPCGUARD_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c 'import rpcguard, pytest, hypothesis, uvloop, yaml, prometheus_client, cryptography' 2>/dev/null \
   || [ "$ROOT/pyproject.toml" -nt "$VENV/.rpcguard-installed" ] \
   || [ -n "$(find "$ROOT/setup.py" "$ROOT/rpcguard/protocol" -name '*.py' -newer "$VENV/.rpcguard-installed" 2>/dev/null)" ]; then
  # (a protocol source newer than the install: the compiled core of an editable install is stale)
  say "installing rpcguard and its test dependencies into $VENV"
  "$PY" -m pip install -q --disable-pip-version-check -e "$ROOT[test]"
  touch "$VENV/.rpcguard-installed"
fi
say "real llama.cpp peer (llama-cpp-python built with RPC; ~3.5 min the first time, cached after)"
REALPEER_PYTHON=$(bash "$ROOT/tests/realpeer/setup.sh" | sed -n 's/^REALPEER_PYTHON=//p')
export REALPEER_PYTHON
