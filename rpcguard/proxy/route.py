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
from collections import deque
import ssl
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Protocol

from rpcguard.errors import Refusal
from rpcguard.pki.identity import AllowList, PeerIdentity, check_usage
from rpcguard.observe.metrics import ListenerTraffic
from rpcguard.protocol.endings import UPSTREAM_DRAIN_S, peer_cap_refusal
from rpcguard.protocol.endings import admission_refusal
from rpcguard.protocol.linkstate import AWAIT_HELLO, CLOSED, LinkState
from rpcguard.protocol.session import Session
from rpcguard.protocol.stats import SessionStats
from rpcguard.protocol.settings import Limits, Profile
from rpcguard.protocol.side import SIDES, Side
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.versions import format_version
from rpcguard.pki.tls import is_probe, notices, peer_identity

__all__ = ["Limits", "UpstreamSlot", "Route", "Admission", "RoutedLink", "LinkView", "EndedSession", "UPSTREAM_DRAIN_S"]

log = logging.getLogger("rpcguard.relay")  # the links' logger: their lines keep one name

# UPSTREAM_DRAIN_S (protocol/lifecycle.py): how long a finished session's upstream is drained,
# holding the slot; refuse mode waits that long for a finished session's drain.


class UpstreamSlot:
    """The upstream's places: a single server (``--upstream``, ``isolation: shared``) serves one
    session at a time; a listener that runs a server process per session serves ``capacity`` at
    once (``Route.capacity``). Sessions past it queue, first come first served, up to
    ``queue_timeout_s`` (or are refused, ``upstream_busy: refuse``). The holders are known by
    link id, identity and since when: a waiting client's log line and its refusal say who holds
    the node (issue 31)."""

    def __init__(self) -> None:
        self.capacity = 1
        self.taken = 0  # places held, or handed to a waiter that has not resumed yet
        self.holders: dict[int, tuple[str, float]] = {}  # link id -> (identity, since: monotonic)
        self._queue: deque[asyncio.Future[None]] = deque()
        self.waiting = 0
        self._draining: set[int] = set()  # holders whose session is over; only their upstream drain remains

    @property
    def busy(self) -> bool:
        """A session holds (or is being handed) a place."""
        return self.taken > 0

    @property
    def draining(self) -> bool:
        return bool(self._draining)

    def drain(self, link_id: int) -> None:
        """The holder ``link_id``'s session is over; it keeps its place until its upstream has hung up."""
        if link_id in self.holders:
            self._draining.add(link_id)

    def waiting_for(self, link_id: int) -> int:
        """Sessions waiting that ``link_id``'s lifecycle must make way for (its fair-slot share):
        all of them for a single place; with several, only the longest holders are charged, one
        per waiting session, so one waiter does not end every holder. Once per tick, O(places)."""
        waiting = self.waiting
        if not waiting or link_id not in self.holders:
            return 0
        if self.capacity == 1:
            return waiting
        for rank, holder in enumerate(self.holders):
            if rank >= waiting:
                return 0
            if holder == link_id:
                return waiting
        return 0

    def held_by(self, now: float) -> str:
        """Who holds the node, for a waiting client's log line and refusal: 'session 12 (identity X) for 40 s'."""
        return ", ".join(f"session {link} ({identity or '-'}) for {now - since:.0f} s"
                         for link, (identity, since) in self.holders.items()) or "a session starting"

    async def acquire(self, limits: Limits, link_id: int = 0, identity: str = "", capacity: int = 1) -> None:
        """Take a place for ``link_id``, waiting in line when there is none (Refusal ``upstream_busy``)."""
        self.capacity = max(1, capacity)
        loop = asyncio.get_running_loop()
        refuse = limits.upstream_busy == "refuse"
        if self._queue:  # waiters handed a place, or gone, are no longer in line
            self._queue = deque(f for f in self._queue if not f.done())
        if self.taken < self.capacity and not self._queue:
            self.taken += 1
        else:
            if refuse and not self.draining:
                raise Refusal("upstream_busy", f"node busy: held by {self.held_by(loop.time())}")
            # Queue mode waits up to queue_timeout_s; refuse mode waits only for a finished session's
            # drain (llama.cpp opens its next connection right after closing the previous one).
            timeout = UPSTREAM_DRAIN_S if refuse else (limits.queue_timeout_s or None)
            handed: asyncio.Future[None] = loop.create_future()
            self._queue.append(handed)
            self.waiting += 1
            self._wake()  # a place may be free (a larger capacity since a reload)
            try:
                await asyncio.wait_for(asyncio.shield(handed), timeout)
            except asyncio.TimeoutError:
                if not handed.done():  # (else a place was handed over just in time: take it)
                    handed.cancel()
                    where = "waiting for the previous session to close" if refuse else "in the queue"
                    raise Refusal("upstream_busy", f"node busy: still held by {self.held_by(loop.time())} "
                                                   f"after {timeout:g} s {where}") from None
            except BaseException:  # the link went away while it waited
                if handed.done() and not handed.cancelled():
                    self._give_back()
                else:
                    handed.cancel()
                raise
            finally:
                self.waiting -= 1
        self.holders[link_id] = (identity, loop.time())

    def release(self, link_id: int = 0) -> None:
        """``link_id``'s place is free: handed to the first in line, if any."""
        if self.holders.pop(link_id, None) is None:
            return
        self._draining.discard(link_id)
        self._give_back()

    def _give_back(self) -> None:
        self.taken -= 1
        self._wake()

    def _wake(self) -> None:
        while self._queue and self.taken < self.capacity:
            handed = self._queue.popleft()
            if not handed.done():
                handed.set_result(None)
                self.taken += 1


class LinkView(Protocol):
    """What admission and revocation read of a link's lifecycle (protocol/lifecycle.py)."""

    @property
    def profile(self) -> Profile: ...
    @property
    def admitted(self) -> bool: ...
    @property
    def refusal(self) -> Refusal | None: ...
    @property
    def identity(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def state(self) -> LinkState: ...


class RoutedLink(Protocol):
    """What a route needs of the links it holds (proxy/link.py's ``Link``)."""

    @property
    def lc(self) -> LinkView: ...
    peer_cert: PeerIdentity | None  # serve: the client certificate, set at admission
    def end(self, refusal: Refusal) -> None: ...
    def close_for_shutdown(self) -> None: ...


class EndedSession(Protocol):
    """What ``Route.session_over`` folds into the listener of a finished session."""

    @property
    def result(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def session(self) -> Session | None: ...
    @property
    def stats(self) -> SessionStats: ...


class Admission(NamedTuple):
    """What ``Route.admit`` decided about a new session (``Lifecycle.admit``'s arguments)."""

    profile: Profile
    identity: str = ""
    refusal: Refusal | None = None
    identity_refused: bool = False  # the refusal is about who the client is (answered at HELLO)
    probe: bool = False  # serve: the client said in the handshake it is a probe (tls.ALPN_PROBES)
    notices: bool = False  # serve: the client knows the end notice (tls.ALPN_NOTICES, protocol/notice.py)


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
    links: set[RoutedLink] = field(default_factory=set)
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

    def admit(self, link: RoutedLink, ssl_object: ssl.SSLObject | None) -> Admission:
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
                link.peer_cert = ident  # a reload or its notAfter may end the session (Link.end)
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
        tls = self.side.client_tls
        return Admission(profile, identity, refusal, identity_refused, tls and is_probe(ssl_object),
                         tls and notices(ssl_object))

    def peer_counts(self, link: RoutedLink, identity: str) -> tuple[int, int, int, int]:
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

    @property
    def capacity(self) -> int:
        """serve: sessions the upstream serves at once. One for a single server; with a server
        process per session (``isolation`` session or identity), ``max_upstream_sessions`` (0:
        ``max_sessions``), the listener's."""
        provider = self.provider
        if provider is None or provider.settings.isolation == "shared":
            return 1
        limits = self.default.limits
        return limits.max_upstream_sessions or limits.max_sessions

    async def take_slot(self, limits: Limits, link_id: int, identity: str = "") -> Refusal | None:
        """serve: wait for a place on the upstream; the refusal when ``upstream_busy`` says no.
        A session that has to wait is logged with who holds the node and since when."""
        slot = self.slot
        assert slot is not None
        capacity = self.capacity
        if slot.taken >= capacity and (limits.upstream_busy != "refuse" or slot.draining):  # (else refused at once)
            log.info("session %d identity=%s waits for the upstream of listener %s: node busy, held by %s "
                     "(%d waiting before it)", link_id, identity or "-", self.name,
                     slot.held_by(asyncio.get_running_loop().time()), slot.waiting)
        self.traffic.queue_depth = slot.waiting + 1
        try:
            await slot.acquire(limits, link_id, identity, capacity)
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

    def revoke(self, revoked: Callable[[int], bool]) -> int:
        """After a reload: end the live sessions whose client certificate is now revoked or whose
        identity the allow-list no longer admits; how many were ended."""
        ended = 0
        for link in list(self.links):
            cert = link.peer_cert
            if cert is None or link.lc.state == CLOSED:
                continue
            refusal: Refusal | None = None
            if revoked(cert.serial):
                refusal = Refusal("certificate_revoked", "the client certificate was revoked (tls.crl) during the session")
            elif self.allow is not None:
                try:
                    self.allow.authorize(cert)
                except Refusal as exc:
                    refusal = Refusal(exc.reason, f"a reload took the identity off the allow-list: {exc.detail}")
            if refusal is not None:
                link.end(refusal)
                ended += 1
        return ended

    def session_over(self, link: RoutedLink, lc: EndedSession) -> None:
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
