"""Rows of the ops that copy, convert, view or rearrange tensors: DUP/CPY/CONT, the views, rows in
and out (GET_ROWS, SET_ROWS), CONCAT, REPEAT, PAD, ROLL, ACC/SET.

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

from typing import Sequence

from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules.base import (
    BF16, F16, F32, F32_F16, FLOAT, I16, I32, I64, I8, MAX_DIMS, New, ONLY_F32, OpRule, QUANTIZED, Result, Srcs,
    View, check_types, contiguous_nb, dup_or_inplace, is_contiguous, need, nelements, refuse, rows_contiguous,
)
from rpcguard.protocol.oprules.matmul import VEC_DOT
from rpcguard.protocol.tensor import RpcTensor


def _get_rows(n: RpcTensor, s: Srcs) -> Result:
    """ggml_get_rows ggml.c:3963; row indices are data, asserted by the kernel."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    need(a.ne2 == b.ne1 and a.ne3 == b.ne2 and b.ne3 == 1 and b.type == I32, n, "GET_ROWS",
          f"src shapes {a.ne} / {b.ne}")
    need(rows_contiguous(a), n, "GET_ROWS", "src0 rows not contiguous")
    # ops.cpp ggml_compute_forward_get_rows dispatches these (dequantised rows) and aborts on others
    check_types(n, "GET_ROWS", frozenset(VEC_DOT) | {I32}, a)  # not q8_1: no CPU to_float (SIGSEGV)
    return New(I32 if a.type == I32 else F32, (a.ne0, b.ne0, b.ne1, b.ne2))


def _set_rows(n: RpcTensor, s: Srcs) -> Result:
    """ggml_set_rows ggml.c:4009: result = view of a, srcs {b, c, a}."""
    b, c, a = s[0], s[1], s[2]
    assert b is not None and c is not None and a is not None
    ok = (a.ne0 == b.ne0 and a.ne2 == b.ne2 and a.ne3 == b.ne3 and b.ne1 == c.ne0 and c.ne1 and c.ne2
          and b.ne2 % c.ne1 == 0 and b.ne3 % c.ne2 == 0 and c.ne3 == 1 and b.type in F32_F16
          and c.type in (I64, I32) and rows_contiguous(a) and rows_contiguous(b))
    need(bool(ok), n, "SET_ROWS", f"shapes a {a.ne} b {b.ne} c {c.ne}")
    # set_rows (ops.cpp:5477) converts with type_traits_cpu[dst].from_float: NULL for the types
    # ggml-cpu.c:215ff does not list (I8, I16, I64, F64) and the iq types without a quantizer
    need(a.type in _FROM_FLOAT, n, "SET_ROWS", "destination type has no from_float")
    return View(2, a.ne, a.nb, 0)


# ggml-cpu.cpp:434-442: CPY/SET_ROWS into these types abort (no from_float).
_NO_FROM_FLOAT = frozenset({16, 17, 18, 19, 21, 22, 29})  # iq2_xxs iq2_xs iq3_xxs iq1_s iq3_s iq2_s iq1_m
# types with a CPU from_float (ggml-cpu.c type_traits_cpu): the float types, I32 and the block types
_FROM_FLOAT = (frozenset({F32, F16, BF16, I32}) | QUANTIZED) - _NO_FROM_FLOAT


def _set_rows_f32(n: RpcTensor, s: Srcs) -> Result:
    """ggml_set_rows before 4.0.0 (0.3.20 ggml.c): the source rows are F32 only."""
    b = s[0]
    assert b is not None
    check_types(n, "SET_ROWS", ONLY_F32, b)
    return _set_rows(n, s)


def _cpy(n: RpcTensor, s: Srcs) -> Result:
    """ggml_cpy ggml.c:3612: nelements equal, result = view of b; or ggml_cast ggml.c:3625: a
    fresh tensor of a's shape whose src[1] is itself. ggml_compute_forward_dup handles same-type
    copies and conversions from F32/F16/BF16 (and I32<->F32)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    if b.id == n.id:
        _check_dup_types(n, "CPY", a.type, n.type)
        need(n.type in TYPES and a.ne0 % TYPES[n.type].blck_size == 0, n, "CPY", "cast to a block type")
        if n.type in QUANTIZED and a.type != n.type:
            need(a.nb0 == TYPES[a.type].type_size, n, "CPY", "quantizing cast of a strided source")
        return New(n.type, a.ne)
    need(nelements(a) == nelements(b), n, "CPY", f"{a.ne} and {b.ne} differ in element count")
    _check_dup_types(n, "CPY", a.type, b.type)
    if b.type in QUANTIZED and a.type != b.type:  # ops.cpp:292-293, else "not implemented" (:321)
        # dup_to_q quantizes each source row on its own: whole blocks per row (ggml-quants.c asserts
        # k % block size, e.g. :5072 for IQ4_NL)
        need(is_contiguous(b) and a.nb0 == TYPES[a.type].type_size and a.ne0 % TYPES[b.type].blck_size == 0, n,
              "CPY", "quantizing copy layout")
    if a.type == b.type:
        need(_dup_bytes_ok(a, b.ne, b.nb), n, "CPY", "block-type copy into a contiguous tensor of another layout")
    if a.type in _DEQUANTIZE and b.type == F32:
        # ggml_compute_forward_dup_from_q (ops.cpp:475): one block of qk values per step, read at
        # (i00/qk)*nb00 + i01*nb01 ... of a, written at i10*nb10 + ... of b: a's rows hold whole
        # blocks, b has unit nb0 and either whole blocks per row or is contiguous (its asserts)
        qk = TYPES[a.type].blck_size
        need(a.ne0 % qk == 0 and b.nb0 == 4 and (b.ne0 % qk == 0 or is_contiguous(b)), n, "CPY",
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
    return dup_or_inplace(a)


def _cont(n: RpcTensor, s: Srcs) -> Result:
    """ggml_cont_4d ggml.c:3648ff: same element count, a fresh tensor of a's type."""
    a = s[0]
    assert a is not None
    need(nelements(a) == nelements(n), n, "CONT", f"{n.ne} has another element count than {a.ne}")
    need(TYPES[a.type].blck_size == 1 or n.ne0 % TYPES[a.type].blck_size == 0, n, "CONT", "blocks")
    need(_dup_bytes_ok(a, n.ne, contiguous_nb(a.type, n.ne)), n, "CONT",
          "block-type source neither contiguous nor of the result's shape (dup_bytes' row size)")
    return New(a.type, n.ne)


def _reshape(n: RpcTensor, s: Srcs) -> Result:
    """ggml_reshape_4d ggml.c:3770: a contiguous, same element count, view with fresh strides."""
    a = s[0]
    assert a is not None
    need(is_contiguous(a), n, "RESHAPE", "src not contiguous")
    need(nelements(a) == nelements(n), n, "RESHAPE", f"{n.ne} has another element count than {a.ne}")
    need(n.ne0 % TYPES[a.type].blck_size == 0, n, "RESHAPE", "ne0 not a block multiple")
    return View(0, n.ne, contiguous_nb(a.type, n.ne), 0)


def _view(n: RpcTensor, s: Srcs) -> Result:
    """ggml_view_impl ggml.c:3800ff: op_params[0..1] = offset (size_t); nb1..nb3 are the
    caller's (view_2d/3d/4d), nb0 the type size; ggml_new_tensor_impl asserts that the packed
    size of the view plus the offset fits in nbytes(a)."""
    a = s[0]
    assert a is not None
    offs = (n.param0 & 0xFFFFFFFF) | ((n.param1 & 0xFFFFFFFF) << 32)
    info = TYPES[a.type]
    need(n.ne0 % info.blck_size == 0, n, "VIEW", "ne0 not a block multiple")
    packed = n.ne0 // info.blck_size * info.type_size * n.ne1 * n.ne2 * n.ne3
    need(packed == 0 or packed + offs <= _nbytes(a), n, "VIEW", f"offset {offs} + {packed} bytes past the source")
    need(n.nb0 == info.type_size, n, "VIEW", "nb0 is not the type size")
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


# the concat kernels that copy element by element (ops.cpp concat_f32/_f16/_i8), any strides
_CONCAT_ELEMENTWISE = frozenset({F32, F16, BF16, I32, I16, I8})


def _concat(n: RpcTensor, s: Srcs) -> Result:
    """ggml_concat ggml.c:2631."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    dim = n.param0
    if not 0 <= dim < MAX_DIMS:
        raise refuse(n, "CONCAT", f"dim {dim}", "graph_op_params_invalid")
    need(a.type == b.type and all(a.ne[d] == b.ne[d] for d in range(4) if d != dim), n, "CONCAT", "shapes")
    # an empty source is copied from too when only its ne0 is 0: memcpy(dst, src->data, 0) per row
    # (ops.cpp:1934), undefined for a NULL data (UBSan aborts); a real one is a view into a buffer
    need(all(t.data or nelements(t) for t in (a, b)), n, "CONCAT", "an empty source without data")
    if a.type not in _CONCAT_ELEMENTWISE:
        # ops.cpp ggml_compute_forward_concat_any: other types (I64, block types) are copied a row
        # of bytes at a time; it asserts contiguous rows of both sources (blocks whole per row:
        # the tensor rule's ne0 % block size)
        need(rows_contiguous(a) and rows_contiguous(b), n, "CONCAT", "rows not contiguous")
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    return New(a.type, tuple(ne))  # type: ignore[arg-type]


def _repeat(n: RpcTensor, s: Srcs) -> Result:
    """ggml_repeat ggml.c:2579: the node's shape is b's, a must repeat into it."""
    a = s[0]
    assert a is not None
    need(all(x % y == 0 for x, y in zip(n.ne, a.ne)), n, "REPEAT", f"{a.ne} does not repeat into {n.ne}")
    check_types(n, "REPEAT", frozenset({F32, F16, BF16, I16, I32}), a)
    need(a.nb0 == TYPES[a.type].type_size, n, "REPEAT", "nb0 is not the element size (ops.cpp:1720)")
    return New(a.type, n.ne)


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
    check_types(n, "PAD", ONLY_F32, a)
    ne = tuple(a.ne[i] + pads[2 * i] + pads[2 * i + 1] for i in range(4))
    return New(a.type, ne)  # type: ignore[arg-type]


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
    check_types(n, "ACC/SET", types, a, b)
    need(a.type == b.type, n, "ACC/SET", "src0 and src1 types differ")
    need(nelements(b) <= nelements(a), n, "ACC/SET", "src1 has more elements than src0")
    need(is_contiguous(a) and a.nb0 == 4 and b.nb0 == 4, n, "ACC/SET", "src0 not contiguous")
    end = offset + (b.ne0 - 1) * 4 + (b.ne1 - 1) * s1 + (b.ne2 - 1) * s2 + (b.ne3 - 1) * s3 + 4
    if end > _nbytes(a):
        raise refuse(n, "ACC/SET", f"region ends at byte {end}, past the {_nbytes(a)}-byte tensor",
                     "graph_op_params_invalid")
    return dup_or_inplace(a)


def _pad_reflect_1d(n: RpcTensor, s: Srcs) -> Result:
    """ggml_pad_reflect_1d ggml.c:5299: 0 <= p0, p1 < a.ne0; result F32 (a.ne0 + p0 + p1, ...)."""
    a = s[0]
    assert a is not None
    p0, p1 = n.param0, n.param1
    if p0 < 0 or p1 < 0 or p0 >= a.ne0 or p1 >= a.ne0:
        raise refuse(n, "PAD_REFLECT_1D", f"pads ({p0}, {p1}) for ne0={a.ne0}", "graph_op_params_invalid")
    check_types(n, "PAD_REFLECT_1D", ONLY_F32, a)
    need(is_contiguous(a), n, "PAD_REFLECT_1D", "src not contiguous (the constructor asserts it)")
    return New(F32, (a.ne0 + p0 + p1, a.ne1, a.ne2, a.ne3))


def _roll(n: RpcTensor, s: Srcs) -> Result:
    """ggml_roll ggml.c:5330: unit nb0, |shift_i| < ne_i (params 0..3); result a fresh copy. The
    kernel (ops.cpp:8557) is F32 only and copies whole rows of ne0."""
    a = s[0]
    assert a is not None
    check_types(n, "ROLL", ONLY_F32, a)
    shifts = n.op_params[:4]
    if any(not -ne < sh < ne for sh, ne in zip(shifts, a.ne)):
        raise refuse(n, "ROLL", f"shifts {shifts} for {a.ne}", "graph_op_params_invalid")
    need(a.nb0 == 4, n, "ROLL", "nb0 is not the element size")
    return New(a.type, a.ne)


ROWS: tuple[OpRule, ...] = (
    OpRule("DUP", "ggml.c:2053 ggml_dup", 1, _dup),
    OpRule("ACC", "ggml.c:2212 ggml_acc", 2, _acc, params=5),
    OpRule("SET", "ggml.c:3533 ggml_set", 2, _set, params=5),
    OpRule("PAD_REFLECT_1D", "ggml.c:5299 ggml_pad_reflect_1d", 1, _pad_reflect_1d, params=2),
    OpRule("REPEAT", "ggml.c:2579 ggml_repeat", 1, _repeat),
    OpRule("CONCAT", "ggml.c:2631 ggml_concat", 2, _concat, params=1, empty_sources=True),
    OpRule("CPY", "ggml.c:3612 ggml_cpy / ggml.c:3625 ggml_cast", 2, _cpy, self_src1=True),
    OpRule("CONT", "ggml.c:3648 ggml_cont", 1, _cont),
    OpRule("RESHAPE", "ggml.c:3770 ggml_reshape_4d", 1, _reshape),
    OpRule("VIEW", "ggml.c:3863 ggml_view_4d", 1, _view, params=2),
    OpRule("PERMUTE", "ggml.c:3887 ggml_permute", 1, _permute, params=4),
    OpRule("TRANSPOSE", "ggml.c:3943 ggml_transpose", 1, _transpose),
    OpRule("GET_ROWS", "ggml.c:3963 ggml_get_rows", 2, _get_rows),
    # empty_sources: no rows to set (test-backend-ops' r=1,v=1 views 0 rows); ops.cpp:5474-5480
    # loops over ne01 = 0 rows, so neither the rows nor the indices are read
    OpRule("SET_ROWS", "ggml.c:4009 ggml_set_rows", 3, _set_rows, since=(4, 0, 0), empty_sources=True),
    OpRule("SET_ROWS", "0.3.20 ggml.c ggml_set_rows (F32 rows)", 3, _set_rows_f32, until=(4, 0, 0),
           empty_sources=True),
    OpRule("PAD", "ggml.c:5243 ggml_pad_ext", 1, _pad, params=9),
    OpRule("ROLL", "ggml.c:5330 ggml_roll", 1, _roll, params=4),
)
