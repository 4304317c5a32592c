#!/bin/sh
# The install stage of the rpcguard image (Containerfile, stage rpcguard-build), also run by
# tests/integration/test_container_install.py on the sources the stage copies:
#
#   build-wheel.sh SRC OUT [pip wheel options]
#
# builds rpcguard's wheel from SRC into OUT with the protocol core compiled by mypyc (setup.py),
# installs it into a scratch directory and fails unless the compiled core is what imports there:
# an image must never ship the pure-Python fallback without saying so.
set -eu
src=$1
out=$2
shift 2
py=${PYTHON:-python3}
mkdir -p "$out"
"$py" -m pip wheel --no-deps --wheel-dir "$out" "$@" "$src"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$py" -m pip install --no-deps --no-index --target "$scratch" "$out"/rpcguard-*.whl
cd "$scratch"
"$py" - <<'PY'
import sys
sys.path.insert(0, ".")
import rpcguard.protocol as protocol
from rpcguard.protocol import session
where = session.__file__
if not protocol.compiled():
    sys.exit(f"rpcguard build: the wheel's protocol core is pure Python ({where}); is a C compiler there?")
print(f"rpcguard build: {protocol.core_description()} ({where})")
PY
