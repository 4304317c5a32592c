"""Rows of the convolution, pooling and resampling ops: IM2COL, POOL_1D/2D, UPSCALE, CONV_2D_DW, CONV_TRANSPOSE_1D.

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules.base import (
    BF16, Derive, F16, F32, F32_F16, INT32_MAX, MAX_DIMS, New, ONLY_F32, OpRule, Result, Srcs, check_types,
    contiguous_nb, is_contiguous, need, refuse, round_f32,
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


ROWS: tuple[OpRule, ...] = (
    OpRule("IM2COL", "ggml.c:4556 ggml_im2col", 2, _im2col, params=7),
    OpRule("POOL_1D", "ggml.c:5080 ggml_pool_1d", 1, _pool(False), params=4),
    OpRule("POOL_2D", "ggml.c:5108 ggml_pool_2d", 1, _pool(True), params=7),
    OpRule("UPSCALE", "ggml.c:5165 ggml_interpolate_impl (ggml_upscale, _ext, ggml_interpolate)", 1, _upscale,
           params=1, flat_rows=False),
    OpRule("CONV_2D_DW", "ggml.c:4916 ggml_conv_2d_dw_direct", 2, _conv_2d_dw, params=6, flat_rows=False),
    OpRule("CONV_TRANSPOSE_1D", "ggml.c:4727 ggml_conv_transpose_1d", 2, _conv_transpose_1d, params=3,
           flat_rows=False, plan=_conv_transpose_1d_plan),
)
