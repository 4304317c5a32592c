"""What the links of one listener (serve) or tunnel (connect) share: limits, the upstream slot.

How this works: ``Route`` is built once per listener by ``server.Runtime`` and handed to every
``link.Link`` it accepts. It carries the resolved policy and limits, the per-upstream facts
cache, the TLS context getter, the settings (``default`` profile, the named ``profiles`` and the
``allow`` list: replaced whole by a reload, so new sessions see the new ones while a running
link keeps the ``Profile`` object it took), and, for ``serve``, the
``UpstreamSlot``: ggml-rpc-server serves one client at a time, so one session holds the slot
and the others queue for it (bounded) or are refused, per ``limits.upstream_busy``.

The route also decides what concerns the whole listener about one of its links: whether a new
session is admitted (``admit``: the client certificate, the allow-list and the identity's
profile, the session limits, a shutdown in progress), its wait for the slot (``take_slot``), and
what a violation or a finished session adds to the listener's counters (``violation``,
``session_over``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple

from rpcguard.errors import Refusal
from rpcguard.pki.identity import AllowList, PeerIdentity, check_usage
from rpcguard.observe.metrics import ListenerTraffic
from rpcguard.protocol.endings import UPSTREAM_DRAIN_S, peer_cap_refusal
from rpcguard.protocol.lifecycle import AWAIT_HELLO, Lifecycle, admission_refusal
from rpcguard.protocol.settings import Limits, Profile
from rpcguard.protocol.side import SIDES, Side
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.versions import format_version
from rpcguard.pki.tls import is_probe, peer_identity

__all__ = ["Limits", "UpstreamSlot", "Route", "Admission", "UPSTREAM_DRAIN_S"]

log = logging.getLogger("rpcguard.relay")  # the links' logger: their lines keep one name

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


class Admission(NamedTuple):
    """What ``Route.admit`` decided about a new session (``Lifecycle.admit``'s arguments)."""

    profile: Profile
    identity: str = ""
    refusal: Refusal | None = None
    identity_refused: bool = False  # the refusal is about who the client is (answered at HELLO)
    probe: bool = False  # serve: the client said in the handshake it is a probe (tls.ALPN_PROBES)


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
    handshaking: dict = field(default_factory=dict)  # serve: source address -> TLS handshakes running
    on_session_end: Callable[[dict], None] | None = None  # audit sink
    # serve with upstream.exec: the upstream/pool.UpstreamPool that runs the server processes and
    # gives each session its connection (endpoint.dial, link.Link, admit's quarantine check)
    provider: Any = None
    draining: bool = False

    @property
    def side(self) -> Side:
        """What this end of the link does (protocol/side.py)."""
        return SIDES[self.role]

    def handshake_refusal(self, source: str) -> Refusal | None:
        """serve: ``max_handshakes_per_source`` handshakes from ``source`` run already."""
        cap = self.default.limits.max_handshakes_per_source
        if cap and self.handshaking.get(source, 0) >= cap:
            return Refusal("too_many_handshakes_per_source", f"more than {cap} TLS handshakes from this address")
        return None

    def profile_for(self, identity: PeerIdentity) -> Profile:
        """The profile of an identity the allow-list admitted: the one its first matching entry
        names, else ``default``. Called once per session; counted per profile (a bounded label)."""
        name = self.allow.profile_of(identity) if self.allow is not None else None
        profile = self.profiles.get(name, self.default) if name is not None else self.default
        self.traffic.profile_admitted(profile.name)
        return profile

    def admit(self, link: Any, ssl_object: ssl.SSLObject | None) -> Admission:
        """Whether the new session of ``link`` may start. serve: the client certificate's usage
        (clientAuth, whoever issued it), the allow-list, the identity's profile. Both roles: the
        session limits, counting admitted links only (sockets still in their TLS handshake, bounded
        by handshake_timeout_s, must not let an unauthenticated flood lock clients out), and a
        shutdown in progress. An identity refusal is no TLS failure (the handshake worked): it is
        counted in refusals_total when the session ends and answered at HELLO."""
        profile, identity = self.default, ""
        refusal: Refusal | None = None
        identity_refused = False
        if self.side.client_tls:
            try:
                ident = peer_identity(ssl_object)  # type: ignore[arg-type]  # serve: always TLS
                identity = ident.label()
                check_usage(ident, "client")
                if self.allow is not None:
                    self.allow.authorize(ident)
                profile = self.profile_for(ident)
            except Refusal as exc:
                refusal, identity_refused = exc, True
            if refusal is None and self.provider is not None:
                refusal = self.provider.quarantined(identity)
                identity_refused = refusal is not None
        # Links refused already (waiting to answer their HELLO) hold no session: a flood of them
        # must not lock others out.
        held = [other.lc.profile for other in self.links
                if other is not link and other.lc.admitted and other.lc.refusal is None]
        held.append(profile)
        too_many = admission_refusal(self.default, profile, held)
        if too_many is None and refusal is None and self.side.client_tls:
            too_many = peer_cap_refusal(self.default.limits, profile.limits, self.peer_counts(link, identity))
            identity_refused = too_many is not None  # about who (where) it is: counted if it leaves
        if too_many is not None:
            refusal = too_many
        elif self.draining:
            refusal = Refusal("shutdown", "rpcguard is shutting down")
        return Admission(profile, identity, refusal, identity_refused, self.side.client_tls and is_probe(ssl_object))

    def peer_counts(self, link: Any, identity: str) -> tuple[int, int, int, int]:
        """serve: admitted sessions that are not refused (``link``, new, included) of ``identity``
        and of ``link``'s source address, then among them those without a HELLO yet."""
        source = link.lc.source
        ident = src = ident_pending = src_pending = 1
        for other in self.links:
            lc = other.lc
            if other is link or not lc.admitted or lc.refusal is not None:
                continue
            pending = lc.state == AWAIT_HELLO
            if lc.identity == identity:
                ident += 1
                ident_pending += pending
            if lc.source == source:
                src += 1
                src_pending += pending
        return ident, src, ident_pending, src_pending

    async def take_slot(self, limits: Limits, link_id: int) -> Refusal | None:
        """serve: wait for the single upstream slot; the refusal when ``upstream_busy`` says no."""
        slot = self.slot
        assert slot is not None
        self.traffic.queue_depth = slot.waiting + 1
        try:
            await slot.acquire(limits)
        except Refusal as refusal:
            return refusal
        except Exception as exc:
            log.exception("link %d: unexpected error while queueing", link_id)
            return Refusal("refused", f"internal error: {exc!r}")
        finally:
            self.traffic.queue_depth = slot.waiting
        return None

    def violation(self, link_id: int, identity: str, what: tuple) -> None:
        """Count a firewall violation; log one that monitor mode let through."""
        reason, mode, v, _command = what
        self.traffic.firewall_violation(reason, mode)
        if v is not None:
            log.warning("monitor: would refuse session=%d listener=%s identity=%s command=%s reason=%s detail=%s",
                        link_id, self.name, identity or "-", v.command, v.reason, v.detail)

    def session_over(self, link: Any, lc: Lifecycle) -> None:
        """Fold a finished session into the listener: its refusal, the upstream's version, the
        unverified ops it used, its counters and result."""
        traffic = self.traffic
        self.links.discard(link)
        if lc.result == "refused" and lc.reason:
            traffic.refusal(lc.reason)
        session = lc.session
        if session is not None:
            if session.version is not None:
                traffic.upstream_version = format_version(session.version)
            for op, n in session.state.unverified_uses.items():
                traffic.unverified_ops[op] = traffic.unverified_ops.get(op, 0) + n
        traffic.session_ended(lc.stats, lc.result)
