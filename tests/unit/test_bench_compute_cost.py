"""The arithmetic of bench/studies/compute_cost.py: what it decodes from a GRAPH_COMPUTE payload, the bytes
a node moves, and how it turns measurements into a recommended rate. The measurements
themselves need the real server and are run by hand (``bench/studies/compute_cost.py``), never by pytest."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from rpcguard.protocol import cost
from rpcguard.protocol.encode import TensorSpec, graph_payload, pack_tensor
from rpcguard.protocol.ggml import OpTable, op_table
from rpcguard.protocol.tensor import decode_tensor

BENCH = Path(__file__).resolve().parents[2] / "bench" / "studies"
sys.path.insert(0, str(BENCH))

import compute_cost as cc  # noqa: E402

_OPS = op_table((7, 0, 0))
assert _OPS is not None
OPS: OpTable = _OPS
F32, F16, I32, Q8_0 = 0, 1, 26, 8


def spec(id_: int, ne: tuple[int, int, int, int], *, type_: int = F32, op: str = "NONE", src: tuple[int, ...] = (),
         size: int = 4, blck: int = 1) -> TensorSpec:
    return TensorSpec(id=id_, type=type_, ne=ne, op=OPS.ids[op], src=src, type_size=size, blck_size=blck)


def mul_mat_graph(k: int, m: int, n: int) -> bytes:
    a, b = spec(1, (k, m, 1, 1)), spec(2, (k, n, 1, 1))
    d = spec(3, (m, n, 1, 1), op="MUL_MAT", src=(1, 2))
    r = spec(4, (m * n, 1, 1, 1), op="RESHAPE", src=(3,))
    return graph_payload([3, 4], [a, b, d, r])


def test_payload_tensors_reads_nodes_and_every_tensor_by_id():
    nodes, by_id = cc.payload_tensors(mul_mat_graph(64, 32, 8))
    assert nodes == [3, 4]
    assert sorted(by_id) == [1, 2, 3, 4]
    assert (by_id[3].ne0, by_id[3].ne1, by_id[3].src0, by_id[3].src1) == (32, 8, 1, 2)


def test_node_costs_prices_each_node_with_cost_flops_and_views_free():
    costs = cc.node_costs(mul_mat_graph(64, 32, 8))
    mm = (cost.PRICES["mm.f32"] * 64 + cost.PRICES["mm_call"]) * 32 * 8 + cc.BYTE_FLOPS * 4 * (64 * 32 + 64 * 8 + 32 * 8)
    assert costs == [("MUL_MAT", mm), ("RESHAPE", 0)]
    assert cc.graph_flops(mul_mat_graph(64, 32, 8)) == mm
    assert cc.by_op(costs) == {"MUL_MAT": mm}


def test_node_bytes_counts_dst_and_sources():
    payload = mul_mat_graph(64, 32, 8)
    assert cc.graph_bytes(payload) == 4 * (64 * 32 + 64 * 8 + 32 * 8)  # the RESHAPE moves nothing


def tensor(s: TensorSpec):
    return decode_tensor(pack_tensor(s))


def test_get_rows_counts_only_the_rows_it_reads_of_the_table():
    table = tensor(spec(1, (4096, 32000, 1, 1), type_=Q8_0, size=34, blck=32))
    idx = tensor(spec(2, (5, 1, 1, 1), type_=I32))
    dst = tensor(spec(3, (4096, 5, 1, 1), op="GET_ROWS", src=(1, 2)))
    row = 4096 // 32 * 34
    assert cc.node_bytes("GET_ROWS", dst, [table, idx]) == 4 * 4096 * 5 + 4 * 5 + 5 * row


def test_set_rows_counts_only_the_cells_it_writes_of_the_cache():
    cache = tensor(spec(1, (1024, 65536, 1, 1), type_=F16, size=2))
    new = tensor(spec(2, (1024, 3, 1, 1)))
    idx = tensor(spec(3, (3, 1, 1, 1), type_=I32))
    # ggml_set_rows (ggml.c:4030): src[0] the new rows, src[1] their indices, src[2] the cache
    node = tensor(spec(4, (1024, 65536, 1, 1), type_=F16, size=2, op="SET_ROWS", src=(2, 3, 1)))
    assert cc.node_bytes("SET_ROWS", node, [new, idx, cache]) == 4 * 1024 * 3 + 4 * 3 + 3 * 2 * 1024


def test_compute_seconds_is_median_wall_minus_median_round_trip_never_negative():
    assert cc.compute_seconds([0.30, 0.10, 0.20], [0.01, 0.03, 0.02]) == pytest.approx(0.18)
    assert cc.compute_seconds([1e-5], [2e-5]) == 0.0
    assert cc.compute_seconds([0.5], []) == 0.5


def row(kind: str, flop: float, seconds: float, *, real: bool = True, cpu: float = 0.0, threads: int = 1,
        bytes_: int = 0) -> cc.Row:
    return cc.Row(f"{kind} {flop:g}", kind, threads, int(flop), seconds, cpu, 3, real, {}, bytes_)


def test_took_idle_is_cpu_per_thread_capped_by_wall():
    r = row("mul_mat", 1e9, 0.30, cpu=0.20, threads=2)
    assert r.took("wall") == 0.30
    assert r.took("idle") == pytest.approx(0.10)
    assert row("mul_mat", 1e9, 0.05, cpu=0.4, threads=2).took("idle") == 0.05  # OpenMP spin: wall caps it
    assert row("mul_mat", 1e9, 0.3).took("idle") == 0.3  # no CPU figure: the wall time


def test_gflops_and_ratio():
    r = row("mul_mat", 2e9, 0.1, bytes_=10**8)
    assert r.gflops() == pytest.approx(20.0)
    assert r.ratio(10.0) == pytest.approx(2.0)  # the estimate at 10 GFLOP/s is twice the time: safe
    assert r.ratio(40.0) == pytest.approx(0.5)
    assert r.gflops(byte_flops=10.0) == pytest.approx(30.0)  # (2e9 + 10 * 1e8) flop in 0.1 s


def test_recommend_is_the_slowest_real_case_above_the_tiny_floor():
    rows = [row("mul_mat", 2e9, 0.1), row("add", 1e7, 0.01), row("crafted", 1e6, 1.0, real=False),
            row("add", 1.0, 1e-6)]
    assert cc.recommend_gflops(rows) == pytest.approx(1.0)  # 1e7 flop in 10 ms; crafted and tiny left out
    assert cc.recommend_gflops(rows, kinds=("mul_mat",)) == pytest.approx(20.0)
    assert math.isnan(cc.recommend_gflops([]))
    for r in rows[:2]:  # at the recommended rate every real case is over-estimated
        assert r.ratio(cc.recommend_gflops(rows)) >= 1 - 1e-12


def test_fit_byte_flops_covers_every_real_case_at_the_given_rate():
    rows = [row("mul_mat", 2e9, 0.1, bytes_=10**6), row("mul_mat", 1e7, 0.01, bytes_=4 * 10**7),
            row("crafted", 1.0, 100.0, real=False, bytes_=1)]
    b = cc.fit_byte_flops(rows, 20.0)
    assert b == pytest.approx((0.01 * 20e9 - 1e7) / 4e7)  # the memory-bound case sets it
    assert min(r.ratio(20.0, byte_flops=b) for r in rows[:2]) == pytest.approx(1.0)
    assert cc.fit_byte_flops([row("mul_mat", 2e9, 0.01, bytes_=10)], 1.0) == 0.0  # already covered


def test_underestimated_lists_cases_more_than_the_factor_below_the_measurement():
    rows = [row("soft_max", 1e7, 0.004), row("soft_max", 1e7, 0.002), row("add", 1.0, 1e-6)]
    # at 10 GFLOP/s the estimate is 1 ms: 4 ms is 4x over it, 2 ms only 2x, the tiny one is ignored
    assert cc.underestimated(rows, 10.0) == rows[:1]


def test_per_element_factor():
    r = row("rms_norm", 0, 0.02)
    assert cc.per_element_factor(r, 50.0, 10**7) == pytest.approx(100.0)


def test_nice_floor():
    assert [cc.nice_floor(x) for x in (93.0, 27.5, 1.0, 0.42, 199.9)] == [50, 20, 1, 0.2, 100]


def test_crafted_max_fits_the_budget_and_beats_its_grid_neighbours():
    budget = 64 << 20
    k, m, n, f = cc.crafted_max(budget, "f32", step=64)
    assert f == 2 * k * m * n
    assert cc.mul_mat_bytes(k, m, n, "f32") <= budget
    assert cc.mul_mat_bytes(k + 64, m, n, "f32") > budget  # k is as large as the rest allows
    for dk, dm, dn in ((0, 64, -64), (0, -64, 64), (-64, 64, 0), (-64, 0, 64)):
        kk, mm, nn = k + dk, m + dm, n + dn
        if min(kk, mm, nn) > 0 and cc.mul_mat_bytes(kk, mm, nn, "f32") <= budget:
            assert 2 * kk * mm * nn <= f
    # smaller weights leave room for more products
    assert cc.crafted_max(budget, "q4_0", step=64)[3] > f


def test_proposed_out_prod_uses_the_inner_dimension_ne1_of_src0():
    a = tensor(spec(1, (64, 65536, 1, 1)))
    b = tensor(spec(2, (64, 65536, 1, 1)))
    dst = tensor(spec(3, (64, 64, 1, 1), op="OUT_PROD", src=(1, 2)))
    moved = cc.BYTE_FLOPS * 4 * (64 * 65536 * 2 + 64 * 64)
    assert cc.proposed_flops("OUT_PROD", dst, [a, b]) == cost.PRICES["out_prod.f32"] * 65536 * 64 * 64 + moved


def test_proposed_sort_grows_with_log_of_the_row():
    short = tensor(spec(1, (4, 8, 1, 1)))
    long_ = tensor(spec(1, (1024, 8, 1, 1)))
    f = [cc.proposed_flops("ARGSORT", tensor(spec(2, (t.ne0, 8, 1, 1), type_=I32, op="ARGSORT", src=(1,))), [t])
         for t in (short, long_)]
    assert f[0] == cost.PRICES["sort"] * 32 * 2 + cc.BYTE_FLOPS * 2 * 4 * 32
    assert f[1] == cost.PRICES["sort"] * 8192 * 10 + cc.BYTE_FLOPS * 2 * 4 * 8192


def test_proposed_attention_costs_more_with_quantized_kv():
    q = tensor(spec(1, (128, 4, 8, 1)))
    kf, vf = tensor(spec(2, (128, 256, 2, 1), type_=F16, size=2)), tensor(spec(3, (128, 256, 2, 1), type_=F16, size=2))
    kq = tensor(spec(2, (128, 256, 2, 1), type_=Q8_0, size=34, blck=32))
    vq = tensor(spec(3, (128, 256, 2, 1), type_=Q8_0, size=34, blck=32))
    dst = tensor(spec(4, (128, 8, 4, 1), op="FLASH_ATTN_EXT", src=(1, 2, 3)))
    pairs = 4 * 8 * 1 * 256  # queries x heads x keys
    fa = cost.PRICES
    ff = cc.proposed_flops("FLASH_ATTN_EXT", dst, [q, kf, vf, None])
    fq = cc.proposed_flops("FLASH_ATTN_EXT", dst, [q, kq, vq, None])
    assert ff - cc.BYTE_FLOPS * cc.node_bytes("FLASH_ATTN_EXT", dst, [q, kf, vf, None]) == (fa["fa.f16"] * 256 + fa["fa_key"]) * pairs
    assert fq - cc.BYTE_FLOPS * cc.node_bytes("FLASH_ATTN_EXT", dst, [q, kq, vq, None]) == (fa["fa.q8_0"] * 256 + fa["fa_key"]) * pairs
    assert fq > ff


def test_logical_bytes_ignore_strides():
    # a broadcast view (stride 0 in dim 1) is still read element by element
    v = decode_tensor(pack_tensor(TensorSpec(id=1, ne=(16, 1000, 1, 1), nb=(4, 0, 0, 0))))
    dst = tensor(spec(2, (16, 1000, 1, 1), op="ADD", src=(1, 1)))
    assert cc.node_bytes("ADD", dst, [v, v]) == 3 * 4 * 16 * 1000


def test_per_op_summary_groups_by_op_and_class_and_flags_under_pricing():
    # two q2_K products, one measured 4x its estimate (UNDER), one F32 at a third of it
    est = int(40e9 * 0.01)  # 10 ms at 40 GFLOP/s
    rows = [cc.Row("mul_mat q2_K K=1 M=1 N=1", "sweep", 1, est, 0.04, extra={"by_op": {"MUL_MAT": est}, "cpus": [0.04]}),
            cc.Row("mul_mat q2_K K=2 M=1 N=1", "sweep", 1, est, 0.005, extra={"by_op": {"MUL_MAT": est}, "cpus": [0.005]}),
            cc.Row("mul_mat f32 K=1 M=1 N=1", "sweep", 1, est, 0.003, extra={"by_op": {"MUL_MAT": est}, "cpus": [0.004, 0.003]})]
    assert [cc.group_of(r) for r in rows] == ["MUL_MAT low", "MUL_MAT low", "MUL_MAT f32"]
    lines = cc.per_op_summary(rows, 40.0, "min")
    low = next(x for x in lines if x.startswith("| MUL_MAT low"))
    assert "| 2 | 4 |" in low and "UNDER > 3x" in low
    f32 = next(x for x in lines if x.startswith("| MUL_MAT f32"))
    assert "| 0.3 |" in f32 and "UNDER" not in f32  # min of the CPU times, 0.003 s
