#!/usr/bin/env bash
# Build the REAL ggml-rpc-server with AddressSanitizer + UndefinedBehaviorSanitizer (the fuzz oracle).
#
# Same pinned source as setup.sh (llama-cpp-python's PyPI sdist, default 0.3.36 = protocol 7.0.0),
# built with the sdist's own switches: GGML_SANITIZE_ADDRESS/UNDEFINED (ggml/CMakeLists.txt) for
# the ggml libraries and LLAMA_SANITIZE_ADDRESS/UNDEFINED (top CMakeLists.txt) for the tools, plus
# -fno-sanitize-recover=undefined so any UB report aborts, and -fno-sanitize=alignment: ggml-rpc
# reads its packed wire structs in place (graph_compute's rpc_tensor array sits at 8+8*n_nodes+4),
# so every real session is a misaligned access (harmless on x86; unrecoverable checks cannot be
# suppressed at run time). Only the `ggml-rpc-server` target of vendor/llama.cpp is built
# (static ggml, no llama/common objects compiled), at -O1 -g.
# Cached per config key: $REALPEER_HOME/asan/<key>/ggml-rpc-server; a second run takes seconds.
#
# Usage: sanitizer.sh [-h]
# Env: REALPEER_HOME, LLAMA_CPP_PYTHON_VERSION, REALPEER_JOBS, PYTHON: as for setup.sh;
#      LLAMA_CPP_SDIST=FILE.tar.gz to use a local sdist instead of `pip download`.
# Last line of output: REALPEER_ASAN_SERVER_BIN=<binary>; also in $REALPEER_HOME/asan.env.
# Run the binary with (tests/fuzz/sanserver.py does):
#   ASAN_OPTIONS=detect_leaks=0:abort_on_error=1  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REALPEER_HOME="${REALPEER_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/rpcguard-realpeer}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PYTHON:-python3}"
JOBS="${REALPEER_JOBS:-$(nproc)}"
case "${1:-}" in -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; "") ;;
  *) echo "sanitizer.sh: unknown argument $1" >&2; exit 2 ;; esac
log() { echo "[sanitizer] $*" >&2; }
mkdir -p "$REALPEER_HOME/asan"

OPT="-O1 -g -fno-omit-frame-pointer -DNDEBUG"
# The sanitizer switches add -fsanitize=undefined AFTER CMAKE_<LANG>_FLAGS, and gcc takes the last
# word: our two UBSan flags go after <FLAGS> in the compile rule itself.
UB="-fno-sanitize-recover=undefined -fno-sanitize=alignment"
CMAKE_ARGS=(
  -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
  "-DCMAKE_C_FLAGS_RELWITHDEBINFO=$OPT" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=$OPT"
  "-DCMAKE_C_COMPILE_OBJECT=<CMAKE_C_COMPILER> <DEFINES> <INCLUDES> <FLAGS> $UB -o <OBJECT> -c <SOURCE>"
  "-DCMAKE_CXX_COMPILE_OBJECT=<CMAKE_CXX_COMPILER> <DEFINES> <INCLUDES> <FLAGS> $UB -o <OBJECT> -c <SOURCE>"
  -DBUILD_SHARED_LIBS=OFF -DGGML_RPC=ON -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=OFF
  -DGGML_SANITIZE_ADDRESS=ON -DGGML_SANITIZE_UNDEFINED=ON
  -DLLAMA_SANITIZE_ADDRESS=ON -DLLAMA_SANITIZE_UNDEFINED=ON
  -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON   # tools/rpc is added only under these two
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
  -DLLAMA_OPENSSL=OFF
)
KEY=$(echo "$VERSION ${CMAKE_ARGS[*]} $(uname -m) $(gcc -dumpfullversion 2>/dev/null)" | sha256sum | cut -c1-16)
OUT="$REALPEER_HOME/asan/$KEY"
BIN="$OUT/ggml-rpc-server"

(
  flock 9  # one build at a time, whoever asks (tests, CI setup, a person)
  if [ -x "$BIN" ]; then log "reusing cached $BIN"; exit 0; fi
  PATH="$PATH:$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"  # where pip puts them
  for tool in cmake ninja; do
    command -v "$tool" >/dev/null || { log "installing $tool from PyPI"; "$PY" -m pip install -q "$tool"; }
  done
  command -v g++ >/dev/null || { log "installing g++ from Debian"; apt-get update -qq && apt-get install -y -qq g++ >/dev/null; }
  WORK=$(mktemp -d "$REALPEER_HOME/asan/build.XXXX")
  T0=$(date +%s)
  SDIST="${LLAMA_CPP_SDIST:-}"
  if [ -z "$SDIST" ]; then
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
      "llama-cpp-python==$VERSION" -d "$WORK/dl" >&2
    SDIST=$(ls "$WORK"/dl/llama_cpp_python-"$VERSION".tar.gz)
  fi
  tar -xzf "$SDIST" -C "$WORK" "llama_cpp_python-$VERSION/vendor/llama.cpp"
  SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
  T1=$(date +%s)
  log "configuring + building ggml-rpc-server (ASan+UBSan, -O1) from llama-cpp-python $VERSION"
  { cmake -S "$SRC" -B "$WORK/build" "${CMAKE_ARGS[@]}" &&
    cmake --build "$WORK/build" --target ggml-rpc-server -j "$JOBS"; } > "$REALPEER_HOME/asan/build.log" 2>&1 \
    || { log "build failed, see $REALPEER_HOME/asan/build.log"; tail -30 "$REALPEER_HOME/asan/build.log" >&2
         rm -rf "$WORK"; exit 1; }
  mkdir -p "$OUT"
  install -m 0755 "$(find "$WORK/build" -name ggml-rpc-server -type f -perm -u+x | head -1)" "$BIN.tmp"
  mv "$BIN.tmp" "$BIN"
  rm -rf "$WORK"
  log "built $BIN in $(( $(date +%s) - T0 )) s (download+extract $(( T1 - T0 )) s, compile $(( $(date +%s) - T1 )) s)"
) 9>"$REALPEER_HOME/asan/.lock"

# Smoke: the binary carries both sanitizer runtimes (a bad build fails here, not in a test).
LIBS=$(ldd "$BIN" 2>&1 || true)
[[ $LIBS == *libasan* && $LIBS == *libubsan* ]] || { log "$BIN is not linked with libasan+libubsan: $LIBS"; exit 1; }
echo "REALPEER_ASAN_SERVER_BIN=$BIN" > "$REALPEER_HOME/asan.env"
echo "REALPEER_ASAN_SERVER_BIN=$BIN"
