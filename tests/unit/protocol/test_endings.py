"""protocol/endings.py's fair slot (issue 28 item 4, issue 31 item 1): what a session holding the
upstream may do while another waits for it.

``idle_while_waiting_s`` (continuous idle, the operator's preemption of idle holders) is tested in
tests/unit/protocol/test_lifecycle.py; here ``hold_while_waiting_s``: once another session waits, the
holder has that long more (every second with preemption on; only its busy ticks with
``idle_while_waiting_s: 0``), or that much estimated compute, GRAPH_RECOMPUTE included. A frame
trickled at just over ``min_data_rate_bps``, a stream of small frames, a slow reader and a
GRAPH_RECOMPUTE flood are all ended; alone nothing is charged (a 1.7 GB model upload over a slow
link passes), and without preemption an idle holder (llama-server between requests) never is.
"""

from __future__ import annotations

import struct
from typing import Callable

import pytest

from rpcguard.protocol import encode
from rpcguard.protocol.encode import TensorSpec
from rpcguard.protocol.ggml import op_table
from rpcguard.protocol.lifecycle import Lifecycle
from rpcguard.protocol.settings import FirewallPolicy, Limits, Profile, SessionPolicy
from tests.support import vectors as V
from tests.unit.protocol.test_lifecycle import DC_RSP_1, Clock, active, end, feed, set_tensor_head, take, with_buffer
from tests.support.imports import imported

RATE = Limits().min_data_rate_bps
BUSY = 20.0
# Over the minimum rate, so frame_timeout never fires: on main this held the slot forever.
JUST_OVER = RATE + 1


def tick(lc: Lifecycle, clock: Clock, waiting: int, dt: float = 1.0) -> list[tuple[str, object]]:
    clock.now += dt
    lc.tick(clock.now, waiting)
    return take(lc)


def run_until_end(lc: Lifecycle, clock: Clock, waiting: int, seconds: int, each=None) -> tuple[int, dict] | None:
    """Tick once a second for ``seconds`` (``each()`` before every tick); (second, record) of the end."""
    for second in range(1, seconds + 1):
        if each is not None:
            each()
        acts = tick(lc, clock, waiting)
        if acts:
            return second, end(acts)
    return None


def trickle(lc: Lifecycle, clock: Clock, t: bytes) -> Callable[[], None]:
    """Back-to-back SET_TENSORs of the whole 1 MiB tensor, fed JUST_OVER bytes a second (one frame
    takes 64 s: a frame is nearly always in progress at a tick)."""
    frame = set_tensor_head(t, 1 << 20) + bytes(1 << 20)
    stream = memoryview(frame)

    def each() -> None:
        nonlocal stream
        got = bytes(stream[:JUST_OVER])
        stream = stream[JUST_OVER:]
        if len(got) < JUST_OVER:
            stream = memoryview(frame)[JUST_OVER - len(got):]
            got += frame[:JUST_OVER - len(got)]
        feed(lc.client_bytes, got, clock)
        lc.out.clear()
    return each


# ----------------------------------------------------------------------------- slow senders
@pytest.mark.parametrize("preempt", [BUSY, 0], ids=["preemption", "no_preemption"])
def test_a_frame_trickled_just_over_the_minimum_rate_is_ended_when_another_waits(preempt):
    clock = Clock()
    lc, t = with_buffer(clock, Limits(hold_while_waiting_s=BUSY, idle_while_waiting_s=preempt))
    each = trickle(lc, clock, t)
    assert run_until_end(lc, clock, 0, 300, each) is None  # alone: the frame is within its deadline
    got = run_until_end(lc, clock, 1, 60, each)
    assert got is not None, "the trickle held the slot while another waited"
    second, rec = got
    assert second <= BUSY + 2  # the first waiting tick starts the clock; then BUSY (busy) seconds
    assert rec["reason"] == "hold_while_waiting" and rec["party"] == "client" and rec["result"] == "refused"
    assert "1 session(s) waited for it" in rec["detail"] and "hold_while_waiting_s 20" in rec["detail"]


@pytest.mark.parametrize("preempt", [BUSY, 0], ids=["preemption", "no_preemption"])
def test_a_stream_of_small_frames_at_the_minimum_rate_is_ended_when_another_waits(preempt):
    # Frames that each complete between ticks were "work" for idle_while_waiting_s: never ended.
    clock = Clock()
    lc, t = with_buffer(clock, Limits(hold_while_waiting_s=BUSY, idle_while_waiting_s=preempt))

    def each() -> None:
        feed(lc.client_bytes, set_tensor_head(t, RATE) + bytes(RATE), clock)
        lc.out.clear()
    got = run_until_end(lc, clock, 1, 60, each)
    assert got is not None and got[0] <= BUSY + 2 and got[1]["reason"] == "hold_while_waiting"


def test_an_upload_alone_is_never_charged():
    # A 1.7 GB model load over a slow link (at 16 KiB/s 29 h: here an hour of ticks) passes alone.
    clock = Clock()
    lc, t = with_buffer(clock, Limits(hold_while_waiting_s=BUSY))
    each = trickle(lc, clock, t)
    assert run_until_end(lc, clock, 0, 3600, each) is None
    assert lc.wait_t == 0.0 and lc.busy_waited == 0.0


@pytest.mark.parametrize("preempt, within", [(BUSY, (BUSY, BUSY + 2)), (0, (2 * BUSY - 2, 2 * BUSY + 3))],
                         ids=["preemption", "no_preemption"])
def test_work_now_and_then_does_not_restart_the_share(preempt, within):
    # Busy one second, idle the next: the idle clock restarts at every busy tick (never ended on
    # main). With preemption every second counts; without it the busy ones add up.
    clock = Clock()
    lc, t = with_buffer(clock, Limits(idle_while_waiting_s=preempt, hold_while_waiting_s=BUSY))
    n = [0]

    def each() -> None:
        n[0] += 1
        if n[0] % 2:
            feed(lc.client_bytes, set_tensor_head(t, 2 * RATE) + bytes(2 * RATE), clock)
            lc.out.clear()
    got = run_until_end(lc, clock, 1, 120, each)
    assert got is not None and got[1]["reason"] == "hold_while_waiting"
    assert within[0] <= got[0] <= within[1], got[0]


def test_a_session_alone_working_all_the_time_is_never_ended():
    # llama-server generating: a request answered and the next one owed at every tick, for 6 h,
    # nobody waiting.
    clock = Clock()
    lc, _ = with_buffer(clock, Limits(hold_while_waiting_s=BUSY))
    feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)

    def each() -> None:
        feed(lc.server_bytes, DC_RSP_1, clock)
        feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)
        lc.out.clear()
    assert run_until_end(lc, clock, 0, 6 * 3600, each) is None


def test_the_clock_starts_when_another_begins_waiting_and_restarts_with_the_next_wait():
    clock = Clock()
    lc, t = with_buffer(clock, Limits(hold_while_waiting_s=BUSY))
    each = trickle(lc, clock, t)
    assert run_until_end(lc, clock, 0, 1000, each) is None  # busy 1000 s alone: nothing owed
    assert run_until_end(lc, clock, 1, 15, each) is None  # 15 s of someone waiting
    assert run_until_end(lc, clock, 0, 5, each) is None  # it gave up (queue_timeout_s)
    assert run_until_end(lc, clock, 2, 15, each) is None  # a new wait: a new share
    got = run_until_end(lc, clock, 2, 10, each)
    assert got is not None and got[1]["reason"] == "hold_while_waiting" and "2 session(s)" in got[1]["detail"]


def test_a_slow_reader_is_busy():
    # Owed an answer that it does not read: flow control holds the server back; still the holder's time.
    clock = Clock()
    lc = active(clock=clock, profile=Profile("default", SessionPolicy(), Limits(idle_while_waiting_s=0,
                                                                                 hold_while_waiting_s=BUSY)))
    feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)
    lc.out.clear()
    got = run_until_end(lc, clock, 1, 60, lambda: lc.client_blocked(not lc.client_blocked_since))
    assert got is not None and got[0] <= BUSY + 2 and got[1]["reason"] == "hold_while_waiting"


# ----------------------------------------------------------------------------- idle holders (issue 31)
def test_an_idle_holder_is_not_charged_and_without_preemption_is_never_ended():
    # llama-server between requests holds its buffers: only idle_while_waiting_s (the operator's
    # preemption) may end it; with it off, a day of someone waiting ends nothing.
    clock = Clock()
    lc, _ = with_buffer(clock, Limits(idle_while_waiting_s=0, hold_while_waiting_s=BUSY))
    assert run_until_end(lc, clock, 1, 24 * 3600) is None
    assert lc.busy_waited == 0.0


def test_hold_while_waiting_zero_is_off():
    clock = Clock()
    lc, t = with_buffer(clock, Limits(hold_while_waiting_s=0, idle_while_waiting_s=0))
    assert run_until_end(lc, clock, 3, 600, trickle(lc, clock, t)) is None


# ----------------------------------------------------------------------------- compute, GRAPH_RECOMPUTE included
N = 128  # a MUL_MAT of two 128x128 F32 matrices in the session's 1 MiB buffer
MUL_MAT = op_table((7, 0, 0)).ids["MUL_MAT"]  # type: ignore[union-attr]


def graph_frame() -> bytes:
    a = TensorSpec(id=0x10, buffer=V.HANDLE, data=V.BASE, ne=(N, N, 1, 1))
    b = TensorSpec(id=0x11, buffer=V.HANDLE, data=V.BASE + 4 * N * N, ne=(N, N, 1, 1))
    d = TensorSpec(id=0x20, buffer=V.HANDLE, data=V.BASE + 8 * N * N, ne=(N, N, 1, 1), op=MUL_MAT, src=(0x10, 0x11))
    return encode.request("GRAPH_COMPUTE", encode.graph_payload([d.id], [a, b, d]))


def computing(gflops: float, limits: Limits) -> tuple[Lifecycle, Clock, int]:
    """An ACTIVE serve session (the node priced at ``gflops``) that sent one GRAPH_COMPUTE; returns
    it, its clock and the graph's estimate (flop)."""
    clock = Clock()
    lc = active(clock=clock, profile=Profile("default", SessionPolicy(firewall=FirewallPolicy(node_gflops=gflops)),
                                             limits))
    for request, answer in [(V.ALLOC_REQ_1MIB, V.ALLOC_RSP), (V.GET_BASE_REQ, V.GET_BASE_RSP)]:
        feed(lc.client_bytes, request, clock)
        feed(lc.server_bytes, answer, clock)
        lc.out.clear()
    assert lc.session is not None
    feed(lc.client_bytes, graph_frame(), clock)
    assert not lc.actions, lc.actions
    lc.out.clear()
    cost = lc.session.state.graph_flops[0]
    assert cost > 0 and lc.session.state.compute_flops == cost
    return lc, clock, cost


def recompute(lc: Lifecycle, clock: Clock, n: int = 1) -> None:
    feed(lc.client_bytes, V.RECOMPUTE_REQ_0 * n, clock)
    assert not lc.actions, lc.actions
    lc.out.clear()


def test_every_recompute_is_charged_its_stored_graph():
    lc, clock, cost = computing(40.0, Limits())
    recompute(lc, clock, 25)
    assert lc.session is not None and lc.session.state.compute_flops == 26 * cost
    assert lc.audit_record()["compute_s_estimated"] == round(26 * cost / 40e9, 3)


def test_a_recompute_flood_is_bounded_when_another_waits():
    # 4 bytes each, no answer, and on main no bound but the queue of one answer's worth
    # (max_graph_compute_s, 900 s): the stored graph ran again and again while the other tenant waited.
    gflops = 1.0
    lc, clock, cost = computing(gflops, Limits(idle_while_waiting_s=0, hold_while_waiting_s=BUSY))
    per_graph_s = cost / (gflops * 1e9)
    assert per_graph_s < BUSY / 4, per_graph_s
    assert run_until_end(lc, clock, 1, 2) is None  # someone waits: the share starts
    n = int(BUSY / per_graph_s)  # just under the share: not ended (the ticks in between are idle)
    recompute(lc, clock, n - 1)
    assert tick(lc, clock, 1) == []
    recompute(lc, clock, 3)  # past it
    rec = end(tick(lc, clock, 1))
    assert rec["reason"] == "hold_while_waiting" and "s of estimated compute" in rec["detail"]


def test_a_recompute_flood_alone_is_charged_but_not_ended():
    gflops = 1.0
    lc, clock, cost = computing(gflops, Limits(hold_while_waiting_s=BUSY))
    for _ in range(10):
        recompute(lc, clock, int(BUSY * gflops * 1e9 / cost))  # a share's worth a second, nobody waits
        assert tick(lc, clock, 0) == []
        feed(lc.client_bytes, V.DEVICE_COUNT_REQ, clock)  # an answer empties the server's queue
        feed(lc.server_bytes, encode.response(struct.pack("<I", 1)), clock)
        lc.out.clear()
    assert lc.session is not None
    assert lc.session.state.compute_flops == (1 + 10 * int(BUSY * gflops * 1e9 / cost)) * cost


def test_endings_read_a_lifecycle_through_a_protocol():
    """endings <-> lifecycle was an import cycle (behind TYPE_CHECKING): endings reads the fields it
    needs through ``EndingFacts`` (a Protocol) and imports no lifecycle."""
    assert "rpcguard.protocol.lifecycle" not in imported("rpcguard/protocol/endings.py")
