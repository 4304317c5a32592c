"""rpcguard.pki.crl: revoke on the CA machine, the CRL checked at every real loopback handshake."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from rpcguard.pki import certs, crl, tls
from tests.unit.pki.test_tls import Pki, handshake
from tests.unit.pki.test_tls import pki as tls_pki

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pki(tmp_path) -> Pki:
    """test_tls's two CAs and leaves, and one more client to revoke."""
    p = tls_pki.__wrapped__(tmp_path)  # type: ignore[attr-defined]
    certs.issue(p.dir, "stolen", server=False, uris=["spiffe://lab/llama/b"])
    return p


def serial(path: str) -> int:
    return certs.load_cert(path).serial_number


def server_with(pki: Pki, the_crl: crl.Crl) -> "tls.ssl.SSLContext":
    ctx = pki.server_ctx()
    crl.apply(ctx, the_crl)
    return ctx


def test_revoked_client_refused_at_the_handshake_others_not(pki):
    path = crl.revoke(pki.dir, pki.dir / "stolen.pem")
    loaded = crl.load_crl(path, pki.ca)
    assert loaded.revoked == {serial(str(pki.dir / "stolen.pem"))}
    server, client = handshake(server_with(pki, loaded), pki.client_ctx("stolen"))
    assert (server.reason, client.reason) == ("tls_cert_revoked", "tls_cert_revoked")
    server, client = handshake(server_with(pki, loaded), pki.client_ctx("client"))
    assert (server.reason, client.reason) == ("ok", "ok")


def test_empty_crl_accepts_everyone_and_revoke_is_idempotent(pki):
    loaded = crl.load_crl(crl.write_crl(pki.dir), pki.ca)
    assert loaded.revoked == frozenset() and not loaded.expired(dt.datetime.now().timestamp())
    server, _ = handshake(server_with(pki, loaded), pki.client_ctx("stolen"))
    assert server.reason == "ok"
    crl.revoke(pki.dir, pki.dir / "stolen.pem")
    crl.revoke(pki.dir, pki.dir / "stolen.pem")
    assert len((pki.dir / crl.REVOKED_LIST).read_text().splitlines()) == 1


def _crl_signed_by(ca_dir: Path, *, last: dt.datetime, nxt: dt.datetime, serials=()) -> x509.CertificateRevocationList:
    ca_cert = certs.load_cert(ca_dir / "ca.pem")
    key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), None)
    b = x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject).last_update(last).next_update(nxt)
    for s in serials:
        b = b.add_revoked_certificate(x509.RevokedCertificateBuilder().serial_number(s).revocation_date(last).build())
    return b.sign(key, hashes.SHA256())  # type: ignore[arg-type]


def test_der_crl_is_read(pki, tmp_path):
    now = dt.datetime.now(dt.timezone.utc)
    stolen = serial(str(pki.dir / "stolen.pem"))
    der = tmp_path / "crl.der"
    der.write_bytes(_crl_signed_by(pki.dir, last=now - dt.timedelta(hours=1), nxt=now + dt.timedelta(days=1),
                                   serials=[stolen]).public_bytes(serialization.Encoding.DER))
    loaded = crl.load_crl(der, pki.ca)
    assert loaded.revoked == {stolen}
    server, _ = handshake(server_with(pki, loaded), pki.client_ctx("stolen"))
    assert server.reason == "tls_cert_revoked"


def test_expired_crl_refuses_every_peer_with_its_own_reason(pki, tmp_path):
    """OpenSSL refuses every peer once the CRL is past nextUpdate: fail closed, but say why."""
    now = dt.datetime.now(dt.timezone.utc)
    old = tmp_path / "old.pem"
    old.write_bytes(_crl_signed_by(pki.dir, last=now - dt.timedelta(days=9), nxt=now - dt.timedelta(days=2))
                    .public_bytes(serialization.Encoding.PEM))
    loaded = crl.load_crl(old, pki.ca)
    assert loaded.expired(now.timestamp())
    server, _ = handshake(server_with(pki, loaded), pki.client_ctx("client"))
    assert server.reason == "tls_crl_expired"


def test_crl_of_another_ca_is_refused(pki):
    path = crl.write_crl(pki.other)
    with pytest.raises(crl.CrlError, match="not signed by the CA"):
        crl.load_crl(path, pki.ca)


@pytest.mark.parametrize("content", [b"", b"not a crl", b"-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n"])
def test_garbage_is_named(pki, tmp_path, content):
    bad = tmp_path / "bad.crl"
    bad.write_bytes(content)
    with pytest.raises(crl.CrlError, match=str(bad)):
        crl.load_crl(bad, pki.ca)
    with pytest.raises(crl.CrlError, match="cannot read"):
        crl.load_crl(tmp_path / "missing.crl", pki.ca)


def test_revoke_refuses_a_certificate_of_another_ca(pki):
    with pytest.raises(crl.CrlError, match="not issued by the CA"):
        crl.revoke(pki.dir, pki.other / "ca.pem")


def test_hour_scale_certificates(pki):
    files = certs.issue(pki.dir, "short", server=False, hours=2)
    left = certs.cert_not_after(files.cert) - dt.datetime.now(dt.timezone.utc).timestamp()
    assert 2 * 3600 - 60 < left <= 2 * 3600
    assert "expires in 2.0h" in certs.describe(files.cert) or "expires in 1.9h" in certs.describe(files.cert)
    with pytest.raises(certs.CertError, match="hours"):
        certs.issue(pki.dir, "bad", server=False, hours=0)
