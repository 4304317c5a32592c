#!/usr/bin/env bash
# Install the operations tooling the deploy tests need (promtool; kubectl for `kubectl kustomize`;
# systemd-analyze to verify the units). Under CI (.ci/run sets CI=1) a test whose tool is missing
# fails naming this script (tests/support/need.py); elsewhere it skips with the same message.
#
# Idempotent: does nothing but print the versions when `promtool`, `kubectl` and
# `systemd-analyze` are on PATH.
# Source: Debian's `prometheus` package (bookworm: 2.42.x), which ships /usr/bin/promtool.
# The Prometheus daemon in that package must NOT be started on a CI/dev machine: if no
# policy-rc.d is present we install a temporary one that forbids service starts.
set -euo pipefail

if ! command -v promtool >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-ops-tools: promtool missing and not root; run as root or install 'prometheus' yourself" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-cache policy prometheus | sed -n '1,3p'

    tmp_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        tmp_policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' > "$tmp_policy"
        chmod 0755 "$tmp_policy"
        trap 'rm -f "$tmp_policy"' EXIT
    fi
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

command -v promtool
promtool --version 2>&1 | head -n 1

# kubectl renders deploy/kubernetes offline (`kubectl kustomize`, tests/unit/test_kubernetes.py).
# The machine images ship it; otherwise from apt: `kubectl` where such a source is configured,
# else Debian's own `kubernetes-client`.
if ! command -v kubectl >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-ops-tools: kubectl missing and not root; run as root or install 'kubernetes-client' yourself" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends kubectl >/dev/null 2>&1 \
        || apt-get install -y -qq --no-install-recommends kubernetes-client >/dev/null
fi
command -v kubectl
kubectl version --client 2>&1 | sed -n 1p   # sed reads to the end: no SIGPIPE under pipefail

# systemd-analyze verifies deploy/systemd (tests/unit/test_deploy.py): Debian's `systemd`. Installing
# the package starts nothing in a container (no systemd as PID 1); policy-rc.d forbids the rest.
if ! command -v systemd-analyze >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-ops-tools: systemd-analyze missing and not root; run as root or install 'systemd' yourself" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    sd_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then  # (the prometheus step's one, if any, is still there)
        sd_policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\nexit 101\n' > "$sd_policy"
        chmod 0755 "$sd_policy"
        trap 'rm -f "$sd_policy"' EXIT
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends systemd >/dev/null
fi
command -v systemd-analyze
systemd-analyze --version 2>&1 | sed -n 1p
