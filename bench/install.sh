#!/usr/bin/env bash
# Install what bench/run.py needs beyond the project venv, idempotently:
#   - stunnel4 and haproxy from Debian (the two comparison arms), only if missing;
#   - the real llama.cpp peers (tests/realpeer/setup.sh: cached after the first ~4 min build);
#   - py-spy into .venv (only for `run.py --profile`), only if missing.
# The packages' system services are not wanted (the benchmark starts its own foreground processes
# on free loopback ports): while installing as root, a temporary policy-rc.d forbids service
# starts (as .ci/install-ops-tools.sh does).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

need=()
command -v stunnel4 >/dev/null 2>&1 || need+=(stunnel4)
command -v haproxy >/dev/null 2>&1 || need+=(haproxy)
if [ ${#need[@]} -gt 0 ]; then
    echo "bench/install.sh: apt-get install ${need[*]}"
    if [ -z "$SUDO" ] && [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

bash "$ROOT/tests/realpeer/setup.sh" >/dev/null

if [ -x "$ROOT/.venv/bin/pip" ] && [ ! -x "$ROOT/.venv/bin/py-spy" ]; then
    "$ROOT/.venv/bin/pip" install -q py-spy || echo "bench/install.sh: py-spy not installed (only --profile needs it)"
fi

echo "bench/install.sh: $(haproxy -v | head -1)"
echo "bench/install.sh: $(stunnel4 -version 2>&1 | grep -m1 '^stunnel ')"
echo "bench/install.sh: ready; run: .venv/bin/python bench/run.py"
