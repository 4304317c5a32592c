"""The link lifecycle's vocabulary and tables: states, events, actions, transitions, handlers.

How this works (h11's ``_state.py`` is the model): a link is in one of ``STATES``; ``EDGES``
lists the transitions allowed from each (``Lifecycle._goto`` refuses any other: a bug, not a
peer's doing); ``TABLE`` names the ``Lifecycle`` method that handles every event in every
state (an event a state does not expect goes to ``_ignore``, ``_drop`` or a clean-up such as
``_free_granted_slot``); ``SESSION_EVENTS`` names the handler of each event the ``Session``
reports. Actions are ``(kind, argument)`` tuples the relay carries out in order. See
protocol/lifecycle.py for the machine and docs/design.md for the state diagram.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Literal, Mapping, Union

from rpcguard.protocol.session import EV_ACTIVE, EV_HELLO, EV_NODE_REFUSED, EV_VIOLATION

if TYPE_CHECKING:
    from rpcguard.protocol.session import Violation
    from rpcguard.protocol.settings import Limits

__all__ = [
    "STATES", "EVENTS", "HANDSHAKE", "AWAIT_HELLO", "REFUSING", "QUEUED", "CONNECTING", "GREETING", "ACTIVE",
    "DRAINING", "CLOSED", "WRITE_CLIENT", "WRITE_UPSTREAM", "OPEN_UPSTREAM", "TAKE_SLOT", "FREE_SLOT",
    "HALF_CLOSE_UPSTREAM", "CLOSE_CLIENT", "CLOSE_UPSTREAM", "ABORT_UPSTREAM", "COUNT_TLS_FAILURE",
    "COUNT_VIOLATION", "END", "Action", "EDGES", "TABLE", "SESSION_EVENTS",
]  # fmt: skip

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
    "internal_error", "rejected",
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
END: Final = "end"  # dict: the audit record (the session is over for metrics and logs)

ViolationCount = tuple[str, str, "Violation | None", str]  # reason, mode, the monitor's Violation, command
Action = Union[
    tuple[Literal["write_client"], bytes],
    tuple[Literal["write_upstream"], "list[bytes]"],
    tuple[Literal["open_upstream", "take_slot"], "Limits"],
    tuple[Literal["free_slot", "close_client", "close_upstream", "abort_upstream"], None],
    tuple[Literal["half_close_upstream"], bool],
    tuple[Literal["tls_failure"], str],
    tuple[Literal["violation"], ViolationCount],
    tuple[Literal["end"], "dict[str, object]"],
]

# Allowed transitions: _goto refuses any other (a bug, not a peer's doing).
EDGES: Mapping[str, frozenset[str]] = {
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
           "shutdown": "_shutdown", "internal_error": "_internal_error", "rejected": "_ignore"}  # fmt: skip
TABLE: Mapping[str, Mapping[str, str]] = {
    HANDSHAKE: {**_COMMON, "admit": "_admit", "handshake_failed": "_handshake_failed", "rejected": "_rejected"},
    AWAIT_HELLO: {**_COMMON, "client_data": "_client_early"},
    REFUSING: {**_COMMON, "client_data": "_client_early"},
    QUEUED: {**_COMMON, "client_data": "_client_early", "slot_granted": "_slot_granted",
             "slot_refused": "_refuse_early"},
    CONNECTING: {**_COMMON, "client_data": "_client_early", "upstream_connected": "_upstream_connected",
                 "upstream_failed": "_refuse_early"},
    # The session's own client_data / server_data, bound directly (the hot path: no wrapper call).
    GREETING: {**_COMMON, "client_data": "_feed_c", "server_data": "_feed_s",
               "upstream_closed": "_upstream_closed_early"},
    ACTIVE: {**_COMMON, "client_data": "_feed_c", "server_data": "_feed_s",
             "upstream_closed": "_upstream_closed_active"},
    DRAINING: {**_COMMON, "client_closed": "_ignore", "server_data": "_drain_data", "upstream_closed": "_drained",
               "tick": "_tick_drain",
               "shutdown": "_ignore", "internal_error": "_ignore"},
    CLOSED: {**_COMMON, "client_closed": "_ignore", "tick": "_ignore", "shutdown": "_ignore",
             "internal_error": "_ignore"},
}  # fmt: skip


# What the link does with each event the session reports (the handler says if the link is over).
SESSION_EVENTS: Mapping[str, str] = {
    EV_VIOLATION: "_ev_violation", EV_HELLO: "_ev_hello", EV_ACTIVE: "_ev_active",
    EV_NODE_REFUSED: "_ev_node_refused",
}
