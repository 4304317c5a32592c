"""Revocation with the real server and a real llama.cpp client (issue 31.4, docs/revocation.md).

A certificate put on the CRL (``rpcguard certs revoke``) is refused at the next handshake, and a
reload ends its live session; an identity a reload takes off the allow-list loses its live session
too; a session ends at its client certificate's notAfter. Other tenants are untouched throughout.
"""

from __future__ import annotations

import datetime as dt
import signal

import pytest

from rpcguard.pki import certs, crl
from tests.integration.test_ops import LongClient, closed_after, session_end_line, tls_open
from tests.support import realpeer
from tests.support.guard import start_guard

pytestmark = pytest.mark.timeout(240)


def reload(serve, n: int) -> None:
    serve.proc.popen.send_signal(signal.SIGHUP)
    assert serve.wait_value("rpcguard_reload_total", n, result="ok") == n, serve.output()[-3000:]


def test_revoked_certificate_loses_its_live_session_and_its_next_handshake(pki, models, workdir, rpc_server):
    victim = pki.issue("victim", server=False, uris=["spiffe://lab/llama/victim"])
    crl_path = crl.write_crl(pki.dir)  # empty to start with
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args(),
                                           "--crl", str(crl_path)])
    to_victim = start_guard("connect", workdir, ["--server", f"127.0.0.1:{serve.port}", "--server-name", pki.node,
                                                 *pki.connect_args(*victim)])
    to_other = start_guard("connect", workdir, ["--server", f"127.0.0.1:{serve.port}", "--server-name", pki.node,
                                                *pki.connect_args()])
    long = LongClient(workdir, to_victim.endpoint, models["tiny"], rounds=1)
    try:
        long.wait_for("WAITING 1")  # a real llama.cpp session holds its model on the node
        crl.revoke(pki.dir, victim[0])
        reload(serve, 1)
        assert "certificate_revoked" in session_end_line(serve, "certificate_revoked")
        assert serve.wait_value("rpcguard_refusals_total", 1, reason="certificate_revoked") == 1
        long.go(1)
        assert long.finish() != 0  # its session is gone: llama.cpp cannot compute on the node any more
    finally:
        long.stop()
    # the next handshake of the revoked certificate is refused, counted under its own reason
    with pytest.raises(Exception):
        with tls_open(pki, serve.port, cert=victim[0], key=victim[1]) as s:
            closed_after(s)
    assert serve.wait_value("rpcguard_tls_handshake_failures_total", 1, reason="tls_cert_revoked") >= 1
    # another tenant is served as before, on the slot the revoked session held
    run = realpeer.run_client(to_other.endpoint, models["tiny"], n=4)
    assert run.ok, run.output[-3000:]
    for g in (to_victim, to_other, serve):
        g.stop()


def test_reload_ends_the_sessions_of_an_identity_taken_off_the_allow_list(pki, workdir, rpc_server, tmp_path):
    gone = pki.issue("gone", server=False, uris=["spiffe://lab/llama/gone"])
    cfg = tmp_path / "serve.yaml"
    tls = f"tls: {{cert: {pki.path(pki.node)}, key: {pki.path(pki.node, 'key')}, ca: {pki.path('ca')}}}\n"
    listener = f"listeners: [{{listen: '127.0.0.1:0', upstream: '127.0.0.1:{rpc_server}'}}]\n"
    cfg.write_text(tls + listener + "allow: {uri: ['spiffe://lab/llama/gone', 'spiffe://lab/llama/stays']}\n")
    serve = start_guard("serve", workdir, ["--config", str(cfg)])
    with tls_open(pki, serve.port, cert=gone[0], key=gone[1]) as s:  # HELLO answered: the session is live
        cfg.write_text(tls + listener + "allow: {uri: ['spiffe://lab/llama/stays']}\n")
        reload(serve, 1)
        assert closed_after(s) < 15
    assert "identity_not_allowed" in session_end_line(serve, "identity_not_allowed")
    serve.stop()


def test_a_session_never_outlives_its_client_certificate(pki, workdir, rpc_server):
    now = dt.datetime.now(dt.timezone.utc)
    short = certs.issue(pki.dir, "short", server=False, force=True, not_before=now - dt.timedelta(minutes=1),
                        not_after=now + dt.timedelta(seconds=20))
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args()])
    with tls_open(pki, serve.port, cert=str(short.cert), key=str(short.key)) as s:  # HELLO answered
        left = short_left = (now + dt.timedelta(seconds=20) - dt.datetime.now(dt.timezone.utc)).total_seconds()
        assert left > 0, "the machine took over 20 s to start serve and open one session"
        assert closed_after(s, timeout=short_left + 30) >= 0
    line = session_end_line(serve, "tls_cert_expired")
    assert "result=refused" in line, line
    serve.stop()
