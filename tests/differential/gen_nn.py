"""Generators: matrix products, rows, attention, GLU, sort/pad/misc, a whole llama block (see cases.py)."""

from __future__ import annotations

import random

from tests.differential.cases import BLCK, FLOAT, KEEP, QUANT, R, TSIZE, Case, gen, rand_ne, rand_row


# -- matrix products --------------------------------------------------------------------------


@gen("mul_mat", "MUL_MAT")
def _mul_mat(rng: random.Random) -> Case:
    r = R(rng)
    ta = rng.choice(FLOAT + QUANT)
    k = rand_row(rng, ta)
    m = rng.choice((1, 2, 3, 7, 8, 16))
    n = rng.choice((1, 1, 2, 5, 8, 32))
    a2, a3 = rng.choice((1, 2)), rng.choice((1, 2))
    b2, b3 = a2 * rng.choice((1, 2, 3)), a3 * rng.choice((1, 2))
    a = r.inp(ta, [k, m, a2, a3], 0.15 if BLCK[ta] == 1 else 0.0)
    b = r.inp(rng.choice(("f32", "f32", "f16")), [k, n, b2, b3], 0.3)
    r.op("mul_mat", a, b)
    return Case("MUL_MAT", r.recipe())


@gen("mul_mat_id", "MUL_MAT_ID")
def _mul_mat_id(rng: random.Random) -> Case:
    r = R(rng)
    ta = rng.choice(FLOAT + QUANT)
    k, m, n_as = rand_row(rng, ta), rng.choice((1, 4, 8)), rng.randint(1, 8)
    n_used, n_tok = rng.randint(1, n_as), rng.randint(1, 6)
    as_ = r.leaf(ta, [k, m, n_as])
    b = r.inp("f32", [k, rng.choice((1, n_used)), n_tok], 0.2)
    ids = r.leaf("i32", [n_used, n_tok])
    r.op("mul_mat_id", as_, b, ids)
    return Case("MUL_MAT_ID", r.recipe())


@gen("out_prod", "OUT_PROD")
def _out_prod(rng: random.Random) -> Case:
    r = R(rng)
    k = rng.randint(1, 6)
    a = r.leaf(rng.choice(("f32", "f16", "q8_0")), [32, k, 2, 1])
    r.op("out_prod", a, r.leaf("f32", [rng.randint(1, 7), k, 2 * rng.randint(1, 2), 1]))
    return Case("OUT_PROD", r.recipe())


# -- rows -------------------------------------------------------------------------------------


@gen("get_rows", "GET_ROWS")
def _get_rows(rng: random.Random) -> Case:
    r = R(rng)
    ta = rng.choice(FLOAT + QUANT + ("i32",))
    ne0 = rand_row(rng, ta)
    n_rows, b1, b2 = rng.randint(1, 9), rng.randint(1, 3), rng.randint(1, 2)
    a = r.leaf(ta, [ne0, n_rows, b1, b2])
    r.op("get_rows", a, r.leaf("i32", [rng.randint(1, 7), b1, b2]))
    return Case("GET_ROWS", r.recipe())


@gen("get_rows_back", "GET_ROWS_BACK")
def _get_rows_back(rng: random.Random) -> Case:
    r = R(rng)
    ne0, n = rng.randint(1, 9), rng.randint(1, 5)
    r.op("get_rows_back", r.leaf("f32", [ne0, n]), r.leaf("i32", [n]), r.leaf("f32", [ne0, rng.randint(1, 9)]))
    return Case("GET_ROWS_BACK", r.recipe())


@gen("set_rows", "SET_ROWS")
def _set_rows(rng: random.Random) -> Case:
    r = R(rng)
    ta = rng.choice(("f32", "f16", "bf16", "q8_0", "q4_0"))
    ne0 = rand_row(rng, ta) if BLCK[ta] == 1 else BLCK[ta] * rng.randint(1, 3)
    n_rows, n2, n3 = rng.randint(1, 9), rng.randint(1, 3), rng.randint(1, 2)
    a = r.leaf(ta, [ne0, rng.randint(n_rows, n_rows + 5), n2, n3])
    k = rng.randint(1, n_rows)
    b = r.inp(rng.choice(("f32", "f16")), [ne0, k, n2, n3], 0.2)
    c = r.leaf(rng.choice(("i64", "i32")), [k, rng.choice([d for d in (1, n2) if n2 % d == 0]), 1])
    r.op("set_rows", a, b, c)
    return Case("SET_ROWS", r.recipe())


@gen("diag_mask_inf", "DIAG_MASK_INF")
def _dmi(rng: random.Random) -> Case:
    r = R(rng)
    r.op("diag_mask_inf", r.leaf("f32", rand_ne(rng)), rng.randint(0, 5))
    return Case("DIAG_MASK_INF", r.recipe(), params={1: (0, [0, 3, 100])})


@gen("diag_mask_zero", "DIAG_MASK_ZERO")
def _dmz(rng: random.Random) -> Case:
    r = R(rng)
    r.op("diag_mask_zero", r.leaf("f32", rand_ne(rng)), rng.randint(0, 5))
    return Case("DIAG_MASK_ZERO", r.recipe(), params={1: (0, [0, 3, 100])})


# -- attention --------------------------------------------------------------------------------


@gen("soft_max_ext", "SOFT_MAX")
def _soft_max_ext(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    ne[0] = rng.choice((1, 3, 8, 32, 33))
    a = r.inp("f32", ne, 0.2)
    mask = None
    if rng.random() < 0.7:
        m2 = rng.choice([d for d in range(1, ne[2] + 1) if ne[2] % d == 0])
        mask = r.leaf(rng.choice(("f32", "f16")), [ne[0], ne[1] + rng.choice((0, 0, 3)), m2, 1])
    r.op("soft_max_ext", a, mask, 0.125, rng.choice((0.0, 8.0)))
    return Case("SOFT_MAX", r.recipe(), nullable={1: 1})


@gen("soft_max_ext_back", "SOFT_MAX_BACK")
def _soft_max_back(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    r.op("soft_max_ext_back", r.leaf("f32", ne), r.leaf("f32", ne), 1.0, 0.0)
    return Case("SOFT_MAX_BACK", r.recipe())


def _ff_room(rng: random.Random, ne0: int, n_ff: int) -> int:
    """Bytes of buffer after ``n_ff`` freq factors: the kernel reads ceil(ne0/2) of them
    (ggml_rope_cache_init, ops.cpp:6209-6210), past the tensor when n_dims < ne0. None (flush
    against the buffer's end), one float short, exactly enough, plenty."""
    need = max(0, (ne0 + 1) // 2 - n_ff) * 4
    return rng.choice((0, max(0, need - 4), need, need, need + 64))


def _rope_case(rng: random.Random, back: bool = False) -> Case:
    r = R(rng)
    head = rng.choice((2, 4, 8, 64, 128, 5, 7))  # odd: the unrotated copy ends one element past every row
    n_head, n_tok = rng.choice((1, 2, 3, 8)), rng.choice((1, 2, 5, 7))
    a = r.inp(rng.choice(("f32", "f16")) if not back else "f32", [head, n_head, n_tok, 1], 0.2)
    pos = r.leaf("i32", [n_tok])
    n_dims = rng.choice([d for d in (2, 4, head // 2, head) if d <= head and d % 2 == 0])
    mode = rng.choice((0, 2))
    ff = r.leaf("f32", [n_dims // 2], room=_ff_room(rng, head, n_dims // 2)) if rng.random() < 0.3 else None
    r.op("rope_ext_back" if back else "rope_ext", a, pos, ff, n_dims, mode, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    return Case("ROPE_BACK" if back else "ROPE", r.recipe(), nullable={2: 2},
                params={3: (1, [2, head, head + 2, 0]), 4: (2, [0, 2, 8, 24, 40]), 5: (4, [0, 1 << 20])})


def _rope_ff_case(rng: random.Random, back: bool = False) -> Case:
    """Freq factors of exactly n_dims/2 (what test-backend-ops passes) in every mode: partial
    rotation and vision (n_dims == ne0/2) read past them, inside their buffer or not (_ff_room)."""
    r = R(rng)
    mode = rng.choice((0, 2, 8, 24, 40))
    head = rng.choice((8, 16, 64, 80, 128))
    n_head, n_tok = rng.choice((1, 2, 3)), rng.choice((1, 2, 5))
    a = r.inp(rng.choice(("f32", "f16")) if not back else "f32", [head, n_head, n_tok, 1], 0.2)
    pos = r.leaf("i32", [n_tok * (4 if mode & 8 else 1)])
    n_dims = head // 2 if mode == 24 else rng.choice((head, head // 2, head // 4 * 2, 2))
    ff = r.leaf("f32", [n_dims // 2], room=_ff_room(rng, head, n_dims // 2))
    tail = (4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    if mode & 8:
        secs = [n_dims // 2, n_dims // 2, 0, 0] if mode == 24 else [max(1, n_dims // 3)] * 3 + [0]
        r.op("rope_multi_back" if back else "rope_multi", a, pos, ff, n_dims, secs, mode, *tail)
        return Case("ROPE_BACK" if back else "ROPE", r.recipe(), nullable={2: 2}, params={3: (1, [2, head, 0])})
    r.op("rope_ext_back" if back else "rope_ext", a, pos, ff, n_dims, mode, *tail)
    return Case("ROPE_BACK" if back else "ROPE", r.recipe(), nullable={2: 2}, params={3: (1, [2, head, 0])})


gen("rope_ext", "ROPE")(lambda rng: _rope_case(rng))
gen("rope_ext_back", "ROPE_BACK")(lambda rng: _rope_case(rng, True))
gen("rope_ff", "ROPE")(lambda rng: _rope_ff_case(rng))
gen("rope_ff_back", "ROPE_BACK")(lambda rng: _rope_ff_case(rng, True))


@gen("rope_multi", "ROPE")
def _rope_multi(rng: random.Random) -> Case:
    r = R(rng)
    head, n_head, n_tok = 16, rng.choice((1, 2)), rng.choice((1, 3))
    a = r.leaf("f32", [head, n_head, n_tok])
    pos = r.leaf("i32", [4 * n_tok])
    r.op("rope_multi", a, pos, None, 8, [2, 1, 1, 0], 8, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    return Case("ROPE", r.recipe(), nullable={2: 2})


@gen("flash_attn_ext", "FLASH_ATTN_EXT")
def _fa(rng: random.Random) -> Case:
    r = R(rng)
    d, dv = rng.choice((32, 64, 128)), None
    dv = d if rng.random() < 0.8 else rng.choice((32, 64))
    n_q, n_kv = rng.choice((1, 2, 7)), rng.choice((16, 32, 256))
    h_kv = rng.choice((1, 2))
    h = h_kv * rng.choice((1, 2, 4))
    kt = rng.choice(("f16", "f16", "f32", "q8_0"))
    q = r.inp("f32", [d, n_q, h, 1], 0.3)
    k = r.inp(kt, [d, n_kv, h_kv, 1], 0.3)
    v = r.inp(kt, [dv, n_kv, h_kv, 1], 0.3)
    mask = r.leaf("f16", [n_kv, n_q + rng.choice((0, 1)), 1, 1]) if rng.random() < 0.8 else None
    r.op("flash_attn_ext", q, k, v, mask, 0.125, 0.0, rng.choice((0.0, 30.0)))
    return Case("FLASH_ATTN_EXT", r.recipe(), nullable={3: 3})


# -- glu --------------------------------------------------------------------------------------


@gen("glu", "GLU")
def _glu(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    ne[0] = 2 * rng.randint(1, 16)
    r.op("glu", r.inp(rng.choice(("f32", "f16")), ne, 0.2), rng.randrange(0, 6), rng.random() < 0.5)
    return Case("GLU", r.recipe(), params={1: (0, [0, 2, 5]), 2: (1, [0, 1])})


@gen("swiglu_split", "GLU")
def _glu_split(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    fn = rng.choice(("swiglu_split", "geglu_split", "reglu_split"))
    r.op(fn, r.inp("f32", ne, 0.2), r.inp("f32", ne, 0.2))
    return Case("GLU", r.recipe())


@gen("swiglu_oai", "GLU")
def _swiglu_oai(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    r.op("swiglu_oai", r.leaf("f32", ne), r.leaf("f32", ne), 1.702, 7.0)
    return Case("GLU", r.recipe())


# -- sort, pad, misc --------------------------------------------------------------------------


@gen("argsort", "ARGSORT")
def _argsort(rng: random.Random) -> Case:
    r = R(rng)
    r.op("argsort", r.inp("f32", rand_ne(rng), 0.2), rng.randrange(2))
    return Case("ARGSORT", r.recipe(), params={1: (0, [0, 1])})


@gen("top_k", "TOP_K")
def _top_k(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    ne[0] = rng.randint(1, 40)
    r.op("top_k", r.inp("f32", ne, 0.2), rng.randint(1, ne[0]))
    return Case("TOP_K", r.recipe(), dst_args=lambda ne_, nb_: [KEEP, ne_[0]])


@gen("pad", "PAD")
def _pad(rng: random.Random) -> Case:
    r = R(rng)
    p = [rng.choice((0, 0, 1, 3)) for _ in range(4)]
    r.op("pad", r.inp("f32", rand_ne(rng), 0.2), *p)
    return Case("PAD", r.recipe(), params={1: (1, [0, 5]), 2: (3, [0, 5])})


@gen("pad_ext", "PAD")
def _pad_ext(rng: random.Random) -> Case:
    r = R(rng)
    p = [rng.choice((0, 0, 1, 2)) for _ in range(8)]
    r.op("pad_ext", r.leaf("f32", rand_ne(rng)), *p)
    return Case("PAD", r.recipe(), params={1: (0, [0, 4]), 2: (1, [0, 4]), 8: (7, [0, 4])})


@gen("pad_reflect_1d", "PAD_REFLECT_1D")
def _pad_reflect(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    ne[0] = rng.randint(2, 9)
    r.op("pad_reflect_1d", r.leaf("f32", ne), rng.randint(0, ne[0] - 1), rng.randint(0, ne[0] - 1))
    return Case("PAD_REFLECT_1D", r.recipe(), params={1: (0, [0, 1, 8, -1]), 2: (1, [0, 2, 9, -1])})


@gen("roll", "ROLL")
def _roll(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    r.op("roll", r.leaf("f32", ne), *[rng.randint(-n + 1, n - 1) for n in ne])
    return Case("ROLL", r.recipe(), params={1: (0, [0, 1, 100, -100])})


@gen("arange", "ARANGE")
def _arange(rng: random.Random) -> Case:
    r = R(rng)
    start = float(rng.randint(-5, 5))
    r.op("arange", start, start + rng.randint(1, 20), float(rng.choice((1, 2, 3))))
    return Case("ARANGE", r.recipe())


@gen("timestep_embedding", "TIMESTEP_EMBEDDING")
def _tsemb(rng: random.Random) -> Case:
    r = R(rng)
    r.op("timestep_embedding", r.leaf("f32", [rng.randint(1, 6)]), rng.choice((4, 7, 16, 32)), 10000)
    return Case("TIMESTEP_EMBEDDING", r.recipe(), params={1: (0, [2, 8, 64, 1 << 16])})


@gen("tri", "TRI")
def _tri(rng: random.Random) -> Case:
    r = R(rng)
    n = rng.randint(1, 8)
    r.op("tri", r.leaf("f32", [n, n, rng.randint(1, 3)]), rng.randrange(4))
    return Case("TRI", r.recipe(), params={1: (0, [0, 3])})


@gen("upscale", "UPSCALE")
def _upscale(rng: random.Random) -> Case:
    r = R(rng)
    ne = rand_ne(rng)
    r.op("interpolate", r.leaf("f32", ne), *[n * rng.choice((1, 2, 3)) for n in ne], rng.choice((0, 1)))
    return Case("UPSCALE", r.recipe(), params={5: (0, [0, 1, 2])}, dst_args=lambda ne_, nb_: [KEEP, *ne_, KEEP])


@gen("interpolate_modes", "UPSCALE")
def _interpolate_modes(rng: random.Random) -> Case:
    """Every mode and flag ggml_interpolate takes (ggml.h:2314 ggml_scale_mode, 2322 ggml_scale_flag):
    down- and non-integer scales, align-corners, bilinear antialias, a non-contiguous source."""
    r = R(rng)
    ne = rand_ne(rng)
    mode = rng.choice((0, 1, 2)) | rng.choice((0, 0x100))
    if mode & 0xFF == 1 and rng.random() < 0.4:
        mode |= 0x200
    tgt = [max(1, n * rng.choice((1, 2, 3)) // rng.choice((1, 2, 3))) for n in ne]
    r.op("interpolate", r.inp("f32", ne, noncontig=0.4), *tgt, mode)
    return Case("UPSCALE", r.recipe(), params={5: (0, [0, 2, 3, 0x102, 0x200, 0x301, 0x400])},
                dst_args=lambda ne_, nb_: [KEEP, *ne_, KEEP])



# -- a whole transformer block, as llama.cpp builds it -----------------------------------------


@gen("llama_block", "ADD")
def _llama_block(rng: random.Random) -> Case:
    """One llama layer: norm, Q/K/V, RoPE, KV-cache SET_ROWS, cache views, attention (plain or
    flash), output projection, SwiGLU FFN, residuals. Its last node is the residual ADD."""
    r = R(rng)
    wt = rng.choice(("f32", "f16", "q8_0", "q4_0", "q4_K", "q6_K"))
    e = 256 if BLCK[wt] == 256 else 64
    d = rng.choice((16, 32))
    h = e // d
    hkv = rng.choice([x for x in (1, 2, h) if h % x == 0])
    t, kv = rng.choice((1, 1, 3, 7)), 64
    n_kv = rng.choice((32, 64))
    f = 2 * e
    x = r.leaf("f32", [e, t])
    attn_norm, ffn_norm = r.leaf("f32", [e]), r.leaf("f32", [e])
    wq, wk, wv, wo = r.leaf(wt, [e, e]), r.leaf(wt, [e, hkv * d]), r.leaf(wt, [e, hkv * d]), r.leaf(wt, [e, e])
    wg, wu, wd = r.leaf(wt, [e, f]), r.leaf(wt, [e, f]), r.leaf(wt, [f, e]) if BLCK[wt] <= f else r.leaf("f16", [f, e])
    pos = r.leaf("i32", [t])
    r.op("set_input", x)
    r.op("set_input", pos)
    ct = rng.choice(("f16", "f32", "q8_0")) if d % 32 == 0 else "f16"
    kc, vc = r.leaf(ct, [hkv * d, kv]), r.leaf(ct, [hkv * d, kv])
    idx = r.leaf(rng.choice(("i64", "i32")), [t])
    flash = rng.random() < 0.5
    mask = r.leaf("f16", [n_kv, t if not flash else -(-t // 64) * 64])
    r.op("set_input", idx)
    r.op("set_input", mask)
    cur = r.op("mul", r.op("rms_norm", x, 1e-6), attn_norm)
    q = r.op("reshape_3d", r.op("mul_mat", wq, cur), d, h, t)
    k = r.op("reshape_3d", r.op("mul_mat", wk, cur), d, hkv, t)
    v = r.op("mul_mat", wv, cur)
    rope = (10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    q = r.op("rope_ext", q, pos, None, d, rng.choice((0, 2)), 4096, *rope)
    k = r.op("rope_ext", k, pos, None, d, 0, 4096, *rope)
    sk = r.op("set_rows", kc, r.op("reshape_2d", k, d * hkv, t), idx)
    sv = r.op("set_rows", vc, v, idx)
    row = TSIZE[ct] * d // BLCK[ct]
    kview = r.op("view_3d", kc, d, hkv, n_kv, row, row * hkv, 0)
    vview = r.op("view_3d", vc, d, hkv, n_kv, row, row * hkv, 0)
    qp = r.op("permute", q, 0, 2, 1, 3)
    kp = r.op("permute", kview, 0, 2, 1, 3)
    if flash:
        vp = r.op("permute", vview, 0, 2, 1, 3)
        att = r.op("reshape_2d", r.op("flash_attn_ext", qp, kp, vp, mask, 0.125, 0.0, 0.0), e, t)
    else:
        kq = r.op("soft_max_ext", r.op("mul_mat", kp, qp), mask, 0.125, 0.0)
        vt = r.op("cont", r.op("permute", vview, 1, 2, 0, 3))
        kqv = r.op("permute", r.op("mul_mat", vt, kq), 0, 2, 1, 3)
        att = r.op("cont_2d", kqv, e, t)
    cur = r.op("add", r.op("mul_mat", wo, att), x)
    n = r.op("mul", r.op("rms_norm", cur, 1e-6), ffn_norm)
    ff = r.op("swiglu_split", r.op("mul_mat", wg, n), r.op("mul_mat", wu, n))
    out = r.op("add", r.op("mul_mat", wd, ff), cur)
    if rng.random() < 0.5:
        r.op("set_output", out)  # the target is still the ADD node, now with the OUTPUT flag
    recipe = r.recipe(outputs=[sk, sv, out])
    if rng.random() < 0.4:
        recipe["first_node"] = rng.randint(1, 20)  # a later split: earlier nodes arrive as sources
    return Case("ADD", recipe)


# -- nodes changed after their constructor, as llama.cpp does ------------------------------------

PREC = [0, 10, 15, 20]  # enum ggml_prec: UNDEFINED, F32, BF16, F16 (ggml.h:443-451)


@gen("mul_mat_prec", "MUL_MAT")
def _mul_mat_prec(rng: random.Random) -> Case:
    """ggml_prec_set_acc (llama-graph.cpp), ggml_prec_set_src (llama-model.cpp), ggml_mul_mat_set_hint."""
    r = R(rng)
    ta = rng.choice(("f16", "q8_0", "q4_0"))
    k = rand_row(rng, ta)
    mm = r.op("mul_mat", r.leaf(ta, [k, rng.randint(1, 8)]), r.inp("f32", [k, rng.randint(1, 5)], 0.2))
    which = rng.randrange(3)
    if which == 0:
        r.op("prec_set_acc", mm, 10)
        return Case("MUL_MAT", r.recipe(), params={1: (0, PREC)})
    if which == 1:
        r.op("prec_set_src", mm, rng.choice((10, 30, 40)), 1)
        return Case("MUL_MAT", r.recipe(), params={1: (3, PREC + [30, 40])})
    r.op("mul_mat_set_hint", mm, 1)
    return Case("MUL_MAT", r.recipe(), params={1: (1, [0, 1, 2])})


@gen("rope_offset", "ROPE")
def _rope_offset(rng: random.Random) -> Case:
    """ggml_rope_set_offset: partial RoPE after n_offs unrotated values (deepseek2, minicpm3, plm)."""
    r = R(rng)
    head, n_tok = rng.choice((16, 24, 64)), rng.randint(1, 5)
    n_dims = rng.choice((8, head // 2))
    a = r.leaf("f32", [head, rng.randint(1, 4), n_tok])
    rope = r.op("rope_ext", a, r.leaf("i32", [n_tok]), None, n_dims, rng.choice((0, 2)), 4096, 10000.0, 1.0, 0.0,
                1.0, 32.0, 1.0)  # fmt: skip
    r.op("rope_set_offset", rope, rng.randint(0, head - n_dims))
    return Case("ROPE", r.recipe(), params={1: (15, [0, head - n_dims, head - n_dims + 2, head])})


@gen("flash_attn_ext_sinks", "FLASH_ATTN_EXT")
def _fa_modified(rng: random.Random) -> Case:
    """ggml_flash_attn_ext_add_sinks (gpt-oss), _set_n_kv_max, ggml_prec_set_acc (llama-graph.cpp)."""
    r = R(rng)
    d, n_q, n_kv, h = rng.choice((32, 64)), rng.choice((1, 3)), rng.choice((32, 64)), rng.choice((1, 2, 4))
    q = r.leaf("f32", [d, n_q, h])
    k, v = r.leaf("f16", [d, n_kv, h]), r.leaf("f16", [d, n_kv, h])
    sinks = r.leaf("f32", [h])
    fa = r.op("flash_attn_ext", q, k, v, r.leaf("f16", [n_kv, 64]), 0.125, 0.0, 0.0)
    which = rng.randrange(3)
    if which == 0:
        r.op("flash_attn_ext_add_sinks", fa, sinks)
        return Case("FLASH_ATTN_EXT", r.recipe(), nullable={4: 1, 3: (0, 3)})  # sinks with or without a mask
    if which == 1:
        r.op("flash_attn_ext_set_n_kv_max", fa, rng.randint(0, n_kv))
        return Case("FLASH_ATTN_EXT", r.recipe(), params={1: (4, [0, n_kv, n_kv + 1, 1 << 20])})
    r.op("prec_set_acc", fa, 10)
    return Case("FLASH_ATTN_EXT", r.recipe(), params={1: (3, PREC)})


@gen("soft_max_sinks", "SOFT_MAX")
def _soft_max_sinks(rng: random.Random) -> Case:
    """ggml_soft_max_add_sinks (llama-graph.cpp, the non-flash attention of gpt-oss)."""
    r = R(rng)
    n_kv, n_q, h = rng.choice((8, 32)), rng.randint(1, 4), rng.randint(1, 4)
    sm = r.op("soft_max_ext", r.leaf("f32", [n_kv, n_q, h]), r.leaf("f16", [n_kv, n_q]), 0.125, 0.0)
    r.op("soft_max_add_sinks", sm, r.leaf("f32", [h]))
    # sinks without a mask: ggml_soft_max_ext(a, NULL, ...) then add_sinks (test-backend-ops does)
    return Case("SOFT_MAX", r.recipe(), nullable={2: 1, 1: (0, 1)})
