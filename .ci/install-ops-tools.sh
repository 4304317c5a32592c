#!/usr/bin/env bash
# Install the operations tooling the deploy tests need (promtool).
#
# Idempotent: does nothing but print the version when `promtool` is already on PATH.
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
