"""Start-up warnings about this side's own certificate: expired, expiring soon, not from our CA.

How this works: the TLS contexts (``tls.server_context``/``client_context``) already refuse
material that cannot work at all (unreadable, key not matching, wrong usage, key readable by
others). What they accept can still fail every handshake or fail soon: a certificate that has
expired or is not yet valid, one close to its end, one that is not signed by the configured CA
(the peers trust only that CA, so they refuse it), or a CA bundle that has expired.
``certificate_warnings`` finds those from the files in use, as a table of checks, each with a
stable ``kind`` (the ``kind`` label of ``rpcguard_certificate_warning`` and of the log line).
``server.Runtime`` runs it at start and after each reload; ``rpcguard check-config`` runs the
same ``Runtime`` construction, so both report the same things. ``material_expiry`` gives the
dates the expiry gauges show. Both read ``CertFacts`` (dates, CA dates, whether a CA signed it),
which need ``cryptography``: ``cert_facts`` gets them in a forked child (pki/forked.py), so serve
and connect never load it, once per version of the files (the TLS file check of pki/tls.py
hands over the facts it read in its own child, ``remember``).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import time
from dataclasses import dataclass

from rpcguard.pki.forked import in_child

__all__ = ["CertWarning", "CertFacts", "WARNING_KINDS", "SOON_S", "certificate_warnings", "material_expiry",
           "cert_facts", "remember", "stamp_of", "read_facts"]

#: "expiring soon" means less than this left, or less than a third of the lifetime for
#: short-lived certificates (a 24 h certificate warns in its last 8 h, not all its life).
SOON_S = 7 * 86400.0
SOON_FRACTION = 1 / 3
WARNING_KINDS = ("expired", "not_yet_valid", "expiring_soon", "untrusted", "ca_expired")
_FACTS_MAX = 16  # versions of (certificate, CA) files remembered; a reload adds one


@dataclass(frozen=True)
class CertWarning:
    """One problem of the material in use; ``kind`` is stable, ``message`` names the file."""

    kind: str
    message: str


@dataclass(frozen=True)
class CertFacts:
    """What the warnings and the expiry gauges need of a certificate and its CA bundle (POSIX seconds)."""

    not_before: float
    not_after: float
    ca_not_after: tuple[float, ...]
    signed: bool  # a CA of the bundle signed the certificate


_FACTS: dict[tuple, CertFacts | None] = {}


def stamp_of(cert_path: str | os.PathLike[str], ca_path: str | os.PathLike[str]) -> tuple:
    """The paths and the bytes' digest of both files: which version of them a ``CertFacts`` is of."""
    out: list[object] = [os.fspath(cert_path), os.fspath(ca_path)]
    for path in (cert_path, ca_path):
        try:
            with open(path, "rb") as f:
                out.append(hashlib.sha256(f.read()).digest())
        except OSError:
            out.append(None)
    return tuple(out)


def remember(stamp: tuple, facts: CertFacts | None) -> None:
    """Keep ``facts`` read elsewhere (the TLS file check's child) for the files' ``stamp_of``
    taken before they were read."""
    if len(_FACTS) >= _FACTS_MAX:
        _FACTS.clear()
    _FACTS[stamp] = facts


def cert_facts(cert_path: str | os.PathLike[str], ca_path: str | os.PathLike[str]) -> CertFacts | None:
    """The facts of these files (None: one cannot be parsed), read in a child unless known."""
    stamp = stamp_of(cert_path, ca_path)
    if stamp not in _FACTS:
        remember(stamp, in_child(read_facts, os.fspath(cert_path), os.fspath(ca_path)))
    return _FACTS[stamp]


def read_facts(cert_path: str, ca_path: str) -> CertFacts | None:
    """``CertFacts`` of the files, read here with ``cryptography``; None if one cannot be parsed."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        with open(cert_path, "rb") as f:
            cert = x509.load_pem_x509_certificates(f.read())[0]
        with open(ca_path, "rb") as f:
            cas = x509.load_pem_x509_certificates(f.read())
    except (OSError, ValueError):
        return None
    signed = False
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            signed = True
            break
        except (InvalidSignature, ValueError, TypeError):  # bad signature, other issuer, key type
            continue
    return CertFacts(cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp(),
                     tuple(ca.not_valid_after_utc.timestamp() for ca in cas), signed)


def certificate_warnings(cert_path: str | os.PathLike[str], ca_path: str | os.PathLike[str],
                         now: float | None = None) -> list[CertWarning]:
    """Warnings for the certificate in ``cert_path`` against the CA bundle in ``ca_path``.

    The files were already accepted by the TLS context checks; a file that cannot be parsed
    here gives no warning (the context check reports it).
    """
    facts = cert_facts(cert_path, ca_path)
    if facts is None:
        return []
    now_s = time.time() if now is None else now
    start, end = (_dt.datetime.fromtimestamp(t, _dt.timezone.utc) for t in (facts.not_before, facts.not_after))
    left = facts.not_after - now_s
    soon = min(SOON_S, (facts.not_after - facts.not_before) * SOON_FRACTION)
    checks = (
        ("expired", left <= 0, f"{cert_path}: certificate expired on {end:%Y-%m-%d %H:%M} UTC; peers refuse it"),
        ("not_yet_valid", facts.not_before > now_s,
         f"{cert_path}: certificate not valid before {start:%Y-%m-%d %H:%M} UTC (clock skew?)"),
        ("expiring_soon", 0 < left < soon, f"{cert_path}: certificate expires in {left / 3600:.1f} h "
                                           f"({end:%Y-%m-%d %H:%M} UTC); renew it and reload"),
        ("untrusted", not facts.signed,
         f"{cert_path}: certificate is not signed by a CA of {ca_path}; peers that trust that CA refuse it"),
        ("ca_expired", any(t <= now_s for t in facts.ca_not_after),
         f"{ca_path}: a CA certificate has expired; certificates it signed are refused"),
    )
    return [CertWarning(kind, message) for kind, bad, message in checks if bad]


def material_expiry(cert_path: str | os.PathLike[str], ca_path: str | os.PathLike[str]) -> dict[str, float]:
    """notAfter (POSIX seconds) of the certificate (``"cert"``) and of the CA bundle's first CA to
    expire (``"ca"``); ``CertError`` naming a certificate that cannot be read."""
    facts = cert_facts(cert_path, ca_path)
    if facts is None or not facts.ca_not_after:
        from rpcguard.pki.certs import CertError

        raise CertError(f"{cert_path}, {ca_path}: cannot read the certificate and CA dates")
    return {"cert": facts.not_after, "ca": min(facts.ca_not_after)}
