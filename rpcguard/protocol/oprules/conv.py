"""Rows of the convolution, pooling and resampling ops: IM2COL (2D, 3D) and its backward op
IM2COL_BACK, COL2IM_1D, the convolutions (CONV_2D, CONV_3D, CONV_2D_DW, CONV_TRANSPOSE_1D/2D),
POOL_1D/2D and POOL_2D_BACK, UPSCALE.

Stays whole (over 400 lines): one family of rows (oprules keeps one module per family), the
convolution ops sharing their output-size and window helpers.

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

from typing import Sequence

from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules.base import (
    BF16, Derive, F16, F32, F32_F16, FLOAT, INT32_MAX, MAX_DIMS, New, ONLY_F32, OpRule, Result, Srcs,
    check_types, contiguous_nb, is_contiguous, need, nelements, refuse, round_f32,
)
from rpcguard.protocol.tensor import RpcTensor


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
        need(a.ne2 == b.ne2, n, "IM2COL", f"channels of {a.ne} and {b.ne}")
    else:
        need(b.ne1 == a.ne1 and b.ne3 == 1, n, "IM2COL", f"channels of {a.ne} and {b.ne}")
    oh = _conv_out(b.ne1, a.ne1, s1, p1, d1) if is_2d else 0
    ow = _conv_out(b.ne0, a.ne0, s0, p0, d0)
    need((not is_2d or oh > 0) and ow > 0, n, "IM2COL", f"b {b.ne} too small for a {a.ne}")
    if n.type == F32:
        check_types(n, "IM2COL", ONLY_F32, b)
    else:
        check_types(n, "IM2COL", F32_F16, b)
        need(n.type == F16, n, "IM2COL", "result neither F32 nor F16")
    esize = TYPES[b.type].type_size
    ofs = (b.nb3, b.nb2) if is_2d else (b.nb2, b.nb1)
    need(b.nb0 == esize and max(ofs) <= INT32_MAX and (not is_2d or b.nb1 == b.ne0 * esize), n, "IM2COL",
          f"strides {b.nb} of b")
    ne = (a.ne2 * a.ne1 * a.ne0 if is_2d else a.ne1 * a.ne0, ow, oh if is_2d else b.ne2, b.ne3 if is_2d else 1)
    return New(n.type if n.type in (F32, F16) else F32, ne)


def _im2col_back(n: RpcTensor, s: Srcs) -> Result:
    """ggml_im2col_back ggml.c:4600 (what ggml_build_backward_expand makes of an IM2COL whose
    image needs a gradient, ggml.c:7141): params as IM2COL's {s0, s1, p0, p1, d0, d1, is_2D},
    src0 the gradient of that IM2COL's result, src1 its convolution kernel (only its shape is
    read), an F32 result of the caller's shape ``ne`` (the image's). The kernel (ops.cpp:6896
    ggml_compute_forward_im2col_back_f32) asserts F32/F16 types and a unit nb0 for dst; it reads
    the gradient flat, ``(in*OH*OW + ioh*OW + iow)*(IC*KH*KW) + iic*KH*KW + ikh*KW + ikw`` with OW
    and OH from src0's ne1 and ne2 and N, IC from dst: so src0 is packed in exactly the shape
    IM2COL gives for this image and kernel (which is what the gradient has). It takes ``tmpw % s0``
    (and ``% s1`` in 2D): a zero stride divides by zero. It writes each channel's pixels as
    ``dst[iih*IW + iiw]`` from ``dst + in*ofs0 + iic*ofs1`` with the two offsets (nb3, nb2 in 2D,
    nb2, nb1 in 1D) held in an ``int``, and forms ``ikw*d0`` in int64: kernel sides past 2^31
    could overflow it."""
    g, k = s[0], s[1]
    assert g is not None and k is not None
    op = "IM2COL_BACK"
    s0, s1, p0, p1, d0, d1, is_2d = n.op_params[:7]
    if is_2d not in (0, 1) or s0 == 0 or (is_2d and s1 == 0):
        raise refuse(n, op, f"params {n.op_params[:7]}", "graph_op_params_invalid")
    check_types(n, op, ONLY_F32, g)
    check_types(n, op, F32_F16, k)
    kw, kh = k.ne0, (k.ne1 if is_2d else 1)
    need(max(kw, kh) <= INT32_MAX, n, op, f"kernel {k.ne} sides past 2^31")
    if is_2d:
        iw, ih, ic, batch = n.ne
        need(k.ne2 == ic, n, op, f"channels of kernel {k.ne} and image {n.ne}")
    else:
        iw, ic, batch, ih = n.ne0, n.ne1, n.ne2, 1
        need(n.ne3 == 1 and k.ne1 == ic, n, op, f"channels of kernel {k.ne} and image {n.ne}")
    ow = _conv_out(iw, kw, s0, p0, d0)
    oh = _conv_out(ih, kh, s1, p1, d1) if is_2d else 1
    need(ow > 0 and oh > 0, n, op, f"image {n.ne} too small for kernel {k.ne}")
    want = (ic * kh * kw, ow, oh, batch) if is_2d else (ic * kw, ow, batch, 1)
    need(g.ne == want and is_contiguous(g), n, op, f"gradient {g.ne} (strides {g.nb}) is not IM2COL's packed {want}")
    nb = contiguous_nb(F32, n.ne)
    need(max(nb[2:] if is_2d else nb[1:3]) <= INT32_MAX, n, op, f"image planes of {n.ne} past the kernel's int offsets")
    return New(F32, n.ne)


POOL_OPS = (0, 1)  # ggml.h enum ggml_op_pool: AVG, MAX (COUNT aborts in the kernels)


def _pool_out(ins: int, k: int, st: int, p: int) -> int:
    """ggml.c:5074 ggml_calc_pool_output_size: (ins + 2*p - k) / s + 1 with a float p, so in
    single precision, each operation rounded, then truncated to int64."""
    x = round_f32(round_f32(round_f32(float(ins)) + round_f32(2.0 * p)) - k)
    return int(round_f32(round_f32(x / st) + 1.0))


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
        check_types(n, op, F32_F16, a)
        need(a.nb0 == TYPES[a.type].type_size, n, op, "nb0 is not the element size")
        if two_d:
            need(a.nb == contiguous_nb(a.type, a.ne), n, op, "source not packed")
        ow = _pool_out(a.ne0, k0, s0, p0)
        oh = _pool_out(a.ne1, k1, s1, p1) if two_d else a.ne1
        need(ow > 0 and oh > 0, n, op, f"window larger than {a.ne}")
        reach = max(ow * s0, oh * s1) + max(k0, k1) + abs(p0) + abs(p1)
        # POOL_2D's average divides by ``int ka = k0 * k1`` (ops.cpp:8028): a window whose area
        # passes 2^31 is a signed overflow (UBSan) even where each side fits
        if reach > INT32_MAX or k0 * k1 > INT32_MAX:
            raise refuse(n, op, f"window positions or area past 2^31 ({reach}, {k0}x{k1})", "graph_op_params_invalid")
        return New(F32, (ow, oh, a.ne2, a.ne3))

    return derive


def _pool_2d_back(n: RpcTensor, s: Srcs) -> Result:
    """ggml_pool_2d_back ggml.c:5139 (what ggml_build_backward_expand makes of a POOL_2D,
    ggml.c:7154): params as POOL_2D's {op, k0, k1, s0, s1, p0, p1} (its float paddings stored as
    int), src0 the gradient of that POOL_2D's result, src1 (af) its source; an F32 result of af's
    shape. The kernel (ops.cpp:8085 ggml_compute_forward_pool_2d_back, one thread) zeroes dst and
    walks its planes from data to data + nbytes in steps of nb2, as POOL_2D does (packed); per
    plane it reads px*py gradients (src0's ne0, ne1) as packed F32 and moves on by px*py, so src0
    is packed in exactly POOL_2D's result shape for af; for MAX it reads af at dst's own strides
    and in dst's type, so af is packed F32 as dst is. Window positions ``offset + ox*s0`` and the
    window area ``k0*k1`` are ``int``s, bounded as POOL_2D's; a pool op other than AVG and MAX
    aborts (GGML_ASSERT(false))."""
    g, af = s[0], s[1]
    assert g is not None and af is not None
    op = "POOL_2D_BACK"
    pool, k0, k1, s0, s1, p0, p1 = n.op_params[:7]
    if pool not in POOL_OPS or min(k0, k1, s0, s1) <= 0:
        raise refuse(n, op, f"params {n.op_params[:7]}", "graph_op_params_invalid")
    check_types(n, op, ONLY_F32, g, af)
    need(af.nb == contiguous_nb(F32, af.ne), n, op, "pooled source not packed")
    ow, oh = _pool_out(af.ne0, k0, s0, p0), _pool_out(af.ne1, k1, s1, p1)
    need(ow > 0 and oh > 0, n, op, f"window larger than {af.ne}")
    want = (ow, oh, af.ne2, af.ne3)
    need(g.ne == want and g.nb == contiguous_nb(F32, want), n, op, f"gradient {g.ne} is not POOL_2D's packed {want}")
    reach = max(ow * s0, oh * s1) + max(k0, k1) + abs(p0) + abs(p1)
    if reach > INT32_MAX or k0 * k1 > INT32_MAX:
        raise refuse(n, op, f"window positions or area past 2^31 ({reach}, {k0}x{k1})", "graph_op_params_invalid")
    return New(F32, af.ne)


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
        sf = round_f32(round_f32(float(ne - 1)) / round_f32(float(ne_src - 1)))
    else:
        sf = round_f32(round_f32(float(ne)) / round_f32(float(ne_src)))
    return int(round_f32(round_f32(float(ne - 1)) / sf))


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
    check_types(n, "UPSCALE", ONLY_F32, a)
    align = bool(flags & SCALE_ALIGN_CORNERS)
    for d in range(MAX_DIMS):
        if d >= 2 or base == 0:
            last = _upscale_last_index(n.ne[d], a.ne[d], align and d < 2)
            need(last < a.ne[d], n, "UPSCALE", f"dim {d}: source index {last} of {a.ne} (float rounding)")
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
    need(a.ne2 == 1 and a.ne3 == b.ne2, n, "CONV_2D_DW", f"weights {a.ne} for input {b.ne}")
    check_types(n, "CONV_2D_DW", F32_F16, a)
    check_types(n, "CONV_2D_DW", ONLY_F32, b)
    ow = _conv_out(b.ne0, a.ne0, s0, p0, d0)
    oh = _conv_out(b.ne1, a.ne1, s1, p1, d1)
    need(ow > 0 and oh > 0, n, "CONV_2D_DW", f"input {b.ne} too small for weights {a.ne}")
    c, es, ka = b.ne2, TYPES[b.type].type_size, TYPES[a.type].type_size
    channels = is_contiguous_channels(b)
    if is_contiguous(b):
        need(is_contiguous(a), n, "CONV_2D_DW", f"weights strides {a.nb} not packed")
    else:
        need(channels and b.nb == (c * es, b.ne0 * c * es, es, b.ne0 * b.ne1 * c * es), n, "CONV_2D_DW",
              f"input strides {b.nb} neither packed nor channels-first")
        need(a.nb0 == c * ka and a.nb1 == a.ne0 * c * ka and a.nb3 == ka and a.nb2 <= a.nb0, n, "CONV_2D_DW",
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
    check_types(n, "CONV_TRANSPOSE_1D", F32_F16, a)
    check_types(n, "CONV_TRANSPOSE_1D", ONLY_F32, b)
    need(a.ne3 == 1 and b.ne2 == 1 and b.ne3 == 1, n, "CONV_TRANSPOSE_1D", f"kernel {a.ne}, input {b.ne}")
    need(a.ne0 * a.ne1 * a.ne2 <= INT32_MAX and b.ne0 * b.ne1 <= INT32_MAX, n, "CONV_TRANSPOSE_1D",
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
    need(a.ne2 == b.ne1, n, "CONV_TRANSPOSE_1D", f"channels of kernel {a.ne} and input {b.ne}")
    need(a.nb0 == TYPES[a.type].type_size and b.nb0 == 4, n, "CONV_TRANSPOSE_1D", "nb0 is not the element size")
    ow = (b.ne0 - 1) * s0 + a.ne0
    need(ow <= INT32_MAX, n, "CONV_TRANSPOSE_1D", f"output length {ow} past 2^31")
    return New(F32, (ow, a.ne1, b.ne2, 1))


# ggml-cpu/ops.h:23 GGML_IM2COL_WORK_SIZE: the work buffer ggml_graph_plan gives a CONV_2D/CONV_3D
# node (ggml-cpu.c:2962); the whole plan's buffer is the largest need of any node, so at least this.
IM2COL_WORK_SIZE = 16 * 1024 * 1024


def _conv_params(n: RpcTensor, op: str, strides: Sequence[int], pads: Sequence[int], dils: Sequence[int]) -> None:
    """Strides and dilations at least 1, paddings in [0, 2^30): what every caller passes, and what
    keeps ggml_calc_conv_output_size's ``2 * p`` (an int, ggml.c:4549) defined and its divisor
    nonzero; with a positive output size every int64 source position the kernels form then lies
    in [-p, W + p) and is checked against the source's extent before a read."""
    if min(*strides, *dils) < 1 or not all(0 <= p <= CONV_PARAM_MAX for p in pads):
        raise refuse(n, op, f"params {n.op_params[:len(strides) * 3]}", "graph_op_params_invalid")


def _conv_direct_patch(n: RpcTensor, op: str, a: RpcTensor, taps: int, c_out: int) -> None:
    """ggml_compute_forward_conv_2d_impl / _conv_3d_impl (ops.cpp:7313, 7450): the kernel asserts a
    contiguous F16/F32 weight tensor (ops.cpp:7319-7321, 7456-7458; the product reads it as one
    packed [taps, c_out] matrix, ggml_call_mul_mat ops.cpp:7191) and sizes its batches of patches
    as ``wsize / (taps*type_size + c_out*4)``, dividing by that count (ops.cpp:7353, 7496: SIGFPE
    when it is 0) before asserting it (ops.cpp:7355, 7498): the plan's work buffer is only known
    to hold IM2COL_WORK_SIZE (plus a cache line per thread), so one patch must fit in that."""
    check_types(n, op, F32_F16, a)
    need(is_contiguous(a), n, op, f"weights strides {a.nb} not contiguous (the kernel asserts it)")
    per_patch = taps * TYPES[a.type].type_size + c_out * 4
    need(per_patch <= IM2COL_WORK_SIZE, n, op, f"one patch needs {per_patch} bytes of the {IM2COL_WORK_SIZE}-byte work buffer")


def _conv_empty_sources(n: RpcTensor, op: str, a: RpcTensor, b: RpcTensor) -> None:
    """An empty weight or input (a 0 in a side, test-backend-ops' KW = 0 cases: the constructor's
    output size stays positive) is never read: the gather loops run over no taps, or every source
    position is outside an empty extent, and the product has an inner dimension of 0. Its data
    pointer still enters pointer arithmetic (``src + batch*nb3``, ops.cpp:7376): it must point into
    a buffer, as CONCAT's (OpRule.empty_sources), with the strides ggml_new_tensor gives an empty
    tensor (no layout rule looks at them: a huge nb3 times the batch would wrap the pointer)."""
    for t in (a, b):
        if not nelements(t):
            need(bool(t.data) and t.nb == contiguous_nb(t.type, t.ne), n, op,
                  f"an empty source without data or with strides {t.nb}")


def _conv_2d(n: RpcTensor, s: Srcs) -> Result:
    """ggml_conv_2d_direct ggml.c:4956: a (the weights) [KW, KH, IC, OC], b (the input) [W, H, IC,
    N] with a.ne2 == b.ne2, params {s0, s1, p0, p1, d0, d1}; a result of b's type [OW, OH, OC, N].
    The kernel (ops.cpp:7313 ggml_compute_forward_conv_2d_impl) reads b as floats through its four
    strides (``sx*nb0 + sy*nb1 + ic*nb2 + batch*nb3``, ops.cpp:7391, positions checked against W
    and H first) and writes floats through the result's strides (ops.cpp:7431): b is F32 (the
    constructor takes any type), any strides; a as _conv_direct_patch says. Every index is int64."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    _conv_params(n, "CONV_2D", n.op_params[0:2], n.op_params[2:4], n.op_params[4:6])
    s0, s1, p0, p1, d0, d1 = n.op_params[:6]
    need(a.ne2 == b.ne2, n, "CONV_2D", f"channels of weights {a.ne} and input {b.ne}")
    _conv_empty_sources(n, "CONV_2D", a, b)
    check_types(n, "CONV_2D", ONLY_F32, b)
    _conv_direct_patch(n, "CONV_2D", a, a.ne0 * a.ne1 * a.ne2, a.ne3)
    ow = _conv_out(b.ne0, a.ne0, s0, p0, d0)
    oh = _conv_out(b.ne1, a.ne1, s1, p1, d1)
    need(ow > 0 and oh > 0, n, "CONV_2D", f"input {b.ne} too small for weights {a.ne}")
    return New(b.type, (ow, oh, a.ne3, b.ne3))


def _conv_3d(n: RpcTensor, s: Srcs) -> Result:
    """ggml_conv_3d_direct ggml.c:4994: a [KW, KH, KD, IC*OC], b [W, H, D, IC*N], params {s0, s1,
    s2, p0, p1, p2, d0, d1, d2, IC, N, OC} with a.ne3 == IC*OC and b.ne3 == IC*N asserted; an F32
    result [OW, OH, OD, OC*N]. The kernel (ops.cpp:7450 ggml_compute_forward_conv_3d_impl) takes
    IC, N and OC from the params: negative ones whose products match pass the constructor and make
    the kernel's batch size negative (its assert aborts), so each is at least 1. b is read as floats
    through its strides at channel ``batch*IC + ic`` (ops.cpp:7536), the result written through its
    own (ops.cpp:7575); a as _conv_direct_patch says."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    _conv_params(n, "CONV_3D", n.op_params[0:3], n.op_params[3:6], n.op_params[6:9])
    s0, s1, s2, p0, p1, p2, d0, d1, d2, c, bn, oc = n.op_params[:12]
    if min(c, bn, oc) < 1:
        raise refuse(n, "CONV_3D", f"channels {c}, batch {bn}, out channels {oc}", "graph_op_params_invalid")
    need(a.ne3 == c * oc and b.ne3 == c * bn, n, "CONV_3D", f"weights {a.ne} / input {b.ne} for IC={c} N={bn} OC={oc}")
    _conv_empty_sources(n, "CONV_3D", a, b)
    check_types(n, "CONV_3D", ONLY_F32, b)
    _conv_direct_patch(n, "CONV_3D", a, a.ne0 * a.ne1 * a.ne2 * c, oc)
    ow = _conv_out(b.ne0, a.ne0, s0, p0, d0)
    oh = _conv_out(b.ne1, a.ne1, s1, p1, d1)
    od = _conv_out(b.ne2, a.ne2, s2, p2, d2)
    need(ow > 0 and oh > 0 and od > 0, n, "CONV_3D", f"input {b.ne} too small for weights {a.ne}")
    return New(F32, (ow, oh, od, oc * bn))


def _im2col_3d(n: RpcTensor, s: Srcs) -> Result:
    """ggml_im2col_3d ggml.c:4789: a (the kernel: only its shape is read) [KW, KH, KD, OC*IC], b
    [W, H, D, N*IC], params {s0, s1, s2, p0, p1, p2, d0, d1, d2, IC}; N = b.ne3 / IC; result
    [KW*KH*KD*IC, OW, OH, OD*N] of the caller's type. The kernels (ops.cpp:6994 _f16, 7084 _f32,
    dispatched on the result type, else GGML_ABORT ops.cpp:7186) assert an F32 b with unit nb0 and
    read it through its strides at channel ``n*IC + ic`` (ops.cpp:7054, 7145), positions checked
    first; they divide by IC and by N (ops.cpp:7021, 7032): IC >= 1 and N >= 1. The result is
    written flat (it is fresh). Every index is int64."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    _conv_params(n, "IM2COL_3D", n.op_params[0:3], n.op_params[3:6], n.op_params[6:9])
    s0, s1, s2, p0, p1, p2, d0, d1, d2, ic = n.op_params[:10]
    if ic < 1 or b.ne3 < ic:
        raise refuse(n, "IM2COL_3D", f"IC {ic} for input {b.ne}", "graph_op_params_invalid")
    check_types(n, "IM2COL_3D", ONLY_F32, b)
    need(n.type in F32_F16, n, "IM2COL_3D", "result neither F32 nor F16")
    need(b.nb0 == 4, n, "IM2COL_3D", "input nb0 is not the element size")
    ow = _conv_out(b.ne0, a.ne0, s0, p0, d0)
    oh = _conv_out(b.ne1, a.ne1, s1, p1, d1)
    od = _conv_out(b.ne2, a.ne2, s2, p2, d2)
    need(ow > 0 and oh > 0 and od > 0, n, "IM2COL_3D", f"input {b.ne} too small for kernel {a.ne}")
    return New(n.type, (a.ne0 * a.ne1 * a.ne2 * ic, ow, oh, od * (b.ne3 // ic)))


def _col2im_1d(n: RpcTensor, s: Srcs) -> Result:
    """ggml_col2im_1d ggml.c:4688: a contiguous F32/F16/BF16 matrix [K*OC, T_in], params {s0, OC,
    p0} with s0 > 0, OC > 0, p0 >= 0, OC dividing a.ne0, T_out = (T_in - 1)*s0 + K - 2*p0 > 0; a
    result of a's type [T_out, OC]. The kernel (ops.cpp:7246 ggml_compute_forward_col2im_1d_impl)
    asserts both contiguous and reads a flat at ``oc*K + k + t_in*K*OC`` with k < K, t_in < T_in,
    writes ``t_out + oc*T_out``: inside both. p0 stays below 2^30 (the constructor's ``2 * p0`` is an
    int). Its gather loop visits at most min(T_in, K/s0 + 1) columns per output: linear in the
    elements of a and the result."""
    a = s[0]
    assert a is not None
    s0, oc, p0 = n.op_params[:3]
    if s0 < 1 or oc < 1 or not 0 <= p0 <= CONV_PARAM_MAX:
        raise refuse(n, "COL2IM_1D", f"params {n.op_params[:3]}", "graph_op_params_invalid")
    check_types(n, "COL2IM_1D", FLOAT, a)
    need(a.ne2 == 1 and a.ne3 == 1 and is_contiguous(a), n, "COL2IM_1D", f"source {a.ne} {a.nb} not a contiguous matrix")
    k = a.ne0 // oc
    t_out = (a.ne1 - 1) * s0 + k - 2 * p0
    need(k * oc == a.ne0 and k > 0 and t_out > 0, n, "COL2IM_1D", f"source {a.ne} for OC={oc} s0={s0} p0={p0}")
    return New(a.type, (t_out, oc, 1, 1))


def _conv_transpose_2d_plan(n: RpcTensor, s: Srcs) -> None:
    """What ggml_graph_plan (ggml-cpu.c:2964) asserts of a CONV_TRANSPOSE_2D node, empty or not:
    an F16/F32 kernel and an F32 input (GGML_ASSERT); its work buffer, ``es*(|a| + |b|)``, is
    bounded by the two sources' buffers (cost.py mirrors it)."""
    a, b = s[0], s[1]
    if a is None or b is None:
        return  # check_sources refuses a missing source
    check_types(n, "CONV_TRANSPOSE_2D", F32_F16, a)
    check_types(n, "CONV_TRANSPOSE_2D", ONLY_F32, b)


def _conv_transpose_2d(n: RpcTensor, s: Srcs) -> Result:
    """ggml_conv_transpose_2d_p0 ggml.c:5048: a (the kernel) [KW, KH, Cout, Cin], b (the input) [W,
    H, Cin, N] with a.ne3 == b.ne2, param {stride}; an F32 result [(W-1)*s + KW, (H-1)*s + KH,
    Cout, N]. The kernel (ops.cpp:7591 ggml_compute_forward_conv_transpose_2d_impl) asserts unit
    nb00 and nb10 (ops.cpp:7609-7610), copies a plane of a as ``src[i01*ne00 + i00]`` from
    ``i03*nb03 + i02*nb02`` (ops.cpp:7625: inside a's extent when its rows do not overlap, nb01 >=
    ne00*es, or it has one row) and rows of b through b's strides, then accumulates
    ``dst[(i11*s + i01)*ne0 + i10*s + i00]`` (ops.cpp:7692): inside a plane of the result only for
    s >= 1 (the constructor takes any; a negative one writes before the result). Its counters are
    ``int``: ``nk = |a|`` (ops.cpp:7607), ``i1n`` < W*H*Cin (ops.cpp:7679), ``i11*s + i01`` <
    the result's ne1 and ``i10*s + i00`` < its ne0, so all of those stay below 2^31."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    st = n.param0
    if st < 1:
        raise refuse(n, "CONV_TRANSPOSE_2D", f"stride {st}", "graph_op_params_invalid")
    need(a.ne3 == b.ne2, n, "CONV_TRANSPOSE_2D", f"channels of kernel {a.ne} and input {b.ne}")
    es = TYPES[a.type].type_size
    need(a.nb0 == es and b.nb0 == 4, n, "CONV_TRANSPOSE_2D", "nb0 is not the element size")
    need(a.ne1 == 1 or a.nb1 >= a.ne0 * es, n, "CONV_TRANSPOSE_2D", f"kernel rows {a.nb} overlap (read as packed planes)")
    ow, oh = (b.ne0 - 1) * st + a.ne0, (b.ne1 - 1) * st + a.ne1
    need(nelements(a) <= INT32_MAX and b.ne0 * b.ne1 * b.ne2 <= INT32_MAX and max(ow, oh) <= INT32_MAX, n,
          "CONV_TRANSPOSE_2D", f"kernel {a.ne}, input {b.ne} or output ({ow}, {oh}) past the kernel's int counters")
    return New(F32, (ow, oh, a.ne2, b.ne3))


ROWS: tuple[OpRule, ...] = (
    OpRule("IM2COL", "ggml.c:4556 ggml_im2col", 2, _im2col, params=7),
    OpRule("POOL_1D", "ggml.c:5080 ggml_pool_1d", 1, _pool(False), params=4),
    OpRule("POOL_2D", "ggml.c:5108 ggml_pool_2d", 1, _pool(True), params=7),
    # the two backward ops read only packed tensors and the kernel's shape (no flat-row walk)
    OpRule("IM2COL_BACK", "ggml.c:4600 ggml_im2col_back", 2, _im2col_back, params=7, flat_rows=False),
    OpRule("POOL_2D_BACK", "ggml.c:5139 ggml_pool_2d_back", 2, _pool_2d_back, params=7, flat_rows=False),
    OpRule("UPSCALE", "ggml.c:5165 ggml_interpolate_impl (ggml_upscale, _ext, ggml_interpolate)", 1, _upscale,
           params=1, flat_rows=False),
    OpRule("CONV_2D_DW", "ggml.c:4916 ggml_conv_2d_dw_direct", 2, _conv_2d_dw, params=6, flat_rows=False),
    OpRule("CONV_TRANSPOSE_1D", "ggml.c:4727 ggml_conv_transpose_1d", 2, _conv_transpose_1d, params=3,
           flat_rows=False, plan=_conv_transpose_1d_plan),
    OpRule("CONV_2D", "ggml.c:4956 ggml_conv_2d_direct", 2, _conv_2d, params=6, flat_rows=False, empty_sources=True),
    OpRule("CONV_3D", "ggml.c:4994 ggml_conv_3d_direct", 2, _conv_3d, params=12, flat_rows=False,
           empty_sources=True),
    OpRule("IM2COL_3D", "ggml.c:4789 ggml_im2col_3d", 2, _im2col_3d, params=10, flat_rows=False),
    OpRule("COL2IM_1D", "ggml.c:4688 ggml_col2im_1d", 1, _col2im_1d, params=3),
    OpRule("CONV_TRANSPOSE_2D", "ggml.c:5048 ggml_conv_transpose_2d_p0", 2, _conv_transpose_2d, params=1,
           flat_rows=False, plan=_conv_transpose_2d_plan),
)
