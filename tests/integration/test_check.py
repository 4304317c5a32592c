"""``rpcguard check`` against a real node: one connection, classified like the data path.

The node is a real ``rpcguard serve`` in front of the real ggml-rpc-server (or in front of a
closed port). Every case asserts the reason ``check`` prints, its exit code, and, where the
node can see it, that the check cost the node exactly one connection (one TLS failure or one
session), so an operator reads one line in the node's log per check.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import ssl
import subprocess
import json
import time
from pathlib import Path

import pytest

from rpcguard.pki.preflight import certificate_warnings
from rpcguard.admin.check import probe_node
from rpcguard.pki.probe import tls_probe
from rpcguard.pki.tls import client_context
from tests.support import realpeer
from tests.support.guard import Pki, start_guard, wait_for_line
from tests.support.waiting import wait_until
from tests.support.realpeer import PYTHON


@pytest.fixture
def node(workdir, pki, rpc_server):
    """A real serve -> real ggml-rpc-server, allowing only CN=client1; yields the Guard."""
    guards = []

    def make(*extra: str, upstream: int | None = None):
        g = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{upstream or rpc_server}", *pki.serve_args(),
                                           "--allow-cn", pki.client, *extra])
        guards.append(g)
        return g

    yield make
    for g in guards:
        g.stop()


def check(endpoint: str, pki: Pki, *args: str, name: str | None = None, cert: str | None = None,
          key: str | None = None, ca: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run([PYTHON, "-m", "rpcguard", "check", "--server", endpoint, "--server-name", name or pki.node,
                        *pki.connect_args(cert, key, ca), *args], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    return p


def node_connections(g) -> float:
    """Connections the node saw: each one ends as a session (ok, refused or error), failed handshakes too."""
    return g.value("rpcguard_sessions_total")


def wait_connections(g, n: float) -> float:
    """The connections the node saw from a check that has exited: each one it made is in the
    node's accept queue or accepted by then, so once the queue is empty and no session runs, a
    second connection (if any) is counted: no window in which it would probably have landed."""
    g.wait_value("rpcguard_sessions_total", n)
    g.wait_quiet()
    return node_connections(g)


def test_ok_one_connection(node, pki):
    g = node()
    p = check(g.endpoint, pki)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("OK") and "protocol 7.0.0, 1 device(s)" in p.stdout, p.stdout
    assert wait_connections(g, 1) == 1
    # the check said in the handshake it is a probe: the node records no session that worked
    assert g.wait_value("rpcguard_sessions_total", 1, result="probe") == 1
    assert g.value("rpcguard_sessions_total", result="ok") == 0
    assert "node enforces every request check" in p.stdout, p.stdout


def test_closed_port_is_node_unreachable(pki):
    port = realpeer.reserve_port()
    p = check(f"127.0.0.1:{port}", pki)
    assert p.returncode == 1
    assert p.stdout.count("\n") == 1 and "REFUSED" in p.stdout and ": node_unreachable - " in p.stdout, p.stdout


def test_one_connection_to_a_silent_closer():
    """A port that accepts and hangs up: one connect, not a second try with another HELLO."""
    srv = socket.create_server(("127.0.0.1", 0))
    accepted = []

    async def run():
        loop = asyncio.get_running_loop()
        srv.setblocking(False)

        async def accept_loop():
            while True:
                conn, peer = await loop.sock_accept(srv)
                accepted.append(peer)
                conn.close()

        task = loop.create_task(accept_loop())
        ctx = ssl.create_default_context()
        r = await probe_node("n", "127.0.0.1", srv.getsockname()[1], ctx, "localhost", timeout=5)
        # Every connection the probe made is queued by now; a marker connection of ours queues
        # after them, and the accept loop takes them in order: once it has taken the marker, it
        # has taken every connection of the probe (no window in which a second one would land).
        marker = socket.create_connection(srv.getsockname()[:2])
        deadline = loop.time() + 30
        while marker.getsockname() not in accepted:
            assert loop.time() < deadline, "the marker connection was not accepted within 30 s"
            await asyncio.sleep(0.01)
        accepted.remove(marker.getsockname())
        marker.close()
        task.cancel()
        return r

    r = asyncio.run(run())
    srv.close()
    assert len(accepted) == 1, accepted
    # something answered TCP and hung up on the ClientHello: not an unreachable node, not TLS
    assert not r.ok and r.reason == "tls_failed" and r.cause == "tls_not_tls" and "during the TLS handshake" in r.detail, r
    assert r.line().startswith("REFUSED n 127.0.0.1:") and ": not TLS (" in r.line(), r.line()


@pytest.mark.parametrize("case,reason,cause", [
    ("expired", "tls_failed", "tls_cert_expired"),
    ("foreign_ca", "tls_failed", "tls_unknown_ca"),
])
def test_bad_client_certificate_is_tls_failed_with_its_cause(node, pki, tmp_path, case, reason, cause):
    g = node()
    if case == "expired":
        now = dt.datetime.now(dt.timezone.utc)
        cert, key = pki.issue("oldclient", server=False, not_before=now - dt.timedelta(days=3),
                              not_after=now - dt.timedelta(days=1))
    else:
        other = Pki(tmp_path / "other")
        cert, key = other.path(other.client), other.path(other.client, "key")
    p = check(g.endpoint, pki, cert=cert, key=key)
    assert p.returncode == 1
    assert f": {reason} ({cause}) - " in p.stdout, p.stdout
    assert wait_connections(g, 1) == 1  # one refusal in the node's log, not two


def test_name_mismatch(node, pki):
    g = node()
    p = check(g.endpoint, pki, name="othernode")
    assert p.returncode == 1 and ": node_name_mismatch - " in p.stdout, p.stdout


def test_identity_not_allowed(node, pki):
    g = node()
    cert, key = pki.issue("stranger", server=False)
    p = check(g.endpoint, pki, cert=cert, key=key)
    assert p.returncode == 1 and ": identity_not_allowed - " in p.stdout, p.stdout
    assert wait_connections(g, 1) == 1


def test_upstream_unavailable(node, pki):
    g = node(upstream=realpeer.reserve_port())
    p = check(g.endpoint, pki)
    assert p.returncode == 1 and ": upstream_unavailable - " in p.stdout, p.stdout
    assert wait_connections(g, 1) == 1


def test_version_not_accepted(node, pki, workdir):
    g = node()
    cfg = workdir / "connect.yaml"
    cfg.write_text(f"""
tls: {{cert: {pki.path(pki.client)}, key: {pki.path(pki.client, 'key')}, ca: {pki.path('ca')}}}
policy: {{accepted_versions: ["5.0.0"]}}
tunnels:
  - {{listen: "127.0.0.1:1", server: "{g.endpoint}", server_name: {pki.node}}}
""")
    p = subprocess.run([PYTHON, "-m", "rpcguard", "check", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and ": version_not_accepted - " in p.stdout and "7.0.0" in p.stdout, p.stdout
    assert "Traceback" not in p.stderr


def test_upstream_busy_in_refuse_mode_is_ok_busy(pki, workdir, rpc_server):
    """A session holds the node's single upstream; with upstream_busy: refuse the check says busy, exit 0."""
    from rpcguard.protocol import encode

    cfg = workdir / "busy.yaml"
    cfg.write_text(f"""
tls: {{cert: {pki.path(pki.node)}, key: {pki.path(pki.node, 'key')}, ca: {pki.path('ca')}}}
limits: {{upstream_busy: refuse}}
allow: {{cn: [{pki.client}]}}
listeners:
  - {{upstream: "127.0.0.1:{rpc_server}"}}
""")
    g = start_guard("serve", workdir, ["--config", str(cfg)])
    ctx = client_context(pki.path(pki.client), pki.path(pki.client, "key"), pki.path("ca"), server_name=pki.node)
    try:
        with socket.create_connection(("127.0.0.1", g.port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname=pki.node) as holder:
                holder.sendall(encode.hello_request((7, 0, 0)))
                assert len(holder.recv(64)) >= 8  # the node's HELLO reply: this session holds the upstream
                p = check(g.endpoint, pki)
        assert p.returncode == 0 and "TLS and identity accepted, server busy" in p.stdout, p.stdout
        assert g.value("rpcguard_refusals_total", reason="upstream_busy") == 0
    finally:
        g.stop()


def test_wrong_usage_of_the_node_certificate(tmp_path):
    """A node presenting a client (clientAuth) certificate: tls_failed (tls_bad_certificate)."""
    p = Pki(tmp_path)
    bad_cert, bad_key = p.issue("badnode", server=False)
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(bad_cert, bad_key)
    cctx = client_context(p.path(p.client), p.path(p.client, "key"), p.path("ca"), server_name="badnode")

    async def run():
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0, ssl=sctx)
        port = srv.sockets[0].getsockname()[1]
        try:
            return (await probe_node("n", "127.0.0.1", port, cctx, "badnode", timeout=5),
                    await tls_probe("n", "127.0.0.1", port, cctx, "badnode", timeout=5))
        finally:
            srv.close()

    for r in asyncio.run(run()):
        assert not r.ok and r.reason == "tls_failed" and r.cause == "tls_bad_certificate", r


def test_tls_probe_accepts_a_working_node_and_sends_no_hello(node, pki):
    g = node()
    ctx = client_context(pki.path(pki.client), pki.path(pki.client, "key"), pki.path("ca"), server_name=pki.node)
    r = asyncio.run(tls_probe("n", "127.0.0.1", g.port, ctx, pki.node, timeout=5))
    assert r.ok, r
    assert g.value("rpcguard_refusals_total") == 0
    now = dt.datetime.now(dt.timezone.utc)
    cert, key = pki.issue("oldclient2", server=False, not_before=now - dt.timedelta(days=3),
                          not_after=now - dt.timedelta(days=1))
    bad = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bad.load_verify_locations(pki.path("ca"))
    bad.load_cert_chain(cert, key)
    r = asyncio.run(tls_probe("n", "127.0.0.1", g.port, bad, pki.node, timeout=5))
    assert not r.ok and r.reason == "tls_failed", r  # the node refused it, cause unknown to the probe alone
    own = [w.kind for w in certificate_warnings(cert, pki.path("ca"))]
    r = asyncio.run(tls_probe("n", "127.0.0.1", g.port, bad, pki.node, timeout=5, own_warnings=own))
    assert not r.ok and r.reason == "tls_failed" and r.cause == "tls_cert_expired", r
    assert wait_connections(g, 3) == 3  # three probes, two connections, no HELLO: no session refused
    assert g.value("rpcguard_refusals_total", reason="upstream_busy") == 0


LONGCLIENT = Path(__file__).resolve().parent.parent / "support" / "longclient.py"


def test_check_of_a_live_node_held_by_llama_cpp_is_ok_busy_at_once(pair, pki, workdir, models):
    """The node's real server is held by a real llama.cpp client (as llama-server holds it for hours),
    and the node queues (upstream_busy: queue, 30 s): check answers at once, exit 0, and the node
    counts neither a refusal nor a session; the llama.cpp session is untouched."""
    connect, serve = pair()
    go = workdir / "go-1"
    cmd = [realpeer.realpeer_python(), str(LONGCLIENT), connect.endpoint, "-m", str(models["tiny"]), "-n", "4",
           "--wait", str(go)]
    client = realpeer.start(cmd, workdir / "longclient.log", "longclient")
    try:
        wait_for_line(client, "WAITING 1", 60)
        t0 = time.monotonic()
        p = check(serve.endpoint, pki)
        took = time.monotonic() - t0
        assert p.returncode == 0, p.stdout + p.stderr
        assert p.stdout.startswith("OK") and "TLS and identity accepted, server busy" in p.stdout, p.stdout
        assert took < 10, took  # not the node's 30 s queue timeout
        js = check(serve.endpoint, pki, "--json")
        (rec,) = [json.loads(line) for line in js.stdout.splitlines()]
        assert js.returncode == 0 and rec["ok"] is True and rec["busy"] is True and rec["node_mode"] == "enforce", rec
        wait_until(lambda: serve.value("rpcguard_sessions_total", result="probe") == 2, what="two probes ended")
        assert serve.value("rpcguard_refusals_total", reason="upstream_busy") == 0
        assert serve.value("rpcguard_refusals_total") == 0
        go.touch()  # the held session goes on
        assert client.popen.wait(60) == 0, client.output()
        assert "LONGCLIENT_OK" in client.output()
    finally:
        client.stop()


def test_a_plain_port_is_not_tls(pki, node, rpc_server):
    """check against the real ggml-rpc-server's own port and against a metrics (HTTP) port."""
    g = node()
    for port in (rpc_server, g.metrics_port):
        p = check(f"127.0.0.1:{port}", pki)
        assert p.returncode == 1 and ": not TLS (tls_failed: tls_not_tls) - " in p.stdout, (port, p.stdout)


def test_a_node_name_that_does_not_resolve_gets_the_hint(pki):
    p = check("nosuchnode.invalid:50100", pki, name="node1")  # .invalid never resolves (RFC 6761)
    assert p.returncode == 1 and ": node_unreachable - cannot reach the node: " in p.stdout, p.stdout
    assert "'nosuchnode.invalid' does not resolve here: give --server IP:PORT --server-name node1" in p.stdout, p.stdout
