"""What the links of one listener (serve) or tunnel (connect) share: limits, the upstream slot.

How this works: ``Route`` is built once per listener by ``server.Runtime`` and handed to every
``relay.Link`` it accepts. It carries the resolved policy and limits, the per-upstream facts
cache, the TLS context getter, the settings (``default`` profile, the named ``profiles`` and the
``allow`` list: replaced whole by a reload, so new sessions see the new ones while a running
link keeps the ``Profile`` object it took), and, for ``serve``, the
``UpstreamSlot``: ggml-rpc-server serves one client at a time, so one session holds the slot
and the others queue for it (bounded) or are refused, per ``limits.upstream_busy``.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from rpcguard.errors import Refusal
from rpcguard.identity import AllowList, PeerIdentity
from rpcguard.metrics import ListenerTraffic
from rpcguard.protocol.endings import UPSTREAM_DRAIN_S
from rpcguard.protocol.settings import Limits, Profile
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
    traffic: ListenerTraffic
    # The listener's (tunnel's) own policy and limits: everything decided before an identity is
    # known (handshake and pre-admission timeouts, the listener-wide max_sessions), every connect
    # session, and serve identities whose allow-list entry names no profile.
    default: Profile = field(default_factory=Profile)
    profiles: Mapping[str, Profile] = field(default_factory=lambda: MappingProxyType({}))  # by name
    allow: AllowList | None = None  # serve: who may connect, and under which profile
    facts: UpstreamFacts = field(default_factory=UpstreamFacts)
    # serve: context for the TLS server side; connect: context toward the node. A callable, so a
    # reload swaps it for new links while running links keep theirs.
    ssl_context: Callable[[], ssl.SSLContext] | None = None
    server_name: str | None = None  # connect: expected name in the node's certificate
    slot: UpstreamSlot | None = None  # serve: the single upstream client slot
    links: set = field(default_factory=set)
    on_session_end: Callable[[dict], None] | None = None  # audit sink
    draining: bool = False

    def profile_for(self, identity: PeerIdentity) -> Profile:
        """The profile of an identity the allow-list admitted: the one its first matching entry
        names, else ``default``. Called once per session; counted per profile (a bounded label)."""
        name = self.allow.profile_of(identity) if self.allow is not None else None
        profile = self.profiles.get(name, self.default) if name is not None else self.default
        self.traffic.profile_admitted(profile.name)
        return profile

    @property
    def acl(self) -> Callable[[], AllowList] | None:
        """serve: the current allow-list (a getter, as the relay reads it per session)."""
        return (lambda: self.allow) if self.allow is not None else None  # type: ignore[return-value]
