"""The life of one proxied connection as a sans-IO state machine (h11 style).

Stays whole (over 400 lines): it is one class whose handlers share the link's fields; its tables
are apart already (linkstate.py), as are the deadline, admission and audit rules (endings.py) and
what serve and connect differ in (side.py).

How this works: ``Lifecycle`` is told what happened to a link (events in: the TLS handshake
done with an identity, bytes from either side, the upstream slot granted or refused, the
upstream connected or failed, either side closed, ``tick(now)``, shutdown) and answers with
what the relay must do (actions out, appended to ``actions``: write, open the upstream, take or
free the slot, half-close, close, count, and the audit record at the end). It never touches a
socket or a clock of its own: the relay carries out the actions, the clock is injected.

States (protocol/linkstate.py: ``EDGES`` lists the allowed transitions, ``TABLE`` the
handler of every event in every state; an event a state does not expect is ignored by name)::

    HANDSHAKE --admit--> AWAIT_HELLO (serve: the slot is taken only once the client said HELLO)
              \\-------> CONNECTING  (connect: the node is dialled at once)
              \\-------> REFUSING    (refused before the HELLO: answered 0.0.N when it comes)
    AWAIT_HELLO --HELLO--> QUEUED --slot--> CONNECTING --connected--> GREETING --reply--> ACTIVE
    ACTIVE --end--> DRAINING (serve: upstream half-closed, read until it hangs up, slot kept)
    any --end--> CLOSED

A refusal before ACTIVE is answered at the client's HELLO with version 0.0.N (llama.cpp then
reports a version mismatch instead of a crashed server), whatever the HELLO era; a refusal
during ACTIVE closes both sides. Timeouts come from the ``Limits`` of the session's profile:
``route.default`` until the identity is authorized, then the profile of that identity.

Hot path: ``_goto`` binds ``client_data`` / ``server_data`` to the state's handlers once per
transition; in GREETING and ACTIVE they are the ``Session``'s own methods. The feed contract is
``client_bytes`` / ``server_bytes`` (and ``graph_validated`` after a deferred graph), the only
way the relay feeds a session: a ``Refusal`` raised goes to ``refused()``, a non-empty
``out.events`` to ``session_events()``; then the caller sends the frames in ``out`` and carries
out ``actions``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

from rpcguard.errors import FirewallRefusal, Refusal, party_of
from rpcguard.protocol.endings import UPSTREAM_DRAIN_MAX_S, UPSTREAM_DRAIN_S, admission_refusal, audit_record, hello_closed_refusal, overdue
from rpcguard.protocol.linkstate import (
    ABORT_UPSTREAM, ACTIVE, AWAIT_HELLO, CLOSE_CLIENT, CLOSE_UPSTREAM, CLOSED, CONNECTING, COUNT_TLS_FAILURE,
    COUNT_VIOLATION, DRAINING, EDGES, END, ENDS, EVENTS, FREE_SLOT, GREETING, HALF_CLOSE_UPSTREAM, HANDSHAKE,
    OPEN_UPSTREAM, QUEUED, REFUSING, STATES, TABLE, TAKE_SLOT, VALIDATE, WRITE_CLIENT, WRITE_UPSTREAM, Action,
    LinkState,
    table_markdown,
)
from rpcguard.protocol.side import Side
from rpcguard.protocol.session import GREETED, HELLO_FORWARDED, Output, Session, Violation
from rpcguard.protocol.settings import Limits, Profile
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.stats import SessionStats

__all__ = [
    "Lifecycle", "admission_refusal", "STATES", "EVENTS", "UPSTREAM_DRAIN_S",
    "HANDSHAKE", "AWAIT_HELLO", "REFUSING", "QUEUED", "CONNECTING", "GREETING", "ACTIVE", "DRAINING",
    "CLOSED", "TABLE", "table_markdown", "WRITE_CLIENT", "WRITE_UPSTREAM", "OPEN_UPSTREAM", "TAKE_SLOT", "FREE_SLOT",
    "HALF_CLOSE_UPSTREAM", "CLOSE_CLIENT", "CLOSE_UPSTREAM", "ABORT_UPSTREAM", "COUNT_TLS_FAILURE",
    "COUNT_VIOLATION", "VALIDATE", "END",
]  # fmt: skip


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
        self.result = self.reason = self.detail = self.party = ""
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
        self.others_waiting = 0  # serve: sessions queued for this one's upstream slot
        self.slot_held = False
        # The fair slot's share (endings.overdue, hold_while_waiting_s): the tick that first saw
        # another session wait while this one held the slot (0.0: nobody waits), the seconds of
        # busy ticks since, and the session's estimated compute (flop) at that tick.
        self.wait_t = 0.0
        self.busy_waited = 0.0
        self.flops_at_wait = 0
        self.upstream_open = False
        self.upstream_exit: Refusal | None = None  # the server serve runs died under the session (upstream/pool.py)
        self.post_mortem: dict[str, object] | None = None  # ...and what the session sent last (Session.post_mortem)
        self.t_drain = 0.0  # when the drain began
        self.t_drained = 0.0  # when the server last sent something during it
        self._pending: list[bytes] = []  # client bytes accepted before the upstream connected
        self._feed_c: Callable[[memoryview, int], Output] = self._drop  # the session's, once admitted
        self._feed_s: Callable[[memoryview, int], Output] = self._drop
        self.state = HANDSHAKE
        self._then: frozenset[LinkState] = frozenset()  # where the event being handled may lead
        self._bind()

    # ----------------------------------------------------------------------------- dispatch
    def _goto(self, state: LinkState) -> None:
        if state not in self._then:
            raise AssertionError(f"link {self.id}: no transition {self.state} -> {state} here")
        self.state = state
        self._bind()

    def _bind(self) -> None:
        # The data handlers of this state, bound once per transition (the per-read path).
        row = TABLE[self.state]
        self.client_data: Callable[[memoryview, int], Output] = getattr(self, row["client_data"].handler)
        self.server_data: Callable[[memoryview, int], Output] = getattr(self, row["server_data"].handler)

    def _on(self, event: str, *args: object) -> None:
        handler, self._then = _ON[self.state][event]
        handler(self, *args)

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
    def admit(self, profile: Profile, identity: str = "", refusal: Refusal | None = None,
              identity_refused: bool = False, probe: bool = False) -> None:
        """Accepted (connect) or TLS done (serve) with ``identity``; ``refusal`` if the identity or
        the admission check (sessions, shutdown) said no; ``profile`` is the session's from now on;
        ``probe``: the client said it is a probe."""
        self._on("admit", profile, identity, refusal, identity_refused, probe)

    def handshake_failed(self, result: str, reason: str, detail: str) -> None:
        self._on("handshake_failed", result, reason, detail)

    def rejected(self, refusal: Refusal) -> None:
        """Refused at accept, before any TLS (serve's cap on handshakes per source): closed."""
        self._on("rejected", refusal)

    def slot_granted(self) -> None:
        self._on("slot_granted")

    def slot_refused(self, refusal: Refusal) -> None:
        self._on("slot_refused", refusal)

    def upstream_connected(self) -> None:
        self._on("upstream_connected")

    def upstream_failed(self, refusal: Refusal) -> None:
        self._on("upstream_failed", refusal)

    def client_closed(self, error: str = "") -> None:
        self._on("client_closed", error)

    def upstream_closed(self, error: str = "", tls_reason: str | None = None) -> None:
        """The upstream hung up (``error``: why, if it was an error; ``tls_reason``: the
        classified TLS alert when it was one)."""
        self._on("upstream_closed", error, tls_reason)

    def tick(self, now: float, others_waiting: int = 0) -> None:
        """Enforce the deadlines of the current state (the relay calls this every second);
        ``others_waiting``: sessions queued for the upstream slot this one may hold."""
        self.others_waiting = others_waiting
        self._on("tick", now)

    def shutdown(self) -> None:
        """The drain timeout is reached: end the session now."""
        self._on("shutdown")

    def internal_error(self) -> None:
        self._on("internal_error")

    def client_blocked(self, blocked: bool) -> None:
        """The client's write buffer filled up (it is not reading its responses) or drained."""
        self.client_blocked_since = self.clock() if blocked else 0.0

    # ----------------------------------------------------------------------------- set-up
    def _admit(self, profile: Profile, identity: str, refusal: Refusal | None, identity_refused: bool,
               probe: bool = False) -> None:
        self.probe = probe
        self.profile = profile
        self.identity = identity
        self.t_admitted = self.clock()
        self.session = Session(profile.policy, self.facts, self.stats)
        self.out = self.session.out
        self._feed_c = self.session.client_data
        self._feed_s = self.session.server_data
        if refusal is not None:
            self.refusal = refusal
            self.refused_on_leave = identity_refused
            self._goto(REFUSING)
        elif self.side.takes_slot:
            self._goto(AWAIT_HELLO)
        else:
            self._goto(CONNECTING)
            self.actions.append((OPEN_UPSTREAM, self.limits))

    def _rejected(self, refusal: Refusal) -> None:
        self._finish("refused", refusal.reason, refusal.detail, refusal.party)

    def _handshake_failed(self, result: str, reason: str, detail: str) -> None:
        if result == "refused":
            self.tls_failure(reason)
        self._finish(result, reason, detail)

    def _slot_granted(self) -> None:
        self.slot_held = True
        self._goto(CONNECTING)
        self.actions.append((OPEN_UPSTREAM, self.limits))

    def _free_granted_slot(self) -> None:
        # The session ended while it queued: hand the slot straight back.
        self.actions.append((FREE_SLOT, None))

    def _upstream_connected(self) -> None:
        self.upstream_open = True
        self.t_upstream = self.clock()
        self._goto(GREETING)
        if self._pending:
            self.actions.append((WRITE_UPSTREAM, self._pending))
            self._pending = []

    def _close_new_upstream(self) -> None:
        self.actions.append((CLOSE_UPSTREAM, None))

    def _refuse_early(self, refusal: Refusal) -> None:
        """Refused before ACTIVE: answer now if the HELLO is waiting, else when it comes."""
        self.refusal = refusal
        session = self.session
        if session is not None and session.phase == HELLO_FORWARDED:
            self._answer_refusal()
            return
        self._release_upstream()
        if self.slot_held:
            self.actions.append((FREE_SLOT, None))
            self.slot_held = False
        self._goto(REFUSING)

    def _answer_refusal(self) -> None:
        refusal = self.refusal
        assert refusal is not None and self.session is not None
        self.out.clear()
        self.actions.append((WRITE_CLIENT, self.session.refusal_answer(refusal.reason)))
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

    def client_bytes(self, data: memoryview, now_ns: int) -> Output:
        """``client_data`` with the whole contract: a refusal reported, the events handled, the
        bytes counted (``rx_bytes``)."""
        self.rx_bytes += len(data)
        return self._fed(self.client_data, data, now_ns)

    def server_bytes(self, data: memoryview, now_ns: int) -> Output:
        """``server_data`` with the whole contract (see ``client_bytes``)."""
        return self._fed(self.server_data, data, now_ns)

    def graph_validated(self, now_ns: int) -> Output:
        """After the VALIDATE action ran ``Session.validate_deferred``: the graph's verdict and the
        bytes that followed it, with the whole contract (see ``client_bytes``)."""
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
        for kind, value in events:
            self._on(kind, value)
            if self.state in ENDS:
                return  # the link is over: later events do not matter

    def _ev_validate(self, nbytes: int) -> None:
        """A large graph waits for its validation (Session.validate_deferred): the relay runs it
        off the event loop and holds both sides' reads meanwhile, then calls ``resume_deferred``."""
        self.actions.append((VALIDATE, None))

    def _ev_violation(self, v: Violation) -> None:
        self.actions.append((COUNT_VIOLATION, (v.reason, "monitor", v, v.command)))

    def _ev_hello(self, length: int) -> None:
        self._goto(QUEUED)
        # A probe never waits for a busy upstream: it is answered "busy" at once (upstream_busy).
        self.actions.append((TAKE_SLOT, replace(self.limits, upstream_busy="refuse") if self.probe
                             else self.limits))

    def _answer_at_hello(self, length: int) -> None:
        self._answer_refusal()

    def _ev_active(self, version: object) -> None:
        self._goto(ACTIVE)

    def _ev_ignore(self, value: object) -> None:
        pass

    def _ev_node_refused(self, reason: str) -> None:
        # The node's rpcguard refused the session: its 0.0.N answer is forwarded as is.
        self.refusal = Refusal(reason, "refused by the node")
        self._finish("refused", "node_refused", f"node refused the session: {reason}")

    def refused(self, refusal: Refusal) -> None:
        """The session refused a frame (either side): the caller hands over what ``client_data`` /
        ``server_data`` raised."""
        self._on("refused", refusal)

    def _refused(self, refusal: Refusal) -> None:
        session = self.session
        assert session is not None
        self.command = session.command_name
        self.out.clear()
        if isinstance(refusal, FirewallRefusal):
            self.actions.append((COUNT_VIOLATION, (refusal.reason, "enforce", None, self.command)))
        if session.phase != GREETED and session.hello_request_len is not None:
            if self.refusal is None:  # else: a refusal already waited for this HELLO, say that one
                self.refusal = refusal
            self._answer_refusal()
        else:
            self._finish("refused", refusal.reason, refusal.detail, refusal.party)

    # ----------------------------------------------------------------------------- closes
    def _client_closed(self, error: str) -> None:
        if self.refused_on_leave and self.refusal is not None:
            self._finish("refused", self.refusal.reason, self.refusal.detail, self.refusal.party)  # left before its HELLO
            return
        s = self.session
        clean = s is None or s.idle or (s.phase == GREETED and not s.mid_frame)
        said_hello = s is not None and s.hello_request_len is not None
        result = "error" if not clean else "probe" if self.probe else "ok" if said_hello else "no_hello"
        self._finish(result, "" if clean else "client_closed_mid_frame",
                     "client closed" + (f": {error}" if error else "") + ("" if said_hello or not clean else
                                                                          " before its HELLO"))

    def _upstream_closed_early(self, error: str, tls_reason: str | None) -> None:
        """The upstream hung up before the session was active: the client still gets its 0.0.N."""
        self.upstream_open = False
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
        self._refuse_early(refusal)

    def _upstream_closed_active(self, error: str, tls_reason: str | None) -> None:
        self.upstream_open = False
        if self.upstream_exit is not None:  # serve runs the server and saw it die under this session
            self._finish("error", self.upstream_exit.reason, self.upstream_exit.detail, self.upstream_exit.party)
            return
        self._finish("error", "upstream_closed", "upstream closed" + (f": {error}" if error else ""))

    def _drained(self, error: str, tls_reason: str | None) -> None:
        self.upstream_open = False
        self._end_drain()

    def _end_drain(self) -> None:
        if self.slot_held:
            self.actions.append((FREE_SLOT, None))
            self.slot_held = False
        self._goto(CLOSED)

    def _release_upstream(self) -> None:
        """Refused before the HELLO: the upstream (connect's node) is of no more use."""
        if self.upstream_open:
            self.upstream_open = False
            self.actions.append((CLOSE_UPSTREAM, None))

    # ----------------------------------------------------------------------------- timers
    def _sample(self, now: float) -> None:
        """What the deadlines by age need from this tick: whether the request frame in progress
        is the one the last tick saw (its age then counts from that tick), and whether the
        session worked since the last tick (the server owed an answer, or the client sent at
        ``min_data_rate_bps``)."""
        session = self.session
        if session is None or session.phase != GREETED:
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

    def _tick(self, now: float) -> None:
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

    def _tick_drain(self, now: float) -> None:
        if now - self.t_drained > UPSTREAM_DRAIN_S or now - self.t_drain > UPSTREAM_DRAIN_MAX_S:
            self.upstream_open = False
            self.actions.append((ABORT_UPSTREAM, None))
            self._end_drain()

    # ----------------------------------------------------------------------------- the end
    def _shutdown(self) -> None:
        self._finish("refused", "shutdown", "drain timeout reached")

    def _internal_error(self) -> None:
        self._finish("error", "internal_error", "internal error (logged)")

    def tls_failure(self, reason: str) -> None:
        """Count a failed TLS handshake (or a node's alert after it) under ``reason``."""
        self.actions.append((COUNT_TLS_FAILURE, reason))

    def _ignore(self, *args: object) -> None:
        pass

    def _finish(self, result: str, reason: str, detail: str, party: str | None = None) -> None:
        """End the session: close the client, drain (serve) or close the upstream, free the
        slot unless the drain keeps it, and hand out the audit record. ``party``: who is at fault
        (the Refusal's, else the reason's row in errors.PARTY_OF_REASON)."""
        self.result, self.reason = result, reason
        self.party = party if party is not None else (party_of(reason) if reason else "")
        actions = self.actions
        actions.append((CLOSE_CLIENT, None))
        drain = self.upstream_open and self.side.drains_upstream
        if drain:
            actions.append((HALF_CLOSE_UPSTREAM, self.slot_held))
            self.t_drain = self.t_drained = self.clock()
            self._goto(DRAINING)
        else:
            if self.upstream_open:
                self.upstream_open = False
                # close() flushes what is queued; an error aborts.
                actions.append((ABORT_UPSTREAM if result == "error" else CLOSE_UPSTREAM, None))
            if self.slot_held:
                actions.append((FREE_SLOT, None))
                self.slot_held = False
            self._goto(CLOSED)
        unverified = self.session.state.unverified_uses if self.session is not None else {}
        if unverified:  # ops the site allowed without a verified rule: counted, and in the log line
            detail = f"{detail} unverified_ops={','.join(f'{op}:{n}' for op, n in sorted(unverified.items()))}"
        self.detail = detail
        actions.append((END, self.audit_record()))

    def audit_record(self) -> dict[str, object]:
        """The per-session audit record (one per session, logged at its end)."""
        return audit_record(self)


# linkstate.TABLE names Lifecycle methods; resolved once, here, so a name that is not a method
# fails at import and an event costs no attribute lookup by name. The data events are bound per
# state by _goto instead (GREETING/ACTIVE bind the session's own methods).
_DATA_EVENTS = ("client_data", "server_data")
_ON: Mapping[LinkState, Mapping[str, tuple[Callable[..., None], frozenset[LinkState]]]] = {
    state: {event: (getattr(Lifecycle, row.handler), row.then) for event, row in rows.items()
            if event not in _DATA_EVENTS}
    for state, rows in TABLE.items()
}
