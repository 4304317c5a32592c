"""YAML configuration -> frozen dataclasses, the runtime settings types included.

How this works: ``load_config`` reads the file with a safe YAML loader that also refuses duplicate
keys; ``parse_config`` walks the plain data section by section. Every reader knows the dotted key
path of what it reads (``listeners[1].upstream``) and raises ``ConfigError(path, message)`` on the
first problem, so an error is always one line naming the key. Unknown keys are errors. Safe defaults
are enforced here, ghostunnel style (loopback upstream / tunnel listen / metrics, TLS 1.3); the
``unsafe_*`` keys are the explicit opt-outs. ``build_config`` lays CLI flags over the file: a value
that came from a flag is wrapped in ``_Flag`` so its errors name the flag (``--upstream``).

``policy`` and ``limits`` are parsed straight into the runtime types of ``protocol/settings.py``
(``SessionPolicy`` with its ``FirewallPolicy``, ``Limits``, ``Profile``): each YAML key is one row
of ``_POLICY_KEYS`` / ``_LIMIT_KEYS`` naming the field it sets, and layers (top level, listener,
profile) are applied with ``dataclasses.replace`` over the defaults written in settings.py, so no
default is repeated here. ``profiles`` (serve) are named policy/limits overlays; an allow-list entry
that names one puts the identities it admits under it (``identity.AllowList``: first match wins).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from dataclasses import dataclass, field, replace
from fractions import Fraction
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

import yaml

from rpcguard.protocol.ggml import OP_TABLES
from rpcguard.protocol.settings import (
    CHECK_NAMES, DEFAULT_PROFILE, Limits, Profile, SessionPolicy, default_policy,
)
from rpcguard.protocol.versions import CATEGORIES as _CATEGORIES
from rpcguard.protocol.versions import COMMAND_NAMES, KNOWN_VERSIONS, parse_version

from .errors import ConfigError

if TYPE_CHECKING:
    from .identity import AllowList

__all__ = [
    "COMMAND_NAMES", "CATEGORIES", "CHECK_NAMES", "ROLES", "DEFAULT_METRICS", "KIB", "MIB", "GIB",
    "Address", "TlsConfig", "MetricsConfig", "LogConfig", "ListenerConfig", "TunnelConfig", "Config",
    "POLICY_FIELDS", "LIMIT_KEYS", "PROFILE_ONLY_TOP_LIMITS",
    "parse_address", "parse_size", "expand_commands",
    "load_config", "parse_config", "build_config", "check_config", "config_summary",
]

log = logging.getLogger("rpcguard.config")

ROLES = ("serve", "connect")
_OP_NAMES = frozenset(name for table in OP_TABLES.values() for name in table.ids)
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

#: ggml-rpc command names (index = wire id) and the ``allow_commands`` categories (``"@name"``),
#: both from the one command table in ``protocol.versions``.
CATEGORIES: Mapping[str, tuple[str, ...]] = MappingProxyType({"@" + k: v for k, v in _CATEGORIES.items()})


@dataclass(frozen=True, slots=True)
class Address:
    """A TCP endpoint; ``host`` is a name, an IPv4 address or a bare IPv6 address."""
    host: str
    port: int

    def is_loopback(self) -> bool:
        """True for ``localhost``, 127.0.0.0/8 and ::1 (also as ::ffff:127.x.y.z)."""
        if self.host.lower() == "localhost":
            return True
        ip = ipaddress.ip_address(self.host) if _is_ip(self.host) else None
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip is not None and ip.is_loopback

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: str  # absolute paths, checked readable at load time
    key: str
    ca: str
    min_version: Literal["1.2", "1.3"] = "1.3"
    reload_interval_s: float = 0.0  # 0 = reload on SIGHUP only; > 0 also polls the files' mtimes


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    listen: Address | None = None  # None = metrics HTTP endpoint disabled
    unsafe_public: bool = False
    web_config: str | None = None  # exporter-toolkit web config file (TLS, basic auth), absolute


@dataclass(frozen=True, slots=True)
class LogConfig:
    format: Literal["text", "json"] = "text"
    level: Literal["debug", "info", "warning", "error"] = "info"


@dataclass(frozen=True, slots=True)
class ListenerConfig:
    """``serve``: accept mTLS on ``listen``, relay to the loopback ggml-rpc-server ``upstream``.

    ``default`` is the listener's own policy and limits; ``profiles`` holds, by name, the profiles
    its allow-list entries name, each already merged over ``default``."""
    name: str
    listen: Address
    upstream: Address
    allow: AllowList
    default: Profile = Profile()
    profiles: Mapping[str, Profile] = field(default_factory=lambda: MappingProxyType({}))
    unsafe_upstream: bool = False

    @property
    def policy(self) -> SessionPolicy:
        return self.default.policy


@dataclass(frozen=True, slots=True)
class TunnelConfig:
    """``connect``: plain TCP on loopback ``listen`` for llama.cpp, mTLS to ``server``."""
    name: str
    listen: Address
    server: Address
    server_name: str  # expected in the server certificate; default: server.host
    default: Profile = Profile(policy=default_policy("connect"))
    unsafe_listen: bool = False

    @property
    def policy(self) -> SessionPolicy:
        return self.default.policy


@dataclass(frozen=True, slots=True)
class Config:
    role: Literal["serve", "connect"]
    tls: TlsConfig
    metrics: MetricsConfig = MetricsConfig()
    log: LogConfig = LogConfig()
    limits: Limits = Limits()  # the top-level limits: every listener's default, drain_timeout_s
    listeners: tuple[ListenerConfig, ...] = ()
    tunnels: tuple[TunnelConfig, ...] = ()
    profiles: tuple[str, ...] = ()  # serve: names of the profiles defined (used or not)


DEFAULT_METRICS = MappingProxyType({"serve": Address("127.0.0.1", 9450), "connect": Address("127.0.0.1", 9451)})

# ---------------------------------------------------------------- public value parsers

_ADDR_RE = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([A-Za-z0-9_.-]+):(\d{1,5})")
_HOST_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?")
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": KIB, "mib": MIB, "gib": GIB, "tib": 1 << 40}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _host_ok(host: Any) -> bool:
    """An IP address, or a host name (a numeric-looking name must be a real IPv4 address)."""
    return isinstance(host, str) and (_is_ip(host) or (
        not re.fullmatch(r"[\d.]+", host) and _HOST_RE.fullmatch(host) is not None))


def parse_address(text: object, *, allow_port_zero: bool = False) -> Address:
    """Parse ``HOST:PORT`` or ``[IPv6]:PORT``; raises ``ValueError`` with a one-line message."""
    m = _ADDR_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"must be HOST:PORT ([IPv6]:PORT), got {_show(text)}")
    v6, host, port = m.group(1) is not None, m.group(1) or m.group(3), int(m.group(2) or m.group(4))
    if not (":" in host and _is_ip(host) if v6 else _host_ok(host)):
        raise ValueError(f"bad {'IPv6 address' if v6 else 'host'} in {text!r}")
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise ValueError(f"port must be {0 if allow_port_zero else 1}..65535, got {text!r}")
    return Address(str(ipaddress.IPv6Address(host)) if v6 else host, port)


def parse_size(value: object, *, allow_zero: bool = True) -> int:
    """Bytes from an int or a string like ``"64MiB"``/``"1.5GiB"``/``"10MB"``, computed exactly."""
    m = _SIZE_RE.fullmatch(value) if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif m and m.group(2).lower() in _SIZE_UNITS:
        exact = Fraction(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
        if exact.denominator != 1:
            raise ValueError(f"must be a whole number of bytes, got {value!r}")
        n = int(exact)
    else:
        raise ValueError(f"must be a size in bytes (integer, or like '64MiB'), got {_show(value)}")
    if n < 0 or (n == 0 and not allow_zero):
        raise ValueError(f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return n


# ---------------------------------------------------------------- readers: (value, path) -> value

Reader = Callable[[Any, str], Any]


def _show(v: object) -> str:
    """A short one-line rendering of a bad value for an error message."""
    try:
        s = "a mapping" if isinstance(v, dict) else "a list" if isinstance(v, list) else repr(v)
    except ValueError:  # an int beyond sys.get_int_max_str_digits()
        s = f"a huge {type(v).__name__}"
    return s if len(s) <= 60 else s[:57] + "..."


def _reader(ok: Callable[[Any], Any], want: str, conv: Callable[[Any], Any] = lambda v: v) -> Reader:
    """A reader accepting values where ``ok(v)``; otherwise ``"<path>: must be <want>, got <v>"``."""
    def read(v: Any, path: str) -> Any:
        if not ok(v):
            raise ConfigError(path, f"must be {want}, got {_show(v)}")
        return conv(v)
    return read


def _via(parse: Callable[..., Any], **kw: Any) -> Reader:
    """A reader from a public parser that raises ``ValueError``."""
    def read(v: Any, path: str) -> Any:
        try:
            return parse(v, **kw)
        except ValueError as e:
            raise ConfigError(path, str(e)) from None
    return read


def _list(item: Reader) -> Reader:
    def read(v: Any, path: str) -> tuple:
        if not isinstance(v, list):
            raise ConfigError(path, f"must be a list, got {_show(v)}")
        return tuple(item(x, f"{path}[{i}]") for i, x in enumerate(v))
    return read


def _re(pattern: str) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and re.fullmatch(pattern, v) is not None


def _choice(*choices: str) -> Reader:  # a float is read as text: YAML makes `min_version: 1.3` a float
    text = lambda v: str(v) if isinstance(v, float) else v  # noqa: E731
    return _reader(lambda v: text(v) in choices, "one of " + ", ".join(choices), text)


def _duration(zero_is_off: bool = False) -> Reader:
    def ok(v: Any) -> bool:  # abs(v) < 1e15 also refuses nan and inf
        return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e15 and (
            v > 0 or (zero_is_off and v == 0))
    return _reader(ok,
                   "a number of seconds " + (">= 0 (0 = off)" if zero_is_off else "> 0"), float)


def _ip(v: Any, path: str) -> str:
    try:
        return str(ipaddress.ip_network(v if isinstance(v, str) else ""))
    except ValueError:
        raise ConfigError(path, f"must be an IP address or network, got {_show(v)}") from None


_str = _reader(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")
_bool = _reader(lambda v: isinstance(v, bool), "true or false")
_count = _reader(lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "an integer > 0")
_name = _reader(_re(r"[A-Za-z0-9_.-]+"), "a name of letters, digits, '_', '.', '-'")
_version = _reader(_re(r"\d+\.\d+\.\d+"), "a version like '7.0.0'")
_uri = _reader(_re(r"[A-Za-z][A-Za-z0-9+.-]*:\S+"), "a URI like 'spiffe://domain/workload'")
_server_name = _reader(_host_ok, "a host name or IP address")
_command = _reader(lambda v: isinstance(v, str) and (v in COMMAND_NAMES or v in CATEGORIES),
                   f"a command name like SET_TENSOR or a category ({', '.join(CATEGORIES)})")
_op = _reader(lambda v: isinstance(v, str) and v in _OP_NAMES,
              "a ggml op name like SSM_SCAN or GATED_DELTA_NET (see rpcguard/protocol/ggml.py)")
_op_or_all = _reader(lambda v: isinstance(v, str) and (v in _OP_NAMES or v == "*"),
                     "a ggml op name like IM2COL, or * for every op")
_listen, _connect = _via(parse_address, allow_port_zero=True), _via(parse_address)  # listen :0 = any port


def _file(base_dir: str | None) -> Reader:
    """A readable regular file; relative to ``base_dir`` (the config's dir), or the cwd for flags."""
    def read(v: Any, path: str) -> str:
        p = os.path.expanduser(_str(v, path))
        p = os.path.normpath(os.path.join(os.getcwd() if path.startswith("--") or base_dir is None
                                          else base_dir, p))
        if not os.path.isfile(p):
            raise ConfigError(path, f"{'not a regular file' if os.path.exists(p) else 'no such file'}: {p}")
        try:
            open(p, "rb").close()
        except OSError as e:
            raise ConfigError(path, f"cannot read {p}: {e.strerror}") from None
        return p
    return read


# ---------------------------------------------------------------- sections


@dataclass(frozen=True, slots=True)
class _Flag:
    """A value set by a CLI flag: errors about it name the flag instead of the key path."""
    value: Any
    flag: str


_MISSING = object()


class _Section:
    """One mapping being read: knows its path, rejects unknown keys, reads keys by reader."""

    def __init__(self, data: Any, path: str, keys: set[str] | frozenset[str]) -> None:
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(path, f"must be a mapping, got {_show(data)}")
        for k in data:
            if k not in keys:
                k = k if isinstance(k, str) and k.isprintable() else repr(k)
                raise ConfigError(f"{path}.{k}" if path else k,
                                  f"unknown key (expected one of: {', '.join(sorted(keys))})")
        self.data, self.path = data, path

    def raw(self, key: str) -> tuple[Any, str]:
        """(value, path-or-flag) with a ``_Flag`` unwrapped; value None when absent."""
        v = self.data.get(key)
        return (v.value, v.flag) if isinstance(v, _Flag) else (v, f"{self.path}.{key}" if self.path else key)

    def get(self, key: str, read: Reader, default: Any = _MISSING) -> Any:
        """Read ``key`` (absent or null -> ``default``; no default -> "required")."""
        v, path = self.raw(key)
        if v is None and default is _MISSING:
            raise ConfigError(path, "required")
        return default if v is None else read(v, path)

    def read_all(self, readers: Mapping[str, Reader]) -> dict[str, Any]:
        """Every key of ``readers`` that is set (not null), read."""
        return {k: self.get(k, r) for k, r in readers.items() if self.raw(k)[0] is not None}


def _parse_tls(data: Any, base_dir: str | None) -> TlsConfig:
    if data is None:
        raise ConfigError("tls", "required (cert, key and ca)")
    s = _Section(data, "tls", {"cert", "key", "ca", "min_version", "reload_interval_s"})
    files = [s.get(k, _file(base_dir)) for k in ("cert", "key", "ca")]
    return TlsConfig(*files, **s.read_all({"min_version": _choice("1.3", "1.2"),
                                           "reload_interval_s": _duration(zero_is_off=True)}))


def _then(read: Reader, conv: Callable[[Any], Any]) -> Reader:
    return lambda v, path: conv(read(v, path))


def expand_commands(entries: tuple[str, ...]) -> frozenset[str]:
    """``allow_commands`` entries (names, ``@category``) -> the allowed command names (+ HELLO)."""
    if not entries:
        return frozenset(COMMAND_NAMES)
    names = {n for e in entries for n in (CATEGORIES[e] if e in CATEGORIES else (e,))}
    return frozenset(names | {"HELLO"})  # the session cannot start without it


def _versions(vs: tuple[str, ...]) -> frozenset:
    return frozenset(parse_version(v) for v in vs) if vs else frozenset(KNOWN_VERSIONS)


_SIZE, _SIZE_POS = _via(parse_size), _via(parse_size, allow_zero=False)
# YAML key under `policy:` -> (reader giving the runtime value, field path in SessionPolicy)
_POLICY_KEYS: dict[str, tuple[Reader, str]] = {
    "mode": (_choice("enforce", "monitor"), "mode"),
    "accepted_versions": (_then(_list(_version), _versions), "accepted_versions"),
    "allow_commands": (_then(_list(_command), expand_commands), "allowed_commands"),
    "max_request_bytes": (_SIZE_POS, "max_request_bytes"),
    "max_graph_bytes": (_SIZE_POS, "max_graph_bytes"),
    "clear_new_buffers": (_bool, "clear_new_buffers"),
    "max_graph_nodes": (_count, "firewall.max_graph_nodes"),
    "max_graph_tensors": (_count, "firewall.max_graph_tensors"),
    "max_alloc_bytes": (_SIZE, "firewall.max_alloc_bytes"),
    "max_session_alloc_bytes": (_SIZE, "firewall.max_session_alloc_bytes"),
    "denied_ops": (_then(_list(_op), frozenset), "firewall.denied_ops"),
    "allow_unverified_ops": (_then(_list(_op_or_all), frozenset), "firewall.allow_unverified_ops"),
    "max_graph_cpu_ms": (_then(_count, lambda ms: ms / 1000), "firewall.max_graph_cpu_s"),
}
#: runtime field path -> the config key that sets it (``policy.checks`` sets disabled_checks)
POLICY_FIELDS: Mapping[str, str] = MappingProxyType(
    {f: k for k, (_, f) in _POLICY_KEYS.items()} | {"firewall.disabled_checks": "checks"})
# YAML key under `limits:` -> reader (the Limits field has the same name)
_LIMIT_KEYS: dict[str, Reader] = {
    "handshake_timeout_s": _duration(), "hello_timeout_s": _duration(), "idle_timeout_s": _duration(zero_is_off=True),
    "frame_timeout_s": _duration(zero_is_off=True), "max_session_s": _duration(zero_is_off=True), "max_sessions": _count,
    "upstream_busy": _choice("queue", "refuse"), "queue_timeout_s": _duration(),
    "drain_timeout_s": _duration(), "connect_timeout_s": _duration(),
}
LIMIT_KEYS: tuple[str, ...] = tuple(_LIMIT_KEYS)
#: limits a profile cannot set: they apply before the identity is known, or to the whole process
PROFILE_ONLY_TOP_LIMITS: Mapping[str, str] = MappingProxyType({
    "handshake_timeout_s": "applies before the identity (and so its profile) is known",
    "drain_timeout_s": "applies to the whole process",
})
_LOG_READERS: dict[str, Reader] = {"format": _choice("text", "json"),
                                   "level": _choice("debug", "info", "warning", "error")}


def _parse_policy(layers: list[tuple[Any, str]], base: SessionPolicy) -> SessionPolicy:
    """Lay policy mappings over ``base`` key by key (later layers win; ``checks`` check by check)."""
    top: dict[str, Any] = {}
    fw: dict[str, Any] = {}
    disabled = set(base.firewall.disabled_checks)
    for data, path in layers:
        s = _Section(data, path, set(_POLICY_KEYS) | {"checks"})
        for key, (read, target) in _POLICY_KEYS.items():
            v, where = s.raw(key)
            if v is not None:
                sub, _, name = target.rpartition(".")
                (fw if sub else top)[name] = read(v, where)
        c = _Section(s.data.get("checks"), s.raw("checks")[1], frozenset(CHECK_NAMES))
        for name, on in c.read_all(dict.fromkeys(CHECK_NAMES, _bool)).items():
            (disabled.discard if on else disabled.add)(name)
    return replace(base, **top, firewall=replace(base.firewall, **fw, disabled_checks=frozenset(disabled)))


def _parse_limits(data: Any, path: str, base: Limits, refused: Mapping[str, str] = MappingProxyType({})) -> Limits:
    s = _Section(data, path, set(_LIMIT_KEYS))
    for key, why in refused.items():
        if s.raw(key)[0] is not None:
            raise ConfigError(s.raw(key)[1], f"cannot be set in a profile: it {why}; set it in the top-level limits")
    return replace(base, **s.read_all(_LIMIT_KEYS))


def _acl_entry(kind: str, check: Reader) -> Reader:
    """An allow-list entry, also checked by the matcher's own rules (``identity.Acl``)."""
    def read(v: Any, path: str) -> str:
        from .identity import Acl  # lazy: pulls in cryptography

        v = check(v, path)
        try:
            Acl(**{kind: (v,)})
        except ValueError as e:
            raise ConfigError(path, str(e).split(": ", 1)[-1]) from None
        return v
    return read


# allow-list key -> (reader, identity.Acl field)
_ACL_KEYS: dict[str, tuple[Reader, str]] = {
    "cn": (_list(_str), "cns"), "dns": (_list(_acl_entry("dns", _str)), "dns"),
    "uri": (_list(_acl_entry("uris", _uri)), "uris"), "ip": (_list(_acl_entry("ips", _ip)), "ips"),
    "all": (_bool, "allow_any"),
}
_EMPTY_ACL = ("empty allow-list: give cn/dns/uri/ip entries (--allow-cn/-dns/-uri/-ip), "
              "or all: true (--allow-all) to admit any certificate signed by tls.ca")


def _parse_allow(data: Any, path: str, profiles: Mapping[str, Any], require: bool = True) -> AllowList:
    """``allow``: one mapping (an entry) or a list of entries; an entry may name a ``profile``.

    The first entry that matches a peer decides its profile. An empty allow-list is refused: like
    ghostunnel, admitting every certificate the CA signed must be asked for (``all: true``).
    """
    from .identity import Acl, AllowList  # lazy: pulls in cryptography

    if isinstance(data, list) and not data and require:
        raise ConfigError(path, _EMPTY_ACL)
    items = [(x, f"{path}[{i}]") for i, x in enumerate(data)] if isinstance(data, list) else [(data, path)]
    entries = []
    for item, where in items:
        s = _Section(item, where, set(_ACL_KEYS) | {"profile"})
        values = {attr: s.get(key, read) for key, (read, attr) in _ACL_KEYS.items() if s.raw(key)[0] is not None}
        named = any(values.get(k) for k in ("cns", "dns", "uris", "ips"))
        if values.get("allow_any") and named:
            raise ConfigError(where + ".all", "all: true admits any certificate; remove it or the entries")
        if not named and not values.get("allow_any") and (require or where != path):
            raise ConfigError(where, _EMPTY_ACL if where == path else
                              "empty entry: give cn/dns/uri/ip entries or all: true")
        profile = s.get("profile", _name, None)
        if profile is not None and profile not in profiles:
            known = ", ".join(sorted(profiles)) or "none"
            raise ConfigError(s.raw("profile")[1], f"unknown profile {profile!r} (defined in profiles: {known})")
        entries.append(Acl(**values, profile=profile))
    return AllowList(tuple(entries))


def _parse_profiles(data: Any, role: str, top_policy: Any, top_limits: Limits) -> dict[str, tuple[Any, Any]]:
    """``profiles``: name -> (policy mapping, limits mapping), checked; merged per listener later."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("profiles", f"must be a mapping of name -> {{policy, limits}}, got {_show(data)}")
    out = {}
    for name, body in data.items():
        path = f"profiles.{name}"
        _name(name, path)
        if name == DEFAULT_PROFILE:
            raise ConfigError(path, f"{DEFAULT_PROFILE!r} is reserved: it names the listener's own policy and limits")
        s = _Section(body, path, {"policy", "limits"})
        _parse_policy([(top_policy, "policy"), (s.data.get("policy"), path + ".policy")], default_policy(role))
        _parse_limits(s.data.get("limits"), path + ".limits", top_limits, PROFILE_ONLY_TOP_LIMITS)
        out[name] = (s.data.get("policy"), s.data.get("limits"))
    return out


def _parse_metrics(data: Any, role: str, base_dir: str | None) -> tuple[MetricsConfig, str]:
    from .webconfig import load_web_config

    s = _Section(data, "metrics", {"listen", "unsafe_public", "web_config"})
    unsafe = s.get("unsafe_public", _bool, False)
    web_path = s.get("web_config", _file(base_dir), None)
    web = load_web_config(web_path) if web_path else None
    raw, path = s.raw("listen")
    listen = DEFAULT_METRICS[role] if "listen" not in s.data else None if raw in (None, "") else _listen(raw, path)
    # Beyond loopback the endpoint must authenticate (TLS plus a verified client certificate
    # or a password), or the operator says unsafe_public: /refusals names peers and identities.
    if listen is not None and not listen.is_loopback() and not unsafe and not (web and web.tls and web.authenticates):
        why = ("its web config must enable TLS and require RequireAndVerifyClientCert or basic_auth_users"
               if web else "set metrics.web_config (TLS + client certificates or basic auth)")
        how = "pass --metrics-unsafe-public" if path.startswith("--") else "set metrics.unsafe_public: true"
        raise ConfigError(path, f"{listen} is not loopback; {why}, or {how} to serve metrics beyond this host "
                                "unprotected")
    return MetricsConfig(listen, unsafe, web_path), path


def _clash(a: Address, b: Address) -> bool:
    """Would binding both fail? Same port and host, or a wildcard of the same family (V6ONLY)."""
    fam = [(":" in h) if _is_ip(h) else None for h in (a.host, b.host)]
    wild = a.host in ("0.0.0.0", "::") or b.host in ("0.0.0.0", "::")
    return a.port == b.port != 0 and (a.host.lower() == b.host.lower()
                                      or (fam[0] is not None and fam[0] == fam[1] and wild))


def _not_loopback(path: str, addr: Address, key: str, word: str) -> ConfigError:
    how = f"pass --{key.replace('_', '-')}" if path.startswith("--") else f"set {key}: true on this {word}"
    return ConfigError(path, f"{addr} is not loopback; {how} to allow it")


_ITEM_KEYS = {"serve": {"name", "listen", "upstream", "allow", "policy", "unsafe_upstream"},
              "connect": {"name", "listen", "server", "server_name", "policy", "unsafe_listen"}}


@dataclass(frozen=True)
class _Top:
    """What the items inherit from the top level: raw policy / allow / profiles, parsed limits."""
    policy: Any
    allow: Any
    profiles: Mapping[str, tuple[Any, Any]]
    limits: Limits


def _item_profiles(top: _Top, allow: AllowList, default: Profile) -> Mapping[str, Profile]:
    """The profiles ``allow`` names, each merged over the item's own ``default``."""
    out = {}
    for name in dict.fromkeys(e.profile for e in allow.entries if e.profile is not None):
        policy_data, limits_data = top.profiles[name]
        path = f"profiles.{name}"
        out[name] = Profile(name, _parse_policy([(policy_data, path + ".policy")], default.policy),
                            _parse_limits(limits_data, path + ".limits", default.limits, PROFILE_ONLY_TOP_LIMITS))
    return MappingProxyType(out)


def _parse_items(role: str, items: Any, top: _Top) -> tuple[tuple, list]:
    """The listeners (serve) or tunnels (connect), and [(listen address, path)] for clash checks."""
    key, word = ("listeners", "listener") if role == "serve" else ("tunnels", "tunnel")
    if items is not None and not isinstance(items, list):
        raise ConfigError(key, f"must be a list of {key}, got {_show(items)}")
    if not items:
        raise ConfigError(key, f"at least one {word} is required")
    out: list = []
    names: dict[str, str] = {}
    listens: list[tuple[Address, str]] = []
    for i, item in enumerate(items):
        s = _Section(item, f"{key}[{i}]", _ITEM_KEYS[role])
        name, listen = s.get("name", _name, f"{word}{i}"), s.get("listen", _listen)
        if name in names:
            raise ConfigError(s.raw("name")[1], f"duplicate name {name!r} (also {names[name]})")
        for other, where in listens:
            if _clash(listen, other):
                raise ConfigError(s.raw("listen")[1], f"{listen} already used by {where}")
        names[name] = s.path
        listens.append((listen, s.path))
        policy = _parse_policy([(top.policy, "policy"), (s.data.get("policy"), s.path + ".policy")],
                               default_policy(role))
        if policy.firewall.allow_unverified_ops:
            log.warning("%s (%s): graph ops forwarded WITHOUT a verified rule (allow_unverified_ops): %s; "
                        "each use is counted in rpcguard_unverified_op_nodes_total", s.path, name,
                        ", ".join(sorted(policy.firewall.allow_unverified_ops)))
        default = Profile(DEFAULT_PROFILE, policy, top.limits)
        if role == "serve":
            upstream, unsafe = s.get("upstream", _connect), s.get("unsafe_upstream", _bool, False)
            if not upstream.is_loopback() and not unsafe:
                raise _not_loopback(s.raw("upstream")[1], upstream, "unsafe_upstream", "listener")
            own = s.data.get("allow") is not None  # else the top-level allow-list applies
            allow = _parse_allow(s.data["allow"] if own else top.allow, s.path + ".allow" if own else "allow",
                                 top.profiles)
            if any(e.allow_any for e in allow.entries):
                log.warning("%s (%s): allow.all, any certificate signed by tls.ca is admitted", s.path, name)
            out.append(ListenerConfig(name, listen, upstream, allow, default, _item_profiles(top, allow, default),
                                      unsafe))
        else:
            server, unsafe = s.get("server", _connect), s.get("unsafe_listen", _bool, False)
            if not listen.is_loopback() and not unsafe:
                raise _not_loopback(s.raw("listen")[1], listen, "unsafe_listen", "tunnel")
            server_name = s.get("server_name", _server_name, server.host)
            out.append(TunnelConfig(name, listen, server, server_name, default, unsafe))
    return tuple(out), listens


_TOP_KEYS = {"log", "metrics", "tls", "policy", "limits"}
_ROLE_TOP_KEYS = {"serve": {"allow", "listeners", "profiles"}, "connect": {"tunnels"}}


def parse_config(data: object, role: str | None = None, *, source: str = "<config>",
                 base_dir: str | None = None) -> Config:
    """Validate plain data (as from ``yaml.safe_load``) into a ``Config``; raises ``ConfigError``.

    ``role`` None infers it from ``listeners`` (serve) or ``tunnels`` (connect). Relative TLS file
    paths are resolved against ``base_dir`` (the config file's directory; default: the cwd).
    """
    if not isinstance(data, dict):
        raise ConfigError(source, "top level must be a mapping, got "
                                  + ("an empty file" if data is None else _show(data)))
    if role is None:
        if "listeners" in data and "tunnels" in data:
            raise ConfigError("tunnels", "cannot be combined with listeners (one role per config)")
        if "listeners" not in data and "tunnels" not in data:
            raise ConfigError(source, "no listeners (serve) or tunnels (connect) defined")
        role = "serve" if "listeners" in data else "connect"
    if role not in ROLES:
        raise ConfigError("role", f"must be serve or connect, got {_show(role)}")
    other = "connect" if role == "serve" else "serve"
    for k in data:
        if k in _ROLE_TOP_KEYS[other]:
            raise ConfigError(str(k), f"only valid for rpcguard {other} (this is a {role} config)")
    _Section(data, "", _TOP_KEYS | _ROLE_TOP_KEYS[role])
    tls = _parse_tls(data.get("tls"), base_dir)
    metrics, metrics_path = _parse_metrics(data.get("metrics"), role, base_dir)
    _parse_policy([(data.get("policy"), "policy")], default_policy(role))  # report top-level errors even if overridden
    limits = _parse_limits(data.get("limits"), "limits", Limits())
    profiles = _parse_profiles(data.get("profiles"), role, data.get("policy"), limits) if role == "serve" else {}
    if role == "serve" and data.get("allow") is not None:
        _parse_allow(data.get("allow"), "allow", profiles, require=False)  # (required where used)
    top = _Top(data.get("policy"), data.get("allow"), profiles, limits)
    items, listens = _parse_items(role, data.get("listeners" if role == "serve" else "tunnels"), top)
    for addr, where in listens:
        if metrics.listen is not None and _clash(metrics.listen, addr):
            raise ConfigError(metrics_path, f"{metrics.listen} already used by {where}")
    log = LogConfig(**_Section(data.get("log"), "log", set(_LOG_READERS)).read_all(_LOG_READERS))
    return Config(role, tls, metrics, log, limits,  # type: ignore[arg-type]
                  items if role == "serve" else (), items if role == "connect" else (), tuple(profiles))


# ---------------------------------------------------------------- files and flags


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                dup = key in seen
                seen.add(key)
            except TypeError:  # unhashable key: the base class reports it
                continue
            if dup:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        return super().construct_mapping(node, deep)


def _read_yaml(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(path, f"cannot read config file: {e.strerror}") from None
    try:
        return yaml.load(text.decode("utf-8-sig"), Loader=_Loader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError as e:
        raise ConfigError(path, f"not UTF-8 text (byte {e.start})") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        why = " ".join(", ".join(str(x) for x in (e.context, e.problem) if x).split())
        raise ConfigError(f"{path}:{mark.line + 1}" if mark else path, f"invalid YAML: {why}") from None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: e.g. an int of > 4300 digits
        raise ConfigError(path, "invalid YAML: " + " ".join(str(e).split())[:200]) from None


def load_config(path: str, role: str | None = None) -> Config:
    """Read and validate a YAML config file; relative TLS paths are relative to its directory."""
    return parse_config(_read_yaml(path), role, source=path, base_dir=os.path.dirname(os.path.abspath(path)))


def check_config(path: str) -> Config:
    """``rpcguard check-config``: the same as ``load_config(path)``."""
    return load_config(path)


# flag -> (section, key) for flags that apply to the whole config
_GLOBAL_FLAGS = {
    "cert": ("tls", "cert"), "key": ("tls", "key"), "ca": ("tls", "ca"),
    "tls_min_version": ("tls", "min_version"), "tls_reload_interval_s": ("tls", "reload_interval_s"),
    "metrics": ("metrics", "listen"), "metrics_unsafe_public": ("metrics", "unsafe_public"),
    "web_config": ("metrics", "web_config"),
    "log_format": ("log", "format"), "log_level": ("log", "level"), "mode": ("policy", "mode"),
    "allow_unverified_op": ("policy", "allow_unverified_ops"),
}
# flags that configure the single listener / tunnel (keys of that item; allow_* go to its `allow`)
_ITEM_FLAGS = {
    "serve": ("listen", "upstream", "name", "unsafe_upstream", "allow_cn", "allow_dns", "allow_uri", "allow_ip",
              "allow_all"),
    "connect": ("listen", "server", "server_name", "name", "unsafe_listen"),
}


def _copy(d: Any) -> Any:
    return {} if d is None else dict(d) if isinstance(d, dict) else d


def build_config(role: str, *, file: str | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Config for ``rpcguard serve|connect``: the optional ``file`` with CLI ``overrides`` on top.

    Override values of None, False or an empty list mean "flag not given". TLS/metrics/log flags
    and ``mode`` apply to everything; listener flags (``listen``, ``upstream``, ``server``,
    ``allow_cn``...; ``allow_*`` replace that kind only) need at most one listener/tunnel in the
    file. Errors about a flag's value name the flag (``--upstream: ...``); relative paths given by
    flags are relative to the cwd.
    """
    if role not in ROLES:
        raise ConfigError("role", f"must be serve or connect, got {_show(role)}")
    data, source = (_read_yaml(file), file) if file is not None else ({}, "<flags>")
    if not isinstance(data, dict):
        return parse_config(data, role, source=source)  # raises the top-level error
    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    given = {k: v for k, v in (overrides or {}).items() if v is not None and v is not False and v not in ([], ())}
    other = "connect" if role == "serve" else "serve"
    for k in given:
        if k not in _GLOBAL_FLAGS and k not in _ITEM_FLAGS[role]:
            raise ConfigError(flag(k), f"only valid for rpcguard {other}" if k in _ITEM_FLAGS[other] else "unknown option")
    data = {**data, **{sec: _copy(data.get(sec)) for sec in ("tls", "metrics", "log", "policy")}}
    for k, (sec, key) in _GLOBAL_FLAGS.items():
        if k in given and isinstance(data[sec], dict):
            data[sec][key] = _Flag(given[k], flag(k))
    for k in ("cert", "key", "ca"):
        if isinstance(data["tls"], dict) and data["tls"].get(k) is None:
            raise ConfigError(flag(k), f"required (or tls.{k} in the config file)")
    items_key, word = ("listeners", "listener") if role == "serve" else ("tunnels", "tunnel")
    items = data.get(items_key)
    if "mode" in given and isinstance(data["policy"], dict):  # beat items' (and profiles') own mode
        mode = data["policy"]["mode"]
        if isinstance(items, list):
            items = data[items_key] = [{**it, "policy": {**it["policy"], "mode": mode}}
                                       if isinstance(it, dict) and isinstance(it.get("policy"), dict)
                                       and "mode" in it["policy"] else it for it in items]
        if isinstance(data.get("profiles"), dict):
            data["profiles"] = {k: {**p, "policy": {**p["policy"], "mode": mode}}
                                if isinstance(p, dict) and isinstance(p.get("policy"), dict)
                                and "mode" in p["policy"] else p for k, p in data["profiles"].items()}
    item_flags = [k for k in _ITEM_FLAGS[role] if k in given]
    if item_flags and (items is None or items == []):
        for k in ("listen", "upstream" if role == "serve" else "server"):
            if k not in given:
                raise ConfigError(flag(k), f"required (no {word} in a config file)")
        items = [{}]
    if item_flags and isinstance(items, list) and len(items) > 1:
        raise ConfigError(flag(item_flags[0]), f"the config file defines {len(items)} {items_key}; "
                                               f"this flag can only configure a single {word}")
    if item_flags and isinstance(items, list) and isinstance(items[0], dict):
        item = dict(items[0])
        if any(k.startswith("allow_") for k in item_flags):  # the item's ACL, else the top-level one
            item["allow"] = _copy(data.get("allow") if item.get("allow") is None else item["allow"])
        for k in item_flags:
            if k.startswith("allow_") and isinstance(item["allow"], list):
                raise ConfigError(flag(k), "the config file's allow-list is a list of entries (profiles); "
                                           "put this identity in the file instead")
            if k.startswith("allow_"):
                if isinstance(item["allow"], dict):
                    v = given[k]
                    item["allow"][k[6:]] = _Flag(v if k == "allow_all" else [v] if isinstance(v, str) else list(v),
                                                 flag(k))
            else:
                item[k] = _Flag(given[k], flag(k))
        data[items_key] = [item]
    return parse_config(data, role, source=source, base_dir=os.path.dirname(os.path.abspath(file)) if file else None)


def _acl_text(allow: AllowList) -> str:
    def entry(e: Any) -> str:
        parts = [f"{tag}:{v}" for tag, vals in (("CN", e.cns), ("DNS", e.dns), ("URI", e.uris), ("IP", e.ips))
                 for v in vals]
        text = ",".join(parts) if parts else "any-cert-from-ca" if e.allow_any else "nobody"
        return f"{text}=>{e.profile}" if e.profile else text
    return ",".join(entry(e) for e in allow.entries) or "nobody"


def config_summary(cfg: Config) -> list[str]:
    """One human line per listener / tunnel, for ``rpcguard check-config``."""
    def extra(p: SessionPolicy, unsafe: str | None) -> str:
        off = [n for n in CHECK_NAMES if n in p.firewall.disabled_checks]
        return ((f" checks_off={','.join(off)}" if off else "")
                + (f" unverified_ops={','.join(sorted(p.firewall.allow_unverified_ops))}"
                   if p.firewall.allow_unverified_ops else "")
                + (f" {unsafe}" if unsafe else ""))

    def profiles(x: ListenerConfig) -> str:
        return "".join(f" profile {p.name}: mode={p.policy.mode} commands={len(p.policy.allowed_commands)}"
                       f" max_sessions={p.limits.max_sessions}"
                       + (f" max_session_alloc_bytes={p.policy.firewall.max_session_alloc_bytes}"
                          if p.policy.firewall.max_session_alloc_bytes else "") + ";"
                       for p in x.profiles.values()).rstrip(";")
    return ([f"serve {x.name} {x.listen} -> {x.upstream} mode={x.policy.mode} acl={_acl_text(x.allow)}"
             + extra(x.policy, "unsafe_upstream" if x.unsafe_upstream else None)
             + (f" |{profiles(x)}" if x.profiles else "") for x in cfg.listeners]
            + [f"connect {x.name} {x.listen} -> {x.server} server_name={x.server_name} mode={x.policy.mode}"
               + extra(x.policy, "unsafe_listen" if x.unsafe_listen else None) for x in cfg.tunnels])
