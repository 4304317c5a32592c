"""How a link ends: its deadlines, the admission caps, close classification, the audit record.

How this works: pure functions over what they read of a link (``EndingFacts``, a Protocol the
``Lifecycle`` satisfies: this module needs no concrete lifecycle), kept apart from its table.
``overdue(lc, now)`` is what ``Lifecycle.tick`` enforces: which deadline of the session's
profile ``Limits`` the link has missed, and whether the refusal is answered at HELLO (the
client's HELLO is waiting for a reply) or ends the link. ``admission_refusal`` applies the
listener-wide and per-profile ``max_sessions``. ``hello_closed_refusal`` says why an upstream
hung up on a HELLO. ``audit_record`` is the per-session record logged at its end.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from rpcguard.errors import Refusal
from rpcguard.protocol.settings import Limits, Profile
from rpcguard.protocol.session import Session
from rpcguard.protocol.side import Side
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.stats import SessionStats
from rpcguard.protocol.versions import format_version, spec_for

__all__ = ["EndingFacts", "UPSTREAM_DRAIN_S", "UPSTREAM_DRAIN_MAX_S", "admission_refusal", "peer_cap_refusal",
           "hello_closed_refusal", "overdue", "audit_record"]

# serve: a finished session's upstream is half-closed and read until the server hangs up
# (ggml-rpc-server dies of SIGPIPE on a response written to a closed connection). The server
# hangs up once it has answered what it was asked before the EOF. The drain is aborted when the
# server sends nothing for UPSTREAM_DRAIN_S (it hangs), or after UPSTREAM_DRAIN_MAX_S in all (a
# client that queued many large responses before leaving keeps the slot no longer than this).
# Progress, not age: a busy machine drains 1 GiB of queued responses in well over 5 s.
UPSTREAM_DRAIN_S = 5.0
UPSTREAM_DRAIN_MAX_S = 60.0


class EndingFacts(Protocol):
    """What the deadlines and the audit record read of a link (protocol/lifecycle.py's fields)."""

    # who and where
    @property
    def id(self) -> int: ...
    @property
    def role(self) -> str: ...
    @property
    def listener(self) -> str: ...
    @property
    def upstream(self) -> str: ...
    @property
    def peer(self) -> str: ...
    @property
    def identity(self) -> str: ...
    @property
    def profile(self) -> Profile: ...
    @property
    def side(self) -> Side: ...
    @property
    def limits(self) -> Limits: ...
    @property
    def clock(self) -> Callable[[], float]: ...
    # the session and its state
    @property
    def session(self) -> Session | None: ...
    @property
    def stats(self) -> SessionStats: ...
    @property
    def greeted(self) -> bool: ...
    @property
    def refusal(self) -> Refusal | None: ...
    @property
    def refused_on_leave(self) -> bool: ...
    @property
    def upstream_open(self) -> bool: ...
    @property
    def slot_held(self) -> bool: ...
    # times and samples (Lifecycle._sample)
    @property
    def t0(self) -> float: ...
    @property
    def t_admitted(self) -> float | None: ...
    @property
    def t_upstream(self) -> float: ...
    @property
    def last_activity_ns(self) -> int: ...
    @property
    def rx_bytes(self) -> int: ...
    @property
    def frame_t(self) -> float: ...
    @property
    def frame_rx(self) -> int: ...
    @property
    def working_t(self) -> float: ...
    @property
    def others_waiting(self) -> int: ...
    @property
    def wait_t(self) -> float: ...
    @property
    def busy_waited(self) -> float: ...
    @property
    def flops_at_wait(self) -> int: ...
    @property
    def client_blocked_since(self) -> float: ...
    # how it ended
    @property
    def result(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def party(self) -> str: ...
    @property
    def command(self) -> str: ...
    @property
    def detail(self) -> str: ...
    @property
    def post_mortem(self) -> dict[str, object] | None: ...


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


def peer_cap_refusal(listener: Limits, profile: Limits, counts: tuple[int, int, int, int]) -> Refusal | None:
    """serve: a new session would take one certificate or one host past its share of the
    listener. ``counts``: admitted sessions (the new one included) of the same identity, of the
    same source address, and among those the ones without a HELLO yet (the new one has none).
    The identity's caps are its profile's; the source's, the listener's."""
    ident, source, ident_pending, source_pending = counts
    checks = (
        (ident, profile.max_sessions_per_identity,
         Refusal("too_many_sessions_per_identity", f"more than {profile.max_sessions_per_identity} sessions of "
                                                   "this identity")),
        (source, listener.max_sessions_per_source,
         Refusal("too_many_sessions_per_source", f"more than {listener.max_sessions_per_source} sessions from "
                                                 "this address")),
        (ident_pending, profile.max_pending_per_identity,
         Refusal("too_many_pending_per_identity", f"more than {profile.max_pending_per_identity} connections of "
                                                  "this identity waiting for their HELLO")),
        (source_pending, listener.max_pending_per_source,
         Refusal("too_many_pending_per_source", f"more than {listener.max_pending_per_source} connections from "
                                                "this address waiting for their HELLO")),
    )
    for count, cap, refusal in checks:
        if cap and count > cap:
            return refusal
    return None


def hello_closed_refusal(facts: UpstreamFacts, sent: int | None) -> Refusal:
    """The upstream hung up on the HELLO: say why when its version tells (a HELLO of the other era)."""
    known = facts.version
    spec = spec_for(known) if known is not None else None
    if known is not None and spec is not None and sent is not None and sent != spec.hello_request:
        era = "pre-4.0.0 (0-byte)" if sent == 0 else ">= 4.0.0 (24-byte)"
        return Refusal("version_not_accepted", f"the client sent a {era} HELLO; the upstream speaks "
                                               f"{format_version(known)} and closed the connection")
    return Refusal("upstream_unavailable", "upstream closed the connection at HELLO")


def overdue(lc: EndingFacts, now: float) -> tuple[Refusal, bool] | None:
    """The deadline ``lc`` has missed at ``now``: (refusal, answered at HELLO?), or None."""
    limits = lc.limits
    session = lc.session
    hello_s = limits.hello_timeout_s
    greeted = lc.greeted
    if session is not None and not greeted and hello_s:
        if session.hello_request_len is None:
            # The clock starts at admission; the TLS handshake has its own timeout.
            if lc.t_admitted is not None and now - lc.t_admitted > hello_s:
                early = lc.refusal
                if early is not None and lc.refused_on_leave:  # refused for who it is: say that
                    return Refusal(early.reason, f"{early.detail}; no HELLO within {hello_s:g} s",
                                   party=early.party), False
                return Refusal("hello_timeout", f"no HELLO within {hello_s:g} s"), False
        elif lc.upstream_open and now - lc.t_upstream > hello_s + (
            limits.queue_timeout_s if lc.side.upstream_is_guard else 0
        ):
            # A server that takes the connection but never answers HELLO. connect's upstream
            # is the node's serve, which may queue the HELLO for its own queue_timeout_s.
            return Refusal("upstream_unavailable", "the upstream did not answer HELLO"), True
    if session is not None and greeted:
        quiet = now - lc.last_activity_ns / 1e9
        idle = session.idle
        if limits.idle_timeout_s and idle and quiet > limits.idle_timeout_s:
            return Refusal("idle_timeout", f"idle for {quiet:.0f} s"), False
        base = limits.frame_timeout_s
        if base and lc.frame_t:
            # By age, from the tick that first saw the frame in progress: frame_timeout_s, plus
            # one second per min_data_rate_bps bytes received since (a trickle buys nothing).
            age, got, rate = now - lc.frame_t, lc.rx_bytes - lc.frame_rx, limits.min_data_rate_bps
            if age > base + (got / rate if rate else 0):
                pace = f" ({got} bytes; the minimum is {rate} B/s after {base:g} s)" if rate else ""
                return Refusal("frame_timeout", f"a request frame stalled for {age:.0f} s{pace}"), False
        wait_s = limits.idle_while_waiting_s
        if wait_s and lc.others_waiting and lc.slot_held and now - lc.working_t > wait_s:
            return Refusal("idle_while_waiting", f"idle for {now - lc.working_t:.0f} s while {lc.others_waiting} "
                                                 f"session(s) waited for the upstream"), False
        hold_s = limits.hold_while_waiting_s
        if hold_s and lc.wait_t:
            # The holder's share of the upstream once another waits: every second since, or with
            # no preemption of idle holders (idle_while_waiting_s 0) only its busy ticks (a trickled
            # frame, a slow reader, a stream of requests); or the estimated compute of the graphs
            # it sent since, GRAPH_RECOMPUTE charged as its stored graph, whichever is larger.
            held = now - lc.wait_t if wait_s else lc.busy_waited
            compute = (session.state.compute_flops - lc.flops_at_wait) / (session.policy.firewall.node_gflops * 1e9)
            if held > hold_s or compute > hold_s:
                return Refusal("hold_while_waiting",
                               f"held the upstream {now - lc.wait_t:.0f} s (busy {lc.busy_waited:.0f} s, {compute:.1f} s "
                               f"of estimated compute) while {lc.others_waiting} session(s) waited for it "
                               f"(limits.hold_while_waiting_s {hold_s:g})"), False
    owed = session.owed_since_ns if session is not None and greeted else 0
    if limits.max_graph_s and owed and now - owed / 1e9 > limits.max_graph_s:
        return Refusal("upstream_hung", f"the server has owed a response for {now - owed / 1e9:.0f} s "
                                        f"(limits.max_graph_s {limits.max_graph_s:g})"), False
    blocked = lc.client_blocked_since
    if limits.frame_timeout_s and blocked and now - blocked > limits.frame_timeout_s:
        # A client that stops reading its responses would hold the single upstream slot forever.
        return Refusal("frame_timeout", f"the client has not read its responses for {now - blocked:.0f} s"), False
    if limits.max_session_s and now - lc.t0 > limits.max_session_s:
        return Refusal("session_lifetime", f"session older than {limits.max_session_s:g} s"), False
    return None


def _compute_s(lc: EndingFacts) -> float | None:
    session = lc.session
    if session is None:
        return None
    policy = session.policy.firewall
    return round(session.state.compute_flops / (policy.node_gflops * 1e9), 3)


def audit_record(lc: EndingFacts) -> dict[str, object]:
    """The per-session audit record (one per session, logged at its end)."""
    s = lc.stats
    version = lc.session.version if lc.session is not None else None
    return {
        "event": "session_end",
        "session": lc.id,
        "role": lc.role,
        "listener": lc.listener,
        "profile": lc.profile.name,
        "peer": lc.peer,
        "identity": lc.identity,
        "upstream": lc.upstream,
        "version": format_version(version) if version else None,
        "duration_s": round(lc.clock() - lc.t0, 6),
        "result": lc.result,
        "reason": lc.reason or None,
        "party": lc.party or None,  # who is at fault: client, upstream or local (errors.py)
        "command": lc.command if lc.command != "-" else None,
        "detail": lc.detail,
        # who ran the request firewall: this process, or the node's rpcguard (connect, ALPN)
        "request_checks": lc.session.requests_checked_by if lc.session is not None else None,
        "alloc_bytes": s.alloc_bytes,
        "upload_bytes": s.upload_bytes_set,
        "hash_hit_bytes": s.upload_bytes_hash_hit,
        # SET_TENSOR_HASH the proxy answered "not cached" (a cache other identities share): logged once, here
        "hash_answered_by_proxy": s.hash_answered_by_proxy,
        # the compute budget's estimate of what this session's graphs cost the server (cost.py)
        "compute_s_estimated": _compute_s(lc),
        "commands": s.per_command(),
        **({"post_mortem": lc.post_mortem} if lc.post_mortem is not None else {}),
    }
