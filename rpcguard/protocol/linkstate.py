"""The link lifecycle's vocabulary and tables: states, events, actions, transitions, handlers.

How this works (h11's ``_state.py`` is the model): a link is in one of the ``LinkState``s;
``TABLE`` holds, for every event in every state, a ``Row``: the ``Lifecycle`` method that
handles it (an event a state does not expect goes to ``_ignore``, ``_drop`` or a clean-up such
as ``_free_granted_slot``) and the states it may move the link to (``Lifecycle._goto`` refuses
any other: a bug, not a peer's doing). The events are the relay's (a read, a close, the slot,
the dial, the tick) and the ``Session``'s (its HELLO, ACTIVE, node-refusal and monitor-violation
events, and a refusal it raised). ``EDGES`` is the union per state. Actions are ``(kind,
argument)`` tuples the relay carries out in order. See protocol/lifecycle.py for the machine and
docs/design.md for the state diagram.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Final, Literal, Mapping, NamedTuple, Union

from rpcguard.protocol.session import EV_ACTIVE, EV_HELLO, EV_NODE_REFUSED, EV_VALIDATE, EV_VIOLATION

if TYPE_CHECKING:
    from rpcguard.protocol.session import Violation
    from rpcguard.protocol.settings import Limits

__all__ = [
    "STATES", "EVENTS", "HANDSHAKE", "AWAIT_HELLO", "REFUSING", "QUEUED", "CONNECTING", "GREETING", "ACTIVE",
    "DRAINING", "CLOSED", "WRITE_CLIENT", "WRITE_UPSTREAM", "OPEN_UPSTREAM", "TAKE_SLOT", "FREE_SLOT",
    "HALF_CLOSE_UPSTREAM", "CLOSE_CLIENT", "CLOSE_UPSTREAM", "ABORT_UPSTREAM", "COUNT_TLS_FAILURE",
    "COUNT_VIOLATION", "VALIDATE", "END", "Action", "EDGES", "TABLE", "Row", "LinkState", "ENDS", "table_markdown",
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
    DRAINING = "draining"  # over; serve's upstream half-closed and read until it hangs up
    CLOSED = "closed"

    def __str__(self) -> str:
        return self.value


HANDSHAKE, AWAIT_HELLO, REFUSING, QUEUED, CONNECTING, GREETING, ACTIVE, DRAINING, CLOSED = LinkState
STATES: tuple[LinkState, ...] = tuple(LinkState)

# ---------------------------------------------------------------------------------- events
EVENTS: tuple[str, ...] = (
    "admit", "handshake_failed", "client_data", "server_data", "slot_granted", "slot_refused",
    "upstream_connected", "upstream_failed", "client_closed", "upstream_closed", "tick", "shutdown",
    "internal_error", "rejected",
    # what the Session reports (Output.events) and a refusal it raised, dispatched the same way
    EV_HELLO, EV_ACTIVE, EV_NODE_REFUSED, EV_VIOLATION, EV_VALIDATE, "refused",
)  # fmt: skip

# ---------------------------------------------------------------------------------- actions
# (kind, argument) tuples in ``Lifecycle.actions``, carried out in order by the relay. Each kind
# is a Literal and ``Action`` the union of the (kind, argument type) pairs, so mypy checks every
# action the lifecycle makes against what the relay's handler of that kind takes.
WRITE_CLIENT: Final = "write_client"  # bytes: a refusal answer
WRITE_UPSTREAM: Final = "write_upstream"  # list[bytes]: client bytes kept while the upstream was dialled
OPEN_UPSTREAM: Final = "open_upstream"  # Limits: dial; answer with upstream_connected / upstream_failed
TAKE_SLOT: Final = "take_slot"  # Limits: queue for the upstream slot; answer slot_granted / slot_refused
FREE_SLOT: Final = "free_slot"  # None
HALF_CLOSE_UPSTREAM: Final = "half_close_upstream"  # bool (slot held): write EOF, keep reading
CLOSE_CLIENT: Final = "close_client"  # None: close after flushing what is queued
CLOSE_UPSTREAM: Final = "close_upstream"  # None
ABORT_UPSTREAM: Final = "abort_upstream"  # None
COUNT_TLS_FAILURE: Final = "tls_failure"  # str: reason
COUNT_VIOLATION: Final = "violation"  # (reason, mode, Violation | None, command): a firewall rule failed
VALIDATE: Final = "validate"  # None: run Session.validate_deferred off the loop, then resume_deferred
END: Final = "end"  # dict: the audit record (the session is over for metrics and logs)

ViolationCount = tuple[str, str, "Violation | None", str]  # reason, mode, the monitor's Violation, command
Action = Union[
    tuple[Literal["write_client"], bytes],
    tuple[Literal["write_upstream"], "list[bytes]"],
    tuple[Literal["open_upstream", "take_slot"], "Limits"],
    tuple[Literal["free_slot", "close_client", "close_upstream", "abort_upstream", "validate"], None],
    tuple[Literal["half_close_upstream"], bool],
    tuple[Literal["tls_failure"], str],
    tuple[Literal["violation"], ViolationCount],
    tuple[Literal["end"], "dict[str, object]"],
]

# ---------------------------------------------------------------------------------- the table
class Row(NamedTuple):
    """What one event does in one state: the ``Lifecycle`` method that handles it, and the states
    that method may move the link to (empty: it stays; ``Lifecycle._goto`` refuses any other)."""

    handler: str
    then: frozenset[LinkState] = frozenset()


STAY: Final = frozenset[LinkState]()
# Where a session's end goes (Lifecycle._finish): DRAINING while serve's upstream is open, else CLOSED.
ENDS: Final = frozenset({DRAINING, CLOSED})
CLOSES: Final = frozenset({CLOSED})  # ...from a state whose upstream is not open yet

# The events every state answers the same way unless its row says otherwise; ``end`` is where a
# session's end goes from that state.
def _common(end: frozenset[LinkState]) -> dict[str, Row]:
    return {
        "admit": Row("_ignore"), "handshake_failed": Row("_ignore"), "client_data": Row("_drop"),
        "server_data": Row("_drop"), "slot_granted": Row("_free_granted_slot"), "slot_refused": Row("_ignore"),
        "upstream_connected": Row("_close_new_upstream"), "upstream_failed": Row("_ignore"),
        "client_closed": Row("_client_closed", end), "upstream_closed": Row("_ignore"), "tick": Row("_tick", end),
        "shutdown": Row("_shutdown", end), "internal_error": Row("_internal_error", end), "rejected": Row("_ignore"),
        EV_HELLO: Row("_ev_ignore"), EV_ACTIVE: Row("_ev_ignore"), EV_NODE_REFUSED: Row("_ev_node_refused", end),
        EV_VIOLATION: Row("_ev_violation"), EV_VALIDATE: Row("_ev_validate"), "refused": Row("_refused", end),
    }  # fmt: skip


TABLE: Mapping[LinkState, Mapping[str, Row]] = {
    HANDSHAKE: {**_common(CLOSES), "admit": Row("_admit", frozenset({AWAIT_HELLO, REFUSING, CONNECTING})),
                "handshake_failed": Row("_handshake_failed", CLOSES), "rejected": Row("_rejected", CLOSES)},
    AWAIT_HELLO: {**_common(CLOSES), "client_data": Row("_client_early"),
                  EV_HELLO: Row("_ev_hello", frozenset({QUEUED}))},
    REFUSING: {**_common(CLOSES), "client_data": Row("_client_refusing"), EV_HELLO: Row("_answer_at_hello", CLOSES)},
    QUEUED: {**_common(CLOSES), "client_data": Row("_client_early"),
             "slot_granted": Row("_slot_granted", frozenset({CONNECTING})),
             "slot_refused": Row("_refuse_early", frozenset({REFUSING, CLOSED}))},
    CONNECTING: {**_common(CLOSES), "client_data": Row("_client_early"),
                 "upstream_connected": Row("_upstream_connected", frozenset({GREETING})),
                 "upstream_failed": Row("_refuse_early", frozenset({REFUSING, CLOSED}))},
    # The session's own client_data / server_data, bound directly (the hot path: no wrapper call).
    GREETING: {**_common(ENDS), "client_data": Row("_feed_c"), "server_data": Row("_feed_s"),
               "upstream_closed": Row("_upstream_closed_early", frozenset({REFUSING, CLOSED})),
               EV_ACTIVE: Row("_ev_active", frozenset({ACTIVE}))},
    ACTIVE: {**_common(ENDS), "client_data": Row("_feed_c"), "server_data": Row("_feed_s"),
             "upstream_closed": Row("_upstream_closed_active", CLOSES)},
    DRAINING: {**_common(CLOSES), "client_closed": Row("_ignore"), "server_data": Row("_drain_data"),
               "upstream_closed": Row("_drained", CLOSES), "tick": Row("_tick_drain", CLOSES),
               "shutdown": Row("_ignore"), "internal_error": Row("_ignore"), "refused": Row("_ignore"),
               EV_NODE_REFUSED: Row("_ev_ignore"), EV_VIOLATION: Row("_ev_ignore")},
    CLOSED: {**_common(STAY), "client_closed": Row("_ignore"), "tick": Row("_ignore"), "shutdown": Row("_ignore"),
             "internal_error": Row("_ignore"), "refused": Row("_ignore"), EV_NODE_REFUSED: Row("_ev_ignore"),
             EV_VIOLATION: Row("_ev_ignore")},
}  # fmt: skip

# The transitions the table allows out of each state (docs/design.md's state table).
EDGES: Mapping[LinkState, frozenset[LinkState]] = {
    state: frozenset().union(*(r.then for r in row.values())) for state, row in TABLE.items()
}


def table_markdown() -> str:
    """The table as docs/design.md shows it: what every state does with an event unless its own
    row says otherwise, then each state's own rows, with where each may lead
    (tests/unit/protocol/test_lifecycle.py keeps the two equal)."""
    common = _common(ENDS)
    lines = ["| state | event | handler | may lead to |", "|---|---|---|---|"]
    for event, row in common.items():
        then = "the session's end: DRAINING (serve, upstream open) or CLOSED" if row.then else "(stays)"
        lines.append(f"| any | {event} | `{row.handler}` | {then} |")
    for state, rows in TABLE.items():
        for event, row in rows.items():
            if row.handler != common[event].handler:
                then = ", ".join(s.name for s in STATES if s in row.then) or "(stays)"
                lines.append(f"| {state.name} | {event} | `{row.handler}` | {then} |")
    return "\n".join(lines) + "\n"
