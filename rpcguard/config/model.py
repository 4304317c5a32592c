"""YAML configuration -> frozen dataclasses, the runtime settings types included.

How this works: ``load_config`` reads the file with a safe YAML loader that also refuses duplicate
keys; ``parse_config`` walks the plain data section by section. Every reader knows the dotted key
path of what it reads (``listeners[1].upstream``) and raises ``ConfigError(path, message)`` on the
first problem, so an error is always one line naming the key. Unknown keys are errors. Safe defaults
are enforced here, ghostunnel style (loopback upstream / tunnel listen / metrics, TLS 1.3); the
``unsafe_*`` keys are the explicit opt-outs. ``build_config`` lays CLI flags over the file: a value
that came from a flag is wrapped in ``FromFlag`` so its errors name the flag (``--upstream``).

``policy`` and ``limits`` are parsed straight into the runtime types of ``protocol/settings.py``
(``SessionPolicy`` with its ``FirewallPolicy``, ``Limits``, ``Profile``): each YAML key is one row
of ``_POLICY_KEYS`` / ``_LIMIT_KEYS`` naming the field it sets, and layers (top level, listener,
profile) are applied with ``dataclasses.replace`` over the defaults written in settings.py, so no
default is repeated here. ``tls``, ``metrics`` and ``log`` are read by key tables the same way (config/process.py).
``profiles`` (serve) are named policy/limits overlays; an allow-list entry
that names one puts the identities it admits under it (``identity.AllowList``: first match wins).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Mapping

import yaml

from rpcguard.protocol.settings import CHECK_NAMES, DEFAULT_PROFILE, Limits, Profile, SessionPolicy, default_policy
from rpcguard.protocol.side import SIDES, Side
from rpcguard.protocol.versions import COMMAND_NAMES

from rpcguard.config.read import (
    CATEGORIES, GIB, KIB, MIB, Address, boolean, connect_address, FromFlag, is_ip, listen_address, name_text,
    Section, server_name_text, show, parse_address, parse_size, unknown_key,
)
from rpcguard.config.sections import (
    LIMIT_KEYS, POLICY_FIELDS, PROFILE_ONLY_TOP_LIMITS, _parse_allow, _parse_limits, _parse_policy,
    _parse_profiles, expand_commands,
)
from rpcguard.config.process import (
    DEFAULT_METRICS, LogConfig, MetricsConfig, TlsConfig, parse_log, parse_metrics, parse_tls,
)
from rpcguard.errors import ConfigError
from rpcguard.config.upstream import UpstreamSettings, parse_upstream

if TYPE_CHECKING:
    from rpcguard.pki.identity import AllowList

__all__ = [
    "COMMAND_NAMES", "CATEGORIES", "CHECK_NAMES", "ROLES", "DEFAULT_METRICS", "KIB", "MIB", "GIB",
    "Address", "TlsConfig", "MetricsConfig", "LogConfig", "ListenerConfig", "TunnelConfig", "Config",
    "POLICY_FIELDS", "LIMIT_KEYS", "PROFILE_ONLY_TOP_LIMITS",
    "parse_address", "parse_size", "expand_commands",
    "load_config", "parse_config", "config_summary",
]

LOGGER = "rpcguard.config"  # the logger callers log ``Config.warnings`` to

ROLES = ("serve", "connect")


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
    managed: UpstreamSettings | None = None  # upstream: {exec: ...}: serve runs the server (rpcguard/upstream/)

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
    # what the file does that deserves a warning (allow.all, unused profiles...): data, logged or
    # printed by the caller (serve/connect at start and reload, check-config); not part of equality
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def side(self) -> Side:
        """What this role's end of a link does (protocol/side.py)."""
        return SIDES[self.role]

    @property
    def items(self) -> tuple[ListenerConfig, ...] | tuple[TunnelConfig, ...]:
        """The role's endpoints: the listeners (serve) or the tunnels (connect)."""
        return self.listeners if self.side.takes_slot else self.tunnels


def _clash(a: Address, b: Address) -> bool:
    """Would binding both fail? Same port and host, or a wildcard of the same family (V6ONLY)."""
    fam = [(":" in h) if is_ip(h) else None for h in (a.host, b.host)]
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


def _parse_items(role: str, items: Any, top: _Top, warnings: list[str]) -> tuple[tuple, list]:
    """The listeners (serve) or tunnels (connect), and [(listen address, path)] for clash checks."""
    key, word = SIDES[role].items, SIDES[role].item
    if items is not None and not isinstance(items, list):
        raise ConfigError(key, f"must be a list of {key}, got {show(items)}")
    if not items:
        raise ConfigError(key, f"at least one {word} is required")
    out: list = []
    names: dict[str, str] = {}
    listens: list[tuple[Address, str]] = []
    for i, item in enumerate(items):
        s = Section(item, f"{key}[{i}]", _ITEM_KEYS[role])
        name, listen = s.get("name", name_text, f"{word}{i}"), s.get("listen", listen_address)
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
            warnings.append(f"{s.path} ({name}): graph ops forwarded WITHOUT a verified rule (allow_unverified_ops): "
                            f"{', '.join(sorted(policy.firewall.allow_unverified_ops))}; each use is counted in "
                            "rpcguard_unverified_op_nodes_total")
        default = Profile(DEFAULT_PROFILE, policy, top.limits)
        if SIDES[role].takes_slot:  # a ggml-rpc-server: given, or run by serve (upstream.exec)
            raw = s.data.get("upstream")
            managed = parse_upstream(raw, s.path + ".upstream") if isinstance(raw, (dict, FromFlag)) and (
                isinstance(raw, dict) or isinstance(raw.value, list)) else None
            upstream = Address("127.0.0.1", 0) if managed else s.get("upstream", connect_address)
            unsafe = s.get("unsafe_upstream", boolean, False)
            if not upstream.is_loopback() and not unsafe:
                raise _not_loopback(s.raw("upstream")[1], upstream, "unsafe_upstream", "listener")
            own = s.data.get("allow") is not None  # else the top-level allow-list applies
            allow = _parse_allow(s.data["allow"] if own else top.allow, s.path + ".allow" if own else "allow",
                                 top.profiles)
            if any(e.allow_any for e in allow.entries):
                warnings.append(f"{s.path} ({name}): allow.all, any certificate signed by tls.ca is admitted")
            out.append(ListenerConfig(name, listen, upstream, allow, default, _item_profiles(top, allow, default),
                                      unsafe, managed))
        else:
            server, unsafe = s.get("server", connect_address), s.get("unsafe_listen", boolean, False)
            if not listen.is_loopback() and not unsafe:
                raise _not_loopback(s.raw("listen")[1], listen, "unsafe_listen", "tunnel")
            server_name = s.get("server_name", server_name_text, server.host)
            out.append(TunnelConfig(name, listen, server, server_name, default, unsafe))
    return tuple(out), listens


def _warn_profiles(listeners: tuple, profiles: Mapping[str, Any], warnings: list[str]) -> None:
    """A profile no entry names, and entries behind an ``all: true`` one."""
    used = {e.profile for li in listeners for e in li.allow.entries}
    for name in profiles:
        if name not in used:
            warnings.append(f"profiles.{name}: no allow-list entry names it (unused)")
    for li in listeners:
        catch_all = next((i for i, e in enumerate(li.allow.entries) if e.allow_any), None)
        for e in li.allow.entries[catch_all + 1:] if catch_all is not None else ():
            if e.profile is not None:
                warnings.append(f"{li.name}: the entry naming profile {e.profile} never decides a profile: an earlier "
                                "entry (all: true) matches every certificate first")


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
                                  + ("an empty file" if data is None else show(data)))
    if role is None:
        if "listeners" in data and "tunnels" in data:
            raise ConfigError("tunnels", "cannot be combined with listeners (one role per config)")
        if "listeners" not in data and "tunnels" not in data:
            every = _TOP_KEYS.union(*_ROLE_TOP_KEYS.values())
            stray = [k for k in data if k not in every]
            if stray:
                raise unknown_key(stray[0], "", every)
            raise ConfigError(source, "no listeners (serve) or tunnels (connect) defined")
        role = next(s.role for s in SIDES.values() if s.items in data)
    if role not in ROLES:
        raise ConfigError("role", f"must be serve or connect, got {show(role)}")
    side = SIDES[role]
    other = side.other
    own, others = side.items, SIDES[other].items
    if others in data and own not in data:  # the file of the other role, given to this command
        raise ConfigError(source, f"this is a {other} config (it defines {others}); {side.read_by} a {role} config "
                                  f"(with {own})")
    for k in data:
        if k in _ROLE_TOP_KEYS[other]:
            raise ConfigError(str(k), f"only valid for rpcguard {other} (this is a {role} config)")
    Section(data, "", _TOP_KEYS | _ROLE_TOP_KEYS[role])
    tls = parse_tls(data.get("tls"), base_dir)
    metrics, metrics_path = parse_metrics(data.get("metrics"), role, base_dir)
    _parse_policy([(data.get("policy"), "policy")], default_policy(role))  # report top-level errors even if overridden
    limits = _parse_limits(data.get("limits"), "limits", Limits())
    # identities (allow-lists, profiles) exist where clients present certificates: serve
    profiles = _parse_profiles(data.get("profiles"), role, data.get("policy"), limits) if side.client_tls else {}
    if side.client_tls and data.get("allow") is not None:
        _parse_allow(data.get("allow"), "allow", profiles, require=False)  # (required where used)
    top = _Top(data.get("policy"), data.get("allow"), profiles, limits)
    warnings: list[str] = []
    items, listens = _parse_items(role, data.get(own), top, warnings)
    for addr, where in listens:
        if metrics.listen is not None and _clash(metrics.listen, addr):
            raise ConfigError(metrics_path, f"{metrics.listen} already used by {where}")
    _warn_profiles(items if side.client_tls else (), profiles, warnings)
    log = parse_log(data.get("log"))
    return Config(role, tls, metrics, log, limits,  # type: ignore[arg-type]
                  items if role == "serve" else (), items if role == "connect" else (), tuple(profiles),
                  tuple(warnings))


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


def read_yaml(path: str) -> Any:
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
    return parse_config(read_yaml(path), role, source=path, base_dir=os.path.dirname(os.path.abspath(path)))


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

    def up(x: ListenerConfig) -> str:
        m = x.managed
        return str(x.upstream) if m is None else f"exec {m.exec[0]} (isolation={m.isolation} sandbox={m.sandbox.mode})"

    return ([f"serve {x.name} {x.listen} -> {up(x)} mode={x.policy.mode} acl={_acl_text(x.allow)}"
             + extra(x.policy, "unsafe_upstream" if x.unsafe_upstream else None)
             + (f" |{profiles(x)}" if x.profiles else "") for x in cfg.listeners]
            + [f"connect {x.name} {x.listen} -> {x.server} server_name={x.server_name} mode={x.policy.mode}"
               f" validate_requests={x.policy.validate_requests}"
               + extra(x.policy, "unsafe_listen" if x.unsafe_listen else None) for x in cfg.tunnels])
