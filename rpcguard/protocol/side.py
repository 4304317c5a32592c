"""The two ends rpcguard can be of a link, each described once: what a role means, in one row.

How this works: ``serve`` (on the GPU node: TLS from the client, a real ggml-rpc-server behind)
and ``connect`` (next to llama.cpp: plain TCP from the client, a node's ``serve`` behind) run the
same link machine (protocol/lifecycle.py) and the same relay (proxy/link.py). Where they differ,
the code asks the ``Side`` a question (``side.takes_slot``), never the role's name: a third kind
of end, or a change of one, is a new row here and no hunt through the handlers (h11 keeps roles
out of its state handlers the same way). ``SIDES`` maps the role names of the config and the
metrics labels to their rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, Mapping

__all__ = ["Side", "SERVE", "CONNECT", "SIDES"]

Role = Literal["serve", "connect"]


@dataclass(frozen=True, slots=True)
class Side:
    role: Role  # the config's and the metrics' name
    other: Role  # the role at the far end of a rpcguard-to-rpcguard link
    items: str  # the config key of its endpoints ("listeners": serve, "tunnels": connect)
    item: str  # one of them, in messages
    target: str  # an endpoint's key for what it forwards to ("upstream" / "server")
    # The upstream serves one client at a time (a ggml-rpc-server): a session takes it at the
    # client's HELLO and queues for it (limits.upstream_busy).
    takes_slot: bool
    # At a session's end the upstream is half-closed and read until it hangs up, not cut: a
    # ggml-rpc-server that writes into a closed socket dies of SIGPIPE.
    drains_upstream: bool
    # The upstream is a node's rpcguard serve: it answers every HELLO (a bare close before the
    # answer means its TLS layer refused this certificate) and may hold the HELLO for its own
    # queue_timeout_s before answering.
    upstream_is_guard: bool
    # The client side is TLS with a client certificate: identities, probes, per-source caps.
    client_tls: bool
    # Why a session is refused when the upstream cannot be reached.
    unreachable_reason: str
    read_by: str  # who reads a config of this role, in messages


SERVE: Final = Side(role="serve", other="connect", items="listeners", item="listener", target="upstream",
                    takes_slot=True, drains_upstream=True, upstream_is_guard=False, client_tls=True,
                    unreachable_reason="upstream_unavailable", read_by="rpcguard serve reads")
CONNECT: Final = Side(role="connect", other="serve", items="tunnels", item="tunnel", target="server",
                      takes_slot=False, drains_upstream=False, upstream_is_guard=True, client_tls=False,
                      unreachable_reason="node_unreachable", read_by="rpcguard connect and check read")
SIDES: Final[Mapping[str, Side]] = {s.role: s for s in (SERVE, CONNECT)}
