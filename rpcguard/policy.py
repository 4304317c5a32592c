"""Turn validated configuration into the objects the hot path consults.

How this works: ``config.py`` checks what the user wrote; this module resolves it into
``SessionPolicy`` (accepted versions, allowed commands, caps, firewall switches), ``Acl``
(who may connect) and ``Limits`` (timeouts), once per listener at start-up or reload, so
nothing on the data path looks at configuration again.
"""

from __future__ import annotations

from rpcguard.config import AclConfig, LimitsConfig, PolicyConfig
from rpcguard.identity import Acl
from rpcguard.protocol.firewall import FirewallPolicy
from rpcguard.protocol.session import SessionPolicy
from rpcguard.protocol.versions import CATEGORIES, COMMAND_NAMES, KNOWN_VERSIONS, parse_version
from rpcguard.route import Limits

__all__ = ["session_policy", "acl", "limits", "expand_commands"]


def expand_commands(entries: tuple[str, ...]) -> frozenset[str]:
    """Command names and ``@category`` entries -> the set of allowed command names."""
    if not entries:
        return frozenset(COMMAND_NAMES)
    names: set[str] = set()
    for entry in entries:
        if entry.startswith("@"):
            names.update(CATEGORIES[entry[1:]])
        else:
            names.add(entry)
    names.add("HELLO")  # the session cannot start without it
    return frozenset(names)


def session_policy(cfg: PolicyConfig) -> SessionPolicy:
    """The per-session rules of one listener or tunnel."""
    versions = (
        frozenset(parse_version(v) for v in cfg.accepted_versions) if cfg.accepted_versions else frozenset(KNOWN_VERSIONS)
    )
    return SessionPolicy(
        accepted_versions=versions,
        allowed_commands=expand_commands(cfg.allow_commands),
        max_request_bytes=cfg.max_request_bytes,
        max_graph_bytes=cfg.max_graph_bytes,
        mode=cfg.mode,
        firewall=FirewallPolicy(
            disabled_checks=frozenset(cfg.disabled_checks),
            max_graph_nodes=cfg.max_graph_nodes,
            max_graph_tensors=cfg.max_graph_tensors,
            max_alloc_bytes=cfg.max_alloc_bytes,
            max_session_alloc_bytes=cfg.max_session_alloc_bytes,
            denied_ops=frozenset(cfg.denied_ops),
            allow_unverified_ops=frozenset(cfg.allow_unverified_ops),
            max_graph_cpu_s=cfg.max_graph_cpu_ms / 1000,
        ),
        clear_new_buffers=cfg.clear_new_buffers,
    )


def acl(cfg: AclConfig) -> Acl:
    """The identity allow-list of a serve listener (``all``: any certificate from the CA)."""
    return Acl(cns=cfg.cn, dns=cfg.dns, uris=cfg.uri, ips=cfg.ip, allow_any=cfg.all)


def limits(cfg: LimitsConfig) -> Limits:
    """Timeouts and caps of the links of one listener or tunnel."""
    return Limits(
        handshake_timeout_s=cfg.handshake_timeout_s,
        hello_timeout_s=cfg.hello_timeout_s,
        idle_timeout_s=cfg.idle_timeout_s,
        frame_timeout_s=cfg.frame_timeout_s,
        max_session_s=cfg.max_session_s,
        max_sessions=cfg.max_sessions,
        upstream_busy=cfg.upstream_busy,
        queue_timeout_s=cfg.queue_timeout_s,
        connect_timeout_s=cfg.connect_timeout_s,
    )
