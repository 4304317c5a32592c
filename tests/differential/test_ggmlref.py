"""The harness itself: real constructors, abort isolation, and ggml-rpc's serialisation."""

from __future__ import annotations

import struct

from rpcguard.protocol import encode
from rpcguard.protocol.ggml import TYPES, op_table
from rpcguard.protocol.session import Session
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.tensor import decode_tensor, nbytes
from tests.support.ggmlref import BUFFER_SIZE, Built, Refused, build_many, kernel_refused

OPS = op_table((7, 0, 0)).ids  # type: ignore[union-attr]
MUL_MAT = {"leaves": [{"type": "q8_0", "ne": [64, 5]}, {"type": "f32", "ne": [64, 3, 2]}],
           "ops": [{"fn": "mul_mat", "args": [0, 1]}]}  # fmt: skip
BAD_MUL_MAT = {"leaves": [{"type": "f16", "ne": [64, 5]}, {"type": "f32", "ne": [63, 3]}],
               "ops": [{"fn": "mul_mat", "args": [0, 1]}]}  # fmt: skip
# A permuted (non-contiguous) view made contiguous, then soft_max with a mask: views, use counts.
CHAIN = {"leaves": [{"type": "f32", "ne": [8, 4, 2]}, {"type": "f16", "ne": [4, 8]}],
         "ops": [{"fn": "permute", "args": [0, 1, 0, 2, 3]}, {"fn": "cont", "args": [2]},
                 {"fn": "soft_max_ext", "args": [3, 1, 0.5, 0.0]}]}  # fmt: skip


def tensors(b: Built):
    return [decode_tensor(b.payload, b.tensor_bytes + 296 * i) for i in range(b.n_tensors)]


def test_aborting_constructor_is_isolated_and_the_batch_goes_on():
    res = build_many([MUL_MAT, BAD_MUL_MAT, MUL_MAT, BAD_MUL_MAT, BAD_MUL_MAT, CHAIN])
    assert [type(r) for r in res] == [Built, Refused, Built, Refused, Refused, Built]
    assert "GGML_ASSERT(ggml_can_mul_mat(a, b)) failed" in res[1].message
    assert "GGML_ASSERT" in res[4].message and len(res[5].nodes) == 3  # two aborts in a row, then a build


def test_mul_mat_is_serialised_like_serialize_graph():
    (b,) = build_many([MUL_MAT])
    device, n_nodes = struct.unpack_from("<II", b.payload)
    assert (device, n_nodes) == (0, 1)
    ts = tensors(b)
    a, x, dst = ts  # depth-first post-order: src[0], src[1], then the node
    assert b.nodes == [dst.id] and b.refs == [0, 1, 2]
    assert (a.type, a.ne, a.nb) == (8, (64, 5, 1, 1), (34, 68, 340, 340))  # q8_0: 2 blocks of 34 bytes
    assert (dst.type, dst.ne, dst.nb, dst.op) == (0, (5, 3, 2, 1), (4, 20, 60, 120), OPS["MUL_MAT"])
    assert dst.src[:2] == (a.id, x.id) and not any(dst.src[2:]) and dst.view_src == 0
    assert (a.use_count, x.use_count, dst.use_count) == (1, 1, 0)
    bufs = {h: (base, size) for h, base, size in b.buffers}
    assert len(b.buffers) == 3  # a buffer per tensor that owns memory, its data the first byte
    for t in ts:
        base, size = bufs[t.buffer]
        assert t.data == base and t.data + nbytes(t, TYPES[t.type]) <= base + size
        assert t.name.rstrip(b"\0") and t.name[-1] == 0
    # The project's own encoder writes the same bytes from the decoded fields.
    specs = [encode.TensorSpec(id=t.id, type=t.type, buffer=t.buffer, ne=t.ne, nb=t.nb, op=t.op,
                               op_params=t.op_params, flags=t.flags, src=t.src, view_src=t.view_src,
                               view_offs=t.view_offs, data=t.data, name=t.name, use_count=t.use_count)
             for t in ts]  # fmt: skip
    assert encode.graph_payload(b.nodes, specs) == b.payload


def test_views_point_into_their_source_and_nodes_come_in_graph_order():
    (b,) = build_many([CHAIN])
    ts = tensors(b)
    pos = {t.id: i for i, t in enumerate(ts)}
    for i, t in enumerate(ts):
        assert all(pos[s] < i for s in t.src if s)
        if t.view_src:
            assert t.data == ts[pos[t.view_src]].data + t.view_offs
    ops = [ts[pos[n]].op for n in b.nodes]
    assert ops == [OPS["PERMUTE"], OPS["CONT"], OPS["SOFT_MAX"]]
    perm = ts[pos[b.nodes[0]]]
    assert perm.ne == (4, 8, 2, 1) and perm.nb == (32, 4, 128, 256) and perm.op_params[:4] == (1, 0, 2, 3)


def test_a_built_graph_passes_through_a_whole_session():
    (b,) = build_many([CHAIN])
    # The device memory is known (a real client asked on an earlier connection): the session
    # then injects no GET_DEVICE_MEMORY whose answer this test would have to play.
    s = Session(None, UpstreamFacts(device_count=1, version=(7, 0, 0), memory={0: (BUFFER_SIZE, BUFFER_SIZE)}))
    s.client_data(memoryview(encode.hello_request((7, 0, 0))))
    s.server_data(memoryview(encode.hello_response((7, 0, 0))))
    graph = encode.request("GRAPH_COMPUTE", b.payload)
    for handle, base, size in b.buffers:
        s.client_data(memoryview(encode.request("ALLOC_BUFFER", struct.pack("<IQ", 0, size))))
        s.server_data(memoryview(encode.response(struct.pack("<QQ", handle, size))))
        s.client_data(memoryview(encode.request("BUFFER_GET_BASE", struct.pack("<Q", handle))))
        s.server_data(memoryview(encode.response(struct.pack("<Q", base))))
    s.to_server.clear()
    s.client_data(memoryview(graph))
    assert b"".join(bytes(c) for c in s.to_server) == graph


def test_a_later_split_sends_earlier_nodes_as_sources():
    whole, split = build_many([CHAIN, dict(CHAIN, first_node=2)])
    assert len(whole.nodes) == 3 and len(split.nodes) == 1
    ts = tensors(split)
    assert [t.op for t in ts] == [0, OPS["PERMUTE"], OPS["CONT"], 0, OPS["SOFT_MAX"]]
    assert split.nodes == [ts[-1].id]


# -- the kernel oracle (compute=True): the real CPU backend runs what the constructors built ----

ROPE_TAIL = [10000.0, 1.0, 0.0, 1.0, 32.0, 1.0]


def _rope(n_dims: int) -> dict:
    return {"leaves": [{"type": "f32", "ne": [16, 2, 3, 1]}, {"type": "i32", "ne": [3, 1, 1, 1]}],
            "ops": [{"fn": "rope_ext", "args": [0, 1, None, n_dims, 0, 4096, *ROPE_TAIL]}]}  # fmt: skip


# ggml_flash_attn_ext checks V only against K's head size: V with 32 rows for K's 256 is read past
# its end by the kernel (ops.cpp:8991). Its span ends at a guard page here: SIGSEGV.
SHORT_V = {"leaves": [{"type": "f32", "ne": [64, 4, 2, 1]}, {"type": "f16", "ne": [64, 256, 2, 1]},
                      {"type": "f16", "ne": [64, 32, 2, 1]}],
           "ops": [{"fn": "flash_attn_ext", "args": [0, 1, 2, None, 0.125, 0.0, 0.0]}]}  # fmt: skip
# 4096^3 multiply-adds: tens of seconds on one thread (its inputs are zero pages: no memory cost).
BIG_MUL_MAT = {"leaves": [{"type": "f32", "ne": [4096, 4096]}, {"type": "f32", "ne": [4096, 4096]}],
               "ops": [{"fn": "mul_mat", "args": [0, 1]}]}  # fmt: skip


def test_kernel_verdicts_abort_fault_and_clean_and_the_batch_goes_on():
    res = build_many([MUL_MAT, _rope(32), BAD_MUL_MAT, SHORT_V, CHAIN, _rope(8), dict(CHAIN, first_node=2)],
                     compute=True)
    assert [type(r) for r in res] == [Built, Built, Refused, Built, Built, Built, Built]
    assert res[0].kernel == "ok" and res[4].kernel == "ok" and res[5].kernel == "ok" and res[6].kernel == "ok"
    assert res[1].kernel.startswith("abort: ggml/src/ggml-cpu/ops.cpp:") and "n_dims <= ne0" in res[1].kernel
    assert "GGML_ASSERT(ggml_can_mul_mat(a, b)) failed" in res[2].message  # a constructor abort stays one
    assert res[3].kernel == "signal 11 (SIGSEGV)"
    assert [kernel_refused(r.kernel) for r in (res[0], res[1], res[3])] == [False, True, True]


def test_a_compute_past_the_time_bound_is_a_hang_and_the_next_recipe_runs():
    slow, after = build_many([BIG_MUL_MAT, MUL_MAT], compute=True, kernel_timeout_s=0.2)
    assert slow.kernel == "hang > 0.2 s" and kernel_refused(slow.kernel)
    assert after.kernel == "ok"


def test_without_compute_there_is_no_kernel_verdict():
    (b,) = build_many([_rope(32)])
    assert b.kernel is None and not kernel_refused(b.kernel)


# ggml_compute_forward_count_equal_i32 (ops.cpp:1649-1651) splits the row index with ne03/ne02
# where ne02*ne01/ne01 belong: some rows are read at a NEGATIVE offset. The second layout (data
# right after a guard page) catches it; the ASan server reports it too (asan_replay).
UNDERRUN = {"leaves": [{"type": "i32", "ne": [1, 1, 3, 3]}, {"type": "i32", "ne": [1, 1, 3, 3]}],
            "ops": [{"fn": "count_equal", "args": [0, 1]}]}  # fmt: skip
NO_UNDERRUN = {"leaves": [{"type": "i32", "ne": [5, 4, 1, 1]}, {"type": "i32", "ne": [5, 4, 1, 1]}],
               "ops": [{"fn": "count_equal", "args": [0, 1]}]}  # fmt: skip


def test_an_underrun_faults_in_the_second_layout():
    bad, good = build_many([UNDERRUN, NO_UNDERRUN], compute=True)
    assert bad.kernel == "signal 11 (SIGSEGV)" and good.kernel == "ok"
