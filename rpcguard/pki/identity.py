"""Peer identity from a verified certificate, and the allow-list that authorizes it.

Stays whole (over 400 lines): the identity read from a certificate and the allow-list entries that
match it must agree field by field (CN, SANs, SPIFFE URIs, networks); one reader, one matcher.

How this works: once the TLS layer has verified the peer's chain against the private CA, the peer
certificate (DER) becomes a ``PeerIdentity``: CN, DNS / URI / IP SANs, serial, expiry, fingerprint.
``Acl.authorize`` is then a pure function of that identity (as in ghostunnel's ``auth/auth.go``):
the peer passes if any allow-list entry matches, else ``PolicyRefusal("identity_not_allowed")``.
An ``AllowList`` is an ordered list of such entries, each of which may name a profile (the policy
and limits its identities are held to): the FIRST entry that matches decides the profile, so a
narrow entry (``cn: [grafana-probe], profile: monitor``) goes before a broad one (``all: true``).

An ACL admits nobody until it has entries or ``allow_any`` (``--allow-all``, YAML
``allow: {all: true}``): like ghostunnel, "any certificate the CA signed" must be said explicitly,
and the config layer refuses to start a listener with an empty allow-list.

Whoever issued it, a peer certificate must be meant for its role: ``check_usage`` requires the
clientAuth extended key usage of a client and serverAuth of a server (``certificate_usage_invalid``
otherwise), so a server certificate stolen from a node cannot be used to log in as a client. OpenSSL
itself only checks the EKU when the extension is present; a certificate without one passes it.

Matching is strict where a name could be smuggled: a wildcard URI entry matches only plain path
segments (no empty, ``.``/``..`` or percent-encoded segment), and a DNS SAN that itself contains
a wildcard (``*.lab``) never satisfies an entry. This module never imports ``ssl``: the TLS layer
hands it what OpenSSL read from the verified certificate (``from_peercert``: ``getpeercert()``'s
names and dates, and the DER, from which only the extended key usage is read here) or the DER
alone (``from_der``, with ``cryptography``: tools and tests). serve and connect never import
``cryptography`` (its library is the largest part of an idle process, docs/performance.md).
"""

from __future__ import annotations

import calendar
import hashlib
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from rpcguard.errors import PolicyRefusal

__all__ = ["PeerIdentity", "Acl", "AllowList", "check_usage", "source_of", "CLIENT_AUTH", "SERVER_AUTH", "ANY_EKU",
           "extended_key_usages"]

# An IPv6 host is given a /64 (RFC 4291's interface identifiers; SLAAC privacy addresses rotate
# inside it): it can connect from any of its 2^64 addresses, so the per-source caps count the /64.
SOURCE_V6_PREFIX = 64


def source_of(host: str) -> str:
    """The unit the per-source caps count (limits.max_*_per_source, the metrics endpoint): an
    IPv4 address (also written as IPv4-mapped IPv6), or an IPv6 address's /64."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> (128 - SOURCE_V6_PREFIX) << (128 - SOURCE_V6_PREFIX),
                                          SOURCE_V6_PREFIX)))
    return str(ip)

CLIENT_AUTH = "1.3.6.1.5.5.7.3.2"  # id-kp-clientAuth (RFC 5280 4.2.1.12)
SERVER_AUTH = "1.3.6.1.5.5.7.3.1"  # id-kp-serverAuth
ANY_EKU = "2.5.29.37.0"  # anyExtendedKeyUsage
_EKU_OID = b"\x55\x1d\x25"  # 2.5.29.37, the extendedKeyUsage extension, DER-encoded
# A path segment a URI wildcard may match: RFC 3986 pchar without percent-encoding (SPIFFE IDs
# allow only letters, digits, '.', '-', '_'); "." and ".." are refused separately.
_PLAIN_SEGMENT = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@-]+")

# label() shows at most this many values per kind, so one log line stays short.
LABEL_MAX_VALUES = 3
IpNet = ipaddress.IPv4Network | ipaddress.IPv6Network


def _printable(text: str) -> str:
    """Escape control characters: names come from a certificate and end up in log lines."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _norm_ip(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(value)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass(frozen=True)
class PeerIdentity:
    """What a verified peer certificate says about its holder."""

    common_name: str | None
    dns: tuple[str, ...]
    uris: tuple[str, ...]
    ips: tuple[str, ...]
    serial: int
    not_after: float
    fingerprint_sha256: str
    ekus: tuple[str, ...] | None = None  # extended key usage OIDs (dotted); None: no EKU extension

    @classmethod
    def from_peercert(cls, cert: Mapping[str, Any], der: bytes) -> "PeerIdentity":
        """The identity of a peer OpenSSL verified: ``cert`` is ``getpeercert()``, ``der`` is
        ``getpeercert(binary_form=True)``. The names, serial and dates are OpenSSL's reading; the
        extended key usage, which ``getpeercert()`` leaves out, is read from ``der``
        (``extended_key_usages``). ``ValueError`` if either is not what OpenSSL gives."""
        cns = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
        names: dict[str, list[str]] = {"DNS": [], "URI": [], "IP Address": []}
        for kind, value in cert.get("subjectAltName", ()):
            if kind in names:
                names[kind].append(value)
        return cls(
            common_name=cns[0] if cns else None,
            dns=tuple(v.lower() for v in names["DNS"]),
            uris=tuple(names["URI"]),
            ips=tuple(_ip_text(v) for v in names["IP Address"]),
            serial=int(cert["serialNumber"], 16),
            not_after=float(_cert_time(cert["notAfter"])),
            fingerprint_sha256=hashlib.sha256(der).hexdigest(),
            ekus=extended_key_usages(der),
        )

    @classmethod
    def from_der(cls, der: bytes) -> "PeerIdentity":
        """Parse a DER certificate with ``cryptography`` (tools, tests); ``ValueError`` if it is not one."""
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        cert = x509.load_der_x509_certificate(der)
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        cn = cns[0].value if cns else None
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            dns = tuple(v.lower() for v in san.get_values_for_type(x509.DNSName))
            uris = tuple(san.get_values_for_type(x509.UniformResourceIdentifier))
            ips = tuple(str(v) for v in san.get_values_for_type(x509.IPAddress))
        except x509.ExtensionNotFound:
            dns, uris, ips = (), (), ()
        try:
            eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
            ekus: tuple[str, ...] | None = tuple(oid.dotted_string for oid in eku)
        except x509.ExtensionNotFound:
            ekus = None
        return cls(
            common_name=cn if isinstance(cn, str) else None,
            dns=dns,
            uris=uris,
            ips=ips,
            serial=cert.serial_number,
            not_after=cert.not_valid_after_utc.timestamp(),
            fingerprint_sha256=hashlib.sha256(der).hexdigest(),
            ekus=ekus,
        )

    def label(self) -> str:
        """Short human form for logs, e.g. ``CN=client1 URI=spiffe://lab/llama``."""
        parts = []
        if self.common_name is not None:
            parts.append(f"CN={_printable(self.common_name)}")
        for kind, values in (("DNS", self.dns), ("URI", self.uris), ("IP", self.ips)):
            if values:
                shown = ",".join(_printable(v) for v in values[:LABEL_MAX_VALUES])
                more = len(values) - LABEL_MAX_VALUES
                parts.append(f"{kind}={shown}" + (f",+{more}" if more > 0 else ""))
        return " ".join(parts) or f"serial={self.serial:x}"


@dataclass(frozen=True)
class Acl:
    """Allow-list of peer identities; a peer is allowed if ANY entry matches.

    - ``cns``: exact, case-sensitive CommonName.
    - ``dns``: DNS SAN, case-insensitive; ``*.lab.example`` matches exactly one extra leftmost label.
    - ``uris``: URI SAN, exact; an entry ending in ``/*`` matches any URI below that prefix
      (``spiffe://lab/llama/*`` matches ``spiffe://lab/llama/a/b`` but not ``spiffe://lab/llama``).
    - ``ips``: IP SAN, an address or a CIDR network (``10.0.0.0/8``); IPv4-mapped IPv6 counts as IPv4.
    - No entries and ``allow_any=False``: nobody is allowed (the config layer refuses to start so).

    Invalid entries raise ``ValueError`` (the config layer turns it into a ``ConfigError``).
    """

    cns: tuple[str, ...] = ()
    dns: tuple[str, ...] = ()
    uris: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()
    allow_any: bool = False
    profile: str | None = None  # the profile of the identities this entry admits (None: the default)
    _nets: tuple[IpNet, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        for name in ("cns", "dns", "uris", "ips"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"{name}: expected a list of strings, got a string")
            object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "dns", tuple(_check_dns_entry(d) for d in self.dns))
        for uri in self.uris:
            if not uri or "*" in uri[:-1] or (uri.endswith("*") and not uri.endswith("/*")):
                raise ValueError(f"uris: {uri!r}: only a trailing '/*' wildcard is supported")
        nets = []
        for entry in self.ips:
            try:
                net = ipaddress.ip_network(entry, strict=True)
            except ValueError as exc:
                raise ValueError(f"ips: {entry!r}: {exc}") from None
            if isinstance(net, ipaddress.IPv6Network) and net.network_address.ipv4_mapped and net.prefixlen >= 96:
                net = ipaddress.ip_network(f"{net.network_address.ipv4_mapped}/{net.prefixlen - 96}")
            nets.append(net)
        object.__setattr__(self, "_nets", tuple(nets))
        if self.allow_any and not self.is_empty:
            raise ValueError("allow_any cannot be combined with allow-list entries")

    @property
    def is_empty(self) -> bool:
        """True when there are no entries (then only ``allow_any`` admits anyone)."""
        return not (self.cns or self.dns or self.uris or self.ips)

    def allows(self, identity: PeerIdentity) -> bool:
        """True if ``identity`` passes this ACL."""
        if self.allow_any:
            return True
        if identity.common_name is not None and identity.common_name in self.cns:
            return True
        if any(_dns_match(entry, name) for entry in self.dns for name in identity.dns):
            return True
        if any(_uri_match(entry, uri) for entry in self.uris for uri in identity.uris):
            return True
        for value in identity.ips:
            try:
                ip = _norm_ip(value)
            except ValueError:
                continue
            if any(ip in net for net in self._nets):
                return True
        return False

    def authorize(self, identity: PeerIdentity) -> None:
        """Return if ``identity`` is allowed, else raise ``PolicyRefusal("identity_not_allowed")``."""
        if not self.allows(identity):
            raise PolicyRefusal("identity_not_allowed", f"{identity.label()} is not in the allow-list")



@dataclass(frozen=True)
class AllowList:
    """Ordered allow-list entries: a peer passes if any matches; the first match names its profile."""

    entries: tuple[Acl, ...] = ()

    @property
    def is_empty(self) -> bool:
        """True when no entry admits anyone."""
        return all(e.is_empty and not e.allow_any for e in self.entries)

    def match(self, identity: PeerIdentity) -> Acl | None:
        """The first entry that admits ``identity``, or None."""
        return next((e for e in self.entries if e.allows(identity)), None)

    def allows(self, identity: PeerIdentity) -> bool:
        return self.match(identity) is not None

    def authorize(self, identity: PeerIdentity) -> Acl:
        """The entry that admits ``identity``, else ``PolicyRefusal("identity_not_allowed")``."""
        entry = self.match(identity)
        if entry is None:
            raise PolicyRefusal("identity_not_allowed", f"{identity.label()} is not in the allow-list")
        return entry

    def profile_of(self, identity: PeerIdentity) -> str | None:
        """The profile named by the first entry admitting ``identity`` (None: default or not admitted)."""
        entry = self.match(identity)
        return entry.profile if entry is not None else None


def _ip_text(value: str) -> str:
    """OpenSSL writes an IPv6 SAN in full upper case (``2001:DB8:0:0:0:0:0:1``): the short form."""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return value


_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def _cert_time(text: str) -> int:
    """A date as ``getpeercert()`` writes it (``Jun  1 12:00:00 2027 GMT``), in POSIX seconds (the
    same reading as ``ssl.cert_time_to_seconds``, without its module or the locale)."""
    month, day, hms, year, zone = text.split()
    if zone != "GMT":
        raise ValueError(f"certificate time {text!r}: expected GMT")
    hours, minutes, seconds = (int(x) for x in hms.split(":"))
    return calendar.timegm((int(year), _MONTHS.index(month) + 1, int(day), hours, minutes, seconds))


def extended_key_usages(der: bytes) -> tuple[str, ...] | None:
    """The extended key usage OIDs (dotted) of the DER certificate ``der``; None when it has no
    such extension. Reads only the outline of RFC 5280 4.1 (Certificate, tbsCertificate, its [3]
    extensions, each Extension's extnID and extnValue) of a certificate OpenSSL already verified;
    ``ValueError`` if that outline is not there."""
    cert = _children(der, *_expect(der, 0, 0x30, whole=True))
    tbs = _children(der, *cert[0][1:]) if cert and cert[0][0] == 0x30 else None
    if tbs is None:
        raise ValueError("not a DER certificate")
    for tag, start, end in tbs:
        if tag != 0xA3:  # [3] EXPLICIT Extensions
            continue
        for _, e_start, e_end in _children(der, *_expect(der, start, 0x30, limit=end)):
            fields = _children(der, e_start, e_end)
            if len(fields) < 2 or fields[0][0] != 0x06 or fields[-1][0] != 0x04:
                raise ValueError("malformed certificate extension")
            if der[fields[0][1]:fields[0][2]] != _EKU_OID:
                continue
            _, v_start, v_end = fields[-1]
            seq = _children(der, *_expect(der, v_start, 0x30, limit=v_end))
            return tuple(_oid_text(der[s:e]) for tag_, s, e in seq if tag_ == 0x06)
    return None


def _expect(buf: bytes, pos: int, tag: int, *, whole: bool = False, limit: int | None = None) -> tuple[int, int]:
    """(start, end) of the value of the TLV at ``pos``, which must have ``tag``."""
    t, start, end = _tlv(buf, pos, len(buf) if limit is None else limit)
    if t != tag or (whole and end != len(buf)):
        raise ValueError("not a DER certificate")
    return start, end


def _tlv(buf: bytes, pos: int, limit: int) -> tuple[int, int, int]:
    """(tag, value start, value end) of the DER TLV at ``pos``, ending at or before ``limit``."""
    if pos + 2 > limit or buf[pos] & 0x1F == 0x1F:
        raise ValueError("truncated or unsupported DER")
    first = buf[pos + 1]
    start = pos + 2
    if first < 0x80:
        length = first
    else:
        n = first & 0x7F
        if not 1 <= n <= 4 or start + n > limit:
            raise ValueError("bad DER length")
        length = int.from_bytes(buf[start:start + n], "big")
        start += n
    if start + length > limit:
        raise ValueError("truncated DER")
    return buf[pos], start, start + length


def _children(buf: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    out = []
    pos = start
    while pos < end:
        tag, s, e = _tlv(buf, pos, end)
        out.append((tag, s, e))
        pos = e
    return out


def _oid_text(body: bytes) -> str:
    arcs: list[int] = []
    value = 0
    for b in body:
        value = (value << 7) | (b & 0x7F)
        if not b & 0x80:
            arcs.append(value)
            value = 0
    if not arcs or body[-1] & 0x80:
        raise ValueError("bad DER object identifier")
    first = min(arcs[0] // 40, 2)
    return ".".join(str(a) for a in (first, arcs[0] - 40 * first, *arcs[1:]))


def _check_dns_entry(entry: str) -> str:
    value = entry.lower().rstrip(".")
    labels = value.split(".")
    if not value or "" in labels or "*" in ".".join(labels[1:]) or ("*" in labels[0] and labels[0] != "*"):
        raise ValueError(f"dns: {entry!r}: expected a host name, optionally with a leading '*.' label")
    if labels[0] == "*" and len(labels) < 2:
        raise ValueError(f"dns: {entry!r}: a wildcard needs a parent domain")
    return value


def check_usage(identity: PeerIdentity, role: str) -> None:
    """Refuse a peer certificate not meant for ``role`` (``"client"`` or ``"server"``): it must
    carry the clientAuth / serverAuth extended key usage (anyExtendedKeyUsage or no EKU at all do
    not count), whoever issued it."""
    needed, name = (CLIENT_AUTH, "clientAuth") if role == "client" else (SERVER_AUTH, "serverAuth")
    if identity.ekus is None or needed not in identity.ekus:
        has = "no extended key usage" if identity.ekus is None else f"extended key usage {', '.join(identity.ekus)}"
        raise PolicyRefusal(
            "certificate_usage_invalid", f"{identity.label()}: {role} certificate without {name} ({has})"
        )


def _dns_match(entry: str, name: str) -> bool:
    if "*" in name:  # a wildcard SAN names no host: it never satisfies an entry
        return False
    name = name.lower().rstrip(".")
    if entry.startswith("*."):
        head, _, rest = name.partition(".")
        return bool(head) and rest == entry[2:]
    return name == entry


def _uri_match(entry: str, uri: str) -> bool:
    if not entry.endswith("/*"):
        return uri == entry
    prefix = entry[:-1]  # keep the slash: "spiffe://lab/llama/"
    if not uri.startswith(prefix) or len(uri) == len(prefix):
        return False
    # Only plain segments: no empty, "." or ".." segment ("spiffe://lab/llama/../admin" is not
    # under the prefix), and no percent-encoding at all ("%2e%2e" is ".." to whoever decodes it,
    # "%2f" a slash), nor "?", "#", "\\" or non-ASCII.
    return all(seg not in (".", "..") and _PLAIN_SEGMENT.fullmatch(seg) for seg in uri[len(prefix):].split("/"))

