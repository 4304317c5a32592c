"""Rows of the element-wise ops: unary and binary arithmetic, norms, scale, GLU, ADD_ID, values made from params.

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

import math
from typing import Mapping

from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules.base import (
    BF16, Derive, F16, F32, F32_F16, FLOAT, I32, INT32_MAX, New, ONLY_F32, OpRule, Result, Srcs, can_repeat,
    check_types, dup_or_inplace, f32, is_contiguous, is_padded_1d, need, nelements, refuse, round_f32,
    rows_contiguous,
)
from rpcguard.protocol.tensor import RpcTensor


def _unary_like(types: frozenset[int], rows: bool = False, contiguous: bool = False, unit: bool = False) -> Derive:
    """An elementwise op on one source whose result is ggml_dup_tensor(a) or its inplace view;
    the kernel handles ``types`` and needs contiguous rows, a contiguous source, or a unit
    element stride (nb0 == type size) as asked."""
    def derive(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
        a = s[0]
        assert a is not None
        check_types(n, "unary", types, a)
        if rows:
            need(rows_contiguous(a), n, "unary", "src rows not contiguous")
        if contiguous:
            need(is_contiguous(a), n, "unary", "src not contiguous")
        if unit:
            need(a.nb0 == TYPES[a.type].type_size, n, "unary", "nb0 is not the element size")
        return dup_or_inplace(a)

    return derive


# ggml-cpu/binary-ops.cpp:120-135 (dst type = src0 type, see ggml_add_impl ggml.c:2066)
_BINARY_TYPES = frozenset({(F32, F32), (F16, F16), (BF16, BF16), (BF16, F32), (F16, F32)})


def _binary(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ADD/SUB/MUL/DIV (ggml_add_impl ggml.c:2066 ...): b repeats into a; binary_op asserts unit
    nb0 of dst and src0 (binary-ops.cpp:58-59)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    need(can_repeat(b, a), n, "binary", f"src1 {b.ne} does not repeat into src0 {a.ne}")
    if (a.type, b.type) not in _BINARY_TYPES:
        raise refuse(n, "binary", f"types {TYPES[a.type].name}/{TYPES[b.type].name}", "graph_type_invalid")
    need(a.nb0 == TYPES[a.type].type_size, n, "binary", "src0 nb0 is not the element size")
    return dup_or_inplace(a)


def _rms_norm(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """RMS_NORM (ggml.c:3191): as NORM, but its kernel asserts a unit nb00 (ops.cpp:4123)."""
    a = s[0]
    assert a is not None
    need(a.nb0 == 4, n, "RMS_NORM", "src0 nb0 is not the element size")
    return _norm(n, s)


def _norm(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """NORM / RMS_NORM / L2_NORM (ggml.c:3140ff): op_params[0] = eps; kernels F32 only. They read
    ne00 floats from each row start (i01*nb01 + ...): with nb00 >= 4 (the layout rule) that stays
    inside the source, which the kernel oracle confirms for strided sources."""
    a = s[0]
    assert a is not None
    check_types(n, "norm", ONLY_F32, a)
    if not f32(n.param0) >= 0.0:  # ops.cpp:4026/4132/4502 GGML_ASSERT(eps >= 0.0f) (NaN fails too)
        raise refuse(n, "norm", f"eps {f32(n.param0)}", "graph_op_params_invalid")
    return dup_or_inplace(a)


GROUP_NORM_EXTRA = 1 << 16  # groups the kernel may loop over beyond the channels (microseconds)


def _group_norm(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    a = s[0]
    assert a is not None
    check_types(n, "GROUP_NORM", ONLY_F32, a)
    # ops.cpp:4413 computes (n_channels + n_groups - 1) / n_groups in int (UBSan: overflow near
    # 2^31) and loops over every group, empty ones too (2^31 of them: seconds). More groups than
    # channels leaves the extra ones empty, which the constructor allows: up to GROUP_NORM_EXTRA of
    # those, and the sum inside an int
    g = n.param0
    need(0 < g <= max(a.ne2, GROUP_NORM_EXTRA) and a.ne2 + g - 1 <= INT32_MAX, n, "GROUP_NORM",
          f"n_groups {g} for {a.ne2} channels")
    need(a.nb0 == 4, n, "GROUP_NORM", "nb0")
    return dup_or_inplace(a)


_SCALE_TYPES = frozenset({F32, BF16})


def _scale(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ggml_scale_impl ggml.c:3455: a padded 1d; params {s, b}. The kernel asserts more than the
    constructor: a contiguous F32 source (ops.cpp:4886 ggml_compute_forward_scale_f32)."""
    a = s[0]
    assert a is not None
    check_types(n, "SCALE", _SCALE_TYPES, a)  # ops.cpp scale_f32 / scale_bf16
    # the constructor's padded-1d check has no size-1 exception: the kernel walks flat rows at
    # i1*nb01 (ops.cpp:4886ff); it also asserts a contiguous source
    need(is_padded_1d(a) and is_contiguous(a), n, "SCALE", "src is not padded 1d and contiguous")
    return dup_or_inplace(a)


GLU_OP_COUNT = 7  # ggml.h:634-643 (7.0.0)
GLU_OP_SWIGLU_OAI = 3
UNARY_OP_COUNT = 22  # ggml.h:608-631 (7.0.0); older versions have fewer, their ids are a prefix
UNARY_OP_XIELU = 17
# GELU, GELU_QUICK, SILU, GELU_ERF: ops.cpp's own kernels read ne00 elements from each row start
# (no unit-stride assert; in bounds with nb00 >= the element size, per the kernel oracle)
UNARY_OPS_CPP = frozenset({8, 9, 10, 16})


def _glu_before_7(n: RpcTensor, s: Srcs) -> Result:
    """GLU before 7.0.0: six glu ops (ggml.h of 0.3.20-0.3.35). SWIGLU_CLAMP came with 6.0.0 (b10970
    ggml.h:641) but the BF16 glu kernels only with 7.0.0, so 6.0.0 keeps this row (its SWIGLU_CLAMP
    nodes are refused: no row yet says F32/F16 with seven glu ops)."""
    if n.param0 >= GLU_OP_COUNT - 1:
        raise refuse(n, "GLU", f"glu op {n.param0} unknown before 7.0.0", "graph_op_params_invalid")
    a = s[0]
    assert a is not None
    check_types(n, "GLU", F32_F16, a)  # BF16 kernels were read for 7.0.0 only
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
    check_types(n, "GLU", _GLU_TYPES.get(n.param0, FLOAT), a)  # ops.cpp: the dispatch of each glu op
    need(is_contiguous(a, 1), n, "GLU", "src0 not contiguous_1")
    if b is not None:
        need(is_contiguous(b, 1) and b.ne == a.ne and b.type == a.type, n, "GLU", "src1")
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
    check_types(n, "UNARY", FLOAT, a)
    need(rows_contiguous(a), n, "UNARY", "rows not contiguous (the constructor asserts it)")
    if op not in UNARY_OPS_CPP:  # unary-ops.cpp apply_unary_op asserts a unit nb00
        need(a.nb0 == TYPES[a.type].type_size, n, "UNARY", "rows")
    if op == UNARY_OP_XIELU:
        need(is_contiguous(a, 1), n, "UNARY", "XIELU needs a contiguous_1 source")
        return (New(a.type, a.ne),)
    return dup_or_inplace(a)


def _add_id(n: RpcTensor, s: Srcs) -> Result:
    """ggml_add_id ggml.c:2130; kernel F32 only."""
    a, b, ids = s[0], s[1], s[2]
    assert a is not None and b is not None and ids is not None
    ok = a.ne0 == b.ne0 and a.ne1 == ids.ne0 and a.ne2 == ids.ne1 and ids.type == I32
    need(ok, n, "ADD_ID", f"a {a.ne} b {b.ne} ids {ids.ne}")
    check_types(n, "ADD_ID", ONLY_F32, a, b)
    need(a.nb0 == 4 and b.nb0 == 4, n, "ADD_ID", "nb0")
    return New(a.type, a.ne)


def _timestep_embedding(n: RpcTensor, s: Srcs) -> Result:
    """ggml_timestep_embedding ggml.c:5358: result F32 (dim, ts.ne0); dim > 0."""
    a = s[0]
    assert a is not None
    if n.param0 <= 0:
        raise refuse(n, "TIMESTEP_EMBEDDING", f"dim {n.param0}", "graph_op_params_invalid")
    check_types(n, "TIMESTEP_EMBEDDING", ONLY_F32, a)
    need(a.nb0 == 4, n, "TIMESTEP_EMBEDDING", "nb0 is not the element size")  # ops.cpp:8659
    return New(F32, (n.param0, a.ne0, 1, 1))


def _arange(n: RpcTensor, s: Srcs) -> Result:
    """ggml_arange ggml.c:5484: ceil((stop - start) / step) F32 elements, stop > start."""
    start, stop, step = f32(n.param0), f32(n.param1), f32(n.param2)
    if not (stop > start) or not step > 0 or not math.isfinite(stop - start):
        raise refuse(n, "ARANGE", f"start {start} stop {stop} step {step}", "graph_op_params_invalid")
    # in float as ggml.c and the kernel (ops.cpp:8628) compute it: ceilf((stop - start) / step),
    # each operation rounded to single precision (a double quotient can cross an integer the
    # float one does not: the kernel then asserts nelements == steps)
    steps = math.ceil(round_f32(round_f32(stop - start) / step))
    return New(F32, (steps, 1, 1, 1))


ROWS: tuple[OpRule, ...] = (
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
    OpRule("NORM", "ggml.c:3160 ggml_norm", 1, _norm, params=1),
    OpRule("RMS_NORM", "ggml.c:3191 ggml_rms_norm", 1, _rms_norm, params=1),
    OpRule("GROUP_NORM", "ggml.c:3242 ggml_group_norm", 1, _group_norm, params=2),
    OpRule("L2_NORM", "ggml.c:3275 ggml_l2_norm", 1, _norm, params=1),
    OpRule("SCALE", "ggml.c:3476 ggml_scale", 1, _scale, params=2),
    OpRule("CLAMP", "ggml.c:4136 ggml_clamp", 1, _unary_like(F32_F16, unit=True), params=2),
    OpRule("TIMESTEP_EMBEDDING", "ggml.c:5358 ggml_timestep_embedding", 1, _timestep_embedding, params=2),
    OpRule("FILL", "ggml.c:5416 ggml_fill", 1, _unary_like(F32_F16, contiguous=True), params=1),
    OpRule("ARANGE", "ggml.c:5484 ggml_arange", 0, _arange, params=3),
    OpRule("LEAKY_RELU", "ggml.c:2760 ggml_leaky_relu", 1, _unary_like(F32_F16), params=1),
    OpRule("UNARY", "ggml.c:6033 ggml_unary", 1, _unary, params=5),
    OpRule("GLU", "ggml.c:2998 ggml_glu", 1, _glu, optional=1, params=4, since=(7, 0, 0)),
    OpRule("GLU", "0.3.35 ggml.c ggml_glu", 1, _glu_before_7, optional=1, params=4, until=(7, 0, 0)),
)
