"""What one graph node costs the server in compute: the estimate the compute budget bounds.

How this works: ``flops`` is the compute cost model: floating-point operations per node from
its shapes (matrix products ``2*K*|dst|``, attention ``2*n_q*n_kv*(DK+DV)`` per head, everything
else a few operations per element read or written). Summed over a graph and divided by the
node's throughput (``node_gflops``, calibrated against the real server: docs/firewall.md
"Compute budget") it estimates the server's compute time, which ``max_graph_compute_s`` bounds
before the server sees the graph. What the CPU planner allocates for a node is
protocol/workbuf.py's. Sans-IO, pure integer arithmetic on decoded tensors.
"""

from __future__ import annotations

import math
from typing import Callable, Final, Mapping

from rpcguard.protocol.tensor import RpcTensor
from rpcguard.protocol.workbuf import F16, F32, Srcs, elements, quantized, row_size

__all__ = ["flops", "moved_bytes", "ELEMENT_FLOPS", "BYTE_FLOPS"]

# Operations per element of an op the model does not price on its own (exp, division, a few
# multiply-adds): an over-estimate for copies, an under-estimate for nothing that matters.
ELEMENT_FLOPS: Final = 8



# -- compute cost --------------------------------------------------------------------------
#
# Calibrated against the real ggml-rpc-server (bench/studies/compute_cost.py, docs/firewall.md "Compute
# budget"): every node pays BYTE_FLOPS per byte it reads and writes on top of its arithmetic (at
# the default rate a byte costs what the memory-bound one-token matrix products measure); the
# arithmetic is 2*K*|dst| for matrix products, a formula for ops whose work is not proportional
# to their elements, and a number of operations per element for the rest. Each factor was rounded
# up from what the measurements needed, with at least 1.4x margin.

BYTE_FLOPS: Final = 4
FA_FACTOR: Final = {False: 3, True: 5}  # FLASH_ATTN_EXT with F16/F32 K/V, with quantized K/V
OUT_PROD_FACTOR: Final = 6  # vec_mad rows: ~13 GFLOP/s where MUL_MAT does ~100
# OUT_PROD with an F16 src0 (out_prod_f16_f32 converts a row per dst row and inner index): 5-7x
# slower than q8_0's path, measured (bench/studies/compute_cost.py --only train: 1024x256x1024 in
# 254-289 ms on one thread, 0.32 of the estimate at factor 6, 1.3 at 28); 32 keeps 1.4x
OUT_PROD_F16_FACTOR: Final = 32
# ADD1 of a block type (dequantize, add, quantize again per row): q4_K 4096x1024 in 6.4-8.6 ms, q2_K
# in 5.3-6.9 ms on one thread (compute_cost.py --only train), 1.1-1.3x at 32 per element, 1.2-1.5x
# at 48: 64 keeps 1.6x
ADD1_BLOCK_FLOPS: Final = 64
CONVERT_FLOPS: Final = 32  # CPY/DUP/CONT/GET_ROWS/SET_ROWS with a side that is not F32
SORT_FLOPS: Final = 32  # ARGSORT/TOP_K: per element per level of log2(ne0) (std::sort)
POOL_FLOPS: Final = 32  # POOL_1D/2D: per dst element per kernel tap (a scalar loop)
CONV_FACTOR: Final = 2  # CONV_2D (direct): multiplies 2*|dst|*KW*KH*Cin
CONV_DW_FLOPS: Final = 96  # CONV_2D_DW: per dst element per kernel tap (a scalar loop: 1.06e9 taps in 1.9 s)
CONV_T1D_FACTOR: Final = 4  # CONV_TRANSPOSE_1D: multiplies 2*L*K*Cout*Cin (a dot over Cin per tap)
UPSCALE_TAPS: Final = {0: 1, 1: 4, 2: 16}  # NEAREST, BILINEAR, BICUBIC: source pixels per dst element
ELEMENT_FLOPS_OP: Final = {"SOFT_MAX": 48, "RMS_NORM": 24, "NORM": 24, "L2_NORM": 24, "GROUP_NORM": 24,
                           "ROPE": 16}
_CONVERTING: Final = frozenset({"CPY", "DUP", "CONT"})
# Ops ggml-cpu never computes (views, NONE): no cost.
_FREE: Final = frozenset({"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})


def _bytes(t: RpcTensor | None) -> int:
    """Logical bytes (elements x type size): a view with a zero stride is still read element by
    element."""
    return 0 if t is None else row_size(t.type, elements(t))


def moved_bytes(op: str, node: RpcTensor, srcs: Srcs) -> int:
    """Bytes a node reads and writes; GET_ROWS / SET_ROWS count the rows they touch of the table
    or cache, not all of it; views move nothing."""
    if op in _FREE:
        return 0
    if op == "GET_ROWS" and srcs[0] is not None:
        return _bytes(node) + _bytes(srcs[1]) + node.ne1 * node.ne2 * node.ne3 * row_size(srcs[0].type, srcs[0].ne0)
    if op == "SET_ROWS" and srcs[1] is not None:
        b = srcs[1]
        return _bytes(b) + _bytes(srcs[2]) + b.ne1 * b.ne2 * b.ne3 * row_size(node.type, node.ne0)
    return _bytes(node) + sum(_bytes(t) for t in srcs)


def _matmul(n: RpcTensor, s: Srcs) -> int:
    a = s[0]
    return 2 * (a.ne0 if a is not None else 1) * elements(n)


def _out_prod(n: RpcTensor, s: Srcs) -> int:
    a = s[0]  # ops.cpp out_prod loops over src0's ne1
    factor = OUT_PROD_F16_FACTOR if a is not None and a.type == F16 else OUT_PROD_FACTOR
    return factor * 2 * (a.ne1 if a is not None else 1) * elements(n)


def _flash_attn(n: RpcTensor, s: Srcs) -> int:
    q, k, v = s[0], s[1], s[2]
    if q is None or k is None or v is None:
        return 0
    # per query row (ne1), head (ne2) and sequence (ne3): a dot product of DK and an accumulation
    # of DV per key
    return FA_FACTOR[quantized(k.type)] * 2 * q.ne1 * q.ne2 * q.ne3 * k.ne1 * (k.ne0 + v.ne0)


def _ssm_conv(n: RpcTensor, s: Srcs) -> int:
    c = s[1]
    return 2 * (c.ne0 if c is not None else 1) * elements(n)


def _sort(n: RpcTensor, s: Srcs) -> int:
    a = s[0]
    if a is None:
        return 0
    return SORT_FLOPS * elements(a) * max(1, math.ceil(math.log2(max(a.ne0, 2))))


def _pool_1d(n: RpcTensor, s: Srcs) -> int:
    return POOL_FLOPS * elements(n) * max(1, n.param1)


def _pool_2d(n: RpcTensor, s: Srcs) -> int:
    return POOL_FLOPS * elements(n) * max(1, n.param1) * max(1, n.param2)


def _conv_2d(n: RpcTensor, s: Srcs) -> int:
    a = s[0]
    return CONV_FACTOR * 2 * elements(n) * (a.ne0 * a.ne1 * a.ne2 if a is not None else 1)


def _conv_2d_dw(n: RpcTensor, s: Srcs) -> int:
    k = s[0]  # [KW, KH, 1, C]: every dst element reads KW*KH taps
    return CONV_DW_FLOPS * elements(n) * (k.ne0 * k.ne1 if k is not None else 1)


def _conv_transpose_1d(n: RpcTensor, s: Srcs) -> int:
    k, x = s[0], s[1]  # kernel [K, Cout, Cin], input [L, Cin]: each input element meets K*Cout taps
    if k is None or x is None:
        return 0
    return CONV_T1D_FACTOR * 2 * x.ne0 * k.ne0 * k.ne1 * k.ne2


def _upscale(n: RpcTensor, s: Srcs) -> int:
    a = s[0]
    mode = n.param0 & 0xFF
    taps = UPSCALE_TAPS.get(mode, 16)
    if n.param0 & (1 << 9) and a is not None:  # ANTIALIAS: a window of 2*support+1 per axis, support >= 1
        w0 = 2 * max(1, -(-a.ne0 // max(1, n.ne0))) + 1
        w1 = 2 * max(1, -(-a.ne1 // max(1, n.ne1))) + 1
        taps = w0 * w1
    return POOL_FLOPS * taps * elements(n)


# -- recurrent and newer-model ops (compute) --
#
# Measured with test-backend-ops perf on the CPU backend of the pinned tree (this shared 2-core
# machine, 2026-12-02), each factor rounded up so that the estimate at the default 40 GFLOP/s is
# at least 1.4x the slowest time measured:
# GATED_DELTA_NET S_v=128, H=32, T=1024: 5.4e8 head-token-S_v^2 steps in 218 ms (4.1e-10 s each;
# H=4, T=512: 4.3e-10 s);
# SOLVE_TRI [256,256,4,2] \ [128,256,4,2]: 6.7e7 n^2*k steps in 31 ms (4.5e-10 s each);
# TRI [1024,1024,8,4]: 3.4e7 elements in 77 ms (a predicate through a function pointer per element);
# LIGHTNING_INDEXER D=128, 32 heads, 256 keys, 512 tokens, q4_0 K: 5.4e8 q-element-key steps in
# 256 ms (4.7e-10 s each; its 4.2-17 GFLOP/s over all K types).
# The DSV4 kernels have no perf case: their loops, copied from ops.cpp and compiled with gcc -O3
# -march=native, timed on one thread here: a Sinkhorn iteration 20-35 ns (one token is one
# thread's); HC_POST 1.4 ns per comb term at hc = 4, 5.4 ns at hc = 256 or 1024 (residual rows
# read across); HC_PRE 5.7-9.6 ns per x element gated, the factors taken for two threads.
GDN_FLOPS: Final = 28  # per S_v^2 per head per token (scale/decay, two dots and a rank-1 update)
SOLVE_TRI_FLOPS: Final = 28  # per n*n*k per batch (a forward substitution reading X by columns)
DSV4_COMB_FLOPS: Final = 2048  # per token per Sinkhorn iteration (a row and a column pass of 4x4)
DSV4_TERM_FLOPS: Final = 160  # HC_POST per output per comb term, HC_PRE per x element (strided scalar loops)
DSV4_GATE_FLOPS: Final = 288  # HC_PRE gated: per x element (a sigmoid through expf)
LIGHTNING_FLOPS: Final = 28  # per q element per key (a dot of D per head; K re-converted per token)
TRI_FLOPS: Final = 56  # per element read or written


def _tri(n: RpcTensor, s: Srcs) -> int:
    return TRI_FLOPS * (elements(n) + elements(s[0]))


def _gated_delta_net(n: RpcTensor, s: Srcs) -> int:
    v = s[2]
    if v is None:
        return 0
    S_v, H, T, n_seqs = v.ne
    return GDN_FLOPS * S_v * S_v * H * T * n_seqs


def _solve_tri(n: RpcTensor, s: Srcs) -> int:
    b = s[1]
    return SOLVE_TRI_FLOPS * b.ne1 * elements(b) if b is not None else 0


def _dsv4_hc_comb(n: RpcTensor, s: Srcs) -> int:
    return DSV4_COMB_FLOPS * n.ne2 * max(1, n.param1) + ELEMENT_FLOPS * 64 * n.ne2


def _dsv4_hc_pre(n: RpcTensor, s: Srcs) -> int:
    return (DSV4_GATE_FLOPS if n.param1 else DSV4_TERM_FLOPS) * elements(s[0])


def _dsv4_hc_post(n: RpcTensor, s: Srcs) -> int:
    return DSV4_TERM_FLOPS * elements(n) * (n.ne1 if s[3] is not None else 1)


def _lightning_indexer(n: RpcTensor, s: Srcs) -> int:
    q, k = s[0], s[1]
    if q is None or k is None:
        return 0
    return LIGHTNING_FLOPS * elements(q) * k.ne2 + CONVERT_FLOPS * elements(k) * q.ne2  # K re-converted for every token
def _add1(n: RpcTensor, s: Srcs) -> int:
    # a block-type src0 is dequantized, incremented and quantized again row by row (ops.cpp:921
    # add1_q_f32): ADD1_BLOCK_FLOPS per element read or written
    a = s[0]
    per = ADD1_BLOCK_FLOPS if a is not None and quantized(a.type) else ELEMENT_FLOPS
    return per * (elements(n) + sum(elements(t) for t in s))


_FLOPS: Mapping[str, Callable[[RpcTensor, Srcs], int]] = {
    "MUL_MAT": _matmul, "MUL_MAT_ID": _matmul, "SSM_CONV": _ssm_conv, "OUT_PROD": _out_prod,
    "FLASH_ATTN_EXT": _flash_attn, "ARGSORT": _sort, "TOP_K": _sort, "POOL_1D": _pool_1d, "POOL_2D": _pool_2d,
    "CONV_2D": _conv_2d, "CONV_2D_DW": _conv_2d_dw, "CONV_TRANSPOSE_1D": _conv_transpose_1d, "UPSCALE": _upscale,
    # -- recurrent and newer-model ops --
    "GATED_DELTA_NET": _gated_delta_net, "SOLVE_TRI": _solve_tri, "DSV4_HC_COMB": _dsv4_hc_comb,
    "DSV4_HC_PRE": _dsv4_hc_pre, "DSV4_HC_POST": _dsv4_hc_post, "LIGHTNING_INDEXER": _lightning_indexer, "TRI": _tri,
    # -- training and backward ops
    "ADD1": _add1,
}  # fmt: skip


def flops(op: str, node: RpcTensor, srcs: Srcs) -> int:
    """Estimated floating-point operations the server spends on this node (its arithmetic plus
    BYTE_FLOPS per byte moved)."""
    if op in _FREE or not elements(node):
        return 0
    moved = BYTE_FLOPS * moved_bytes(op, node, srcs)
    fn = _FLOPS.get(op)
    if fn is not None:
        return fn(node, srcs) + moved
    if op in ("GET_ROWS", "SET_ROWS"):
        data = srcs[0] if op == "GET_ROWS" else srcs[1]
        per = 8 if node.type == F32 and (data is None or data.type == F32) else CONVERT_FLOPS
        return per * moved_bytes(op, node, srcs) // 4 + moved
    per = ELEMENT_FLOPS_OP.get(op, ELEMENT_FLOPS)
    if op in _CONVERTING and not all(t is None or t.type == F32 for t in (node, *srcs)):
        per = CONVERT_FLOPS
    return per * (elements(node) + sum(elements(t) for t in srcs)) + moved


# -- convolutions (3D, transposed, col2im) ------------------------------------------------------
#
# CONV_2D/CONV_3D (ops.cpp:7313, 7450) gather every patch into the work buffer (one scalar step per
# tap) before a matrix product over the output channels: besides CONV_FACTOR's product, each tap
# of each output position costs CONV_IM2COL_FLOPS. CONV_TRANSPOSE_2D (ops.cpp:7591) calls one
# vec_dot of Cin per tap of every input pixel and output channel: CONV_T2D_FACTOR per multiply-add
# plus CONV_T2D_DOT_FLOPS per call. IM2COL and IM2COL_3D write one gathered (bounds-checked,
# converted) element per result element: IM2COL_FLOPS each. COL2IM_1D gathers, per output, the
# at most min(T_in, K/s0 + 1) columns that overlap it, strided by a whole column: COL2IM_FLOPS each.

# Measured with bench/studies/compute_cost.py (the real 7.0.0 server, -t 1, its CPU time, this
# shared 2-core machine, 2026-12-02): the gather costs 1.5 ns per tap in 2D (conv_2d_direct
# 64x64 cin=64 cout=1 k=7: 10.6e6 taps in 15.8 ms) and 2.2 ns in 3D (conv_3d_direct 24^3 cin=8
# cout=1 k=3: 2.3e6 taps in 5.0 ms), 87 operations at 40 GFLOP/s: 128 covers both at >= 1.5x.
# CONV_TRANSPOSE_2D with Cin = 1 (128x128 cout=16 k=3 s=2) is 2.4e6 dots in 8.8 ms, 3.7 ns (149
# operations) each: 256 per dot covers it at 1.8x; at Cin = 64 the product term dominates (3.9x).
# IM2COL/IM2COL_3D measured the same way: 3.3-3.8 ns per F16 result element (im2col 2D 256x256
# cin=16 k=3: 9.3e6 in 35 ms; im2col_3d 24^3 cin=8 k=3: 2.3e6 in 7.6 ms), 1.0-1.7 ns per F32 one;
# 256 covers the F16 ones at >= 1.75x. COL2IM_1D: 2.3-3.5 ns per gathered column (k=4096 oc=1
# t_in=4096 s=1: 1.7e7 in 59 ms), 256 per column of the bound above covers it at >= 1.8x.
IM2COL_FLOPS: Final = 256  # IM2COL / IM2COL_3D: per result element
COL2IM_FLOPS: Final = 256  # COL2IM_1D: per gathered column
CONV_IM2COL_FLOPS: Final = 128  # per patch tap of CONV_2D/CONV_3D
CONV_T2D_FACTOR: Final = 4  # CONV_TRANSPOSE_2D: multiplies 2*N*H*W*KW*KH*Cout*Cin
CONV_T2D_DOT_FLOPS: Final = 256  # CONV_TRANSPOSE_2D: per vec_dot call (N*H*W*KW*KH*Cout of them)
def _conv_2d_direct(n: RpcTensor, s: Srcs) -> int:
    a = s[0]  # [KW, KH, IC, OC]: N*OW*OH patches of KW*KH*IC taps, times OC in the product
    taps = a.ne0 * a.ne1 * a.ne2 if a is not None else 1
    patches = n.ne0 * n.ne1 * n.ne3
    return CONV_FACTOR * 2 * elements(n) * taps + CONV_IM2COL_FLOPS * patches * taps


def _conv_3d_direct(n: RpcTensor, s: Srcs) -> int:
    a = s[0]  # [KW, KH, KD, IC*OC]; params[9] = IC, [11] = OC (the rule holds them >= 1)
    ic, oc = max(1, n.op_params[9]), max(1, n.op_params[11])
    taps = (a.ne0 * a.ne1 * a.ne2 if a is not None else 1) * ic
    patches = elements(n) // oc
    return CONV_FACTOR * 2 * elements(n) * taps + CONV_IM2COL_FLOPS * patches * taps


def _conv_transpose_2d(n: RpcTensor, s: Srcs) -> int:
    k, x = s[0], s[1]  # kernel [KW, KH, Cout, Cin], input [W, H, Cin, N]
    if k is None or x is None:
        return 0
    dots = x.ne0 * x.ne1 * x.ne3 * k.ne0 * k.ne1 * k.ne2
    return CONV_T2D_FACTOR * 2 * dots * k.ne3 + CONV_T2D_DOT_FLOPS * dots


# CONV_TRANSPOSE_1D/2D zero the WHOLE work buffer of the plan on every node (ops.cpp:6539, 6627,
# 7613: memset(params->wdata, 0, params->wsize)), and that buffer is the largest need of any node
# of the graph: a graph of many tiny transposed convolutions next to one node of a 1 GiB need
# (graph.MAX_WORK_BYTES, the default cap) clears 1 GiB per node, which their own sizes do not
# show. Each is charged that memset at BYTE_FLOPS per byte: 0.11 s at 40 GFLOP/s, 3x the 0.034 s
# a 1 GiB memset takes on this machine. (A policy raising max_work_bytes raises the real cost too.)
WORK_MEMSET_FLOPS: Final = BYTE_FLOPS * (1 << 30)


def _conv_transpose_2d_all(n: RpcTensor, s: Srcs) -> int:
    return _conv_transpose_2d(n, s) + WORK_MEMSET_FLOPS


def _conv_transpose_1d_all(n: RpcTensor, s: Srcs) -> int:
    return _conv_transpose_1d(n, s) + WORK_MEMSET_FLOPS


def _im2col(n: RpcTensor, s: Srcs) -> int:
    return IM2COL_FLOPS * elements(n)


def _col2im_1d(n: RpcTensor, s: Srcs) -> int:
    a = s[0]  # [K*OC, T_in]; params {s0, OC, p0} (the rule holds s0, OC >= 1); result [T_out, OC]
    if a is None:
        return 0
    s0, oc = max(1, n.op_params[0]), max(1, n.op_params[1])
    return COL2IM_FLOPS * elements(n) * min(a.ne1, a.ne0 // oc // s0 + 1)


# IM2COL_BACK (ops.cpp:6896) visits every tap of the kernel for every image element, with an int64
# division and remainder by the stride per tap (2D: two); POOL_2D_BACK (ops.cpp:8085) every tap of
# the window for every gradient element, as POOL_2D does for every result element, on one thread.
# Measured (compute_cost.py --only train --match _back, -t 1, server CPU time, 2026-12-02): IM2COL_BACK
# 7.1 ns per tap in 2D (128x128 cin=16 k=3: 2.4e6 taps in 16.7 ms), 3.4 ns in 1D; POOL_2D_BACK 1.44
# ns per tap with MAX (128x128x64 k=4 s=2: 4.1e6 taps in 5.9 ms), 0.64 with AVG. 512 and 96
# operations (12.8 and 2.4 ns at 40 GFLOP/s) keep 1.6x and 1.7x over the slowest.
IM2COL_BACK_TAP_FLOPS: Final = 512  # IM2COL_BACK: per image element per kernel tap
POOL_BACK_TAP_FLOPS: Final = 96  # POOL_2D_BACK: per gradient element per window tap


def _im2col_back(n: RpcTensor, s: Srcs) -> int:
    k = s[1]  # the convolution kernel [KW, KH, ...] (1D: [KW, IC, ...]); params[6] is_2D
    if k is None:
        return 0
    taps = k.ne0 * (k.ne1 if n.op_params[6] == 1 else 1)
    return IM2COL_BACK_TAP_FLOPS * elements(n) * taps


def _pool_2d_back(n: RpcTensor, s: Srcs) -> int:
    g = s[0]  # the gradient of POOL_2D's result; params {op, k0, k1, ...} (the rule holds k >= 1)
    return 0 if g is None else POOL_BACK_TAP_FLOPS * elements(g) * max(1, n.param1) * max(1, n.param2)


_FLOPS = {**_FLOPS, "CONV_2D": _conv_2d_direct, "CONV_3D": _conv_3d_direct, "CONV_TRANSPOSE_2D": _conv_transpose_2d_all,
          "CONV_TRANSPOSE_1D": _conv_transpose_1d_all, "IM2COL": _im2col, "IM2COL_3D": _im2col,
          "COL2IM_1D": _col2im_1d, "IM2COL_BACK": _im2col_back, "POOL_2D_BACK": _pool_2d_back}
