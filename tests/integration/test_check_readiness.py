"""/readyz tells what the material and the peers IN USE can do, for serve and for connect.

connect's /readyz answers "does my node answer?" from a cached TLS-only probe (no HELLO, so the
node's single upstream slot is never taken for it) or from the last session's outcome; serve's
ignores a broken certificate file on disk while the loaded certificate works.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

from rpcguard.proxy.readiness import NODE_CHECK_INTERVAL_S
from tests.support import realpeer
from tests.support.guard import start_guard


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20) as rsp:
            return rsp.status, rsp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_connect_readyz_follows_its_node(pki, workdir, rpc_server):
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args(),
                                           "--allow-cn", pki.client])
    dead = realpeer.reserve_port()
    up = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                          *pki.connect_args()])
    down = start_guard("connect", workdir, ["--server", f"127.0.0.1:{dead}", "--server-name", pki.node,
                                            *pki.connect_args()])
    try:
        status, body = http_get(up.metrics_port, "/readyz")
        assert status == 200 and "node answers (TLS accepted)" in body, body
        status, body = http_get(down.metrics_port, "/readyz")
        assert status == 503 and f"127.0.0.1:{dead}: node_unreachable" in body, body
        # cached: a second /readyz within NODE_CHECK_INTERVAL_S makes no new connection to the node
        sessions = serve.wait_value("rpcguard_sessions_total", 1)
        assert sessions == 1
        for _ in range(5):
            assert http_get(up.metrics_port, "/readyz")[0] == 200
        assert serve.value("rpcguard_sessions_total") == 1 and NODE_CHECK_INTERVAL_S >= 5
        # the probe sent no HELLO: nothing refused, no upstream version learned from it
        assert serve.value("rpcguard_refusals_total") == 0
        assert serve.samples("rpcguard_upstream_protocol_info") == []
        # ... and said it is a probe: the node records a probe, not a session that worked
        assert serve.value("rpcguard_sessions_total", result="probe") == 1
        assert serve.value("rpcguard_sessions_total", result="ok") == 0
        assert "result=probe" not in serve.output()  # probes every few seconds are DEBUG, not INFO
    finally:
        for g in (up, down, serve):
            g.stop()


def test_a_port_check_on_a_tunnel_is_no_hello_not_a_session(pki, workdir, rpc_server):
    """A bare TCP connect (a port check, a kubelet tcpSocket probe) to connect's listener: no HELLO
    ever comes. Both ends record result=no_hello, not ok."""
    import socket

    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args(),
                                           "--allow-cn", pki.client])
    connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                               *pki.connect_args()])
    try:
        socket.create_connection(("127.0.0.1", connect.port), timeout=10).close()
        assert connect.wait_value("rpcguard_sessions_total", 1, result="no_hello") == 1
        assert serve.wait_value("rpcguard_sessions_total", 1, result="no_hello") == 1
        for g in (connect, serve):
            assert g.value("rpcguard_sessions_total", result="ok") == 0
            assert g.value("rpcguard_refusals_total") == 0
        assert connect.logged("result=no_hello")
    finally:
        for g in (connect, serve):
            g.stop()


def test_connect_readyz_is_503_when_the_node_refuses_the_certificate(pki, workdir, tmp_path, rpc_server):
    from tests.support.guard import Pki

    other = Pki(tmp_path / "other")  # a client certificate of another CA: the node refuses it
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args()])
    connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                               *pki.connect_args(other.path(other.client),
                                                                 other.path(other.client, "key"))])
    try:
        status, body = http_get(connect.metrics_port, "/readyz")
        assert status == 503 and "tls_failed" in body, body
        assert connect.logged("warning") and connect.logged("untrusted")  # said at start too
        assert connect.value("rpcguard_certificate_warning", kind="untrusted") == 1
    finally:
        connect.stop()
        serve.stop()


def test_serve_readyz_reflects_the_certificate_in_use_not_the_file(pki, workdir, rpc_server):
    cert, key = pki.issue("readynode", server=True, ips=["127.0.0.1"])
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", "--cert", cert, "--key", key,
                                           "--ca", pki.path("ca")])
    try:
        assert http_get(serve.metrics_port, "/readyz")[0] == 200
        Path(cert).write_text("garbage\n")  # a broken rotation on disk; the loaded certificate still works
        status, body = http_get(serve.metrics_port, "/readyz")
        assert status == 200 and "answered HELLO" in body, body
    finally:
        serve.stop()


def test_connect_readyz_reuses_the_last_session_outcome(pki):
    """A session's outcome is fresher than any probe: it decides /readyz without a connection."""
    import asyncio

    from rpcguard.config.flags import build_config
    from rpcguard.proxy.server import Runtime

    dead = realpeer.reserve_port()  # nothing listens: only the session records can make it ready
    cfg = build_config("connect", overrides={"listen": "127.0.0.1:0", "server": f"127.0.0.1:{dead}",
                                             "server_name": pki.node, "cert": pki.path(pki.client),
                                             "key": pki.path(pki.client, "key"), "ca": pki.path("ca")})

    async def run():
        rt = Runtime(cfg)
        rt.outcomes.session_ended({"role": "connect", "listener": "tunnel0", "result": "ok", "version": "7.0.0"})
        first = await rt.ready()
        rt.outcomes.session_ended({"role": "connect", "listener": "tunnel0", "result": "refused", "reason": "identity_not_allowed",
                           "detail": "not on the allow-list"})
        second = await rt.ready()
        rt.outcomes.session_ended({"role": "connect", "listener": "tunnel0", "result": "refused", "reason": "upstream_busy", "detail": "busy"})
        third = await rt.ready()  # busy is the node answering: the last verdict stands
        return first, second, third

    first, second, third = asyncio.run(run())
    assert first == (True, "tunnel0: node answers (a session got through)"), first
    assert second[0] is False and "identity_not_allowed: not on the allow-list" in second[1], second
    assert third == second


def test_serve_readyz_is_the_truth_about_its_upstream(pki, workdir, rpc_server):
    """Ready only when the upstream answers HELLO with an accepted version (issue 31.2): an HTTP
    server on the upstream port takes TCP connections but is no ggml-rpc-server; `rpcguard status`
    exits 1 for a node that is not ready and 0 for one that is."""
    import http.server
    import subprocess
    import sys
    import threading

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    liar = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{httpd.server_address[1]}", *pki.serve_args()])
    real = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args()])
    try:
        status, body = http_get(liar.metrics_port, "/readyz")
        assert status == 503 and "not a ggml-rpc-server" in body, body  # silent (it waits for a line) or a 400
        assert liar.value("rpcguard_upstream_up") == 0
        status, body = http_get(real.metrics_port, "/readyz")
        assert status == 200 and "answered HELLO, protocol" in body, body
        assert real.value("rpcguard_upstream_up") == 1
        for guard, code in ((liar, 1), (real, 0)):
            p = subprocess.run([sys.executable, "-m", "rpcguard", "status", "--metrics",
                                f"127.0.0.1:{guard.metrics_port}"], capture_output=True, text=True, timeout=60)
            assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
        assert "not ready" in subprocess.run(
            [sys.executable, "-m", "rpcguard", "status", "--metrics", f"127.0.0.1:{liar.metrics_port}"],
            capture_output=True, text=True, timeout=60).stderr
    finally:
        liar.stop()
        real.stop()
        httpd.shutdown()
