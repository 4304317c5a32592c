"""Mutual-TLS contexts against a private CA, and handshake error -> stable reason mapping.

Stays whole (over 400 lines): the context builders, the file checks they run first and the
handshake-error table are one contract about what a TLS failure looks like to the operator.

How this works: ``server_context`` / ``client_context`` check the files first (readable, PEM,
key matches cert, key not readable by others, EKU fits the role) and raise ``TlsConfigError``
naming the file, so a bad deployment fails at startup or reload with one clear line instead of an
OpenSSL error at the first handshake. The contexts trust ``ca`` only (never the system store),
require a peer certificate on both sides, and default to TLS 1.3.

Cipher suites. ``SSLContext.set_ciphers`` only affects TLS <= 1.2; CPython (3.11, and still 3.13)
has no binding for OpenSSL's ``SSL_CTX_set_ciphersuites``, so TLS 1.3 uses OpenSSL's default
suites, in order TLS_AES_256_GCM_SHA384, TLS_CHACHA20_POLY1305_SHA256, TLS_AES_128_GCM_SHA256
(all AEAD; AES-GCM first suits AES-NI hosts). They can only be changed through the OpenSSL
config file (``Ciphersuites =`` in a ``system_default`` section, via ``OPENSSL_CONF``). With
``min_version="1.2"`` the TLS 1.2 list below is ECDHE + AEAD only, AES-GCM before ChaCha20.

ALPN says what the node enforces. A ``serve`` listener offers exactly one of ``ALPN_ENFORCING``
(every session of the listener, whatever its profile, runs every firewall check in enforce mode)
or ``ALPN_MONITORING`` (some of it runs in monitor mode or with a check switched off,
``observe/downgrades.py``), and the probe form of the same (``+probe``). ``connect`` offers the first two: only a node that
negotiated ``ALPN_ENFORCING`` gets the request firewall left to it (``node_enforces``,
``SessionPolicy.validate_requests``, docs/firewall.md); a monitoring node, one that is not rpcguard
(stunnel, HAProxy) and an older serve (which offers only ``rpcguard/1``) negotiate something else
or nothing, and connect validates every request itself. ``rpcguard check`` and connect's
``/readyz`` offer the two probe forms alone: the node then knows the connection is a probe, never
queues it for the upstream and records it as ``result=probe`` (probe.py), and the probe still
learns whether the node enforces.

Each mode also has a ``+notice`` form (``ALPN_NOTICES``), which a serve listener prefers and a
connect offers first: negotiated, serve tells connect why it ends a session with an end notice
(protocol/notice.py) before it closes. An older serve or connect does not know the form and
negotiates the plain one, and sessions end as before (a bare close).

The transport's ``SSLObject`` is ``DirectSSLObject``: its ``read`` / ``write`` / ``pending`` are
the C object's own methods, so uvloop's TLS loop, which calls them once per record, skips a
Python wrapper frame per call (the wrappers only forward their arguments).

``classify_handshake_error`` maps a failed handshake (either side) to the stable reasons of
docs/design.md with a table of message substrings; the strings were taken from real loopback
handshakes (tests/unit/pki/test_tls.py asserts them). With TLS 1.3 a client learns that the server
refused its certificate only on its first read after the handshake, so callers should classify
that first read error too.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
from pathlib import Path

from rpcguard.errors import PolicyRefusal, RpcGuardError
from rpcguard.pki import preflight
from rpcguard.pki.forked import in_child
from rpcguard.pki.identity import ANY_EKU, CLIENT_AUTH, SERVER_AUTH, PeerIdentity
from rpcguard.pki.keyfiles import key_file_problem, read_passphrase
from rpcguard.pki.tlsversion import DEFAULT_MIN_VERSION, TLS_MIN_VERSIONS, TlsVersion

__all__ = [
    "TlsConfigError",
    "TlsVersion",
    "server_context",
    "client_context",
    "classify_handshake_error",
    "peer_identity",
    "HANDSHAKE_ERROR_REASONS",
    "TLS12_CIPHERS",
    "ALPN_ENFORCING",
    "ALPN_MONITORING",
    "ALPN_PROBES",
    "ALPN_NOTICES",
    "notices",
    "DirectSSLObject",
    "negotiated_rpcguard",
    "node_enforces",
    "node_mode",
    "is_probe",
    "probe_context",
]

# What a serve listener says in the handshake (see the module doc). Never "rpcguard/1": that is
# what serve offered before it said whether it enforces, and an older connect that negotiated it
# left its request checks to any node, monitoring or not.
ALPN_ENFORCING = "rpcguard/1+enforce"
ALPN_MONITORING = "rpcguard/1+monitor"
# The probe forms: offered alone by ``rpcguard check`` and connect's /readyz.
ALPN_PROBES = {ALPN_ENFORCING: "rpcguard/1+enforce+probe", ALPN_MONITORING: "rpcguard/1+monitor+probe"}
# The forms of a connect and a serve that both know the end notice (protocol/notice.py).
ALPN_NOTICES = {ALPN_ENFORCING: "rpcguard/1+enforce+notice", ALPN_MONITORING: "rpcguard/1+monitor+notice"}
_NODE_MODES = {ALPN_ENFORCING: "enforce", ALPN_MONITORING: "monitor",
               ALPN_PROBES[ALPN_ENFORCING]: "enforce", ALPN_PROBES[ALPN_MONITORING]: "monitor",
               ALPN_NOTICES[ALPN_ENFORCING]: "enforce", ALPN_NOTICES[ALPN_MONITORING]: "monitor"}

# tls.min_version's allowed values and default live in pki/tlsversion.py, written once
_VERSIONS = {v: ssl.TLSVersion[f"TLSv1_{v[2:]}"] for v in TLS_MIN_VERSIONS}

# TLS 1.2 only (opt-in): forward secrecy + AEAD. AES-GCM first (AES-NI), 128 before 256 (fewer rounds).
TLS12_CIPHERS = ":".join(
    (
        "ECDHE-ECDSA-AES128-GCM-SHA256",
        "ECDHE-RSA-AES128-GCM-SHA256",
        "ECDHE-ECDSA-AES256-GCM-SHA384",
        "ECDHE-RSA-AES256-GCM-SHA384",
        "ECDHE-ECDSA-CHACHA20-POLY1305",
        "ECDHE-RSA-CHACHA20-POLY1305",
    )
)

# (lower-case substring, reason): first match wins, so specific entries come before generic ones.
# Comments say which side saw the string on loopback with OpenSSL 3.0 (S = server, C = client).
HANDSHAKE_ERROR_REASONS: tuple[tuple[str, str], ...] = (
    ("handshake is taking longer", "tls_handshake_timeout"),  # asyncio/uvloop ssl_handshake_timeout
    ("peer did not return a certificate", "tls_no_client_cert"),  # S: client sent no cert
    ("certificate required", "tls_no_client_cert"),  # C: tlsv13 alert certificate required
    ("certificate has expired", "tls_cert_expired"),  # S/C verify: peer's cert expired
    ("certificate expired", "tls_cert_expired"),  # S/C: sslv3 alert certificate expired
    ("certificate revoked", "tls_cert_revoked"),  # S verify: on the CRL (tls.crl); C: the alert
    ("crl has expired", "tls_crl_expired"),  # S/C verify: the CRL is past its nextUpdate: renew it
    ("unable to get certificate crl", "tls_crl_expired"),  # no CRL of the issuing CA is loaded
    ("hostname mismatch", "node_name_mismatch"),  # C: server cert lacks the DNS name
    ("ip address mismatch", "node_name_mismatch"),  # C: server cert lacks the IP
    ("unable to get local issuer", "tls_unknown_ca"),  # S/C verify: signed by another CA
    ("self-signed certificate", "tls_unknown_ca"),  # S/C verify: self-signed peer / CA not ours
    ("self signed certificate", "tls_unknown_ca"),  # OpenSSL 1.1 spelling
    ("unknown ca", "tls_unknown_ca"),  # S/C: alert from the side that did not trust us
    ("unsupported protocol", "tls_protocol_version"),  # S: client offered TLS 1.2 only
    ("protocol version", "tls_protocol_version"),  # C: tlsv1 alert protocol version
    ("no protocols available", "tls_protocol_version"),
    ("wrong version number", "tls_not_tls"),  # S: plain TCP bytes
    ("http request", "tls_not_tls"),  # S: "GET / HTTP/1.1"
    ("packet length too long", "tls_not_tls"),
    ("record layer failure", "tls_not_tls"),  # OpenSSL 3.2+
    ("unexpected eof", "tls_not_tls"),  # S: connect + close with nothing sent (port probe)
    ("eof occurred in violation of protocol", "tls_not_tls"),
    ("unsuitable certificate purpose", "tls_bad_certificate"),  # S/C verify: wrong EKU
    ("unsupported certificate", "tls_bad_certificate"),  # S/C: alert for wrong EKU
    ("bad certificate", "tls_bad_certificate"),
    ("certificate verify failed", "tls_bad_certificate"),
)


class TlsConfigError(RpcGuardError):
    """A certificate, key or CA file cannot be used; the message names the file."""


def server_context(
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str],
    ca: str | os.PathLike[str],
    *,
    min_version: TlsVersion = DEFAULT_MIN_VERSION,
    allow_insecure_key_perms: bool = False,
    enforcing: bool = True,
    key_passphrase_file: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    """Server side: present ``cert``/``key``; require a client certificate signed by ``ca``.

    ``enforcing``: what the listener says in ALPN (``ALPN_ENFORCING`` or ``ALPN_MONITORING``; its
    notice form preferred, its probe form for probes).
    ``key_passphrase_file``: ``key`` is encrypted with the passphrase on its first line."""
    mode = ALPN_ENFORCING if enforcing else ALPN_MONITORING
    ctx = _context(ssl.PROTOCOL_TLS_SERVER, cert, key, ca, SERVER_AUTH,
                   min_version, allow_insecure_key_perms,
                   [ALPN_NOTICES[mode], mode, ALPN_PROBES[mode]], key_passphrase_file)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    return ctx


def client_context(
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str],
    ca: str | os.PathLike[str],
    *,
    server_name: str,
    min_version: TlsVersion = DEFAULT_MIN_VERSION,
    allow_insecure_key_perms: bool = False,
    probe: bool = False,
    key_passphrase_file: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    """Client side: present ``cert``/``key``; verify the server against ``ca`` and ``server_name``.

    The caller must wrap with ``server_hostname=server_name`` (a DNS name or an IP literal).
    ``probe``: offer the probe forms only (``rpcguard check``, connect's ``/readyz``).
    """
    if not server_name or any(c.isspace() for c in server_name):
        raise TlsConfigError(f"server_name {server_name!r}: expected a DNS name or IP address")
    ctx = _context(ssl.PROTOCOL_TLS_CLIENT, cert, key, ca, CLIENT_AUTH,
                   min_version, allow_insecure_key_perms,
                   list(ALPN_PROBES.values()) if probe else [*ALPN_NOTICES.values(), ALPN_ENFORCING, ALPN_MONITORING],
                   key_passphrase_file)
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def classify_handshake_error(exc: BaseException) -> str:
    """Stable reason for a failed handshake (or the first read after it); see docs/design.md."""
    texts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(texts) < 4:  # the exception and a few causes (asyncio wraps)
        if isinstance(seen, (TimeoutError, asyncio.TimeoutError)):
            return "tls_handshake_timeout"
        texts.append(str(seen))
        texts.append(str(getattr(seen, "reason", "") or "").replace("_", " "))
        texts.append(str(getattr(seen, "verify_message", "") or ""))
        seen = seen.__cause__ or seen.__context__
    text = " ".join(texts).lower()
    for needle, reason in HANDSHAKE_ERROR_REASONS:
        if needle in text:
            return reason
    return "tls_handshake_failed"


def peer_identity(ssl_object: ssl.SSLObject | ssl.SSLSocket) -> PeerIdentity:
    """Identity of the verified peer; ``PolicyRefusal("tls_no_client_cert")`` if it sent none."""
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        raise PolicyRefusal("tls_no_client_cert", "peer presented no certificate")
    return PeerIdentity.from_peercert(ssl_object.getpeercert() or {}, der)


# -- helpers ---------------------------------------------------------------------------------


def _context(
    protocol: int,
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str],
    ca: str | os.PathLike[str],
    purpose: str,
    min_version: str,
    allow_insecure_key_perms: bool,
    alpn: list[str],
    passphrase_file: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    if min_version not in _VERSIONS:
        raise TlsConfigError(f"min_version {min_version!r}: expected one of {', '.join(TLS_MIN_VERSIONS)}")
    pass_file = os.fspath(passphrase_file) if passphrase_file is not None else None
    _check_files(os.fspath(ca), os.fspath(cert), os.fspath(key), purpose, allow_insecure_key_perms, pass_file)
    password = _passphrase(pass_file, allow_insecure_key_perms) if pass_file is not None else None
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = _VERSIONS[min_version]
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    ctx.set_ciphers(TLS12_CIPHERS)  # TLS <= 1.2 only; see the module comment for TLS 1.3
    ctx.set_alpn_protocols(alpn)
    if hasattr(ssl.SSLObject, "_create"):  # CPython >= 3.7; else the plain wrappers
        ctx.sslobject_class = DirectSSLObject
    try:
        ctx.load_verify_locations(cafile=os.fspath(ca))  # private CA only: no load_default_certs()
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"{ca}: cannot load CA certificates: {exc}") from exc
    try:
        ctx.load_cert_chain(os.fspath(cert), os.fspath(key), password=password)
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"{cert}, {key}: cannot load certificate and key: {exc}") from exc
    return ctx


class DirectSSLObject(ssl.SSLObject):
    """``ssl.SSLObject`` with the C object's ``read``/``write``/``pending`` bound on the instance."""

    @classmethod
    def _create(cls, *args: object, **kwargs: object) -> ssl.SSLObject:
        obj = super()._create(*args, **kwargs)  # type: ignore[misc]  # private in typeshed
        c = obj._sslobj
        # Same signatures and errors as the wrappers in ssl.py, which only forward to these.
        obj.read, obj.write, obj.pending = c.read, c.write, c.pending
        return obj


def node_mode(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str | None:
    """What the node said in the handshake: ``"enforce"``, ``"monitor"``, or None (not told)."""
    return _NODE_MODES.get(ssl_object.selected_alpn_protocol() or "") if ssl_object is not None else None


def node_enforces(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> bool:
    """True when the node said in the handshake that it enforces every request check."""
    return ssl_object is not None and ssl_object.selected_alpn_protocol() in _ENFORCING_FORMS


_PROBE_FORMS = frozenset(ALPN_PROBES.values())
_ENFORCING_FORMS = frozenset({ALPN_ENFORCING, ALPN_NOTICES[ALPN_ENFORCING]})
_NOTICE_FORMS = frozenset(ALPN_NOTICES.values())


def notices(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> bool:
    """Both ends said in the handshake that they know the end notice (``ALPN_NOTICES``)."""
    return ssl_object is not None and ssl_object.selected_alpn_protocol() in _NOTICE_FORMS

# The name proxy/link.py calls: a connect leaves its request checks to a node only when this is True.
negotiated_rpcguard = node_enforces


def is_probe(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> bool:
    """The client said in the handshake that this connection is a probe (``ALPN_PROBES``)."""
    return ssl_object is not None and ssl_object.selected_alpn_protocol() in _PROBE_FORMS


def probe_context(
    cert: str | os.PathLike[str], key: str | os.PathLike[str], ca: str | os.PathLike[str], *,
    min_version: TlsVersion = DEFAULT_MIN_VERSION, key_passphrase_file: str | os.PathLike[str] | None = None,
) -> ssl.SSLContext:
    """The client context of ``rpcguard check`` and connect's ``/readyz`` (``ALPN_PROBES``)."""
    return client_context(cert, key, ca, server_name="rpcguard-node", min_version=min_version, probe=True,
                          key_passphrase_file=key_passphrase_file)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{path}: cannot read {what}: {exc.strerror or exc}") from exc


# The files last found good (their paths and contents): serve builds two contexts of the same
# files, and the check, which needs cryptography, runs in a forked child (pki/forked.py) once.
_CHECKED: set[tuple] = set()
_CHECKED_MAX = 16


def _check_files(ca: str, cert: str, key: str, purpose: str, allow_insecure: bool,
                 passphrase_file: str | None = None) -> None:
    """The CA, the certificate and its key can be used for ``purpose``; ``TlsConfigError`` naming the
    file otherwise. Needs ``cryptography``: run in a child unless the process holds it already."""
    stamp = (ca, cert, key, purpose, allow_insecure, passphrase_file,
             *(_stat_stamp(p) for p in (ca, cert, key, passphrase_file) if p is not None))
    if stamp in _CHECKED:
        return
    facts_stamp = preflight.stamp_of(cert, ca)
    preflight.remember(facts_stamp, in_child(_check_files_here, ca, cert, key, purpose, allow_insecure,
                                             passphrase_file))
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED.add(stamp)


def _stat_stamp(path: str) -> tuple[object, ...] | None:
    """Which version of the file: its bytes' digest, mode and owner (a file rewritten in place within
    the file system's timestamp granularity still differs)."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).digest()
    except OSError:
        return None
    return digest, st.st_mode, st.st_uid


def _check_files_here(ca: str, cert: str, key: str, purpose: str, allow_insecure: bool,
                      passphrase_file: str | None) -> preflight.CertFacts | None:
    _check_ca(Path(ca))
    _check_pair(Path(cert), Path(key), purpose, allow_insecure, passphrase_file)
    return preflight.read_facts(cert, ca)  # what the warnings and the expiry gauges will ask next


def _check_ca(path: Path) -> None:
    from cryptography import x509

    data = _read(path, "CA file")
    try:
        cas = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise TlsConfigError(f"{path}: not a PEM CA certificate") from exc
    for ca in cas:
        try:
            is_ca = ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        if not is_ca:
            raise TlsConfigError(f"{path}: {ca.subject.rfc4514_string()} is not a CA certificate (BasicConstraints)")


def _check_pair(cert_path: Path, key_path: Path, purpose: str, allow_insecure: bool,
                passphrase_file: str | None = None) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificates(_read(cert_path, "certificate"))[0]
    except ValueError as exc:
        raise TlsConfigError(f"{cert_path}: not a PEM certificate") from exc
    _check_key_perms(key_path, allow_insecure)
    password = _passphrase(passphrase_file, allow_insecure) if passphrase_file is not None else None
    data = _read(key_path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=password)
    except TypeError as exc:  # encrypted without a passphrase given, or the reverse
        if password is None:
            raise TlsConfigError(f"{key_path}: encrypted private key: give its passphrase in "
                                 "tls.key_passphrase_file") from exc
        raise TlsConfigError(f"{key_path}: private key is not encrypted, but tls.key_passphrase_file "
                             f"{passphrase_file} is set") from exc
    except ValueError as exc:
        if password is not None and b"ENCRYPTED" in data:
            raise TlsConfigError(f"{key_path}: cannot decrypt the private key with the passphrase in "
                                 f"{passphrase_file} (wrong passphrase?)") from exc
        raise TlsConfigError(f"{key_path}: not a PEM private key") from exc
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise TlsConfigError(f"{key_path}: private key does not match certificate {cert_path}")
    try:
        ekus = {oid.dotted_string for oid in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value}
    except x509.ExtensionNotFound:
        return  # no EKU extension: any purpose
    if purpose not in ekus and ANY_EKU not in ekus:
        role = "server (issue --server)" if purpose == SERVER_AUTH else "client (issue --client)"
        raise TlsConfigError(f"{cert_path}: certificate lacks the extended key usage for a {role}")


def _passphrase(path: str, allow_insecure: bool) -> bytes:
    """The passphrase of the key: the key-file rule applies to its file (pki/keyfiles.py)."""
    try:
        return read_passphrase(path, allow_insecure=allow_insecure)
    except ValueError as exc:
        raise TlsConfigError(str(exc)) from None
    except OSError as exc:
        raise TlsConfigError(f"{path}: cannot read passphrase file: {exc.strerror or exc}") from None


def _check_key_perms(path: Path, allow_insecure: bool) -> None:
    """The one rule for private key files (pki/keyfiles.py): readable, a key, not readable by others."""
    problem = key_file_problem(path, allow_insecure=allow_insecure)
    if problem:
        raise TlsConfigError(problem)
