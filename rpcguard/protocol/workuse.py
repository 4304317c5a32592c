"""What the CPU kernels touch of the work buffer, per thread, against what the planner reserved.

How this works: ``ggml_graph_plan`` sizes the work buffer from ``ggml_get_n_tasks`` (workbuf.py:
``planned_bytes``), but every node runs on all the graph's threads (``params->nth``, up to the
server's ``-t``), and each kernel addresses its own per-thread scratch from ``params->wdata``. The
two sides were written apart in ggml and disagree for some shapes: a quantizing CPY whose source
rows are longer than its destination's (the planner counts the destination row, ggml-cpu.c:2862;
the kernel writes the source row, ops.cpp:297) and SET_ROWS from F16 (one task planned,
ggml-cpu.c:2367; every thread writes its row, ops.cpp:5501): heap writes past the buffer.
``USES`` is the kernel side, per op, from the pinned sources (0.3.36 vendor/llama.cpp and b11434;
the same lines in 0.3.35): one or more ``Use`` terms whose largest gives the end of the highest
byte any of ``nth`` threads touches, for the smallest cache line (workbuf.CACHE_LINE_MIN).
``check_work_use`` refuses a node when, for some server thread count ``t`` in
1..``server_threads``, that use on ``t`` threads exceeds the planner's reservation for ``t``. Every
use grows with ``nth`` and ``nth <= t``, so ``nth = t`` is each ``t``'s worst case; a graph whose
nodes are all one-task ops (workbuf.ONE_TASK_OPS, e.g. a lone SET_ROWS and its views) runs on one
thread (``graph_threads``: ggml-cpu.c:3055), whatever the server's ``-t``. The terms are
computed once per node and the planner's need is affine in its task count (workbuf), so the
check over all thread counts is integer arithmetic at a few break points (``_thread_counts``),
and its verdict per shape is remembered. Ops whose kernel sizes itself from ``params->wsize``
(CONV_2D, CONV_3D: ops.cpp:7351) or asserts its layout against it (MUL_MAT_ID: ggml-cpu.c:1607)
cannot write past it and have no entry; ACC and ADD_ID reserve scratch for block types their
kernels abort on (ops.cpp:1236, 755). Sans-IO; docs/firewall.md "What the kernels write into it".
"""

from __future__ import annotations

from typing import Callable, Final, Mapping, NamedTuple

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.oprules import VEC_DOT
from rpcguard.protocol.tensor import RpcTensor
from rpcguard.protocol.workbuf import (
    BF16, CACHE_LINE_MIN, F16, F32, TILED_SLOT_BYTES, Srcs, elements, quantized, row_size, task_cap, work_bytes,
)

__all__ = ["Use", "kernel_bytes", "overflow", "check_work_use", "USES"]

_L: Final = CACHE_LINE_MIN
_TO_Q_SOURCES: Final = frozenset({F32, F16, BF16})  # dup_to_q's sources (ops.cpp:543-558)
ALL, BLOCKED, STRIDED = 0, 1, 2  # how a kernel hands rows to threads (Use.split)


class Use(NamedTuple):
    """``fixed + per_thread*nth`` bytes, plus ``row`` bytes for each of ``w`` writing threads at
    ``wdata + (row + CACHE_LINE_SIZE)*ith`` (the common per-thread layout, ops.cpp:297 and the
    like): ``w = nth`` (ALL), the threads that get a block of ceil(nr/nth) of ``nr`` rows
    (BLOCKED: ``ir0 = dr*ith``, the others skip their loop), or min(nth, nr) (STRIDED: rows
    ith, ith+nth ...)."""

    fixed: int = 0
    per_thread: int = 0
    row: int = 0
    split: int = ALL
    nr: int = 0

    def at(self, nth: int) -> int:
        if self.split == ALL:
            w = nth
        elif self.split == STRIDED:
            w = min(nth, self.nr)
        elif self.nr <= 0:
            w = 0
        else:
            dr = -(-self.nr // nth)
            w = -(-self.nr // dr)
        rows = self.row * w + _L * (w - 1) if self.row and w > 0 else 0
        return self.fixed + self.per_thread * nth + rows


_NONE: Final[tuple[Use, ...]] = ()


# -- per op: (node, srcs) -> the kernel's Use terms (none: no scratch for this node) -----------


def _use_dup(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:270 dup_to_q (CPY, DUP, CONT from F32/F16/BF16 into a block type, ops.cpp:543-558):
    each thread converts a whole *source* row (ne00 floats) into ``wdata + (ne00 + CL)*ith``
    (ops.cpp:297-304); rows of dim 1 are split in blocks over the threads (ops.cpp:284-289). The
    planner sizes the row from the *destination* (ggml-cpu.c:2862)."""
    a = s[0]
    if a is None or a.type == n.type or a.type not in _TO_Q_SOURCES or not quantized(n.type):
        return _NONE
    return (Use(row=4 * a.ne0, split=BLOCKED, nr=a.ne1),)


def _use_add_q(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:578 add_q_f32: one dequantized src0 row per thread (ops.cpp:618), rows of src0 in
    blocks (:612-616)."""
    a = s[0]
    if a is None or not quantized(a.type):
        return _NONE
    return (Use(row=4 * a.ne0, split=BLOCKED, nr=a.ne1 * a.ne2 * a.ne3),)


def _use_add1_q(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:921 add1_q_f32: one row of the *result's* ne0 per thread (ops.cpp:964)."""
    a = s[0]
    if a is None or not quantized(a.type):
        return _NONE
    return (Use(row=4 * n.ne0, split=BLOCKED, nr=a.ne1 * a.ne2 * a.ne3),)


def _use_out_prod(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:4736 (block types) and :4803 (F16): one row of the result's ne0 per thread."""
    a = s[0]
    if a is None or not (quantized(a.type) or a.type == F16):
        return _NONE
    return (Use(row=4 * n.ne0),)


def _use_set_rows(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:5501: F16 rows into a type other than F16 go through one F32 row (nc = ne00 of the
    source) per thread; source rows of dim 1 are split in blocks over all the threads
    (:5469-5473), while the planner counts one task (ggml-cpu.c:2367)."""
    b = s[0]
    if b is None or b.type != F16 or n.type == F16:
        return _NONE
    return (Use(row=4 * b.ne0, split=BLOCKED, nr=b.ne1),)


def _use_soft_max(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:5850: one row of src0's ne00 per thread; thread ith takes rows ith, ith+nth ... of
    dim 1 (:5859)."""
    a = s[0]
    return _NONE if a is None else (Use(row=4 * a.ne0, split=STRIDED, nr=a.ne1),)


def _use_rope(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:6412: the sin/cos cache, one row of the result's ne0 per thread."""
    return (Use(row=4 * n.ne0),)


def _use_top_k(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:8803: one int32 row of src0's ne00 per thread."""
    a = s[0]
    return _NONE if a is None else (Use(row=4 * a.ne0),)


def _use_flash_attn(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:8939 (one chunk: DK + 2*DV floats and a cache line a thread), :9497 (split KV:
    after those, q.ne2 x nth partials of 2 + DV floats) and :9190 (tiled: five tiles a thread,
    common.h:9-10 64 x 64)."""
    q, k, v = s[0], s[1], s[2]
    if q is None or k is None or v is None:
        return _NONE
    dk, dv, tq, tkv = k.ne0, v.ne0, 64, 64
    chunk = Use(per_thread=4 * (dk + 2 * dv) + _L + 4 * q.ne2 * (2 + dv))
    return chunk, Use(row=4 * (tq * dk + 2 * tq * tkv + tq * dv + tkv * dv + tkv * dk))


def _use_conv_transpose_1d(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:6543-6559: the permuted kernel (nk elements) then the permuted input (L x Cin), in
    the kernel's element size; the memset of :6539 covers params->wsize, the buffer itself."""
    k, x = s[0], s[1]
    if k is None or x is None:
        return _NONE
    return (Use(fixed=(2 if k.type in (F16, BF16) else 4) * (k.ne0 * k.ne1 * k.ne2 + x.ne0 * x.ne1)),)


def _use_conv_transpose_2d(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:7617-7640: the permuted kernel, then every batch of the input (``i13*ne10*ne11*ne12``)."""
    k, x = s[0], s[1]
    if k is None or x is None:
        return _NONE
    return (Use(fixed=(2 if k.type == F16 else 4) * (elements(k) + elements(x))),)


def _use_count_equal(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:1638: one int64 partial count per thread."""
    return (Use(per_thread=8),)


def _use_cross_entropy_loss(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:11947-11951: nth partial sums, then one row of src0's nc per thread."""
    a = s[0]
    return _NONE if a is None else (Use(per_thread=4 * (1 + a.ne0)),)


def _use_gated_delta_net(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:11170-11173: ``per_thread`` floats at ``ith*per_thread + CL`` (the delta row, and
    for K > 1 the S_v x S_v state scratch)."""
    v = s[2]
    if v is None:
        return _NONE
    return (Use(fixed=_L, per_thread=4 * (v.ne0 + (v.ne0 * v.ne0 if n.param0 > 1 else 0))),)


def _use_lightning_indexer(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ops.cpp:12400: one F32 row of *q's* ne0 (n_embd, :12386) per thread."""
    q = s[0]
    return _NONE if q is None else (Use(row=4 * q.ne0),)


def _use_mul_mat(n: RpcTensor, s: Srcs) -> tuple[Use, ...]:
    """ggml-cpu.c:1329-1348: src1 converted to the vec_dot type, ``ne13*nbw3`` bytes; then
    tiled.cpp:1118-1123: one slot per thread after it, 64-aligned. The tiled term is counted
    whatever the operands, as workbuf does for the planner: the same predicate gates both sides."""
    a, b = s[0], s[1]
    if a is None or b is None:
        return _NONE
    vdt = VEC_DOT.get(a.type, a.type)  # the planner's table (a type without one: MUL_MAT's rule refuses)
    conv = row_size(vdt, b.ne0) * b.ne1 * b.ne2 * b.ne3 if b.type != vdt else 0
    return (Use(fixed=(conv + 63) // 64 * 64 + 64, per_thread=TILED_SLOT_BYTES),)


USES: Mapping[str, Callable[[RpcTensor, Srcs], tuple[Use, ...]]] = {
    "CPY": _use_dup, "DUP": _use_dup, "CONT": _use_dup,
    "ADD": _use_add_q, "ADD1": _use_add1_q,
    "OUT_PROD": _use_out_prod,
    "SET_ROWS": _use_set_rows,
    "SOFT_MAX": _use_soft_max, "ROPE": _use_rope, "ROPE_BACK": _use_rope,
    "TOP_K": _use_top_k,
    "FLASH_ATTN_EXT": _use_flash_attn,
    "CONV_TRANSPOSE_1D": _use_conv_transpose_1d, "CONV_TRANSPOSE_2D": _use_conv_transpose_2d,
    "COUNT_EQUAL": _use_count_equal, "CROSS_ENTROPY_LOSS": _use_cross_entropy_loss,
    "GATED_DELTA_NET": _use_gated_delta_net, "LIGHTNING_INDEXER": _use_lightning_indexer,
    "MUL_MAT": _use_mul_mat,
}  # fmt: skip


def kernel_bytes(op: str, node: RpcTensor, srcs: Srcs, nth: int) -> int:
    """The end of the work buffer bytes ``op``'s kernel touches on ``nth`` threads (0: none)."""
    fn = USES.get(op)
    return max((u.at(nth) for u in fn(node, srcs)), default=0) if fn is not None else 0


def overflow(op: str, node: RpcTensor, srcs: Srcs, server_threads: int,
             graph_threads: int | None = None) -> tuple[int, int, int] | None:
    """The first server thread count ``t`` in 1..``server_threads`` at which the kernel on
    ``min(t, graph_threads)`` threads (the graph's nodes' largest task count bounds the threads
    every node runs on: 1 for a graph of workbuf.ONE_TASK_OPS alone, else None, no bound)
    touches more than the planner reserved (workbuf.planned_bytes), as (t, used, reserved); None
    when there is none."""
    fn = USES.get(op)
    terms = fn(node, srcs) if fn is not None else _NONE
    if not terms:
        return None
    # the planner's need is affine in its task count (every case of ggml-cpu.c:2852-3042)
    base = work_bytes(op, node, srcs, 0)
    slope = work_bytes(op, node, srcs, 1) - base
    cap = task_cap(op, node, srcs)
    g = server_threads if graph_threads is None else graph_threads
    for t in _thread_counts(terms, cap, g, server_threads):
        nth = t if t < g else g
        used = max(u.at(nth) for u in terms)
        if not used:
            continue
        cur = base + slope * (t if cap is None or cap > t else cap)
        reserved = cur + _L * t if cur else 0
        if used > reserved:
            return t, used, reserved
    return None


def _thread_counts(terms: tuple[Use, ...], cap: int | None, graph_threads: int,
                   server_threads: int) -> list[int] | range:
    """The thread counts that decide ``overflow``: between the break points below, every term's
    use is affine in ``t`` (ALL: ``w = nth``; STRIDED: ``w = min(nth, nr)``; ``nth = min(t,
    graph_threads)``) and so is the planner's reservation (``min(t, cap)`` tasks), so use minus
    reservation is a maximum of affine functions, convex, largest at an end of each piece. A
    BLOCKED term's writer count is a step function of ``nth``: every ``t`` is checked."""
    if any(u.split == BLOCKED for u in terms):
        return range(1, server_threads + 1)
    points = {1, server_threads, graph_threads, graph_threads + 1}
    for u in terms:
        if u.split == STRIDED:
            points |= {u.nr, u.nr + 1}
    if cap is not None:
        points |= {cap, cap + 1}
    return sorted(t for t in points if 1 <= t <= server_threads)


_VERDICTS: dict[tuple[object, ...], tuple[int, int, int] | None] = {}
_VERDICTS_MAX: Final = 4096  # distinct node shapes remembered (a model's layers repeat a few dozen)


def check_work_use(op: str, node: RpcTensor, srcs: Srcs, server_threads: int,
                   graph_threads: int | None = None) -> None:
    """Refuse a computed node whose kernel writes past the planner's work buffer on a server of
    up to ``server_threads`` threads (``work_buffer_overflow``); ``graph_threads`` as for
    ``overflow``."""
    fn = USES.get(op)
    if fn is None:
        return
    # the verdict depends on types, shapes and param0 only: layers repeat them (bounded memo)
    key = (op, server_threads, graph_threads, node.type, node.ne, node.param0,
           *((t.type, t.ne) if t is not None else None for t in srcs[:4]))
    if key in _VERDICTS:
        hit = _VERDICTS[key]
    else:
        hit = overflow(op, node, srcs, server_threads, graph_threads)
        if len(_VERDICTS) >= _VERDICTS_MAX:
            _VERDICTS.clear()
        _VERDICTS[key] = hit
    if hit is not None:
        t, used, reserved = hit
        raise FirewallRefusal(
            "work_buffer_overflow",
            f"node id={node.id:#x} op {op}: on {t} server thread(s) the kernel touches {used} bytes of work "
            f"buffer, the CPU planner reserves {reserved} (ggml_graph_plan and the kernel disagree)",
        )
