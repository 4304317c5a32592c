"""rpcguard.proxy.readiness: the HELLO probe against servers that answer, lie, stay silent or are not there.

The real ggml-rpc-server's side is in tests/integration/test_check_readiness.py; these fakes are the
servers it cannot be (an HTTP server on the port, an old or unknown version, a silent accept).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading

import pytest

from rpcguard.proxy import readiness as readiness_mod
from rpcguard.proxy.readiness import NodeChecks, UpstreamProbe, hello_probe, readiness
from tests.support.realpeer import reserve_port

pytestmark = pytest.mark.timeout(30)
ALL = frozenset({(7, 0, 0), (3, 6, 1), (6, 0, 0)})


@contextlib.contextmanager
def fake_server(port: int, version: bytes | None = None, *, raw: bytes | None = None, old: bool = False,
                silent: bool = False):
    """A one-thread server on ``port``: answers HELLO with ``version`` (28-byte form; ``old``: only the
    empty HELLO of 1.0-3.6, with the 3-byte form, closing on the 24-byte one), or ``raw`` bytes, or nothing."""
    srv = socket.create_server(("127.0.0.1", port))
    srv.settimeout(0.2)
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                conn.settimeout(5)
                try:
                    head = conn.recv(9)
                    size = struct.unpack_from("<Q", head, 1)[0] if len(head) == 9 else 0
                    if size:
                        conn.recv(size)
                    if silent:
                        stop.wait(10)
                    elif raw is not None:
                        conn.sendall(raw)
                    elif old:
                        if size == 0:
                            conn.sendall(struct.pack("<Q", 3) + version)  # type: ignore[operator]
                        else:  # as the real 3.6.1 server: it hangs up on the caps unread, a reset
                            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    elif version is not None:
                        conn.sendall(struct.pack("<Q", 28) + version + bytes(25))
                except OSError:
                    pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)
        srv.close()


def probe(port: int, accepted=ALL, timeout: float = 3.0) -> tuple[bool, str]:
    return asyncio.run(hello_probe("127.0.0.1", port, accepted, timeout))


def test_a_server_that_answers_hello_with_an_accepted_version_is_ready():
    port = reserve_port()
    with fake_server(port, bytes([7, 0, 0])):
        ok, why = probe(port)
    assert ok and "protocol 7.0.0" in why, why


def test_a_pre_4_server_is_asked_again_with_the_empty_hello():
    port = reserve_port()
    with fake_server(port, bytes([3, 6, 1]), old=True):
        ok, why = probe(port)
    assert ok and "protocol 3.6.1" in why, why


def test_a_version_the_listener_does_not_accept_is_not_ready():
    port = reserve_port()
    with fake_server(port, bytes([9, 9, 9])):
        ok, why = probe(port)
    assert not ok and "speaks protocol 9.9.9, not accepted" in why, why


def test_an_http_server_on_the_upstream_port_is_not_ready():
    port = reserve_port()
    with fake_server(port, raw=b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"):
        ok, why = probe(port)
    assert not ok and "not a ggml-rpc-server" in why and "HTTP/1.1" in why, why


def test_nothing_listening_and_a_silent_accept():
    port = reserve_port()
    ok, why = probe(port)
    assert not ok and "unreachable" in why, why
    with fake_server(port, silent=True):
        ok, why = probe(port, timeout=0.5)
    assert not ok and "did not answer HELLO within 0.5 s" in why, why


def test_a_probe_that_gives_up_never_closes_under_the_unanswered_hello():
    """ggml-rpc-server does not ignore SIGPIPE: a probe that timed out and closed while its HELLO
    waited in the backlog (the server draining the last session, or slow under load) killed the
    server when it answered (a two-clone run: test_tenant_isolation_real's server died so). The
    probe half-closes; when it gives up, the connection lingers until the server hangs up."""
    port = reserve_port()
    srv = socket.create_server(("127.0.0.1", port))
    release, outcome = threading.Event(), {}

    def busy_server() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(10)
            got = b""
            while len(got) < 9 + 24:
                got += conn.recv(64)
            release.wait(10)  # "busy": it answers only after the probe gave up
            try:
                conn.sendall(struct.pack("<Q", 28))  # two writes, as ggml-rpc's send_msg does
                conn.sendall(bytes([7, 0, 0]) + bytes(25))
                outcome["eof"] = conn.recv(1) == b""  # the probe's half-close, then it hangs up
            except OSError as exc:  # EPIPE / ECONNRESET: the real server would have died (SIGPIPE)
                outcome["error"] = exc

    t = threading.Thread(target=busy_server, daemon=True)
    t.start()

    async def main() -> None:
        ok, why = await hello_probe("127.0.0.1", port, ALL, 0.3)
        assert not ok and "did not answer HELLO within 0.3 s" in why, why
        assert readiness_mod.LINGERING  # still open
        release.set()
        await asyncio.wait_for(asyncio.gather(*readiness_mod.LINGERING), 10)  # closed once the server hung up

    try:
        asyncio.run(main())
        t.join(10)
    finally:
        srv.close()
    assert outcome == {"eof": True}, outcome


def test_read_never_waits_and_an_upstream_in_use_is_ready():
    port = reserve_port()
    busy = [False]
    p = UpstreamProbe("127.0.0.1", port, lambda: ALL, lambda: busy[0])
    assert p.read() == (False, f"upstream 127.0.0.1:{port} not probed yet")
    busy[0] = True
    assert p.read()[0] is True and "in use by a session" in p.read()[1]
    busy[0] = False
    asyncio.run(p.probe_now())
    assert p.read()[0] is False and "unreachable" in p.read()[1]


# ---------------------------------------------------------------- readiness(): the /readyz verdict


def _listener(name: str, *, guard: bool = False, draining: bool = False, provider=None, probe=None):
    from types import SimpleNamespace

    route = SimpleNamespace(name=name, upstream_host="127.0.0.1", upstream_port=1, server_name=None,
                            draining=draining, provider=provider, traffic=SimpleNamespace(upstream_up=None),
                            side=SimpleNamespace(upstream_is_guard=guard))
    return SimpleNamespace(route=route, probe=probe)


class _Pool:
    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def ready(self) -> tuple[bool, str]:
        return self.ok, "2 of 2 servers up" if self.ok else "no server could start"


def _nodes() -> NodeChecks:
    def no_probe():
        raise AssertionError("a fresh outcome must answer without a probe")
    return NodeChecks(no_probe, lambda: 1.0, list)


def test_draining_or_an_expired_certificate_is_not_ready():
    import time

    ok_pool = _listener("a", provider=_Pool(True))
    assert asyncio.run(readiness([ok_pool], {"cert": time.time() + 60}, None)) == (True, "a: upstream 2 of 2 servers up")
    assert asyncio.run(readiness([ok_pool], {"cert": time.time() - 1}, None)) == (
        False, "cert certificate in use expired")
    draining = _listener("b", provider=_Pool(True), draining=True)
    assert asyncio.run(readiness([ok_pool, draining], {}, None)) == (False, "draining: not accepting new sessions")


def test_serve_reads_its_pool_and_sets_the_upstream_gauge():
    bad = _listener("a", provider=_Pool(False))
    assert asyncio.run(readiness([bad], {}, None)) == (False, "a: upstream no server could start")
    assert bad.route.traffic.upstream_up is False


def test_connect_trusts_a_fresh_session_outcome_without_probing():
    nodes = _nodes()
    tunnel = _listener("t", guard=True)
    nodes.note({"listener": "t", "result": "ok", "version": "7.0.0"})
    assert asyncio.run(readiness([tunnel], {}, nodes)) == (True, "t: node answers (a session got through)")
    nodes.note({"listener": "t", "result": "refused", "reason": "identity_not_allowed", "detail": "cn=x"})
    assert asyncio.run(readiness([tunnel], {}, nodes)) == (
        False, "t: node 127.0.0.1:1: identity_not_allowed: cn=x")
    nodes.note({"listener": "t", "result": "refused", "reason": "upstream_busy"})  # says nothing about the node
    assert asyncio.run(readiness([tunnel], {}, nodes))[0] is False
