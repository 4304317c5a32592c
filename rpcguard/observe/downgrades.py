"""Security downgrades a configuration switches on, said loudly: log, metric, handshake.

How this works: ``switched_off(policy)`` names what one policy turns off (``monitor_mode``: the
firewall forwards what it would refuse; ``check_<name>``: a firewall check disabled with
``policy.checks.<name>: false``; ``unverified_ops``: graph ops forwarded without a verified rule).
A listener (serve) or tunnel (connect) *enforces* when none of its profiles turns off anything but
named unverified ops (those are an opt-in per op, counted per use): ``enforces``. That one answer
is what a serve listener says in the TLS handshake (pki/tls.py ``ALPN_ENFORCING``), so a connect leaves
its request checks only to a node that runs them all.

``report(cfg, metrics, web)`` runs at start and after every reload (server.Runtime): one WARNING
per listener that does not enforce, per serve listener whose ``--upstream`` server (one process
someone else runs) is shared by more than one allowed identity (``shared_upstream``: no process
boundary between tenants; ``serve -- ggml-rpc-server`` gives each session its own), per serve
listener on a GPU node whose server is not one sandboxed process per session (``gpu_uncontained``:
the CUDA kernels of the content-indexed ops check no index, docs/gpu.md), and for a
metrics endpoint served beyond loopback without TLS and authentication, and the gauges ``rpcguard_listener_enforcing{role,listener}``,
``rpcguard_listener_switched_off{role,listener,what}`` and ``rpcguard_metrics_unprotected{role}``
(alerts in deploy/prometheus/rpcguard-rules.yml, runbook entries in docs/runbook.md).
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping, Protocol, Sequence

from rpcguard.observe.webconfig import WebConfig
from rpcguard.protocol.oprules import cuda, needs_containment
from rpcguard.protocol.settings import CHECK_NAMES, Profile, SessionPolicy
from rpcguard.protocol.side import Side

__all__ = ["SWITCHED_OFF", "NOT_ENFORCING", "CUDA_INDEX_OPS", "switched_off", "item_switched_off", "enforces",
           "report", "shared_upstream", "gpu_node", "gpu_uncontained", "Item", "ManagedUpstream", "Settings", "Gauges"]


# -- what report reads of a configuration and writes into the metrics: the seams to config/ (above
# this package: config.model's Config, ListenerConfig and TunnelConfig, upstream.pool's
# UpstreamSettings) and to observe.metrics (which imports SWITCHED_OFF and NOT_ENFORCING from here)
class Item(Protocol):
    """A listener (serve) or a tunnel (connect). A serve listener also has ``allow`` (an AllowList),
    ``profiles`` and ``managed`` (``ManagedUpstream`` or None), read where present."""
    @property
    def name(self) -> str: ...
    @property
    def default(self) -> Profile: ...


class _Sandbox(Protocol):
    @property
    def mode(self) -> str: ...


class ManagedUpstream(Protocol):
    """The server serve runs for a listener (upstream.pool.UpstreamSettings)."""
    @property
    def gpu(self) -> bool: ...
    @property
    def isolation(self) -> str: ...
    @property
    def sandbox(self) -> _Sandbox: ...


class _Address(Protocol):
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    def is_loopback(self) -> bool: ...


class _MetricsSettings(Protocol):
    @property
    def listen(self) -> _Address | None: ...


class Settings(Protocol):
    """What report reads of a configuration (config.model.Config)."""
    @property
    def role(self) -> str: ...
    @property
    def side(self) -> Side: ...
    @property
    def items(self) -> Sequence[Item]: ...
    @property
    def metrics(self) -> _MetricsSettings: ...


class Gauges(Protocol):
    """What report sets in the metrics (observe.metrics.Metrics)."""
    enforcement: dict[tuple[str, str], frozenset[str]]
    metrics_unprotected: bool


log = logging.getLogger("rpcguard.downgrades")

# Every value of rpcguard_listener_switched_off{what} (exported at 0 too), with what it means.
_MEANING: Mapping[str, str] = {
    "monitor_mode": "firewall in monitor mode (violations are logged and forwarded, not refused)",
    **{f"check_{name}": f"firewall check {name} switched off (policy.checks.{name}: false)"
       for name in CHECK_NAMES},
    "unverified_ops": "graph ops forwarded without a verified rule (policy.allow_unverified_ops)",
    "shared_upstream": "one --upstream server shared by more than one allowed identity: nothing but the "
                       "firewall stands between tenants (its memory, its -c cache, a crash); for a shared node "
                       "run `serve -- ggml-rpc-server` (a sandboxed process per session, docs/containment.md)",
    "gpu_uncontained": "a GPU node whose server is not one sandboxed process per session: on CUDA, GET_ROWS, "
                       "SET_ROWS, ADD_ID, MUL_MAT_ID and SSM_SCAN address device memory with row indices no kernel "
                       "checks (read and write anywhere in the server process every tenant's tensors live in), "
                       "and one sticky CUDA fault ends every tenant's session; `serve -- ggml-rpc-server` with "
                       "upstream.isolation: session (the default) confines both to the tenant (docs/gpu.md)",
}
SWITCHED_OFF: tuple[str, ...] = tuple(_MEANING)
# What makes a listener not enforcing (the unverified ops are allowed by name and counted per use;
# a shared upstream is a deployment's choice the firewall still enforces in front of).
NOT_ENFORCING: frozenset[str] = frozenset(SWITCHED_OFF) - {"unverified_ops", "shared_upstream", "gpu_uncontained"}
#: the ops a GPU node forwards only to a contained server (oprules.needs_containment on CUDA)
CUDA_INDEX_OPS: tuple[str, ...] = tuple(op for op in cuda.CONTENT_INDEXED if needs_containment(op, "cuda"))


def switched_off(policy: SessionPolicy) -> tuple[str, ...]:
    """What ``policy`` turns off, in ``SWITCHED_OFF`` order."""
    on = {"monitor_mode": policy.mode == "monitor",
          "unverified_ops": bool(policy.firewall.allow_unverified_ops)}
    on.update({f"check_{name}": name in policy.firewall.disabled_checks for name in CHECK_NAMES})
    return tuple(what for what in SWITCHED_OFF if on.get(what))


def _profiles(default: Profile, profiles: Mapping[str, Profile]) -> Iterable[Profile]:
    return (default, *profiles.values())


def item_switched_off(default: Profile, profiles: Mapping[str, Profile] | None = None) -> dict[str, tuple[str, ...]]:
    """Profile name -> what it turns off, for the profiles that turn something off."""
    out = {}
    for profile in _profiles(default, profiles or {}):
        off = switched_off(profile.policy)
        if off:
            out[profile.name] = off
    return out


def enforces(default: Profile, profiles: Mapping[str, Profile] | None = None) -> bool:
    """True when every session of the listener runs every firewall check in enforce mode."""
    return not any(NOT_ENFORCING.intersection(switched_off(p.policy)) for p in _profiles(default, profiles or {}))


def shared_upstream(item: Item) -> bool:
    """A serve listener relaying to a server someone else runs (``--upstream``, not ``upstream.exec``)
    that admits more than one identity: allow-all, a wildcard or network, or several names."""
    allow = getattr(item, "allow", None)
    if getattr(item, "managed", True) is not None or allow is None:
        return False
    names = 0
    for e in allow.entries:
        if e.allow_any or any(u.endswith("/*") for u in e.uris) or any(d.startswith("*") for d in e.dns):
            return True
        if any("/" in ip and not ip.endswith(("/32", "/128")) for ip in e.ips):
            return True
        names += len(e.cns) + len(e.dns) + len(e.uris) + len(e.ips)
    return names > 1


def gpu_node(item: Item) -> bool:
    """A serve listener whose server uses a GPU: a profile says ``policy.backend: cuda``, or serve
    runs the server (``upstream.exec``) and it may open a GPU (UpstreamSettings.gpu, the config's
    upstream.gpu.uses_gpu: its -d names one, or it names none on a host with NVIDIA GPUs) with no
    profile holding it to ``cpu``. An
    ``--upstream`` server counts only by the setting (serve cannot see its devices before a
    session asks; under ``auto`` a session that detects CUDA gets the CUDA layer anyway)."""
    if not hasattr(item, "managed"):
        return False
    backends = {p.policy.firewall.backend for p in _profiles(item.default, _item_profiles(item))}
    if "cuda" in backends:
        return True
    managed: ManagedUpstream | None = getattr(item, "managed", None)
    return managed is not None and backends != {"cpu"} and managed.gpu


def gpu_uncontained(item: Item) -> str:
    """Why a GPU listener's server is not one sandboxed process per session ('' when it is, or
    when the listener is not on a GPU node): what UpstreamPool.contained needs, read from the config."""
    if not gpu_node(item):
        return ""
    managed: ManagedUpstream | None = getattr(item, "managed", None)
    if managed is None:
        return "--upstream: one server someone else runs"
    if managed.isolation != "session":
        return f"upstream.isolation: {managed.isolation}"
    if managed.sandbox.mode == "off":
        return "upstream.sandbox.mode: off"
    return ""


def _acknowledged(item: Item) -> list[str]:
    """CUDA_INDEX_OPS that a profile of ``item`` forwards uncontained (allow_unverified_ops)."""
    out = []
    for op in CUDA_INDEX_OPS:
        if any(op in p.policy.firewall.allow_unverified_ops or "*" in p.policy.firewall.allow_unverified_ops
               for p in _profiles(item.default, _item_profiles(item))):
            out.append(op)
    return out


def _item_profiles(item: Item) -> Mapping[str, Profile]:
    return getattr(item, "profiles", {})


def report(cfg: Settings, metrics: Gauges, web: WebConfig | None = None) -> list[str]:
    """Log a WARNING per downgrade of ``cfg`` and set the gauges; returns the warning lines."""
    lines: list[str] = []
    enforcement: dict[tuple[str, str], frozenset[str]] = {}
    for item in cfg.items:
        profiles = _item_profiles(item)
        off = item_switched_off(item.default, profiles)
        enforcement[(cfg.role, item.name)] = frozenset(w for whats in off.values() for w in whats)
        if shared_upstream(item):
            enforcement[(cfg.role, item.name)] |= {"shared_upstream"}
            lines.append(f"{cfg.role} {cfg.side.item} {item.name}: SHARED UPSTREAM: {_MEANING['shared_upstream']}")
        why = gpu_uncontained(item)
        if why:
            enforcement[(cfg.role, item.name)] |= {"gpu_uncontained"}
            acked = _acknowledged(item)
            refused = [op for op in CUDA_INDEX_OPS if op not in acked]
            lines.append(f"{cfg.role} {cfg.side.item} {item.name}: GPU NODE NOT CONTAINED ({why}): "
                         f"{_MEANING['gpu_uncontained']}"
                         + (f"; FORWARDED UNCONTAINED (a profile's policy.allow_unverified_ops): {', '.join(acked)}, "
                            "each use counted in rpcguard_unverified_op_nodes_total" if acked else "")
                         + (f"; refused op_needs_containment on a CUDA device: {', '.join(refused)}"
                            + (" (every model uses GET_ROWS and SET_ROWS: its graphs are refused until they are "
                               "named there)" if "GET_ROWS" in refused or "SET_ROWS" in refused else "")
                            if refused else ""))
        elif gpu_node(item):
            log.info("%s %s %s: GPU node: one sandboxed server process per session (upstream.isolation: session); "
                     "%s forwarded to it only", cfg.role, cfg.side.item, item.name, ", ".join(CUDA_INDEX_OPS))
        breaking = {name: [w for w in whats if w in NOT_ENFORCING] for name, whats in off.items()}
        breaking = {name: whats for name, whats in breaking.items() if whats}
        if not breaking:
            continue
        where = cfg.side.item
        said = ("; it says so in the TLS handshake and connect runs its own request checks"
                if cfg.side.client_tls else "")
        lines.append(f"{cfg.role} {where} {item.name}: NOT ENFORCING: " + "; ".join(
            f"profile {name}: " + ", ".join(_MEANING[w] for w in whats) for name, whats in breaking.items()) + said)
    unprotected = _metrics_unprotected(cfg, web)
    if unprotected:
        lines.append(f"{cfg.role}: metrics endpoint {unprotected}")
    for line in lines:
        log.warning("%s", line)
    metrics.enforcement = enforcement
    metrics.metrics_unprotected = bool(unprotected)
    return lines


def _metrics_unprotected(cfg: Settings, web: WebConfig | None) -> str:
    """Why the metrics endpoint is open beyond this host ('' when it is not)."""
    listen = cfg.metrics.listen
    if listen is None or listen.is_loopback():
        return ""
    if web is not None and web.tls and web.authenticates:
        return ""
    return (f"{listen.host}:{listen.port} is served beyond loopback without TLS and client certificates or "
            "basic auth (metrics.unsafe_public): anyone who reaches it reads peers, identities and refusals")
