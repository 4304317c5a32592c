"""What a reload changes: the difference between the running ``Config`` and a new one.

How this works: ``diff_configs`` compares two validated configs and names every difference by its
config key path (``limits.hello_timeout_s``, ``listeners[gpu0].policy.max_graph_nodes``,
``listeners[gpu0].profiles.monitor.limits.max_sessions``), the way the YAML spells it: runtime
fields are mapped back to their key through ``config.POLICY_FIELDS`` (``firewall.max_graph_cpu_s``
is ``policy.max_graph_cpu_ms``). Listeners (tunnels) are matched by name: a new name is added, a
missing one removed, and one whose address, upstream or server changed is *replaced* (a new route,
the old one finishing its sessions). ``RESTART_KEYS`` are the keys a running process cannot take
(its metrics socket and log stream are set up once): they are reported as ``kept`` and the caller
keeps their old value. Pure functions, no I/O: proxy/reload.py applies the result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from rpcguard.config.model import POLICY_FIELDS, Config, ListenerConfig, TunnelConfig
from rpcguard.protocol.side import SIDES

__all__ = ["RESTART_KEYS", "ConfigDiff", "diff_configs", "keep_restart_keys", "policy_changes"]

#: key path -> why it cannot change live (the old value stays until a restart)
RESTART_KEYS: Mapping[str, str] = {
    "metrics.listen": "the metrics endpoint is bound once at start",
    "metrics.unsafe_public": "it goes with metrics.listen",
    "log.format": "the log stream is set up once at start",
}
# Changing one of these rebuilds the listener (tunnel): a new route, the old one lets its sessions finish.
_ADDRESS_KEYS = {"serve": ("listen", "upstream", "unsafe_upstream", "managed"),
                 "connect": ("listen", "server", "server_name", "unsafe_listen")}


@dataclass(frozen=True)
class ConfigDiff:
    """Key paths that differ, in file order; listener (tunnel) names added, removed, replaced."""

    changed: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()  # RESTART_KEYS that differ: the old value stays
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.changed or self.kept or self.added or self.removed or self.replaced)

    def summary(self, word: str = "listener") -> str:
        """``changed a, b; added listener x; removed listener y; kept until restart: z`` (or ``no change``)."""
        parts = []
        if self.changed:
            parts.append("changed " + ", ".join(self.changed))
        parts += [f"{verb} {word} {name}" for verb, names in (("added", self.added), ("removed", self.removed),
                                                               ("replaced", self.replaced)) for name in names]
        if self.kept:
            parts.append("kept until restart: " + ", ".join(self.kept))
        return "; ".join(parts) or "no change"


def _flat(obj: Any, deep: bool, prefix: str = "") -> dict[str, Any]:
    """Dataclass fields by name; ``deep`` expands nested dataclasses to ``a.b`` paths."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if deep and dataclasses.is_dataclass(v) and not isinstance(v, type):
            out.update(_flat(v, deep, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = v
    return out


def _diff(old: Any, new: Any, deep: bool = False) -> list[str]:
    """Field paths that differ between two instances of one dataclass."""
    a, b = _flat(old, deep), _flat(new, deep)
    return [k for k in a if a[k] != b.get(k)]


def policy_changes(old: Any, new: Any) -> list[str]:
    """``SessionPolicy`` differences as ``policy.<config key>``."""
    return [f"policy.{POLICY_FIELDS.get(k, k)}" for k in _diff(old, new, deep=True)]


def _item(role: str, path: str, old: ListenerConfig | TunnelConfig, new: ListenerConfig | TunnelConfig,
          top_limits: set[str]) -> list[str]:
    """Live changes of one listener (tunnel) kept by name."""
    out = [f"{path}.{k}" for k in policy_changes(old.default.policy, new.default.policy)]
    if SIDES[role].client_tls:  # allow-lists and profiles: who may connect
        assert isinstance(old, ListenerConfig) and isinstance(new, ListenerConfig)
        if old.allow != new.allow:
            out.append(f"{path}.allow")
        default_changed = set(policy_changes(old.default.policy, new.default.policy))
        for name in dict.fromkeys([*old.profiles, *new.profiles]):
            p, q = old.profiles.get(name), new.profiles.get(name)
            where = f"{path}.profiles.{name}"
            if p is None or q is None:
                out.append(where)
                continue
            # what the listener's own settings already explain is not repeated per profile
            out += [f"{where}.{k}" for k in policy_changes(p.policy, q.policy) if k not in default_changed]
            out += [f"{where}.limits.{k}" for k in _diff(p.limits, q.limits) if k not in top_limits]
    return out


def diff_configs(old: Config, new: Config) -> ConfigDiff:
    """What applying ``new`` over the running ``old`` changes (same role: a reload keeps the role)."""
    changed: list[str] = []
    kept: list[str] = []
    for section in ("tls", "metrics", "log"):
        for k in _diff(getattr(old, section), getattr(new, section)):
            path = f"{section}.{k}"
            (kept if path in RESTART_KEYS else changed).append(path)
    limits = _diff(old.limits, new.limits)
    changed += [f"limits.{k}" for k in limits]
    key, role = old.side.items, old.role
    olds = {x.name: x for x in getattr(old, key)}
    news = {x.name: x for x in getattr(new, key)}
    replaced = []
    for name, item in news.items():
        before = olds.get(name)
        if before is None:
            continue
        path = f"{key}[{name}]"
        moved = [k for k in _ADDRESS_KEYS[role] if getattr(before, k) != getattr(item, k)]
        if moved:
            replaced.append(name)
            changed += [f"{path}.{k}" for k in moved]
        else:
            changed += _item(role, path, before, item, set(limits))
    for name in dict.fromkeys([*old.profiles, *new.profiles]):
        if (name in old.profiles) != (name in new.profiles):
            changed.append(f"profiles.{name}")
    return ConfigDiff(tuple(changed), tuple(kept), tuple(n for n in news if n not in olds),
                      tuple(n for n in olds if n not in news), tuple(replaced))


def keep_restart_keys(old: Config, new: Config) -> Config:
    """``new`` with the RESTART_KEYS of ``old`` (what the running process keeps)."""
    metrics = dataclasses.replace(new.metrics, listen=old.metrics.listen, unsafe_public=old.metrics.unsafe_public)
    return dataclasses.replace(new, metrics=metrics, log=dataclasses.replace(new.log, format=old.log.format))
