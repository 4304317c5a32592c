"""What one graph node costs the server in compute: the estimate the compute budget bounds.

Stays whole (over 400 lines): the per-op formulas and the one price table they share; a cost
profile (costprofile.py) swaps the prices, never the formulas.

How this works: ``flops`` is the compute cost model: floating-point operations per node from
its shapes (matrix products ``2*K*|dst|``, attention ``2*n_q*n_kv*(DK+DV)`` per head, everything
else a few operations per element read or written). Summed over a graph and divided by the
node's throughput (``node_gflops``, calibrated against the real server: docs/firewall.md
"Compute budget") it estimates the server's compute time, which ``max_graph_compute_s`` bounds
before the server sees the graph. What the CPU planner allocates for a node is
protocol/workbuf.py's. Sans-IO, pure integer arithmetic on decoded tensors.

Work and price are kept apart: each formula counts an op's work in units that follow its
kernel's loops (multiply-adds of a matrix product per weight-type class, state elements per
token of a recurrent op, elements of a transcendental function, ...), and ``PRICES`` gives the
flop-equivalents one unit costs on the node (the CPU of ggml-cpu, measured: bench/studies/
compute_cost.py --only sweep, docs/performance.md "Compute prices per op"). A backend whose
kernels have other relative costs passes its own mapping (``flops(..., prices=...)``, every key
of ``PRICES``); ``node_gflops`` stays the one rate that turns flop-equivalents into seconds.
"""

from __future__ import annotations

import math
from typing import Callable, Final, Mapping

from rpcguard.protocol.tensor import RpcTensor
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.workbuf import BF16, F16, F32, Srcs, elements, quantized, row_size

Prices = Mapping[str, int]  # unit -> flop-equivalents per unit on the node

__all__ = ["flops", "moved_bytes", "seconds", "matmul_class", "type_class", "Prices", "PRICES", "TYPE_CLASSES",
           "ELEMENT_FLOPS", "BYTE_FLOPS"]

# Operations per element of an op the model does not price on its own (exp, division, a few
# multiply-adds): an over-estimate for copies, an under-estimate for nothing that matters.
ELEMENT_FLOPS: Final = 8


# -- compute cost --------------------------------------------------------------------------
#
# Calibrated against the real ggml-rpc-server (bench/studies/compute_cost.py, docs/firewall.md "Compute
# budget"): every node pays BYTE_FLOPS per byte it reads and writes on top of its work (at the
# default rate a byte costs what the memory-bound one-token matrix products measure); the work is
# counted per unit of its kernel's loops and priced by PRICES (at the end of this module), each
# price rounded up from the slowest measured shape of its unit with at least 1.3x margin. The
# constants below are the prices measured before the per-op sweep, kept where the sweep agreed.

BYTE_FLOPS: Final = 4
# MUL_MAT/MUL_MAT_ID, OUT_PROD, FLASH_ATTN_EXT, ADD1 and the conversions are priced per weight-type
# class (PRICES below, measured per type: bench/studies/compute_cost.py --only sweep).
CONVERT_FLOPS: Final = 32  # CPY/DUP/CONT/GET_ROWS/SET_ROWS with a side that is not F32
SORT_FLOPS: Final = 32  # TOP_K: per element per level of log2(ne0) (ARGSORT: PRICES["sort"])
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
    if op == "SET_ROWS" and srcs[0] is not None:
        b = srcs[0]  # ggml_set_rows: src[0] the rows, src[1] their indices, src[2] the table
        return _bytes(b) + _bytes(srcs[1]) + b.ne1 * b.ne2 * b.ne3 * row_size(node.type, node.ne0)
    return _bytes(node) + sum(_bytes(t) for t in srcs)


def _matmul(n: RpcTensor, s: Srcs, p: Prices) -> int:
    # ggml_compute_forward_mul_mat (ggml-cpu.c): src1 converted once to src0's vec_dot type (a
    # from_float per element unless src0 is F32), then one vec_dot of K per dst element (or
    # llamafile_sgemm's tiles for the types it has): K multiply-adds per dst element, priced per
    # src0 type class. MUL_MAT_ID (ggml-cpu.c:1655): the same per used expert and token.
    a, b = s[0], s[1]
    if a is None:
        return 2 * elements(n)
    convert = 0
    if a.type != F32 and b is not None and b.type == F32:  # from_float into q8_K for the 256-blocks: 2.2 ns
        convert = (p["convert"] if type_class(a.type) in ("f16", "q") else p["convert_q8_K"]) * elements(b)
    return (_price(p, "mm", a.type) * a.ne0 + p["mm_call"]) * elements(n) + convert


def _out_prod(n: RpcTensor, s: Srcs, p: Prices) -> int:
    a = s[0]  # ops.cpp out_prod loops over src0's ne1
    if a is None:
        return 0
    # (ops.cpp out_prod_f32: a vec_mad per dst row and inner index; a block-type or F16 src0's
    # row dequantized for each)
    return _price(p, "out_prod", a.type) * a.ne1 * elements(n)


def _flash_attn(n: RpcTensor, s: Srcs, p: Prices) -> int:
    q, k, v = s[0], s[1], s[2]
    if q is None or k is None or v is None:
        return 0
    # per query row (ne1), head (ne2) and sequence (ne3): a dot product of DK and an accumulation
    # of DV per key
    # (ops.cpp flash_attn_ext_f16_one_chunk: a kq_vec_dot of K's type, then V's row through
    # v_to_float unless F16, per query and key), priced per multiply-add by the dearer class of K
    # and V
    per = max(_price(p, "fa", k.type), _price(p, "fa", v.type))
    return (per * (k.ne0 + v.ne0) + p["fa_key"]) * q.ne1 * q.ne2 * q.ne3 * k.ne1  # fa_key: an expf per key


def _ssm_conv(n: RpcTensor, s: Srcs, p: Prices) -> int:
    c = s[1]  # ops.cpp:9932: a scalar dot of d_conv per dst element
    return p["ssm_conv_tap"] * (c.ne0 if c is not None else 1) * elements(n)


# -- recurrent state ops: work per state element per token ---------------------------------------
#
# RWKV_WKV6 (ops.cpp:10642), GATED_LINEAR_ATTN (ops.cpp:10854) and RWKV_WKV7 (ops.cpp:11651) loop
# over tokens t < T, heads h, rows i < S and columns j < S of the head's S x S state: T*H*S*S =
# T*C*S steps (C = dst.ne0 = S*H, S = C / v.ne1, T = v.ne2), each a few multiply-adds on the state
# read and written (WKV7 two passes: a dot with the state row, then the update). A state larger
# than the caches is streamed from memory once per token: the price per step is the slowest of
# the measured shapes (a 32 MiB state per token), so a real RWKV head of 64 is over-priced a few
# times, never under-priced. SSM_SCAN (ops.cpp:10002) loops over tokens, heads, head_dim rows and
# d_state columns: nc*nr*nh*nt*ns steps; Mamba-1 (A with d_state columns) calls expf in each step
# (ops.cpp:10202, a scalar loop), Mamba-2 (A one per head) is a vector FMA loop.


def _linear_attn_steps(n: RpcTensor, v: RpcTensor | None) -> int:
    if v is None or not v.ne1:
        return 0
    c = n.ne0
    return v.ne2 * c * (c // v.ne1)  # T * C * head_size


def _wkv6(n: RpcTensor, s: Srcs, p: Prices) -> int:
    v = s[1]  # plus a row's setup (four broadcasts, a remainder loop) per token and state row: T*C
    return p["state_step"] * _linear_attn_steps(n, v) + p["state_row"] * (v.ne2 * n.ne0 if v is not None else 0)


def _wkv7(n: RpcTensor, s: Srcs, p: Prices) -> int:
    v = s[1]
    return p["state_step7"] * _linear_attn_steps(n, v) + p["state_row"] * (v.ne2 * n.ne0 if v is not None else 0)


# The vector loops of SSM_SCAN (Mamba-2) and the vec_dot/vec_mad calls of GATED_DELTA_NET step
# GGML_F32_STEP floats at a time (32 with AVX2, 64 with AVX-512) and finish the rest in a
# scalar loop: the last ``n % SCALAR_TAIL`` of each row are priced as scalar steps.
SCALAR_TAIL: Final = 64


def _ssm_scan(n: RpcTensor, s: Srcs, p: Prices) -> int:
    st, x, a = s[0], s[1], s[3]
    if st is None or x is None or a is None:
        return 0
    rows = st.ne1 * x.ne1 * x.ne2 * x.ne3  # head_dim * heads * tokens * sequences
    if a.ne0 != 1:  # Mamba-1: expf in every step of a scalar loop
        return p["scan_step_exp"] * st.ne0 * rows
    tail = st.ne0 % SCALAR_TAIL
    return (p["scan_step"] * (st.ne0 - tail) + p["scan_step_scalar"] * tail) * rows


# -- element-wise ops whose price depends on the function (a libm call per element, or not) ---
# UNARY's function is op_params[0] (ggml.h enum ggml_unary_op), GLU's too (enum ggml_glu_op).
UNARY_NAMES: Final = ("abs", "sgn", "neg", "step", "tanh", "elu", "relu", "sigmoid", "gelu", "gelu_quick", "silu",
                      "hardswish", "hardsigmoid", "exp", "expm1", "softplus", "gelu_erf", "xielu", "floor", "ceil",
                      "round", "trunc")
GLU_NAMES: Final = ("reglu", "geglu", "swiglu", "swiglu_oai", "geglu_erf", "geglu_quick", "swiglu_clamp")


def _per_element(key: str, n: RpcTensor, s: Srcs, p: Prices) -> int:
    return p.get(key, p["element"]) * (elements(n) + sum(elements(t) for t in s))


def _unary(n: RpcTensor, s: Srcs, p: Prices) -> int:
    name = UNARY_NAMES[n.param0] if 0 <= n.param0 < len(UNARY_NAMES) else ""
    return _per_element("unary." + name, n, s, p)


def _glu(n: RpcTensor, s: Srcs, p: Prices) -> int:
    name = GLU_NAMES[n.param0] if 0 <= n.param0 < len(GLU_NAMES) else ""
    return _per_element("glu." + name, n, s, p)


def _timestep_embedding(n: RpcTensor, s: Srcs, p: Prices) -> int:
    return p["timestep"] * elements(n)  # ops.cpp: an expf, a cosf and a sinf per pair of dst elements


def _convert_price(src: int, dst: int, p: Prices) -> int:
    """Flop-equivalents per element converted from type ``src`` to type ``dst``: to F32 (the
    source type's to_float), then from F32 (the destination's from_float); F32 itself is free."""
    if src == dst and src in (F32, F16, BF16):
        return p["element"]
    return (0 if src == F32 else _price(p, "dequant", src)) + (0 if dst == F32 else _price(p, "quant", dst))


def _sort(n: RpcTensor, s: Srcs, p: Prices) -> int:
    a = s[0]  # std::sort of each row's indices by value: mispredicted compares on varied values
    if a is None:
        return 0
    return p["sort"] * elements(a) * max(1, math.ceil(math.log2(max(a.ne0, 2))))


def _top_k(n: RpcTensor, s: Srcs, p: Prices) -> int:
    a = s[0]  # a partial sort: the same bound, its own price
    if a is None:
        return 0
    return p["top_k"] * elements(a) * max(1, math.ceil(math.log2(max(a.ne0, 2))))


def _pool_1d(n: RpcTensor, s: Srcs, p: Prices) -> int:
    return p["pool"] * elements(n) * max(1, n.param1)


def _pool_2d(n: RpcTensor, s: Srcs, p: Prices) -> int:
    return p["pool"] * elements(n) * max(1, n.param1) * max(1, n.param2)


def _conv_2d(n: RpcTensor, s: Srcs, p: Prices) -> int:
    a = s[0]
    return p["conv_factor"] * 2 * elements(n) * (a.ne0 * a.ne1 * a.ne2 if a is not None else 1)


def _conv_2d_dw(n: RpcTensor, s: Srcs, p: Prices) -> int:
    k = s[0]  # [KW, KH, 1, C]: every dst element reads KW*KH taps
    return p["conv_dw"] * elements(n) * (k.ne0 * k.ne1 if k is not None else 1)


def _conv_transpose_1d(n: RpcTensor, s: Srcs, p: Prices) -> int:
    k, x = s[0], s[1]  # kernel [K, Cout, Cin], input [L, Cin]: each input element meets K*Cout taps
    if k is None or x is None:
        return 0
    return p["conv_t1d_factor"] * 2 * x.ne0 * k.ne0 * k.ne1 * k.ne2


def _upscale(n: RpcTensor, s: Srcs, p: Prices) -> int:
    a = s[0]
    mode = n.param0 & 0xFF
    taps = UPSCALE_TAPS.get(mode, 16)
    if n.param0 & (1 << 9) and a is not None:  # ANTIALIAS: a window of 2*support+1 per axis, support >= 1
        w0 = 2 * max(1, -(-a.ne0 // max(1, n.ne0))) + 1
        w1 = 2 * max(1, -(-a.ne1 // max(1, n.ne1))) + 1
        taps = w0 * w1
    return p["pool"] * taps * elements(n)


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


def _tri(n: RpcTensor, s: Srcs, p: Prices) -> int:
    return p["tri"] * (elements(n) + elements(s[0]))


def _gated_delta_net(n: RpcTensor, s: Srcs, p: Prices) -> int:
    v = s[2]
    if v is None:
        return 0
    # ops.cpp:11196-11260: per head, sequence and token, S_v rows of three vector calls (a dot
    # with k, a mad, a dot with q) over the S_v x S_v state: S_v^2 steps, S_v call triples, and
    # the rows' scalar tails
    S_v, H, T, n_seqs = v.ne
    rows = S_v * H * T * n_seqs
    return p["gdn"] * S_v * rows + (p["gdn_row"] + p["gdn_scalar"] * (S_v % SCALAR_TAIL)) * rows


def _solve_tri(n: RpcTensor, s: Srcs, p: Prices) -> int:
    b = s[1]
    return p["solve_tri"] * b.ne1 * elements(b) if b is not None else 0


def _dsv4_hc_comb(n: RpcTensor, s: Srcs, p: Prices) -> int:
    return p["dsv4_comb"] * n.ne2 * max(1, n.param1) + p["element"] * 64 * n.ne2


def _dsv4_hc_pre(n: RpcTensor, s: Srcs, p: Prices) -> int:
    return (p["dsv4_gate"] if n.param1 else p["dsv4_term"]) * elements(s[0])


def _dsv4_hc_post(n: RpcTensor, s: Srcs, p: Prices) -> int:
    return p["dsv4_term"] * elements(n) * (n.ne1 if s[3] is not None else 1)


def _lightning_indexer(n: RpcTensor, s: Srcs, p: Prices) -> int:
    q, k = s[0], s[1]
    if q is None or k is None:
        return 0
    # K re-converted to F32 for every token (its class's to_float)
    deq = p["element"] if k.type == F32 else _price(p, "dequant", k.type)
    return p["lightning"] * elements(q) * k.ne2 + deq * elements(k) * q.ne2
def _add1(n: RpcTensor, s: Srcs, p: Prices) -> int:
    # a block-type src0 is dequantized, incremented and quantized again row by row (ops.cpp:921
    # add1_q_f32): a row's to_float and from_float per element on top (the quantizers of the
    # 256-blocks search scales: 12-300 ns per element on varied values)
    a = s[0]
    requant = _price(p, "dequant", a.type) + _price(p, "quant", a.type) if a is not None and quantized(a.type) else 0
    return p["element"] * (elements(n) + sum(elements(t) for t in s)) + requant * elements(n)


_FLOPS: Mapping[str, Callable[[RpcTensor, Srcs, Prices], int]] = {
    "MUL_MAT": _matmul, "MUL_MAT_ID": _matmul, "SSM_CONV": _ssm_conv, "OUT_PROD": _out_prod,
    "FLASH_ATTN_EXT": _flash_attn, "ARGSORT": _sort, "TOP_K": _top_k, "POOL_1D": _pool_1d, "POOL_2D": _pool_2d,
    "CONV_2D": _conv_2d, "CONV_2D_DW": _conv_2d_dw, "CONV_TRANSPOSE_1D": _conv_transpose_1d, "UPSCALE": _upscale,
    # -- recurrent and newer-model ops --
    "GATED_DELTA_NET": _gated_delta_net, "SOLVE_TRI": _solve_tri, "DSV4_HC_COMB": _dsv4_hc_comb,
    "DSV4_HC_PRE": _dsv4_hc_pre, "DSV4_HC_POST": _dsv4_hc_post, "LIGHTNING_INDEXER": _lightning_indexer, "TRI": _tri,
    # -- training and backward ops
    "ADD1": _add1, "RWKV_WKV6": _wkv6, "GATED_LINEAR_ATTN": _wkv6, "RWKV_WKV7": _wkv7, "SSM_SCAN": _ssm_scan,
    "UNARY": _unary, "GLU": _glu, "TIMESTEP_EMBEDDING": _timestep_embedding,
}  # fmt: skip


def flops(op: str, node: RpcTensor, srcs: Srcs, prices: Prices | None = None) -> int:
    """Estimated flop-equivalents the server spends on this node: its work in each unit times
    the unit's price (``prices``, default ``PRICES``: ggml-cpu's) plus a price per byte moved."""
    if op in _FREE or not elements(node):
        return 0
    p = PRICES if prices is None else prices
    moved = p["byte"] * moved_bytes(op, node, srcs)
    fn = _FLOPS.get(op)
    if fn is not None:
        return fn(node, srcs, p) + moved
    if op == "GET_ROWS" and srcs[0] is not None:  # the rows read, converted to dst's type
        return _convert_price(srcs[0].type, node.type, p) * elements(node) + moved
    if op == "SET_ROWS" and srcs[0] is not None:  # the source rows, converted to the table's type
        return _convert_price(srcs[0].type, node.type, p) * elements(srcs[0]) + moved
    if op in _CONVERTING and srcs[0] is not None and srcs[0].type != node.type:
        return _convert_price(srcs[0].type, node.type, p) * elements(node) + moved
    if op in _CONVERTING and srcs[0] is not None and srcs[0].type not in (F32, F16, BF16):  # a block copy
        return p["element"] * (elements(node) + elements(srcs[0])) + moved
    return _per_element("op." + op, node, srcs, p) + moved


def seconds(flop: int, node_gflops: float) -> float:
    """The estimated compute time of ``flop`` flop-equivalents at ``node_gflops`` (0 or less:
    the budget is off, the estimate 0)."""
    return flop / (node_gflops * 1e9) if node_gflops > 0 else 0.0


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
def _conv_2d_direct(n: RpcTensor, s: Srcs, p: Prices) -> int:
    a = s[0]  # [KW, KH, IC, OC]: N*OW*OH patches of KW*KH*IC taps, times OC in the product
    taps = a.ne0 * a.ne1 * a.ne2 if a is not None else 1
    patches = n.ne0 * n.ne1 * n.ne3
    return p["conv_factor"] * 2 * elements(n) * taps + p["conv_im2col"] * patches * taps


def _conv_3d_direct(n: RpcTensor, s: Srcs, p: Prices) -> int:
    a = s[0]  # [KW, KH, KD, IC*OC]; params[9] = IC, [11] = OC (the rule holds them >= 1)
    ic, oc = max(1, n.op_params[9]), max(1, n.op_params[11])
    taps = (a.ne0 * a.ne1 * a.ne2 if a is not None else 1) * ic
    patches = elements(n) // oc
    return p["conv_factor"] * 2 * elements(n) * taps + p["conv_im2col"] * patches * taps


def _conv_transpose_2d(n: RpcTensor, s: Srcs, p: Prices) -> int:
    k, x = s[0], s[1]  # kernel [KW, KH, Cout, Cin], input [W, H, Cin, N]
    if k is None or x is None:
        return 0
    dots = x.ne0 * x.ne1 * x.ne3 * k.ne0 * k.ne1 * k.ne2
    return p["conv_t2d_factor"] * 2 * dots * k.ne3 + p["conv_t2d_dot"] * dots


# CONV_TRANSPOSE_1D/2D zero the WHOLE work buffer of the plan on every node (ops.cpp:6539, 6627,
# 7613: memset(params->wdata, 0, params->wsize)), and that buffer is the largest need of any node
# of the graph: a graph of many tiny transposed convolutions next to one node of a 1 GiB need
# (graph.MAX_WORK_BYTES, the default cap) clears 1 GiB per node, which their own sizes do not
# show. Each is charged that memset at BYTE_FLOPS per byte: 0.11 s at 40 GFLOP/s, 3x the 0.034 s
# a 1 GiB memset takes on this machine. (A policy raising max_work_bytes raises the real cost too.)
WORK_MEMSET_FLOPS: Final = BYTE_FLOPS * (1 << 30)


def _conv_transpose_2d_all(n: RpcTensor, s: Srcs, p: Prices) -> int:
    return _conv_transpose_2d(n, s, p) + p["work_memset"]


def _conv_transpose_1d_all(n: RpcTensor, s: Srcs, p: Prices) -> int:
    return _conv_transpose_1d(n, s, p) + p["work_memset"]


def _im2col(n: RpcTensor, s: Srcs, p: Prices) -> int:
    return p["im2col"] * elements(n)


def _col2im_1d(n: RpcTensor, s: Srcs, p: Prices) -> int:
    a = s[0]  # [K*OC, T_in]; params {s0, OC, p0} (the rule holds s0, OC >= 1); result [T_out, OC]
    if a is None:
        return 0
    s0, oc = max(1, n.op_params[0]), max(1, n.op_params[1])
    return p["col2im"] * elements(n) * min(a.ne1, a.ne0 // oc // s0 + 1)


# IM2COL_BACK (ops.cpp:6896) visits every tap of the kernel for every image element, with an int64
# division and remainder by the stride per tap (2D: two); POOL_2D_BACK (ops.cpp:8085) every tap of
# the window for every gradient element, as POOL_2D does for every result element, on one thread.
# Measured (compute_cost.py --only train --match _back, -t 1, server CPU time, 2026-12-02): IM2COL_BACK
# 7.1 ns per tap in 2D (128x128 cin=16 k=3: 2.4e6 taps in 16.7 ms), 3.4 ns in 1D; POOL_2D_BACK 1.44
# ns per tap with MAX (128x128x64 k=4 s=2: 4.1e6 taps in 5.9 ms), 0.64 with AVG. 512 and 96
# operations (12.8 and 2.4 ns at 40 GFLOP/s) keep 1.6x and 1.7x over the slowest.
IM2COL_BACK_TAP_FLOPS: Final = 512  # IM2COL_BACK: per image element per kernel tap
POOL_BACK_TAP_FLOPS: Final = 96  # POOL_2D_BACK: per gradient element per window tap


def _im2col_back(n: RpcTensor, s: Srcs, p: Prices) -> int:
    k = s[1]  # the convolution kernel [KW, KH, ...] (1D: [KW, IC, ...]); params[6] is_2D
    if k is None:
        return 0
    taps = k.ne0 * (k.ne1 if n.op_params[6] == 1 else 1)
    return p["im2col_back_tap"] * elements(n) * taps


def _pool_2d_back(n: RpcTensor, s: Srcs, p: Prices) -> int:
    g = s[0]  # the gradient of POOL_2D's result; params {op, k0, k1, ...} (the rule holds k >= 1)
    return 0 if g is None else p["pool_back_tap"] * elements(g) * max(1, n.param1) * max(1, n.param2)


_FLOPS = {**_FLOPS, "CONV_2D": _conv_2d_direct, "CONV_3D": _conv_3d_direct, "CONV_TRANSPOSE_2D": _conv_transpose_2d_all,
          "CONV_TRANSPOSE_1D": _conv_transpose_1d_all, "IM2COL": _im2col, "IM2COL_3D": _im2col,
          "COL2IM_1D": _col2im_1d, "IM2COL_BACK": _im2col_back, "POOL_2D_BACK": _pool_2d_back}


# -- type classes --------------------------------------------------------------------------------
#
# Weight types grouped by their CPU kernels (vec_dot per multiply-add, to_float and from_float per
# element): a class's price covers its members as measured (docs/performance.md "Compute prices
# per op"); a member much dearer than its class has its own entry in PRICES ("mm.q5_1").
TYPE_CLASSES: Final[Mapping[str, str]] = {
    "f32": "f32", "f16": "f16", "bf16": "f16",
    # 32-element blocks with a scale (llamafile_sgemm has most of them)
    "q4_0": "q", "q4_1": "q", "q5_0": "q", "q5_1": "q", "q8_0": "q", "q8_1": "q", "iq4_nl": "q", "mxfp4": "q",
    "nvfp4": "q", "q1_0": "q", "q2_0": "q",
    # 256-element super-blocks
    "q4_K": "k", "q5_K": "k", "q6_K": "k", "q8_K": "k", "iq4_xs": "k",
    "q2_K": "low", "q3_K": "low", "tq1_0": "low", "tq2_0": "low",
    # grid-lookup types
    "iq2_xxs": "iq", "iq2_xs": "iq", "iq2_s": "iq", "iq3_xxs": "iq", "iq3_s": "iq", "iq1_s": "iq", "iq1_m": "iq",
}  # fmt: skip
_CLASS_OF: Final = {tid: TYPE_CLASSES.get(t.name, "iq") for tid, t in TYPES.items()}


def _price(p: Prices, kind: str, type_: int) -> int:
    """The price of ``kind`` ("mm", "fa", "out_prod", "quant", "dequant") for a ggml type: the
    type's own entry where it is much dearer than its class ("mm.q5_1"), else its class's."""
    info = TYPES.get(type_)
    own = p.get(f"{kind}.{info.name}") if info is not None else None
    return own if own is not None else p[f"{kind}.{type_class(type_)}"]


def type_class(type_: int) -> str:
    """The price class of a ggml type id (an unknown id: the dearest class, "iq")."""
    return _CLASS_OF.get(type_, "iq")


def matmul_class(type_: int) -> str:
    """The class a matrix product with a src0 of ``type_`` is priced by."""
    return type_class(type_)


# -- the prices of ggml-cpu (flop-equivalents per unit, at node_gflops) ----------------------------
#
# Measured with bench/studies/compute_cost.py --only sweep (the real 7.0.0 server of llama-cpp-python
# 0.3.36, one thread, AVX2 without AVX-512, min-of-N server CPU time on the loaded 2-core VM,
# 2026-12-07): each price is the slowest measured shape of its unit times at least 1.3, rounded up
# (docs/performance.md "Compute prices per op" has the table and the worst/median per op).
# One unit costs price / node_gflops seconds: at 40 GFLOP/s a price of 40 is 1 ns.
PRICES: Final[Prices] = {
    "byte": BYTE_FLOPS, "element": ELEMENT_FLOPS, "convert": CONVERT_FLOPS,
    # MUL_MAT / MUL_MAT_ID per multiply-add (K per dst element): F32 to Q8_0 and the K-quants run
    # at 40-75 GFLOP/s on one thread, q5_1 and mxfp4 at 20-25, the grid types 10-30 (one token)
    "mm.f32": 2, "mm.f16": 2, "mm.q": 2, "mm.k": 2, "mm.low": 2, "mm.iq": 6,
    "mm.q4_1": 3, "mm.q5_0": 3, "mm.q5_1": 5, "mm.mxfp4": 5, "mm.nvfp4": 5, "mm.q1_0": 5, "mm.q2_0": 5,
    "mm.iq4_xs": 3,
    # src1 converted once per element to the vec_dot type: q8_0/f16 0.5 ns, q8_K 2.2 ns
    "convert_q8_K": 128,
    # per dst element: one vec_dot call whatever K (K = 1: 6.7 ns per element)
    "mm_call": 320,
    # OUT_PROD per multiply-add (src0.ne1 per dst element): a vec_mad per row, a block row
    # dequantized per row and inner index (q2_K 0.68 ns, iq2_xxs 0.52 per multiply-add)
    "out_prod.f32": 18, "out_prod.f16": 96, "out_prod.q": 80, "out_prod.q8_0": 24, "out_prod.k": 80,
    "out_prod.q4_K": 24, "out_prod.low": 72, "out_prod.iq": 72,
    # FLASH_ATTN_EXT per multiply-add of K's dot and V's accumulation (DK + DV per query and
    # key): a quantized V row goes through to_float per query and key (q4_0, iq4_nl: 0.36 ns)
    "fa.f32": 6, "fa.f16": 6, "fa.bf16": 12, "fa.q": 40, "fa.q8_0": 12, "fa.k": 40, "fa.q4_K": 16, "fa.low": 40,
    "fa.iq": 40,
    "fa_key": 320,  # per query and key: the online softmax's expf (D = 4: 5.9 ns per key)
    # conversions per element: from the class to F32 (to_float), from F32 into the class (from_float)
    "dequant.f16": CONVERT_FLOPS, "dequant.q": CONVERT_FLOPS, "dequant.k": 64, "dequant.low": 40,
    "dequant.iq": 48, "dequant.f32": 0,
    # from_float on varied values (SET_ROWS, the attacker's choice): the 256-block quantizers
    # search their scales, q4_K 100 ns per element, q2_K 80, q6_K 40, iq4_xs 300; iq4_nl 18-28;
    # F32 to F16 3.3 ns on values past F16's range
    "quant.f16": 176, "quant.q": 96, "quant.iq4_nl": 1440, "quant.mxfp4": 320, "quant.k": 5248,
    "quant.q6_K": 2112, "quant.iq4_xs": 16384, "quant.low": 4224, "quant.q3_K": 640, "quant.iq": 16384,
    "quant.f32": 0,
    # ARGSORT per element and level (32000x64 of varied values: 6.6 ns per element-level);
    # TOP_K's partial sort 0.2x of SORT_FLOPS' estimate; pooling and UPSCALE per tap (POOL_1D
    # avg k = 64: 1.4 ns per tap)
    "sort": 288, "top_k": SORT_FLOPS, "pool": 80, "conv_factor": CONV_FACTOR, "conv_dw": CONV_DW_FLOPS,
    "conv_t1d_factor": CONV_T1D_FACTOR, "conv_im2col": CONV_IM2COL_FLOPS, "conv_t2d_factor": CONV_T2D_FACTOR,
    "conv_t2d_dot": CONV_T2D_DOT_FLOPS, "im2col": IM2COL_FLOPS, "col2im": COL2IM_FLOPS,
    "im2col_back_tap": IM2COL_BACK_TAP_FLOPS, "pool_back_tap": POOL_BACK_TAP_FLOPS, "work_memset": WORK_MEMSET_FLOPS,
    # recurrent state ops: per state step (T*C*S), per state row (T*C); a 32 MiB state streamed
    # per token 0.39 ns per step (WKV7 0.51), a head of 17 8.3 ns per row
    "state_step": 20, "state_step7": 28, "state_row": 448,
    # SSM_SCAN per d_state step of a row: Mamba-2 vector 0.13 ns, its scalar tail 1.4 ns,
    # Mamba-1 (expf each) 5.9 ns
    "scan_step": 8, "scan_step_scalar": 80, "scan_step_exp": 320,
    "ssm_conv_tap": 48,  # a scalar (not reassociated) dot of d_conv per dst element: 0.93 ns per tap
    # GATED_DELTA_NET per S_v^2 step, per state row (three vector calls), per scalar-tail element
    "gdn": GDN_FLOPS, "gdn_row": 640, "gdn_scalar": 112,
    "solve_tri": 36, "tri": TRI_FLOPS, "lightning": 12,
    "dsv4_comb": DSV4_COMB_FLOPS, "dsv4_term": DSV4_TERM_FLOPS, "dsv4_gate": DSV4_GATE_FLOPS,
    "timestep": 704,  # per dst element: an expf, a cosf and a sinf per pair (17 ns per pair)
    # per element read or written: a libm call per element (sinf, logf, sqrtf of a negative, ...)
    # or a sequential dependency (CUMSUM), measured 2-7 ns per result element
    **{"op." + op: v for op, v in ELEMENT_FLOPS_OP.items()},
    "op.SOFT_MAX": 72, "op.GROUP_NORM": 40, "op.ROPE": 64, "op.SIN": 176, "op.COS": 192, "op.LOG": 160,
    "op.SQRT": 176, "op.CUMSUM": 96, "op.CROSS_ENTROPY_LOSS": 256, "op.CROSS_ENTROPY_LOSS_BACK": 256,
    "op.SILU_BACK": 96, "op.ARGMAX": 24, "op.OPT_STEP_ADAMW": 16,
    # a reduction per row (SUM, MEAN, SUM_ROWS: 1.7-1.9x at 8), PAD's index test per element (3x)
    "op.SUM": 24, "op.MEAN": 24, "op.SUM_ROWS": 24, "op.PAD": 64, "op.CONCAT": 24, "op.RMS_NORM_BACK": 16,
    "unary.exp": 176, "unary.expm1": 176, "unary.xielu": 176, "unary.tanh": 160, "unary.gelu_erf": 128,
    "unary.softplus": 160, "unary.sigmoid": 144, "unary.elu": 72, "unary.gelu_quick": 48, "unary.silu": 40,
    "unary.gelu": 24,
    "glu.geglu_erf": 96, "glu.swiglu_oai": 104, "glu.geglu_quick": 48, "glu.swiglu": 24, "glu.geglu": 24,
    "glu.swiglu_clamp": 40,
}  # fmt: skip
