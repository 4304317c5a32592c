"""Revocation: the CA machine's list of revoked certificates, and the CRL a listener checks.

How this works: ``revoke`` (on the CA machine, ``rpcguard certs revoke``) adds a certificate's
serial to ``CADIR/revoked.txt`` and writes a fresh CRL signed by the CA, ``CADIR/crl.pem``, valid
for ``days`` (a CRL past its nextUpdate makes OpenSSL refuse every peer, so re-run
``certs crl`` before that, e.g. from a timer). ``load_crl`` (where the CRL is used: ``tls.crl``)
reads a PEM or DER CRL, checks that the configured CA signed it, and returns a ``Crl``: the PEM
text to give OpenSSL (``apply``: ``VERIFY_CRL_CHECK_LEAF``, so every handshake checks the peer's
certificate against it) and the revoked serials, with which a reload ends the live sessions of a
certificate revoked since they started. Problems raise ``CrlError`` naming the file. Reading
needs ``cryptography``: ``load_crl`` runs in a forked child (pki/forked.py), so a listener never
loads it.

The same model as HAProxy's ``crl-file`` and Envoy's ``crl``: a file the operator replaces,
checked at each handshake, reloaded on change; istio's ztunnel (since 2025) also closes open
connections of a revoked certificate, as rpcguard does at reload. ghostunnel has no CRL and
recommends short-lived certificates instead (its issues #214, #482): ``certs issue --hours``
gives those, and a session never outlives its client certificate (docs/revocation.md).
"""

from __future__ import annotations

import datetime as _dt
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rpcguard.errors import RpcGuardError
from rpcguard.pki.forked import in_child

if TYPE_CHECKING:
    from cryptography import x509

__all__ = ["CrlError", "Crl", "load_crl", "apply", "revoke", "write_crl", "REVOKED_LIST", "CRL_NAME"]

REVOKED_LIST = "revoked.txt"  # CADIR/revoked.txt: one "serial-hex  iso-date  subject" line per revocation
CRL_NAME = "crl.pem"


class CrlError(RpcGuardError):
    """A CRL that cannot be used (unreadable, not a CRL, not signed by the CA, expired)."""


@dataclass(frozen=True, slots=True)
class Crl:
    """A CRL read and checked against the CA, ready for a context."""

    path: str
    pem: str
    revoked: frozenset[int]  # serial numbers
    next_update: float | None  # POSIX seconds; None: the CRL does not say

    def expired(self, now: float) -> bool:
        return self.next_update is not None and now > self.next_update


def load_crl(path: str | os.PathLike[str], ca: str | os.PathLike[str]) -> Crl:
    """Read ``path`` (PEM or DER) and check that a certificate of the CA bundle ``ca`` signed it."""
    return in_child(_load_crl, os.fspath(path), os.fspath(ca))


def _load_crl(path: str, ca: str) -> Crl:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CrlError(f"{path}: cannot read the CRL: {exc.strerror or exc}") from exc
    try:
        crl = (x509.load_pem_x509_crl(data) if data.lstrip().startswith(b"-----BEGIN")
               else x509.load_der_x509_crl(data))
    except ValueError as exc:
        raise CrlError(f"{path}: not a CRL in PEM or DER form") from exc
    try:
        cas = x509.load_pem_x509_certificates(Path(ca).read_bytes())
    except (OSError, ValueError) as exc:
        raise CrlError(f"{ca}: cannot read the CA to check the CRL with") from exc
    if not any(c.subject == crl.issuer and _signed_by(crl, c) for c in cas):
        raise CrlError(f"{path}: not signed by the CA in {ca} (issuer {crl.issuer.rfc4514_string()})")
    nxt = crl.next_update_utc
    return Crl(str(path), crl.public_bytes(serialization.Encoding.PEM).decode("ascii"),
               frozenset(r.serial_number for r in crl), nxt.timestamp() if nxt is not None else None)


def _signed_by(crl: x509.CertificateRevocationList, ca: x509.Certificate) -> bool:
    try:
        return crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def apply(ctx: ssl.SSLContext, crl: Crl) -> None:
    """Make every handshake of ``ctx`` check the peer's certificate against ``crl``."""
    # cadata takes certificates only; a PEM file may hold CRLs (OpenSSL X509_load_cert_crl_file)
    with tempfile.NamedTemporaryFile("w", suffix=".pem", encoding="ascii") as f:
        f.write(crl.pem)
        f.flush()
        ctx.load_verify_locations(cafile=f.name)
    ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF


def _load_ca_pair(ca_dir: Path) -> tuple[x509.Certificate, object]:
    from rpcguard.pki.certs import _load_ca  # the one reader of a CA directory (key mode, pair match)

    return _load_ca(ca_dir)


def revoke(ca_dir: str | os.PathLike[str], cert_path: str | os.PathLike[str], *, days: int = 30) -> Path:
    """On the CA machine: add ``cert_path``'s serial to ``CADIR/revoked.txt`` and rewrite ``CADIR/crl.pem``."""
    from cryptography.exceptions import InvalidSignature

    from rpcguard.pki.certs import CertError, load_cert

    d = Path(ca_dir)
    ca_cert, _ = _load_ca_pair(d)
    try:
        cert = load_cert(cert_path)
    except CertError as exc:
        raise CrlError(str(exc)) from exc
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise CrlError(f"{cert_path}: not issued by the CA in {d}") from exc
    listed = _read_list(d)
    if cert.serial_number not in listed:
        now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
        with open(d / REVOKED_LIST, "a", encoding="utf-8") as f:
            f.write(f"{cert.serial_number:x}  {now.isoformat()}  {cert.subject.rfc4514_string()}\n")
    return write_crl(d, days=days)


def _read_list(d: Path) -> dict[int, _dt.datetime]:
    out: dict[int, _dt.datetime] = {}
    try:
        lines = (d / REVOKED_LIST).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return out
    for n, line in enumerate(lines, 1):
        parts = line.split()
        if not parts or line.startswith("#"):
            continue
        try:
            out[int(parts[0], 16)] = _dt.datetime.fromisoformat(parts[1])
        except (ValueError, IndexError) as exc:
            raise CrlError(f"{d / REVOKED_LIST}:{n}: expected 'SERIAL-HEX ISO-DATE SUBJECT'") from exc
    return out


def write_crl(ca_dir: str | os.PathLike[str], *, days: int = 30) -> Path:
    """Sign a CRL of every serial in ``CADIR/revoked.txt`` (possibly none), valid ``days``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    if not isinstance(days, int) or days < 1:
        raise CrlError(f"days must be a positive integer, got {days!r}")
    d = Path(ca_dir)
    ca_cert, ca_key = _load_ca_pair(d)
    now = _dt.datetime.now(_dt.timezone.utc)
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
               .last_update(now - _dt.timedelta(minutes=5)).next_update(now + _dt.timedelta(days=days)))
    for serial, when in sorted(_read_list(d).items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build())
    crl = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    out = d / CRL_NAME
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    return out
