"""Generators: convolution, pooling, recurrent, training and the less common ops (see cases.py)."""

from __future__ import annotations

import random

from tests.differential.cases import KEEP, R, Case, gen, rand_ne


# -- convolution and pooling ------------------------------------------------------------------


@gen("im2col", "IM2COL")
def _im2col(rng: random.Random) -> Case:
    r = R(rng)
    two_d = rng.random() < 0.6
    kw, kh, ic = rng.choice((1, 3, 5)), rng.choice((1, 3)), rng.randint(1, 3)
    iw, ih, n = rng.randint(kw, 12), rng.randint(kh, 9), rng.randint(1, 2)
    s0, s1, p0, p1, d0, d1 = rng.randint(1, 2), rng.randint(1, 2), rng.randint(0, 1), rng.randint(0, 1), 1, 1
    if two_d:
        a = r.leaf("f16", [kw, kh, ic, 4])
        b = r.leaf("f32", [iw, ih, ic, n])
    else:
        a = r.leaf("f16", [kw, ic, 4])
        b = r.leaf("f32", [iw, ic, n])
    r.op("im2col", a, b, s0, s1, p0, p1, d0, d1, two_d, rng.choice((0, 1)))
    return Case("IM2COL", r.recipe(), params={2: (0, [1, 2, 7]), 4: (2, [0, 1, 4]), 6: (4, [1, 2, 3])}, type_arg=9)


@gen("conv_transpose_1d", "CONV_TRANSPOSE_1D")
def _convt1d(rng: random.Random) -> Case:
    r = R(rng)
    k, oc, ic = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 3)
    r.op("conv_transpose_1d", r.leaf("f32", [k, oc, ic]), r.leaf("f32", [rng.randint(1, 9), ic]), rng.randint(1, 3), 0, 1)
    return Case("CONV_TRANSPOSE_1D", r.recipe(), params={2: (0, [1, 2, 5])})


@gen("conv_transpose_1d_mixed", "CONV_TRANSPOSE_1D")
def _convt1d_mixed(rng: random.Random) -> Case:
    """F16 and F32 kernels (the two CPU kernels, ops.cpp:6517 / 6605), longer inputs and kernels,
    strided (non-contiguous) kernels and inputs, and the asserted p0 == 0, d0 == 1 mutated."""
    r = R(rng)
    k, oc, ic = rng.choice((1, 2, 3, 4, 7, 16)), rng.randint(1, 6), rng.randint(1, 6)
    a = r.inp(rng.choice(("f32", "f16")), [k, oc, ic], noncontig=0.3)
    b = r.inp("f32", [rng.choice((1, 2, 5, 13, 40)), ic], noncontig=0.3)
    r.op("conv_transpose_1d", a, b, rng.randint(1, 4), 0, 1)
    return Case("CONV_TRANSPOSE_1D", r.recipe(), params={2: (0, [0, 1, 3, -1]), 3: (1, [1, -1]), 4: (2, [0, 2])})


@gen("conv_transpose_2d", "CONV_TRANSPOSE_2D")
def _convt2d(rng: random.Random) -> Case:
    r = R(rng)
    ic = rng.randint(1, 3)
    a = r.leaf("f16", [rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 3), ic])
    b = r.leaf("f32", [rng.randint(1, 6), rng.randint(1, 6), ic, 1])
    r.op("conv_transpose_2d_p0", a, b, rng.randint(1, 3))
    return Case("CONV_TRANSPOSE_2D", r.recipe(), params={2: (0, [1, 2, 5])})


@gen("conv_2d_direct", "CONV_2D")
def _conv2d(rng: random.Random) -> Case:
    r = R(rng)
    ic = rng.randint(1, 3)
    a = r.leaf("f32", [rng.randint(1, 3), rng.randint(1, 3), ic, rng.randint(1, 4)])
    b = r.leaf("f32", [rng.randint(3, 9), rng.randint(3, 9), ic, rng.randint(1, 2)])
    r.op("conv_2d_direct", a, b, 1, 1, rng.randint(0, 1), rng.randint(0, 1), 1, 1)
    return Case("CONV_2D", r.recipe(), params={2: (0, [1, 2, 3]), 4: (2, [0, 2]), 6: (4, [1, 2])})


@gen("conv_2d_dw_direct", "CONV_2D_DW")
def _conv2d_dw(rng: random.Random) -> Case:
    r = R(rng)
    c = rng.randint(1, 4)
    a = r.leaf("f32", [rng.randint(1, 3), rng.randint(1, 3), 1, c])
    b = r.leaf("f32", [rng.randint(3, 9), rng.randint(3, 9), c, 1])
    r.op("conv_2d_dw_direct", a, b, 1, 1, rng.randint(0, 1), rng.randint(0, 1), 1, 1)
    return Case("CONV_2D_DW", r.recipe(), params={2: (0, [1, 2, 3]), 4: (2, [0, 2])})


@gen("conv_2d_dw_layouts", "CONV_2D_DW")
def _conv2d_dw_layouts(rng: random.Random) -> Case:
    """F32 and F16 weights, strides, paddings, dilations, batches, and the channels-first (CWHN)
    layout test-backend-ops builds (tests/test-backend-ops.cpp test_conv_2d_dw: the input and the
    weights made channel-contiguous, then permuted back)."""
    r = R(rng)
    c, n = rng.choice((1, 2, 3, 4, 8, 9)), rng.randint(1, 2)
    kw, kh = rng.randint(1, 3), rng.randint(1, 3)
    p0, p1, d0, d1 = rng.randint(0, 2), rng.randint(0, 2), rng.randint(1, 2), rng.randint(1, 2)
    a = r.leaf(rng.choice(("f32", "f16")), [kw, kh, 1, c])
    # at least one output position: a smaller input gives a negative ne (no tensor at all)
    w, h = rng.randint(max(1, d0 * (kw - 1) + 1 - 2 * p0), 11), rng.randint(max(1, d1 * (kh - 1) + 1 - 2 * p1), 11)
    b = r.leaf("f32", [w, h, c, n])
    if rng.random() < 0.5:
        b = r.op("permute", r.op("cont", r.op("permute", b, 1, 2, 0, 3)), 2, 0, 1, 3)
        a = r.op("permute", r.op("cont", r.op("permute", a, 2, 3, 1, 0)), 3, 2, 0, 1)
    r.op("conv_2d_dw_direct", a, b, rng.randint(1, 3), rng.randint(1, 3), p0, p1, d0, d1)
    return Case("CONV_2D_DW", r.recipe(), params={2: (0, [0, 1, 2, 3]), 4: (2, [0, 2, -1]), 6: (4, [0, 1, 2])})


@gen("conv_3d_direct", "CONV_3D")
def _conv3d(rng: random.Random) -> Case:
    r = R(rng)
    ic, oc, n = rng.randint(1, 2), rng.randint(1, 2), 1
    a = r.leaf("f32", [rng.randint(1, 2), rng.randint(1, 2), rng.randint(1, 2), ic * oc])
    b = r.leaf("f32", [rng.randint(2, 5), rng.randint(2, 5), rng.randint(2, 4), ic * n])
    r.op("conv_3d_direct", a, b, 1, 1, 1, 0, 0, 0, 1, 1, 1, ic, n, oc)
    return Case("CONV_3D", r.recipe(), params={2: (0, [1, 2])})


@gen("pool_1d", "POOL_1D")
def _pool1d(rng: random.Random) -> Case:
    r = R(rng)
    k = rng.randint(1, 3)
    r.op("pool_1d", r.leaf("f32", [rng.randint(k, 9), rng.randint(1, 3)]), rng.randrange(2), k, rng.randint(1, 2), 0)
    return Case("POOL_1D", r.recipe(), params={2: (1, [1, 2, 5]), 3: (2, [1, 3])})


@gen("pool_2d", "POOL_2D")
def _pool2d(rng: random.Random) -> Case:
    r = R(rng)
    k0, k1 = rng.randint(1, 3), rng.randint(1, 3)
    a = r.leaf("f32", [rng.randint(k0, 9), rng.randint(k1, 9), rng.randint(1, 3)])
    r.op("pool_2d", a, rng.randrange(2), k0, k1, rng.randint(1, 2), rng.randint(1, 2), 0.0, 0.0)
    return Case("POOL_2D", r.recipe(), params={2: (1, [1, 2, 5]), 4: (3, [1, 3])})


@gen("col2im_1d", "COL2IM_1D")
def _col2im(rng: random.Random) -> Case:
    r = R(rng)
    k, oc = rng.randint(1, 4), rng.randint(1, 3)
    r.op("col2im_1d", r.leaf("f32", [k * oc, rng.randint(1, 6)]), rng.randint(1, 3), oc, rng.randint(0, 1))
    return Case("COL2IM_1D", r.recipe(), params={1: (0, [1, 2, 5]), 2: (1, [1, 2, 3])})


# -- recurrent / state-space ------------------------------------------------------------------


@gen("ssm_conv", "SSM_CONV")
def _ssm_conv(rng: random.Random) -> Case:
    r = R(rng)
    d_conv, d_inner, n_t, n_s = rng.randint(2, 4), rng.randint(1, 8), rng.randint(1, 5), rng.randint(1, 2)
    r.op("ssm_conv", r.leaf("f32", [d_conv - 1 + n_t, d_inner, n_s]), r.leaf("f32", [d_conv, d_inner]))
    return Case("SSM_CONV", r.recipe())


@gen("win_part", "WIN_PART")
def _win_part(rng: random.Random) -> Case:
    r = R(rng)
    r.op("win_part", r.leaf("f32", [rng.randint(1, 4), rng.randint(1, 9), rng.randint(1, 9)]), rng.randint(1, 4))
    return Case("WIN_PART", r.recipe(), params={1: (2, [1, 2, 7])})


@gen("win_unpart", "WIN_UNPART")
def _win_unpart(rng: random.Random) -> Case:
    r = R(rng)
    w = rng.randint(1, 3)
    a = r.leaf("f32", [rng.randint(1, 4), w, w, rng.randint(1, 6)])
    r.op("win_unpart", a, rng.randint(1, 6), rng.randint(1, 6), w)
    return Case("WIN_UNPART", r.recipe(), params={3: (0, [1, 2, 5])},
                dst_args=lambda ne_, nb_: [KEEP, ne_[1], ne_[2], KEEP])


@gen("get_rel_pos", "GET_REL_POS")
def _get_rel_pos(rng: random.Random) -> Case:
    r = R(rng)
    q = rng.randint(1, 5)
    r.op("get_rel_pos", r.leaf("f16", [rng.randint(1, 4), 2 * q - 1]), q, q)
    return Case("GET_REL_POS", r.recipe())


@gen("rwkv_wkv6", "RWKV_WKV6")
def _wkv6(rng: random.Random) -> Case:
    r = R(rng)
    s, h, t, n = rng.choice((1, 4)), rng.randint(1, 2), rng.randint(1, 4), 1
    k, v, rr = (r.leaf("f32", [s, h, t]) for _ in range(3))
    tf = r.leaf("f32", [s, h])
    td = r.leaf("f32", [s, h, t])
    st = r.leaf("f32", [s * s * h, n])
    r.op("rwkv_wkv6", k, v, rr, tf, td, st)
    return Case("RWKV_WKV6", r.recipe())


@gen("gated_linear_attn", "GATED_LINEAR_ATTN")
def _gla(rng: random.Random) -> Case:
    r = R(rng)
    s, h, t = rng.choice((1, 4)), rng.randint(1, 2), rng.randint(1, 4)
    k, v, q, g = (r.leaf("f32", [s, h, t]) for _ in range(4))
    r.op("gated_linear_attn", k, v, q, g, r.leaf("f32", [s * s * h, 1]), 0.5)
    return Case("GATED_LINEAR_ATTN", r.recipe())


@gen("rwkv_wkv7", "RWKV_WKV7")
def _wkv7(rng: random.Random) -> Case:
    r = R(rng)
    # 64: RWKV-7's head size; the kernel needs a multiple of its SIMD step (oprules WKV7_HEAD_MULTIPLE)
    s, h, t = rng.choice((1, 4, 64)), rng.randint(1, 2), rng.randint(1, 4)
    xs = [r.leaf("f32", [s, h, t]) for _ in range(6)]
    r.op("rwkv_wkv7", *xs, r.leaf("f32", [s * s * h, 1]))
    return Case("RWKV_WKV7", r.recipe())


@gen("solve_tri", "SOLVE_TRI")
def _solve_tri(rng: random.Random) -> Case:
    r = R(rng)
    n = rng.randint(1, 6)
    r.op("solve_tri", r.leaf("f32", [n, n, 2]), r.leaf("f32", [rng.randint(1, 4), n, 2]), True, True, False)
    return Case("SOLVE_TRI", r.recipe())


# -- training ---------------------------------------------------------------------------------


@gen("cross_entropy_loss", "CROSS_ENTROPY_LOSS")
def _cel(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng, 2)
    r.op("cross_entropy_loss", r.leaf("f32", ne), r.leaf("f32", ne))
    return Case("CROSS_ENTROPY_LOSS", r.recipe())


@gen("cross_entropy_loss_back", "CROSS_ENTROPY_LOSS_BACK")
def _celb(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng, 2)
    r.op("cross_entropy_loss_back", r.leaf("f32", [1]), r.leaf("f32", ne), r.leaf("f32", ne))
    return Case("CROSS_ENTROPY_LOSS_BACK", r.recipe())


@gen("opt_step_adamw", "OPT_STEP_ADAMW")
def _adamw(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    xs = [r.leaf("f32", ne, param=i == 0) for i in range(4)]
    r.op("opt_step_adamw", *xs, r.leaf("f32", [7]))
    return Case("OPT_STEP_ADAMW", r.recipe())


@gen("opt_step_sgd", "OPT_STEP_SGD")
def _sgd(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    r.op("opt_step_sgd", r.leaf("f32", ne, param=True), r.leaf("f32", ne), r.leaf("f32", [2]))
    return Case("OPT_STEP_SGD", r.recipe())


# -- less common ops --------------------------------------------------------------------------


@gen("im2col_back", "IM2COL_BACK")
def _im2col_back(rng: random.Random) -> Case:
    """The gradient of im2col(kernel, image) (1D or 2D, strides, paddings and dilations of 1-2):
    ggml_im2col_back(ctx, a = the gradient, b = the kernel, ne = the image's shape, ...), as the
    backward pass calls it (ggml.c:7141)."""
    r = R(rng)
    two_d = rng.random() < 0.5
    kw, kh, ic, n = rng.randint(1, 3), rng.randint(1, 3) if two_d else 1, rng.randint(1, 3), rng.randint(1, 2)
    s0, s1, p0, p1, d0, d1 = (rng.randint(1, 2) for _ in range(6))
    iw, ih = rng.randint(d0 * (kw - 1) + 1, 9), rng.randint(d1 * (kh - 1) + 1, 7) if two_d else 1
    ow = (iw + 2 * p0 - d0 * (kw - 1) - 1) // s0 + 1
    oh = (ih + 2 * p1 - d1 * (kh - 1) - 1) // s1 + 1
    if two_d:
        kernel, grad = r.leaf("f16", [kw, kh, ic, 2]), r.leaf("f32", [ic * kh * kw, ow, oh, n])
        ne = [iw, ih, ic, n]
    else:
        kernel, grad = r.leaf("f16", [kw, ic, 2]), r.leaf("f32", [ic * kw, ow, n])
        ne = [iw, ic, n, 1]
    r.op("im2col_back", grad, kernel, ne, s0, s1, p0, p1, d0, d1, two_d)
    return Case("IM2COL_BACK", r.recipe(), params={3: (0, [1, 2])}, dst_args=lambda ne_, nb_: [KEEP, KEEP, list(ne_)] + [KEEP] * 7)


@gen("im2col_3d", "IM2COL_3D")
def _im2col_3d(rng: random.Random) -> Case:
    r = R(rng)
    ic, oc, n = rng.randint(1, 2), rng.randint(1, 2), rng.randint(1, 2)
    a = r.leaf("f16", [rng.randint(1, 2), rng.randint(1, 2), rng.randint(1, 2), ic * oc])
    b = r.leaf("f32", [rng.randint(2, 5), rng.randint(2, 5), rng.randint(2, 4), ic * n])
    r.op("im2col_3d", a, b, ic, 1, 1, 1, 0, 0, 0, 1, 1, 1, rng.choice((0, 1)))
    return Case("IM2COL_3D", r.recipe(), params={3: (0, [1, 2, 3])}, type_arg=12)


@gen("pool_2d_back", "POOL_2D_BACK")
def _pool_2d_back(rng: random.Random) -> Case:
    """The gradient of pool_2d(af) (AVG or MAX, windows, strides and paddings of 1-3)."""
    r = R(rng)
    k0, k1 = rng.randint(1, 3), rng.randint(1, 3)
    s0, s1 = rng.randint(1, 3), rng.randint(1, 3)
    p0, p1 = rng.randint(0, k0 // 2), rng.randint(0, k1 // 2)
    w, h, c = rng.randint(k0, 8), rng.randint(k1, 8), rng.randint(1, 3)
    af = r.leaf("f32", [w, h, c])
    a = r.leaf("f32", [(w + 2 * p0 - k0) // s0 + 1, (h + 2 * p1 - k1) // s1 + 1, c])
    r.op("pool_2d_back", a, af, rng.randrange(2), k0, k1, s0, s1, float(p0), float(p1))
    return Case("POOL_2D_BACK", r.recipe(), params={3: (1, [1, 2, 4])})


@gen("flash_attn_back", "FLASH_ATTN_BACK")
def _fa_back(rng: random.Random) -> Case:
    r = R(rng)
    d, n, m, h = rng.choice((4, 8)), rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 2)
    q = r.leaf("f32", [d, n, h, 1])
    k = r.leaf("f32", [d, m, h, 1])
    v = r.leaf("f32", [m, d, h, 1])
    r.op("flash_attn_back", q, k, v, r.leaf("f32", [d, n, h, 1]), rng.random() < 0.5)
    return Case("FLASH_ATTN_BACK", r.recipe())


@gen("ssm_scan", "SSM_SCAN")
def _ssm_scan(rng: random.Random) -> Case:
    r = R(rng)
    ds, hd, nh, t, s = rng.choice((4, 16)), rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 2)
    st = r.leaf("f32", [ds, hd, nh, s])
    x = r.leaf("f32", [hd, nh, t, s])
    dt = r.leaf("f32", [nh, t, s])
    a = r.leaf("f32", [rng.choice((1, ds)), nh])
    b = r.leaf("f32", [ds, 1, t, s])
    c = r.leaf("f32", [ds, 1, t, s])
    r.op("ssm_scan", st, x, dt, a, b, c, r.leaf("i32", [s]), 1)
    return Case("SSM_SCAN", r.recipe(), params={7: (0, [2, 4])})


@gen("add_rel_pos", "ADD_REL_POS")
def _add_rel_pos(rng: random.Random) -> Case:
    r = R(rng)
    w, h, c = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 3)
    a = r.leaf("f32", [w * w, w * h, c])
    r.op("add_rel_pos", a, r.leaf("f32", [w, w, h, c]), r.leaf("f32", [w, w, h, c]))
    return Case("ADD_REL_POS", r.recipe())


@gen("gated_delta_net", "GATED_DELTA_NET")
def _gdn(rng: random.Random) -> Case:
    r = R(rng)
    sv, h, t, s = rng.choice((2, 4, 8)), rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 2)
    q, k, v = (r.leaf("f32", [sv, h, t, s]) for _ in range(3))
    g = r.leaf("f32", [rng.choice((1, sv)), h, t, s])
    beta = r.leaf("f32", [1, h, t, s])
    r.op("gated_delta_net", q, k, v, g, beta, r.leaf("f32", [sv, sv, h, s]), rng.randint(1, 2))
    return Case("GATED_DELTA_NET", r.recipe(), params={6: (0, [1, 3, 64])})


@gen("lightning_indexer", "LIGHTNING_INDEXER")
def _lightning(rng: random.Random) -> Case:
    r = R(rng)
    d, nh, nq, nkv, b = rng.choice((4, 8)), rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 9), rng.randint(1, 2)
    q = r.leaf("f32", [d, nh, nq, b])
    k = r.leaf(rng.choice(("f32", "f16")), [d, 1, nkv, b])
    w = r.leaf("f32", [nh, nq, 1, b])
    r.op("lightning_indexer", q, k, w, r.leaf("f16", [nkv, nq, 1, rng.choice((1, b))]))
    return Case("LIGHTNING_INDEXER", r.recipe())


@gen("dsv4_hc_comb", "DSV4_HC_COMB")
def _hc_comb(rng: random.Random) -> Case:
    r = R(rng)
    n = rng.randint(1, 5)
    mix = 24  # hc * (hc + 2) with hc == 4 (the only value the constructor takes)
    r.op("dsv4_hc_comb", r.leaf("f32", [mix, n]), r.leaf("f32", [rng.randint(3, 4)]), r.leaf("f32", [mix]),
         1e-6, rng.randint(1, 5))  # fmt: skip
    return Case("DSV4_HC_COMB", r.recipe(), params={4: (1, [1, 7])})  # n_iter: op_params[1] (ggml.c:6507)


@gen("dsv4_hc_pre", "DSV4_HC_PRE")
def _hc_pre(rng: random.Random) -> Case:
    r = R(rng)
    e, hc, n = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 4)
    w = r.leaf("f32", [hc, n]) if rng.random() < 0.5 else r.leaf("f32", [e, hc, n])
    r.op("dsv4_hc_pre", r.leaf("f32", [e, hc, n]), w)
    return Case("DSV4_HC_PRE", r.recipe())


@gen("dsv4_hc_post", "DSV4_HC_POST")
def _hc_post(rng: random.Random) -> Case:
    r = R(rng)
    e, hc, n = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 4)
    x = r.leaf("f32", [e, n])
    res = r.leaf("f32", [e, hc, n])
    post = r.leaf("f32", [hc, n])
    r.op("dsv4_hc_post", x, res, post, r.leaf("f32", [hc, hc, n]))
    return Case("DSV4_HC_POST", r.recipe())


@gen("rope_multi_back", "ROPE_BACK")
def _rope_multi_back(rng: random.Random) -> Case:
    r = R(rng)
    n_tok = rng.choice((1, 3))
    a = r.leaf("f32", [16, rng.choice((1, 2)), n_tok])
    r.op("rope_multi_back", a, r.leaf("i32", [4 * n_tok]), None, 8, [2, 1, 1, 0], 8, 4096, 10000.0, 1.0, 0.0, 1.0,
         32.0, 1.0)  # fmt: skip
    return Case("ROPE_BACK", r.recipe(), nullable={2: 2})


@gen("conv_1d_dw_composite", "RESHAPE")
def _conv1d_dw(rng: random.Random) -> Case:
    """ggml_conv_1d_dw builds reshape -> im2col -> mul_mat -> reshape: a multi-node recipe."""
    r = R(rng)
    c, k = rng.randint(1, 3), rng.randint(1, 3)
    a = r.leaf("f16", [k, 1, c])
    b = r.leaf("f32", [rng.randint(k, 9), c, 1])
    r.op("conv_1d_dw", a, b, 1, 0, 1)
    return Case("RESHAPE", r.recipe())
