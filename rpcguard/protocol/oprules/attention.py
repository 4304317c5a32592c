"""Rows of the attention ops: SOFT_MAX, ROPE, FLASH_ATTN_EXT, the diagonal masks, and DeepSeek's
LIGHTNING_INDEXER and hyper-connection ops (DSV4_HC_*).

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules.base import (
    F16, F32, F32_F16, I32, New, ONLY_F32, OpRule, Result, Srcs, check_types, dup_or_inplace, f32,
    is_contiguous, need, refuse, rows_contiguous,
)
from rpcguard.protocol.oprules.matmul import PRECS, VEC_DOT
from rpcguard.protocol.tensor import RpcTensor


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
ROPE_TYPE_MROPE, ROPE_TYPE_VISION = 8, 24


def _rope(n: RpcTensor, s: Srcs) -> tuple[Result, ...]:
    """ggml_rope_impl ggml.c:4240: b an I32 vector of a.ne2 positions (4 per token for mrope),
    c (freq factors) F32 with ne0 >= n_dims/2; params {0, n_dims, mode, 0, n_ctx_orig, 6 floats,
    4 sections, n_offs}. The kernel (ops.cpp:6315-6360) asserts F32/F16 with unit nb0, n_dims
    even and <= ne0, n_offs even with n_offs + n_dims <= ne0, vision n_dims == ne0/2; mrope takes
    ``(i0/2) % sum(sections)``, so sections must be >= 0 with a positive sum <= ne0."""
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
    if c is not None:
        # the constructor asks ne0 >= n_dims/2, but ggml_rope_cache_init (ops.cpp:6209) reads
        # freq_factors[i0/2] for every i0 < ne0 of the row
        need(c.type == F32 and c.ne0 >= n_dims // 2 and c.ne0 >= a.ne0 // 2, n, "ROPE", "freq factors")
    return dup_or_inplace(a)


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


ROWS: tuple[OpRule, ...] = (
    OpRule("DIAG_MASK_INF", "ggml.c:4071 ggml_diag_mask_inf", 1, _diag_mask, params=1),
    OpRule("DIAG_MASK_ZERO", "ggml.c:4103 ggml_diag_mask_zero", 1, _diag_mask, params=1),
    OpRule("SOFT_MAX", "ggml.c:4200 ggml_soft_max_ext", 1, _soft_max, optional=2, params=2),
    OpRule("ROPE", "ggml.c:4398 ggml_rope_ext", 2, _rope, optional=1, params=16, since=(7, 0, 0)),
    # before 7.0.0 ggml_rope_impl set 15 params (no n_offs, ggml_rope_set_offset came with 7.0.0)
    OpRule("ROPE", "0.3.35 ggml.c ggml_rope_impl", 2, _rope, optional=1, params=15, until=(7, 0, 0)),
    OpRule("ROPE_BACK", "ggml.c:4494 ggml_rope_ext_back (+4514 ggml_rope_multi_back, 4535 set_offset)", 2,
           _rope_back, optional=1, params=16, since=(7, 0, 0), flat_rows=False),
    OpRule("FLASH_ATTN_EXT", "ggml.c:5506 ggml_flash_attn_ext (+5558 set_prec, 5570 set_n_kv_max)", 3,
           _flash_attn_ext, optional=2, params=5, since=(7, 0, 0)),
    OpRule("FLASH_ATTN_EXT", "0.3.35 ggml.c ggml_flash_attn_ext (+set_prec)", 3, _flash_attn_ext, optional=2,
           params=4, until=(7, 0, 0)),
)
