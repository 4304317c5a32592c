#!/usr/bin/env bash
# The main job on one machine: a real llama.cpp session guarded by rpcguard, all on loopback.
#   real ggml-rpc-server (127.0.0.1:50052) <- rpcguard serve (mTLS :50100) <- rpcguard connect (:50200)
#   <- the real llama.cpp client (llama-cpp-python) generating tokens from a small generated model,
# then a per-command summary of what rpcguard saw, read from its Prometheus metrics.
# Usage: scripts/demo.sh [--bench]   (--bench: the ~105 MB model instead of the 0.6 MB one)
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
exec "$PY" "$ROOT/scripts/demo.py" "$@"
