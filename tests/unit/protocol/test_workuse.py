"""protocol/workuse.py: the kernels' per-thread use of the work buffer against the planner's
reservation (workbuf.planned_bytes), for every server thread count up to policy.server_threads.
The two holes of issue 28 item 1 (a quantizing CPY whose source rows are longer than its
destination's; SET_ROWS from F16 on more than one thread) are refused at exactly the thread
counts where the real kernel writes past the buffer, accepted where it does not."""

from __future__ import annotations

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import graph_payload
from rpcguard.protocol.graph import GraphValidator
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.tensor import decode_tensor
from rpcguard.protocol.encode import pack_tensor
from rpcguard.protocol.workbuf import CACHE_LINE_MIN, ONE_TASK_OPS, planned_bytes
from rpcguard.protocol.workuse import USES, kernel_bytes, overflow
from tests.unit.protocol.test_oprules import OPS, T, state

F32, F16, Q4_0, Q8_0, Q4_K, I64 = 0, 1, 2, 8, 12, 27


def dec(spec):
    return decode_tensor(memoryview(pack_tensor(spec)))


def with_add(tensors, node):
    """``node`` with a small ADD listed before it: ADD plans n_threads tasks, so the whole graph,
    ``node`` included, runs on all the server's threads (ggml-cpu.c:2259-2270, :3055)."""
    x = T(0x30, F32, (4, 2, 1, 1))
    y = T(0x31, F32, (4, 2, 1, 1))
    add = T(0x32, F32, (4, 2, 1, 1), op=OPS["ADD"], src=(0x30, 0x31))
    return [*tensors, x, y, add], node, [add.id, node.id]


def verdict(tensors, node, threads: int, nodes=None) -> str:
    v = GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=16, server_threads=threads))
    try:
        v.check(memoryview(graph_payload(nodes or [node.id], tensors + [node])), state())
    except FirewallRefusal as e:
        return e.reason
    return "ok"


def quantizing_cpy(src_ne, dst_ne, dst_type=Q8_0):
    """CPY of an F32 tensor into a contiguous block-type tensor of the same element count."""
    a = T(0x10, F32, src_ne)
    b = T(0x11, dst_type, dst_ne)
    d = T(0x20, dst_type, dst_ne, op=OPS["CPY"], src=(0x10, 0x11), view_src=0x11, data=b.data)
    return [a, b], d


def set_rows_f16(row, rows, dst_type=F32):
    src = T(0x10, F16, (row, rows, 1, 1))
    idx = T(0x11, I64, (rows, 1, 1, 1))
    dst = T(0x12, dst_type, (row, rows + 2, 1, 1))
    d = T(0x20, dst_type, dst.ne, op=OPS["SET_ROWS"], src=(0x10, 0x11, 0x12), view_src=0x12, data=dst.data)
    return [src, idx, dst], d


def first_overflow(kind: str, node_op: str, tensors, node) -> int | None:
    """The model's first overflowing thread count (None: none up to 64), straight from workuse."""
    n = dec(node)
    by_id = {t.id: dec(t) for t in tensors}
    srcs = [by_id.get(i) for i in node.src] + [None] * (10 - len(node.src))
    hit = overflow(node_op, n, srcs, 64)
    return None if hit is None else hit[0]


# -- (a) quantizing CPY with source rows longer than the destination's --------------------------


def test_cpy_source_row_longer_than_destination_row_overflows_on_one_thread():
    # 4096-float source rows into 32-element q8_0 rows: the planner reserves 4*32 + 64 bytes on
    # one thread (ggml-cpu.c:2862, :3051), the kernel writes 16 KiB (ops.cpp:297)
    tensors, d = quantizing_cpy((4096, 2, 1, 1), (32, 256, 1, 1))
    assert verdict(tensors, d, 1) == "work_buffer_overflow"
    assert first_overflow("cpy", "CPY", tensors, d) == 1


@pytest.mark.parametrize("dst_type", [Q4_0, Q8_0, Q4_K])
def test_cpy_same_rows_is_accepted_at_every_thread_count(dst_type):
    tensors, d = quantizing_cpy((256, 4, 2, 1), (256, 4, 2, 1), dst_type)
    for threads in (1, 2, 3, 4, 8, 64):
        assert verdict(tensors, d, threads) == "ok"


def test_cpy_source_row_one_block_longer_overflows_on_one_thread():
    # rows are whole blocks (the rule), so a longer source row is at least 32 floats longer: 128
    # bytes past the planner's row, twice its 64-byte pad, already on a one-thread server
    tensors, d = quantizing_cpy((64, 2, 1, 1), (32, 4, 1, 1))
    assert verdict(tensors, d, 1) == "work_buffer_overflow"


def test_cpy_rows_are_split_in_blocks_over_the_threads():
    # ops.cpp:284-289: 3 source rows on 8 threads -> blocks of 1, threads 0..2 write; on 2
    # threads blocks of 2, both write
    a = dec(T(0x10, F32, (64, 3, 1, 1)))
    n = dec(T(0x20, Q8_0, (32, 6, 1, 1)))
    srcs = [a] + [None] * 9
    assert kernel_bytes("CPY", n, srcs, 8) == 3 * 256 + 2 * CACHE_LINE_MIN
    assert kernel_bytes("CPY", n, srcs, 2) == 2 * 256 + CACHE_LINE_MIN
    assert kernel_bytes("CPY", n, srcs, 1) == 256


# -- (b) SET_ROWS from F16 on more than one thread --------------------------------------------


@pytest.mark.parametrize("dst_type", [F32, Q8_0, Q4_0])
def test_set_rows_from_f16_overflows_once_two_threads_write(dst_type):
    # 256-byte rows, one task planned (ggml-cpu.c:2367), in a graph that runs on every thread
    tensors, d, nodes = with_add(*set_rows_f16(64, 4, dst_type))
    assert verdict(tensors, d, 1, nodes) == "ok"
    for threads in (2, 3, 4, 8):
        assert verdict(tensors, d, threads, nodes) == "work_buffer_overflow"
    assert first_overflow("set_rows", "SET_ROWS", tensors, d) == 2


def test_set_rows_from_f16_alone_runs_on_one_thread():
    # a graph of one-task ops (here the lone SET_ROWS, as test-backend-ops builds it) runs on
    # min(largest task count, -t) = 1 thread (ggml-cpu.c:3055): accepted at any server size
    tensors, d = set_rows_f16(64, 4)
    assert verdict(tensors, d, 64) == "ok"


def test_set_rows_from_f16_with_one_row_or_short_rows_is_accepted():
    tensors, d, nodes = with_add(*set_rows_f16(64, 1))  # one row: one writer
    assert verdict(tensors, d, 64, nodes) == "ok"
    # 64-byte rows: the planner's per-thread line covers a second writer's row; 4 rows on 3
    # threads go in blocks of 2 (two writers), on 4 threads every thread writes one
    tensors, d, nodes = with_add(*set_rows_f16(16, 4))
    assert verdict(tensors, d, 3, nodes) == "ok"
    assert verdict(tensors, d, 4, nodes) == "work_buffer_overflow"


def test_a_node_accepted_in_a_one_thread_graph_is_checked_again_beside_an_add():
    # the node cache keys the one-thread verdict apart: the same SET_ROWS bytes in a graph with
    # an ADD are refused on the same session
    tensors, d = set_rows_f16(64, 4)
    v = GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=16, server_threads=4))
    st = state()
    v.check(memoryview(graph_payload([d.id], tensors + [d])), st)
    tensors2, d2, nodes = with_add(tensors, d)
    with pytest.raises(FirewallRefusal) as exc:
        v.check(memoryview(graph_payload(nodes, tensors2 + [d2])), st)
    assert exc.value.reason == "work_buffer_overflow"


def test_set_rows_from_f32_or_into_f16_uses_no_scratch():
    for src_type, dst_type in ((F32, Q8_0), (F16, F16)):
        src = T(0x10, src_type, (64, 4, 1, 1))
        idx = T(0x11, I64, (4, 1, 1, 1))
        dst = T(0x12, dst_type, (64, 6, 1, 1))
        d = T(0x20, dst_type, dst.ne, op=OPS["SET_ROWS"], src=(0x10, 0x11, 0x12), view_src=0x12, data=dst.data)
        assert verdict([src, idx, dst], d, 64) == "ok"


# -- the model against itself ------------------------------------------------------------------


def test_every_op_with_a_kernel_use_has_a_planner_reservation():
    """An op whose kernel uses scratch but for which the planner reserves nothing would be refused
    always; the model names the planner's reservation for every op it names a use for."""
    from rpcguard.protocol.workbuf import _WORK

    assert set(USES) - set(_WORK) == {"CONT"}  # ggml-cpu.c:2852: CPY and DUP only; CONT same-type


def test_cont_keeps_its_type_so_uses_no_scratch():
    a = dec(T(0x10, F32, (64, 4, 1, 1)))
    n = dec(T(0x20, F32, (256, 1, 1, 1)))
    assert kernel_bytes("CONT", n, [a] + [None] * 9, 8) == 0


def test_per_thread_rows_layout():
    # SOFT_MAX on 4 threads, 8 rows of 100: (100*4 + 64) * 3 + 400 bytes touched, reserved
    # 4*100*4 + 64*4 (n_tasks = min(4, rows) = 4)
    a = dec(T(0x10, F32, (100, 8, 1, 1)))
    n = dec(T(0x20, F32, (100, 8, 1, 1)))
    srcs = [a] + [None] * 9
    assert kernel_bytes("SOFT_MAX", n, srcs, 4) == 464 * 3 + 400
    assert planned_bytes("SOFT_MAX", n, srcs, 4) == 1600 + CACHE_LINE_MIN * 4


# -- the thread count the check runs to ----------------------------------------------------------


@pytest.mark.parametrize("argv, threads", [
    (("ggml-rpc-server", "-t", "4"), 4),
    (("ggml-rpc-server", "-H", "127.0.0.1", "--threads", "12", "-c"), 12),
])
def test_contained_serve_checks_the_thread_count_it_starts_the_server_with(argv, threads):
    from rpcguard.protocol.settings import Profile
    from rpcguard.upstream.pool import UpstreamSettings
    from rpcguard.upstream.runtime import contain

    n = UpstreamSettings(exec=argv).server_threads
    assert n == threads
    assert contain(Profile(), n).policy.firewall.server_threads == threads
    assert contain(Profile(), n).policy.firewall.contained


def test_contained_serve_without_t_checks_the_servers_default():
    import os

    from rpcguard.upstream.pool import UpstreamSettings

    # rpc-server.cpp:89: half the hardware threads, at least one
    assert UpstreamSettings(exec=("ggml-rpc-server",)).server_threads == max(1, (os.cpu_count() or 1) // 2)


# -- properties: the reduced check equals the check at every thread count ------------------------


def _random_node(r, op):
    types = (F32, F16, Q8_0, Q4_0, Q4_K, 30)  # 30: BF16

    def t(i, typ=None):
        typ = r.choice(types) if typ is None else typ
        blk = 256 if typ == Q4_K else 32 if typ in (Q8_0, Q4_0) else 1
        ne = (blk * r.randint(1, 9), r.choice((1, 2, 3, 5, 17, 70)), r.choice((1, 2, 3)), 1)
        return dec(T(i, typ, ne))

    n = t(0x20)
    srcs = [t(0x10 + i) for i in range(3)] + [None] * 7
    return n._replace(param0=r.choice((0, 1, 2))), srcs


@pytest.mark.parametrize("op", sorted(USES))
def test_the_break_points_decide_like_every_thread_count(op):
    import random

    r = random.Random(f"workuse:{op}")
    for _ in range(150):
        n, srcs = _random_node(r, op)
        for s_threads, g in ((r.choice((1, 2, 3, 4, 8, 64)), None), (r.choice((4, 64)), 1)):
            brute = next((t for t in range(1, s_threads + 1)
                          if 0 < kernel_bytes(op, n, srcs, min(t, g or t)) > planned_bytes(op, n, srcs, t)), None)
            got = overflow(op, n, srcs, s_threads, g)
            assert (got is None) == (brute is None), (op, n, srcs, s_threads, g, got, brute)
            if got is not None:
                t, used, reserved = got
                assert used == kernel_bytes(op, n, srcs, min(t, g or t)) > reserved == planned_bytes(op, n, srcs, t)


@pytest.mark.parametrize("op", sorted(USES))
def test_the_planners_need_is_affine_in_its_task_count(op):
    # overflow() takes the planner's need as base + slope * n_tasks (workbuf.work_bytes)
    import random

    from rpcguard.protocol.workbuf import work_bytes

    r = random.Random(f"affine:{op}")
    for _ in range(100):
        n, srcs = _random_node(r, op)
        w = [work_bytes(op, n, srcs, k) for k in range(0, 6)]
        assert all(w[k] - w[0] == k * (w[1] - w[0]) for k in range(6)), (op, w)


@pytest.mark.parametrize("op", ["CPY", "SET_ROWS", "SOFT_MAX", "ADD", "ROPE", "FLASH_ATTN_EXT", "TOP_K", "OUT_PROD"])
def test_the_acceptance_generators_cases_fit_the_planners_reservation(op):
    """Every case tests/fuzz/accept_gen.py keeps (what serve forwards) has, for each computed node,
    kernel use <= the planner's reservation at every thread count up to 64, and the planner-edge
    draws include cases refused for it (so the edge is drawn on both sides)."""
    from tests.fuzz import accept_gen as gen

    kept = refused = 0
    for case, why in gen.generate(op, 5, 12):
        refused += why.get("work_buffer_overflow", 0)
        if case is None:
            continue
        blobs = gen.materialize(case, gen.handles_fake(case))
        by_id = {t.id: decode_tensor(memoryview(b)) for t, b in zip(case.tensors, blobs)}
        for nid in case.nodes:
            n = by_id[nid]
            if 0 in n.ne:
                continue
            srcs = [by_id.get(i) for i in case.by_id(nid).src]
            name = gen.TABLE.names[case.by_id(nid).op]
            one = all(gen.TABLE.names[case.by_id(i).op] in ONE_TASK_OPS for i in case.nodes)
            assert overflow(name, n, srcs, 64, 1 if one else None) is None, case.describe()
            kept += 1
    assert kept >= 12
    if op in ("CPY", "SET_ROWS"):
        assert refused, f"no {op} candidate at the planner's edge was refused work_buffer_overflow"


def test_the_cpu_planners_checks_do_not_apply_on_a_cuda_node():
    """ggml_graph_plan is the CPU backend's: a CUDA node runs no such work buffer, so the CPY that
    overflows it on the CPU is not refused work_buffer_overflow on the cuda layer (the CUDA layer's
    own rows decide there: CPY F32 -> q8_0 is one CUDA supports)."""
    tensors, d = quantizing_cpy((4096, 2, 1, 1), (32, 256, 1, 1))
    payload = memoryview(graph_payload([d.id], tensors + [d]))
    cpu = GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=16, server_threads=4, backend="cpu"))
    with pytest.raises(FirewallRefusal) as info:
        cpu.check(payload, state())
    assert info.value.reason == "work_buffer_overflow"
    GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=16, server_threads=4, backend="cuda")).check(payload, state())
