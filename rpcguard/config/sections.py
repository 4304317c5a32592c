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

from rpcguard.protocol.backend import SETTINGS as BACKENDS
from rpcguard.protocol.settings import (
    CHECK_NAMES, DEFAULT_PROFILE, MODES, UPSTREAM_BUSY, VALIDATE_REQUESTS, Limits, SessionPolicy, default_policy,
)
from rpcguard.protocol.versions import COMMAND_NAMES, KNOWN_VERSIONS, parse_version

from rpcguard.config.read import (
    CATEGORIES, Reader, boolean, choice, command_name, count, count_or_off, duration, ip_text, list_of, name_text, op_name,
    op_name_or_all, Section, show, text, then, uri_text, version_text, via, parse_size,
)
from rpcguard.errors import ConfigError

if TYPE_CHECKING:
    from rpcguard.pki.identity import AllowList

__all__ = ["POLICY_FIELDS", "POLICY_READERS", "LIMIT_KEYS", "LIMIT_READERS", "PROFILE_ONLY_TOP_LIMITS", "expand_commands"]


def expand_commands(entries: tuple[str, ...]) -> frozenset[str]:
    """``allow_commands`` entries (names, ``@category``) -> the allowed command names (+ HELLO)."""
    if not entries:
        return frozenset(COMMAND_NAMES)
    names = {n for e in entries for n in (CATEGORIES[e] if e in CATEGORIES else (e,))}
    return frozenset(names | {"HELLO"})  # the session cannot start without it


def _versions(vs: tuple[str, ...]) -> frozenset:
    return frozenset(parse_version(v) for v in vs) if vs else frozenset(KNOWN_VERSIONS)


_SIZE, _SIZE_POS = via(parse_size), via(parse_size, allow_zero=False)
# YAML key under `policy:` -> (reader giving the runtime value, field path in SessionPolicy)
_POLICY_KEYS: dict[str, tuple[Reader, str]] = {
    "mode": (choice(*MODES), "mode"),
    "accepted_versions": (then(list_of(version_text), _versions), "accepted_versions"),
    "allow_commands": (then(list_of(command_name), expand_commands), "allowed_commands"),
    "max_request_bytes": (_SIZE_POS, "max_request_bytes"),
    "max_graph_bytes": (_SIZE_POS, "max_graph_bytes"),
    "clear_new_buffers": (boolean, "clear_new_buffers"),
    "validate_requests": (choice(*VALIDATE_REQUESTS), "validate_requests"),
    "max_graph_nodes": (count, "firewall.max_graph_nodes"),
    "max_graph_tensors": (count, "firewall.max_graph_tensors"),
    "max_alloc_bytes": (_SIZE, "firewall.max_alloc_bytes"),
    "max_session_alloc_bytes": (_SIZE, "firewall.max_session_alloc_bytes"),
    "denied_ops": (then(list_of(op_name), frozenset), "firewall.denied_ops"),
    "allow_unverified_ops": (then(list_of(op_name_or_all), frozenset), "firewall.allow_unverified_ops"),
    "max_graph_cpu_ms": (then(count, lambda ms: ms / 1000), "firewall.max_graph_cpu_s"),
    "max_graph_compute_s": (duration(zero_is_off=True), "firewall.max_graph_compute_s"),
    "node_gflops": (duration(), "firewall.node_gflops"),  # (a positive number, read as a duration is)
    "max_work_bytes": (_SIZE_POS, "firewall.max_work_bytes"),
    "server_threads": (count, "firewall.server_threads"),
    "backend": (choice(*BACKENDS), "firewall.backend"),  # protocol/backend.py
    "max_cuda_scratch_bytes": (_SIZE, "firewall.max_cuda_scratch_bytes"),  # protocol/cudascratch.py; 0: off
    "device_memory_share_bytes": (_SIZE, "firewall.device_memory_share_bytes"),  # protocol/memshare.py; 0: off
}
#: YAML key under `policy:` -> its reader (the table flags read, config/flags.py)
POLICY_READERS: Mapping[str, Reader] = MappingProxyType({k: r for k, (r, _) in _POLICY_KEYS.items()})
#: runtime field path -> the config key that sets it (``policy.checks`` sets disabled_checks)
POLICY_FIELDS: Mapping[str, str] = MappingProxyType(
    {f: k for k, (_, f) in _POLICY_KEYS.items()} | {"firewall.disabled_checks": "checks"})
# YAML key under `limits:` -> reader (the Limits field has the same name)
_LIMIT_KEYS: dict[str, Reader] = {
    "handshake_timeout_s": duration(), "hello_timeout_s": duration(), "idle_timeout_s": duration(zero_is_off=True),
    "frame_timeout_s": duration(zero_is_off=True), "max_session_s": duration(zero_is_off=True), "max_sessions": count,
    "upstream_busy": choice(*UPSTREAM_BUSY), "queue_timeout_s": duration(),
    "max_graph_s": duration(zero_is_off=True),
    "drain_timeout_s": duration(), "connect_timeout_s": duration(),
    "min_data_rate_bps": count_or_off, "idle_while_waiting_s": duration(zero_is_off=True),
    "hold_while_waiting_s": duration(zero_is_off=True), "max_upstream_sessions": count_or_off,
    "max_sessions_per_identity": count_or_off, "max_sessions_per_source": count_or_off,
    "max_pending_per_identity": count_or_off, "max_pending_per_source": count_or_off,
    "max_handshakes_per_source": count_or_off,
}
LIMIT_KEYS: tuple[str, ...] = tuple(_LIMIT_KEYS)
LIMIT_READERS: Mapping[str, Reader] = MappingProxyType(_LIMIT_KEYS)
#: limits a profile cannot set: they apply before the identity is known, or to the whole process
PROFILE_ONLY_TOP_LIMITS: Mapping[str, str] = MappingProxyType({
    "handshake_timeout_s": "applies before the identity (and so its profile) is known",
    "drain_timeout_s": "applies to the whole process",
    "max_sessions_per_source": "counts every identity that connects from one address",
    "max_pending_per_source": "counts every identity that connects from one address",
    "max_handshakes_per_source": "applies before the identity (and so its profile) is known",
    "max_upstream_sessions": "counts every identity's sessions on the listener's server processes",
})


def _parse_policy(layers: list[tuple[Any, str]], base: SessionPolicy) -> SessionPolicy:
    """Lay policy mappings over ``base`` key by key (later layers win; ``checks`` check by check)."""
    top: dict[str, Any] = {}
    fw: dict[str, Any] = {}
    disabled = set(base.firewall.disabled_checks)
    for data, path in layers:
        s = Section(data, path, set(_POLICY_KEYS) | {"checks"})
        for key, (read, target) in _POLICY_KEYS.items():
            v, where = s.raw(key)
            if v is not None:
                sub, _, name = target.rpartition(".")
                (fw if sub else top)[name] = read(v, where)
        c = Section(s.data.get("checks"), s.raw("checks")[1], frozenset(CHECK_NAMES))
        for name, on in c.read_all(dict.fromkeys(CHECK_NAMES, boolean)).items():
            (disabled.discard if on else disabled.add)(name)
    return replace(base, **top, firewall=replace(base.firewall, **fw, disabled_checks=frozenset(disabled)))


def _parse_limits(data: Any, path: str, base: Limits, refused: Mapping[str, str] = MappingProxyType({})) -> Limits:
    s = Section(data, path, set(_LIMIT_KEYS))
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
    "cn": (list_of(text), "cns"), "dns": (list_of(_acl_entry("dns", text)), "dns"),
    "uri": (list_of(_acl_entry("uris", uri_text)), "uris"), "ip": (list_of(_acl_entry("ips", ip_text)), "ips"),
    "all": (boolean, "allow_any"),
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
        s = Section(item, where, set(_ACL_KEYS) | {"profile"})
        values: dict[str, Any] = {attr: s.get(key, read) for key, (read, attr) in _ACL_KEYS.items()
                                  if s.raw(key)[0] is not None}
        named = any(values.get(k) for k in ("cns", "dns", "uris", "ips"))
        if values.get("allow_any") and named:
            raise ConfigError(where + ".all", "all: true admits any certificate; remove it or the entries")
        if not named and not values.get("allow_any") and (require or where != path):
            raise ConfigError(where, _EMPTY_ACL if where == path else
                              "empty entry: give cn/dns/uri/ip entries or all: true")
        profile = s.get("profile", name_text, None)
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
        raise ConfigError("profiles", f"must be a mapping of name -> {{policy, limits}}, got {show(data)}")
    out = {}
    for name, body in data.items():
        path = f"profiles.{name}"
        name_text(name, path)
        if name == DEFAULT_PROFILE:
            raise ConfigError(path, f"{DEFAULT_PROFILE!r} is reserved: it names the listener's own policy and limits")
        s = Section(body, path, {"policy", "limits"})
        _parse_policy([(top_policy, "policy"), (s.data.get("policy"), path + ".policy")], default_policy(role))
        _parse_limits(s.data.get("limits"), path + ".limits", top_limits, PROFILE_ONLY_TOP_LIMITS)
        out[name] = (s.data.get("policy"), s.data.get("limits"))
    return out
