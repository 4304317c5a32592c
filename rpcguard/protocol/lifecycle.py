"""The life of one proxied connection as a sans-IO state machine (h11 style).

Stays whole (over 400 lines): it is one class whose handlers share the link's fields; its table
is apart already (linkstate.py), as are the deadline, admission and audit rules (endings.py) and
what serve and connect differ in (side.py).

How this works: ``Lifecycle`` is told what happened to a link (typed events in, linkstate.py:
the socket accepted, the TLS handshake done with an identity, bytes from either side, the
upstream slot granted or refused, the upstream connected or failed, either side closed or
blocked, ``Tick(now)``, shutdown; and the Session's own events) and answers with what the relay
must do (typed actions out, appended to ``actions``: write, open the upstream, take or free the
slot, half-close, close, count, validate a graph, and the audit record at the end). It never
touches a socket or a clock of its own: the relay carries out the actions, the clock is injected.

Dispatch (``handle``): the handler of the event in the current state does the work (``_HANDLERS``,
registered with ``on`` so that mypy checks each handler against its event class); then the link
moves where ``linkstate.TABLE`` says, a ``Rule`` deciding the cells that depend on the link's
facts, and the state-triggered rule moves a session that ended to DRAINING or CLOSED. Entering a
state does that state's work (``_ENTER``: dial, queue, half-close, release the upstream). No
handler picks or assigns a state. See docs/design.md for the diagram::

    HANDSHAKE --Admit--> AWAIT_HELLO (serve: the slot is taken only once the client said HELLO)
              \\-------> CONNECTING  (connect: the node is dialled at once)
              \\-------> REFUSING    (refused before the HELLO: answered 0.0.N when it comes)
    AWAIT_HELLO --Hello--> QUEUED --SlotGranted--> CONNECTING --UpstreamConnected--> GREETING
    GREETING --Active--> ACTIVE <--GraphValidated-- VALIDATING <--Deferred-- ACTIVE
    ACTIVE --end--> DRAINING (serve: upstream half-closed, read until it hangs up, slot kept)
    any --end--> CLOSED

A refusal before ACTIVE is answered at the client's HELLO with version 0.0.N (llama.cpp then
reports a version mismatch instead of a crashed server), whatever the HELLO era; a refusal
during ACTIVE closes both sides. Timeouts come from the ``Limits`` of the session's profile:
``route.default`` until the identity is authorized, then the profile of that identity.

Hot path: a transition binds ``client_data`` / ``server_data`` to the state's data handlers
(``_DATA``); in GREETING and ACTIVE they are the ``Session``'s own methods. The feed contract is
``feed`` (``client_bytes`` / ``server_bytes``; ``graph_validated`` after a deferred graph), the only
way the relay feeds a session: a ``Refusal`` raised becomes a ``Refused`` event, a non-empty
``out.events`` goes to ``session_events()``; then the caller sends the frames in ``out`` and
carries out ``actions``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping, TypeVar

from rpcguard.errors import UPSTREAM, FirewallRefusal, Refusal, party_of
from rpcguard.protocol.endings import UPSTREAM_DRAIN_MAX_S, UPSTREAM_DRAIN_S, admission_refusal, audit_record, hello_closed_refusal, overdue
from rpcguard.protocol.linkstate import (
    ACTIVE, AWAIT_HELLO, CLOSED, CONNECTING, DRAINING, ENDS, EVENTS, GREETING, HANDSHAKE, QUEUED, REFUSING, RULES,
    STATES,
    TABLE, VALIDATING, AbortUpstream, Accepted, Action, Admit, ClientBlocked, ClientClosed, CloseClient,
    CloseUpstream, CountTlsFailure, CountViolation, End, Event, FreeSlot, GraphValidated, HalfCloseUpstream,
    HandshakeFailed, InternalError, LinkState, OpenUpstream, Refused, Rejected, Rule, Shutdown, SlotGranted,
    SlotRefused, TakeSlot, TICK, Tick, UpstreamBlocked, UpstreamClosed, UpstreamConnected, UpstreamFailed, Validate,
    WriteClient, WriteUpstream, ended_to,
)
from rpcguard.protocol.side import Side
from rpcguard.protocol.notice import encode_notice
from rpcguard.protocol.session import Active, Deferred, Hello, NodeEnded, NodeRefused, Output, Session, Violation
from rpcguard.protocol.settings import Limits, Profile
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.stats import SessionStats

__all__ = ["Lifecycle", "admission_refusal", "on", "UPSTREAM_DRAIN_S"]


# The events without fields, built once (an event costs no object then).
_SLOT_GRANTED, _UPSTREAM_CONNECTED, _SHUTDOWN, _INTERNAL_ERROR, _GRAPH_VALIDATED = (
    SlotGranted(), UpstreamConnected(), Shutdown(), InternalError(), GraphValidated())


class Lifecycle:
    """One link from accept to close; see the module docstring."""

    def __init__(self, *, link_id: int, side: Side, listener: str, upstream: str, default: Profile,
                 facts: UpstreamFacts, clock: Callable[[], float]) -> None:
        self.id = link_id
        self.side = side  # what this end of the link does (protocol/side.py): no handler tests the role
        self.role = side.role  # "serve" or "connect": the audit record's and the metrics' label
        self.listener = listener
        self.upstream = upstream  # "host:port", for logs
        self.profile = default  # replaced by the identity's profile once it is authorized
        self.facts = facts
        self.clock = clock
        self.peer = "-"
        self.source = ""  # the peer's address without the port (serve's per-source caps)
        self.identity = ""
        self.stats = SessionStats()
        self.session: Session | None = None  # built at admission, from the profile's policy
        self.out = Output()  # the session's, once there is one
        self.actions: list[Action] = []
        self.refusal: Refusal | None = None  # refused before ACTIVE: answered at HELLO
        self.refused_on_leave = False  # identity refused: a client leaving before HELLO is a refusal
        # serve: the client said in the handshake that it is a probe (rpcguard check, connect's
        # /readyz): never queued for the upstream, and its end is result "probe", not a session.
        self.probe = False
        self.notices = False  # serve: the client knows the end notice (protocol/notice.py)
        self._client_cut = False  # the client is gone, or bytes meant for it were dropped: no notice then
        self.result = self.reason = self.detail = self.party = ""  # result set: the session ended
        self._record_due = False  # ended by this event: the audit record follows the transition
        self.command = "-"  # command of the frame that was refused
        self.t0 = clock()
        self.t_admitted: float | None = None
        self.t_upstream = 0.0
        self._t0_ns = int(self.t0 * 1e9)
        self.client_blocked_since = 0.0  # the client's write buffer is full (flow control)
        # Deadlines by age, sampled at the tick (no clock read per frame): client bytes read
        # (counted per read by the caller), the tick that first saw the request frame in progress
        # and the byte count then, the last tick that saw the session working.
        self.rx_bytes = 0
        self.client_held_back = False  # the relay paused the client's reads (a slow upstream)
        self.frame_t = 0.0
        self.frame_rx = 0
        self._tick_rx = 0
        self._tick_t = self.working_t = self.t0
        self.now_s = self.t0  # the time of the last tick
        self.others_waiting = 0  # serve: sessions queued for this one's upstream slot (at the last tick)
        self.slot_held = False
        # The fair slot's share (endings.overdue, hold_while_waiting_s): the tick that first saw
        # another session wait while this one held the slot (0.0: nobody waits), the seconds of
        # busy ticks since, and the session's estimated compute (flop) at that tick.
        self.wait_t = 0.0
        self.busy_waited = 0.0
        self.flops_at_wait = 0
        self.upstream_open = False
        self.post_mortem: dict[str, object] | None = None  # what the session sent last before its server died
        self.t_drain = 0.0  # when the drain began
        self.t_drained = 0.0  # when the server last sent something during it
        self._pending: list[bytes] = []  # client bytes accepted before the upstream connected
        self._feed_c: Callable[[memoryview, int], Output] = self._drop  # the session's, once admitted
        self._feed_s: Callable[[memoryview, int], Output] = self._drop
        self.state = HANDSHAKE
        self.greeted = False  # ACTIVE or VALIDATING (set with the state, by _enter)
        self._bind()

    # ----------------------------------------------------------------------------- dispatch
    def handle(self, event: Event) -> None:
        """Do ``event``'s work in this state, then move where the table (or a rule) says."""
        state = self.state
        kind = type(event)
        _HANDLERS[state][kind](self, event)
        if self.result and state is not CLOSED:  # state-triggered: the session ended
            nxt = ended_to(self)
        else:
            cell = _NEXT[state][kind]
            if cell is None:  # the event leaves the state as it is
                return
            nxt = RULES[cell](self) if isinstance(cell, Rule) else cell
        if nxt is not state:
            self._enter(nxt)
        if self._record_due:
            self._record_due = False
            self.actions.append(End(self.audit_record()))

    def _enter(self, state: LinkState) -> None:
        self.state = state
        self.greeted = state is ACTIVE or state is VALIDATING  # the HELLO exchange is done, the session on
        self._bind()
        _ENTER[state](self)

    def _bind(self) -> None:
        # The data handlers of this state, bound once per transition (the per-read path).
        client, server = _DATA[self.state]
        self.client_data: Callable[[memoryview, int], Output] = getattr(self, client)
        self.server_data: Callable[[memoryview, int], Output] = getattr(self, server)

    @property
    def limits(self) -> Limits:
        return self.profile.limits

    @property
    def last_activity_ns(self) -> int:
        """When bytes last came from either side (the session notes the time of every feed)."""
        session = self.session
        return max(self._t0_ns, session.last_feed_ns) if session is not None else self._t0_ns

    @property
    def admitted(self) -> bool:
        return self.t_admitted is not None

    # ----------------------------------------------------------------------------- events in
    # The relay's calls, one per event class (linkstate.py documents each).
    def accepted(self, peer: str, source: str) -> None:
        self.handle(Accepted(peer, source))

    def admit(self, profile: Profile, identity: str = "", refusal: Refusal | None = None,
              identity_refused: bool = False, probe: bool = False, notices: bool = False) -> None:
        self.handle(Admit(profile, identity, refusal, identity_refused, probe, notices))

    def handshake_failed(self, result: str, reason: str, detail: str) -> None:
        self.handle(HandshakeFailed(result, reason, detail))

    def rejected(self, refusal: Refusal) -> None:
        self.handle(Rejected(refusal))

    def slot_granted(self) -> None:
        self.handle(_SLOT_GRANTED)

    def slot_refused(self, refusal: Refusal) -> None:
        self.handle(SlotRefused(refusal))

    def upstream_connected(self) -> None:
        self.handle(_UPSTREAM_CONNECTED)

    def upstream_failed(self, refusal: Refusal) -> None:
        self.handle(UpstreamFailed(refusal))

    def client_closed(self, error: str = "") -> None:
        self.handle(ClientClosed(error))

    def upstream_closed(self, error: str = "", tls_reason: str | None = None, crashed: Refusal | None = None) -> None:
        self.handle(UpstreamClosed(error, tls_reason, crashed))

    def tick(self, now: float, others_waiting: int = 0) -> None:
        """Enforce the deadlines of the current state (the relay calls this every second);
        ``others_waiting``: sessions queued for the upstream slot this one may hold."""
        self.now_s, self.others_waiting = now, others_waiting
        self.handle(TICK)

    def shutdown(self) -> None:
        """The drain timeout is reached: end the session now."""
        self.handle(_SHUTDOWN)

    def internal_error(self) -> None:
        self.handle(_INTERNAL_ERROR)

    def refused(self, refusal: Refusal) -> None:
        """The session refused a frame (either side), or the link is ended from outside."""
        self.handle(Refused(refusal))

    def client_blocked(self, blocked: bool) -> None:
        self.handle(ClientBlocked(blocked))

    def upstream_blocked(self, blocked: bool) -> None:
        self.handle(UpstreamBlocked(blocked))

    # ----------------------------------------------------------------------------- entering a state
    def _enter_nothing(self) -> None:
        pass

    def _enter_connecting(self) -> None:
        self.actions.append(OpenUpstream(self.limits))

    def _enter_queued(self) -> None:
        # A probe never waits for a busy upstream: it is answered "busy" at once (upstream_busy).
        self.actions.append(TakeSlot(replace(self.limits, upstream_busy="refuse") if self.probe else self.limits))

    def _enter_refusing(self) -> None:
        """Refused before the HELLO: the upstream (connect's node) and the slot are of no more use."""
        self._release_upstream(CloseUpstream())

    def _enter_validating(self) -> None:
        """A large graph waits for its validation (Session.validate_deferred): the relay runs it
        off the event loop and holds both sides' reads meanwhile, then calls ``graph_validated``."""
        self.actions.append(Validate())

    def _enter_draining(self) -> None:
        self.actions.append(HalfCloseUpstream(self.slot_held))
        self.t_drain = self.t_drained = self.clock()

    def _enter_closed(self) -> None:
        # close() flushes what is queued; an error aborts.
        self._release_upstream(AbortUpstream() if self.result == "error" else CloseUpstream())

    def _release_upstream(self, close: AbortUpstream | CloseUpstream) -> None:
        if self.upstream_open:
            self.upstream_open = False
            self.actions.append(close)
        if self.slot_held:
            self.actions.append(FreeSlot())
            self.slot_held = False

    # ----------------------------------------------------------------------------- set-up
    def _accepted(self, ev: Accepted) -> None:
        self.peer, self.source = ev.peer, ev.source

    def _admit(self, ev: Admit) -> None:
        profile = ev.profile
        self.probe = ev.probe
        self.notices = ev.notices
        self.profile = profile
        self.identity = ev.identity
        self.t_admitted = self.clock()
        self.session = Session(profile.policy, self.facts, self.stats)
        self.out = self.session.out
        self._feed_c = self.session.client_data
        self._feed_s = self.session.server_data
        if ev.refusal is not None:
            self.refusal = ev.refusal
            self.refused_on_leave = ev.identity_refused

    def _rejected(self, ev: Rejected) -> None:
        refusal = ev.refusal
        self._finish("refused", refusal.reason, refusal.detail, refusal.party)

    def _handshake_failed(self, ev: HandshakeFailed) -> None:
        if ev.result == "refused":
            self.tls_failure(ev.reason)
        self._finish(ev.result, ev.reason, ev.detail)

    def _slot_granted(self, ev: SlotGranted) -> None:
        self.slot_held = True

    def _free_granted_slot(self, ev: SlotGranted) -> None:
        # The session ended while it queued: hand the slot straight back.
        self.actions.append(FreeSlot())

    def _upstream_connected(self, ev: UpstreamConnected) -> None:
        self.upstream_open = True
        self.t_upstream = self.clock()
        if self._pending:
            self.actions.append(WriteUpstream(self._pending))
            self._pending = []

    def _close_new_upstream(self, ev: UpstreamConnected) -> None:
        self.actions.append(CloseUpstream())

    def _refuse_early(self, ev: SlotRefused | UpstreamFailed) -> None:
        self._refuse_before_active(ev.refusal)

    def _refuse_before_active(self, refusal: Refusal) -> None:
        """Refused before ACTIVE: answered now if the HELLO is waiting (the session ends), else
        when it comes (the table's REFUSING)."""
        self.refusal = refusal
        session = self.session
        if session is not None and session.hello_request_len is not None:
            self._answer_refusal()

    def _answer_refusal(self) -> None:
        refusal = self.refusal
        assert refusal is not None and self.session is not None
        self.out.clear()
        self.actions.append(WriteClient(self.session.refusal_answer(refusal.reason)))
        if self.probe and refusal.reason == "upstream_busy":  # the probe's answer, not a refusal
            self._finish("probe", "", "probe: identity accepted, upstream busy with another session")
            return
        self._finish("refused", refusal.reason, refusal.detail, refusal.party)

    # ----------------------------------------------------------------------------- data
    def _drop(self, data: memoryview, now_ns: int) -> Output:
        self.out.clear()
        return self.out

    def _client_early(self, data: memoryview, now_ns: int) -> Output:
        """Client bytes before the upstream is connected: checked, kept for the upstream."""
        out = self._fed(self._feed_c, data, now_ns)
        if out.to_server:
            self._pending.extend(bytes(chunk) for chunk in out.to_server)
            out.to_server.clear()
        return out

    def _client_refusing(self, data: memoryview, now_ns: int) -> Output:
        """Client bytes of a link refused before its HELLO: checked (the HELLO is answered), never kept."""
        out = self._fed(self._feed_c, data, now_ns)
        out.to_server.clear()
        return out

    def feed(self, from_client: bool, data: memoryview, now_ns: int) -> Output:
        """Bytes read from the client (``client_data``, counted in ``rx_bytes``) or the server
        (``server_data``) with the whole contract (``_fed``): a refusal reported, the events handled."""
        if from_client:
            self.rx_bytes += len(data)
            return self._fed(self.client_data, data, now_ns)
        return self._fed(self.server_data, data, now_ns)

    def client_bytes(self, data: memoryview, now_ns: int) -> Output:
        """``feed`` of client bytes."""
        return self.feed(True, data, now_ns)

    def server_bytes(self, data: memoryview, now_ns: int) -> Output:
        """``feed`` of server bytes."""
        return self.feed(False, data, now_ns)

    def graph_validated(self, now_ns: int) -> Output:
        """After the ``Validate`` action ran ``Session.validate_deferred``: back to ACTIVE, then the
        graph's verdict and the bytes that followed it, with the whole contract."""
        self.handle(_GRAPH_VALIDATED)
        return self._fed(self._resume_deferred, memoryview(b""), now_ns)

    def _resume_deferred(self, data: memoryview, now_ns: int) -> Output:
        assert self.session is not None
        return self.session.resume_deferred(now_ns)

    def _fed(self, feed: Callable[[memoryview, int], Output], data: memoryview, now_ns: int) -> Output:
        try:
            out = feed(data, now_ns)
        except Refusal as refusal:
            self.refused(refusal)
            return self.out
        if out.events:
            self.session_events(out)
        return out

    def session_events(self, out: Output) -> None:
        """Act on the events of one feed (the caller hands them over when ``out.events`` is set)."""
        events = list(out.events)
        out.events.clear()
        for event in events:
            self.handle(event)
            if self.state in ENDS:
                return  # the link is over: later events do not matter

    def _violation(self, v: Violation) -> None:
        self.actions.append(CountViolation(v.reason, "monitor", v, v.command))

    def _answer_at_hello(self, ev: Hello) -> None:
        self._answer_refusal()

    def _node_ended(self, ev: NodeEnded) -> None:
        # connect: the node's serve ended the session and said why (its end notice). What came
        # before the notice in the same read (whole answers) still goes to the client.
        self._finish("refused", "node_ended",
                     f"the node ended the session: {ev.reason}" + (f" ({ev.detail})" if ev.detail else ""), UPSTREAM)

    def _node_refused(self, ev: NodeRefused) -> None:
        # The node's rpcguard refused the session: its 0.0.N answer is forwarded as is.
        self.refusal = Refusal(ev.reason, "refused by the node")
        self._finish("refused", "node_refused", f"node refused the session: {ev.reason}")

    def _refused(self, ev: Refused) -> None:
        refusal = ev.refusal
        session = self.session
        assert session is not None
        self.command = session.command_name
        self._client_cut = bool(self.out.to_client)
        self.out.clear()
        if isinstance(refusal, FirewallRefusal):
            self.actions.append(CountViolation(refusal.reason, "enforce", None, self.command))
        if not self.greeted and session.hello_request_len is not None:
            if self.refusal is None:  # else: a refusal already waited for this HELLO, say that one
                self.refusal = refusal
            self._answer_refusal()
        else:
            self._finish("refused", refusal.reason, refusal.detail, refusal.party)

    def _client_blocked(self, ev: ClientBlocked) -> None:
        self.client_blocked_since = self.clock() if ev.blocked else 0.0

    def _upstream_blocked(self, ev: UpstreamBlocked) -> None:
        self.client_held_back = ev.blocked  # the client's frames wait for the upstream: not its delay

    # ----------------------------------------------------------------------------- closes
    def _client_closed(self, ev: ClientClosed) -> None:
        self._client_cut = True
        if self.refused_on_leave and self.refusal is not None:
            self._finish("refused", self.refusal.reason, self.refusal.detail, self.refusal.party)  # left before its HELLO
            return
        s = self.session
        error = ev.error
        clean = s is None or s.idle or (self.greeted and not s.mid_frame)
        said_hello = s is not None and s.hello_request_len is not None
        result = "error" if not clean else "probe" if self.probe else "ok" if said_hello else "no_hello"
        self._finish(result, "" if clean else "client_closed_mid_frame",
                     "client closed" + (f": {error}" if error else "") + ("" if said_hello or not clean else
                                                                          " before its HELLO"))

    def _upstream_closed_early(self, ev: UpstreamClosed) -> None:
        """The upstream hung up before the session was active: the client still gets its 0.0.N."""
        self.upstream_open = False
        tls_reason, error = ev.tls_reason, ev.error
        if tls_reason is not None:
            # TLS 1.3: the node rejects our certificate after the handshake, on the first read.
            self.tls_failure(tls_reason)
            refusal = Refusal("tls_failed", f"the node refused the TLS session ({tls_reason}): {error}")
        elif self.side.upstream_is_guard:
            # A node's rpcguard answers every HELLO, refusals included: a bare close means its
            # TLS layer dropped us after the handshake (certificate refused).
            self.tls_failure("tls_handshake_failed")
            refusal = Refusal("tls_failed", "the node closed the TLS session before answering HELLO: "
                                            "its rpcguard refused this certificate (see the node's log)")
        else:
            refusal = hello_closed_refusal(self.facts, self.session.hello_request_len if self.session else None)
        self._refuse_before_active(refusal)

    def _upstream_closed_active(self, ev: UpstreamClosed) -> None:
        self.upstream_open = False
        crashed = ev.crashed
        if crashed is not None and self.session is not None:  # serve runs the server and saw it die
            self.command = self.session.command_name  # the command it was running (audit record)
            self.post_mortem = self.session.post_mortem()
            self._finish("error", crashed.reason, crashed.detail, crashed.party)
            return
        self._finish("error", "upstream_closed", "upstream closed" + (f": {ev.error}" if ev.error else ""))

    def _drained(self, ev: UpstreamClosed) -> None:
        self.upstream_open = False  # CLOSED (the slot is freed on entering it)

    # ----------------------------------------------------------------------------- timers
    def _sample(self, now: float) -> None:
        """What the deadlines by age need from this tick: whether the request frame in progress
        is the one the last tick saw (its age then counts from that tick), and whether the
        session worked since the last tick (the server owed an answer, or the client sent at
        ``min_data_rate_bps``)."""
        session = self.session
        if session is None or not self.greeted:
            self._tick_t, self._tick_rx, self.working_t = now, self.rx_bytes, now
            return
        rx = self.rx_bytes
        if session.mid_frame and not self.client_held_back:
            if not self.frame_t:
                self.frame_t, self.frame_rx = now, rx
        else:
            self.frame_t = 0.0
        owed = not session.idle and not session.mid_frame  # a response owed or streaming
        if not (self.others_waiting and self.slot_held):
            self.wait_t = 0.0
        elif not self.wait_t:
            self.wait_t, self.busy_waited, self.flops_at_wait = now, 0.0, session.state.compute_flops
        elif rx != self._tick_rx or session.mid_frame or owed or self.client_blocked_since or self.client_held_back:
            # Busy since the last tick (bytes came, a frame is in progress, an answer is owed or
            # streaming, or flow control holds either side): the whole interval counts, however
            # slowly the bytes came.
            self.busy_waited += now - self._tick_t
        rate = self.limits.min_data_rate_bps
        if (owed and not self.client_blocked_since) or self.client_held_back or (
                rx - self._tick_rx >= rate * (now - self._tick_t) > 0) or (not rate and rx != self._tick_rx):
            self.working_t = now
        self._tick_t, self._tick_rx = now, rx

    def _tick(self, ev: Tick) -> None:
        now = self.now_s
        self._sample(now)
        missed = overdue(self, now)
        if missed is None:
            return
        refusal, answer = missed
        if answer:
            self.refusal = refusal
            self._answer_refusal()
        else:  # a hung server is the session's error, not a refusal (reasons.SESSION_ERROR_REASONS)
            if refusal.reason == "upstream_hung" and self.session is not None:
                self.post_mortem = self.session.post_mortem()
            self._finish("error" if refusal.reason == "upstream_hung" else "refused", refusal.reason, refusal.detail,
                         refusal.party)

    def _drain_data(self, data: memoryview, now_ns: int) -> Output:
        """What the server still sends after the session ended is dropped; it is progress."""
        self.t_drained = self.clock()
        self.out.clear()
        return self.out

    def _tick_drain(self, ev: Tick) -> None:
        now = self.now_s
        if now - self.t_drained > UPSTREAM_DRAIN_S or now - self.t_drain > UPSTREAM_DRAIN_MAX_S:
            self.upstream_open = False  # CLOSED (the slot is freed on entering it)
            self.actions.append(AbortUpstream())

    # ----------------------------------------------------------------------------- the end
    def _shutdown(self, ev: Shutdown) -> None:
        self._finish("refused", "shutdown", "drain timeout reached")

    def _internal_error(self, ev: InternalError) -> None:
        self._finish("error", "internal_error", "internal error (logged)")

    def tls_failure(self, reason: str) -> None:
        """Count a failed TLS handshake (or a node's alert after it) under ``reason``."""
        self.actions.append(CountTlsFailure(reason))

    def _ignore(self, ev: Event) -> None:
        pass

    def _finish(self, result: str, reason: str, detail: str, party: str | None = None) -> None:
        """End the session: record how, close the client; the state-triggered rule then moves
        the link to DRAINING (serve's upstream open) or CLOSED, whose entry releases the
        upstream and the slot, and the audit record follows. ``party``: who is at fault (the
        Refusal's, else the reason's row in errors.PARTY_OF_REASON)."""
        self.result, self.reason = result, reason
        self.party = party if party is not None else (party_of(reason) if reason else "")
        session = self.session
        if (self.notices and result in ("refused", "error") and reason and not self._client_cut
                and session is not None and self.greeted and session.at_response_boundary):
            self.actions.append(WriteClient(encode_notice(reason, detail)))  # why, before the close
        self.actions.append(CloseClient())
        unverified = self.session.state.unverified_uses if self.session is not None else {}
        if unverified:  # ops the site allowed without a verified rule: counted, and in the log line
            detail = f"{detail} unverified_ops={','.join(f'{op}:{n}' for op, n in sorted(unverified.items()))}"
        self.detail = detail
        self._record_due = True

    def audit_record(self) -> dict[str, object]:
        """The per-session audit record (one per session, logged at its end)."""
        return audit_record(self)


# ----------------------------------------------------------------------------- the handlers
E = TypeVar("E")


def on(event: type[E], handler: Callable[[Lifecycle, E], None]) -> tuple[type, Callable[[Lifecycle, Any], None]]:
    """One handler registration: mypy checks that ``handler`` takes ``event``'s class."""
    return event, handler


L = Lifecycle
# What every state does with each event unless its own row below says otherwise.
_DEFAULT = dict([
    on(Accepted, L._accepted), on(Admit, L._ignore), on(HandshakeFailed, L._ignore), on(Rejected, L._ignore),
    on(SlotGranted, L._free_granted_slot), on(SlotRefused, L._ignore), on(UpstreamConnected, L._close_new_upstream),
    on(UpstreamFailed, L._ignore), on(ClientClosed, L._client_closed), on(UpstreamClosed, L._ignore),
    on(Tick, L._tick), on(Shutdown, L._shutdown), on(InternalError, L._internal_error), on(Refused, L._refused),
    on(ClientBlocked, L._client_blocked), on(UpstreamBlocked, L._upstream_blocked), on(GraphValidated, L._ignore),
    on(Hello, L._ignore), on(Active, L._ignore), on(NodeRefused, L._node_refused), on(NodeEnded, L._node_ended),
    on(Violation, L._violation),
    on(Deferred, L._ignore),
])  # fmt: skip
_OVER = [  # a session that is over ignores what would end it
    on(ClientClosed, L._ignore), on(Shutdown, L._ignore), on(InternalError, L._ignore), on(Refused, L._ignore),
    on(NodeRefused, L._ignore), on(NodeEnded, L._ignore), on(Violation, L._ignore),
]
_UPSTREAM_LOST_ACTIVE = on(UpstreamClosed, L._upstream_closed_active)
_HANDLERS: Mapping[LinkState, Mapping[type, Callable[[Lifecycle, Any], None]]] = {
    state: {**_DEFAULT, **dict(rows)} for state, rows in {
        HANDSHAKE: [on(Admit, L._admit), on(HandshakeFailed, L._handshake_failed), on(Rejected, L._rejected)],
        AWAIT_HELLO: [],
        REFUSING: [on(Hello, L._answer_at_hello)],
        QUEUED: [on(SlotGranted, L._slot_granted), on(SlotRefused, L._refuse_early)],
        CONNECTING: [on(UpstreamConnected, L._upstream_connected), on(UpstreamFailed, L._refuse_early)],
        GREETING: [on(UpstreamClosed, L._upstream_closed_early)],
        ACTIVE: [_UPSTREAM_LOST_ACTIVE],
        VALIDATING: [_UPSTREAM_LOST_ACTIVE],
        DRAINING: [*_OVER, on(UpstreamClosed, L._drained), on(Tick, L._tick_drain)],
        CLOSED: [*_OVER, on(Tick, L._ignore)],
    }.items()
}  # fmt: skip
# The table's next state of every event in every state (None: it stays), looked up per event.
_NEXT: Mapping[LinkState, Mapping[type, LinkState | Rule | None]] = {
    state: {event: TABLE[state].get(event) for event in EVENTS} for state in STATES
}
# Entering a state: its work, whichever event led there.
_ENTER: Mapping[LinkState, Callable[[Lifecycle], None]] = {
    **{state: L._enter_nothing for state in STATES},
    CONNECTING: L._enter_connecting, QUEUED: L._enter_queued, REFUSING: L._enter_refusing,
    VALIDATING: L._enter_validating, DRAINING: L._enter_draining, CLOSED: L._enter_closed,
}  # fmt: skip
# The data handlers of each state (client, server), bound per transition: GREETING/ACTIVE bind
# the session's own methods (the hot path: no wrapper call).
_DATA: Mapping[LinkState, tuple[str, str]] = {
    HANDSHAKE: ("_drop", "_drop"), AWAIT_HELLO: ("_client_early", "_drop"), REFUSING: ("_client_refusing", "_drop"),
    QUEUED: ("_client_early", "_drop"), CONNECTING: ("_client_early", "_drop"), GREETING: ("_feed_c", "_feed_s"),
    ACTIVE: ("_feed_c", "_feed_s"), VALIDATING: ("_feed_c", "_feed_s"), DRAINING: ("_drop", "_drain_data"),
    CLOSED: ("_drop", "_drop"),
}  # fmt: skip
del L
