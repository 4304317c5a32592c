"""Lifecycle: every path of a link with a fake clock and no sockets (the relay only carries out actions).

Each test drives one ``Lifecycle`` with events and checks the state it reaches, the actions it
asks for (in order) and the audit record. Byte vectors are fed whole, byte by byte and with
trailing data where a path reads frames.
"""

from __future__ import annotations

import struct

import pytest

from rpcguard.errors import PolicyRefusal, Refusal
from rpcguard.protocol import encode
from rpcguard.protocol import linkstate as S
from rpcguard.protocol.endings import UPSTREAM_DRAIN_MAX_S, UPSTREAM_DRAIN_S
from rpcguard.protocol.lifecycle import Lifecycle, admission_refusal
from rpcguard.protocol.notice import NOTICE_HEAD, Notice, decode_notice, encode_notice
from rpcguard.protocol.settings import FirewallPolicy, Limits, Profile, SessionPolicy
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.side import SIDES
from rpcguard.protocol.versions import REFUSAL_CODES
from tests.support import vectors as V

GIB = 1 << 30
LIMITS = Limits(handshake_timeout_s=10, hello_timeout_s=10, idle_timeout_s=30, frame_timeout_s=60,
                max_session_s=3600, queue_timeout_s=30)
DEFAULT = Profile("default", SessionPolicy(), LIMITS)
TENANT = Profile("tenant", SessionPolicy(), Limits(hello_timeout_s=2, idle_timeout_s=5, max_sessions=1))
DC_RSP_1 = encode.response(struct.pack("<I", 1))  # DEVICE_COUNT answer: 1 device (nothing to learn)
ERAS = [(V.HELLO_REQ_V4, True), (V.HELLO_REQ_V1, False)]  # (client HELLO, 28-byte answer layout)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    @property
    def ns(self) -> int:
        return int(self.now * 1e9)


def make(role: str = "serve", facts: UpstreamFacts | None = None, clock: Clock | None = None) -> Lifecycle:
    return Lifecycle(link_id=7, side=SIDES[role], listener="gpu0", upstream="127.0.0.1:50052", default=DEFAULT,
                     facts=facts or UpstreamFacts(version=(7, 0, 0), device_count=1, memory={0: (GIB, GIB)}),
                     clock=clock or Clock())


def take(lc: Lifecycle) -> list[S.Action]:
    out = list(lc.actions)
    lc.actions.clear()
    return out


def kinds(actions: list[S.Action]) -> list[type]:
    return [type(a) for a in actions]


def end(actions: list[S.Action]) -> dict:
    records = [a.record for a in actions if isinstance(a, S.End)]
    assert len(records) == 1, actions
    return records[0]


def sent(chunks) -> bytes:
    data = b"".join(bytes(c) for c in chunks)
    chunks.clear()
    return data


def feed(fn, data: bytes, clock: Clock, how: str = "whole"):
    pieces = [data] if how == "whole" else [data[i : i + 1] for i in range(len(data))]
    out = None
    for piece in pieces:
        out = fn(memoryview(bytearray(piece)), clock.ns)
    return out


def active(role: str = "serve", clock: Clock | None = None, profile: Profile = DEFAULT,
           notices: bool = False) -> Lifecycle:
    """A link whose session is ACTIVE on 7.0.0 (serve: holding the slot); ``notices``: the end
    notice was negotiated (serve: the client knows it; connect: the node sends it)."""
    clock = clock or Clock()
    lc = make(role, clock=clock)
    lc.admit(profile, "CN=client1", notices=notices and role == "serve")
    if notices and role == "connect":
        lc.session.expect_notices()
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    if role == "serve":
        lc.slot_granted()
    lc.upstream_connected()
    feed(lc.server_bytes, V.HELLO_RSP_700, clock)
    lc.out.clear()
    take(lc)
    assert lc.state == S.ACTIVE
    return lc


# ----------------------------------------------------------------------------- the table
def test_every_state_has_a_handler_for_every_event_and_the_table_names_only_events_and_states():
    from rpcguard.protocol.lifecycle import _ENTER, _HANDLERS
    for state in S.STATES:
        assert set(_HANDLERS[state]) == set(S.EVENTS), state
        assert set(S.TABLE[state]) <= set(S.EVENTS), state
        assert all(isinstance(nxt, (S.LinkState, S.Rule)) for nxt in S.TABLE[state].values()), state
        assert state in _ENTER
    assert set(S.RULES) == set(S.Rule)
    # where a state may go: the diagram of docs/design.md
    assert S.EDGES[S.ACTIVE] == {S.VALIDATING, S.DRAINING, S.CLOSED}
    assert S.EDGES[S.HANDSHAKE] == {S.AWAIT_HELLO, S.REFUSING, S.CONNECTING, S.DRAINING, S.CLOSED}
    assert S.EDGES[S.DRAINING] == {S.CLOSED} and not S.EDGES[S.CLOSED]


def test_handlers_never_assign_the_state():
    """Only the dispatch moves the link (``handle`` -> ``_enter``): no handler assigns ``state``
    or calls ``_enter`` (the table and its rules hold every next state)."""
    import ast
    import inspect
    from rpcguard.protocol import lifecycle
    tree = ast.parse(inspect.getsource(lifecycle))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Lifecycle")
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name in ("__init__", "handle", "_enter"):
            continue
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                assert not any(isinstance(t, ast.Attribute) and t.attr == "state" for t in targets), fn.name
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("_enter", "_goto"), fn.name


@pytest.mark.parametrize("role, state", [("serve", S.DRAINING), ("connect", S.CLOSED)])
def test_an_ended_session_goes_where_the_state_triggered_rule_says(role, state):
    lc = active(role)
    lc.shutdown()
    assert lc.state == state and S.ended_to(lc) == state
    assert kinds(take(lc)) == ([S.CloseClient, S.HalfCloseUpstream, S.End] if role == "serve"
                               else [S.CloseClient, S.CloseUpstream, S.End])


def test_design_md_renders_the_table():
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[3] / "docs" / "design.md").read_text(encoding="utf-8")
    begin = doc.index("\n", doc.index("<!-- link-table:begin")) + 1
    assert doc[begin:doc.index("<!-- link-table:end")] == S.table_markdown(), \
        "docs/design.md's link table is stale: paste rpcguard.protocol.linkstate.table_markdown()"


def test_active_reads_go_straight_to_the_session():
    lc = active()
    assert lc.client_data == lc.session.client_data and lc.server_data == lc.session.server_data
    with pytest.raises(Refusal):  # the caller hands it to refused(): client_bytes does
        lc.client_data(memoryview(V.HELLO_REQ_V4), 0)


_TYPED = """
from rpcguard.protocol.lifecycle import Lifecycle, on
from rpcguard.protocol.linkstate import Admit, End, SlotRefused, WriteClient
from rpcguard.proxy.link import Link, does

on(Admit, Lifecycle._admit)
does(WriteClient, Link._write_client)
"""


def test_mypy_rejects_a_handler_of_the_wrong_event_or_action(request, tmp_path):
    """Each handler is registered with its event class (``lifecycle.on``) or action class
    (``link.does``): mypy checks the pair. A planted mismatch must fail, the right pairs pass."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[3]
    (tmp_path / "typed_ok.py").write_text(_TYPED)
    (tmp_path / "typed_bad.py").write_text(_TYPED + "on(SlotRefused, Lifecycle._admit)\n"
                                           "does(End, Link._write_client)\n")
    pytest_cache = getattr(request.config, "cache", None)
    cache = pytest_cache.mkdir("mypy") if pytest_cache is not None else root / ".mypy_cache"
    p = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"), "--cache-dir", str(cache),
         "--no-error-summary", "--hide-error-context", "--no-color-output", "--show-error-codes",
         str(tmp_path / "typed_ok.py"), str(tmp_path / "typed_bad.py")],
        cwd=root, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "MYPYPATH": str(root)},
    )
    errors = [line for line in p.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2 and all("typed_bad.py:8:" in e or "typed_bad.py:9:" in e for e in errors), p.stdout + p.stderr
    assert 'Argument 2 to "on" has incompatible type' in errors[0] and "SlotRefused" in errors[0], errors
    assert 'Argument 2 to "does" has incompatible type' in errors[1] and "End" in errors[1], errors


# ----------------------------------------------------------------------------- handshake, admission
def test_tls_failure_is_counted_and_recorded():
    lc = make()
    lc.peer = "10.0.0.9:5000"
    lc.handshake_failed("refused", "tls_unknown_ca", "TLS handshake failed: unknown ca")
    acts = take(lc)
    assert kinds(acts) == [S.CountTlsFailure, S.CloseClient, S.End] and acts[0][0] == "tls_unknown_ca"
    rec = end(acts)
    assert lc.state == S.CLOSED and lc.session is None
    assert rec["result"] == "refused" and rec["reason"] == "tls_unknown_ca" and rec["identity"] == ""
    assert rec["version"] is None and rec["commands"] == {} and rec["peer"] == "10.0.0.9:5000"
    assert rec["profile"] == "default" and rec["listener"] == "gpu0" and rec["upstream"] == "127.0.0.1:50052"


def test_admission_takes_the_identity_profile_and_builds_the_session_from_it():
    lc = make()
    lc.admit(TENANT, "CN=tenant")
    assert lc.state == S.AWAIT_HELLO and lc.profile is TENANT and lc.limits is TENANT.limits
    assert lc.session is not None and lc.session.policy is TENANT.policy and lc.out is lc.session.out
    assert take(lc) == []  # serve: nothing happens before the HELLO (the slot is taken only then)


def test_the_profile_limits_bound_the_queue_and_the_dial():
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(TENANT, "CN=tenant")
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    assert take(lc) == [S.TakeSlot(TENANT.limits)]
    lc.slot_granted()
    assert take(lc) == [S.OpenUpstream(TENANT.limits)]
    lc = make("connect")
    lc.admit(TENANT)
    assert take(lc) == [S.OpenUpstream(TENANT.limits)]


def test_admission_counts_sessions_per_listener_and_per_profile():
    assert admission_refusal(DEFAULT, DEFAULT, [DEFAULT] * 64) is None
    over = admission_refusal(DEFAULT, DEFAULT, [DEFAULT] * 65)
    assert over is not None and over.reason == "too_many_sessions" and "more than 64 sessions" in over.detail
    assert admission_refusal(DEFAULT, TENANT, [DEFAULT, TENANT]) is None
    over = admission_refusal(DEFAULT, TENANT, [DEFAULT, TENANT, TENANT])
    assert over is not None and over.reason == "too_many_sessions" and "profile tenant" in over.detail


# ----------------------------------------------------------------------------- the serve path
@pytest.mark.parametrize("how", ["whole", "bytewise"])
def test_serve_path_hello_queue_connect_active_drain(how):
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT, "CN=client1")
    out = feed(lc.client_bytes, V.HELLO_REQ_V4, clock, how)
    assert lc.state == S.QUEUED and not out.to_server  # kept until the upstream is there
    assert take(lc) == [S.TakeSlot(LIMITS)]
    lc.slot_granted()
    assert lc.state == S.CONNECTING and take(lc) == [S.OpenUpstream(LIMITS)] and lc.slot_held
    lc.upstream_connected()
    acts = take(lc)
    assert lc.state == S.GREETING and kinds(acts) == [S.WriteUpstream]
    assert b"".join(acts[0][0]) == V.HELLO_REQ_V4  # type: ignore[arg-type]
    out = feed(lc.server_bytes, V.HELLO_RSP_700, clock, how)
    assert lc.state == S.ACTIVE and sent(out.to_client) == V.HELLO_RSP_700
    # ACTIVE: bytes go straight through, both ways
    out = feed(lc.client_bytes, V.DEVICE_COUNT_REQ + V.GET_ALIGNMENT_REQ[:3], clock, how)
    assert sent(out.to_server) == V.DEVICE_COUNT_REQ and take(lc) == []
    out = feed(lc.server_bytes, DC_RSP_1[:12], clock, how)
    assert sent(out.to_client) == DC_RSP_1[:12]
    # the client leaves between frames... no: mid-frame (3 bytes of GET_ALIGNMENT)
    lc.client_closed()
    acts = take(lc)
    assert kinds(acts) == [S.CloseClient, S.HalfCloseUpstream, S.End] and acts[1][0] is True
    rec = end(acts)
    assert rec["result"] == "error" and rec["reason"] == "client_closed_mid_frame" and rec["version"] == "7.0.0"
    assert rec["commands"]["HELLO"] == {"req_frames": 1, "req_bytes": 33, "rsp_frames": 1, "rsp_bytes": 36}
    # DRAINING: the slot is kept and what the server still sends is dropped until it hangs up
    assert lc.state == S.DRAINING and lc.slot_held
    out = feed(lc.server_bytes, b"late answer", clock)
    assert not out.to_client and take(lc) == []
    lc.client_closed("again")  # no second record
    lc.upstream_closed()
    assert take(lc) == [S.FreeSlot()] and lc.state == S.CLOSED and not lc.slot_held


def test_clean_close_between_frames_is_ok():
    lc = active()
    lc.client_closed()
    rec = end(take(lc))
    assert rec["result"] == "ok" and rec["reason"] is None and rec["detail"] == "client closed"


def test_drain_that_never_ends_is_aborted_and_frees_the_slot():
    clock = Clock()
    lc = active(clock=clock)
    lc.client_closed()
    take(lc)
    clock.now += UPSTREAM_DRAIN_S - 0.5
    lc.tick(clock.now)
    assert take(lc) == [] and lc.state == S.DRAINING
    clock.now += 1
    lc.tick(clock.now)
    assert take(lc) == [S.AbortUpstream(), S.FreeSlot()] and lc.state == S.CLOSED


def test_a_drain_that_makes_progress_is_not_cut():
    # A busy machine drains 1 GiB of queued responses in more than UPSTREAM_DRAIN_S: the deadline
    # is UPSTREAM_DRAIN_S without a byte from the server (cutting it kills ggml-rpc-server by
    # SIGPIPE), and UPSTREAM_DRAIN_MAX_S in all.
    clock = Clock()
    lc = active(clock=clock)
    lc.client_closed()
    take(lc)
    t0 = clock.now
    while clock.now - t0 < UPSTREAM_DRAIN_MAX_S - 1:
        clock.now += UPSTREAM_DRAIN_S - 1
        out = feed(lc.server_bytes, b"x" * 4096, clock)
        assert not out.to_client
        lc.tick(clock.now)
        assert take(lc) == [] and lc.state == S.DRAINING
    clock.now = t0 + UPSTREAM_DRAIN_MAX_S + 0.5
    feed(lc.server_bytes, b"x", clock)
    lc.tick(clock.now)
    assert take(lc) == [S.AbortUpstream(), S.FreeSlot()] and lc.state == S.CLOSED


# ----------------------------------------------------------------------------- the connect path
@pytest.mark.parametrize("hello_first", [True, False])
def test_connect_dials_at_once_and_keeps_the_hello_until_connected(hello_first):
    clock = Clock()
    lc = make("connect", clock=clock)
    lc.admit(DEFAULT)
    assert lc.state == S.CONNECTING and take(lc) == [S.OpenUpstream(LIMITS)]
    if hello_first:
        out = feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
        assert not out.to_server and lc.state == S.CONNECTING
    lc.upstream_connected()
    acts = take(lc)
    if hello_first:
        assert kinds(acts) == [S.WriteUpstream] and b"".join(acts[0][0]) == V.HELLO_REQ_V4  # type: ignore[arg-type]
    else:
        assert acts == []
        out = feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
        assert sent(out.to_server) == V.HELLO_REQ_V4
    feed(lc.server_bytes, V.HELLO_RSP_700, clock)
    assert lc.state == S.ACTIVE
    lc.client_closed()
    acts = take(lc)
    assert kinds(acts) == [S.CloseClient, S.CloseUpstream, S.End]  # connect never drains
    assert end(acts)["role"] == "connect" and lc.state == S.CLOSED


def test_node_refusal_is_passed_through_and_ends_the_session():
    clock = Clock()
    lc = make("connect", clock=clock)
    lc.admit(DEFAULT)
    lc.upstream_connected()
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    take(lc)
    answer = encode.hello_response((0, 0, REFUSAL_CODES["identity_not_allowed"]), new_layout=True)
    out = feed(lc.server_bytes, answer, clock)
    assert sent(out.to_client) == answer  # the relay writes it before closing
    acts = take(lc)
    assert kinds(acts) == [S.CloseClient, S.CloseUpstream, S.End]
    rec = end(acts)
    assert rec["reason"] == "node_refused" and "identity_not_allowed" in rec["detail"]


# ----------------------------------------------------------------------------- refusal at HELLO
@pytest.mark.parametrize("hello,new_layout", ERAS)
@pytest.mark.parametrize("how", ["whole", "bytewise"])
def test_identity_refused_is_answered_at_hello_in_both_eras(hello, new_layout, how):
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT, "CN=mallory", PolicyRefusal("identity_not_allowed", "not on the list"), identity_refused=True)
    assert lc.state == S.REFUSING and take(lc) == []
    out = feed(lc.client_bytes, hello, clock, how)
    assert not out.to_server
    acts = take(lc)
    assert kinds(acts) == [S.WriteClient, S.CloseClient, S.End]
    assert acts[0][0] == encode.hello_response((0, 0, REFUSAL_CODES["identity_not_allowed"]), new_layout=new_layout)
    rec = end(acts)
    assert rec["result"] == "refused" and rec["reason"] == "identity_not_allowed" and rec["identity"] == "CN=mallory"


def test_hello_with_trailing_data_is_still_answered():
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT, refusal=Refusal("shutdown", "rpcguard is shutting down"))
    feed(lc.client_bytes, V.HELLO_REQ_V4 + V.DEVICE_COUNT_REQ, clock)
    acts = take(lc)
    assert acts[0] == S.WriteClient(encode.hello_response((0, 0, REFUSAL_CODES["shutdown"]), new_layout=True))


@pytest.mark.parametrize("reason", sorted(REFUSAL_CODES))
def test_every_refusal_code_reaches_the_client(reason):
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT)
    feed(lc.client_bytes, V.HELLO_REQ_V1, clock)
    take(lc)
    lc.slot_refused(Refusal(reason, "why"))
    acts = take(lc)
    assert acts[0] == S.WriteClient(encode.hello_response((0, 0, REFUSAL_CODES[reason]), new_layout=False))
    assert end(acts)["reason"] == reason and lc.state == S.CLOSED


def test_identity_refused_client_leaving_before_hello_is_a_refusal():
    lc = make()
    lc.admit(DEFAULT, "CN=mallory", PolicyRefusal("identity_not_allowed", "no"), identity_refused=True)
    lc.client_closed()
    rec = end(take(lc))
    assert rec["result"] == "refused" and rec["reason"] == "identity_not_allowed"


def test_other_early_refusal_client_leaving_before_hello_is_a_clean_close():
    lc = make()
    lc.admit(DEFAULT, refusal=Refusal("too_many_sessions", "more than 64 sessions"))
    lc.client_closed()
    assert end(take(lc))["result"] == "no_hello"  # not a session that worked


def test_a_refused_link_that_never_says_hello_times_out():
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT, refusal=Refusal("too_many_sessions", "x"))
    clock.now += 11
    lc.tick(clock.now)
    assert end(take(lc))["reason"] == "hello_timeout"


# ----------------------------------------------------------------------------- queue and refuse
@pytest.mark.parametrize("detail", ["the upstream serves another session", "still busy after 2 s in the queue"])
def test_upstream_busy_is_answered_at_hello(detail):
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT)
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    assert take(lc) == [S.TakeSlot(LIMITS)]
    lc.slot_refused(Refusal("upstream_busy", detail))
    acts = take(lc)
    assert kinds(acts) == [S.WriteClient, S.CloseClient, S.End]  # no slot held: none freed
    assert acts[0][0] == encode.hello_response((0, 0, REFUSAL_CODES["upstream_busy"]), new_layout=True)
    assert end(acts)["detail"] == detail


def test_a_probe_is_never_queued_and_its_busy_answer_is_no_refusal():
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT, "CN=client1", probe=True)
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    (asked,) = take(lc)
    # the slot is asked for in refuse mode: a probe is answered "busy" at once, never queued
    assert isinstance(asked, S.TakeSlot)
    limits = asked.limits
    assert limits.upstream_busy == "refuse" and limits.queue_timeout_s == LIMITS.queue_timeout_s
    lc.slot_refused(Refusal("upstream_busy", "the upstream serves another session"))
    acts = take(lc)
    assert kinds(acts) == [S.WriteClient, S.CloseClient, S.End]
    assert acts[0][0] == encode.hello_response((0, 0, REFUSAL_CODES["upstream_busy"]), new_layout=True)
    rec = end(acts)
    assert rec["result"] == "probe" and rec["reason"] is None  # not counted in refusals_total


def test_a_probe_that_got_through_or_said_nothing_is_a_probe_and_an_identity_refusal_still_counts():
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT, "CN=client1", probe=True)
    lc.client_closed()  # connect's /readyz: TLS only, no HELLO
    assert end(take(lc))["result"] == "probe"
    lc = make(clock=clock)
    lc.admit(DEFAULT, "CN=client1", refusal=Refusal("identity_not_allowed", "not on the list"),
             identity_refused=True, probe=True)
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    rec = end(take(lc))
    assert rec["result"] == "refused" and rec["reason"] == "identity_not_allowed"


@pytest.mark.parametrize("role", ["serve", "connect"])
def test_a_client_that_leaves_before_its_hello_is_no_hello_not_ok(role):
    lc = make(role)
    lc.admit(DEFAULT, "CN=client1")
    take(lc)
    lc.client_closed()
    rec = end(take(lc))
    assert rec["result"] == "no_hello" and rec["reason"] is None and "before its HELLO" in rec["detail"]


def test_slot_granted_after_the_client_left_goes_straight_back():
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT)
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    take(lc)
    lc.client_closed()  # waiting for its HELLO reply: not a clean close
    assert end(take(lc))["reason"] == "client_closed_mid_frame" and lc.state == S.CLOSED
    lc.slot_granted()
    assert take(lc) == [S.FreeSlot()]


def test_upstream_connected_after_the_end_is_closed():
    clock = Clock()
    lc = make("connect", clock=clock)
    lc.admit(DEFAULT)
    take(lc)
    lc.shutdown()
    take(lc)
    lc.upstream_connected()
    assert take(lc) == [S.CloseUpstream()]


def test_data_before_the_hello_reply_is_refused_at_hello():
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT)
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    take(lc)
    feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)  # still queued, no HELLO reply yet
    acts = take(lc)
    assert acts[0] == S.WriteClient(encode.hello_response((0, 0, REFUSAL_CODES["refused"]), new_layout=True))
    rec = end(acts)
    assert rec["reason"] == "data_before_hello_reply" and rec["command"] == "DEVICE_COUNT"


# ----------------------------------------------------------------------------- upstream lost at each state
@pytest.mark.parametrize("role,reason", [("serve", "upstream_unavailable"), ("connect", "node_unreachable")])
def test_dial_failure_before_the_hello_is_answered_when_it_comes(role, reason):
    clock = Clock()
    lc = make(role, clock=clock)
    lc.admit(DEFAULT)
    if role == "serve":  # serve dials only after HELLO and the slot
        feed(lc.client_bytes, V.HELLO_REQ_V1, clock)
        lc.slot_granted()
    take(lc)
    lc.upstream_failed(Refusal(reason, "cannot reach it"))
    acts = take(lc)
    if role == "connect":
        assert lc.state == S.REFUSING and acts == []
        feed(lc.client_bytes, V.HELLO_REQ_V1, clock)
        acts = take(lc)
    assert acts[0] == S.WriteClient(encode.hello_response((0, 0, REFUSAL_CODES[reason]), new_layout=False))
    if role == "serve":
        assert S.FreeSlot() in acts
    assert end(acts)["reason"] == reason and lc.state == S.CLOSED


def test_serve_upstream_closed_at_hello():
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT)
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    lc.slot_granted()
    lc.upstream_connected()
    take(lc)
    lc.upstream_closed()
    acts = take(lc)
    assert kinds(acts) == [S.WriteClient, S.CloseClient, S.FreeSlot, S.End]  # gone: nothing to drain
    assert end(acts)["reason"] == "upstream_unavailable"


@pytest.mark.parametrize("hello,known,era", [(V.HELLO_REQ_V1, (7, 0, 0), "pre-4.0.0"), (V.HELLO_REQ_V4, (3, 6, 1), ">= 4.0.0")])
def test_upstream_closed_on_a_hello_of_the_other_era(hello, known, era):
    clock = Clock()
    lc = make(facts=UpstreamFacts(version=known, device_count=1), clock=clock)
    lc.admit(DEFAULT)
    feed(lc.client_bytes, hello, clock)
    lc.slot_granted()
    lc.upstream_connected()
    take(lc)
    lc.upstream_closed()
    rec = end(take(lc))
    assert rec["reason"] == "version_not_accepted" and era in rec["detail"]


@pytest.mark.parametrize("tls_reason", [None, "tls_unknown_ca"])
def test_connect_node_closing_after_the_handshake_is_a_tls_refusal(tls_reason):
    """Before the client's HELLO (TLS 1.3: the node's verdict on our certificate comes after
    the handshake): answered 0.0.9 once the HELLO arrives."""
    clock = Clock()
    lc = make("connect", clock=clock)
    lc.admit(DEFAULT)
    lc.upstream_connected()
    take(lc)
    lc.upstream_closed("alert" if tls_reason else "", tls_reason)
    acts = take(lc)
    assert acts == [S.CountTlsFailure(tls_reason or "tls_handshake_failed")] and lc.state == S.REFUSING
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    acts = take(lc)
    assert acts[0] == S.WriteClient(encode.hello_response((0, 0, REFUSAL_CODES["tls_failed"]), new_layout=True))
    assert S.CloseUpstream not in kinds(acts)  # already gone
    assert end(acts)["reason"] == "tls_failed"


@pytest.mark.parametrize("role", ["serve", "connect"])
def test_upstream_lost_during_the_session(role):
    lc = active(role)
    lc.upstream_closed("reset")
    acts = take(lc)
    expected = [S.CloseClient, S.FreeSlot, S.End] if role == "serve" else [S.CloseClient, S.End]
    assert kinds(acts) == expected
    rec = end(acts)
    assert rec["result"] == "error" and rec["reason"] == "upstream_closed" and rec["detail"] == "upstream closed: reset"


# ----------------------------------------------------------------------------- refusals during the session
def test_refusal_mid_session_closes_both_sides_and_names_the_command():
    clock = Clock()
    lc = active(clock=clock)
    out = feed(lc.client_bytes, V.DEVICE_COUNT_REQ + V.HELLO_REQ_V4, clock)
    assert not out.to_server  # nothing of the chunk is forwarded once a frame in it is refused
    acts = take(lc)
    assert kinds(acts) == [S.CloseClient, S.HalfCloseUpstream, S.End]
    rec = end(acts)
    assert rec["reason"] == "hello_repeated" and rec["command"] == "HELLO" and lc.state == S.DRAINING


def test_firewall_refusal_and_monitor_violation_are_counted():
    clock = Clock()
    lc = active(clock=clock)
    feed(lc.client_bytes, V.FREE_REQ, clock)  # a buffer this session never allocated
    acts = take(lc)
    assert acts[0] == S.CountViolation("buffer_unknown", "enforce", None, "FREE_BUFFER")
    monitor = Profile("m", SessionPolicy(mode="monitor", firewall=FirewallPolicy()), LIMITS)
    lc = active(clock=clock, profile=monitor)
    out = feed(lc.client_bytes, V.FREE_REQ, clock)
    assert sent(out.to_server) == V.FREE_REQ
    (counted,) = take(lc)
    assert isinstance(counted, S.CountViolation) and counted.violation is not None
    assert counted._replace(violation=None) == S.CountViolation("buffer_unknown", "monitor", None, "FREE_BUFFER")
    assert lc.state == S.ACTIVE and not lc.out.events


def test_the_audit_record_says_who_is_at_fault():
    """party: the refusal's own (a firewall rule: the client), else the reason's row."""
    clock = Clock()
    lc = active(clock=clock)
    feed(lc.client_bytes, V.FREE_REQ, clock)
    assert end(take(lc))["party"] == "client"
    lc = active(clock=clock)
    lc.upstream_closed()
    rec = end(take(lc))
    assert (rec["reason"], rec["party"]) == ("upstream_closed", "upstream")
    lc = active(clock=clock)
    lc.internal_error()
    assert end(take(lc))["party"] == "local"
    lc = active(clock=clock)
    lc.client_closed()
    rec = end(take(lc))
    assert (rec["result"], rec["party"]) == ("ok", None)


def test_internal_error_costs_one_session():
    lc = active()
    lc.internal_error()
    rec = end(take(lc))
    assert (rec["result"], rec["reason"], rec["detail"]) == ("error", "internal_error", "internal error (logged)")


# ----------------------------------------------------------------------------- timeouts
def tick_at(lc: Lifecycle, clock: Clock, dt: float) -> list[tuple[str, object]]:
    clock.now += dt
    lc.tick(clock.now)
    return take(lc)


@pytest.mark.parametrize("role", ["serve", "connect"])
def test_hello_timeout_counts_from_admission(role):
    clock = Clock()
    lc = make(role, clock=clock)
    clock.now += 100  # a slow TLS handshake is handshake_timeout_s's business (asyncio's)
    lc.tick(clock.now)
    assert take(lc) == []
    lc.admit(DEFAULT)
    take(lc)
    assert tick_at(lc, clock, 9.5) == []
    rec = end(tick_at(lc, clock, 1))
    assert rec["reason"] == "hello_timeout" and rec["detail"] == "no HELLO within 10 s"


@pytest.mark.parametrize("role", ["serve", "connect"])
def test_a_hello_trickled_a_byte_a_second_is_cut_by_its_age(role):
    clock = Clock()
    lc = make(role, clock=clock)
    lc.admit(DEFAULT)
    take(lc)
    acts: list = []
    for i in range(20):
        if i < len(V.HELLO_REQ_V4) - 1:
            feed(lc.client_bytes, V.HELLO_REQ_V4[i : i + 1], clock)
        acts = tick_at(lc, clock, 1)
        if acts:
            break
    assert end(acts)["reason"] == "hello_timeout" and i == 10  # hello_timeout_s after admission


def test_hello_timeout_uses_the_profile_limits():
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(TENANT)
    rec = end(tick_at(lc, clock, 2.5))
    assert rec["reason"] == "hello_timeout" and rec["profile"] == "tenant"


@pytest.mark.parametrize("role,deadline", [("serve", 10), ("connect", 40)])
def test_upstream_that_never_answers_hello(role, deadline):
    clock = Clock()
    lc = make(role, clock=clock)
    lc.admit(DEFAULT)
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    if role == "serve":
        lc.slot_granted()
    lc.upstream_connected()
    take(lc)
    assert tick_at(lc, clock, deadline - 0.5) == []
    acts = tick_at(lc, clock, 1)
    assert acts[0] == S.WriteClient(encode.hello_response((0, 0, REFUSAL_CODES["upstream_unavailable"]),
                                                             new_layout=True))
    rec = end(acts)
    assert rec["reason"] == "upstream_unavailable" and rec["detail"] == "the upstream did not answer HELLO"
    if role == "serve":  # the server may still answer: drained, never cut
        assert S.HalfCloseUpstream in kinds(acts) and lc.state == S.DRAINING


def test_queued_link_has_no_hello_deadline():
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT)
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    take(lc)
    assert tick_at(lc, clock, 25) == []  # the slot's queue_timeout_s bounds it (slot_refused)


def test_idle_timeout():
    clock = Clock()
    lc = active(clock=clock)
    assert tick_at(lc, clock, 29) == []
    feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)
    feed(lc.server_bytes, DC_RSP_1, clock)
    lc.out.clear()
    assert tick_at(lc, clock, 29) == []  # activity restarted the clock
    rec = end(tick_at(lc, clock, 2))
    assert rec["reason"] == "idle_timeout" and rec["detail"] == "idle for 31 s"


def test_waiting_for_a_response_is_not_idle():
    clock = Clock()
    lc = active(clock=clock)
    feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)
    lc.out.clear()
    assert tick_at(lc, clock, 45) == []  # the server computes; not a stalled request frame either


def test_frame_timeout_for_a_stalled_request_frame():
    clock = Clock()
    lc = active(clock=clock)
    feed(lc.client_bytes, V.GET_ALIGNMENT_REQ[:5], clock)
    assert tick_at(lc, clock, 1) == []  # the first tick that sees the frame: its age counts from here
    assert tick_at(lc, clock, 59) == []
    rec = end(tick_at(lc, clock, 2))
    assert rec["reason"] == "frame_timeout"
    assert rec["detail"] == "a request frame stalled for 61 s (0 bytes; the minimum is 16384 B/s after 60 s)"


def with_buffer(clock: Clock, limits: Limits = LIMITS) -> tuple[Lifecycle, bytes]:
    """An ACTIVE serve link with one 1 MiB buffer allocated; returns it and a 1 MiB tensor in it."""
    lc = active(clock=clock, profile=Profile("default", SessionPolicy(), limits))
    for request, answer in [(V.ALLOC_REQ_1MIB, V.ALLOC_RSP), (V.GET_BASE_REQ, V.GET_BASE_RSP)]:
        feed(lc.client_bytes, request, clock)
        feed(lc.server_bytes, answer, clock)
        lc.out.clear()
    t = encode.pack_tensor(encode.TensorSpec(buffer=V.HANDLE, data=V.BASE, ne=(1 << 18, 1, 1, 1)))
    return lc, t


def set_tensor_head(t: bytes, size: int) -> bytes:
    """The header and head of a SET_TENSOR of ``size`` bytes (the body is fed by the test)."""
    return struct.pack("<BQ", 6, len(t) + 8 + size) + t + struct.pack("<Q", 0)


def test_a_trickled_frame_is_cut_by_its_age_not_by_the_gap_since_its_last_byte():
    # issue 21: one byte every 20 s kept a 1 MiB SET_TENSOR (and the upstream) forever.
    clock = Clock()
    lc, t = with_buffer(clock)
    feed(lc.client_bytes, set_tensor_head(t, 1 << 20), clock)
    ends = []
    for second in range(1, 200):
        if second % 20 == 0:
            feed(lc.client_bytes, b"\0", clock)
            lc.out.clear()
        ends += [a.record for a in tick_at(lc, clock, 1) if isinstance(a, S.End)]
        if ends:
            break
    assert ends and ends[0]["reason"] == "frame_timeout", ends  # type: ignore[index]
    assert 60 < second <= 62 and lc.state == S.DRAINING


@pytest.mark.parametrize("rate_bps, cut", [(16384, False), (8192, True)])
def test_a_frame_arriving_at_the_minimum_rate_is_never_cut(rate_bps, cut):
    # 1 MiB at 16 KiB/s takes 64 s, past frame_timeout_s: the size buys the time; at half the
    # rate it falls behind once frame_timeout_s is spent.
    clock = Clock()
    lc, t = with_buffer(clock)
    feed(lc.client_bytes, set_tensor_head(t, 1 << 20), clock)
    left, ended = 1 << 20, []
    while left and not ended:
        n = min(rate_bps, left)
        feed(lc.client_bytes, bytes(n), clock)
        lc.out.clear()
        left -= n
        ended = [a.record for a in tick_at(lc, clock, 1) if isinstance(a, S.End)]
    assert bool(ended) == cut and (cut or lc.state == S.ACTIVE)
    if cut:
        assert ended[0]["reason"] == "frame_timeout" and "the minimum is 16384 B/s" in ended[0]["detail"]


def test_time_the_proxy_holds_the_client_back_does_not_count():
    clock = Clock()
    lc, t = with_buffer(clock)
    feed(lc.client_bytes, set_tensor_head(t, 1 << 20), clock)
    lc.upstream_blocked(True)  # the upstream's write buffer is full: the relay paused the client
    for _ in range(300):
        assert tick_at(lc, clock, 1) == []
    lc.upstream_blocked(False)
    assert tick_at(lc, clock, 1) == [] and tick_at(lc, clock, 59) == []
    assert end(tick_at(lc, clock, 2))["reason"] == "frame_timeout"


def test_the_frame_deadline_is_off_with_frame_timeout_zero():
    clock = Clock()
    lc, t = with_buffer(clock, Limits(frame_timeout_s=0))
    feed(lc.client_bytes, set_tensor_head(t, 1 << 20), clock)
    for _ in range(5):
        assert tick_at(lc, clock, 600) == []


# ----------------------------------------------------------------------------- the fair slot
def tick_waiting(lc: Lifecycle, clock: Clock, dt: float, waiting: int) -> list[tuple[str, object]]:
    clock.now += dt
    lc.tick(clock.now, waiting)
    return take(lc)


def test_an_idle_session_alone_is_never_ended():
    clock = Clock()
    lc = active(clock=clock, profile=Profile("default", SessionPolicy(), Limits()))
    for _ in range(24 * 60):
        assert tick_waiting(lc, clock, 60, 0) == []  # a day of llama-server idling between requests


def test_an_idle_session_is_ended_when_another_waits_for_the_upstream():
    clock = Clock()
    lc = active(clock=clock, profile=Profile("default", SessionPolicy(), Limits(idle_while_waiting_s=20)))
    for _ in range(600):
        assert tick_waiting(lc, clock, 1, 0) == []
    assert tick_waiting(lc, clock, 1, 1) != []  # idle for 10 minutes already: ended at the first tick
    rec = end(lc.actions or [S.End(lc.audit_record())])
    assert rec["reason"] == "idle_while_waiting" and "1 session(s) waited" in rec["detail"]
    assert rec["party"] == "client"


def test_work_restarts_the_fair_slot_clock_and_a_trickle_is_no_work():
    clock = Clock()  # the idle clock alone (the busy one: tests/unit/protocol/test_endings.py)
    lc = active(clock=clock, profile=Profile("default", SessionPolicy(),
                                             Limits(idle_while_waiting_s=20, hold_while_waiting_s=0)))
    feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)  # the server owes an answer: it works
    for _ in range(60):
        assert tick_waiting(lc, clock, 1, 1) == []
    feed(lc.server_bytes, DC_RSP_1, clock)
    lc.out.clear()
    for _ in range(19):
        assert tick_waiting(lc, clock, 1, 1) == []
    # A request a second (13 bytes: far below min_data_rate_bps) answered at once is no work.
    acts: list = []
    for _ in range(3):
        feed(lc.client_bytes, V.GET_ALIGNMENT_REQ, clock)
        feed(lc.server_bytes, V.GET_ALIGNMENT_RSP_32, clock)
        lc.out.clear()
        acts += tick_waiting(lc, clock, 1, 1)
    assert end(acts)["reason"] == "idle_while_waiting"


def test_a_client_that_does_not_read_the_answer_it_is_owed_is_not_working():
    clock = Clock()
    lc = active(clock=clock, profile=Profile("default", SessionPolicy(), Limits(idle_while_waiting_s=20)))
    feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)  # owed, but the client stopped reading
    lc.client_blocked(True)
    acts: list = []
    for _ in range(22):
        acts += tick_waiting(lc, clock, 1, 1)
    assert end(acts)["reason"] == "idle_while_waiting"


def test_a_session_sending_at_the_minimum_rate_works():
    clock = Clock()  # for the idle clock; hold_while_waiting_s bounds it (tests/unit/protocol/test_endings.py)
    lc, t = with_buffer(clock, Limits(idle_while_waiting_s=20, hold_while_waiting_s=0))
    for _ in range(100):
        feed(lc.client_bytes, set_tensor_head(t, 16384) + bytes(16384), clock)
        lc.out.clear()
        assert tick_waiting(lc, clock, 1, 1) == []


def test_the_fair_slot_is_off_with_zero():
    clock = Clock()
    lc = active(clock=clock, profile=Profile("default", SessionPolicy(), Limits(idle_while_waiting_s=0)))
    for _ in range(100):
        assert tick_waiting(lc, clock, 60, 3) == []


def test_frame_timeout_for_a_client_that_does_not_read():
    clock = Clock()
    lc = active(clock=clock, profile=Profile("busy", SessionPolicy(), Limits(frame_timeout_s=60)))
    lc.client_blocked(True)
    assert tick_at(lc, clock, 20) == []
    lc.client_blocked(False)
    assert tick_at(lc, clock, 50) == []
    lc.client_blocked(True)
    rec = end(tick_at(lc, clock, 61))
    assert rec["reason"] == "frame_timeout" and "has not read its responses for 61 s" in rec["detail"]


def test_session_lifetime():
    clock = Clock()
    lc = active(clock=clock, profile=Profile("long", SessionPolicy(), Limits(max_session_s=3600)))
    for _ in range(3):
        feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)
        feed(lc.server_bytes, DC_RSP_1, clock)
        lc.out.clear()
        assert tick_at(lc, clock, 1000) == []
    rec = end(tick_at(lc, clock, 700))
    assert rec["reason"] == "session_lifetime" and rec["detail"] == "session older than 3600 s"


# ----------------------------------------------------------------------------- shutdown (drain of rpcguard)
def test_admission_while_draining_is_refused_at_hello():
    clock = Clock()
    lc = make(clock=clock)
    lc.admit(DEFAULT, refusal=Refusal("shutdown", "rpcguard is shutting down"))
    feed(lc.client_bytes, V.HELLO_REQ_V4, clock)
    assert end(take(lc))["reason"] == "shutdown"


def test_shutdown_without_a_running_session():
    lc = make()
    lc.admit(DEFAULT)
    lc.shutdown()
    acts = take(lc)
    assert kinds(acts) == [S.CloseClient, S.End] and end(acts)["detail"] == "drain timeout reached"
    assert lc.state == S.CLOSED


def test_shutdown_cuts_a_running_session_and_drains_its_upstream():
    lc = active()
    lc.shutdown()
    acts = take(lc)
    assert kinds(acts) == [S.CloseClient, S.HalfCloseUpstream, S.End]
    assert end(acts)["reason"] == "shutdown" and lc.state == S.DRAINING
    lc.shutdown()  # a second drain pass finds it already over
    assert take(lc) == []
    lc.upstream_closed()
    assert take(lc) == [S.FreeSlot()]


def test_audit_record_fields():
    lc = active()
    lc.peer = "10.1.2.3:4444"
    lc.client_closed()
    rec = end(take(lc))
    assert set(rec) == {"event", "session", "role", "listener", "profile", "peer", "identity", "upstream", "version",
                        "duration_s", "result", "reason", "party", "command", "detail", "request_checks",
                        "alloc_bytes", "upload_bytes",
                        "hash_hit_bytes", "hash_answered_by_proxy", "compute_s_estimated", "commands"}
    assert rec["session"] == 7 and rec["identity"] == "CN=client1" and rec["duration_s"] == 0


# ----------------------------------------------------------------------------- one link state
def test_a_large_graph_is_the_validating_state_and_its_validation_takes_the_link_back():
    """"A graph is being validated" is the link's state, not a flag elsewhere: Deferred moves an
    ACTIVE link to VALIDATING (asking the relay to validate), GraphValidated back to ACTIVE."""
    from tests.unit.protocol.test_session import graph_frame
    clock = Clock()
    lc, _ = with_buffer(clock)
    lc.session.defer_graphs(from_bytes=1024)
    graph = graph_frame()
    out = feed(lc.client_bytes, graph + V.GET_ALIGNMENT_REQ, clock)
    assert sent(out.to_server) == b"" and lc.state == S.VALIDATING and take(lc) == [S.Validate()]
    assert lc.greeted and lc.client_data == lc.session.client_data  # still the session's own feed
    lc.session.validate_deferred()
    out = lc.graph_validated(clock.ns)
    assert lc.state == S.ACTIVE and sent(out.to_server) == graph + V.GET_ALIGNMENT_REQ and not take(lc)


def test_the_relay_reports_events_and_writes_no_field():
    """What the relay used to write into the lifecycle comes as events: who connected, the
    upstream's back-pressure, and a crash serve saw under the session (its cause and post-mortem)."""
    clock = Clock()
    lc = make(clock=clock)
    lc.accepted("10.0.0.9:5000", "10.0.0.9")
    assert (lc.peer, lc.source, lc.state) == ("10.0.0.9:5000", "10.0.0.9", S.HANDSHAKE)
    lc = active(clock=clock)
    lc.upstream_blocked(True)
    assert lc.client_held_back and lc.state == S.ACTIVE
    lc.upstream_blocked(False)
    assert not lc.client_held_back
    lc.session.record_recent()
    feed(lc.client_bytes, V.GET_ALIGNMENT_REQ, clock)
    lc.upstream_closed("eof", crashed=Refusal("upstream_crashed", "the server died of SIGSEGV", party="upstream"))
    rec = end(take(lc))
    assert lc.state == S.CLOSED and (rec["result"], rec["reason"], rec["party"]) == ("error", "upstream_crashed",
                                                                                      "upstream")
    assert rec["command"] == "GET_ALIGNMENT" and rec["post_mortem"]["last_requests"] == [["GET_ALIGNMENT", 4]]


# ----------------------------------------------------------------------------- the end notice
def notice_in(acts: list[S.Action]) -> Notice | None:
    writes = [a.data for a in acts if isinstance(a, S.WriteClient)]
    assert len(writes) <= 1, acts
    return decode_notice(writes[0][8:]) if writes else None


def test_serve_says_why_it_ends_a_session_before_closing_when_the_client_knows_the_notice():
    clock = Clock()
    lc = active(clock=clock, notices=True)
    feed(lc.client_bytes, V.DEVICE_COUNT_REQ + V.HELLO_REQ_V4, clock)
    acts = take(lc)
    assert kinds(acts) == [S.WriteClient, S.CloseClient, S.HalfCloseUpstream, S.End]
    assert notice_in(acts) == Notice("hello_repeated", end(acts)["detail"])
    # the same end without the notice negotiated: a bare close, as before
    lc = active(clock=clock)
    feed(lc.client_bytes, V.DEVICE_COUNT_REQ + V.HELLO_REQ_V4, clock)
    assert notice_in(take(lc)) is None


def test_serve_notices_ends_of_its_own_but_not_a_client_that_left():
    clock = Clock()
    lc = active(clock=clock, notices=True)
    assert notice_in(tick_at(lc, clock, 31)) == Notice("idle_timeout", "idle for 31 s")
    lc = active(notices=True)
    lc.shutdown()
    assert notice_in(take(lc)).reason == "shutdown"
    lc = active(notices=True)
    lc.client_closed()
    assert notice_in(take(lc)) is None


def test_serve_never_puts_a_notice_inside_a_response():
    clock = Clock()
    lc = active(clock=clock, notices=True)
    feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)
    feed(lc.server_bytes, DC_RSP_1[:5], clock)  # the client got part of the answer
    lc.out.clear()
    take(lc)
    lc.shutdown()
    acts = take(lc)
    assert notice_in(acts) is None and end(acts)["reason"] == "shutdown"
    # a refusal that drops bytes meant for the client (a whole answer and a bad one in one read)
    lc = active(clock=clock, notices=True)
    feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)
    lc.out.clear()
    feed(lc.server_bytes, DC_RSP_1 + DC_RSP_1, clock)
    acts = take(lc)
    assert end(acts)["reason"] == "response_unexpected" and notice_in(acts) is None


@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
@pytest.mark.parametrize("pending", [False, True])
def test_connect_logs_the_nodes_notice_as_its_reason_and_forwards_none_of_it(how, pending):
    clock = Clock()
    lc = active("connect", clock=clock, notices=True)
    if pending:  # the notice comes in place of the answer the client waits for
        feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)
        lc.out.clear()
    raw = encode_notice("idle_while_waiting", "held the node 21 s while 1 waited")
    out = feed(lc.server_bytes, raw + (DC_RSP_1 if how == "trailing" else b""), clock,
               "bytewise" if how == "bytewise" else "whole")
    assert not out.to_client
    rec = end(take(lc))
    assert rec["reason"] == "node_ended" and rec["result"] == "refused" and rec["party"] == "upstream"
    assert rec["detail"] == "the node ended the session: idle_while_waiting (held the node 21 s while 1 waited)"
    assert lc.state == S.CLOSED


def test_connect_refuses_a_notice_it_did_not_negotiate_and_a_malformed_one():
    clock = Clock()
    lc = active("connect", clock=clock)
    feed(lc.server_bytes, encode_notice("shutdown"), clock)
    assert end(take(lc))["reason"] == "response_unexpected"
    lc = active("connect", clock=clock, notices=True)
    feed(lc.server_bytes, encode_notice("shutdown")[:8] + b"Bad\0".ljust(NOTICE_HEAD, b"\0"), clock)
    rec = end(take(lc))
    assert rec["reason"] == "notice_invalid" and rec["party"] == "upstream"
