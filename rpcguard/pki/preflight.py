"""Start-up warnings about this side's own certificate: expired, expiring soon, not from our CA.

How this works: the TLS contexts (``tls.server_context``/``client_context``) already refuse
material that cannot work at all (unreadable, key not matching, wrong usage, key readable by
others). What they accept can still fail every handshake or fail soon: a certificate that has
expired or is not yet valid, one close to its end, one that is not signed by the configured CA
(the peers trust only that CA, so they refuse it), or a CA bundle that has expired.
``certificate_warnings`` finds those from the files in use, as a table of checks, each with a
stable ``kind`` (the ``kind`` label of ``rpcguard_certificate_warning`` and of the log line).
``server.Runtime`` runs it at start and after each reload; ``rpcguard check-config`` runs the
same ``Runtime`` construction, so both report the same things.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature

__all__ = ["CertWarning", "WARNING_KINDS", "SOON_S", "certificate_warnings"]

#: "expiring soon" means less than this left, or less than a third of the lifetime for
#: short-lived certificates (a 24 h certificate warns in its last 8 h, not all its life).
SOON_S = 7 * 86400.0
SOON_FRACTION = 1 / 3
WARNING_KINDS = ("expired", "not_yet_valid", "expiring_soon", "untrusted", "ca_expired")


@dataclass(frozen=True)
class CertWarning:
    """One problem of the material in use; ``kind`` is stable, ``message`` names the file."""

    kind: str
    message: str


def _signed_by(cert: x509.Certificate, cas: list[x509.Certificate]) -> bool:
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return True
        except (InvalidSignature, ValueError, TypeError):  # bad signature, other issuer, key type
            continue
    return False


def certificate_warnings(cert_path: str | os.PathLike[str], ca_path: str | os.PathLike[str],
                         now: float | None = None) -> list[CertWarning]:
    """Warnings for the certificate in ``cert_path`` against the CA bundle in ``ca_path``.

    The files were already accepted by the TLS context checks; a file that cannot be parsed
    here gives no warning (the context check reports it).
    """
    try:
        with open(cert_path, "rb") as f:
            cert = x509.load_pem_x509_certificates(f.read())[0]
        with open(ca_path, "rb") as f:
            cas = x509.load_pem_x509_certificates(f.read())
    except (OSError, ValueError):
        return []
    now_dt = _dt.datetime.fromtimestamp(time.time() if now is None else now, _dt.timezone.utc)
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    left = (end - now_dt).total_seconds()
    soon = min(SOON_S, (end - start).total_seconds() * SOON_FRACTION)
    checks = (
        ("expired", left <= 0, f"{cert_path}: certificate expired on {end:%Y-%m-%d %H:%M} UTC; peers refuse it"),
        ("not_yet_valid", start > now_dt,
         f"{cert_path}: certificate not valid before {start:%Y-%m-%d %H:%M} UTC (clock skew?)"),
        ("expiring_soon", 0 < left < soon, f"{cert_path}: certificate expires in {left / 3600:.1f} h "
                                           f"({end:%Y-%m-%d %H:%M} UTC); renew it and reload"),
        ("untrusted", not _signed_by(cert, cas),
         f"{cert_path}: certificate is not signed by a CA of {ca_path}; peers that trust that CA refuse it"),
        ("ca_expired", any(ca.not_valid_after_utc <= now_dt for ca in cas),
         f"{ca_path}: a CA certificate has expired; certificates it signed are refused"),
    )
    return [CertWarning(kind, message) for kind, bad, message in checks if bad]

