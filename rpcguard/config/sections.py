"""``policy``, ``limits``, ``allow`` and ``profiles``: YAML straight into the runtime settings types.

How this works: each YAML key is one row of ``_POLICY_KEYS`` / ``_LIMIT_KEYS`` naming the field of
``SessionPolicy`` (``firewall.<f>`` for its ``FirewallPolicy``) or ``Limits`` it sets, with a reader
that checks and converts the value (``allow_commands`` -> the expanded command set,
``max_graph_cpu_ms`` -> seconds). Layers (top level, listener, profile) are laid over a base with
``dataclasses.replace``, so every default stays in ``protocol/settings.py`` and is written once.
``allow`` is one entry (a mapping) or a list of entries; an entry may name a profile, and the
first entry that matches a peer decides it (``identity.AllowList``). Profiles are checked here once
and merged over each listener's own settings by ``config.py``.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from rpcguard.protocol.settings import CHECK_NAMES, DEFAULT_PROFILE, Limits, SessionPolicy, default_policy
from rpcguard.protocol.versions import COMMAND_NAMES, KNOWN_VERSIONS, parse_version

from rpcguard.config.read import (
    CATEGORIES, Reader, _bool, _choice, _command, _count, _count_or_off, _duration, _ip, _list, _name, _op,
    _op_or_all, _Section, _show, _str, _then, _uri, _version, _via, parse_size,
)
from rpcguard.errors import ConfigError

if TYPE_CHECKING:
    from rpcguard.pki.identity import AllowList

__all__ = ["POLICY_FIELDS", "LIMIT_KEYS", "PROFILE_ONLY_TOP_LIMITS", "expand_commands"]


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
    "validate_requests": (_choice("auto", "always"), "validate_requests"),
    "max_graph_nodes": (_count, "firewall.max_graph_nodes"),
    "max_graph_tensors": (_count, "firewall.max_graph_tensors"),
    "max_alloc_bytes": (_SIZE, "firewall.max_alloc_bytes"),
    "max_session_alloc_bytes": (_SIZE, "firewall.max_session_alloc_bytes"),
    "denied_ops": (_then(_list(_op), frozenset), "firewall.denied_ops"),
    "allow_unverified_ops": (_then(_list(_op_or_all), frozenset), "firewall.allow_unverified_ops"),
    "max_graph_cpu_ms": (_then(_count, lambda ms: ms / 1000), "firewall.max_graph_cpu_s"),
    "max_graph_compute_s": (_duration(zero_is_off=True), "firewall.max_graph_compute_s"),
    "node_gflops": (_duration(), "firewall.node_gflops"),  # (a positive number, read as a duration is)
    "max_work_bytes": (_SIZE_POS, "firewall.max_work_bytes"),
    "server_threads": (_count, "firewall.server_threads"),
}
#: runtime field path -> the config key that sets it (``policy.checks`` sets disabled_checks)
POLICY_FIELDS: Mapping[str, str] = MappingProxyType(
    {f: k for k, (_, f) in _POLICY_KEYS.items()} | {"firewall.disabled_checks": "checks"})
# YAML key under `limits:` -> reader (the Limits field has the same name)
_LIMIT_KEYS: dict[str, Reader] = {
    "handshake_timeout_s": _duration(), "hello_timeout_s": _duration(), "idle_timeout_s": _duration(zero_is_off=True),
    "frame_timeout_s": _duration(zero_is_off=True), "max_session_s": _duration(zero_is_off=True), "max_sessions": _count,
    "upstream_busy": _choice("queue", "refuse"), "queue_timeout_s": _duration(),
    "max_graph_s": _duration(zero_is_off=True),
    "drain_timeout_s": _duration(), "connect_timeout_s": _duration(),
    "min_data_rate_bps": _count_or_off, "idle_while_waiting_s": _duration(zero_is_off=True),
    "max_sessions_per_identity": _count_or_off, "max_sessions_per_source": _count_or_off,
    "max_pending_per_identity": _count_or_off, "max_pending_per_source": _count_or_off,
    "max_handshakes_per_source": _count_or_off,
}
LIMIT_KEYS: tuple[str, ...] = tuple(_LIMIT_KEYS)
#: limits a profile cannot set: they apply before the identity is known, or to the whole process
PROFILE_ONLY_TOP_LIMITS: Mapping[str, str] = MappingProxyType({
    "handshake_timeout_s": "applies before the identity (and so its profile) is known",
    "drain_timeout_s": "applies to the whole process",
    "max_sessions_per_source": "counts every identity that connects from one address",
    "max_pending_per_source": "counts every identity that connects from one address",
    "max_handshakes_per_source": "applies before the identity (and so its profile) is known",
})


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
        from rpcguard.pki.identity import Acl  # lazy: pulls in cryptography

        v = check(v, path)
        try:
            entry: dict[str, Any] = {kind: (v,)}
            Acl(**entry)
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
    from rpcguard.pki.identity import Acl, AllowList  # lazy: pulls in cryptography

    if isinstance(data, list) and not data and require:
        raise ConfigError(path, _EMPTY_ACL)
    items = [(x, f"{path}[{i}]") for i, x in enumerate(data)] if isinstance(data, list) else [(data, path)]
    entries = []
    for item, where in items:
        s = _Section(item, where, set(_ACL_KEYS) | {"profile"})
        values: dict[str, Any] = {attr: s.get(key, read) for key, (read, attr) in _ACL_KEYS.items()
                                  if s.raw(key)[0] is not None}
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
