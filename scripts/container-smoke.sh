#!/usr/bin/env bash
# Build the rpcguard image (deploy/container/Containerfile, target rpcguard) and smoke-test it, or
# say exactly why it cannot be done on this machine (issue 31.5).
#
# Usage: scripts/container-smoke.sh [ENGINE]      ENGINE: podman or docker (default: the first that answers)
#
# Exit 0: built and the smoke test passed. Exit 3: not attempted, the reason on one line starting
# "container image not built:" (no engine installed, an engine client without a running engine, or
# no access to the base image's registry). Any other exit: the build or the smoke test failed.
#
# The smoke test runs what a user of the image runs first: `rpcguard --version`, then
# `rpcguard check-config` on a serve config with a throwaway PKI made by the image itself
# (`rpcguard certs init-ca/issue` into a tmpfs), as the image's user 10001 on a
# read-only root file system (the Kubernetes manifests' securityContext).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TAG="localhost/rpcguard-smoke:$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo dev)"

not_built() { echo "container image not built: $*"; exit 3; }

engine="${1:-}"
if [ -z "$engine" ]; then
  for e in podman docker; do
    command -v "$e" >/dev/null 2>&1 && { engine=$e; break; }
  done
fi
[ -n "$engine" ] || not_built "no container engine on this machine (install podman or docker; the Containerfile builds with either)"
command -v "$engine" >/dev/null 2>&1 || not_built "$engine is not installed"
if ! why=$("$engine" info 2>&1 >/dev/null); then
  not_built "$engine answers but no engine runs behind it: $(printf '%s' "$why" | grep -v '^$' | tail -n 1)"
fi

base=$(sed -n 's/^ARG PYTHON_BASE=//p' "$ROOT/deploy/container/Containerfile")
if ! pulled=$("$engine" pull -q "$base" 2>&1); then
  not_built "cannot pull the base image $base: $(printf '%s' "$pulled" | tail -n 1)"
fi

echo "building $TAG with $engine (target rpcguard)" >&2
"$engine" build -f "$ROOT/deploy/container/Containerfile" --target rpcguard -t "$TAG" "$ROOT" >&2

run() { "$engine" run --rm --read-only --user 10001 --tmpfs /tmp:rw,mode=1777 "$@"; }
version=$(run "$TAG" --version)
case "$version" in
  rpcguard\ *) echo "smoke: $version" ;;
  *) echo "smoke failed: 'rpcguard --version' printed: $version" >&2; exit 1 ;;
esac
run --entrypoint sh "$TAG" -c '
  set -e
  cd /tmp
  rpcguard certs init-ca pki >/dev/null
  rpcguard certs issue --server --dns node1 pki node1 >/dev/null
  printf "%s\n" "tls: {cert: pki/node1.pem, key: pki/node1.key, ca: pki/ca.pem}" \
    "allow: {cn: [client1]}" "listeners: [{listen: 127.0.0.1:50100, upstream: 127.0.0.1:50052}]" > serve.yaml
  rpcguard check-config serve.yaml
' >&2
echo "smoke: check-config of a serve listener passed in the image (user 10001, read-only root)"
