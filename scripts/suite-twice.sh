#!/usr/bin/env bash
# Issue 30's load check (docs/testing.md "Two clean clones at once"): two clean clones of HEAD run
# .ci/run (the README's test command) at the same time, a CPU hog beside them. Exit 0 only if
# both are green. Logs: $WORK/clone{1,2}.log. Takes ~45 min on a 2-core machine with warm caches.
# Usage: bash scripts/suite-twice.sh [WORK_DIR]     (default /tmp/rpcguard-suite-twice)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-/tmp/rpcguard-suite-twice}"
rm -rf "$WORK" && mkdir -p "$WORK"
for n in 1 2; do git clone -q "$ROOT" "$WORK/clone$n"; done
python3 -c 'while True: pass' & HOG=$!
trap 'kill $HOG 2>/dev/null' EXIT
echo "suite-twice: $(git -C "$ROOT" rev-parse --short HEAD), two clones and a CPU hog, start $(date -u +%T)"
pids=()
for n in 1 2; do
  ( cd "$WORK/clone$n" && .ci/run > "$WORK/clone$n.log" 2>&1 ) & pids+=($!)
done
rc=0
for n in 1 2; do
  if wait "${pids[$((n-1))]}"; then r=0; else r=$?; fi
  echo "clone$n: exit $r: $(grep -E '(passed|failed)' "$WORK/clone$n.log" | tail -1)"
  [ "$r" -eq 0 ] || rc=1
done
echo "suite-twice: end $(date -u +%T)"
exit $rc
