"""Certificate signing requests: the node makes its key, the CA machine signs, no key travels.

How this works: ``make_csr`` (on the node) writes ``NAME.key`` (0600) and ``NAME.csr``, asking
for the profile ``certs.issue`` would give (CN, SANs, exactly one EKU). ``sign_csr`` (on the CA
machine, ``ca.pem`` + ``ca.key`` in their own directory) verifies the request's signature, reads
its CN, SANs and requested usage, and runs them through the same ``certs._profile`` rules and
``certs._sign`` extensions as ``issue``; everything else the request asks for (a CA flag, other
extensions) is ignored, because the CA decides the profile.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rpcguard.pki.certs import (
    RSA_KEY_BITS,
    CertError,
    KeyType,
    LeafFiles,
    lifetime,
    _key_pem,
    _leaf_files,
    _load_ca,
    make_dir,
    _new_key,
    read_key_passphrase,
    _profile,
    _sign,
    _write_private,
    _write_public,
)

__all__ = ["make_csr", "sign_csr"]


def make_csr(
    directory: str | os.PathLike[str],
    name: str,
    *,
    server: bool,
    dns: Iterable[str] = (),
    ips: Iterable[str] = (),
    uris: Iterable[str] = (),
    key_type: KeyType = "ec",
    force: bool = False,
    passphrase_file: str | os.PathLike[str] | None = None,
) -> LeafFiles:
    """On the node: write ``DIR/NAME.key`` (0600, never leaves it) and ``DIR/NAME.csr`` to send to the CA.

    The CSR asks for the same profile ``issue`` would give (CN, SANs, one EKU); ``sign`` applies
    the same rules again on the CA machine, so the request carries nothing the CA would not issue.
    ``passphrase_file``: encrypt the key with the first line of that file (``tls.key_passphrase_file``).
    """
    passphrase = read_key_passphrase(passphrase_file)
    files = _leaf_files(directory, name, ".csr", force)
    profile = _profile(name, server, dns, ips, uris, None)
    key = _new_key(key_type)
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, profile.cn)]))
    builder = builder.add_extension(x509.ExtendedKeyUsage([profile.eku]), critical=False)
    if profile.sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(profile.sans), critical=False)
    csr = builder.sign(key, hashes.SHA256())
    make_dir(files.key.parent)
    _write_private(files.key, _key_pem(key, passphrase))
    _write_public(files.cert, csr.public_bytes(serialization.Encoding.PEM))
    return files


def sign_csr(
    ca_dir: str | os.PathLike[str],
    csr_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    server: bool | None = None,
    days: int = 30,
    force: bool = False,
    hours: int | None = None,
) -> Path:
    """On the CA machine: sign ``csr_path`` into ``out`` with the rules of ``issue``.

    The name is the CSR's CN and must be a valid certificate name; its SANs are re-checked; the
    kind is ``server`` (True/False) or, when None, the one EKU the CSR asks for. Every other
    requested extension is ignored: the CA decides the profile.
    """
    out_path = Path(out)
    if out_path.exists() and not force:
        raise CertError(f"{out_path}: already exists (--force renews it)")
    span = lifetime(days, hours)
    try:
        csr = x509.load_pem_x509_csr(Path(csr_path).read_bytes())
    except OSError as exc:
        raise CertError(f"{csr_path}: cannot read CSR: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise CertError(f"{csr_path}: not a PEM certificate signing request") from exc
    if not csr.is_signature_valid:
        raise CertError(f"{csr_path}: the CSR's signature does not verify")
    cns = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1 or not isinstance(cns[0].value, str):
        raise CertError(f"{csr_path}: the CSR must have exactly one common name")
    asked = _csr_kind(csr, csr_path)
    if server is None:
        if asked is None:
            raise CertError(f"{csr_path}: the CSR asks for no key usage: pass --server or --client")
        server = asked
    elif asked is not None and asked != server:
        raise CertError(f"{csr_path}: the CSR asks for a {'server' if asked else 'client'} certificate,"
                        f" not a {'server' if server else 'client'} one")
    dns, ips, uris = _csr_sans(csr, csr_path)
    profile = _profile(cns[0].value, server, dns, ips, uris, None)
    _check_public_key(csr.public_key(), csr_path)
    ca = _load_ca(ca_dir)
    cert = _sign(ca, csr.public_key(), profile, span, out_path, None, None)
    _write_public(out_path, cert.public_bytes(serialization.Encoding.PEM))
    return out_path


def _csr_kind(csr: x509.CertificateSigningRequest, where) -> bool | None:
    """True/False for a CSR asking for serverAuth/clientAuth, None when it asks for no EKU."""
    try:
        ekus = set(csr.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return None
    if ekus == {ExtendedKeyUsageOID.SERVER_AUTH}:
        return True
    if ekus == {ExtendedKeyUsageOID.CLIENT_AUTH}:
        return False
    raise CertError(f"{where}: the CSR must ask for exactly one of serverAuth or clientAuth")


def _csr_sans(csr: x509.CertificateSigningRequest, where) -> tuple[list[str], list[str], list[str]]:
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], [], []
    known = (x509.DNSName, x509.IPAddress, x509.UniformResourceIdentifier)
    for general in san:
        if not isinstance(general, known):
            raise CertError(f"{where}: unsupported subject alternative name {general!r}")
    return (list(san.get_values_for_type(x509.DNSName)), [str(v) for v in san.get_values_for_type(x509.IPAddress)],
            list(san.get_values_for_type(x509.UniformResourceIdentifier)))


def _check_public_key(key, where) -> None:
    if isinstance(key, rsa.RSAPublicKey) and key.key_size < RSA_KEY_BITS:
        raise CertError(f"{where}: RSA key of {key.key_size} bits; at least {RSA_KEY_BITS} required")
    if not isinstance(key, (ec.EllipticCurvePublicKey, rsa.RSAPublicKey)):
        raise CertError(f"{where}: unsupported key type {type(key).__name__}")
