"""rpcguard.pki.certs: CA and leaf issuance, file modes, extensions, validation."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rpcguard.pki import certs, csr
from rpcguard.pki.certs import CertError
from rpcguard.errors import RpcGuardError



def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def ext(cert: x509.Certificate, cls):
    return cert.extensions.get_extension_for_class(cls)


@pytest.fixture
def ca_dir(tmp_path):
    certs.init_ca(tmp_path)
    return tmp_path


def test_init_ca_writes_files_with_modes(tmp_path):
    NOW = dt.datetime.now(dt.timezone.utc)  # per test: collection may run long before
    files = certs.init_ca(tmp_path / "pki", common_name="lab CA")
    assert files == certs.CaFiles(tmp_path / "pki" / "ca.pem", tmp_path / "pki" / "ca.key")
    assert mode(files.key) == 0o600
    assert mode(files.cert) == 0o644
    assert sorted(p.name for p in (tmp_path / "pki").iterdir()) == ["ca.key", "ca.pem"]  # no temp files left
    ca = certs.load_cert(files.cert)
    assert ca.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "lab CA"
    assert ca.issuer == ca.subject
    bc = ext(ca, x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = ext(ca, x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    ca.verify_directly_issued_by(ca)
    assert abs((ca.not_valid_after_utc - NOW).days - 365 * 5) <= 1


def test_init_ca_key_private_even_with_umask_zero(tmp_path):
    old = os.umask(0)
    try:
        files = certs.init_ca(tmp_path)
    finally:
        os.umask(old)
    assert mode(files.key) == 0o600


def test_init_ca_refuses_overwrite_unless_forced(ca_dir):
    before = (ca_dir / "ca.pem").read_bytes()
    with pytest.raises(CertError, match="already exists"):
        certs.init_ca(ca_dir)
    assert (ca_dir / "ca.pem").read_bytes() == before
    certs.init_ca(ca_dir, force=True)
    assert (ca_dir / "ca.pem").read_bytes() != before


def test_init_ca_refuses_when_only_key_exists(tmp_path):
    (tmp_path / "ca.key").write_text("x")
    with pytest.raises(CertError, match="ca.key"):
        certs.init_ca(tmp_path)


def test_cert_error_is_rpcguard_error():
    assert issubclass(CertError, RpcGuardError)


def test_issue_server_leaf(ca_dir):
    NOW = dt.datetime.now(dt.timezone.utc)  # per test: collection may run long before
    files = certs.issue(ca_dir, "node1", server=True)
    assert files == certs.LeafFiles(ca_dir / "node1.pem", ca_dir / "node1.key")
    assert mode(files.key) == 0o600
    leaf = certs.load_cert(files.cert)
    ca = certs.load_cert(ca_dir / "ca.pem")
    leaf.verify_directly_issued_by(ca)
    assert len(x509.load_pem_x509_certificates(files.cert.read_bytes())) == 1  # leaf only
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node1"
    assert list(ext(leaf, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert ext(leaf, x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName) == ["node1"]
    bc = ext(leaf, x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    ku = ext(leaf, x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and ku.value.key_agreement
    assert not ku.value.key_cert_sign
    aki = ext(leaf, x509.AuthorityKeyIdentifier).value.key_identifier
    assert aki == ext(ca, x509.SubjectKeyIdentifier).value.digest
    assert ext(leaf, x509.SubjectKeyIdentifier).value == x509.SubjectKeyIdentifier.from_public_key(leaf.public_key())
    start, end = leaf.not_valid_before_utc, leaf.not_valid_after_utc
    assert dt.timedelta(minutes=4) < NOW - start < dt.timedelta(minutes=6)
    assert abs((end - NOW) - dt.timedelta(days=30)) < dt.timedelta(minutes=1)


def test_issue_client_leaf_with_sans(ca_dir):
    NOW = dt.datetime.now(dt.timezone.utc)  # per test: collection may run long before
    files = certs.issue(
        ca_dir, "client1", server=False, dns=["Gpu1.Lab.Example"], ips=["10.0.0.7", "::1"],
        uris=["spiffe://lab/llama"], common_name="llama client", days=7,
    )
    leaf = certs.load_cert(files.cert)
    assert list(ext(leaf, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    san = ext(leaf, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["gpu1.lab.example"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7"), ipaddress.ip_address("::1")]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://lab/llama"]
    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "llama client"
    assert abs((leaf.not_valid_after_utc - NOW) - dt.timedelta(days=7)) < dt.timedelta(minutes=1)


def test_client_without_sans_has_no_san_extension(ca_dir):
    leaf = certs.load_cert(certs.issue(ca_dir, "c", server=False).cert)
    with pytest.raises(x509.ExtensionNotFound):
        ext(leaf, x509.SubjectAlternativeName)


def test_server_with_explicit_san_does_not_add_name(ca_dir):
    leaf = certs.load_cert(certs.issue(ca_dir, "n1", server=True, ips=["127.0.0.1"]).cert)
    san = ext(leaf, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == []
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]


def test_issue_rsa(ca_dir):
    leaf = certs.load_cert(certs.issue(ca_dir, "r", server=True, key_type="rsa").cert)
    assert isinstance(leaf.public_key(), rsa.RSAPublicKey)
    ku = ext(leaf, x509.KeyUsage).value
    assert ku.digital_signature and not ku.key_agreement


def test_issue_refuses_overwrite_unless_forced(ca_dir):
    first = certs.issue(ca_dir, "n", server=True).cert.read_bytes()
    with pytest.raises(CertError, match="already exists"):
        certs.issue(ca_dir, "n", server=True)
    assert certs.issue(ca_dir, "n", server=True, force=True).cert.read_bytes() != first
    assert mode(ca_dir / "n.key") == 0o600


def test_issue_validity_overrides_mint_expired(ca_dir):
    NOW = dt.datetime.now(dt.timezone.utc)  # per test: collection may run long before
    files = certs.issue(ca_dir, "old", server=False, not_before=NOW - dt.timedelta(days=3),
                        not_after=NOW - dt.timedelta(days=1))
    assert certs.cert_not_after(files.cert) == pytest.approx((NOW - dt.timedelta(days=1)).timestamp(), abs=1)
    assert "EXPIRED" in certs.describe(files.cert)
    with pytest.raises(CertError, match="empty"):
        certs.issue(ca_dir, "bad", server=False, not_before=NOW, not_after=NOW - dt.timedelta(seconds=1))


def test_leaf_never_outlives_ca(tmp_path):
    certs.init_ca(tmp_path, days=10)
    ca = certs.load_cert(tmp_path / "ca.pem")
    leaf = certs.load_cert(certs.issue(tmp_path, "n", server=True, days=30).cert)
    assert leaf.not_valid_after_utc == ca.not_valid_after_utc


@pytest.mark.parametrize("name", ["", "ca", "CA", "ca.pem", "../x", "a/b", ".hidden", "x y", "n\u00e9", "a\n"])
def test_issue_rejects_bad_names(ca_dir, name):
    with pytest.raises(CertError, match="invalid certificate name"):
        certs.issue(ca_dir, name, server=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ips": ["10.0.0.256"]}, "invalid IP"),
        ({"ips": ["10.0.0.0/8"]}, "invalid IP"),
        ({"uris": ["not a uri"]}, "invalid URI"),
        ({"uris": ["lab/llama"]}, "invalid URI"),
        ({"dns": ["bad_name.lab"]}, "invalid DNS"),
        ({"dns": ["a..b"]}, "invalid DNS"),
        ({"dns": ["-a.b"]}, "invalid DNS"),
        ({"days": 0}, "days"),
        ({"common_name": "x" * 65}, "common name"),
        ({"key_type": "dsa"}, "key type"),
    ],
)
def test_issue_rejects_bad_arguments(ca_dir, kwargs, message):
    with pytest.raises(CertError, match=message):
        certs.issue(ca_dir, "n", server=False, **kwargs)
    assert not (ca_dir / "n.key").exists()


def test_server_name_must_be_a_dns_name_without_san(ca_dir):
    with pytest.raises(CertError, match="invalid DNS name"):
        certs.issue(ca_dir, "node_1", server=True)
    certs.issue(ca_dir, "node_2", server=True, dns=["node2.lab"])


def test_wildcard_dns_san(ca_dir):
    leaf = certs.load_cert(certs.issue(ca_dir, "w", server=True, dns=["*.lab.example"]).cert)
    assert ext(leaf, x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName) == ["*.lab.example"]


def test_issue_without_ca(tmp_path):
    with pytest.raises(CertError, match="ca.pem"):
        certs.issue(tmp_path, "n", server=True)


def test_load_cert_errors_name_the_file(tmp_path):
    with pytest.raises(CertError, match="missing.pem"):
        certs.load_cert(tmp_path / "missing.pem")
    junk = tmp_path / "junk.pem"
    junk.write_text("hello")
    with pytest.raises(CertError, match="junk.pem: not a PEM certificate"):
        certs.load_cert(junk)


def test_cert_not_after_and_describe(ca_dir):
    files = certs.issue(ca_dir, "n1", server=True, ips=["127.0.0.1"], uris=["spiffe://lab/n1"])
    leaf = certs.load_cert(files.cert)
    assert certs.cert_not_after(files.cert) == leaf.not_valid_after_utc.timestamp()
    text = certs.describe(files.cert)
    assert "subject=CN=n1" in text
    assert "san=IP:127.0.0.1,URI:spiffe://lab/n1" in text
    assert "eku=serverAuth" in text
    assert "expires in 29d" in text or "expires in 30d" in text
    assert "\n" not in text


# ----------------------------------------------------------------------------- CSR + sign, --ca-dir


def test_issue_with_ca_in_its_own_directory(tmp_path):
    certs.init_ca(tmp_path / "ca")
    (tmp_path / "leaves").mkdir()
    files = certs.issue(tmp_path / "leaves", "n1", server=True, ca_dir=tmp_path / "ca")
    assert sorted(p.name for p in (tmp_path / "leaves").iterdir()) == ["n1.key", "n1.pem"]  # no ca.key here
    certs.load_cert(files.cert).verify_directly_issued_by(certs.load_cert(tmp_path / "ca" / "ca.pem"))
    with pytest.raises(CertError, match="ca.pem"):
        certs.issue(tmp_path / "leaves", "n2", server=True)  # the CA is not in the leaf directory


def test_csr_then_sign_gives_what_issue_gives(tmp_path):
    certs.init_ca(tmp_path / "ca")
    node = tmp_path / "node"
    node.mkdir()
    req = csr.make_csr(node, "node1", server=True, dns=["Node1.Lab."], ips=["10.0.0.5"])
    assert mode(req.key) == 0o600 and req.cert.name == "node1.csr"
    out = csr.sign_csr(tmp_path / "ca", req.cert, node / "node1.pem")
    cert = certs.load_cert(out)
    ref = certs.load_cert(certs.issue(tmp_path / "ca", "ref", server=True, dns=["node1.lab"], ips=["10.0.0.5"]).cert)
    for cls in (x509.SubjectAlternativeName, x509.ExtendedKeyUsage, x509.KeyUsage, x509.BasicConstraints):
        assert ext(cert, cls).value == ext(ref, cls).value, cls
    assert cert.subject.rfc4514_string() == "CN=node1"
    # the certificate carries the node's key: the key never left the node
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(req.key.read_bytes(), None)
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    assert key.public_key().public_bytes(*spki) == cert.public_key().public_bytes(*spki)
    from rpcguard.pki.tls import server_context

    server_context(out, req.key, tmp_path / "ca" / "ca.pem")  # rpcguard serve takes it


def test_sign_kind_follows_the_csr_and_must_match(tmp_path):
    certs.init_ca(tmp_path)
    req = csr.make_csr(tmp_path, "c1", server=False, uris=["spiffe://lab/llama/1"])
    with pytest.raises(CertError, match="asks for a client certificate"):
        csr.sign_csr(tmp_path, req.cert, tmp_path / "c1.pem", server=True)
    out = csr.sign_csr(tmp_path, req.cert, tmp_path / "c1.pem")
    assert list(ext(certs.load_cert(out), x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    with pytest.raises(CertError, match="already exists"):
        csr.sign_csr(tmp_path, req.cert, out)
    csr.sign_csr(tmp_path, req.cert, out, force=True, days=2)


def _foreign_csr(tmp_path, name="evil", sans=(), ekus=(ExtendedKeyUsageOID.CLIENT_AUTH,)):
    from cryptography.hazmat.primitives import hashes, serialization

    key = ec.generate_private_key(ec.SECP256R1())
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
    if ekus:
        b = b.add_extension(x509.ExtendedKeyUsage(list(ekus)), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)  # asks to be a CA
    path = tmp_path / f"{name}.csr"
    path.write_bytes(b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return path


def test_sign_applies_the_issue_rules_to_a_hand_made_csr(tmp_path):
    certs.init_ca(tmp_path)
    # a CSR asking to be a CA gets a plain leaf: the CA decides the extensions
    out = csr.sign_csr(tmp_path, _foreign_csr(tmp_path), tmp_path / "evil.pem")
    assert ext(certs.load_cert(out), x509.BasicConstraints).value.ca is False
    cases = [
        (dict(name="../x"), "invalid certificate name"),
        (dict(name="ca"), "invalid certificate name"),
        (dict(name="s1", sans=[x509.DNSName("bad..name")]), "invalid DNS name"),
        (dict(name="s2", sans=[x509.RFC822Name("a@b.c")]), "unsupported subject alternative name"),
        (dict(name="s3", ekus=[ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]), "exactly one"),
        (dict(name="s4", ekus=[]), "pass --server or --client"),
    ]
    for kw, msg in cases:
        with pytest.raises(CertError, match=msg):
            csr.sign_csr(tmp_path, _foreign_csr(tmp_path, **kw), tmp_path / "x.pem")
    assert not (tmp_path / "x.pem").exists()


def test_sign_refuses_a_tampered_csr_and_bad_files(tmp_path):
    certs.init_ca(tmp_path)
    req = csr.make_csr(tmp_path, "t1", server=False)
    data = bytearray(x509.load_pem_x509_csr(req.cert.read_bytes()).public_bytes(
        __import__("cryptography.hazmat.primitives.serialization", fromlist=["Encoding"]).Encoding.DER))
    data[-5] ^= 0xFF  # flip a signature byte
    import base64

    tampered = tmp_path / "tampered.csr"
    tampered.write_text("-----BEGIN CERTIFICATE REQUEST-----\n" + base64.encodebytes(bytes(data)).decode()
                        + "-----END CERTIFICATE REQUEST-----\n")
    with pytest.raises(CertError, match="signature|not a PEM"):
        csr.sign_csr(tmp_path, tampered, tmp_path / "t.pem")
    with pytest.raises(CertError, match="cannot read CSR"):
        csr.sign_csr(tmp_path, tmp_path / "missing.csr", tmp_path / "t.pem")
    with pytest.raises(CertError, match="not a PEM certificate signing request"):
        csr.sign_csr(tmp_path, tmp_path / "ca.pem", tmp_path / "t.pem")
    # the quick start's `certs issue certs/ ...` and `certs csr certs/ ...` create certs/
    files = csr.make_csr(tmp_path / "nodir" / "deeper", "t2", server=True)
    assert files.key.is_file() and (files.key.stat().st_mode & 0o777) == 0o600 and files.cert.is_file()
    leaf = certs.issue(tmp_path / "certs", "t3", server=False, ca_dir=tmp_path)
    assert leaf.cert.is_file() and (leaf.key.stat().st_mode & 0o777) == 0o600
    with pytest.raises(CertError, match="not a directory"):
        certs.issue(tmp_path / "ca.pem", "t4", server=False, ca_dir=tmp_path)


def test_write_errors_are_cert_errors(tmp_path):
    with pytest.raises(CertError, match="cannot create the directory"):
        certs.init_ca("/proc/rpcguard-test/ca")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CertError, match="cannot create the directory"):
        certs.init_ca(tmp_path / "file" / "ca")


# ----------------------------------------------------------------------------- start-up warnings


def test_certificate_warnings(tmp_path):
    from rpcguard.pki.preflight import certificate_warnings

    certs.init_ca(tmp_path)
    now = dt.datetime.now(dt.timezone.utc)
    ca = tmp_path / "ca.pem"

    def kinds(**kw) -> list[str]:
        f = certs.issue(tmp_path, f"w{len(list(tmp_path.iterdir()))}", server=True, **kw)
        return [w.kind for w in certificate_warnings(f.cert, ca)]

    assert kinds() == []
    assert kinds(not_before=now - dt.timedelta(days=3), not_after=now - dt.timedelta(days=1)) == ["expired"]
    assert kinds(not_before=now + dt.timedelta(days=1), not_after=now + dt.timedelta(days=30)) == ["not_yet_valid"]
    assert kinds(not_before=now - dt.timedelta(days=29), not_after=now + dt.timedelta(days=1)) == ["expiring_soon"]
    # short-lived: a 24 h certificate warns in its last third only
    assert kinds(not_before=now - dt.timedelta(hours=12), not_after=now + dt.timedelta(hours=12)) == []
    assert kinds(not_before=now - dt.timedelta(hours=20), not_after=now + dt.timedelta(hours=4)) == ["expiring_soon"]
    other = tmp_path / "other"
    certs.init_ca(other)
    f = certs.issue(other, "stranger", server=True)
    assert [w.kind for w in certificate_warnings(f.cert, ca)] == ["untrusted"]
    assert "not signed by a CA of" in certificate_warnings(f.cert, ca)[0].message
    # a bundle with both CAs (CA rotation) trusts both
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(ca.read_bytes() + (other / "ca.pem").read_bytes())
    assert certificate_warnings(f.cert, bundle) == []
    assert certificate_warnings(tmp_path / "missing.pem", ca) == []  # unreadable: the context check reports it


def test_issue_and_csr_write_an_encrypted_key_when_asked(ca_dir, tmp_path):
    """--passphrase-file: the key is written encrypted (PKCS#8, the passphrase is the file's first
    line) and the ssl module, which serve and connect load keys with, reads it with that passphrase."""
    import ssl

    from cryptography.hazmat.primitives import serialization

    from rpcguard.pki.csr import make_csr

    pw = tmp_path / "pw"
    pw.write_bytes(b"correct horse\n")
    os.chmod(pw, 0o600)
    files = certs.issue(ca_dir, "enc", server=True, dns=["enc"], passphrase_file=pw)
    data = files.key.read_bytes()
    assert data.startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
    serialization.load_pem_private_key(data, password=b"correct horse")
    with pytest.raises(TypeError):
        serialization.load_pem_private_key(data, password=None)
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(files.cert, files.key, password=b"correct horse")
    csr = make_csr(tmp_path / "node", "n1", server=True, dns=["n1"], passphrase_file=pw)
    assert csr.key.read_bytes().startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
    os.chmod(pw, 0o644)
    with pytest.raises(certs.CertError, match="passphrase file is accessible by others"):
        certs.issue(ca_dir, "enc2", server=True, dns=["enc2"], passphrase_file=pw)
    assert not (ca_dir / "enc2.key").exists()
