"""The life of one proxied connection as a sans-IO state machine (h11 style).

How this works: ``Lifecycle`` is told what happened to a link (events in: the TLS handshake
done with an identity, bytes from either side, the upstream slot granted or refused, the
upstream connected or failed, either side closed, ``tick(now)``, shutdown) and answers with
what the relay must do (actions out, appended to ``actions``: write, open the upstream, take or
free the slot, half-close, close, count, and the audit record at the end). It never touches a
socket or a clock of its own: the relay carries out the actions, the clock is injected.

States (``_EDGES`` lists the allowed transitions, ``_TABLE`` the handler of every event in
every state; an event a state does not expect is ignored by name, ``_ignore``)::

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

Hot path: in ACTIVE the bound handlers ``client_data``/``server_data`` hand the bytes straight
to the ``Session`` and return its ``Output``; the only per-read extra is one test of its event
list. ``_goto`` rebinds the two handlers on every transition, so no table lookup is paid per read.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from rpcguard.errors import FirewallRefusal, Refusal
from rpcguard.protocol.session import (
    ACTIVE as SESSION_ACTIVE,
    AWAIT_HELLO_REPLY,
    EV_ACTIVE,
    EV_HELLO,
    EV_NODE_REFUSED,
    EV_VIOLATION,
    Output,
    Session,
)
from rpcguard.protocol.settings import Limits, Profile
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.stats import SessionStats
from rpcguard.protocol.versions import format_version, spec_for

__all__ = [
    "Lifecycle", "admission_refusal", "STATES", "EVENTS", "UPSTREAM_DRAIN_S",
    "HANDSHAKE", "AWAIT_HELLO", "REFUSING", "QUEUED", "CONNECTING", "GREETING", "ACTIVE", "DRAINING",
    "CLOSED", "WRITE_CLIENT", "WRITE_UPSTREAM", "OPEN_UPSTREAM", "TAKE_SLOT", "FREE_SLOT",
    "HALF_CLOSE_UPSTREAM", "CLOSE_CLIENT", "CLOSE_UPSTREAM", "ABORT_UPSTREAM", "COUNT_TLS_FAILURE",
    "COUNT_VIOLATION", "END",
]  # fmt: skip

# serve: a finished session's upstream is half-closed and read until the server hangs up
# (ggml-rpc-server dies of SIGPIPE on a response written to a closed connection); past this
# long it is aborted. The server hangs up once it has answered the command it is running.
UPSTREAM_DRAIN_S = 5.0

# ---------------------------------------------------------------------------------- states
HANDSHAKE = "handshake"  # accepted; serve: TLS handshake running
AWAIT_HELLO = "await_hello"  # admitted (serve): waiting for the client's HELLO before the slot
REFUSING = "refusing"  # refused before the client's HELLO: waiting for it to answer 0.0.N
QUEUED = "queued"  # HELLO received, waiting for the upstream slot
CONNECTING = "connecting"  # the upstream is being dialled; client bytes are kept meanwhile
GREETING = "greeting"  # upstream connected, the HELLO exchange not finished
ACTIVE = "active"  # the session runs: bytes go straight through the Session
DRAINING = "draining"  # over; serve's upstream half-closed and read until it hangs up
CLOSED = "closed"
STATES: tuple[str, ...] = (HANDSHAKE, AWAIT_HELLO, REFUSING, QUEUED, CONNECTING, GREETING, ACTIVE,
                           DRAINING, CLOSED)  # fmt: skip

# ---------------------------------------------------------------------------------- events
EVENTS: tuple[str, ...] = (
    "admit", "handshake_failed", "client_data", "server_data", "slot_granted", "slot_refused",
    "upstream_connected", "upstream_failed", "client_closed", "upstream_closed", "tick", "shutdown",
    "internal_error",
)  # fmt: skip

# ---------------------------------------------------------------------------------- actions
# (kind, argument) tuples in ``Lifecycle.actions``, carried out in order by the relay.
WRITE_CLIENT = "write_client"  # bytes: a refusal answer
WRITE_UPSTREAM = "write_upstream"  # list[bytes]: client bytes kept while the upstream was dialled
OPEN_UPSTREAM = "open_upstream"  # None: dial; answer with upstream_connected / upstream_failed
TAKE_SLOT = "take_slot"  # Limits: queue for the upstream slot; answer slot_granted / slot_refused
FREE_SLOT = "free_slot"  # None
HALF_CLOSE_UPSTREAM = "half_close_upstream"  # bool (slot held): write EOF, keep reading
CLOSE_CLIENT = "close_client"  # None: close after flushing what is queued
CLOSE_UPSTREAM = "close_upstream"  # None
ABORT_UPSTREAM = "abort_upstream"  # None
COUNT_TLS_FAILURE = "tls_failure"  # str: reason
COUNT_VIOLATION = "violation"  # (reason, mode, Violation | None, command): a firewall rule failed
END = "end"  # dict: the audit record (the session is over for metrics and logs)

Action = tuple[str, object]

# Allowed transitions: _goto refuses any other (a bug, not a peer's doing).
_EDGES: Mapping[str, frozenset[str]] = {
    HANDSHAKE: frozenset({AWAIT_HELLO, REFUSING, CONNECTING, CLOSED}),
    AWAIT_HELLO: frozenset({QUEUED, REFUSING, CLOSED}),
    REFUSING: frozenset({CLOSED}),
    QUEUED: frozenset({CONNECTING, REFUSING, CLOSED}),
    CONNECTING: frozenset({GREETING, REFUSING, CLOSED}),
    GREETING: frozenset({ACTIVE, REFUSING, DRAINING, CLOSED}),
    ACTIVE: frozenset({DRAINING, CLOSED}),
    DRAINING: frozenset({CLOSED}),
    CLOSED: frozenset(),
}

# The handler (a method name) of every event in every state.
_COMMON = {"admit": "_ignore", "handshake_failed": "_ignore", "client_data": "_drop", "server_data": "_drop",
           "slot_granted": "_free_granted_slot", "slot_refused": "_ignore",
           "upstream_connected": "_close_new_upstream", "upstream_failed": "_ignore",
           "client_closed": "_client_closed", "upstream_closed": "_ignore", "tick": "_tick",
           "shutdown": "_shutdown", "internal_error": "_internal_error"}  # fmt: skip
_TABLE: Mapping[str, Mapping[str, str]] = {
    HANDSHAKE: {**_COMMON, "admit": "_admit", "handshake_failed": "_handshake_failed"},
    AWAIT_HELLO: {**_COMMON, "client_data": "_client_early"},
    REFUSING: {**_COMMON, "client_data": "_client_early"},
    QUEUED: {**_COMMON, "client_data": "_client_early", "slot_granted": "_slot_granted",
             "slot_refused": "_refuse_early"},
    CONNECTING: {**_COMMON, "client_data": "_client_early", "upstream_connected": "_upstream_connected",
                 "upstream_failed": "_refuse_early"},
    GREETING: {**_COMMON, "client_data": "_client_greeting", "server_data": "_server_greeting",
               "upstream_closed": "_upstream_closed_early"},
    ACTIVE: {**_COMMON, "client_data": "_client_active", "server_data": "_server_active",
             "upstream_closed": "_upstream_closed_active"},
    DRAINING: {**_COMMON, "client_closed": "_ignore", "upstream_closed": "_drained", "tick": "_tick_drain",
               "shutdown": "_ignore", "internal_error": "_ignore"},
    CLOSED: {**_COMMON, "client_closed": "_ignore", "tick": "_ignore", "shutdown": "_ignore",
             "internal_error": "_ignore"},
}  # fmt: skip


def admission_refusal(default: Profile, profile: Profile, admitted: Iterable[Profile]) -> Refusal | None:
    """``too_many_sessions`` when the admitted links (this one included) exceed the listener's
    ``max_sessions`` or, among those holding a profile of this name, the profile's own."""
    total = same = 0
    for held in admitted:
        total += 1
        same += held.name == profile.name
    if total > default.limits.max_sessions:
        return Refusal("too_many_sessions", f"more than {default.limits.max_sessions} sessions")
    if same > profile.limits.max_sessions:
        return Refusal("too_many_sessions", f"more than {profile.limits.max_sessions} sessions of profile "
                                            f"{profile.name}")
    return None


class Lifecycle:
    """One link from accept to close; see the module docstring."""

    def __init__(self, *, link_id: int, role: str, listener: str, upstream: str, default: Profile,
                 facts: UpstreamFacts, clock: Callable[[], float], uses_slot: bool) -> None:
        self.id = link_id
        self.role = role  # "serve" or "connect"
        self.listener = listener
        self.upstream = upstream  # "host:port", for logs
        self.profile = default  # replaced by the identity's profile once it is authorized
        self.facts = facts
        self.clock = clock
        self.uses_slot = uses_slot  # serve: the single-client upstream is taken at HELLO
        self.peer = "-"
        self.identity = ""
        self.stats = SessionStats()
        self.session: Session | None = None  # built at admission, from the profile's policy
        self.out = Output()  # the session's, once there is one
        self.actions: list[Action] = []
        self.refusal: Refusal | None = None  # refused before ACTIVE: answered at HELLO
        self.refused_on_leave = False  # identity refused: a client leaving before HELLO is a refusal
        self.result = self.reason = self.detail = ""
        self.command = "-"  # command of the frame that was refused
        self.t0 = clock()
        self.t_admitted: float | None = None
        self.t_upstream = 0.0
        self.last_activity_ns = int(self.t0 * 1e9)
        self.client_blocked_since = 0.0  # the client's write buffer is full (flow control)
        self.slot_held = False
        self.upstream_open = False
        self.t_drain = 0.0
        self._pending: list[bytes] = []  # client bytes accepted before the upstream connected
        self._feed_c: Callable[[memoryview, int], Output] = self._drop  # the session's, once admitted
        self._feed_s: Callable[[memoryview, int], Output] = self._drop
        self.state = ""
        self._goto(HANDSHAKE)

    # ----------------------------------------------------------------------------- dispatch
    def _goto(self, state: str) -> None:
        if self.state and state not in _EDGES[self.state]:
            raise AssertionError(f"link {self.id}: no transition {self.state} -> {state}")
        self.state = state
        row = _TABLE[state]
        # The data handlers of this state, bound once per transition (the per-read path).
        self.client_data: Callable[[memoryview, int], Output] = getattr(self, row["client_data"])
        self.server_data: Callable[[memoryview, int], Output] = getattr(self, row["server_data"])

    def _on(self, event: str, *args: object) -> None:
        getattr(self, _TABLE[self.state][event])(*args)

    @property
    def limits(self) -> Limits:
        return self.profile.limits

    @property
    def admitted(self) -> bool:
        return self.t_admitted is not None

    # ----------------------------------------------------------------------------- events in
    def admit(self, profile: Profile, identity: str = "", refusal: Refusal | None = None,
              identity_refused: bool = False) -> None:
        """Accepted (connect) or TLS done (serve) with ``identity``; ``refusal`` if the identity or
        the admission check (sessions, shutdown) said no; ``profile`` is the session's from now on."""
        self._on("admit", profile, identity, refusal, identity_refused)

    def handshake_failed(self, result: str, reason: str, detail: str) -> None:
        self._on("handshake_failed", result, reason, detail)

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

    def tick(self, now: float) -> None:
        """Enforce the deadlines of the current state (the relay calls this every second)."""
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
    def _admit(self, profile: Profile, identity: str, refusal: Refusal | None, identity_refused: bool) -> None:
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
        elif self.uses_slot:
            self._goto(AWAIT_HELLO)
        else:
            self._goto(CONNECTING)
            self.actions.append((OPEN_UPSTREAM, None))

    def _handshake_failed(self, result: str, reason: str, detail: str) -> None:
        if result == "refused":
            self.tls_failure(reason)
        self._finish(result, reason, detail)

    def _slot_granted(self) -> None:
        self.slot_held = True
        self._goto(CONNECTING)
        self.actions.append((OPEN_UPSTREAM, None))

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
        if session is not None and session.phase == AWAIT_HELLO_REPLY:
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
        self._finish("refused", refusal.reason, refusal.detail)

    # ----------------------------------------------------------------------------- data
    def _drop(self, data: memoryview, now_ns: int) -> Output:
        self.out.clear()
        return self.out

    def _client_early(self, data: memoryview, now_ns: int) -> Output:
        """Client bytes before the upstream is connected: checked, kept for the upstream."""
        out = self._feed_client(data, now_ns)
        if out is None:
            return self.out
        if out.to_server:
            if self.state != REFUSING:
                self._pending.extend(bytes(chunk) for chunk in out.to_server)
            out.to_server.clear()
        if out.events:
            self._session_events(out)
        return out

    def _client_greeting(self, data: memoryview, now_ns: int) -> Output:
        out = self._feed_client(data, now_ns)
        if out is None:
            return self.out
        if out.events:
            self._session_events(out)
        return out

    def _server_greeting(self, data: memoryview, now_ns: int) -> Output:
        out = self._feed_server(data, now_ns)
        if out is not None and out.events:
            self._session_events(out)
        return self.out

    def _client_active(self, data: memoryview, now_ns: int) -> Output:
        try:
            out = self._feed_c(data, now_ns)
        except Refusal as refusal:
            self._refused(refusal)
            return self.out
        self.last_activity_ns = now_ns
        if out.events:
            self._session_events(out)
        return out

    def _server_active(self, data: memoryview, now_ns: int) -> Output:
        try:
            out = self._feed_s(data, now_ns)
        except Refusal as refusal:
            self._refused(refusal)
            return self.out
        self.last_activity_ns = now_ns
        if out.events:
            self._session_events(out)
        return out

    def _feed_client(self, data: memoryview, now_ns: int) -> Output | None:
        try:
            out = self._feed_c(data, now_ns)
        except Refusal as refusal:
            self._refused(refusal)
            return None
        self.last_activity_ns = now_ns
        return out

    def _feed_server(self, data: memoryview, now_ns: int) -> Output | None:
        try:
            out = self._feed_s(data, now_ns)
        except Refusal as refusal:
            self._refused(refusal)
            return None
        self.last_activity_ns = now_ns
        return out

    def _session_events(self, out: Output) -> None:
        events = list(out.events)
        out.events.clear()
        for kind, value in events:
            if kind == EV_VIOLATION:
                v = value
                self.actions.append((COUNT_VIOLATION, (v.reason, "monitor", v, v.command)))  # type: ignore[attr-defined]
            elif kind == EV_HELLO:
                if self.state == AWAIT_HELLO:
                    self._goto(QUEUED)
                    self.actions.append((TAKE_SLOT, self.limits))
                elif self.state == REFUSING:
                    self._answer_refusal()
                    return
            elif kind == EV_ACTIVE and self.state == GREETING:
                self._goto(ACTIVE)
            elif kind == EV_NODE_REFUSED:
                # The node's rpcguard refused the session: its 0.0.N answer is forwarded as is.
                self.refusal = Refusal(str(value), "refused by the node")
                self._finish("refused", "node_refused", f"node refused the session: {value}")
                return

    def _refused(self, refusal: Refusal) -> None:
        """The session refused a frame (either side)."""
        session = self.session
        assert session is not None
        self.command = session.command_name
        self.out.clear()
        if isinstance(refusal, FirewallRefusal):
            self.actions.append((COUNT_VIOLATION, (refusal.reason, "enforce", None, self.command)))
        if session.phase != SESSION_ACTIVE and session.hello_request_len is not None:
            if self.refusal is None:  # else: a refusal already waited for this HELLO, say that one
                self.refusal = refusal
            self._answer_refusal()
        else:
            self._finish("refused", refusal.reason, refusal.detail)

    # ----------------------------------------------------------------------------- closes
    def _client_closed(self, error: str) -> None:
        if self.refused_on_leave and self.refusal is not None:
            self._finish("refused", self.refusal.reason, self.refusal.detail)  # left before its HELLO
            return
        s = self.session
        clean = s is None or s.idle or (s.phase == SESSION_ACTIVE and not s.mid_frame)
        self._finish("ok" if clean else "error", "" if clean else "client_closed_mid_frame",
                     "client closed" + (f": {error}" if error else ""))

    def _upstream_closed_early(self, error: str, tls_reason: str | None) -> None:
        """The upstream hung up before the session was active: the client still gets its 0.0.N."""
        self.upstream_open = False
        if tls_reason is not None:
            # TLS 1.3: the node rejects our certificate after the handshake, on the first read.
            self.tls_failure(tls_reason)
            refusal = Refusal("tls_failed", f"the node refused the TLS session ({tls_reason}): {error}")
        elif self.role == "connect":
            # A node's rpcguard answers every HELLO, refusals included: a bare close means its
            # TLS layer dropped us after the handshake (certificate refused).
            self.tls_failure("tls_handshake_failed")
            refusal = Refusal("tls_failed", "the node closed the TLS session before answering HELLO: "
                                            "its rpcguard refused this certificate (see the node's log)")
        else:
            refusal = self._hello_closed_refusal()
        self._refuse_early(refusal)

    def _hello_closed_refusal(self) -> Refusal:
        """The upstream hung up on the HELLO: say why when its version tells (a HELLO of the other era)."""
        known = self.facts.version
        spec = spec_for(known) if known is not None else None
        sent = self.session.hello_request_len if self.session is not None else None
        if known is not None and spec is not None and sent is not None and sent != spec.hello_request:
            era = "pre-4.0.0 (0-byte)" if sent == 0 else ">= 4.0.0 (24-byte)"
            return Refusal("version_not_accepted", f"the client sent a {era} HELLO; the upstream speaks "
                                                   f"{format_version(known)} and closed the connection")
        return Refusal("upstream_unavailable", "upstream closed the connection at HELLO")

    def _upstream_closed_active(self, error: str, tls_reason: str | None) -> None:
        self.upstream_open = False
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
    def _tick(self, now: float) -> None:
        limits = self.limits
        session = self.session
        hello_s = limits.hello_timeout_s
        if session is not None and session.phase != SESSION_ACTIVE and hello_s:
            if session.hello_request_len is None:
                # The clock starts at admission; the TLS handshake has its own timeout.
                if self.t_admitted is not None and now - self.t_admitted > hello_s:
                    self._finish("refused", "hello_timeout", f"no HELLO within {hello_s:g} s")
                    return
            elif self.upstream_open and now - self.t_upstream > hello_s + (
                limits.queue_timeout_s if self.role == "connect" else 0
            ):
                # A server that takes the connection but never answers HELLO. connect's upstream
                # is the node's serve, which may queue the HELLO for its own queue_timeout_s.
                self.refusal = Refusal("upstream_unavailable", "the upstream did not answer HELLO")
                self._answer_refusal()
                return
        if self.state == ACTIVE and session is not None:
            quiet = now - self.last_activity_ns / 1e9
            idle = session.idle
            if limits.idle_timeout_s and idle and quiet > limits.idle_timeout_s:
                self._finish("refused", "idle_timeout", f"idle for {quiet:.0f} s")
                return
            if limits.frame_timeout_s and not idle and quiet > limits.frame_timeout_s and session.mid_frame:
                self._finish("refused", "frame_timeout", f"a request frame stalled for {quiet:.0f} s")
                return
        blocked = self.client_blocked_since
        if limits.frame_timeout_s and blocked and now - blocked > limits.frame_timeout_s:
            # A client that stops reading its responses would hold the single upstream slot forever.
            self._finish("refused", "frame_timeout",
                         f"the client has not read its responses for {now - blocked:.0f} s")
            return
        if limits.max_session_s and now - self.t0 > limits.max_session_s:
            self._finish("refused", "session_lifetime", f"session older than {limits.max_session_s:g} s")

    def _tick_drain(self, now: float) -> None:
        if now - self.t_drain > UPSTREAM_DRAIN_S:
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

    def _finish(self, result: str, reason: str, detail: str) -> None:
        """End the session: close the client, drain (serve) or close the upstream, free the
        slot unless the drain keeps it, and hand out the audit record."""
        self.result, self.reason = result, reason
        actions = self.actions
        actions.append((CLOSE_CLIENT, None))
        drain = self.upstream_open and self.role == "serve"
        if drain:
            actions.append((HALF_CLOSE_UPSTREAM, self.slot_held))
            self.t_drain = self.clock()
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
        s = self.stats
        version = self.session.version if self.session is not None else None
        return {
            "event": "session_end",
            "session": self.id,
            "role": self.role,
            "listener": self.listener,
            "profile": self.profile.name,
            "peer": self.peer,
            "identity": self.identity,
            "upstream": self.upstream,
            "version": format_version(version) if version else None,
            "duration_s": round(self.clock() - self.t0, 6),
            "result": self.result,
            "reason": self.reason or None,
            "command": self.command if self.command != "-" else None,
            "detail": self.detail,
            "alloc_bytes": s.alloc_bytes,
            "upload_bytes": s.upload_bytes_set,
            "hash_hit_bytes": s.upload_bytes_hash_hit,
            "commands": s.per_command(),
        }
