"""What one graph node makes the server's CPU planner allocate: its work buffer.

How this works: ggml-cpu's ``ggml_graph_plan`` (ggml-cpu.c:2811 of the pinned sdist) walks every
node of a graph, empty or not, and sizes one work buffer as the largest per-node need; the
backend then allocates it with ``new uint8_t[]`` before computing anything. Several needs are
products of dimensions of different tensors (MUL_MAT_ID's ``n_as * ids.ne0 * ids.ne1`` row
map), or of a row length and the thread count, so a graph of a few MiB of tensors could ask for
hundreds of GiB and abort the server with ``std::bad_alloc``. ``work_bytes`` mirrors the
planner's arithmetic per op (``_WORK``, keyed by op name) with ``n_tasks`` = the server's thread
count; the graph validator refuses a node whose need exceeds the policy's cap. ``task_cap``,
``n_tasks`` and ``planned_bytes`` give the least buffer the planner allocates for a node on ``t``
threads, what workuse.py compares the kernels' per-thread use with. The element and row sizes
here are also the compute cost model's (protocol/cost.py). Sans-IO, pure integer arithmetic on
decoded tensors.
"""

from __future__ import annotations

from typing import Callable, Final, Mapping, Sequence

from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules import VEC_DOT
from rpcguard.protocol.tensor import RpcTensor

__all__ = [
    "work_bytes", "n_tasks", "task_cap", "ONE_TASK_OPS", "planned_bytes", "CACHE_LINE_MIN", "elements", "row_size",
    "quantized", "Srcs", "TILED_SLOT_BYTES", "F32", "F16", "I32", "BF16",
]

Srcs = Sequence["RpcTensor | None"]
F32, F16, I32, BF16 = 0, 1, 26, 30  # ggml type ids
# tiled/tiled.cpp:654 ggml_tiled_wdata_size: 64 bytes of alignment plus one 512 KiB slot per
# thread whenever the tiled matmul supports the operand types (counted always: an upper bound).
TILED_SLOT_BYTES: Final = 512 << 10
_CACHE_LINE: Final = 256  # ops.h: the largest CACHE_LINE_SIZE of any target (an upper bound)
_MMID_ROW: Final = 8  # ggml-cpu.c:1478 struct mmid_row_mapping { int32_t i1, i2; }

def elements(t: RpcTensor | None) -> int:
    """Elements of ``t`` (0 for an absent source)."""
    return 0 if t is None else t.ne0 * t.ne1 * t.ne2 * t.ne3


def row_size(type_: int, n: int) -> int:
    """Bytes of ``n`` elements of ``type_`` (0 for a type ggml does not know)."""
    info = TYPES.get(type_)
    return 0 if info is None else info.type_size * n // info.blck_size


def quantized(type_: int) -> bool:
    """A block type (more than one element per block)."""
    info = TYPES.get(type_)
    return info is not None and info.blck_size > 1


# -- the planner's work buffer (ggml-cpu.c:2852-3042, one function per case) -----------------


def _work_cpy(n: RpcTensor, s: Srcs, nt: int) -> int:
    a, b = s[0], s[1]
    pair = (a.type if a else -1, b.type if b else -1)
    if quantized(n.type) or pair in ((F16, BF16), (BF16, F16), (F32, I32), (I32, F32)):
        return 4 * n.ne0 * nt
    return 0


def _work_add(n: RpcTensor, s: Srcs, nt: int) -> int:
    a = s[0]
    return 4 * a.ne0 * nt if a is not None and quantized(a.type) else 0


def _work_acc(n: RpcTensor, s: Srcs, nt: int) -> int:
    a, b = s[0], s[1]
    return 4 * b.ne0 * nt if a is not None and b is not None and quantized(a.type) else 0


def _vec_dot_type(t: int) -> int:
    return VEC_DOT.get(t, t)  # (a type without one is refused by the op's rule)


def _work_mul_mat(n: RpcTensor, s: Srcs, nt: int) -> int:
    a, b = s[0], s[1]
    if a is None or b is None:
        return 0
    vdt = _vec_dot_type(a.type)
    cur = row_size(vdt, elements(b)) if b.type != vdt else 0
    return (cur + 63) // 64 * 64 + 64 + nt * TILED_SLOT_BYTES


def _work_mul_mat_id(n: RpcTensor, s: Srcs, nt: int) -> int:
    a, b, ids = s[0], s[1], s[2]
    if a is None or b is None or ids is None:
        return 0
    vdt = _vec_dot_type(a.type)
    n_as = a.ne2
    cur = row_size(vdt, elements(b)) + 8 if b.type != vdt else 0
    cur += n_as * 8 + 8  # matrix_row_counts
    cur += n_as * ids.ne0 * ids.ne1 * _MMID_ROW + 8  # matrix_rows
    cur += _CACHE_LINE * n_as + _CACHE_LINE  # atomic_current_chunk
    return (cur + 63) // 64 * 64 + 64 + nt * TILED_SLOT_BYTES


def _work_set_rows(n: RpcTensor, s: Srcs, nt: int) -> int:
    a = s[0]
    return 4 * a.ne0 * nt if a is not None and a.type == F16 and n.type != F16 else 0


def _work_row(n: RpcTensor, s: Srcs, nt: int) -> int:
    return 4 * n.ne0 * nt  # SOFT_MAX, ROPE: one F32 row per thread


def _work_top_k(n: RpcTensor, s: Srcs, nt: int) -> int:
    a = s[0]
    return 4 * a.ne0 * nt if a is not None else 0


def _work_flash_attn(n: RpcTensor, s: Srcs, nt: int) -> int:
    q, k, v = s[0], s[1], s[2]
    if q is None or k is None or v is None:
        return 0
    dk, dv, heads = k.ne0, v.ne0, q.ne2
    tq, tkv = 64, 64  # common.h GGML_FA_TILE_Q / GGML_FA_TILE_KV upper bounds
    prefill = 4 * (tq * dk + 2 * tq * tkv + tq * dv + tkv * dv + tkv * dk) * nt
    decode = 4 * (heads * nt * (2 + dv) + nt * (dk + 2 * dv))
    return max(prefill, decode)


def _work_conv_transpose_1d(n: RpcTensor, s: Srcs, nt: int) -> int:
    k, x = s[0], s[1]  # ggml_graph_plan: the kernel and the input, both in the kernel's type
    if k is None or x is None:
        return 0
    es = 2 if k.type == F16 else 4
    return es * (k.ne0 * k.ne1 * k.ne2 + x.ne0 * x.ne1)


# -- recurrent and newer-model ops (work buffer) --


def _work_gated_delta_net(n: RpcTensor, s: Srcs, nt: int) -> int:
    """ggml-cpu.c:3025: ``(S_v + (K > 1 ? S_v*S_v : 0))`` floats per task, S_v = v.ne0, K = op_params[0]
    (the kernel's delta row and, for K > 1, its S_v x S_v state scratch)."""
    v = s[2]
    if v is None:
        return 0
    S_v = v.ne0
    return 4 * (S_v + (S_v * S_v if n.param0 > 1 else 0)) * nt


def _work_lightning_indexer(n: RpcTensor, s: Srcs, nt: int) -> int:
    """ggml-cpu.c:3036: one F32 row of k.ne0 per task (K dequantized), whatever K's type."""
    k = s[1]
    return 4 * k.ne0 * nt if k is not None else 0
# -- training and backward ops (ggml-cpu.c ggml_graph_plan of both 7.0.0 trees) --


def _work_out_prod(n: RpcTensor, s: Srcs, nt: int) -> int:
    a = s[0]  # ggml-cpu.c:2915: one F32 row of src0 per thread to dequantize into (F16, block types)
    return 4 * a.ne0 * nt if a is not None and (a.type == F16 or quantized(a.type)) else 0


def _type_size(type_: int) -> int:
    info = TYPES.get(type_)
    return 0 if info is None else info.type_size


def _work_count_equal(n: RpcTensor, s: Srcs, nt: int) -> int:
    return _type_size(n.type) * nt  # ggml-cpu.c:2879: one partial count per thread (ggml_type_size)


def _work_cross_entropy_loss(n: RpcTensor, s: Srcs, nt: int) -> int:
    a = s[0]  # ggml-cpu.c:3021: per thread a partial sum and a row of src0 (ggml_type_size)
    return _type_size(n.type) * (nt + a.ne0 * nt) if a is not None else 0


# ggml-cpu/ops.h:23 GGML_IM2COL_WORK_SIZE
IM2COL_WORK_SIZE: Final = 16 * 1024 * 1024


def _work_im2col(n: RpcTensor, s: Srcs, nt: int) -> int:
    return IM2COL_WORK_SIZE  # ggml-cpu.c:2959-2963: every CONV_2D / CONV_3D node, whatever its shape


def _work_conv_transpose_2d(n: RpcTensor, s: Srcs, nt: int) -> int:
    k, x = s[0], s[1]  # ggml-cpu.c:2964-2981: the kernel and the input, both in the kernel's type
    if k is None or x is None:
        return 0
    es = 2 if k.type == F16 else 4
    return es * (elements(k) + elements(x))


_WORK: Mapping[str, Callable[[RpcTensor, Srcs, int], int]] = {
    "CPY": _work_cpy, "DUP": _work_cpy,
    "ADD": _work_add, "ADD_ID": _work_add, "ADD1": _work_add,
    "ACC": _work_acc,
    "MUL_MAT": _work_mul_mat, "MUL_MAT_ID": _work_mul_mat_id,
    "SET_ROWS": _work_set_rows,
    "SOFT_MAX": _work_row, "ROPE": _work_row, "ROPE_BACK": _work_row,
    "TOP_K": _work_top_k,
    "FLASH_ATTN_EXT": _work_flash_attn,
    "CONV_TRANSPOSE_1D": _work_conv_transpose_1d,
    # -- recurrent and newer-model ops --
    "GATED_DELTA_NET": _work_gated_delta_net, "LIGHTNING_INDEXER": _work_lightning_indexer,
    # -- training and backward ops
    "OUT_PROD": _work_out_prod, "COUNT_EQUAL": _work_count_equal, "CROSS_ENTROPY_LOSS": _work_cross_entropy_loss,
    # -- image ops
    "CONV_2D": _work_im2col, "CONV_3D": _work_im2col, "CONV_TRANSPOSE_2D": _work_conv_transpose_2d,
}  # fmt: skip


def work_bytes(op: str, node: RpcTensor, srcs: Srcs, n_threads: int) -> int:
    """The work buffer ``ggml_graph_plan`` sizes for this node on a server of ``n_threads``
    (0 for ops the planner gives none; the planner also counts empty nodes)."""
    fn = _WORK.get(op)
    return fn(node, srcs, n_threads) if fn is not None else 0


# -- what the planner reserves for the kernel (workuse.py compares the kernels' use with it) --

# ops.h:13-17: CACHE_LINE_SIZE is 64, 128 or 256 bytes by target. The planner adds one per thread
# (ggml-cpu.c:3051) and the kernels leave one between threads' rows (CACHE_LINE_SIZE_F32, ops.h:20):
# the same constant on both sides, so the smallest is the tightest case for every layout.
CACHE_LINE_MIN: Final = 64


# ggml_get_n_tasks (ggml-cpu.c:2249-2505, the same in 0.3.35 but for SWIGLU_CLAMP) gives these ops
# one task whatever the node; every other op plans up to n_threads (SOFT_MAX, RWKV_WKV6/7,
# GATED_LINEAR_ATTN and the custom ops fewer, counted here as n_threads: an upper bound). A graph
# runs all its nodes on min(its largest task count, n_threads) threads (ggml-cpu.c:3055 cplan.n_threads),
# so a graph of these ops alone runs on one thread.
ONE_TASK_OPS: Final = frozenset({
    "NONE", "SUB", "SQR", "SQRT", "LOG", "SIN", "COS", "SUM", "SUM_ROWS", "MEAN", "ARGMAX", "REPEAT",
    "REPEAT_BACK", "LEAKY_RELU", "GET_ROWS", "SET_ROWS", "SCALE", "SET", "RESHAPE", "VIEW", "PERMUTE",
    "TRANSPOSE", "GET_ROWS_BACK", "DIAG", "CLAMP", "POOL_1D", "POOL_2D", "POOL_2D_BACK", "WIN_PART",
    "WIN_UNPART", "GET_REL_POS",
})


def task_cap(op: str, node: RpcTensor, srcs: Srcs) -> int | None:
    """``ggml_get_n_tasks`` (ggml-cpu.c:2249) for the ops with a work buffer is ``min(n_threads,
    cap)``: every such op plans ``n_threads`` tasks (cap None) except SET_ROWS (one, :2367) and
    SOFT_MAX (one per source row at most, :2398). The kernel still runs on all the graph's
    threads (``params->nth``, up to ``n_threads``)."""
    if op == "SET_ROWS":
        return 1
    if op == "SOFT_MAX":
        a = srcs[0]
        return max(1, a.ne1 * a.ne2 * a.ne3) if a is not None else 1
    return None


def n_tasks(op: str, node: RpcTensor, srcs: Srcs, n_threads: int) -> int:
    """The thread count the planner multiplies this node's per-thread scratch by."""
    cap = task_cap(op, node, srcs)
    return n_threads if cap is None else min(n_threads, cap)


def planned_bytes(op: str, node: RpcTensor, srcs: Srcs, n_threads: int) -> int:
    """The least work buffer ``ggml_graph_plan`` allocates for a graph with this (non-empty) node
    on a server of ``n_threads``: the node's need at its ``n_tasks`` plus the cache line per
    thread the planner adds to a non-zero size (ggml-cpu.c:3050-3052). The buffer is the largest
    node's need, so another node can only make it larger."""
    cur = work_bytes(op, node, srcs, n_tasks(op, node, srcs, n_threads))
    return cur + CACHE_LINE_MIN * n_threads if cur else 0
