"""Private CA and short-lived leaf certificates, minted with ``cryptography``.

Stays whole (over 400 lines): the CA and every leaf share one signing profile and one set of
key-file writers (modes, atomic replace); csr.py and crl.py build on them.

How this works: ``init_ca`` writes a self-signed CA (``ca.pem``, ``ca.key``) into a directory.
``issue`` loads that CA (``ca_dir``, which may be another directory than the one the leaf is
written to) and signs one leaf (``NAME.pem``, ``NAME.key``) with exactly one extended key
usage, serverAuth or clientAuth, so a client certificate can never serve and a server certificate can
never authenticate as a client. Leaves are short-lived (30 days): renew and let the listener reload
rather than revoke (no CRL/OCSP). Private keys are created with ``os.open(..., 0o600)`` under a
temporary name and renamed into place, so they are never readable by others, even briefly, and a
reader never sees a half-written file.

So that node keys never travel, ``rpcguard.pki.csr`` writes the key and a certificate signing
request on the node and signs that request on the CA machine, through this module's
``_profile`` (name, SAN and usage rules) and ``_sign`` (the extensions): the same as ``issue``.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rpcguard.errors import RpcGuardError

__all__ = [
    "CertError",
    "CaFiles",
    "LeafFiles",
    "KeyType",
    "init_ca",
    "issue",
    "load_cert",
    "cert_not_after",
    "describe",
    "read_key_passphrase",
    "lifetime",
]

KeyType = Literal["ec", "rsa"]

CA_CERT_NAME = "ca.pem"
CA_KEY_NAME = "ca.key"
# Validity starts this far in the past so a peer whose clock is a little behind accepts it.
CLOCK_SKEW = _dt.timedelta(minutes=5)
# 2048 bits: the smallest RSA size every TLS stack still accepts; EC P-256 is the default anyway.
RSA_KEY_BITS = 2048
# x509 upper bound for a CommonName (RFC 5280 ub-common-name); cryptography enforces it too.
MAX_COMMON_NAME_CHARS = 64
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_DNS_LABEL_RE = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)\Z")
_EKU_NAMES = {ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth", ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth"}


class CertError(RpcGuardError):
    """A certificate could not be created, loaded or parsed; the message names the file."""


@dataclass(frozen=True)
class CaFiles:
    """Paths of the CA certificate and its private key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class LeafFiles:
    """Paths of a leaf certificate and its private key."""

    cert: Path
    key: Path


def init_ca(
    directory: str | os.PathLike[str],
    *,
    common_name: str = "rpcguard CA",
    days: int = 365 * 5,
    key_type: KeyType = "ec",
    force: bool = False,
) -> CaFiles:
    """Create ``DIR/ca.pem`` and ``DIR/ca.key``; refuse to replace an existing CA unless ``force``."""
    d = Path(directory)
    files = CaFiles(d / CA_CERT_NAME, d / CA_KEY_NAME)
    if not force:
        for p in (files.cert, files.key):
            if p.exists():
                raise CertError(f"{p}: a CA already exists here (--force replaces it)")
    _check_days(days)
    cn = _check_common_name(common_name)
    key = _new_key(key_type)
    now = _dt.datetime.now(_dt.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(digital_signature=True, key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    make_dir(d)
    _write_private(files.key, _key_pem(key))
    _write_public(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    return files


def make_dir(d: Path) -> None:
    """Create ``d`` (and its parents) if missing, as ``init-ca``, ``issue`` and ``csr`` write into it."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CertError(f"{d}: cannot create the directory: {exc.strerror or exc}") from exc


def issue(
    directory: str | os.PathLike[str],
    name: str,
    *,
    server: bool,
    dns: Iterable[str] = (),
    ips: Iterable[str] = (),
    uris: Iterable[str] = (),
    days: int = 30,
    common_name: str | None = None,
    key_type: KeyType = "ec",
    force: bool = False,
    not_before: _dt.datetime | None = None,
    not_after: _dt.datetime | None = None,
    ca_dir: str | os.PathLike[str] | None = None,
    hours: int | None = None,
    passphrase_file: str | os.PathLike[str] | None = None,
) -> LeafFiles:
    """Sign a leaf with the CA in ``ca_dir`` (default ``directory``); write ``DIR/NAME.pem`` and ``DIR/NAME.key`` (0600).

    ``server=True`` gives EKU serverAuth (and, without any SAN, DNS SAN ``name``); ``server=False``
    gives EKU clientAuth. An existing leaf is replaced only with ``force=True`` (renewal).
    ``not_before``/``not_after`` override the validity window (tests mint expired certificates).
    ``hours`` makes an hour-scale certificate instead of ``days`` (short-lived certificates are
    revocation by expiry: a session never outlives its client certificate, docs/revocation.md).
    ``passphrase_file``: encrypt the key with the first line of that file (``tls.key_passphrase_file``).
    """
    passphrase = read_key_passphrase(passphrase_file)
    files = _leaf_files(directory, name, ".pem", force)
    span = lifetime(days, hours)
    profile = _profile(name, server, dns, ips, uris, common_name)
    ca = _load_ca(ca_dir if ca_dir is not None else directory)
    key = _new_key(key_type)
    cert = _sign(ca, key.public_key(), profile, span, files.cert, not_before, not_after)
    # Key first: a reloading listener that sees the new key with the old cert fails the pair check
    # and keeps its old context until the next poll.
    make_dir(files.key.parent)
    _write_private(files.key, _key_pem(key, passphrase))
    _write_public(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    return files


@dataclass(frozen=True)
class _Profile:
    """What a leaf says: common name, SANs and its one extended key usage."""

    cn: str
    sans: list
    eku: x509.ObjectIdentifier


# A certificate name is a file name (NAME.pem, NAME.key) and the default common name, whose
# X.509 upper bound is 64 characters (RFC 5280 ub-common-name).
MAX_NAME_CHARS = 64


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name) or name.lower() in ("ca", CA_CERT_NAME, CA_KEY_NAME):
        raise CertError(f"invalid certificate name {name!r}: use [A-Za-z0-9._-], not starting with '.', not 'ca'")
    if len(name) > MAX_NAME_CHARS:
        raise CertError(f"certificate name of {len(name)} characters: at most {MAX_NAME_CHARS} (it is the file name "
                        "and the common name)")


def _leaf_files(directory: str | os.PathLike[str], name: str, cert_suffix: str, force: bool) -> LeafFiles:
    _check_name(name)
    d = Path(directory)
    files = LeafFiles(d / f"{name}{cert_suffix}", d / f"{name}.key")
    if not force:
        for p in (files.cert, files.key):
            if p.exists():
                raise CertError(f"{p}: already exists (--force renews it)")
    if d.exists() and not d.is_dir():
        raise CertError(f"{d}: not a directory")
    return files  # a missing directory is created when the files are written


def _profile(name: str, server: bool, dns: Iterable[str], ips: Iterable[str], uris: Iterable[str],
             common_name: str | None) -> _Profile:
    """The one set of naming rules of ``issue``, ``make_csr`` and ``sign_csr``."""
    _check_name(name)
    cn = _check_common_name(common_name if common_name is not None else name)
    sans: list[x509.GeneralName] = [x509.DNSName(_check_dns(v)) for v in dns]
    sans += [x509.IPAddress(_check_ip(str(v))) for v in ips]
    sans += [x509.UniformResourceIdentifier(_check_uri(v)) for v in uris]
    if server and not sans:
        sans.append(x509.DNSName(_check_dns(name)))
    return _Profile(cn, sans, ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH)


def _load_ca(ca_dir: str | os.PathLike[str]) -> tuple[x509.Certificate, object]:
    d = Path(ca_dir)
    ca_cert = load_cert(d / CA_CERT_NAME)
    ca_key = _load_ca_key(d / CA_KEY_NAME)
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if ca_key.public_key().public_bytes(*spki) != ca_cert.public_key().public_bytes(*spki):
        raise CertError(f"{d / CA_KEY_NAME}: does not match {d / CA_CERT_NAME}")
    return ca_cert, ca_key


def lifetime(days: int, hours: int | None = None) -> _dt.timedelta:
    """A leaf's validity: ``hours`` when given (hour-scale certificates, renewed as revocation), else ``days``."""
    if hours is None:
        _check_days(days)
        return _dt.timedelta(days=days)
    if not isinstance(hours, int) or hours < 1:
        raise CertError(f"hours must be a positive integer, got {hours!r}")
    return _dt.timedelta(hours=hours)


def _sign(ca: tuple, public_key, profile: _Profile, days: int | _dt.timedelta, where: Path,
          not_before: _dt.datetime | None, not_after: _dt.datetime | None) -> x509.Certificate:
    ca_cert, ca_key = ca
    now = _dt.datetime.now(_dt.timezone.utc)
    start = not_before if not_before is not None else now - CLOCK_SKEW
    span = days if isinstance(days, _dt.timedelta) else _dt.timedelta(days=days)
    end = not_after if not_after is not None else min(now + span, ca_cert.not_valid_after_utc)
    if end <= start:
        raise CertError(f"{where}: validity window is empty ({start} .. {end})")
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, profile.cn)]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            _key_usage(digital_signature=True, key_agreement=isinstance(public_key, ec.EllipticCurvePublicKey)),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([profile.eku]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
    )
    if profile.sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(profile.sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def load_cert(path: str | os.PathLike[str]) -> x509.Certificate:
    """Return the first certificate of a PEM file; ``CertError`` names the file on any failure."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CertError(f"{path}: cannot read certificate: {exc.strerror or exc}") from exc
    try:
        return x509.load_pem_x509_certificates(data)[0]
    except ValueError as exc:
        raise CertError(f"{path}: not a PEM certificate") from exc


def cert_not_after(path: str | os.PathLike[str]) -> float:
    """Expiry of the certificate in ``path`` as epoch seconds (the expiry metric's value)."""
    return load_cert(path).not_valid_after_utc.timestamp()


def describe(path: str | os.PathLike[str]) -> str:
    """One line for people: subject, SANs, EKU, validity and serial of the certificate in ``path``."""
    cert = load_cert(path)
    parts = [f"subject={cert.subject.rfc4514_string()}", f"issuer={cert.issuer.rfc4514_string()}"]
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        san = None
    if san is not None:
        names = [f"DNS:{v}" for v in san.get_values_for_type(x509.DNSName)]
        names += [f"IP:{v}" for v in san.get_values_for_type(x509.IPAddress)]
        names += [f"URI:{v}" for v in san.get_values_for_type(x509.UniformResourceIdentifier)]
        parts.append("san=" + ",".join(names))
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        parts.append("eku=" + ",".join(_EKU_NAMES.get(oid, oid.dotted_string) for oid in eku))
    except x509.ExtensionNotFound:
        pass
    end = cert.not_valid_after_utc
    left = end - _dt.datetime.now(_dt.timezone.utc)
    secs = left.total_seconds()
    state = ("EXPIRED" if secs <= 0 else f"expires in {left.days}d" if left.days
             else f"expires in {secs / 3600:.1f}h")
    parts.append(f"not_after={end.isoformat()} ({state})")
    parts.append(f"serial={cert.serial_number:x}")
    return " ".join(parts)


# -- helpers ---------------------------------------------------------------------------------


def _new_key(key_type: str) -> ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey:
    if key_type == "ec":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "rsa":
        return rsa.generate_private_key(public_exponent=65537, key_size=RSA_KEY_BITS)
    raise CertError(f"unknown key type {key_type!r}: use 'ec' or 'rsa'")


def _key_usage(**on: bool) -> x509.KeyUsage:
    flags = dict.fromkeys(
        ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
         "key_cert_sign", "crl_sign", "encipher_only", "decipher_only"),
        False,
    )
    flags.update(on)
    return x509.KeyUsage(**flags)


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey, passphrase: bytes | None = None) -> bytes:
    """PKCS#8 PEM; encrypted with ``passphrase`` when given (cryptography's best available
    encryption: PBES2 with AES-256-CBC, which OpenSSL and so the ``ssl`` module read)."""
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def read_key_passphrase(path: str | os.PathLike[str] | None) -> bytes | None:
    """The passphrase to encrypt a new key with (``--passphrase-file``), under the key-file rule."""
    if path is None:
        return None
    from rpcguard.pki.keyfiles import read_passphrase

    try:
        return read_passphrase(path)
    except ValueError as exc:
        raise CertError(str(exc)) from None
    except OSError as exc:
        raise CertError(f"{path}: cannot read passphrase file: {exc.strerror or exc}") from None


def _load_ca_key(path: Path) -> ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey:
    from rpcguard.pki.keyfiles import key_file_problem

    problem = key_file_problem(path)  # the rule of every private key rpcguard reads
    if problem:
        raise CertError(problem.replace("private key", "CA key", 1))
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise CertError(f"{path}: cannot read CA key: {exc.strerror or exc}") from exc
    except (ValueError, TypeError) as exc:
        raise CertError(f"{path}: not an unencrypted PEM private key") from exc
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise CertError(f"{path}: unsupported CA key type {type(key).__name__}")
    return key


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a fresh temp file created with ``mode`` and rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    except OSError as exc:
        raise CertError(f"{path}: cannot write: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # umask may have narrowed it; never widened
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CertError(f"{path}: cannot write: {exc.strerror or exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_private(path: Path, data: bytes) -> None:
    _write_atomic(path, data, 0o600)


def _write_public(path: Path, data: bytes) -> None:
    _write_atomic(path, data, 0o644)


def _check_days(days: int) -> None:
    if not isinstance(days, int) or days < 1:
        raise CertError(f"days must be a positive integer, got {days!r}")


def _check_common_name(cn: str) -> str:
    if not cn or len(cn) > MAX_COMMON_NAME_CHARS or not cn.isprintable():
        raise CertError(f"invalid common name {cn!r}: 1-{MAX_COMMON_NAME_CHARS} printable characters")
    return cn


def _check_dns(name: str) -> str:
    """A lower-case ASCII host name; a single leading ``*.`` wildcard label is allowed."""
    value = name.lower().rstrip(".")
    labels = value.split(".")
    if labels and labels[0] == "*" and len(labels) > 1:
        labels = labels[1:]
    if len(value) > 253 or not all(_DNS_LABEL_RE.match(label) for label in labels):
        raise CertError(f"invalid DNS name {name!r}")
    return value


def _check_ip(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(value)
    except ValueError as exc:
        raise CertError(f"invalid IP address {value!r}") from exc


def _check_uri(value: str) -> str:
    parts = urlsplit(value)
    if not parts.scheme or not (parts.netloc or parts.path) or any(c.isspace() for c in value):
        raise CertError(f"invalid URI {value!r}: expected scheme://authority/path, e.g. spiffe://lab/llama")
    return value
