"""YAML configuration -> frozen dataclasses.

How this works: ``load_config`` reads the file with a safe YAML loader that also refuses duplicate
keys; ``parse_config`` walks the plain data section by section. Every reader knows the dotted key
path of what it reads (``listeners[1].upstream``) and raises ``ConfigError(path, message)`` on the
first problem, so an error is always one line naming the key. Unknown keys are errors. Safe defaults
are enforced here, ghostunnel style (loopback upstream / tunnel listen / metrics, TLS 1.3); the
``unsafe_*`` keys are the explicit opt-outs. ``build_config`` lays CLI flags over the file: a value
that came from a flag is wrapped in ``_Flag`` so its errors name the flag (``--upstream``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping

import yaml

from rpcguard.protocol.versions import CATEGORIES as _CATEGORIES
from rpcguard.protocol.ggml import OP_TABLES
from rpcguard.protocol.versions import COMMAND_NAMES

from .errors import ConfigError

__all__ = [
    "COMMAND_NAMES", "CATEGORIES", "CHECK_NAMES", "ROLES", "DEFAULT_METRICS", "KIB", "MIB", "GIB",
    "Address", "TlsConfig", "AclConfig", "PolicyConfig", "LimitsConfig", "MetricsConfig",
    "LogConfig", "ListenerConfig", "TunnelConfig", "Config",
    "parse_address", "parse_size",
    "load_config", "parse_config", "build_config", "check_config", "config_summary",
]

log = logging.getLogger("rpcguard.config")

ROLES = ("serve", "connect")
_OP_NAMES = frozenset(name for table in OP_TABLES.values() for name in table.ids)
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

#: ggml-rpc command names (index = wire id) and the ``allow_commands`` categories (``"@name"``),
#: both from the one command table in ``protocol.versions``.
CATEGORIES: Mapping[str, tuple[str, ...]] = MappingProxyType({"@" + k: v for k, v in _CATEGORIES.items()})
#: Firewall check switches (``policy.checks``); all on by default.
CHECK_NAMES: tuple[str, ...] = (
    "tensor", "buffer_bounds", "graph_structure", "graph_ops", "op_params", "recompute_after_free",
    "device_index",
)

# One request frame's length cap. SET_TENSOR carries a tensor (or a slice of one) whole in one
# frame and the largest weights of current models (token embeddings) reach a few GiB. The relay
# streams bodies, so this bounds how long a bogus 64-bit length can pin a session, not memory.
DEFAULT_MAX_REQUEST_BYTES = 4 * GIB
# GRAPH_COMPUTE is validated whole in memory before it is forwarded, so it must be small:
# 64 MiB holds ~220k serialized tensors (296 bytes each); real decode graphs are a few thousand.
DEFAULT_MAX_GRAPH_BYTES = 64 * MIB


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
class AclConfig:
    """Client certificate allow-list (any match admits). Empty is refused at load unless ``all``
    (``allow: {all: true}`` / ``--allow-all``) admits any certificate signed by the CA."""
    cn: tuple[str, ...] = ()
    dns: tuple[str, ...] = ()
    uri: tuple[str, ...] = ()
    ip: tuple[str, ...] = ()  # normalized networks ("10.0.0.0/24", "::1/128")
    all: bool = False


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    mode: Literal["enforce", "monitor"] = "enforce"
    accepted_versions: tuple[str, ...] = ()  # "X.Y.Z"; empty = every version this build knows
    allow_commands: tuple[str, ...] = ()  # names / "@categories"; empty = the default set
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_graph_bytes: int = DEFAULT_MAX_GRAPH_BYTES
    max_graph_nodes: int = 262144
    max_graph_tensors: int = 1048576
    max_alloc_bytes: int = 0  # 0 = no cap beyond the server's GET_MAX_SIZE
    max_session_alloc_bytes: int = 0  # one session, all devices; 0 = per device, its memory total
    clear_new_buffers: bool = True  # inject BUFFER_CLEAR after each ALLOC_BUFFER (connect: False)
    denied_ops: tuple[str, ...] = ()  # ggml op names refused on top of the custom ops (opt-in)
    # ggml ops forwarded without a verified rule (default deny; "*" = every op): logged, counted
    allow_unverified_ops: tuple[str, ...] = ()
    max_graph_cpu_ms: int = 500  # CPU one GRAPH_COMPUTE may take to validate (graph_too_costly)
    disabled_checks: tuple[str, ...] = ()  # subset of CHECK_NAMES, in CHECK_NAMES order

    def check_enabled(self, name: str) -> bool:
        """True unless ``policy.checks.<name>`` was set to false."""
        return name not in self.disabled_checks


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    handshake_timeout_s: float = 10.0
    hello_timeout_s: float = 10.0
    # 0 = off: llama-server keeps its model connection open and quiet between requests for hours,
    # and llama.cpp aborts when it is closed. A frame that stalls half-way is cut by frame_timeout_s.
    idle_timeout_s: float = 0.0
    frame_timeout_s: float = 60.0  # a request frame started but not finished (slowloris)
    max_session_s: float = 0.0  # 0 = off
    max_sessions: int = 64
    upstream_busy: Literal["queue", "refuse"] = "queue"
    queue_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0


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
    """``serve``: accept mTLS on ``listen``, relay to the loopback ggml-rpc-server ``upstream``."""
    name: str
    listen: Address
    upstream: Address
    allow: AclConfig = AclConfig()
    policy: PolicyConfig = PolicyConfig()
    unsafe_upstream: bool = False


@dataclass(frozen=True, slots=True)
class TunnelConfig:
    """``connect``: plain TCP on loopback ``listen`` for llama.cpp, mTLS to ``server``."""
    name: str
    listen: Address
    server: Address
    server_name: str  # expected in the server certificate; default: server.host
    policy: PolicyConfig = PolicyConfig()
    unsafe_listen: bool = False


@dataclass(frozen=True, slots=True)
class Config:
    role: Literal["serve", "connect"]
    tls: TlsConfig
    metrics: MetricsConfig = MetricsConfig()
    log: LogConfig = LogConfig()
    limits: LimitsConfig = LimitsConfig()
    listeners: tuple[ListenerConfig, ...] = ()
    tunnels: tuple[TunnelConfig, ...] = ()


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


_POLICY_READERS: dict[str, Reader] = {
    "mode": _choice("enforce", "monitor"), "accepted_versions": _list(_version),
    "allow_commands": _list(_command), "max_request_bytes": _via(parse_size, allow_zero=False),
    "max_graph_bytes": _via(parse_size, allow_zero=False), "max_graph_nodes": _count,
    "max_graph_tensors": _count, "max_alloc_bytes": _via(parse_size), "clear_new_buffers": _bool,
    "denied_ops": _list(_op), "allow_unverified_ops": _list(_op_or_all),
    "max_graph_cpu_ms": _count, "max_session_alloc_bytes": _via(parse_size),
}
_LIMIT_READERS: dict[str, Reader] = {
    "handshake_timeout_s": _duration(), "hello_timeout_s": _duration(), "idle_timeout_s": _duration(zero_is_off=True),
    "frame_timeout_s": _duration(zero_is_off=True), "max_session_s": _duration(zero_is_off=True), "max_sessions": _count,
    "upstream_busy": _choice("queue", "refuse"), "queue_timeout_s": _duration(),
    "drain_timeout_s": _duration(), "connect_timeout_s": _duration(),
}
_LOG_READERS: dict[str, Reader] = {"format": _choice("text", "json"),
                                   "level": _choice("debug", "info", "warning", "error")}


# Role defaults that differ from PolicyConfig's: serve zeroes new buffers for the node's tenants;
# connect doing it too would clear every buffer twice (docs/firewall.md, "Tenant isolation").
_ROLE_POLICY_DEFAULTS: dict[str, dict[str, Any]] = {"serve": {}, "connect": {"clear_new_buffers": False}}


def _parse_policy(layers: list[tuple[Any, str]], role: str = "serve") -> PolicyConfig:
    """Merge policy mappings key by key (later layers win; ``checks`` merges check by check)."""
    values: dict[str, Any] = dict(_ROLE_POLICY_DEFAULTS.get(role, {}))
    checks: dict[str, bool] = {}
    for data, path in layers:
        s = _Section(data, path, set(_POLICY_READERS) | {"checks"})
        values.update(s.read_all(_POLICY_READERS))
        c = _Section(s.data.get("checks"), s.raw("checks")[1], frozenset(CHECK_NAMES))
        checks.update(c.read_all(dict.fromkeys(CHECK_NAMES, _bool)))
    return PolicyConfig(**values, disabled_checks=tuple(n for n in CHECK_NAMES if checks.get(n) is False))


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


_ACL_READERS = {"cn": _list(_str), "dns": _list(_acl_entry("dns", _str)),
                "uri": _list(_acl_entry("uris", _uri)), "ip": _list(_acl_entry("ips", _ip)), "all": _bool}


def _parse_acl(data: Any, path: str) -> AclConfig:
    acl = AclConfig(**_Section(data, path, set(_ACL_READERS)).read_all(_ACL_READERS))
    entries = acl.cn or acl.dns or acl.uri or acl.ip
    if acl.all and entries:
        raise ConfigError(path + ".all", "all: true admits any certificate; remove it or the entries")
    return acl


def _require_acl(acl: AclConfig, path: str) -> None:
    """Like ghostunnel: admitting every certificate the CA signed must be asked for."""
    if not (acl.all or acl.cn or acl.dns or acl.uri or acl.ip):
        raise ConfigError(path, "empty allow-list: give cn/dns/uri/ip entries (--allow-cn/-dns/-uri/-ip), "
                                "or all: true (--allow-all) to admit any certificate signed by tls.ca")


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


def _parse_items(role: str, items: Any, top_policy: Any, top_allow: Any) -> tuple[tuple, list]:
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
        policy = _parse_policy([(top_policy, "policy"), (s.data.get("policy"), s.path + ".policy")], role)
        if policy.allow_unverified_ops:
            log.warning("%s (%s): graph ops forwarded WITHOUT a verified rule (allow_unverified_ops): %s; "
                        "each use is counted in rpcguard_unverified_op_nodes_total", s.path, name,
                        ", ".join(policy.allow_unverified_ops))
        if role == "serve":
            upstream, unsafe = s.get("upstream", _connect), s.get("unsafe_upstream", _bool, False)
            if not upstream.is_loopback() and not unsafe:
                raise _not_loopback(s.raw("upstream")[1], upstream, "unsafe_upstream", "listener")
            own = s.data.get("allow") is not None  # else the top-level allow-list applies
            acl = _parse_acl(s.data["allow"] if own else top_allow, s.path + ".allow" if own else "allow")
            _require_acl(acl, s.path + ".allow" if own else "allow")
            if acl.all:
                log.warning("%s (%s): allow.all, any certificate signed by tls.ca is admitted", s.path, name)
            out.append(ListenerConfig(name, listen, upstream, acl, policy, unsafe))
        else:
            server, unsafe = s.get("server", _connect), s.get("unsafe_listen", _bool, False)
            if not listen.is_loopback() and not unsafe:
                raise _not_loopback(s.raw("listen")[1], listen, "unsafe_listen", "tunnel")
            server_name = s.get("server_name", _server_name, server.host)
            out.append(TunnelConfig(name, listen, server, server_name, policy, unsafe))
    return tuple(out), listens


_TOP_KEYS = {"log", "metrics", "tls", "policy", "limits"}
_ROLE_TOP_KEYS = {"serve": {"allow", "listeners"}, "connect": {"tunnels"}}


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
    _parse_policy([(data.get("policy"), "policy")])  # report top-level errors even if overridden
    if role == "serve":
        _parse_acl(data.get("allow"), "allow")
    items, listens = _parse_items(role, data.get("listeners" if role == "serve" else "tunnels"),
                                  data.get("policy"), data.get("allow"))
    for addr, where in listens:
        if metrics.listen is not None and _clash(metrics.listen, addr):
            raise ConfigError(metrics_path, f"{metrics.listen} already used by {where}")
    log = LogConfig(**_Section(data.get("log"), "log", set(_LOG_READERS)).read_all(_LOG_READERS))
    limits = LimitsConfig(**_Section(data.get("limits"), "limits", set(_LIMIT_READERS)).read_all(_LIMIT_READERS))
    return Config(role, tls, metrics, log, limits,  # type: ignore[arg-type]
                  items if role == "serve" else (), items if role == "connect" else ())


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
    if "mode" in given and isinstance(items, list) and isinstance(data["policy"], dict):  # beat items' own mode
        items = data[items_key] = [{**it, "policy": {**it["policy"], "mode": data["policy"]["mode"]}}
                                   if isinstance(it, dict) and isinstance(it.get("policy"), dict)
                                   and "mode" in it["policy"] else it for it in items]
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
            if k.startswith("allow_"):
                if isinstance(item["allow"], dict):
                    v = given[k]
                    item["allow"][k[6:]] = _Flag(v if k == "allow_all" else [v] if isinstance(v, str) else list(v),
                                                 flag(k))
            else:
                item[k] = _Flag(given[k], flag(k))
        data[items_key] = [item]
    return parse_config(data, role, source=source, base_dir=os.path.dirname(os.path.abspath(file)) if file else None)


def _acl_text(acl: AclConfig) -> str:
    parts = [f"{tag}:{v}" for tag, vals in (("CN", acl.cn), ("DNS", acl.dns), ("URI", acl.uri), ("IP", acl.ip))
             for v in vals]
    return ",".join(parts) if parts else "any-cert-from-ca" if acl.all else "nobody"


def config_summary(cfg: Config) -> list[str]:
    """One human line per listener / tunnel, for ``rpcguard check-config``."""
    def extra(p: PolicyConfig, unsafe: str | None) -> str:
        return ((f" checks_off={','.join(p.disabled_checks)}" if p.disabled_checks else "")
                + (f" unverified_ops={','.join(p.allow_unverified_ops)}" if p.allow_unverified_ops else "")
                + (f" {unsafe}" if unsafe else ""))
    return ([f"serve {x.name} {x.listen} -> {x.upstream} mode={x.policy.mode} acl={_acl_text(x.allow)}"
             + extra(x.policy, "unsafe_upstream" if x.unsafe_upstream else None) for x in cfg.listeners]
            + [f"connect {x.name} {x.listen} -> {x.server} server_name={x.server_name} mode={x.policy.mode}"
               + extra(x.policy, "unsafe_listen" if x.unsafe_listen else None) for x in cfg.tunnels])
