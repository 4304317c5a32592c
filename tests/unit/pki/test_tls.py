"""rpcguard.pki.tls: context settings, file checks, and error classification on real loopback handshakes.

Each handshake test runs a blocking server in a thread and a client in the test thread, both with
socket timeouts. The client reads once after its handshake: with TLS 1.3 a client learns that the
server refused its certificate only from the alert that arrives after its own handshake finished.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import socket
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from rpcguard.pki import certs, tls
from rpcguard.errors import PolicyRefusal
from rpcguard.pki.tls import TlsConfigError, classify_handshake_error
from tests.support import need
from tests.support.loops import UVLOOP_INSTALL

pytestmark = pytest.mark.timeout(30)
IO_TIMEOUT_S = 5.0  # bounds every blocking call; a healthy loopback handshake takes milliseconds
NOW = dt.datetime.now(dt.timezone.utc)
PAST = {"not_before": NOW - dt.timedelta(days=3), "not_after": NOW - dt.timedelta(days=1)}


@dataclass
class Pki:
    dir: Path
    other: Path  # a second, unrelated CA

    def pair(self, name: str, other: bool = False) -> tuple[str, str]:
        d = self.other if other else self.dir
        return str(d / f"{name}.pem"), str(d / f"{name}.key")

    @property
    def ca(self) -> str:
        return str(self.dir / "ca.pem")

    def server_ctx(self, **kw) -> ssl.SSLContext:
        return tls.server_context(*self.pair("server"), self.ca, **kw)

    def client_ctx(self, name: str = "client", **kw) -> ssl.SSLContext:
        return tls.client_context(*self.pair(name), self.ca, server_name=kw.pop("server_name", "localhost"), **kw)


@pytest.fixture
def pki(tmp_path) -> Pki:
    d, o = tmp_path / "pki", tmp_path / "other"
    certs.init_ca(d)
    certs.init_ca(o)
    certs.issue(d, "server", server=True, dns=["localhost"], ips=["127.0.0.1"])
    certs.issue(d, "client", server=False, uris=["spiffe://lab/llama"])
    certs.issue(d, "expired_client", server=False, **PAST)
    certs.issue(d, "expired_server", server=True, dns=["localhost"], **PAST)
    certs.issue(o, "client", server=False)
    certs.issue(o, "server", server=True, dns=["localhost"])
    return Pki(d, o)


def raw_context(protocol: int, pair=None, ca: str | None = None, max_version=None) -> ssl.SSLContext:
    """A context built without rpcguard's checks, to play a misconfigured or foreign peer."""
    ctx = ssl.SSLContext(protocol)
    ctx.verify_mode = ssl.CERT_REQUIRED
    if ca:
        ctx.load_verify_locations(ca)
    if pair:
        ctx.load_cert_chain(*pair)
    if max_version:
        ctx.maximum_version = max_version
    return ctx


@dataclass
class Outcome:
    error: BaseException | None = None
    identity: object = None
    version: str | None = None
    cipher: str | None = None

    @property
    def reason(self) -> str:
        return "ok" if self.error is None else classify_handshake_error(self.error)


def _serve(listener: socket.socket, server_side, out: Outcome) -> None:
    try:
        conn, _ = listener.accept()
    except BaseException as exc:  # pragma: no cover - only on a broken test
        out.error = exc
        return
    with conn:
        conn.settimeout(IO_TIMEOUT_S)
        try:
            server_side(conn, out)
        except BaseException as exc:
            out.error = exc


def _tls_server(ctx: ssl.SSLContext):
    def run(conn: socket.socket, out: Outcome) -> None:
        with ctx.wrap_socket(conn, server_side=True) as t:
            out.identity, out.version, out.cipher = tls.peer_identity(t), t.version(), t.cipher()[0]
            t.sendall(b"ok")
            t.recv(16)  # until the client closes
    return run


def run_pair(server_side, client_side) -> tuple[Outcome, Outcome]:
    """Run ``server_side(conn, out)`` in a thread against ``client_side(sock, out)``."""
    server, client = Outcome(), Outcome()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(IO_TIMEOUT_S)
        thread = threading.Thread(target=_serve, args=(listener, server_side, server), daemon=True)
        thread.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=IO_TIMEOUT_S) as sock:
                client_side(sock, client)
        except BaseException as exc:
            client.error = exc
        thread.join(IO_TIMEOUT_S * 2)
        assert not thread.is_alive()
    return server, client


def tls_client(ctx: ssl.SSLContext, host: str = "localhost"):
    def run(sock: socket.socket, out: Outcome) -> None:
        with ctx.wrap_socket(sock, server_hostname=host) as t:
            out.version, out.cipher = t.version(), t.cipher()[0]
            out.identity = tls.peer_identity(t)
            if t.recv(2) != b"ok":  # a TLS 1.3 refusal of our certificate surfaces here
                raise AssertionError("server closed without data")
    return run


def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, host: str = "localhost"):
    return run_pair(_tls_server(server_ctx), tls_client(client_ctx, host))


# -- successful handshakes -------------------------------------------------------------------


def test_mutual_tls_13_and_identities(pki):
    server, client = handshake(pki.server_ctx(), pki.client_ctx())
    assert (server.reason, client.reason) == ("ok", "ok")
    assert server.version == client.version == "TLSv1.3"
    assert server.cipher in ("TLS_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256", "TLS_CHACHA20_POLY1305_SHA256")
    assert server.identity.common_name == "client" and server.identity.uris == ("spiffe://lab/llama",)
    assert client.identity.dns == ("localhost",) and client.identity.ips == ("127.0.0.1",)


def test_client_may_verify_server_by_ip(pki):
    server, client = handshake(pki.server_ctx(), pki.client_ctx(server_name="127.0.0.1"), host="127.0.0.1")
    assert (server.reason, client.reason) == ("ok", "ok")


def test_tls_12_is_opt_in(pki):
    client12 = raw_context(ssl.PROTOCOL_TLS_CLIENT, pki.pair("client"), pki.ca, max_version=ssl.TLSVersion.TLSv1_2)
    server, client = handshake(pki.server_ctx(min_version="1.2"), client12)
    assert (server.reason, client.reason) == ("ok", "ok")
    assert server.version == "TLSv1.2"
    assert server.cipher.startswith("ECDHE-ECDSA-AES128-GCM")  # AES-GCM preferred by the server
    # a 1.2 server still negotiates 1.3 with a modern client
    server, client = handshake(pki.server_ctx(min_version="1.2"), pki.client_ctx())
    assert server.version == "TLSv1.3"


# -- failed handshakes: (server reason, client reason) as observed on real loopback ----------


def test_client_without_certificate(pki):
    # S: PEER_DID_NOT_RETURN_A_CERTIFICATE; C (after handshake): TLSV13_ALERT_CERTIFICATE_REQUIRED
    server, client = handshake(pki.server_ctx(), raw_context(ssl.PROTOCOL_TLS_CLIENT, None, pki.ca))
    assert (server.reason, client.reason) == ("tls_no_client_cert", "tls_no_client_cert")
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in str(server.error)
    assert "CERTIFICATE_REQUIRED" in str(client.error)


def test_client_without_certificate_tls12(pki):
    client12 = raw_context(ssl.PROTOCOL_TLS_CLIENT, None, pki.ca, max_version=ssl.TLSVersion.TLSv1_2)
    server, client = handshake(pki.server_ctx(min_version="1.2"), client12)
    # TLS 1.2 sends a generic handshake_failure alert: the client cannot tell why.
    assert (server.reason, client.reason) == ("tls_no_client_cert", "tls_handshake_failed")


def test_client_from_another_ca(pki):
    # S: verify failed "unable to get local issuer certificate"; C: TLSV1_ALERT_UNKNOWN_CA
    other = raw_context(ssl.PROTOCOL_TLS_CLIENT, pki.pair("client", other=True), pki.ca)
    server, client = handshake(pki.server_ctx(), other)
    assert (server.reason, client.reason) == ("tls_unknown_ca", "tls_unknown_ca")


def test_server_from_another_ca(pki):
    other = raw_context(ssl.PROTOCOL_TLS_SERVER, pki.pair("server", other=True), pki.ca)
    server, client = handshake(other, pki.client_ctx())
    assert (server.reason, client.reason) == ("tls_unknown_ca", "tls_unknown_ca")


def test_expired_client_certificate(pki):
    # S: verify failed "certificate has expired"; C: SSLV3_ALERT_CERTIFICATE_EXPIRED
    expired = raw_context(ssl.PROTOCOL_TLS_CLIENT, pki.pair("expired_client"), pki.ca)
    server, client = handshake(pki.server_ctx(), expired)
    assert (server.reason, client.reason) == ("tls_cert_expired", "tls_cert_expired")


def test_expired_server_certificate(pki):
    # server_context loads an expired certificate (renewal is the operator's job; the expiry metric shows it)
    expired = tls.server_context(*pki.pair("expired_server"), pki.ca)
    server, client = handshake(expired, pki.client_ctx())
    assert (server.reason, client.reason) == ("tls_cert_expired", "tls_cert_expired")


def test_server_certificate_used_as_client(pki):
    # S: verify failed "unsuitable certificate purpose"; C: SSLV3_ALERT_UNSUPPORTED_CERTIFICATE
    wrong = raw_context(ssl.PROTOCOL_TLS_CLIENT, pki.pair("server"), pki.ca)
    server, client = handshake(pki.server_ctx(), wrong)
    assert (server.reason, client.reason) == ("tls_bad_certificate", "tls_bad_certificate")


def test_client_certificate_used_as_server(pki):
    wrong = raw_context(ssl.PROTOCOL_TLS_SERVER, pki.pair("client"), pki.ca)
    server, client = handshake(wrong, pki.client_ctx())
    assert (server.reason, client.reason) == ("tls_bad_certificate", "tls_bad_certificate")


@pytest.mark.parametrize("host", ["node9.lab", "127.0.0.2"])
def test_server_name_mismatch(pki, host):
    # C: "Hostname mismatch, ..." / "IP address mismatch, ..."; S: SSLV3_ALERT_BAD_CERTIFICATE
    server, client = handshake(pki.server_ctx(), pki.client_ctx(server_name=host), host=host)
    assert (server.reason, client.reason) == ("tls_bad_certificate", "node_name_mismatch")


def test_tls12_client_against_tls13_server(pki):
    # S: UNSUPPORTED_PROTOCOL; C: TLSV1_ALERT_PROTOCOL_VERSION
    old = raw_context(ssl.PROTOCOL_TLS_CLIENT, pki.pair("client"), pki.ca, max_version=ssl.TLSVersion.TLSv1_2)
    server, client = handshake(pki.server_ctx(), old)
    assert (server.reason, client.reason) == ("tls_protocol_version", "tls_protocol_version")


def test_tls13_client_against_tls12_only_server(pki):
    old = raw_context(ssl.PROTOCOL_TLS_SERVER, pki.pair("server"), pki.ca, max_version=ssl.TLSVersion.TLSv1_2)
    server, client = handshake(old, pki.client_ctx())
    assert (server.reason, client.reason) == ("tls_protocol_version", "tls_protocol_version")


def _raw_client(data: bytes | None):
    def run(sock: socket.socket, out: Outcome) -> None:
        if data:
            sock.sendall(data)
            try:
                sock.recv(64)
            except OSError:
                pass
    return run


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP_REQUEST"),
        (bytes([14]) + (0).to_bytes(8, "little"), "WRONG_VERSION_NUMBER"),  # a ggml-rpc HELLO in clear
        (b"\x00" * 64, "WRONG_VERSION_NUMBER"),
        (b"\x16\x03\x01\xff\xff" + b"\x00" * 16, "PACKET_LENGTH_TOO_LONG"),
        (None, "UNEXPECTED_EOF"),  # connect and close: a port probe
    ],
)
def test_plain_tcp_on_tls_port(pki, data, message):
    server, _ = run_pair(_tls_server(pki.server_ctx()), _raw_client(data))
    assert server.reason == "tls_not_tls"
    assert message in str(server.error)


@pytest.mark.parametrize("reply", [b"", b"\x00\x00\x00\x00\x00\x00\x00\x00"])
def test_tls_client_against_plain_server(pki, reply):
    # A plain ggml-rpc-server that closes (C: UNEXPECTED_EOF) or answers garbage (C: WRONG_VERSION_NUMBER)
    def plain(conn: socket.socket, out: Outcome) -> None:
        conn.recv(4096)
        conn.sendall(reply)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(4096)

    _, client = run_pair(plain, tls_client(pki.client_ctx()))
    assert client.reason == "tls_not_tls"


def test_silent_client_times_out(pki):
    def server_side(conn: socket.socket, out: Outcome) -> None:
        conn.settimeout(0.2)
        pki.server_ctx().wrap_socket(conn, server_side=True)

    def silent(sock: socket.socket, out: Outcome) -> None:
        sock.recv(1)  # returns when the server gives up and closes

    server, _ = run_pair(server_side, silent)
    assert isinstance(server.error, TimeoutError)
    assert server.reason == "tls_handshake_timeout"


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_asyncio_start_tls_handshake_timeout(pki, loop_name):
    """The relay upgrades with ``loop.start_tls``; its timeout is a ConnectionAbortedError."""
    if loop_name == "uvloop":
        uvloop = need.module("uvloop", UVLOOP_INSTALL)
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    ctx = pki.server_ctx()

    async def main() -> BaseException | None:
        done: asyncio.Future = loop.create_future()

        class Upgrade(asyncio.Protocol):
            def connection_made(self, transport):
                async def up():
                    try:
                        await loop.start_tls(transport, self, ctx, server_side=True, ssl_handshake_timeout=0.2)
                        done.set_result(None)
                    except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
                        done.set_result(exc)
                loop.create_task(up())

        server = await loop.create_server(Upgrade, "127.0.0.1", 0)
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname())
        try:
            return await asyncio.wait_for(done, IO_TIMEOUT_S)
        finally:
            writer.close()
            server.close()

    try:
        error = loop.run_until_complete(main())
    finally:
        loop.close()
    assert error is not None and classify_handshake_error(error) == "tls_handshake_timeout"


# -- classification details -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (TimeoutError("timed out"), "tls_handshake_timeout"),
        (asyncio.TimeoutError(), "tls_handshake_timeout"),
        (socket.timeout("The read operation timed out"), "tls_handshake_timeout"),
        (ConnectionResetError(104, "Connection reset by peer"), "tls_handshake_failed"),
        (ssl.SSLError(1, "[SSL: NO_SHARED_CIPHER] no shared cipher"), "tls_handshake_failed"),
        (ssl.SSLError(1, "[SSL: RECORD_LAYER_FAILURE] record layer failure"), "tls_not_tls"),
        (ssl.SSLError(1, "[SSL: NO_PROTOCOLS_AVAILABLE] no protocols available"), "tls_protocol_version"),
        (ValueError("something else"), "tls_handshake_failed"),
    ],
)
def test_classify_synthetic(exc, reason):
    assert classify_handshake_error(exc) == reason


def test_classify_follows_causes():
    try:
        try:
            raise ssl.SSLError(1, "[SSL: UNSUPPORTED_PROTOCOL] unsupported protocol")
        except ssl.SSLError as inner:
            raise ConnectionError("SSL handshake failed") from inner
    except ConnectionError as outer:
        assert classify_handshake_error(outer) == "tls_protocol_version"


def test_reason_table_uses_only_stable_reasons():
    stable = {"tls_no_client_cert", "tls_unknown_ca", "tls_cert_expired", "tls_bad_certificate", "tls_not_tls",
              "tls_protocol_version", "tls_handshake_failed", "tls_handshake_timeout", "node_name_mismatch",
              "tls_cert_revoked", "tls_crl_expired"}
    assert {reason for _, reason in tls.HANDSHAKE_ERROR_REASONS} <= stable
    assert all(needle == needle.lower() for needle, _ in tls.HANDSHAKE_ERROR_REASONS)


def test_peer_identity_without_certificate():
    class NoCert:
        def getpeercert(self, binary_form=False):
            return None

    with pytest.raises(PolicyRefusal) as info:
        tls.peer_identity(NoCert())  # type: ignore[arg-type]
    assert info.value.reason == "tls_no_client_cert"


# -- context settings ------------------------------------------------------------------------


def test_context_settings(pki):
    for ctx in (pki.server_ctx(), pki.client_ctx()):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.options & ssl.OP_NO_COMPRESSION
        assert ctx.verify_flags & ssl.VERIFY_X509_STRICT
        assert ctx.cert_store_stats()["x509_ca"] == 1  # our CA only, never the system store
        assert [c["subject"] for c in ctx.get_ca_certs()] == [((("commonName", "rpcguard CA"),),)]
    assert pki.client_ctx().check_hostname
    assert pki.server_ctx().options & ssl.OP_CIPHER_SERVER_PREFERENCE
    ctx12 = pki.server_ctx(min_version="1.2")
    assert ctx12.minimum_version == ssl.TLSVersion.TLSv1_2
    tls12 = [c for c in ctx12.get_ciphers() if c["protocol"] == "TLSv1.2"]
    assert tls12 and all(c["kea"] == "kx-ecdhe" and c["aead"] for c in tls12)
    assert "GCM" in tls12[0]["name"]


def test_bad_min_version(pki):
    with pytest.raises(TlsConfigError, match="min_version"):
        pki.server_ctx(min_version="1.1")


def test_bad_server_name(pki):
    with pytest.raises(TlsConfigError, match="server_name"):
        pki.client_ctx(server_name="")


def _write(path: Path, data: bytes | str, mode: int = 0o600) -> str:
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    os.chmod(path, mode)
    return str(path)


def test_missing_files_are_named(pki, tmp_path):
    cert, key = pki.pair("server")
    missing = str(tmp_path / "nope.pem")
    for args in ((missing, key, pki.ca), (cert, missing, pki.ca), (cert, key, missing)):
        with pytest.raises(TlsConfigError, match="nope.pem: cannot read"):
            tls.server_context(*args)


def test_not_pem_files_are_named(pki, tmp_path):
    cert, key = pki.pair("server")
    junk = _write(tmp_path / "junk.pem", "not pem")
    with pytest.raises(TlsConfigError, match="junk.pem: not a PEM certificate"):
        tls.server_context(junk, key, pki.ca)
    with pytest.raises(TlsConfigError, match="junk.pem: not a PEM private key"):
        tls.server_context(cert, junk, pki.ca)
    with pytest.raises(TlsConfigError, match="junk.pem: not a PEM CA"):
        tls.server_context(cert, key, junk)


def test_key_must_match_certificate(pki):
    cert, _ = pki.pair("server")
    _, other_key = pki.pair("client")
    with pytest.raises(TlsConfigError, match="does not match certificate"):
        tls.server_context(cert, other_key, pki.ca)


def test_encrypted_key_is_refused(pki, tmp_path):
    cert, key = pki.pair("server")
    loaded = serialization.load_pem_private_key(Path(key).read_bytes(), None)
    enc = loaded.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.BestAvailableEncryption(b"pw"))
    with pytest.raises(TlsConfigError, match="encrypted"):
        tls.server_context(cert, _write(tmp_path / "enc.key", enc), pki.ca)


@pytest.mark.skipif(os.name != "posix", reason="POSIX modes")
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_key_readable_by_others_is_refused(pki, mode):
    cert, key = pki.pair("server")
    if os.geteuid() == 0:
        os.chown(key, 65534, -1)  # the owner rule (0600) applies to keys not owned by root
    os.chmod(key, mode)
    with pytest.raises(TlsConfigError, match="accessible by others"):
        tls.server_context(cert, key, pki.ca)
    tls.server_context(cert, key, pki.ca, allow_insecure_key_perms=True)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs root to own the key as root")
def test_root_owned_key_may_be_group_readable(pki):
    cert, key = pki.pair("server")
    os.chmod(key, 0o640)  # like PostgreSQL: root:service 0640 is fine
    tls.server_context(cert, key, pki.ca)
    os.chmod(key, 0o660)
    with pytest.raises(TlsConfigError, match="accessible by others"):
        tls.server_context(cert, key, pki.ca)


@pytest.mark.skipif(os.name != "posix", reason="POSIX modes")
def test_key_world_readable_is_refused_even_for_root(pki):
    cert, key = pki.pair("server")
    os.chmod(key, 0o644)
    with pytest.raises(TlsConfigError, match=r"accessible by others \(mode 0644\)"):
        tls.server_context(cert, key, pki.ca)
    os.chmod(key, 0o400)
    tls.server_context(cert, key, pki.ca)


def test_role_must_match_eku(pki):
    with pytest.raises(TlsConfigError, match="extended key usage for a server"):
        tls.server_context(*pki.pair("client"), pki.ca)
    with pytest.raises(TlsConfigError, match="extended key usage for a client"):
        tls.client_context(*pki.pair("server"), pki.ca, server_name="localhost")


def test_ca_file_must_hold_ca_certificates(pki):
    with pytest.raises(TlsConfigError, match="is not a CA certificate"):
        tls.server_context(*pki.pair("server"), pki.pair("client")[0])


# -- ALPN and the transport's SSLObject ------------------------------------------------------


def bio_handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext):
    """A handshake between two SSLObjects over memory BIOs (what uvloop's TLS transport drives);
    returns (server, client, pump) where ``pump()`` moves the pending records both ways."""
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname="localhost")

    def pump() -> None:
        s_in.write(c_out.read())
        c_in.write(s_out.read())

    done = set()
    for _ in range(10):
        for side in (client, server):
            try:
                side.do_handshake()
                done.add(side)
            except ssl.SSLWantReadError:
                pass
            pump()
        if len(done) == 2:
            return server, client, pump
    raise AssertionError("handshake did not finish")


def test_two_rpcguard_ends_negotiate_alpn_and_others_do_not(pki):
    server, client, _ = bio_handshake(pki.server_ctx(), pki.client_ctx())
    assert tls.negotiated_rpcguard(server) and tls.negotiated_rpcguard(client)
    # A node that is not rpcguard (stunnel, HAProxy, an old serve) offers no ALPN: nothing is
    # negotiated, the handshake still works, and connect keeps validating requests itself.
    plain = pki.server_ctx()
    plain.set_alpn_protocols([])
    client = bio_handshake(plain, pki.client_ctx())[1]
    assert not tls.negotiated_rpcguard(client) and client.selected_alpn_protocol() is None
    other = pki.server_ctx()
    other.set_alpn_protocols(["h2"])
    assert not tls.negotiated_rpcguard(bio_handshake(other, pki.client_ctx())[1])
    assert not tls.negotiated_rpcguard(None)


@pytest.mark.parametrize("enforcing", [True, False])
def test_the_node_says_in_the_handshake_whether_it_enforces(pki, enforcing):
    server, client, _ = bio_handshake(pki.server_ctx(enforcing=enforcing), pki.client_ctx())
    # connect leaves its request checks only to a node that said it enforces them all
    assert tls.node_enforces(client) is enforcing and tls.negotiated_rpcguard(client) is enforcing
    assert tls.node_mode(client) == ("enforce" if enforcing else "monitor")
    assert not tls.is_probe(server)
    # a probe (rpcguard check, connect's /readyz) says so, and still learns the node's mode
    server, client, _ = bio_handshake(pki.server_ctx(enforcing=enforcing), pki.client_ctx(probe=True))
    assert tls.is_probe(server) and tls.is_probe(client)
    assert tls.node_mode(client) == ("enforce" if enforcing else "monitor") and not tls.node_enforces(client)


def test_an_older_serve_that_says_only_rpcguard_1_is_not_trusted_to_enforce(pki):
    # serve before the mode was said offered "rpcguard/1" whatever its mode: connect now checks itself
    old = pki.server_ctx()
    old.set_alpn_protocols(["rpcguard/1"])
    server, client, _ = bio_handshake(old, pki.client_ctx())
    assert client.selected_alpn_protocol() is None and not tls.node_enforces(client) and tls.node_mode(client) is None
    # ... and an older connect (offering only "rpcguard/1") negotiates nothing with a node today
    older = pki.client_ctx()
    older.set_alpn_protocols(["rpcguard/1"])
    server, client, _ = bio_handshake(pki.server_ctx(enforcing=False), older)
    assert client.selected_alpn_protocol() is None


@pytest.mark.parametrize("enforcing", [True, False])
def test_the_end_notice_is_negotiated_only_between_two_ends_that_know_it(pki, enforcing):
    mode = "enforce" if enforcing else "monitor"
    server, client, _ = bio_handshake(pki.server_ctx(enforcing=enforcing), pki.client_ctx())
    assert tls.notices(server) and tls.notices(client)
    assert client.selected_alpn_protocol() == f"rpcguard/1+{mode}+notice"
    assert tls.node_mode(client) == mode and tls.node_enforces(client) is enforcing
    # a connect of before the notice offers the plain forms: it gets the plain one, no notice
    old_connect = pki.client_ctx()
    old_connect.set_alpn_protocols(["rpcguard/1+enforce", "rpcguard/1+monitor"])
    server, client, _ = bio_handshake(pki.server_ctx(enforcing=enforcing), old_connect)
    assert client.selected_alpn_protocol() == f"rpcguard/1+{mode}" and not tls.notices(server)
    # a serve of before the notice offers its mode and the probe form: a new connect gets the mode
    old_serve = pki.server_ctx(enforcing=enforcing)
    old_serve.set_alpn_protocols([f"rpcguard/1+{mode}", f"rpcguard/1+{mode}+probe"])
    server, client, _ = bio_handshake(old_serve, pki.client_ctx())
    assert client.selected_alpn_protocol() == f"rpcguard/1+{mode}" and not tls.notices(client)
    assert tls.node_enforces(client) is enforcing
    # a probe never negotiates the notice
    server, client, _ = bio_handshake(pki.server_ctx(enforcing=enforcing), pki.client_ctx(probe=True))
    assert tls.is_probe(server) and not tls.notices(server)


def test_transport_sslobject_calls_the_c_methods_and_moves_the_same_bytes(pki):
    server, client, pump = bio_handshake(pki.server_ctx(), pki.client_ctx())
    assert isinstance(client, tls.DirectSSLObject) and client.read == client._sslobj.read
    assert client.write(b"ab" * 20000) == 40000
    pump()
    buf = bytearray(65536)
    got = bytearray()
    while len(got) < 40000:  # read(n, buffer) as uvloop calls it, then read(n) and pending()
        got += buf[: server.read(65536, buf)] if len(got) < 20000 else server.read(65536)
    assert got == b"ab" * 20000 and server.pending() == 0
    with pytest.raises(ssl.SSLWantReadError):
        server.read(10)


# -- what serve and connect read without cryptography (docs/performance.md, memory) --------------


def _leaf_without_eku(pki, name: str, ekus) -> tuple[str, str]:
    """A client leaf of the CA whose extended key usage is ``ekus`` (None: no such extension)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_cert, ca_key = certs._load_ca(pki.dir)
    key = ec.generate_private_key(ec.SECP256R1())
    b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
         .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(NOW - dt.timedelta(hours=1)).not_valid_after(NOW + dt.timedelta(days=1))
         .add_extension(x509.SubjectAlternativeName([x509.DNSName("Upper.Lab"), x509.IPAddress(
             __import__("ipaddress").ip_address("2001:db8::1")), x509.UniformResourceIdentifier("spiffe://lab/x")]),
             critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    if ekus is not None:
        b = b.add_extension(x509.ExtendedKeyUsage([x509.ObjectIdentifier(o) for o in ekus]), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    path = pki.dir / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = pki.dir / f"{name}.key"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_path, 0o600)
    return str(path), str(key_path)


@pytest.mark.parametrize("ekus", [None, ["1.3.6.1.5.5.7.3.2", "2.5.29.37.0"], ["1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2", "1.2.3.4.5"]])
def test_peer_identity_from_openssl_agrees_with_cryptography(pki, ekus):
    """peer_identity reads getpeercert() (names, serial, dates) and the EKU from the DER, never
    cryptography: it must say what cryptography's reading of the same certificate says."""
    from rpcguard.pki.identity import PeerIdentity

    cert, key = _leaf_without_eku(pki, "odd", ekus)
    for ctx in (tls.client_context(cert, key, pki.ca, server_name="localhost"), pki.client_ctx()):
        server, _, _ = bio_handshake(pki.server_ctx(), ctx)
        assert tls.peer_identity(server) == PeerIdentity.from_der(server.getpeercert(binary_form=True))
    server, _, _ = bio_handshake(pki.server_ctx(), tls.client_context(cert, key, pki.ca, server_name="localhost"))
    ident = tls.peer_identity(server)
    assert (ident.dns, ident.ips, ident.ekus) == (("upper.lab",), ("2001:db8::1",), None if ekus is None else tuple(ekus))
    _, client, _ = bio_handshake(pki.server_ctx(), pki.client_ctx())
    assert tls.peer_identity(client) == PeerIdentity.from_der(client.getpeercert(binary_form=True))


def test_extended_key_usages_reads_whole_certificates_only(pki):
    """The DER outline reader: the whole certificate reads, every shorter prefix and the same
    bytes with trailing data raise ValueError, never anything else."""
    from rpcguard.pki.identity import extended_key_usages

    der = ssl.PEM_cert_to_DER_cert(Path(pki.pair("client")[0]).read_text())
    assert extended_key_usages(der) == ("1.3.6.1.5.5.7.3.2",)
    for n in range(len(der)):
        with pytest.raises(ValueError):
            extended_key_usages(der[:n])
    with pytest.raises(ValueError):
        extended_key_usages(der + b"\x00")
    with pytest.raises(ValueError):
        extended_key_usages(b"\x30\x03\x02\x01\x00")


def test_in_child_returns_and_raises_what_the_function_does():
    from rpcguard.pki.forked import ChildFailed, in_child

    assert in_child(lambda a, b: {"sum": a + b, "pid": os.getpid()}, 2, 3, force=True)["sum"] == 5
    assert in_child(os.getpid, force=True) != os.getpid()
    with pytest.raises(TlsConfigError, match="named file"):
        in_child(lambda: (_ for _ in ()).throw(TlsConfigError("named file: bad")), force=True)

    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}{b}")

    with pytest.raises(ChildFailed, match="Odd: xy"):
        in_child(lambda: (_ for _ in ()).throw(Odd("x", "y")), force=True)


_NO_CRYPTOGRAPHY = r'''
import os, ssl, sys
from rpcguard.cli import main
from rpcguard.proxy.server import Runtime, TlsMaterial
from rpcguard.pki import tls, crl, preflight
d, other = sys.argv[1], sys.argv[2]
p = lambda n: os.path.join(d, n)
s = tls.server_context(p("server.pem"), p("server.key"), p("ca.pem"))
c = tls.client_context(p("client.pem"), p("client.key"), p("ca.pem"), server_name="localhost")
listed = crl.load_crl(p("crl.pem"), p("ca.pem"))
crl.apply(s, listed)
si, so, ci, co = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
server, client = s.wrap_bio(si, so, server_side=True), c.wrap_bio(ci, co, server_hostname="localhost")
for _ in range(6):
    for side in (client, server):
        try:
            side.do_handshake()
        except ssl.SSLWantReadError:
            pass
        si.write(co.read()); ci.write(so.read())
ident = tls.peer_identity(server)
print("identity", ident.common_name, ident.uris, ident.ekus)
print("warnings", [w.kind for w in preflight.certificate_warnings(p("server.pem"), os.path.join(other, "ca.pem"))])
print("expiry", sorted(preflight.material_expiry(p("server.pem"), p("ca.pem"))))
print("revoked", len(listed.revoked))
try:
    tls.server_context(p("server.pem"), p("client.key"), p("ca.pem"))
except tls.TlsConfigError as exc:
    print("error", exc)
print("cryptography loaded:", "cryptography" in sys.modules)
'''


def test_serve_and_connect_never_load_cryptography(pki):
    """The checks that need cryptography run in a forked child; the handshake's identity comes
    from OpenSSL: the process itself never maps cryptography's library (docs/performance.md)."""
    import subprocess
    import sys

    from rpcguard.pki import crl

    crl.write_crl(pki.dir)
    out = subprocess.run([sys.executable, "-c", _NO_CRYPTOGRAPHY, str(pki.dir), str(pki.other)], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(Path(tls.__file__).parents[2])))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "identity client ('spiffe://lab/llama',) ('1.3.6.1.5.5.7.3.2',)"
    assert lines[1] == "warnings ['untrusted']"
    assert lines[2] == "expiry ['ca', 'cert']"
    assert lines[3] == "revoked 0"
    assert lines[4].startswith("error ") and "does not match certificate" in lines[4]
    assert lines[5] == "cryptography loaded: False"


# -- encrypted keys and systemd credentials (issue 31 item 4) ----------------------------------


@pytest.fixture
def enc(pki, tmp_path):
    """An encrypted server key (certs issue --passphrase-file) and its passphrase file."""
    pw = Path(_write(tmp_path / "pw", b"open sesame\n"))
    files = certs.issue(pki.dir, "encserver", server=True, dns=["localhost"], passphrase_file=pw)
    return str(files.cert), str(files.key), pw


def test_an_encrypted_key_works_with_its_passphrase_file(pki, enc):
    cert, key, pw = enc
    server, client = handshake(tls.server_context(cert, key, pki.ca, key_passphrase_file=pw), pki.client_ctx())
    assert (server.reason, client.reason) == ("ok", "ok")
    ctx = tls.client_context(*pki.pair("client"), pki.ca, server_name="x", key_passphrase_file=None)
    assert ctx.verify_mode == ssl.CERT_REQUIRED


def test_encrypted_key_problems_are_one_line_naming_the_files(pki, enc, tmp_path):
    cert, key, pw = enc
    with pytest.raises(TlsConfigError, match=f"{key}: encrypted private key: give its passphrase in "
                                             "tls.key_passphrase_file"):
        tls.server_context(cert, key, pki.ca)
    wrong = _write(tmp_path / "wrong", b"open sesame!\n")
    with pytest.raises(TlsConfigError, match=f"{key}: cannot decrypt the private key with the passphrase in "
                                             f"{wrong} \\(wrong passphrase\\?\\)"):
        tls.server_context(cert, key, pki.ca, key_passphrase_file=wrong)
    os.chmod(pw, 0o644)
    with pytest.raises(TlsConfigError, match=f"{pw}: passphrase file is accessible by others"):
        tls.server_context(cert, key, pki.ca, key_passphrase_file=pw)
    os.chmod(pw, 0o600)
    plain_cert, plain_key = pki.pair("server")
    with pytest.raises(TlsConfigError, match=f"{plain_key}: private key is not encrypted, but "
                                             f"tls.key_passphrase_file {pw} is set"):
        tls.server_context(plain_cert, plain_key, pki.ca, key_passphrase_file=pw)


def _serve_config(tmp_path: Path, tls_keys: dict) -> Path:
    import json

    cfg = {"tls": tls_keys, "allow": {"cn": ["client"]}, "metrics": {"listen": ""},
           "listeners": [{"listen": "127.0.0.1:50999", "upstream": "127.0.0.1:50998"}]}
    path = tmp_path / "serve.yaml"
    path.write_text(json.dumps(cfg))
    return path


def _check_config(path: Path, env: dict | None = None):
    import subprocess
    import sys

    full = dict(os.environ, PYTHONPATH=str(Path(tls.__file__).parents[2]))
    full.pop("CREDENTIALS_DIRECTORY", None)
    return subprocess.run([sys.executable, "-m", "rpcguard", "check-config", str(path)], capture_output=True,
                          text=True, timeout=60, env=dict(full, **(env or {})))


def test_serve_reads_an_encrypted_key_and_systemd_credentials(pki, enc, tmp_path):
    """tls.key_passphrase_file and credential:NAME (LoadCredential=), as serve's start checks them
    (check-config, in a process without cryptography: the checks run in its forked child); a bad
    passphrase or a missing credential is one line naming the key, exit 2."""
    cert, key, pw = enc
    creds = tmp_path / "creds"
    creds.mkdir()
    for name, src in (("node.key", key), ("node.pass", pw)):
        (creds / name).write_bytes(Path(src).read_bytes())
        os.chmod(creds / name, 0o400)
    ok = _check_config(_serve_config(tmp_path, {"cert": cert, "key": key, "ca": pki.ca, "key_passphrase_file": str(pw)}))
    assert ok.returncode == 0 and ok.stdout.startswith("OK "), ok.stderr
    as_credentials = _serve_config(tmp_path, {"cert": cert, "key": "credential:node.key", "ca": pki.ca,
                                              "key_passphrase_file": "credential:node.pass"})
    ok = _check_config(as_credentials, {"CREDENTIALS_DIRECTORY": str(creds)})
    assert ok.returncode == 0 and ok.stdout.startswith("OK "), ok.stderr
    missing = _check_config(as_credentials)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "rpcguard: config error: tls.key: credential:node.key: $CREDENTIALS_DIRECTORY is not set (a systemd unit "
        "with LoadCredential=node.key:PATH sets it)"]
    (creds / "node.pass").unlink()
    missing = _check_config(as_credentials, {"CREDENTIALS_DIRECTORY": str(creds)})
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    assert "tls.key_passphrase_file: credential:node.pass: no credential 'node.pass'" in missing.stderr
    wrong = _write(tmp_path / "wrong", b"nope\n")
    bad = _check_config(_serve_config(tmp_path, {"cert": cert, "key": key, "ca": pki.ca, "key_passphrase_file": wrong}))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"rpcguard: {key}: cannot decrypt the private key with the passphrase in {wrong} (wrong passphrase?)"]


def test_a_file_rewritten_in_place_is_checked_again(pki):
    """The file check (run once per version of the files, pki/tls.py _CHECKED) knows a version by
    its bytes: a key rewritten in place at once, same size, same inode, is checked again."""
    cert, key = pki.pair("server")
    tls.server_context(cert, key, pki.ca)
    other = Path(pki.pair("client")[1]).read_bytes()
    with open(key, "r+b") as f:  # in place: the inode stays, the size is the same (two EC P-256 keys)
        f.truncate(0)
        f.write(other)
    with pytest.raises(TlsConfigError, match="does not match certificate"):
        tls.server_context(cert, key, pki.ca)
