"""What the links of one listener (serve) or tunnel (connect) share: limits, the upstream slot.

How this works: ``Route`` is built once per listener by ``server.Runtime`` and handed to every
``relay.Link`` it accepts. It carries the resolved policy and limits, the per-upstream facts
cache, the TLS context and ACL getters (swapped on reload), and, for ``serve``, the
``UpstreamSlot``: ggml-rpc-server serves one client at a time, so one session holds the slot
and the others queue for it (bounded) or are refused, per ``limits.upstream_busy``.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass, field
from typing import Callable

from rpcguard.errors import Refusal
from rpcguard.identity import Acl
from rpcguard.metrics import ListenerTraffic
from rpcguard.identity import PeerIdentity
from rpcguard.protocol.endings import UPSTREAM_DRAIN_S
from rpcguard.protocol.settings import Limits, Profile, SessionPolicy
from rpcguard.protocol.state import UpstreamFacts

__all__ = ["Limits", "UpstreamSlot", "Route", "UPSTREAM_DRAIN_S"]

# UPSTREAM_DRAIN_S (protocol/lifecycle.py): how long a finished session's upstream is drained,
# holding the slot; refuse mode waits that long for a finished session's drain.


class UpstreamSlot:
    """The single-client upstream: at most one session holds it; others queue or are refused."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self.waiting = 0
        self.draining = False  # the holder's session is over; only its upstream drain remains

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def acquire(self, limits: Limits) -> None:
        refuse = limits.upstream_busy == "refuse"
        if self._lock.locked() and refuse and not self.draining:
            raise Refusal("upstream_busy", "the upstream serves another session")
        # Queue mode waits up to queue_timeout_s; refuse mode waits only for a finished session's
        # drain (llama.cpp opens its next connection right after closing the previous one).
        timeout = UPSTREAM_DRAIN_S if refuse else (limits.queue_timeout_s or None)
        self.waiting += 1
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout)
        except asyncio.TimeoutError:
            where = "waiting for the previous session to close" if refuse else "in the queue"
            raise Refusal("upstream_busy", f"still busy after {timeout:g} s {where}") from None
        finally:
            self.waiting -= 1
        self.draining = False

    def release(self) -> None:
        self.draining = False
        if self._lock.locked():
            self._lock.release()


@dataclass
class Route:
    """One listener (serve) or tunnel (connect) and everything its links share."""

    role: str  # "serve" or "connect"
    name: str
    upstream_host: str
    upstream_port: int
    policy: SessionPolicy
    traffic: ListenerTraffic
    limits: Limits = field(default_factory=Limits)
    facts: UpstreamFacts = field(default_factory=UpstreamFacts)
    # serve: context for the TLS server side; connect: context toward the node. Callables, so a
    # reload swaps them for new links while running links keep theirs.
    ssl_context: Callable[[], ssl.SSLContext] | None = None
    acl: Callable[[], Acl] | None = None
    server_name: str | None = None  # connect: expected name in the node's certificate
    slot: UpstreamSlot | None = None  # serve: the single upstream client slot
    links: set = field(default_factory=set)
    on_session_end: Callable[[dict], None] | None = None  # audit sink
    draining: bool = False

    @property
    def default(self) -> Profile:
        """The listener's (serve) or tunnel's (connect) own policy and limits."""
        return Profile("default", self.policy, self.limits)

    def profile_for(self, identity: PeerIdentity) -> Profile:
        """The profile of an authorized identity (until profiles exist: the default)."""
        return self.default
