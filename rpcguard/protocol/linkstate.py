"""The link lifecycle's vocabulary and its next-state table: states, typed events and actions.

How this works (h11's ``_state.py`` is the model): a link is in one of the ``LinkState``s. Every
event is a class (a ``NamedTuple``: the relay's, below, and the ``Session``'s, protocol/session.py);
``TABLE`` maps state x event class to the next state, as h11's ``EVENT_TRIGGERED_TRANSITIONS``
does (an event a state does not list leaves it where it is). Where the next state depends on more
than the event, the cell holds a ``Rule`` and ``RULES`` decides it from the link's facts
(``LinkFacts``), as h11's state-triggered transitions do; one rule is state-triggered
and checked after every event: a session that ended (``ended``) goes to DRAINING while serve's
upstream is open, else to CLOSED. The handlers (protocol/lifecycle.py) do the work of an event
and never choose or assign a state: ``Lifecycle`` moves the link, and does the work of entering
a state (dial on CONNECTING, queue on QUEUED, half-close on DRAINING, release on CLOSED).

Actions are classes too: ``Action`` is their union, and the relay registers one handler per class
(proxy/link.py), typed so that mypy rejects a handler of the wrong class, as it rejects an event
handler of the wrong event (tests/unit/protocol/test_lifecycle.py plants both mismatches).
"""

from __future__ import annotations

from enum import Enum
from typing import Final, Mapping, NamedTuple, Protocol, Union

from rpcguard.errors import Refusal
from rpcguard.protocol.session import Active, Deferred, Hello, NodeEnded, NodeRefused, SessionEvent, Violation
from rpcguard.protocol.settings import Limits, Profile
from rpcguard.protocol.side import Side

__all__ = [
    "LinkState", "STATES", "HANDSHAKE", "AWAIT_HELLO", "REFUSING", "QUEUED", "CONNECTING", "GREETING", "ACTIVE",
    "VALIDATING", "DRAINING", "CLOSED", "ENDS",
    "Accepted", "Admit", "HandshakeFailed", "Rejected", "SlotGranted", "SlotRefused", "UpstreamConnected",
    "UpstreamFailed", "ClientClosed", "UpstreamClosed", "Tick", "TICK", "Shutdown", "InternalError", "Refused",
    "ClientBlocked", "UpstreamBlocked", "GraphValidated", "LinkEvent", "Event", "EVENTS",
    "WriteClient", "WriteUpstream", "OpenUpstream", "TakeSlot", "FreeSlot", "HalfCloseUpstream", "CloseClient",
    "CloseUpstream", "AbortUpstream", "CountTlsFailure", "CountViolation", "Validate", "End", "Action", "ACTIONS",
    "Rule", "RULES", "LinkFacts", "TABLE", "EDGES", "ended_to", "table_markdown",
]  # fmt: skip


# ---------------------------------------------------------------------------------- states
class LinkState(str, Enum):
    """Where a link is (a str, so logs and comparisons with the names keep working)."""

    HANDSHAKE = "handshake"  # accepted; serve: TLS handshake running
    AWAIT_HELLO = "await_hello"  # admitted (serve): waiting for the client's HELLO before the slot
    REFUSING = "refusing"  # refused before the client's HELLO: waiting for it to answer 0.0.N
    QUEUED = "queued"  # HELLO received, waiting for the upstream slot
    CONNECTING = "connecting"  # the upstream is being dialled; client bytes are kept meanwhile
    GREETING = "greeting"  # upstream connected, the HELLO exchange not finished
    ACTIVE = "active"  # the session runs: bytes go straight through the Session
    VALIDATING = "validating"  # a large graph is validated off the loop; both sides' reads wait
    DRAINING = "draining"  # over; serve's upstream half-closed and read until it hangs up
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


HANDSHAKE, AWAIT_HELLO, REFUSING, QUEUED, CONNECTING, GREETING, ACTIVE, VALIDATING, DRAINING, CLOSED = LinkState
STATES: tuple[LinkState, ...] = tuple(LinkState)
ENDS: Final = frozenset({DRAINING, CLOSED})  # the session is over


# ---------------------------------------------------------------------------------- events
# The relay's events (proxy/link.py); the Session's are Hello, Active, NodeRefused, Violation and
# Deferred (protocol/session.py), dispatched the same way.
class Accepted(NamedTuple):
    """The socket is accepted: who is at the other end (logs; serve's per-source caps)."""

    peer: str  # "host:port"
    source: str  # the peer's address without the port (an IPv6 host's /64)


class Admit(NamedTuple):
    """Accepted (connect) or TLS done (serve): the identity and the admission's verdict."""

    profile: Profile  # the session's from now on
    identity: str = ""
    refusal: Refusal | None = None  # the identity or the admission check (sessions, shutdown) said no
    identity_refused: bool = False  # refused for who it is: leaving before HELLO is a refusal too
    probe: bool = False  # the client said it is a probe
    notices: bool = False  # serve: the client knows the end notice (protocol/notice.py): say why it ends


class HandshakeFailed(NamedTuple):
    result: str
    reason: str
    detail: str


class Rejected(NamedTuple):
    """Refused at accept, before any TLS (serve's cap on handshakes per source), or ended from
    outside before the session started."""

    refusal: Refusal


class SlotGranted(NamedTuple):
    pass


class SlotRefused(NamedTuple):
    refusal: Refusal


class UpstreamConnected(NamedTuple):
    pass


class UpstreamFailed(NamedTuple):
    refusal: Refusal


class ClientClosed(NamedTuple):
    error: str = ""


class UpstreamClosed(NamedTuple):
    """The upstream hung up."""

    error: str = ""  # why, if it was an error
    tls_reason: str | None = None  # the classified TLS alert when it was one
    crashed: Refusal | None = None  # serve runs the server and saw it die under the session (upstream/pool.py)


class Tick(NamedTuple):
    """A second passed: enforce the deadlines. One instance (``TICK``): ``Lifecycle.tick`` notes
    the time and the sessions queued for the slot first, so a tick builds no event object."""


TICK: Final = Tick()


class Shutdown(NamedTuple):
    pass


class InternalError(NamedTuple):
    pass


class Refused(NamedTuple):
    """The session refused a frame (what ``client_data`` / ``server_data`` raised), or the link
    was ended from outside (certificate expired or revoked, identity off the allow-list)."""

    refusal: Refusal


class ClientBlocked(NamedTuple):
    """The client's write buffer filled up (it is not reading its responses) or drained."""

    blocked: bool


class UpstreamBlocked(NamedTuple):
    """The upstream's write buffer filled up (the relay paused the client's reads) or drained."""

    blocked: bool


class GraphValidated(NamedTuple):
    """The deferred graph's validation ran (``Session.validate_deferred``): the session resumes."""


LinkEvent = Union[
    Accepted, Admit, HandshakeFailed, Rejected, SlotGranted, SlotRefused, UpstreamConnected, UpstreamFailed,
    ClientClosed, UpstreamClosed, Tick, Shutdown, InternalError, Refused, ClientBlocked, UpstreamBlocked,
    GraphValidated,
]
Event = Union[LinkEvent, SessionEvent]
EVENTS: tuple[type, ...] = (
    Accepted, Admit, HandshakeFailed, Rejected, SlotGranted, SlotRefused, UpstreamConnected, UpstreamFailed,
    ClientClosed, UpstreamClosed, Tick, Shutdown, InternalError, Refused, ClientBlocked, UpstreamBlocked,
    GraphValidated, Hello, Active, NodeRefused, NodeEnded, Violation, Deferred,
)  # fmt: skip


# ---------------------------------------------------------------------------------- actions
# Appended to ``Lifecycle.actions``; the relay carries them out in order, one handler per class.
class WriteClient(NamedTuple):
    data: bytes  # a refusal answer


class WriteUpstream(NamedTuple):
    chunks: list[bytes]  # client bytes kept while the upstream was dialled


class OpenUpstream(NamedTuple):
    limits: Limits  # dial; answered with UpstreamConnected / UpstreamFailed


class TakeSlot(NamedTuple):
    limits: Limits  # queue for the upstream slot; answered with SlotGranted / SlotRefused


class FreeSlot(NamedTuple):
    pass


class HalfCloseUpstream(NamedTuple):
    slot_held: bool  # write EOF and keep reading; the slot is kept until the upstream hangs up


class CloseClient(NamedTuple):
    pass  # close after flushing what is queued


class CloseUpstream(NamedTuple):
    pass


class AbortUpstream(NamedTuple):
    pass


class CountTlsFailure(NamedTuple):
    reason: str


class CountViolation(NamedTuple):
    """A firewall rule failed."""

    reason: str
    mode: str  # "enforce" (refused) or "monitor" (forwarded)
    violation: Violation | None  # the monitor's
    command: str


class Validate(NamedTuple):
    pass  # run Session.validate_deferred off the loop, then GraphValidated


class End(NamedTuple):
    record: dict[str, object]  # the audit record: the session is over for metrics and logs


Action = Union[
    WriteClient, WriteUpstream, OpenUpstream, TakeSlot, FreeSlot, HalfCloseUpstream, CloseClient, CloseUpstream,
    AbortUpstream, CountTlsFailure, CountViolation, Validate, End,
]
ACTIONS: tuple[type, ...] = (
    WriteClient, WriteUpstream, OpenUpstream, TakeSlot, FreeSlot, HalfCloseUpstream, CloseClient, CloseUpstream,
    AbortUpstream, CountTlsFailure, CountViolation, Validate, End,
)  # fmt: skip


# ---------------------------------------------------------------------------------- rules
class LinkFacts(Protocol):
    """What the rules read of a link (``Lifecycle`` has these)."""

    @property
    def side(self) -> Side: ...
    @property
    def refusal(self) -> Refusal | None: ...
    @property
    def upstream_open(self) -> bool: ...


class Rule(str, Enum):
    """A cell whose next state depends on the link's facts, not on the event alone."""

    ADMITTED = "admitted"  # REFUSING if refused, AWAIT_HELLO if the side takes the slot, else CONNECTING
    ENDED = "ended"  # DRAINING while serve's upstream is open, else CLOSED (see ended_to)


def ended_to(link: LinkFacts) -> LinkState:
    """Where an ended session goes (state-triggered: checked after every event once it ended):
    serve half-closes its open upstream and reads it until it hangs up; else it is closed."""
    return DRAINING if link.upstream_open and link.side.drains_upstream else CLOSED


def _admitted_to(link: LinkFacts) -> LinkState:
    if link.refusal is not None:
        return REFUSING
    return AWAIT_HELLO if link.side.takes_slot else CONNECTING


RULES: Final = {Rule.ADMITTED: _admitted_to, Rule.ENDED: ended_to}

# ---------------------------------------------------------------------------------- the table
Next = Union[LinkState, Rule]
_ENDED: Final = Rule.ENDED

# What every live state does unless its row says otherwise: these events end the session.
_LIVE: Final[Mapping[type, Next]] = {
    ClientClosed: _ENDED, Shutdown: _ENDED, InternalError: _ENDED, Refused: _ENDED, NodeRefused: _ENDED,
    NodeEnded: _ENDED,
}  # fmt: skip

TABLE: Mapping[LinkState, Mapping[type, Next]] = {
    HANDSHAKE: {**_LIVE, Admit: Rule.ADMITTED, HandshakeFailed: _ENDED, Rejected: _ENDED},
    AWAIT_HELLO: {**_LIVE, Hello: QUEUED},
    REFUSING: {**_LIVE, Hello: _ENDED},  # answered 0.0.N at its HELLO
    QUEUED: {**_LIVE, SlotGranted: CONNECTING, SlotRefused: REFUSING},
    CONNECTING: {**_LIVE, UpstreamConnected: GREETING, UpstreamFailed: REFUSING},
    GREETING: {**_LIVE, UpstreamClosed: REFUSING, Active: ACTIVE},
    ACTIVE: {**_LIVE, UpstreamClosed: _ENDED, Deferred: VALIDATING},
    VALIDATING: {**_LIVE, UpstreamClosed: _ENDED, GraphValidated: ACTIVE},
    DRAINING: {UpstreamClosed: CLOSED},  # also by the rule: an aborted drain (Tick) leaves no upstream
    CLOSED: {},
}  # fmt: skip
# A refusal before ACTIVE (SlotRefused, UpstreamFailed, GREETING's UpstreamClosed) whose HELLO is
# waiting is answered at once: the session ends, and the state-triggered rule overrides the cell;
# so does a Tick past a deadline.

# The transitions each state may make (docs/design.md's state diagram).
EDGES: Mapping[LinkState, frozenset[LinkState]] = {
    state: frozenset(
        s for nxt in list(row.values()) + ([] if state in ENDS else [_ENDED]) + ([CLOSED] if state is DRAINING else [])
        for s in ((nxt,) if isinstance(nxt, LinkState) else
                  (REFUSING, AWAIT_HELLO, CONNECTING) if nxt is Rule.ADMITTED else (DRAINING, CLOSED))
        if s is not state
    )
    for state, row in TABLE.items()
}


def table_markdown() -> str:
    """The table as docs/design.md shows it (tests/unit/protocol/test_lifecycle.py keeps the two equal)."""
    rule_text = {Rule.ADMITTED: "REFUSING if refused, else AWAIT_HELLO (serve) or CONNECTING (connect)",
                 Rule.ENDED: "the session's end: DRAINING (serve, upstream open) or CLOSED"}
    lines = ["| state | event | next state |", "|---|---|---|"]
    lines += [f"| any live | {event.__name__} | {rule_text[Rule.ENDED]} |" for event in _LIVE]
    for state, rows in TABLE.items():
        for event, nxt in rows.items():
            if state in ENDS or _LIVE.get(event) != nxt:
                lines.append(f"| {state.name} | {event.__name__} | "
                             f"{rule_text[nxt] if isinstance(nxt, Rule) else nxt.name} |")
    lines.append(f"| any live, after any event that ended the session | (state-triggered) | {rule_text[Rule.ENDED]} |")
    lines.append("| DRAINING, once the upstream is gone | (state-triggered) | CLOSED |")
    return "\n".join(lines) + "\n"
