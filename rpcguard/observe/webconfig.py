"""The metrics endpoint's web config: Prometheus exporter-toolkit format, TLS and basic auth.

Stays whole (over 400 lines): one file format, read and enforced; the reader's key tables and the
guard that applies them must agree key by key, and nothing else uses either.

How this works: ``load_web_config`` reads the YAML file that node_exporter and the other
official exporters take with ``--web.config.file`` (``tls_server_config``,
``http_server_config``, ``basic_auth_users``) into a frozen :class:`WebConfig`, refusing any
key or value rpcguard cannot honour with a ``ConfigError`` naming the file and the key: a
setting is applied or refused, never ignored. :class:`WebGuard` is what one loaded file
becomes at run time: the server ``SSLContext`` (or None for plain HTTP), the extra response
headers, and the basic-auth check.

Basic auth. Passwords are bcrypt hashes (the ``bcrypt`` package); one check costs tens of ms
of CPU (cost 10 ~ 70 ms), so a check runs in a worker thread (bcrypt releases the GIL) and
never on the event loop, at most ``MAX_CONCURRENT_BCRYPT`` at a time, and a successful
(user, password) pair is remembered as an HMAC under a per-process random key (no password is
kept) so that a scrape every 15 s costs one HMAC, not one bcrypt. Unknown users are checked
against a dummy hash so that response time does not tell which user names exist; cache
lookups compare with ``hmac.compare_digest``.

Mapping to Python's ssl (exporter-toolkit's Go names):

* ``client_auth_type``: NoClientCert -> CERT_NONE, VerifyClientCertIfGiven -> CERT_OPTIONAL,
  RequireAndVerifyClientCert -> CERT_REQUIRED. RequestClientCert and RequireAnyClientCert
  accept a certificate *without verifying it*; Python's ssl cannot, so they are refused.
* ``min_version``/``max_version``: TLS10..TLS13 (defaults TLS12 / TLS13, as exporter-toolkit).
* ``cipher_suites``: Go's names of TLS <= 1.2 suites, mapped to OpenSSL names; Go's TLS 1.3
  names are accepted and, as in Go, change nothing (TLS 1.3 suites are not configurable).
* ``client_allowed_sans``: the verified client certificate must carry one of these SANs
  (DNS, IP, e-mail or URI, exact match), checked after the handshake.
* ``http_server_config.headers``: the five headers exporter-toolkit allows, with its value
  rules; ``http2`` only as ``false`` (this endpoint speaks HTTP/1.1).
* refused with a clear error: inline ``cert``/``key`` (give files), ``curve_preferences``
  (no Python binding for a preference list), ``rate_limit``, an encrypted ``key_file`` (the format
  has no passphrase key; OpenSSL would otherwise ask for one on the terminal).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import os
import secrets
import ssl
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

import yaml

from rpcguard.errors import ConfigError
from rpcguard.pki.keyfiles import key_file_problem

__all__ = ["WebConfig", "WebGuard", "BasicAuth", "load_web_config", "CLIENT_AUTH_TYPES", "TLS_VERSIONS",
           "GO_CIPHER_SUITES", "ALLOWED_HEADERS", "AUTH_REASONS", "MAX_CONCURRENT_BCRYPT", "AUTH_CACHE_ENTRIES"]

# exporter-toolkit client_auth_type -> Python verify mode; None = not possible with Python's ssl.
CLIENT_AUTH_TYPES: Mapping[str, ssl.VerifyMode | None] = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": None,
    "RequireAnyClientCert": None,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS: Mapping[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3,
}
# Go crypto/tls names (tls.CipherSuites(): the secure ones) -> OpenSSL names; "" = a TLS 1.3
# suite, which neither Go nor Python lets a server configure.
GO_CIPHER_SUITES: Mapping[str, str] = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_AES_128_GCM_SHA256": "",
    "TLS_AES_256_GCM_SHA384": "",
    "TLS_CHACHA20_POLY1305_SHA256": "",
}
# header -> allowed values (None = any non-empty text), as exporter-toolkit validates them.
ALLOWED_HEADERS: Mapping[str, tuple[str, ...] | None] = {
    "Content-Security-Policy": None,
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-Content-Type-Options": ("nosniff",),
    "X-XSS-Protection": None,
    "Strict-Transport-Security": None,
}
# Stable reasons of a refused request after TLS (metric label of rpcguard_web_refusals_total).
AUTH_REASONS = ("auth_required", "auth_failed", "client_san_not_allowed")

BCRYPT_MAX_PASSWORD_BYTES = 72  # what bcrypt hashes; a longer password never matches a stored hash
MAX_CONCURRENT_BCRYPT = 2  # bcrypt checks running at once (each one is a core for ~70 ms)
AUTH_CACHE_ENTRIES = 64  # successful (user, password) pairs remembered
_BCRYPT_PREFIXES = (b"$2a$", b"$2b$", b"$2y$")
# A cost-10 hash of a random password nobody knows (made once, like exporter-toolkit's): hashing
# one at load time would block the event loop for ~100 ms at every reload.
_DUMMY_HASH = b"$2b$10$3Q3hoNe7/QhqZpcWQx.KMu07VlpugqqfRrDTSH9IA6UoXooKArexC"
_TLS_KEYS = {"cert_file", "key_file", "client_ca_file", "client_ca", "client_auth_type", "client_allowed_sans",
             "min_version", "max_version", "cipher_suites", "prefer_server_cipher_suites"}
_TLS_REFUSED = {"cert": "inline certificates are not supported; use cert_file",
                "key": "inline keys are not supported; use key_file",
                "curve_preferences": "not supported by Python's ssl module (rpcguard uses OpenSSL's defaults)"}
_TOP_REFUSED = {"rate_limit": "not supported by rpcguard (the endpoint already caps connections and header size)"}


@dataclass(frozen=True, slots=True)
class WebConfig:
    """One validated web config file."""

    path: str
    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None
    client_ca: str | None = None  # inline PEM
    client_auth_type: str = "NoClientCert"
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True
    headers: tuple[tuple[str, str], ...] = ()
    users: tuple[tuple[str, bytes], ...] = ()  # (user, bcrypt hash)

    @property
    def tls(self) -> bool:
        return self.cert_file is not None

    @property
    def authenticates(self) -> bool:
        """True if /metrics needs a verified client certificate or a password."""
        return self.client_auth_type == "RequireAndVerifyClientCert" or bool(self.users)

    def files(self) -> tuple[str, ...]:
        """The files this config reads (watched for a reload)."""
        return (self.path,) + tuple(f for f in (self.cert_file, self.key_file, self.client_ca_file) if f)


def _err(path: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"{path}: {key}", message)


def _mapping(v: Any, path: str, key: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _err(path, key, f"must be a mapping, got {type(v).__name__}")
    return v


def _text(v: Any, path: str, key: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise _err(path, key, "must be a non-empty string")
    return v


def _file(v: Any, path: str, key: str) -> str:
    p = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), os.path.expanduser(_text(v, path, key))))
    if not os.path.isfile(p):
        raise _err(path, key, f"no such file: {p}")
    return p


def _check_keys(data: dict, known: set[str], refused: Mapping[str, str], path: str, prefix: str) -> None:
    for k in data:
        where = f"{prefix}{k}"
        if k in refused:
            raise _err(path, where, refused[k])
        if k not in known:
            raise _err(path, where, f"unknown key (expected one of: {', '.join(sorted(known | set(refused)))})")


def load_web_config(path: str) -> WebConfig:
    """Read and validate an exporter-toolkit web config file; raises ``ConfigError``."""
    try:
        with open(path, "rb") as f:
            data = yaml.safe_load(f.read().decode("utf-8-sig"))
    except OSError as e:
        raise ConfigError(path, f"cannot read web config: {e.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(path, "invalid YAML: " + " ".join(str(e).split())[:200]) from None
    data = _mapping(data, path, "(top level)")
    _check_keys(data, {"tls_server_config", "http_server_config", "basic_auth_users"}, _TOP_REFUSED, path, "")
    kw: dict[str, Any] = {"path": os.path.abspath(path)}
    kw.update(_parse_tls(_mapping(data.get("tls_server_config"), path, "tls_server_config"), path))
    kw["headers"] = _parse_http(_mapping(data.get("http_server_config"), path, "http_server_config"), path)
    kw["users"] = _parse_users(_mapping(data.get("basic_auth_users"), path, "basic_auth_users"), path)
    return WebConfig(**kw)


def _parse_tls(t: dict, path: str) -> dict[str, Any]:
    p = "tls_server_config."
    _check_keys(t, _TLS_KEYS, _TLS_REFUSED, path, p)
    if not t:
        return {}
    out: dict[str, Any] = {}
    for k in ("cert_file", "key_file"):
        if t.get(k) is None:
            raise _err(path, p + k, "required when tls_server_config is set")
        out[k] = _file(t[k], path, p + k)
    problem = key_file_problem(out["key_file"])  # the rule of every private key rpcguard reads (pki/keyfiles.py)
    if problem:
        raise _err(path, p + "key_file", problem)
    if t.get("client_ca_file") is not None and t.get("client_ca") is not None:
        raise _err(path, p + "client_ca", "give client_ca or client_ca_file, not both")
    if t.get("client_ca_file") is not None:
        out["client_ca_file"] = _file(t["client_ca_file"], path, p + "client_ca_file")
    if t.get("client_ca") is not None:
        out["client_ca"] = _text(t["client_ca"], path, p + "client_ca")
    auth = t.get("client_auth_type", "NoClientCert")
    if auth not in CLIENT_AUTH_TYPES:
        raise _err(path, p + "client_auth_type", f"{auth!r}: expected one of {', '.join(CLIENT_AUTH_TYPES)}")
    if CLIENT_AUTH_TYPES[auth] is None:
        raise _err(path, p + "client_auth_type", f"{auth} accepts a client certificate without verifying it, which "
                   "Python's ssl cannot do; use RequireAndVerifyClientCert (or VerifyClientCertIfGiven)")
    has_ca = "client_ca_file" in out or "client_ca" in out
    if auth == "NoClientCert" and has_ca:
        raise _err(path, p + "client_auth_type", "client CA configured without a client auth policy "
                   "(set RequireAndVerifyClientCert)")
    if auth != "NoClientCert" and not has_ca:
        raise _err(path, p + "client_ca_file", f"required with client_auth_type {auth}")
    out["client_auth_type"] = auth
    sans = t.get("client_allowed_sans")
    if sans is not None:
        if not isinstance(sans, list) or not sans:
            raise _err(path, p + "client_allowed_sans", "must be a non-empty list of strings")
        if auth != "RequireAndVerifyClientCert":
            raise _err(path, p + "client_allowed_sans", "needs client_auth_type RequireAndVerifyClientCert")
        out["client_allowed_sans"] = tuple(_text(s, path, p + "client_allowed_sans") for s in sans)
    for k, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        v = t.get(k, default)
        if v not in TLS_VERSIONS:
            raise _err(path, p + k, f"{v!r}: expected one of {', '.join(TLS_VERSIONS)}")
        out[k] = v
    if TLS_VERSIONS[out["min_version"]] > TLS_VERSIONS[out["max_version"]]:
        raise _err(path, p + "max_version", f"{out['max_version']} is below min_version {out['min_version']}")
    suites = t.get("cipher_suites")
    if suites is not None:
        if not isinstance(suites, list):
            raise _err(path, p + "cipher_suites", "must be a list of Go cipher suite names")
        for s in suites:
            if s not in GO_CIPHER_SUITES:
                raise _err(path, p + "cipher_suites", f"{s!r} is not a supported suite "
                           f"(expected one of: {', '.join(GO_CIPHER_SUITES)})")
        out["cipher_suites"] = tuple(suites)
    pref = t.get("prefer_server_cipher_suites", True)
    if not isinstance(pref, bool):
        raise _err(path, p + "prefer_server_cipher_suites", "must be true or false")
    out["prefer_server_cipher_suites"] = pref
    return out


def _parse_http(h: dict, path: str) -> tuple[tuple[str, str], ...]:
    p = "http_server_config."
    _check_keys(h, {"headers", "http2"}, {}, path, p)
    if h.get("http2") not in (None, False):
        raise _err(path, p + "http2", "rpcguard's metrics endpoint speaks HTTP/1.1 only; set false or remove")
    out = []
    for name, value in _mapping(h.get("headers"), path, p + "headers").items():
        where = f"{p}headers.{name}"
        if name not in ALLOWED_HEADERS:
            raise _err(path, where, f"header not allowed (expected one of: {', '.join(ALLOWED_HEADERS)})")
        if value in (None, ""):
            continue  # "Unset if blank"
        value = _text(value, path, where)
        allowed = ALLOWED_HEADERS[name]
        if allowed is not None and value.lower() not in allowed:
            raise _err(path, where, f"{value!r}: expected one of {', '.join(allowed)}")
        if any(c in value for c in "\r\n") or not value.isprintable():
            raise _err(path, where, "must be printable text on one line")
        out.append((name, value))
    return tuple(out)


def _parse_users(u: dict, path: str) -> tuple[tuple[str, bytes], ...]:
    out = []
    for user, hashed in u.items():
        where = f"basic_auth_users.{user}"
        if not isinstance(user, str) or not user or ":" in user:
            raise _err(path, where, "user names are non-empty strings without ':'")
        if not isinstance(hashed, str) or len(hashed) != 60 or not hashed.encode().startswith(_BCRYPT_PREFIXES):
            raise _err(path, where, "must be a bcrypt hash ($2y$10$... 60 characters; "
                       "e.g. htpasswd -nBC 10 \"\" | tr -d ':\\n')")
        out.append((user, hashed.encode()))
    return tuple(out)


# ------------------------------------------------------------------------- run time


def _server_context(wc: WebConfig) -> ssl.SSLContext | None:
    if not wc.tls:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_VERSIONS[wc.min_version]
    ctx.maximum_version = TLS_VERSIONS[wc.max_version]
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    if wc.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    names = [GO_CIPHER_SUITES[s] for s in wc.cipher_suites if GO_CIPHER_SUITES[s]]
    try:
        if names:
            ctx.set_ciphers(":".join(names))
        # The format has no passphrase key; without a callback OpenSSL would ask on the terminal.
        ctx.load_cert_chain(wc.cert_file, wc.key_file, password=lambda: _encrypted(wc))  # type: ignore[arg-type]
        if wc.client_ca_file or wc.client_ca:
            ctx.load_verify_locations(cafile=wc.client_ca_file, cadata=wc.client_ca)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ConfigError(wc.path, f"tls_server_config: cannot load certificate, key or client CA: {exc}") from None
    ctx.verify_mode = CLIENT_AUTH_TYPES[wc.client_auth_type]  # type: ignore[assignment]
    return ctx


def _encrypted(wc: WebConfig) -> bytes:
    raise ConfigError(f"{wc.path}: tls_server_config.key_file", f"{wc.key_file} is encrypted and the web config "
                      "format has no passphrase: give an unencrypted key (mode 0600)")


def _sans(cert: dict) -> set[str]:
    """SAN values of a verified peer certificate (``getpeercert()`` form), IPs normalised."""
    out = set()
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "IP Address":
            try:
                value = str(ipaddress.ip_address(value.strip()))
            except ValueError:
                pass
        out.add(value)
    return out


class BasicAuth:
    """bcrypt-checked users with a cache of successful checks. Event-loop thread only."""

    def __init__(self, users: tuple[tuple[str, bytes], ...]) -> None:
        import bcrypt  # only needed when basic auth is configured

        self._bcrypt = bcrypt
        self._users = dict(users)
        self._key = secrets.token_bytes(32)
        self._ok: OrderedDict[bytes, None] = OrderedDict()
        self._sem = asyncio.Semaphore(MAX_CONCURRENT_BCRYPT)
        self._dummy = _DUMMY_HASH  # checked for unknown users: timing does not tell which names exist
        self.bcrypt_checks = 0  # bcrypt computations done (tests, benchmarks)

    def __bool__(self) -> bool:
        return bool(self._users)

    async def check(self, authorization: str | None) -> str | None:
        """None if the ``Authorization`` header value is valid, else a reason of AUTH_REASONS."""
        if not authorization:
            return "auth_required"
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "basic":
            return "auth_required"
        try:
            user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
        except (ValueError, UnicodeDecodeError):
            return "auth_failed"
        if not sep:
            return "auth_failed"
        if len(password.encode()) > BCRYPT_MAX_PASSWORD_BYTES:
            # bcrypt uses 72 bytes at most (bcrypt >= 5 raises past them, older releases cut
            # them off): no stored password is longer, so this one is wrong, whoever the user is.
            return "auth_failed"
        hashed = self._users.get(user)
        digest = hmac.new(self._key, b"\0".join((user.encode(), hashed or b"", password.encode())),
                          hashlib.sha256).digest()
        if hashed is not None and any(hmac.compare_digest(digest, d) for d in self._ok):
            self._ok.move_to_end(digest)
            return None
        async with self._sem:
            self.bcrypt_checks += 1
            try:
                ok = await asyncio.get_running_loop().run_in_executor(
                    None, self._bcrypt.checkpw, password.encode(), hashed or self._dummy)
            except ValueError:  # a password bcrypt will not take (its own checks): a wrong one
                ok = False
        if not ok or hashed is None:
            return "auth_failed"
        self._ok[digest] = None
        while len(self._ok) > AUTH_CACHE_ENTRIES:
            self._ok.popitem(last=False)
        return None


class WebGuard:
    """What the metrics endpoint enforces for one loaded web config (None config = plain HTTP)."""

    def __init__(self, wc: WebConfig | None) -> None:
        self.config = wc
        self.context = _server_context(wc) if wc is not None else None
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in wc.headers) if wc is not None else ""
        self.auth = BasicAuth(wc.users) if wc is not None and wc.users else None
        self.allowed_sans = frozenset(wc.client_allowed_sans) if wc is not None else frozenset()

    @classmethod
    def load(cls, path: str | None) -> WebGuard:
        """Read ``path`` (None = no web config) and build everything; raises ``ConfigError``."""
        return cls(load_web_config(path) if path else None)

    async def authorize(self, authorization: str | None, peercert: dict | None) -> str | None:
        """None if a protected path may be served, else the refusal reason."""
        if self.allowed_sans and not (peercert and _sans(peercert) & self.allowed_sans):
            return "client_san_not_allowed"
        if self.auth is not None:
            return await self.auth.check(authorization)
        return None
