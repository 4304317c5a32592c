"""protocol/cost.py and the graph rules built on it: the planner's work buffer, the compute
budget, and the reach rules for flattened rows and elements (issue 20, classes 1-5)."""

from __future__ import annotations

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.cost import BYTE_FLOPS, PRICES, flops, moved_bytes
from rpcguard.protocol.workbuf import work_bytes
from rpcguard.protocol.encode import graph_payload
from rpcguard.protocol.graph import GraphValidator
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.tensor import decode_tensor
from rpcguard.protocol.encode import pack_tensor
from tests.unit.protocol.test_oprules import BASE, OPS, SIZE, T, f, reason, run, state

F32, F16, Q8_0, I32 = 0, 1, 8, 26


def dec(spec):
    return decode_tensor(memoryview(pack_tensor(spec)), 0)


# -- class 1: kernels that walk rows flattened through nb1 ----------------------------------


def clamp(src_ne, src_nb, data=BASE + 0x10000, inplace=False):
    a = T(0x10, F32, src_ne, nb=src_nb, data=data)
    params = (f(-1.0), f(1.0))
    if inplace:
        d = T(0x20, F32, src_ne, nb=src_nb, op=OPS["CLAMP"], src=(0x10,), view_src=0x10, data=data,
              op_params=params)
    else:
        d = T(0x20, F32, src_ne, op=OPS["CLAMP"], src=(0x10,), op_params=params)
    return [a], d


def test_flat_rows_through_a_size_one_stride_are_refused():
    # ne1 == 1: the rule does not look at nb1, the clamp kernel (ops.cpp clamp_f32) walks row i at i*nb1
    # for i < ne1*ne2*ne3 = 8: 7 * 4 MiB past the data of a 16 MiB buffer
    assert reason(*clamp((4, 1, 8, 1), (4, 4 << 20, 16, 128))) == "tensor_layout_invalid"
    # the in-place variant writes there: the same
    assert reason(*clamp((4, 1, 8, 1), (4, 4 << 20, 16, 128), inplace=True)) == "tensor_layout_invalid"


def test_flat_rows_inside_the_buffer_pass():
    run(*clamp((4, 1, 8, 1), (4, 16, 16, 128)))  # what ggml_new_tensor builds (nb1 == nb2)
    run(*clamp((4, 3, 2, 1), None))


def test_per_dimension_kernels_keep_permuted_views():
    # q of a decode step after ggml_permute(0, 2, 1, 3): ne1 = 1 token, nb1 = the token stride;
    # MUL_MAT indexes every dimension with its own stride, so its flattened rows do not matter
    hd, heads = 64, 32
    q = T(0x11, F32, (hd, 1, heads, 1), nb=(4, hd * heads * 4, hd * 4, hd * heads * 4),
          data=BASE + SIZE - hd * heads * 4)
    k = T(0x10, F32, (hd, 16, heads, 1))
    d = T(0x20, F32, (16, 1, heads, 1), op=OPS["MUL_MAT"], src=(0x10, 0x11))
    run([k, q], d)


# -- flattened elements: packed bytes counted from the tensor's first byte -------------------


def test_packed_elements_past_the_buffer_end_are_refused():
    # 4x4 elements with a zero row stride: ggml_nbytes is 16, the packed size 64; the tensor sits
    # 32 bytes before the end of its buffer
    a = T(0x10, F32, (4, 4, 1, 1), nb=(4, 0, 64, 64), data=BASE + SIZE - 32)
    d = T(0x20, F32, (1, 4, 1, 1), op=OPS["SUM_ROWS"], src=(0x10,))
    assert reason([a], d) == "tensor_layout_invalid"


# -- class 2: empty nodes are not computed, but planned -------------------------------------


def test_empty_node_needs_its_sources():
    a = T(0x10, F32, (64, 0, 1, 1))
    d = T(0x20, F32, (0, 3, 1, 1), op=OPS["MUL_MAT"], src=(0x10,))  # src[1] NULL: the planner reads it
    assert reason([a], d) == "graph_src_missing"
    b = T(0x11, F32, (64, 3, 1, 1))
    run([a, b], T(0x20, F32, (0, 3, 1, 1), op=OPS["MUL_MAT"], src=(0x10, 0x11)))


def test_empty_node_work_is_bounded():
    # an empty MUL_MAT_ID whose planner row map is n_as * ids.ne0 * ids.ne1 * 8 bytes
    a = T(0x10, F32, (1, 1, 1 << 20, 1))  # 4 MiB: a million "experts"
    b = T(0x11, F32, (1, 1, 1024, 1))
    ids = T(0x12, I32, (1024, 1024, 1, 1))  # 4 MiB
    d = T(0x20, F32, (0, 1024, 1024, 1), op=OPS["MUL_MAT_ID"], src=(0x10, 0x11, 0x12))
    assert reason([a, b, ids], d) == "graph_work_too_large"


# -- class 3: work sizes that multiply dimensions of different tensors ------------------------


def test_mul_mat_id_row_map_is_bounded():
    a = T(0x10, F32, (1, 1, 1 << 20, 1))
    b = T(0x11, F32, (1, 1, 1024, 1))
    ids = T(0x12, I32, (1024, 1024, 1, 1))
    d = T(0x20, F32, (1, 1024, 1024, 1), op=OPS["MUL_MAT_ID"], src=(0x10, 0x11, 0x12))
    assert reason([a, b, ids], d) == "graph_work_too_large"


def test_real_moe_work_fits():
    # 8 of 128 experts for 512 tokens: well under the cap
    a = dec(T(0x10, Q8_0, (256, 64, 128, 1)))
    b = dec(T(0x11, F32, (256, 1, 512, 1)))
    ids = dec(T(0x12, I32, (8, 512, 1, 1)))
    d = dec(T(0x20, F32, (64, 8, 512, 1)))
    need = work_bytes("MUL_MAT_ID", d, [a, b, ids], 64)
    assert 128 * 8 * 512 * 8 < need < 64 << 20


@pytest.mark.parametrize("threads, ok", [(8, True), (1 << 16, False)])
def test_per_thread_scratch_counts_the_server_threads(threads, ok):
    a = T(0x10, F32, (1 << 20, 1, 1, 1))  # one 4 MiB row
    d = T(0x20, F32, (1 << 20, 1, 1, 1), op=OPS["SOFT_MAX"], src=(0x10,), op_params=(f(1.0), 0))
    v = GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=8, server_threads=threads))
    payload = memoryview(graph_payload([d.id], [a, d]))
    if ok:
        v.check(payload, state())
    else:
        with pytest.raises(FirewallRefusal) as exc:
            v.check(payload, state())
        assert exc.value.reason == "graph_work_too_large"


# -- class 5: the compute budget --------------------------------------------------------------


def big_mul_mat():
    a = T(0x10, F32, (1024, 1024, 1, 1), data=BASE)
    b = T(0x11, F32, (1024, 1024, 1, 1), data=BASE + (4 << 20))
    d = T(0x20, F32, (1024, 1024, 1, 1), op=OPS["MUL_MAT"], src=(0x10, 0x11), data=BASE + (8 << 20))
    return [a, b], d


def test_matrix_product_flops():
    (a, b), d = big_mul_mat()
    moved = BYTE_FLOPS * 3 * 4 * 1024**2  # two sources and the result, 4 MiB each
    # K multiply-adds per dst element at the F32 class's price, plus one vec_dot call each
    assert flops("MUL_MAT", dec(d), [dec(a), dec(b)]) == (PRICES["mm.f32"] * 1024 + PRICES["mm_call"]) * 1024**2 + moved
    assert flops("VIEW", dec(d), [dec(a)]) == 0


def test_get_rows_pays_for_the_rows_it_reads():
    table = dec(T(0x10, Q8_0, (4096, 32000, 1, 1)))
    idx = dec(T(0x11, I32, (2, 1, 1, 1)))
    out = dec(T(0x20, F32, (4096, 2, 1, 1)))
    assert moved_bytes("GET_ROWS", out, [table, idx]) == 4096 * 2 * 4 + 8 + 2 * 4352  # two q8_0 rows of 4352 bytes


def test_graph_over_the_compute_budget_is_refused():
    tensors, d = big_mul_mat()
    payload = memoryview(graph_payload([d.id], tensors + [d]))
    st = state()
    cost = flops("MUL_MAT", dec(d), [dec(t) for t in tensors])
    GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=8, max_graph_compute_s=1.0, node_gflops=10)).check(payload, st)
    assert st.compute_flops == cost and st.graph_flops[0] == cost and st.inflight_flops == cost
    with pytest.raises(FirewallRefusal) as exc:
        GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=8, max_graph_compute_s=0.1, node_gflops=10)).check(payload, state())
    assert exc.value.reason == "graph_too_costly" and "max_graph_compute_s" in exc.value.detail
    # 0 turns it off
    GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=8, max_graph_compute_s=0, node_gflops=1e-9)).check(payload, state())


def test_cached_nodes_still_count():
    tensors, d = big_mul_mat()
    payload = memoryview(graph_payload([d.id], tensors + [d]))
    st = state()
    v = GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=8))
    v.check(payload, st)
    v.check(payload, st)  # the node verdict comes from the cache the second time
    assert st.compute_flops == 2 * flops("MUL_MAT", dec(d), [dec(t) for t in tensors])


def test_recomputes_queued_without_an_answer_are_bounded():
    # GRAPH_RECOMPUTE (4 bytes, no answer) runs the stored graph again: what is queued on the
    # server since its last answer stays within the budget; an answer empties the queue
    tensors, d = big_mul_mat()
    st = state()
    v = GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=8, max_graph_compute_s=1.0, node_gflops=10))
    v.check(memoryview(graph_payload([d.id], tensors + [d])), st)
    cost = st.graph_flops[0]
    for _ in range(int(10e9 / cost) - 1):
        v.charge_recompute(cost, st)
    with pytest.raises(FirewallRefusal) as exc:
        v.charge_recompute(cost, st)
    assert exc.value.reason == "graph_too_costly" and "GRAPH_RECOMPUTE" in exc.value.detail
    st.inflight_flops = 0  # what Session does when the server answers
    v.charge_recompute(cost, st)


# -- ops whose work is per kernel tap, not per element (rules2: UPSCALE, CONV_2D_DW, CONV_TRANSPOSE_1D)


def test_depthwise_conv_pays_per_kernel_tap():
    # measured on the real server: a 127x127 kernel over a 256x256 plane, 1.06e9 taps in 1.9 s; at
    # the default 40 GFLOP/s the estimate must not be below that
    k = dec(T(0x10, F16, (127, 127, 1, 1)))
    x = dec(T(0x11, F32, (256, 256, 1, 1)))
    out = dec(T(0x20, F32, (256, 256, 1, 1)))
    est = flops("CONV_2D_DW", out, [k, x])
    assert est >= 256 * 256 * 127 * 127 * 72  # 1.9 s at 40e9 flop/s for 1.06e9 taps
    assert est / 40e9 >= 1.9


def test_transposed_conv_pays_per_tap_and_has_its_work_buffer():
    k = dec(T(0x10, F16, (16, 64, 64, 1)))  # K, Cout, Cin
    x = dec(T(0x11, F32, (1000, 64, 1, 1)))  # L, Cin
    out = dec(T(0x20, F32, ((1000 - 1) * 2 + 16, 64, 1, 1)))
    assert flops("CONV_TRANSPOSE_1D", out, [k, x]) >= 2 * 1000 * 16 * 64 * 64
    assert work_bytes("CONV_TRANSPOSE_1D", out, [k, x], 8) == 2 * (16 * 64 * 64 + 1000 * 64)  # ggml-cpu.c:2934


@pytest.mark.parametrize("mode,taps", [(0, 1), (1, 4), (2, 16)])
def test_upscale_pays_per_source_pixel_it_reads(mode, taps):
    a = dec(T(0x10, F32, (64, 64, 3, 1)))
    out = dec(T(0x20, F32, (128, 128, 3, 1), op_params=(mode,)))
    assert flops("UPSCALE", out, [a]) >= 32 * taps * 128 * 128 * 3


def test_antialiased_downscale_pays_for_its_window():
    a = dec(T(0x10, F32, (4096, 4096, 1, 1)))
    out = dec(T(0x20, F32, (16, 16, 1, 1), op_params=(1 | 1 << 9,)))  # BILINEAR | ANTIALIAS: 256x support
    assert flops("UPSCALE", out, [a]) >= 32 * (2 * 256 + 1) ** 2 * 16 * 16


# -- convolutions (3D, transposed, col2im) -----------------------------------------------------


def test_direct_convolutions_pay_per_gathered_tap_and_plan_16_mib():
    # measured on the real server (bench/studies/compute_cost.py): a 7x7x64 kernel with one output
    # channel over 64x64 gathers 10.6e6 taps in 15 ms of CPU; the estimate at 40 GFLOP/s covers it
    k = dec(T(0x10, F32, (7, 7, 64, 1)))
    x = dec(T(0x11, F32, (64, 64, 64, 1)))
    out = dec(T(0x20, F32, (58, 58, 1, 1), op_params=(1, 1, 0, 0, 1, 1)))
    assert flops("CONV_2D", out, [k, x]) / 40e9 >= 0.015 * 1.4
    assert work_bytes("CONV_2D", out, [k, x], 8) == 16 << 20  # ggml-cpu.c:2962 GGML_IM2COL_WORK_SIZE
    k3 = dec(T(0x10, F32, (3, 3, 3, 8)))
    x3 = dec(T(0x11, F32, (24, 24, 24, 8)))
    out3 = dec(T(0x20, F32, (22, 22, 22, 1), op_params=(1, 1, 1, 0, 0, 0, 1, 1, 1, 8, 1, 1)))
    assert flops("CONV_3D", out3, [k3, x3]) / 40e9 >= 0.005 * 1.4  # 2.3e6 taps in 5.0 ms
    assert work_bytes("CONV_3D", out3, [k3, x3], 8) == 16 << 20


def test_transposed_conv_2d_pays_per_dot_and_has_its_work_buffer():
    k = dec(T(0x10, F16, (3, 3, 16, 1)))  # KW, KH, Cout, Cin = 1: one vec_dot call per tap
    x = dec(T(0x11, F32, (128, 128, 1, 1)))
    out = dec(T(0x20, F32, (257, 257, 16, 1), op_params=(2,)))
    assert flops("CONV_TRANSPOSE_2D", out, [k, x]) / 40e9 >= 0.0088 * 1.4  # 2.4e6 dots in 8.8 ms
    assert work_bytes("CONV_TRANSPOSE_2D", out, [k, x], 8) == 2 * (3 * 3 * 16 + 128 * 128)  # ggml-cpu.c:2964


def test_im2col_and_col2im_pay_per_gathered_element():
    # measured (bench/studies/compute_cost.py, the real server's CPU time): im2col 2D into F16,
    # 9.3e6 result elements in 35 ms; col2im_1d k=4096 oc=1 t_in=4096 s=1, 1.7e7 gathered columns in 59 ms
    k = dec(T(0x10, F16, (3, 3, 16, 1)))
    x = dec(T(0x11, F32, (256, 256, 16, 1)))
    out = dec(T(0x20, F16, (144, 254, 254, 1)))
    assert flops("IM2COL", out, [k, x]) / 40e9 >= 0.035 * 1.4
    assert flops("IM2COL_3D", out, [k, x]) == flops("IM2COL", out, [k, x])
    cols = dec(T(0x10, F32, (4096, 4096, 1, 1)))
    sig = dec(T(0x20, F32, (8191, 1, 1, 1), op_params=(1, 1, 0)))
    assert flops("COL2IM_1D", sig, [cols]) / 40e9 >= 0.059 * 1.4


@pytest.mark.parametrize("op", ["CONV_TRANSPOSE_1D", "CONV_TRANSPOSE_2D"])
def test_transposed_convs_pay_the_memset_of_the_plans_work_buffer(op):
    # ops.cpp:6539/6627/7613 zero params->wsize bytes on every node: the graph's largest need, up to
    # the 1 GiB cap; a tiny node still pays that memset (0.034 s per GiB measured, charged 0.11 s)
    k = dec(T(0x10, F32, (1, 1, 1, 1)))
    x = dec(T(0x11, F32, (1, 1, 1, 1)))
    out = dec(T(0x20, F32, (1, 1, 1, 1), op_params=(1, 0, 1)))
    assert flops(op, out, [k, x]) >= BYTE_FLOPS * (1 << 30)

# -- recurrent and newer-model ops --------------------------------------------------------------


def test_gated_delta_net_pays_per_state_element_per_token_and_has_its_work_buffer():
    # measured (test-backend-ops perf, CPU): S_v = 128, H = 32, T = 1024 in 218 ms
    ins = [dec(T(0x10 + i, F32, (128, 32, 1024, 1))) for i in range(3)]
    g, beta = dec(T(0x13, F32, (1, 32, 1024, 1))), dec(T(0x14, F32, (1, 32, 1024, 1)))
    st = dec(T(0x15, F32, (128, 128, 32, 1)))
    out = dec(T(0x20, F32, (128 * 32, 1024 + 128, 1, 1), op_params=(1,)))
    est = flops("GATED_DELTA_NET", out, [*ins, g, beta, st])
    assert est / 40e9 >= 1.4 * 0.218
    assert work_bytes("GATED_DELTA_NET", out, [*ins, g, beta, st], 8) == 4 * 128 * 8
    out2 = dec(T(0x20, F32, (128 * 32, 1024 + 2 * 128, 1, 1), op_params=(2,)))
    assert work_bytes("GATED_DELTA_NET", out2, [*ins, g, beta, st], 8) == 4 * (128 + 128 * 128) * 8  # ggml-cpu.c:3025


def test_solve_tri_and_tri_pay_what_was_measured():
    a, b = dec(T(0x10, F32, (256, 256, 4, 2))), dec(T(0x11, F32, (128, 256, 4, 2)))
    assert flops("SOLVE_TRI", dec(T(0x20, F32, (128, 256, 4, 2))), [a, b]) / 40e9 >= 1.4 * 0.031
    t = dec(T(0x10, F32, (1024, 1024, 8, 4)))
    assert flops("TRI", dec(T(0x20, F32, (1024, 1024, 8, 4))), [t]) / 40e9 >= 1.4 * 0.077


def test_dsv4_hc_comb_pays_per_sinkhorn_iteration():
    mixes, scale, base = dec(T(0x10, F32, (24, 1, 1, 1))), dec(T(0x11, F32, (3, 1, 1, 1))), dec(T(0x12, F32, (24, 1, 1, 1)))
    out = dec(T(0x20, F32, (4, 4, 1, 1), op_params=(0, 2**31 - 1)))
    # 2^31 iterations of a 4x4 row and column normalization: minutes of one thread
    assert flops("DSV4_HC_COMB", out, [mixes, scale, base]) >= 2**31 * 64


def test_lightning_indexer_work_buffer():
    q, k = dec(T(0x10, F32, (128, 4, 3, 1))), dec(T(0x11, F16, (128, 1, 7, 1)))
    w, m = dec(T(0x12, F32, (4, 3, 1, 1))), dec(T(0x13, F16, (7, 3, 1, 1)))
    out = dec(T(0x20, F32, (7, 3, 1, 1)))
    assert work_bytes("LIGHTNING_INDEXER", out, [q, k, w, m], 8) == 4 * 128 * 8  # ggml-cpu.c:3036
    assert flops("LIGHTNING_INDEXER", out, [q, k, w, m]) >= 2 * 128 * 4 * 7 * 3
