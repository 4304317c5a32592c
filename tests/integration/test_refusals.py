"""Every refusal of issue 2, against the real server and client: refused, counted with its
reason, and the proxy keeps serving a real llama.cpp session afterwards.

Refusals before or at HELLO must reach llama.cpp as a version mismatch (0.0.N), never as
"Remote RPC server crashed".
"""

from __future__ import annotations

import datetime
import socket
import ssl

import pytest

from rpcguard.pki import certs
from rpcguard.protocol import encode
from rpcguard.protocol.versions import REFUSAL_CODES
from tests.support import realpeer
from tests.support.guard import start_guard


def mismatch(run: realpeer.ClientRun, reason: str) -> None:
    """The real client was refused at HELLO with the 0.0.N answer of ``reason``."""
    assert not run.ok
    assert f"RPC server version mismatch: 0.0.{REFUSAL_CODES[reason]}" in run.output, run.output[-3000:]
    assert "crashed" not in run.output


def still_serves(connect, models) -> None:
    run = realpeer.run_client(connect.endpoint, models["tiny"], n=4)
    assert run.ok, run.output[-3000:]


def tls_client(pki, cert=None, key=None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki.path("ca"))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def raw_tls(pki, port, *steps: bytes, cert=None, key=None) -> bytes:
    """Speak to serve over mTLS like a client that waits for answers: send each step, read what
    comes back (HELLO's 36-byte answer after the first), until the server closes."""
    ctx = tls_client(pki, cert or pki.path(pki.client), key or pki.path(pki.client, "key"))
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=pki.node) as s:
            try:
                for i, frames in enumerate(steps):
                    s.sendall(frames)
                    want = len(got) + (36 if i == 0 and frames[:1] == b"\x0e" else 1 << 20)
                    while len(got) < want and (chunk := s.recv(65536)):
                        got += chunk
                    if not chunk:
                        break
            except (ssl.SSLError, ConnectionError):
                pass
    return got


def test_no_client_certificate(pki, pair, models):
    connect, serve = pair()
    assert _no_cert(pki, serve.port) == b""
    assert serve.wait_value("rpcguard_tls_handshake_failures_total", 1, reason="tls_no_client_cert") == 1
    still_serves(connect, models)


def _no_cert(pki, port):
    ctx = tls_client(pki)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=pki.node) as s:
            try:
                s.sendall(encode.hello_request())
                return s.recv(100)  # TLS 1.3: the refusal shows on the first read (alert or close)
            except (ssl.SSLError, ConnectionError):
                return b""


@pytest.mark.parametrize("case", ["other_ca", "expired"])
def test_bad_client_certificate_reaches_llama_as_version_mismatch(pki, pair, models, workdir, case):
    connect, serve = pair()
    if case == "other_ca":
        certs.init_ca(workdir / "other", force=True)
        files = certs.issue(workdir / "other", "mallory", server=False)
        reason = "tls_unknown_ca"
    else:
        now = datetime.datetime.now(datetime.timezone.utc)
        files = certs.issue(pki.dir, "expired", server=False, force=True,
                            not_before=now - datetime.timedelta(hours=2), not_after=now - datetime.timedelta(hours=1))
        reason = "tls_cert_expired"
    bad = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                           *pki.connect_args(str(files.cert), str(files.key))])
    try:
        run = realpeer.run_client(bad.endpoint, models["tiny"], n=4)
        mismatch(run, "tls_failed")
        assert serve.wait_value("rpcguard_tls_handshake_failures_total", 1, reason=reason) >= 1
        assert bad.wait_value("rpcguard_refusals_total", 1, reason="tls_failed") >= 1
    finally:
        bad.stop()
    still_serves(connect, models)


def test_identity_not_on_allow_list(pki, pair, models, workdir):
    _, serve = pair(serve_args=["--allow-cn", "someone-else"])
    connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                               *pki.connect_args()])
    try:
        run = realpeer.run_client(connect.endpoint, models["tiny"], n=4)
        mismatch(run, "identity_not_allowed")
        assert serve.wait_value("rpcguard_refusals_total", 1, reason="identity_not_allowed") >= 1
        assert serve.logged("identity_not_allowed") and serve.logged("CN=client1")
        # the handshake worked: a refusal, never a TLS handshake failure
        assert serve.value("rpcguard_tls_handshake_failures_total") == 0
        # a disallowed certificate that hangs up before its HELLO is a refusal too (not a clean session)
        before = serve.value("rpcguard_refusals_total", reason="identity_not_allowed")
        ok_before = serve.value("rpcguard_sessions_total", result="ok")
        assert raw_tls(pki, serve.port) == b""
        assert serve.wait_value("rpcguard_refusals_total", before + 1, reason="identity_not_allowed") == before + 1
        assert serve.value("rpcguard_sessions_total", result="ok") == ok_before
    finally:
        connect.stop()


def test_allowed_identity_by_uri_san(pki, pair, models):
    cert, key = pki.issue("spiffe-client", server=False, uris=["spiffe://lab/llama/a"])
    connect, serve = pair(serve_args=["--allow-uri", "spiffe://lab/llama/*"])
    # the pair's connect presents client1 (no URI SAN): refused; a URI-SAN client is allowed
    mismatch(realpeer.run_client(connect.endpoint, models["tiny"], n=2), "identity_not_allowed")
    got = raw_tls(pki, serve.port, encode.hello_request(), cert=cert, key=key)
    assert got[:8] == (28).to_bytes(8, "little") and got[8:11] == bytes([7, 0, 0])


def test_plain_tcp_to_the_tls_port(pair, models):
    """A plaintext ggml-rpc HELLO on serve's TLS port (llama.cpp pointed straight at serve) is
    answered in plaintext with 0.0.25 in the layout its HELLO asked for; other bytes get TLS's alert."""
    connect, serve = pair()
    for version, size in (((7, 0, 0), 28), ((3, 6, 1), 3)):
        with socket.create_connection(("127.0.0.1", serve.port), timeout=10) as s:
            s.sendall(encode.hello_request(version))
            s.settimeout(10)
            got = b""
            while chunk := s.recv(100):
                got += chunk
        assert got[:8] == size.to_bytes(8, "little") and got[8:11] == bytes([0, 0, 25]), got
    with socket.create_connection(("127.0.0.1", serve.port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        s.settimeout(10)
        try:
            assert not s.recv(100).startswith(b"\x00")  # a TLS alert or nothing, never a ggml answer
        except ConnectionError:
            pass
    assert serve.wait_value("rpcguard_tls_handshake_failures_total", 3, reason="tls_not_tls") >= 3
    # the real llama.cpp client, pointed at the TLS port, says why instead of "crashed"
    mismatch(realpeer.run_client(f"127.0.0.1:{serve.port}", models["tiny"], n=2), "tls_not_tls")
    still_serves(connect, models)


def test_first_frame_not_hello(pki, pair, models):
    connect, serve = pair()
    assert raw_tls(pki, serve.port, encode.request("DEVICE_COUNT")) == b""
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="first_frame_not_hello") == 1
    with socket.create_connection(("127.0.0.1", connect.port), timeout=10) as s:
        s.sendall(encode.request("ALLOC_BUFFER", bytes(12)))
        assert s.recv(100) == b""
    assert connect.wait_value("rpcguard_refusals_total", 1, reason="first_frame_not_hello") == 1
    still_serves(connect, models)


def test_disallowed_command(pki, pair, models, workdir):
    cfg = workdir / "serve.yaml"
    cfg.write_text("policy:\n  allow_commands: ['@handshake', '@query']\n")
    connect, serve = pair(serve_args=["--config", str(cfg)])
    got = raw_tls(pki, serve.port, encode.hello_request(),
                  encode.request("ALLOC_BUFFER", bytes(4) + (1 << 20).to_bytes(8, "little")))
    assert got[8:11] == bytes([7, 0, 0]) and len(got) == 36, got  # HELLO answered, then closed
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="command_not_allowed") == 1, serve.output()[-3000:]
    # a real llama.cpp session needs ALLOC_BUFFER: it is cut, the proxy stays up
    run = realpeer.run_client(connect.endpoint, models["tiny"], n=2)
    assert not run.ok
    assert serve.wait_value("rpcguard_refusals_total", 2, reason="command_not_allowed") >= 2, serve.output()[-3000:]
    assert serve.proc.alive() and connect.proc.alive()


def test_server_version_not_accepted(pki, pair, models, workdir):
    cfg = workdir / "serve.yaml"
    cfg.write_text("policy:\n  accepted_versions: ['5.0.0']\n")
    connect, serve = pair(serve_args=["--config", str(cfg)])
    mismatch(realpeer.run_client(connect.endpoint, models["tiny"], n=2), "version_not_accepted")
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="version_not_accepted") >= 1
    assert serve.logged("7.0.0") and serve.logged("is not on policy.accepted_versions")
    assert connect.wait_value("rpcguard_refusals_total", 1, reason="node_refused") >= 1


def test_upstream_down(pki, pair, models, workdir):
    dead = realpeer.reserve_port()
    connect, serve = pair(upstream_port=dead)
    mismatch(realpeer.run_client(connect.endpoint, models["tiny"], n=2), "upstream_unavailable")
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="upstream_unavailable") >= 1
    # the server comes up: the same proxies serve the next session
    proc, _ = realpeer.start_rpc_server(workdir, port=dead)
    try:
        still_serves(connect, models)
    finally:
        proc.stop()


def test_connect_node_unreachable(pki, models, workdir):
    connect = start_guard("connect", workdir, ["--server", f"127.0.0.1:{realpeer.reserve_port()}",
                                               "--server-name", pki.node, *pki.connect_args()])
    try:
        mismatch(realpeer.run_client(connect.endpoint, models["tiny"], n=2), "node_unreachable")
        assert connect.wait_value("rpcguard_refusals_total", 1, reason="node_unreachable") >= 1
    finally:
        connect.stop()


def issue_without_eku(pki, name: str, *, server: bool) -> tuple[str, str]:
    """A leaf signed by the pki's CA like certs.issue, but with no extended key usage at all:
    OpenSSL accepts it for any purpose, rpcguard must not."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_cert = certs.load_cert(pki.dir / "ca.pem")
    ca_key = serialization.load_pem_private_key((pki.dir / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
         .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(pki.node), x509.IPAddress(
            __import__("ipaddress").ip_address("127.0.0.1"))]), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    cert_path, key_path = pki.dir / f"{name}.pem", pki.dir / f"{name}.key"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def test_client_certificate_without_client_auth_is_refused(pki, pair, models, workdir):
    """Issued by the right CA, on the allow-list (--allow-all), but not a client certificate."""
    cert, key = issue_without_eku(pki, "no-eku-client", server=False)
    _, serve = pair()
    connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                               *pki.connect_args(cert=cert, key=key)])
    try:
        mismatch(realpeer.run_client(connect.endpoint, models["tiny"], n=2), "certificate_usage_invalid")
        assert serve.wait_value("rpcguard_refusals_total", 1, reason="certificate_usage_invalid") >= 1
        assert serve.logged("certificate_usage_invalid") and serve.logged("without clientAuth")
        # a node's server certificate (EKU serverAuth only) is not a client certificate either:
        # OpenSSL already fails that handshake (the EKU extension is there and lacks clientAuth)
        node_cert, node_key = pki.path(pki.node), pki.path(pki.node, "key")
        assert raw_tls(pki, serve.port, encode.hello_request(), cert=node_cert, key=node_key) == b""
        assert serve.wait_value("rpcguard_tls_handshake_failures_total", 1, reason="tls_bad_certificate") >= 1
    finally:
        connect.stop()


def test_node_certificate_without_server_auth_is_refused_by_connect(pki, rpc_server, models, workdir):
    cert, key = issue_without_eku(pki, "no-eku-node", server=True)
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", "--cert", cert, "--key", key,
                                           "--ca", pki.path("ca")])
    connect = start_guard("connect", workdir, ["--server", serve.endpoint, "--server-name", pki.node,
                                               *pki.connect_args()])
    try:
        mismatch(realpeer.run_client(connect.endpoint, models["tiny"], n=2), "certificate_usage_invalid")
        assert connect.wait_value("rpcguard_refusals_total", 1, reason="certificate_usage_invalid") >= 1
        assert connect.logged("without serverAuth")
    finally:
        connect.stop()
        serve.stop()
