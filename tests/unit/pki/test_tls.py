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
