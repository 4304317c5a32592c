#!/usr/bin/env python3
"""Calibrate the compute budget (rpcguard/protocol/cost.py) against the REAL ggml-rpc-server.

Usage (from the repository root, with the real peers built by tests/realpeer/setup.sh):

    .venv/bin/python bench/studies/compute_cost.py [--threads 1,2] [--only mul_mat,layer] [--reps 5]
        [--json FILE] [--crafted] [--quick] [--match TEXT] [--logdir DIR]
    .venv/bin/python bench/studies/compute_cost.py --threads 1 --only sweep --reps 5   # every op, every type class
    .venv/bin/python bench/studies/compute_cost.py --real 10           # a real llama.cpp session, priced
    .venv/bin/python bench/studies/compute_cost.py --summarize a.jsonl b.jsonl

How this works: every case is a small graph built by ggml's REAL constructors
(tests/support/ggmlref.build_many, the same serialiser as ggml-rpc's client), so shapes, strides
and op params are what llama.cpp would send. For each server thread count (``-t``) a fresh real
``ggml-rpc-server`` is started; per case the harness allocates one real buffer of the graph's
span (ALLOC_BUFFER, BUFFER_GET_BASE), clears it to zeros (BUFFER_CLEAR: no NaN or denormal
slows a kernel down; GET_ROWS index leaves get spread row numbers by SET_TENSOR so the rows
come from all over the matrix as a real prompt's tokens do), rebases the graph's tensors into it
and sends GRAPH_COMPUTE once (warm-up), then GRAPH_RECOMPUTE ``--reps`` times; a GET_ALIGNMENT
after each is the barrier (the server answers it only after the compute returned). The figure
per case is the median wall time of those repetitions minus the median GET_ALIGNMENT round trip
of the same connection; the server's CPU time (utime+stime of /proc/PID/stat, all threads) per
repetition is printed next to it.

The estimate is ``cost.flops`` of every node, decoded from the very payload sent
(``rpcguard.protocol.tensor.decode_tensor``, op names from the 7.0.0 op table), summed per
graph as graph.py sums it. Per case: estimated flop, measured seconds, achieved GFLOP/s
(estimate / measured: for matrix products and attention that is the real throughput, for the
other ops "estimated flop per second"), and ``ratio`` = estimated seconds at NODE_GFLOPS /
measured seconds (>= 1: the budget over-estimates, safe; < 1: a graph of that op runs longer
than the budget thinks).

``--only sweep`` (issue 28) runs the per-op sweep (``sweep_cases``): every op with a price of
its own over real shapes and the edges a crafted graph picks, the matrix products, OUT_PROD,
attention and conversions in every weight type, and prints per op (and type class)
measured / estimated time, worst, median and best over its cases, on the min-of-N server CPU
time and on the median (``per_op_summary``): the check that no op is under-priced by more than 3x.

``--crafted`` adds the attacker's cases: the largest single MUL_MAT that about 1 GiB of buffers
allow (F32 and Q4_0 weights) and a 40-node graph of matrix products sharing their two sources,
measured, next to what the estimate says for 40 nodes of the largest product.

Next to cost.flops each case is priced by ``proposed_flops``: the model the measurements ask for
(a byte term, OUT_PROD's inner dimension, per-op factors, sort/pool/conv formulas; see its
comment), at ``RECOMMENDED_GFLOPS``. ``--real N`` instead records a real llama.cpp session (the
105 MB ``bench`` model) and prices every graph it sent against the server's CPU time.
``--summarize FILES`` re-reads ``--json`` runs and prints the conclusions again.

The machine this runs on is shared: every figure is a median of repetitions; the load average
before and after is printed. A benchmark, not a test: it never fails on a figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rpcguard.protocol import encode  # noqa: E402
from rpcguard.protocol.cost import BYTE_FLOPS, flops, moved_bytes as node_bytes  # noqa: E402
from rpcguard.protocol.graph import NODE_GFLOPS  # noqa: E402
from rpcguard.protocol.ggml import TYPES, op_table  # noqa: E402
from rpcguard.protocol.tensor import RpcTensor, decode_tensor  # noqa: E402

V7 = (7, 0, 0)
TENSOR_BYTES = 296
TYPE_IDS = {t.name: i for i, t in TYPES.items()}
ROPE_TAIL = (10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)  # freq_base, freq_scale, ext, attn, beta_fast, beta_slow
# A real-sized case is one llama.cpp sends for a real model; the recommendation must cover
# every one of them. "tiny" cases (a few microseconds of work) only show the fixed overhead of a
# graph on the server, which the budget need not model (it is bounded by the node count).
TINY_S = 200e-6

# -- the arithmetic (tests/unit/test_bench_compute_cost.py) ---------------------------------


def payload_tensors(payload: bytes) -> tuple[list[int], dict[int, RpcTensor]]:
    """The node ids and the tensors (by id) of a 7.0.0 GRAPH_COMPUTE payload."""
    (n_nodes,) = struct.unpack_from("<I", payload, 4)
    nodes = list(struct.unpack_from(f"<{n_nodes}Q", payload, 8))
    off = 8 + 8 * n_nodes
    (n_tensors,) = struct.unpack_from("<I", payload, off)
    off += 4
    by_id = {}
    for i in range(n_tensors):
        t = decode_tensor(payload, off + TENSOR_BYTES * i)
        by_id[t.id] = t
    return nodes, by_id


def _srcs(t: RpcTensor, by_id: dict[int, RpcTensor]) -> list[RpcTensor | None]:
    ids = (t.src0, t.src1, t.src2, t.src3, t.src4, t.src5, t.src6, t.src7, t.src8, t.src9)
    return [by_id.get(s) if s else None for s in ids]


def node_costs(payload: bytes) -> list[tuple[str, int]]:
    """(op name, cost.flops) of every node of the payload, in graph order."""
    table = op_table(V7)
    assert table is not None
    nodes, by_id = payload_tensors(payload)
    out = []
    for nid in nodes:
        t = by_id[nid]
        name = table.name(t.op) or f"op{t.op}"
        out.append((name, flops(name, t, _srcs(t, by_id))))
    return out


def graph_bytes(payload: bytes) -> int:
    table = op_table(V7)
    assert table is not None
    nodes, by_id = payload_tensors(payload)
    return sum(node_bytes(table.name(by_id[n].op) or "", by_id[n], _srcs(by_id[n], by_id)) for n in nodes)


# -- the proposed model: adopted by cost.flops (main 1689ff5: a byte term, OUT_PROD's inner
# dimension, per-op operations per element, sort/pool/conv formulas); kept as a name so that the
# "proposed" columns and --summarize of earlier runs still read.
proposed_flops = flops
RECOMMENDED_GFLOPS = NODE_GFLOPS


def proposed_graph_flops(payload: bytes) -> int:
    table = op_table(V7)
    assert table is not None
    nodes, by_id = payload_tensors(payload)
    return sum(proposed_flops(table.name(by_id[n].op) or "", by_id[n], _srcs(by_id[n], by_id)) for n in nodes)


def graph_flops(payload: bytes) -> int:
    return sum(c for _, c in node_costs(payload))


def by_op(costs: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Estimated flop per op name (ops with no cost left out)."""
    out: dict[str, int] = {}
    for name, c in costs:
        if c:
            out[name] = out.get(name, 0) + c
    return out


@dataclass
class Row:
    case: str
    kind: str  # mul_mat, flash_attn, soft_max, ..., layer, crafted
    threads: int
    est_flop: int
    seconds: float  # median measured compute seconds (RTT subtracted)
    cpu_s: float = 0.0  # server CPU seconds per repetition (all threads)
    reps: int = 0
    real: bool = True  # a shape real llama.cpp sends (covered by the recommendation)
    extra: dict[str, Any] = field(default_factory=dict)

    bytes: int = 0  # node_bytes summed over the graph
    prop_flop: int = 0  # proposed_flops summed over the graph

    def took(self, on: str = "wall") -> float:
        """Measured seconds: ``wall`` (median wall time on this busy machine) or ``idle`` (the
        server's CPU time per thread, capped by the wall time: what an idle node would take)."""
        if on == "idle" and self.cpu_s > 0:
            return min(self.seconds, self.cpu_s / self.threads)
        if on == "min" and self.extra.get("cpus"):  # min-of-N server CPU time: the least disturbed run
            return min(self.extra["cpus"]) / self.threads
        return self.seconds

    def gflops(self, on: str = "wall", byte_flops: float = 0.0) -> float:
        """Estimated flop (plus ``byte_flops`` per byte) per measured second, in GFLOP/s."""
        s = self.took(on)
        return (self.est_flop + byte_flops * self.bytes) / s / 1e9 if s > 0 else math.inf

    def ratio(self, node_gflops: float, on: str = "wall", byte_flops: float = 0.0) -> float:
        """Estimated seconds at ``node_gflops`` over measured seconds (>= 1: over-estimate)."""
        return self.gflops(on, byte_flops) / node_gflops

    def prop_ratio(self, node_gflops: float, on: str = "wall") -> float:
        """The same for the proposed model (proposed_flops)."""
        s = self.took(on)
        return self.prop_flop / (node_gflops * 1e9) / s if s > 0 else math.inf


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def compute_seconds(walls: Sequence[float], rtts: Sequence[float]) -> float:
    """Median wall time of the repetitions minus the median barrier round trip (never below 0)."""
    return max(0.0, median(walls) - (median(rtts) if rtts else 0.0))


def _real(rows: Iterable[Row], kinds: Iterable[str] | None, min_seconds: float, on: str) -> list[Row]:
    want = set(kinds) if kinds is not None else None
    return [r for r in rows if r.real and r.took(on) >= min_seconds and (want is None or r.kind in want)]


def recommend_gflops(rows: Iterable[Row], *, kinds: Iterable[str] | None = None, min_seconds: float = TINY_S,
                     on: str = "wall", byte_flops: float = 0.0) -> float:
    """The largest throughput at which the estimate is at least the measured time of every
    real-sized case: min of estimated flop / measured seconds (GFLOP/s), over real cases of
    ``kinds`` (all when None) that took at least ``min_seconds``."""
    vals = [r.gflops(on, byte_flops) for r in _real(rows, kinds, min_seconds, on)]
    return min(vals) if vals else math.nan


def fit_byte_flops(rows: Iterable[Row], node_gflops: float, *, min_seconds: float = TINY_S,
                   on: str = "wall", kinds: Iterable[str] | None = None) -> float:
    """The flop-equivalents per byte read or written that make the estimate at ``node_gflops``
    cover the measured time of every real case (of ``kinds``): max of (measured * rate - flop) / bytes."""
    vals = [(r.took(on) * node_gflops * 1e9 - r.est_flop) / r.bytes
            for r in _real(rows, kinds, min_seconds, on) if r.bytes]
    return max([0.0, *vals])


def nice_floor(x: float) -> float:
    """``x`` rounded down to 1, 2 or 5 times a power of ten (a default a person can read)."""
    if not x > 0 or math.isinf(x):
        return x
    e = 10 ** math.floor(math.log10(x))
    return max(m * e for m in (1, 2, 5) if m * e <= x)


def underestimated(rows: Iterable[Row], node_gflops: float, factor: float = 3.0, min_seconds: float = TINY_S,
                   on: str = "wall", byte_flops: float = 0.0) -> list[Row]:
    """Cases whose measured time exceeds the estimate at ``node_gflops`` by more than ``factor``."""
    return [r for r in rows if r.took(on) >= min_seconds and r.ratio(node_gflops, on, byte_flops) < 1 / factor]


def per_element_factor(row: Row, node_gflops: float, n_elements: int) -> float:
    """Operations per element (read + written) that would make ``row``'s estimate equal its
    measured time at ``node_gflops``: the ELEMENT_FLOPS this op would need."""
    return row.seconds * node_gflops * 1e9 / n_elements if n_elements else math.nan


def mul_mat_bytes(k: int, m: int, n: int, weight: str) -> int:
    """Bytes of src0 (k x m of ``weight``), src1 (k x n f32) and dst (m x n f32)."""
    info = TYPES[TYPE_IDS[weight]]
    return k * m // info.blck_size * info.type_size + 4 * k * n + 4 * m * n


def crafted_max(budget_bytes: int, weight: str = "f32", step: int = 256) -> tuple[int, int, int, int]:
    """(k, m, n, flop) of the MUL_MAT with the most flop (2*k*m*n) whose src0, src1 and one dst
    fit in ``budget_bytes`` (a crafted graph's nodes may all share these: their dsts can alias).
    Dimensions are multiples of ``step``; k, m, n searched on that grid (k from the remainder)."""
    info = TYPES[TYPE_IDS[weight]]
    best = (0, 0, 0, 0)
    top = int(math.isqrt(budget_bytes // 4)) // step * step + step
    for m in range(step, 4 * top, step):
        for n in range(step, top, step):
            rest = budget_bytes - 4 * m * n
            if rest <= 0:
                break
            per_k = m * info.type_size / info.blck_size + 4 * n  # bytes per unit of k
            k = int(rest // per_k) // step * step
            if k <= 0:
                continue
            f = 2 * k * m * n
            if f > best[3]:
                best = (k, m, n, f)
    return best


# -- recipes (ggml's real constructors) ------------------------------------------------------


class Recipe:
    """A ggmlref recipe: leaves first, then constructor calls; tensors are recipe indexes."""

    def __init__(self) -> None:
        self.leaves: list[dict] = []
        self.ops: list[dict] = []
        self.outputs: list[int] | None = None
        self.spread: list[tuple[int, int]] = []  # (leaf index, row count): index leaves to fill
        self.values: list[int] = []  # F32 leaves filled with large, varied values (not zeros)

    def leaf(self, type_: str, ne: Sequence[int]) -> int:
        self.leaves.append({"type": type_, "ne": (list(ne) + [1, 1, 1])[:4]})
        return len(self.leaves) - 1

    def op(self, fn: str, *args: Any) -> int:
        self.ops.append({"fn": fn, "args": list(args)})
        return len(self.leaves) + len(self.ops) - 1

    def fix(self) -> dict:
        """Leaves are indexes 0..L-1 only once every leaf is declared: declare leaves first."""
        d: dict[str, Any] = {"leaves": self.leaves, "ops": self.ops}
        if self.outputs:
            d["outputs"] = self.outputs
        return d


def mul_mat(k: int, m: int, n: int, wt: str) -> Recipe:
    r = Recipe()
    a, b = r.leaf(wt, [k, m]), r.leaf("f32", [k, n])
    r.op("mul_mat", a, b)
    return r


def flash_attn(d: int, n_q: int, n_kv: int, h: int, h_kv: int, kvt: str = "f16") -> Recipe:
    r = Recipe()
    q, k, v = r.leaf("f32", [d, n_q, h]), r.leaf(kvt, [d, n_kv, h_kv]), r.leaf(kvt, [d, n_kv, h_kv])
    mask = r.leaf("f16", [n_kv, n_q])
    r.op("flash_attn_ext", q, k, v, mask, 1 / math.sqrt(d), 0.0, 0.0)
    return r


def soft_max(n_kv: int, n_q: int, h: int) -> Recipe:
    r = Recipe()
    a, mask = r.leaf("f32", [n_kv, n_q, h]), r.leaf("f16", [n_kv, n_q])
    r.op("soft_max_ext", a, mask, 0.125, 0.0)
    return r


def add(ne0: int, ne1: int) -> Recipe:
    r = Recipe()
    a, b = r.leaf("f32", [ne0, ne1]), r.leaf("f32", [ne0, ne1])
    r.op("add", a, b)
    return r


def rope(d: int, h: int, t: int, mode: int) -> Recipe:
    r = Recipe()
    a, pos = r.leaf("f32", [d, h, t]), r.leaf("i32", [t])
    r.op("rope_ext", a, pos, None, d, mode, 4096, *ROPE_TAIL)
    return r


def rms_norm(ne0: int, ne1: int) -> Recipe:
    r = Recipe()
    r.op("rms_norm", r.leaf("f32", [ne0, ne1]), 1e-6)
    return r


def cpy(ne0: int, ne1: int, ta: str, tb: str) -> Recipe:
    r = Recipe()
    a, b = r.leaf(ta, [ne0, ne1]), r.leaf(tb, [ne0, ne1])
    if ta == "f32":
        r.values.append(a)  # the quantizers' search depends on the values
    r.op("cpy", a, b)
    return r


def get_rows(ne0: int, rows: int, n: int, ta: str) -> Recipe:
    r = Recipe()
    a, idx = r.leaf(ta, [ne0, rows]), r.leaf("i32", [n])
    r.op("get_rows", a, idx)
    r.spread.append((idx, rows))
    return r


def layer(e: int, h: int, h_kv: int, f: int, t: int, n_kv: int, wt: str, flash: bool = True) -> Recipe:
    """One llama block as llama.cpp builds it (llm_build_llama + llm_graph_context::build_attn):
    norm, Q/K/V, RoPE, SET_ROWS into an f16 KV cache, attention over ``n_kv`` cells, output
    projection, SwiGLU feed-forward, residuals."""
    d = e // h
    r = Recipe()
    x, attn_norm, ffn_norm = r.leaf("f32", [e, t]), r.leaf("f32", [e]), r.leaf("f32", [e])
    wq, wk, wv, wo = r.leaf(wt, [e, e]), r.leaf(wt, [e, h_kv * d]), r.leaf(wt, [e, h_kv * d]), r.leaf(wt, [e, e])
    wg, wu, wd = r.leaf(wt, [e, f]), r.leaf(wt, [e, f]), r.leaf(wt, [f, e])
    pos = r.leaf("i32", [t])
    kc, vc = r.leaf("f16", [h_kv * d, n_kv]), r.leaf("f16", [h_kv * d, n_kv])
    idx = r.leaf("i64", [t])
    mask = r.leaf("f16", [n_kv, -(-t // 64) * 64 if flash else t])
    cur = r.op("mul", r.op("rms_norm", x, 1e-6), attn_norm)
    q = r.op("reshape_3d", r.op("mul_mat", wq, cur), d, h, t)
    k = r.op("reshape_3d", r.op("mul_mat", wk, cur), d, h_kv, t)
    v = r.op("mul_mat", wv, cur)
    q = r.op("rope_ext", q, pos, None, d, 0, 4096, *ROPE_TAIL)
    k = r.op("rope_ext", k, pos, None, d, 0, 4096, *ROPE_TAIL)
    sk = r.op("set_rows", kc, r.op("reshape_2d", k, d * h_kv, t), idx)
    sv = r.op("set_rows", vc, v, idx)
    row = 2 * d
    kview = r.op("view_3d", kc, d, h_kv, n_kv, row, row * h_kv, 0)
    vview = r.op("view_3d", vc, d, h_kv, n_kv, row, row * h_kv, 0)
    qp = r.op("permute", q, 0, 2, 1, 3)
    kp = r.op("permute", kview, 0, 2, 1, 3)
    if flash:
        vp = r.op("permute", vview, 0, 2, 1, 3)
        att = r.op("reshape_2d", r.op("flash_attn_ext", qp, kp, vp, mask, 1 / math.sqrt(d), 0.0, 0.0), e, t)
    else:
        kq = r.op("soft_max_ext", r.op("mul_mat", kp, qp), mask, 1 / math.sqrt(d), 0.0)
        vt = r.op("cont", r.op("permute", vview, 1, 2, 0, 3))
        kqv = r.op("permute", r.op("mul_mat", vt, kq), 0, 2, 1, 3)
        att = r.op("cont_2d", kqv, e, t)
    cur = r.op("add", r.op("mul_mat", wo, att), x)
    nrm = r.op("mul", r.op("rms_norm", cur, 1e-6), ffn_norm)
    ff = r.op("swiglu_split", r.op("mul_mat", wg, nrm), r.op("mul_mat", wu, nrm))
    out = r.op("add", r.op("mul_mat", wd, ff), cur)
    r.outputs = [sk, sv, out]
    return r


def out_prod(m: int, n: int, k: int) -> Recipe:
    """dst [m, n] = sum over k: the inner dimension is src0's ne1 (ops.cpp out_prod loop over ne01)."""
    r = Recipe()
    r.op("out_prod", r.leaf("f32", [m, k]), r.leaf("f32", [n, k]))
    return r


def out_prod_t(m: int, n: int, k: int, ta: str) -> Recipe:
    """OUT_PROD with an F16 or block-type src0 (ops.cpp out_prod_q_f32 / _f16_f32: a row of src0
    dequantized per dst row and inner index)."""
    r = Recipe()
    r.op("out_prod", r.leaf(ta, [m, k]), r.leaf("f32", [n, k]))
    return r


def add1(ne0: int, ne1: int, ta: str) -> Recipe:
    """ADD1 of a scalar: a block-type src0 is dequantized, incremented and quantized again per row."""
    r = Recipe()
    r.op("add1", r.leaf(ta, [ne0, ne1]), r.leaf("f32", [1]))
    return r


def argsort(ne0: int, rows: int) -> Recipe:
    r = Recipe()
    r.op("argsort", r.leaf("f32", [ne0, rows]), 0)
    return r


def pool_2d(w: int, c: int, k: int) -> Recipe:
    r = Recipe()
    r.op("pool_2d", r.leaf("f32", [w, w, c]), 1, k, k, 1, 1, 0.0, 0.0)  # GGML_OP_POOL_AVG, stride 1
    return r


def conv_2d_direct(w: int, cin: int, cout: int, k: int) -> Recipe:
    r = Recipe()
    kern, x = r.leaf("f32", [k, k, cin, cout]), r.leaf("f32", [w, w, cin])
    r.op("conv_2d_direct", kern, x, 1, 1, 0, 0, 1, 1)
    return r


def conv_3d_direct(w: int, cin: int, cout: int, k: int) -> Recipe:
    r = Recipe()
    kern, x = r.leaf("f32", [k, k, k, cin * cout]), r.leaf("f32", [w, w, w, cin])
    r.op("conv_3d_direct", kern, x, 1, 1, 1, 0, 0, 0, 1, 1, 1, cin, 1, cout)
    return r


def conv_transpose_2d(w: int, cin: int, cout: int, k: int, stride: int) -> Recipe:
    r = Recipe()
    kern, x = r.leaf("f32", [k, k, cout, cin]), r.leaf("f32", [w, w, cin])
    r.op("conv_transpose_2d_p0", kern, x, stride)
    return r


def im2col_3d(w: int, cin: int, k: int, dst: str) -> Recipe:
    r = Recipe()
    kern, x = r.leaf("f16", [k, k, k, cin]), r.leaf("f32", [w, w, w, cin])
    r.op("im2col_3d", kern, x, cin, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1 if dst == "f16" else 0)
    return r


def im2col_2d(w: int, cin: int, k: int, dst: str) -> Recipe:
    r = Recipe()
    kern, x = r.leaf("f16", [k, k, cin, 1]), r.leaf("f32", [w, w, cin])
    r.op("im2col", kern, x, 1, 1, 0, 0, 1, 1, True, 1 if dst == "f16" else 0)
    return r


def im2col_back(w: int, cin: int, k: int, s: int, two_d: bool = True) -> Recipe:
    """The gradient of im2col(kernel [k, k, cin], image [w, w, cin]) at stride s (2D), or of a 1D
    im2col over [w*w, cin]: IM2COL_BACK as the backward pass builds it."""
    r = Recipe()
    if two_d:
        ow = (w - k) // s + 1
        kern, grad = r.leaf("f16", [k, k, cin, 1]), r.leaf("f32", [cin * k * k, ow, ow, 1])
        r.op("im2col_back", grad, kern, [w, w, cin, 1], s, s, 0, 0, 1, 1, True)
    else:
        ow = (w * w - k) // s + 1
        kern, grad = r.leaf("f16", [k, cin, 1]), r.leaf("f32", [cin * k, ow, 1])
        r.op("im2col_back", grad, kern, [w * w, cin, 1, 1], s, 1, 0, 0, 1, 1, False)
    return r


def pool_2d_back(w: int, c: int, k: int, s: int, op: int) -> Recipe:
    r = Recipe()
    ow = (w - k) // s + 1
    grad, af = r.leaf("f32", [ow, ow, c]), r.leaf("f32", [w, w, c])
    r.op("pool_2d_back", grad, af, op, k, k, s, s, 0.0, 0.0)
    return r


def col2im_1d(k: int, oc: int, t_in: int, s0: int) -> Recipe:
    r = Recipe()
    r.op("col2im_1d", r.leaf("f32", [k * oc, t_in]), s0, oc, 0)
    return r


def chain(n: int, ne0: int = 16) -> Recipe:
    """``n`` tiny ADD nodes, each on the previous one: the per-node cost of the server's loop
    (and, with -t > 1, of its thread barrier between nodes)."""
    r = Recipe()
    cur = r.leaf("f32", [ne0])
    for _ in range(n):
        cur = r.op("add", cur, cur)
    return r


def crafted(k: int, m: int, n: int, wt: str, nodes: int) -> Recipe:
    """``nodes`` matrix products of the same two sources (what a crafted graph can do: the
    sources are shared, only the node records grow)."""
    r = Recipe()
    a, b = r.leaf(wt, [k, m]), r.leaf("f32", [k, n])
    outs = [r.op("mul_mat", a, b) for _ in range(nodes)]
    r.outputs = outs
    return r


# -- the per-op sweep (issue 28: every op priced from measurement) ------------------------------
#
# ``--only sweep``: per op with a rule, shapes drawn at the sizes real models use and at the
# edges a crafted graph would pick (a state that leaves the cache, a head size with no vector
# path, a type whose dot product is slow), every weight type for the matrix products. Inputs
# the cost depends on by value (transcendental functions) get large, varied values (Recipe.values).

# every type with a CPU vec_dot (oprules/matmul.VEC_DOT) the pinned ggml knows
MATMUL_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl", "mxfp4", "q2_K", "q3_K",
                "q4_K", "q5_K", "q6_K", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m",
                "iq4_xs", "tq1_0", "tq2_0")


def linear_attn(fn: str, s_: int, h: int, t: int, n_seqs: int = 1) -> Recipe:
    """RWKV_WKV6 (k v r tf td state), GATED_LINEAR_ATTN (k v q g state, scale), RWKV_WKV7 (r w k
    v a b state): [S, H, T] inputs, the state S*S*H floats per sequence."""
    r = Recipe()
    n_in = {"rwkv_wkv6": 5, "gated_linear_attn": 4, "rwkv_wkv7": 6}[fn]
    ins = [r.leaf("f32", [s_, h, t]) for _ in range(n_in)]
    if fn == "rwkv_wkv6":
        ins[3] = r.leaf("f32", [s_, h])  # tf: its own shape (declared after: leaves only)
    state = r.leaf("f32", [s_ * s_ * h, n_seqs])
    if fn == "gated_linear_attn":
        r.op(fn, *ins, state, 0.125)
    else:
        r.op(fn, *ins, state)
    return r


def ssm_scan(d_state: int, head_dim: int, n_head: int, n_tok: int, mamba1: bool, n_group: int = 1) -> Recipe:
    r = Recipe()
    s = r.leaf("f32", [d_state, head_dim, n_head, 1])
    x = r.leaf("f32", [head_dim, n_head, n_tok, 1])
    dt = r.leaf("f32", [n_head, n_tok, 1])
    a = r.leaf("f32", [d_state if mamba1 else 1, n_head])
    b, c = r.leaf("f32", [d_state, n_group, n_tok, 1]), r.leaf("f32", [d_state, n_group, n_tok, 1])
    ids = r.leaf("i32", [1])
    r.op("ssm_scan", s, x, dt, a, b, c, ids, 1)
    return r


def ssm_conv(d_conv: int, d_inner: int, n_t: int) -> Recipe:
    r = Recipe()
    r.op("ssm_conv", r.leaf("f32", [d_conv - 1 + n_t, d_inner, 1]), r.leaf("f32", [d_conv, d_inner]))
    return r


def gated_delta_net(s_v: int, h: int, t: int, kda: bool = False) -> Recipe:
    r = Recipe()
    q, k, v = (r.leaf("f32", [s_v, h, t, 1]) for _ in range(3))
    g, beta = r.leaf("f32", [s_v if kda else 1, h, t, 1]), r.leaf("f32", [1, h, t, 1])
    st = r.leaf("f32", [s_v, s_v, h, 1])
    r.op("gated_delta_net", q, k, v, g, beta, st, 1)
    return r


def solve_tri(n: int, k: int, b1: int) -> Recipe:
    r = Recipe()
    a, b = r.leaf("f32", [n, n, b1]), r.leaf("f32", [k, n, b1])
    r.values.append(a)
    r.op("solve_tri", a, b, True, True, False)
    return r


def lightning_indexer(d: int, n_head: int, t: int, n_kv: int, kt: str) -> Recipe:
    r = Recipe()
    q, k = r.leaf("f32", [d, n_head, t, 1]), r.leaf(kt, [d, 1, n_kv, 1])
    w, m = r.leaf("f32", [n_head, t, 1, 1]), r.leaf("f16", [n_kv, t, 1, 1])
    r.op("lightning_indexer", q, k, w, m)
    return r


def mul_mat_b(k: int, m: int, n: int, b: int, wt: str) -> Recipe:
    r = Recipe()
    r.op("mul_mat", r.leaf(wt, [k, m, b]), r.leaf("f32", [k, n, b]))
    return r


def mul_mat_id(k: int, m: int, n_as: int, n_used: int, t: int, wt: str) -> Recipe:
    r = Recipe()
    a, b, ids = r.leaf(wt, [k, m, n_as]), r.leaf("f32", [k, n_used, t]), r.leaf("i32", [n_used, t])
    r.spread.append((ids, n_as))
    r.op("mul_mat_id", a, b, ids)
    return r


def unary(fn: str, ne0: int, ne1: int, *extra: Any, ta: str = "f32") -> Recipe:
    r = Recipe()
    a = r.leaf(ta, [ne0, ne1])
    if ta == "f32":
        r.values.append(a)
    r.op(fn, a, *extra)
    return r


def binary(fn: str, ne0: int, ne1: int, *extra: Any) -> Recipe:
    r = Recipe()
    a, b = r.leaf("f32", [ne0, ne1]), r.leaf("f32", [ne0, ne1])
    r.values.append(a)
    r.op(fn, a, b, *extra)
    return r


def arange(n: int) -> Recipe:
    r = Recipe()
    r.op("arange", 0.0, float(n), 1.0)
    return r


def acc_set(fn: str) -> Recipe:
    r = Recipe()
    a, b = r.leaf("f32", [4096, 512]), r.leaf("f32", [2048, 256])
    r.op(fn, a, b, 4096 * 4, 4096 * 512 * 4, 4096 * 512 * 4, 0)
    return r


def add_id(ne0: int, n_expert: int, n_used: int, t: int) -> Recipe:
    r = Recipe()
    a, b, ids = r.leaf("f32", [ne0, n_used, t]), r.leaf("f32", [ne0, n_expert]), r.leaf("i32", [n_used, t])
    r.spread.append((ids, n_expert))
    r.op("add_id", a, b, ids)
    return r


def repeat(ne0: int, ne1: int) -> Recipe:
    r = Recipe()
    a, b = r.leaf("f32", [ne0, 1]), r.leaf("f32", [ne0, ne1])
    r.op("repeat", a, b)
    return r


def get_rows_back(ne0: int, n: int, rows: int) -> Recipe:
    r = Recipe()
    g, idx, shape = r.leaf("f32", [ne0, n]), r.leaf("i32", [n]), r.leaf("f32", [ne0, rows])
    r.spread.append((idx, rows))
    r.op("get_rows_back", g, idx, shape)
    return r


def sgd(n: int) -> Recipe:
    r = Recipe()
    r.leaves.append({"type": "f32", "ne": [n, 1, 1, 1], "param": True})
    w = len(r.leaves) - 1
    g, p = r.leaf("f32", [n]), r.leaf("f32", [2])
    r.op("opt_step_sgd", w, g, p)
    return r


def win_unpart(w: int, c: int, size: int) -> Recipe:
    r = Recipe()
    n = -(-w // size)
    r.op("win_unpart", r.leaf("f32", [c, size, size, n * n]), w, w, size)
    return r


def count_equal(ne0: int, ne1: int) -> Recipe:
    r = Recipe()
    r.op("count_equal", r.leaf("i32", [ne0, ne1]), r.leaf("i32", [ne0, ne1]))
    return r


def rope_back(d: int, h: int, t: int) -> Recipe:
    r = Recipe()
    a, pos = r.leaf("f32", [d, h, t]), r.leaf("i32", [t])
    r.op("rope_ext_back", a, pos, None, d, 0, 4096, *ROPE_TAIL)
    return r


def ce_back(ne0: int, ne1: int) -> Recipe:
    r = Recipe()
    g, a, b = r.leaf("f32", [1]), r.leaf("f32", [ne0, ne1]), r.leaf("f32", [ne0, ne1])
    r.values.append(a)
    r.op("cross_entropy_loss_back", g, a, b)
    return r


def conv_dw(w: int, c: int, k: int) -> Recipe:
    r = Recipe()
    kern, x = r.leaf("f32", [k, k, 1, c]), r.leaf("f32", [w, w, c])
    r.op("conv_2d_dw_direct", kern, x, 1, 1, k // 2, k // 2, 1, 1)
    return r


def conv_t1d(length: int, cin: int, cout: int, k: int) -> Recipe:
    r = Recipe()
    kern, x = r.leaf("f32", [k, cout, cin]), r.leaf("f32", [length, cin])
    r.op("conv_transpose_1d", kern, x, 1, 0, 1)
    return r


def win(w: int, c: int, size: int) -> Recipe:
    r = Recipe()
    r.op("win_part", r.leaf("f32", [c, w, w]), size)
    return r


def set_rows(ne0: int, rows: int, n: int, tdst: str) -> Recipe:
    r = Recipe()
    dst, src, idx = r.leaf(tdst, [ne0, rows]), r.leaf("f32", [ne0, n]), r.leaf("i64", [n])
    r.values.append(src)
    r.spread.append((idx, rows))
    r.op("set_rows", dst, src, idx)
    return r


def cross_entropy(ne0: int, ne1: int) -> Recipe:
    r = Recipe()
    a, b = r.leaf("f32", [ne0, ne1]), r.leaf("f32", [ne0, ne1])
    r.values.append(a)
    r.op("cross_entropy_loss", a, b)
    return r


def adamw(n: int) -> Recipe:
    r = Recipe()
    r.leaves.append({"type": "f32", "ne": [n, 1, 1, 1], "param": True})
    w = len(r.leaves) - 1
    g, m, v, p = r.leaf("f32", [n]), r.leaf("f32", [n]), r.leaf("f32", [n]), r.leaf("f32", [7])
    r.op("opt_step_adamw", w, g, m, v, p)
    return r


def sweep_cases() -> list[Case]:
    """Per op (kind "sweep"): real shapes and the edges a crafted graph picks."""
    out: list[Case] = []

    def add_(name: str, recipe: Recipe, real: bool = True) -> None:
        out.append(Case(name, "sweep", recipe, real=real))

    for wt in MATMUL_TYPES:  # compute-bound (a prompt batch) and memory-bound (one token)
        for k, m, n in ((2048, 1024, 256), (4096, 4096, 1), (2048, 2048, 16)):
            add_(f"mul_mat {wt} K={k} M={m} N={n}", mul_mat(k, m, n, wt))
    # one vec_dot call per dst element whatever K: the call's own cost where K is one block
    add_("mul_mat f32 K=1 M=4096 N=2048 (a call per element)", mul_mat(1, 4096, 2048, "f32"), real=False)
    add_("mul_mat f16 K=1 M=4096 N=2048 (a call per element)", mul_mat(1, 4096, 2048, "f16"), real=False)
    add_("mul_mat q8_0 K=32 M=4096 N=1024 (a call per element)", mul_mat(32, 4096, 1024, "q8_0"), real=False)
    add_("mul_mat q2_K K=256 M=4096 N=512 (a call per element)", mul_mat(256, 4096, 512, "q2_K"), real=False)
    add_("mul_mat iq1_s K=256 M=4096 N=512 (a call per element)", mul_mat(256, 4096, 512, "iq1_s"), real=False)
    # src1 converted to the vec_dot type (one from_float per element) against few weight rows,
    # and many small products batched in dims 2-3
    for wt in ("q2_K", "iq2_xxs", "q4_0", "f16"):
        add_(f"mul_mat {wt} K=4096 M=1 N=8192 (src1 conversion)", mul_mat(4096, 1, 8192, wt), real=False)
        add_(f"mul_mat {wt} K=256 M=32 N=32 B=1024 (batched)", mul_mat_b(256, 32, 32, 1024, wt), real=False)
    add_("flash_attn D=4 q=256 kv=4096 H=8/8 f16 (an expf per key)", flash_attn(4, 256, 4096, 8, 8), real=False)
    add_("flash_attn D=32 q=256 kv=4096 H=8/8 f16", flash_attn(32, 256, 4096, 8, 8), real=False)
    for wt in ("f16", "q8_0", "q4_K", "q2_K", "iq2_xxs", "iq1_s", "mxfp4"):
        add_(f"mul_mat_id {wt} K=2048 M=1024 experts=8/2 T=128", mul_mat_id(2048, 1024, 8, 2, 128, wt))
    for ta in ("f32", "f16", "q8_0", "q4_0", "q5_1", "iq4_nl", "mxfp4", "q4_K", "q6_K", "iq4_xs", "q2_K",
               "q3_K", "tq1_0", "iq2_xxs", "iq3_s", "iq1_s"):
        add_(f"out_prod {ta} m=1024 n=256 k=512", out_prod_t(1024, 256, 512, ta), real=False)
    for fn in ("rwkv_wkv6", "gated_linear_attn", "rwkv_wkv7"):
        add_(f"{fn} S=64 H=32 T=256", linear_attn(fn, 64, 32, 256))  # RWKV-6/7 7B: head size 64
        add_(f"{fn} S=1024 H=1 T=64", linear_attn(fn, 1024, 1, 64), real=False)  # a 4 MiB state
        add_(f"{fn} S=2048 H=2 T=8", linear_attn(fn, 2048, 2, 8), real=False)  # 32 MiB of state per token
        if fn != "rwkv_wkv7":  # WKV7's rule wants S a multiple of 64
            add_(f"{fn} S=17 H=64 T=512 (no vector path)", linear_attn(fn, 17, 64, 512), real=False)
    add_("ssm_scan mamba2 N=128 P=64 H=32 T=64", ssm_scan(128, 64, 32, 64, False))
    add_("ssm_scan mamba2 N=17 P=64 H=32 T=256 (no vector path)", ssm_scan(17, 64, 32, 256, False), real=False)
    add_("ssm_scan mamba1 N=16 D=4096 T=64", ssm_scan(16, 1, 4096, 64, True))  # Mamba-1: d_inner heads of dim 1
    add_("ssm_scan mamba1 N=256 P=64 H=16 T=16", ssm_scan(256, 64, 16, 16, True), real=False)
    add_("ssm_conv d_conv=4 d_inner=4096 T=256", ssm_conv(4, 4096, 256))
    add_("ssm_conv d_conv=1024 d_inner=256 T=256", ssm_conv(1024, 256, 256), real=False)
    add_("gated_delta_net S=128 H=16 T=256", gated_delta_net(128, 16, 256))
    add_("gated_delta_net kda S=128 H=16 T=128", gated_delta_net(128, 16, 128, True))
    add_("gated_delta_net S=17 H=64 T=256", gated_delta_net(17, 64, 256), real=False)
    add_("solve_tri n=256 k=128 B=8", solve_tri(256, 128, 8))
    add_("solve_tri n=2048 k=16 B=1", solve_tri(2048, 16, 1), real=False)
    for kvt in ("f16", "bf16", "q8_0", "q4_0", "q5_1", "mxfp4", "q4_K", "q6_K", "iq4_xs", "q2_K", "q3_K", "tq1_0",
                "iq2_xxs", "iq3_s", "iq1_s", "iq4_nl"):
        add_(f"flash_attn D=256 q=64 kv=1024 H=8/8 {kvt}", flash_attn(256, 64, 1024, 8, 8, kvt))
    add_("rope D=4096 H=1 T=512 mode=0 (a cache entry per element)", rope(4096, 1, 512, 0), real=False)
    add_("rope D=128 H=32 T=512 mode=2", rope(128, 32, 512, 2))
    add_("silu_back 4096x512", binary("silu_back", 4096, 512))
    for kt in ("f32", "f16", "q8_0", "q4_K", "iq2_xxs"):
        add_(f"lightning_indexer D=128 H=32 T=64 kv=1024 {kt}", lightning_indexer(128, 32, 64, 1024, kt))
    for fn in ("exp", "sin", "cos", "log", "sqrt", "sqr", "tanh", "gelu", "gelu_erf", "gelu_quick", "silu",
               "sigmoid", "elu", "softplus"):
        add_(f"unary {fn} 4096x512", unary(fn, 4096, 512))
    add_("unary gelu f16 4096x512", unary("gelu", 4096, 512, ta="f16"))
    add_("unary exp f16 4096x512", unary("exp", 4096, 512, ta="f16"))
    add_("glu swiglu_split 4096x512", binary("swiglu_split", 4096, 512))
    add_("glu geglu_erf_split 4096x512", binary("geglu_erf_split", 4096, 512))
    add_("timestep_embedding 256 dim=4096", unary("timestep_embedding", 256, 1, 4096, 10000))
    add_("soft_max 4096x512", unary("soft_max", 4096, 512))
    add_("norm 4096x512", unary("norm", 4096, 512, 1e-5))
    add_("group_norm 64x64x512 groups=32", unary("group_norm", 64 * 64, 512, 32, 1e-5))
    add_("argmax 32000x64", unary("argmax", 32000, 64))
    add_("cumsum 4096x512", unary("cumsum", 4096, 512))
    add_("top_k 32000x16 k=40", unary("top_k", 32000, 16, 40))
    add_("cross_entropy_loss 32000x64", cross_entropy(32000, 64), real=False)
    add_("opt_step_adamw 4M", adamw(1 << 22), real=False)
    add_("div 4096x512", binary("div", 4096, 512))
    for ta in ("q8_0", "q4_K", "q2_K"):
        add_(f"add1 {ta} 4096x256", add1(4096, 256, ta), real=False)
    for tb in ("q4_0", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs", "bf16", "mxfp4"):
        add_(f"cpy f32->{tb} 4096x256", cpy(4096, 256, "f32", tb))
        add_(f"set_rows f32->{tb} 4096x64 of 4096", set_rows(4096, 4096, 64, tb))
    # the element-wise, layout and window ops at 8 per element (names start "elem ")
    E0, E1 = 4096, 512
    for fn, extra in (("scale", (0.5,)), ("clamp", (-1.0, 1.0)), ("leaky_relu", (0.1, False)), ("sum_rows", ()),
                      ("sum", ()), ("mean", ()), ("l2_norm", (1e-6,)), ("diag_mask_inf", (0,)), ("fill", (1.0,)),
                      ("argsort", (0,)), ("pad", (64, 64, 0, 0)), ("roll", (7, 3, 0, 0)),
                      ("pad_reflect_1d", (64, 64)), ("dup", ()), ("upscale", (2, 1)), ("upscale", (2, 2))):
        add_(f"elem {fn}{extra} {E0}x{E1}", unary(fn, E0 if fn != "upscale" else 512, E1 if fn != "upscale" else 256,
                                                   *extra))
    for fn in ("sub", "mul", "repeat_back"):  # COUNT_EQUAL wants I32 (the server aborts on F32; the rule refuses it)
        add_(f"elem {fn} {E0}x{E1}", binary(fn, E0, E1))
    add_(f"elem concat {E0}x{E1}", binary("concat", E0, E1, 1))
    add_(f"elem soft_max_ext_back {E0}x{E1}", binary("soft_max_ext_back", E0, E1, 1.0, 0.0))
    add_(f"elem rms_norm_back {E0}x{E1}", binary("rms_norm_back", E0, E1, 1e-6))
    add_(f"elem cross_entropy_loss_back {E0}x64", ce_back(E0, 64))
    add_("elem diag 2048", unary("diag", 2048, 1))
    add_("elem tri 2048x2048", unary("tri", 2048, 2048, 0))
    add_("elem pool_1d avg 65536x64 k=64", unary("pool_1d", 65536, 64, 1, 64, 1, 0))
    add_("elem conv_2d_dw_direct 256x256x16 k=31", conv_dw(256, 16, 31), real=False)
    add_("elem conv_transpose_1d L=4096 cin=64 cout=64 k=16", conv_t1d(4096, 64, 64, 16), real=False)
    add_("elem win_part 64x64x768 w=14", win(64, 768, 14))
    add_("elem get_rel_pos 64x127 q=64", unary("get_rel_pos", 64, 127, 64, 64, ta="f16"))
    add_("elem argsort 32000x64", unary("argsort", 32000, 64, 0))
    add_("elem diag_mask_zero 4096x512", unary("diag_mask_zero", E0, E1, 0))
    add_("elem arange 2M", arange(1 << 21))
    for fn, recipe in (("acc", acc_set("acc")), ("set", acc_set("set")), ("add_id", add_id(4096, 8, 2, 512)),
                       ("repeat", repeat(E0, E1)), ("get_rows_back", get_rows_back(E0, 512, 32000)),
                       ("opt_step_sgd", sgd(1 << 22)), ("win_unpart", win_unpart(64, 768, 14)),
                       ("count_equal", count_equal(E0, E1)), ("rope_back", rope_back(128, 32, 512))):
        add_(f"elem {fn}", recipe)
    for ta in ("q2_K", "iq2_xxs", "iq1_s", "iq3_s", "q6_K"):
        add_(f"get_rows {ta} 4096x32000 n=512", get_rows(4096, 32000, 512, ta))
        add_(f"cpy {ta}->f32 4096x256", cpy(4096, 256, ta, "f32"))
    return out


@dataclass
class Case:
    name: str
    kind: str
    recipe: Recipe
    real: bool = True
    reps: int | None = None  # fixed repetitions (-1: the first compute only), else --reps


def cases(quick: bool = False, with_crafted: bool = False, with_sweep: bool = False) -> list[Case]:
    out: list[Case] = sweep_cases() if with_sweep else []
    sizes = (64, 256, 512, 1024, 2048) if not quick else (256, 1024)
    for wt in ("f32", "f16", "q8_0"):
        for s in sizes:
            out.append(Case(f"mul_mat {wt} K=M=N={s}", "mul_mat", mul_mat(s, s, s, wt)))
        for k, m, n in ((2048, 2048, 1), (2048, 2048, 8), (2048, 2048, 64), (2048, 2048, 512),
                        (4096, 4096, 1), (4096, 11008, 1), (11008, 4096, 1), (4096, 11008, 32)):
            if quick and n not in (1, 512):
                continue
            out.append(Case(f"mul_mat {wt} K={k} M={m} N={n}", "mul_mat", mul_mat(k, m, n, wt)))
    for wt in ("bf16", "q4_0", "q4_K", "q5_K", "q6_K", "iq4_xs"):  # other weight types real models ship
        for k, m, n in ((2048, 2048, 2048), (2048, 2048, 512), (4096, 11008, 1), (4096, 11008, 32)):
            if not quick or n == 512:
                out.append(Case(f"mul_mat {wt} K={k} M={m} N={n}", "mul_mat", mul_mat(k, m, n, wt)))
    for d, n_q, n_kv, h, h_kv, kvt in ((128, 1, 512, 32, 8, "f16"), (128, 1, 4096, 32, 8, "f16"),
                                       (128, 128, 2048, 32, 8, "f16"), (128, 512, 512, 32, 8, "f16"),
                                       (64, 1, 4096, 32, 32, "f16"), (128, 1, 4096, 32, 8, "q8_0"),
                                       (128, 128, 2048, 32, 8, "q8_0")):
        out.append(Case(f"flash_attn D={d} q={n_q} kv={n_kv} H={h}/{h_kv} {kvt}", "flash_attn",
                        flash_attn(d, n_q, n_kv, h, h_kv, kvt)))
    for n_kv, n_q, h in ((512, 512, 32), (4096, 1, 32), (2048, 128, 32), (256, 1, 32)):
        out.append(Case(f"soft_max kv={n_kv} q={n_q} H={h}", "soft_max", soft_max(n_kv, n_q, h)))
    for ne0, ne1 in ((4096, 1), (4096, 512), (4096, 2048)):
        out.append(Case(f"add f32 {ne0}x{ne1}", "add", add(ne0, ne1)))
        out.append(Case(f"rms_norm f32 {ne0}x{ne1}", "rms_norm", rms_norm(ne0, ne1)))
    for d, h, t, mode in ((128, 32, 1, 0), (128, 32, 512, 0), (128, 32, 512, 2), (128, 8, 2048, 0)):
        out.append(Case(f"rope D={d} H={h} T={t} mode={mode}", "rope", rope(d, h, t, mode)))
    for ta, tb in (("f32", "f16"), ("f16", "f32"), ("f32", "q8_0"), ("q8_0", "f32"), ("f32", "f32"),
                   ("f32", "q4_0"), ("q4_0", "f32")):
        for ne0, ne1 in ((1024, 4096), (4096, 1)):
            out.append(Case(f"cpy {ta}->{tb} {ne0}x{ne1}", "cpy", cpy(ne0, ne1, ta, tb)))
    for ta in ("f32", "f16", "q8_0", "q4_K"):
        for n in (1, 512):
            out.append(Case(f"get_rows {ta} 4096x32000 n={n}", "get_rows", get_rows(4096, 32000, n, ta)))
    for wt, t, flash in (("f16", 1, True), ("f16", 64, True), ("q8_0", 1, True), ("q8_0", 64, True),
                         ("f16", 64, False)):
        name = f"layer 7B-like {wt} T={t} kv=512 {'fa' if flash else 'no-fa'}"
        out.append(Case(name, "layer", layer(4096, 32, 8, 11008, t, 512, wt, flash)))
    # ops whose work is not proportional to the elements they read and write
    out.append(Case("out_prod f32 m=64 n=64 k=65536", "extra", out_prod(64, 64, 65536), real=False))
    out.append(Case("out_prod f32 m=1024 n=1024 k=1024", "extra", out_prod(1024, 1024, 1024), real=False))
    # the training rules (branch rules-train): OUT_PROD's dequantizing paths, ADD1 of block types
    for ta in ("f16", "q8_0", "q4_K"):
        out.append(Case(f"out_prod {ta} m=1024 n=256 k=1024", "train", out_prod_t(1024, 256, 1024, ta), real=False))
    for ta in ("f32", "q8_0", "q4_K", "q2_K"):
        out.append(Case(f"add1 {ta} 4096x1024", "train", add1(4096, 1024, ta), real=False))
    out.append(Case("argsort f32 32000x1", "extra", argsort(32000, 1)))
    out.append(Case("argsort f32 32000x64", "extra", argsort(32000, 64)))
    out.append(Case("pool_2d avg 64x64x256 k=32 s=1", "extra", pool_2d(64, 256, 32), real=False))
    out.append(Case("conv_2d_direct 64x64 cin=64 cout=64 k=3", "extra", conv_2d_direct(64, 64, 64, 3)))
    # the patch gather of the direct convolutions, and CONV_TRANSPOSE_2D's one vec_dot per tap
    out.append(Case("conv_2d_direct 64x64 cin=64 cout=1 k=7", "extra", conv_2d_direct(64, 64, 1, 7), real=False))
    out.append(Case("conv_3d_direct 24^3 cin=8 cout=1 k=3", "extra", conv_3d_direct(24, 8, 1, 3), real=False))
    out.append(Case("conv_3d_direct 16^3 cin=16 cout=16 k=3", "extra", conv_3d_direct(16, 16, 16, 3), real=False))
    out.append(Case("conv_transpose_2d 128x128 cin=1 cout=16 k=3 s=2", "extra", conv_transpose_2d(128, 1, 16, 3, 2),
                    real=False))
    out.append(Case("conv_transpose_2d 64x64 cin=64 cout=16 k=3 s=1", "extra", conv_transpose_2d(64, 64, 16, 3, 1),
                    real=False))
    out.append(Case("conv im2col_3d 24^3 cin=8 k=3 f16", "extra", im2col_3d(24, 8, 3, "f16"), real=False))
    out.append(Case("conv im2col_3d 24^3 cin=8 k=3 f32", "extra", im2col_3d(24, 8, 3, "f32"), real=False))
    out.append(Case("conv col2im_1d k=16 oc=32 t_in=4096 s=8", "extra", col2im_1d(16, 32, 4096, 8), real=False))
    out.append(Case("conv col2im_1d k=64 oc=4 t_in=4096 s=1", "extra", col2im_1d(64, 4, 4096, 1), real=False))
    out.append(Case("conv col2im_1d k=4096 oc=1 t_in=4096 s=1", "extra", col2im_1d(4096, 1, 4096, 1), real=False))
    out.append(Case("conv im2col 2d 256x256 cin=16 k=3 f16", "extra", im2col_2d(256, 16, 3, "f16"), real=False))
    out.append(Case("conv im2col 2d 256x256 cin=16 k=3 f32", "extra", im2col_2d(256, 16, 3, "f32"), real=False))
    # the backward ops of IM2COL and POOL_2D (ggml_build_backward_expand): taps per image element
    out.append(Case("im2col_back 2d 128x128 cin=16 k=3 s=1", "train", im2col_back(128, 16, 3, 1), real=False))
    out.append(Case("im2col_back 2d 64x64 cin=4 k=16 s=4", "train", im2col_back(64, 4, 16, 4), real=False))
    out.append(Case("im2col_back 1d 4096 cin=8 k=64 s=1", "train", im2col_back(64, 8, 64, 1, two_d=False), real=False))
    out.append(Case("pool_2d_back max 128x128x64 k=4 s=2", "train", pool_2d_back(128, 64, 4, 2, 0), real=False))
    out.append(Case("pool_2d_back avg 64x64x64 k=16 s=1", "train", pool_2d_back(64, 64, 16, 1, 1), real=False))
    out.append(Case("chain of 120 tiny ADD nodes", "overhead", chain(120), real=False))
    if with_crafted:
        gib = 1 << 30
        for wt in ("f32", "q4_0"):
            k, m, n, _ = crafted_max(gib, wt)
            out.append(Case(f"crafted 1x mul_mat {wt} K={k} M={m} N={n} (1 GiB)", "crafted",
                            crafted(k, m, n, wt, 1), real=False, reps=-1))
        out.append(Case("crafted 40x mul_mat f32 K=M=N=2048 (shared srcs)", "crafted",
                        crafted(2048, 2048, 2048, "f32", 40), real=False, reps=-1))
    return out


# -- the real server -------------------------------------------------------------------------


def nelements(t: RpcTensor) -> int:
    return t.ne0 * t.ne1 * t.ne2 * t.ne3


def varied_floats(n: int) -> bytes:
    """``n`` F32 values in about [-100, 100], every 7th times 1e5 (a trigonometric function's
    slow range reduction), none zero (a kernel's time can depend on the values: zeros are cheap)."""
    import array

    base = array.array("f", (((i * 7919) % 20011 - 10005.5) / 100 for i in range(min(n, 20011))))
    for i in range(0, len(base), 7):
        base[i] *= 1e5
    reps, rest = divmod(n, len(base))
    return base.tobytes() * reps + base[:rest].tobytes()


def cpu_ns(pid: int) -> int:
    """Nanoseconds on a CPU of every live thread of ``pid`` (/proc/PID/task/*/schedstat; the
    server's OpenMP threads live as long as the server, so a delta is the compute's CPU time)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise ConnectionError(f"server closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def call(s: socket.socket, cmd: str, payload: bytes) -> bytes:
    s.sendall(encode.request(cmd, payload))
    return recv_exact(s, struct.unpack("<Q", recv_exact(s, 8))[0])


class Server:
    def __init__(self, workdir: Path, threads: int) -> None:
        from tests.support import realpeer

        self.threads = threads
        binary = os.environ.get("REALPEER_RPC_SERVER_BIN") or realpeer._read_env(
            realpeer.REALPEER_HOME / "env.sh").get("REALPEER_RPC_SERVER_BIN")
        if not binary or not Path(binary).exists():
            raise SystemExit("real ggml-rpc-server not built: run `bash tests/realpeer/setup.sh`")
        self.port = realpeer.free_port()
        self.proc = realpeer.start([binary, "-H", "127.0.0.1", "-p", str(self.port), "-t", str(threads)],
                                   workdir / f"rpc-server-t{threads}.log", f"ggml-rpc-server -t {threads}")
        realpeer.wait_port(self.port, proc=self.proc.popen)
        self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=900)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(encode.hello_request(V7))
        assert recv_exact(self.sock, 8 + 28)[8:11] == bytes(V7)

    def close(self) -> None:
        self.sock.close()
        self.proc.stop(timeout=5.0)

    def barrier(self) -> None:
        if len(call(self.sock, "GET_ALIGNMENT", struct.pack("<I", 0))) != 8:
            raise ConnectionError("bad GET_ALIGNMENT answer")

    def rtt(self, n: int = 50) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.barrier()
            out.append(time.perf_counter() - t0)
        return out

    def run(self, built: Any, recipe: Recipe, reps: int, min_total_s: float = 1.0, max_reps: int = 25) -> dict:
        s = self.sock
        # ggmlref gives every tensor that owns memory a fake buffer of its own: packed one after
        # another into one real buffer (Built.rebase)
        size = built.packed_size + 4096
        handle, got = struct.unpack("<QQ", call(s, "ALLOC_BUFFER", struct.pack("<IQ", 0, size)))
        if not handle or got < size:
            raise MemoryError(f"ALLOC_BUFFER {size} failed")
        try:
            (base,) = struct.unpack("<Q", call(s, "BUFFER_GET_BASE", struct.pack("<Q", handle)))
            s.sendall(encode.request("BUFFER_CLEAR", struct.pack("<QB", handle, 0)))
            payload = built.rebase(handle, base)
            for leaf, rows in recipe.spread:  # index leaves: rows spread over the whole matrix
                pos = built.refs[leaf]
                t = payload[built.tensor_bytes + TENSOR_BYTES * pos: built.tensor_bytes + TENSOR_BYTES * (pos + 1)]
                idx = decode_tensor(t)
                n = idx.ne0 * idx.ne1
                code = "q" if idx.type == TYPE_IDS["i64"] else "i"  # SET_ROWS takes I64 indices
                data = struct.pack(f"<{n}{code}", *((i * 7919) % rows for i in range(n)))
                s.sendall(encode.request("SET_TENSOR", t + b"\0" + struct.pack("<Q", 0) + data))
            for leaf in recipe.values:  # operands whose values the kernel's time depends on
                pos = built.refs[leaf]
                t = payload[built.tensor_bytes + TENSOR_BYTES * pos: built.tensor_bytes + TENSOR_BYTES * (pos + 1)]
                n = nelements(decode_tensor(t))
                s.sendall(encode.request("SET_TENSOR", t + b"\0" + struct.pack("<Q", 0) + varied_floats(n)))
            rtts = self.rtt()
            c_first = cpu_ns(self.proc.popen.pid)
            t0 = time.perf_counter()
            s.sendall(encode.request("GRAPH_COMPUTE", payload))
            self.barrier()
            first = time.perf_counter() - t0
            if reps < 0:  # the first compute is the measurement (crafted cases of minutes)
                cpu = (cpu_ns(self.proc.popen.pid) - c_first) / 1e9
                return {"walls": [first], "cpus": [cpu], "rtt": median(rtts), "first": first, "cpu_s": cpu,
                        "reps": 1, "seconds": compute_seconds([first], rtts), "buffer": size}
            if reps == 0:
                reps = max(3, min(max_reps, math.ceil(min_total_s / max(first, 1e-6))))
            walls, cpus = [], []
            pid = self.proc.popen.pid
            for _ in range(reps):
                c0 = cpu_ns(pid)
                t0 = time.perf_counter()
                s.sendall(encode.request("GRAPH_RECOMPUTE", struct.pack("<I", 0)))
                self.barrier()
                walls.append(time.perf_counter() - t0)
                cpus.append((cpu_ns(pid) - c0) / 1e9)
            return {"walls": walls, "cpus": cpus, "rtt": median(rtts), "first": first, "cpu_s": median(cpus),
                    "reps": reps, "seconds": compute_seconds(walls, rtts), "buffer": size}
        finally:
            s.sendall(encode.request("FREE_BUFFER", struct.pack("<Q", handle)))
            self.barrier()


# -- the run ---------------------------------------------------------------------------------


def fmt_row(r: Row, node_gflops: float) -> str:
    return (f"| {r.case} | {r.threads} | {r.est_flop:.3g} | {r.bytes / 2**20:.1f} | {r.seconds * 1e3:.3f} | "
            f"{r.took('idle') * 1e3:.3f} | {r.gflops():.2f} | {r.gflops('idle'):.2f} | {r.ratio(node_gflops):.3g} |")


HEADER = ("| case | -t | est. flop | MiB moved | wall ms (median) | idle ms (CPU/thread) | est. GFLOP/s wall | "
          "idle | est/actual wall at {g:g} GFLOP/s |\n|---|---|---|---|---|---|---|---|---|")


# Kinds whose cost the byte term is fitted on; "extra" ops (argsort, pool, conv, out_prod) need
# a formula of their own (docs: "Compute budget"), and crafted cases are the attacker's.
FIT_KINDS = ("mul_mat", "flash_attn", "soft_max", "add", "rms_norm", "rope", "cpy", "get_rows", "layer")


def summary(rows: Sequence[Row], g: float) -> list[str]:
    """The conclusions per thread count, from wall and idle figures."""
    out = []
    for t in sorted({r.threads for r in rows}):
        mine = [r for r in rows if r.threads == t]
        for on in ("wall", "idle"):
            mm = [r.gflops(on) for r in mine if r.kind == "mul_mat" and r.real and r.est_flop >= 1e9]
            worst = recommend_gflops(mine, on=on)
            mmfa = recommend_gflops(mine, kinds=("mul_mat", "flash_attn", "layer"), on=on)
            out.append(f"-t {t} {on}: MUL_MAT >= 1 GFLOP median {median(mm):.1f} GFLOP/s (min {min(mm, default=math.nan):.1f},"
                       f" max {max(mm, default=math.nan):.1f}); the rate that over-estimates every real case: "
                       f"{worst:.2f} (MUL_MAT/FA/layer only: {mmfa:.2f})")
            for r in underestimated(mine, g, on=on):
                out.append(f"   under-estimated > 3x at {g:g} GFLOP/s ({on}): {r.case} ratio {r.ratio(g, on):.3g}")
            rate = nice_floor(min(mm, default=math.nan))
            b = fit_byte_flops(mine, rate, on=on, kinds=FIT_KINDS)
            fitted = _real(mine, FIT_KINDS, TINY_S, on)
            out.append(f"   with a bytes term at {rate:g} GFLOP/s: {b:.2f} flop per byte moved covers every real case; "
                       f"then the largest over-estimate of a real case is "
                       f"{max((r.ratio(rate, on, b) for r in fitted), default=math.nan):.1f}x")
            for kind in dict.fromkeys(r.kind for r in mine):
                ks = [r for r in mine if r.kind == kind and r.took(on) >= TINY_S]
                if ks:
                    lo = min(ks, key=lambda r: r.ratio(rate, on, b))
                    out.append(f"     {kind}: lowest est/actual {lo.ratio(rate, on, b):.3g} ({lo.case}); "
                               f"highest {max(r.ratio(rate, on, b) for r in ks):.3g}")
    return out


def proposed_summary(rows: Sequence[Row], g: float, on: str = "idle") -> list[str]:
    """The proposed model at ``g`` GFLOP/s: per kind, the lowest and highest est/actual."""
    out = []
    for t in sorted({r.threads for r in rows}):
        mine = [r for r in rows if r.threads == t and r.took(on) >= TINY_S and r.prop_flop]
        out.append(f"proposed model at {g:g} GFLOP/s, -t {t} {on}: per kind lowest / highest est/actual")
        for kind in dict.fromkeys(r.kind for r in mine):
            ks = [r for r in mine if r.kind == kind]
            lo = min(ks, key=lambda r: r.prop_ratio(g, on))
            hi = max(ks, key=lambda r: r.prop_ratio(g, on))
            out.append(f"   {kind}: {lo.prop_ratio(g, on):.3g} ({lo.case}) / {hi.prop_ratio(g, on):.3g} ({hi.case})")
    return out


def group_of(row: Row) -> str:
    """The op (the node kind with the largest estimate in the case) and, for the ops priced per
    type class, the class of the case's type (its name names it: ``mul_mat q2_K ...``)."""
    from rpcguard.protocol.cost import TYPE_CLASSES

    by = row.extra.get("by_op") or {}
    op = max(by, key=by.get) if by else row.kind.upper()
    words = row.case.replace("->", " ").split()
    types = [w for w in words if w in TYPE_CLASSES]
    if op in ("MUL_MAT", "MUL_MAT_ID", "OUT_PROD", "GET_ROWS", "SET_ROWS", "CPY") and types:
        t = types[-1] if op in ("SET_ROWS", "CPY") and types[-1] != "f32" else types[0]
        return f"{op} {TYPE_CLASSES[t]}"
    if op in ("UNARY", "GLU"):
        return f"{op} {words[1]}"
    return op


def per_op_summary(rows: Sequence[Row], g: float, on: str = "idle") -> list[str]:
    """Per op (and type class): measured over estimated time, worst and median, and the cases
    behind the worst; 'over' marks a median estimate above 10x the measured (refuses real work
    sooner than it should), 'UNDER' a worst above 3x."""
    out = []
    for t in sorted({r.threads for r in rows}):
        mine = [r for r in rows if r.threads == t and r.took(on) >= TINY_S and r.est_flop]
        groups: dict[str, list[Row]] = {}
        for r in mine:
            groups.setdefault(group_of(r), []).append(r)
        what = {"min": "min-of-N server CPU time", "idle": "median server CPU time", "wall": "median wall time"}[on]
        out.append(f"\n## measured / estimated per op at {g:g} GFLOP/s, -t {t}, {what}\n")
        out.append("| op | cases | worst | median | best | worst case | note |\n|---|---|---|---|---|---|---|")
        for name in sorted(groups):
            ks = groups[name]
            me = sorted(1 / r.ratio(g, on) for r in ks)
            worst = max(ks, key=lambda r: 1 / r.ratio(g, on))
            note = "UNDER > 3x" if me[-1] > 3 else ("over > 10x" if median(me) < 0.1 else "")
            out.append(f"| {name} | {len(ks)} | {me[-1]:.3g} | {median(me):.3g} | {me[0]:.3g} | {worst.case} | {note} |")
    return out


def refill(rows: list[Row]) -> None:
    """Recompute bytes and the proposed estimate of rows read back from --json (older runs)."""
    from tests.support.ggmlref import Built, build_many

    want = {r.case for r in rows}
    todo = [c for c in cases(False, True, True) if c.name in want]
    payloads = {c.name: b.payload for c, b in zip(todo, build_many([c.recipe.fix() for c in todo], timeout_s=600))
                if isinstance(b, Built)}
    for r in rows:
        if r.case in payloads:
            r.bytes, r.prop_flop = graph_bytes(payloads[r.case]), proposed_graph_flops(payloads[r.case])
            # re-priced by today's cost.flops: --summarize checks a change of PRICES against the
            # measurements of an earlier run
            r.est_flop, r.extra["by_op"] = r.prop_flop, by_op(node_costs(payloads[r.case]))


def real_session(workdir: Path, repeats: int, threads: int = 1) -> list[str]:
    """The real llama.cpp client (``--preset bench`` model, a prompt of ``repeats`` x 6 words, 16
    tokens) through a recording relay to a real server: every GRAPH_COMPUTE priced by cost.flops
    and by the proposal, GRAPH_RECOMPUTE charged again, against the server's CPU time for the
    whole session (which also holds the model upload: an upper bound of the compute)."""
    from rpcguard.protocol.graph import NODE_GFLOPS
    from rpcguard.protocol.versions import COMMAND_IDS
    from tests.support import realpeer
    from tests.support.capture import C2S, CaptureRelay

    model = realpeer.make_model(workdir / "bench.gguf", "--preset", "bench")
    prompt = " ".join(["hello world the quick brown fox"] * repeats)
    srv = Server(workdir, threads)
    srv.sock.close()  # the real client connects instead (the server takes one client at a time)
    relay = CaptureRelay(srv.port, directions=(C2S,))
    try:
        c0 = cpu_ns(srv.proc.popen.pid)
        run = realpeer.run_client(f"127.0.0.1:{relay.port}", model, n=16, extra=["-p", prompt, "--n-ctx", "512"])
        cpu = (cpu_ns(srv.proc.popen.pid) - c0) / 1e9
    finally:
        srv.proc.stop()
    if not run.ok:
        return [f"real client failed: {run.output[-500:]}"]
    gc, gr = COMMAND_IDS["GRAPH_COMPUTE"], COMMAND_IDS["GRAPH_RECOMPUTE"]
    now = prop = 0
    graphs = recomputes = 0
    for conn in relay.conns:
        data, i, last = conn.stream(C2S), 0, (0, 0)
        while i + 9 <= len(data):
            cmd, size = struct.unpack_from("<BQ", data, i)
            body = data[i + 9:i + 9 + size]
            i += 9 + size
            if cmd == gc:
                last = (graph_flops(body), proposed_graph_flops(body))
                graphs += 1
            elif cmd == gr:
                recomputes += 1
            else:
                continue
            now, prop = now + last[0], prop + last[1]
    lines = [line for line in run.output.splitlines() if line.startswith(("prompt:", "generated"))]
    return lines + [f"server CPU {cpu:.3f} s for {graphs} GRAPH_COMPUTE + {recomputes} GRAPH_RECOMPUTE (-t {threads}); "
                    f"cost.flops {now:.3g} = {now / NODE_GFLOPS / 1e9:.3f} s at {NODE_GFLOPS:g} GFLOP/s; proposed "
                    f"{prop:.3g} = {prop / RECOMMENDED_GFLOPS / 1e9:.3f} s at {RECOMMENDED_GFLOPS:g}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="server -t values, comma-separated (default 1,2)")
    ap.add_argument("--only", default="", help="comma-separated kinds (mul_mat, flash_attn, soft_max, add, "
                                               "rms_norm, rope, cpy, get_rows, layer, crafted)")
    ap.add_argument("--match", default="", help="only cases whose name contains this")
    ap.add_argument("--reps", type=int, default=0, help="repetitions per case (0: ~1 s worth, 3..25)")
    ap.add_argument("--crafted", action="store_true", help="also the crafted attacker cases (minutes)")
    ap.add_argument("--quick", action="store_true", help="fewer matrix shapes")
    ap.add_argument("--node-gflops", type=float, default=None, help="ratio column at this rate (default graph.py)")
    ap.add_argument("--json", type=Path, help="write every row here (appended per case)")
    ap.add_argument("--logdir", type=Path, help="keep the servers' logs here (default: a temporary directory)")
    ap.add_argument("--real", type=int, metavar="N", help="only price a real llama.cpp session (prompt of N x 6 words)")
    ap.add_argument("--summarize", type=Path, nargs="+", help="only print the conclusions of earlier --json files")
    a = ap.parse_args(argv)
    if a.real:
        with tempfile.TemporaryDirectory(prefix="compute-cost-") as tmp:
            print("\n".join(real_session(a.logdir or Path(tmp), a.real, int(a.threads.split(",")[0]))))
        return 0
    if a.summarize:
        from rpcguard.protocol.graph import NODE_GFLOPS as default_g

        read = [Row(**json.loads(line)) for f in a.summarize for line in f.read_text().splitlines() if line.strip()]
        refill(read)
        print("\n".join(per_op_summary(read, a.node_gflops or default_g, "min")))
        print("\n".join(per_op_summary(read, a.node_gflops or default_g, "idle")))
        print("\n".join(summary(read, a.node_gflops or default_g)))
        print("\n".join(proposed_summary(read, RECOMMENDED_GFLOPS)))
        print("\n".join(proposed_summary(read, RECOMMENDED_GFLOPS / 2, "wall")))
        return 0

    from rpcguard.protocol.graph import NODE_GFLOPS
    from tests.support.ggmlref import Built, build_many

    g = a.node_gflops or NODE_GFLOPS
    only = {k for k in a.only.split(",") if k}
    todo = [c for c in cases(a.quick, a.crafted or "crafted" in only, "sweep" in only)
            if (not only or c.kind in only) and a.match in c.name]
    built = build_many([c.recipe.fix() for c in todo], timeout_s=600)
    print(f"# compute_cost: {len(todo)} cases, load average {loadavg()} at start, {os.cpu_count()} CPUs "
          f"(the machine is shared with other jobs: medians of repetitions)", flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="compute-cost-") as tmp:
        logdir = a.logdir or Path(tmp)
        logdir.mkdir(parents=True, exist_ok=True)
        for threads in [int(t) for t in a.threads.split(",")]:
            srv = Server(logdir, threads)
            print(f"\n## server -t {threads} (barrier RTT {median(srv.rtt(200)) * 1e6:.0f} us)\n", flush=True)
            print(HEADER.format(g=g), flush=True)
            try:
                for c, b in zip(todo, built):
                    if not isinstance(b, Built):
                        print(f"| {c.name} | refused by the constructor: "
                              f"{b.message[:100]} |", flush=True)
                        continue
                    costs = node_costs(b.payload)
                    try:
                        m = srv.run(b, c.recipe, c.reps if c.reps is not None else a.reps)
                    except (OSError, MemoryError) as e:  # the server closed: say so, start a new one
                        tail = srv.proc.output()[-300:].replace("\n", " / ")
                        print(f"| {c.name} | failed: {type(e).__name__} {e}; server alive={srv.proc.alive()}, "
                              f"log: {tail} |", flush=True)
                        srv.close()
                        srv = Server(logdir, threads)
                        continue
                    row = Row(c.name, c.kind, threads, sum(x for _, x in costs), m["seconds"], m["cpu_s"],
                              m["reps"], c.real, {"by_op": by_op(costs), "first_s": m["first"], "walls": m["walls"],
                                                  "cpus": m["cpus"], "rtt_s": m["rtt"], "load": loadavg()},
                              graph_bytes(b.payload), proposed_graph_flops(b.payload))
                    rows.append(row)
                    print(fmt_row(row, g), flush=True)
                    if a.json:
                        with a.json.open("a") as fh:
                            fh.write(json.dumps(asdict(row)) + "\n")
            finally:
                srv.close()
    print(f"\n# load average {loadavg()} at the end", flush=True)
    print("\n".join(per_op_summary(rows, g, "min")))
    print("\n".join(per_op_summary(rows, g, "idle")))
    if not only or only - {"sweep"}:
        print("\n".join(summary(rows, g)))
        print("\n".join(proposed_summary(rows, RECOMMENDED_GFLOPS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
