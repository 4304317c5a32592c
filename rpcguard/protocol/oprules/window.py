"""Rows of the window and relative-position ops of SAM-style vision encoders: WIN_PART, WIN_UNPART,
GET_REL_POS, ADD_REL_POS.

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

from rpcguard.protocol.oprules.base import (
    BF16, F16, F32, INT32_MAX, New, ONLY_F32, OpRule, Result, Srcs, View, check_types, is_contiguous, need,
    refuse,
)
from rpcguard.protocol.tensor import RpcTensor


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
    check_types(n, "WIN_PART", ONLY_F32, a)
    w = n.param2
    if w < 1 or a.ne1 + w > INT32_MAX or a.ne2 + w > INT32_MAX:
        raise refuse(n, "WIN_PART", f"window {w} for {a.ne}", "graph_op_params_invalid")
    npx, npy = _win_counts(a.ne1, a.ne2, w)
    if (n.param0, n.param1) != (npx, npy) or npx * npy > INT32_MAX:
        raise refuse(n, "WIN_PART", f"params {n.op_params[:3]}, the constructor sets ({npx}, {npy}, {w})",
                     "graph_op_params_invalid")
    need(a.ne3 == 1 and is_contiguous(a), n, "WIN_PART", f"{a.ne} not a contiguous 3d tensor")
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
    check_types(n, "WIN_UNPART", ONLY_F32, a)
    w, w0, h0 = n.param0, n.ne1, n.ne2
    if w < 1 or w0 + w > INT32_MAX or h0 + w > INT32_MAX:
        raise refuse(n, "WIN_UNPART", f"window {w} for {n.ne}", "graph_op_params_invalid")
    npx, npy = _win_counts(w0, h0, w)
    need(is_contiguous(a) and a.ne1 >= w and a.ne2 >= w and a.ne3 >= npx * npy, n, "WIN_UNPART",
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
    check_types(n, "GET_REL_POS", frozenset({F16, BF16}), a)
    need(a.ne1 % 2 == 1, n, "GET_REL_POS", f"{a.ne1} relative positions are not 2*q - 1")
    packed = (a.ne0 == 1 or a.nb0 == 2) and (a.ne1 == 1 or a.nb1 == 2 * a.ne0)
    need(packed, n, "GET_REL_POS", "rows not packed (the kernel reads pos*ne00 + i0)")
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
    check_types(n, "ADD_REL_POS", ONLY_F32, a, pw, ph)
    inplace = n.param0
    if inplace not in (0, 1):
        raise refuse(n, "ADD_REL_POS", f"inplace {inplace}", "graph_op_params_invalid")
    ok = (pw.ne == ph.ne and all(is_contiguous(t) for t in (a, pw, ph)) and pw.ne3 == a.ne2
          and pw.ne0 * pw.ne0 == a.ne0 and pw.ne1 * pw.ne2 == a.ne1)
    need(ok, n, "ADD_REL_POS", f"a {a.ne} pw {pw.ne} ph {ph.ne}")
    return View(0, a.ne, a.nb, 0) if inplace else New(F32, a.ne)


ROWS: tuple[OpRule, ...] = (
    # constructor and kernel the same in every release from 4.0.1 (docs/matrix.md)
    OpRule("WIN_PART", "ggml.c:5767 ggml_win_part", 1, _win_part, params=3, since=(4, 0, 1)),
    OpRule("WIN_UNPART", "ggml.c:5796 ggml_win_unpart", 1, _win_unpart, params=1, since=(4, 0, 1)),
    OpRule("GET_REL_POS", "ggml.c:5818 ggml_get_rel_pos", 1, _get_rel_pos, since=(4, 0, 1)),
    OpRule("ADD_REL_POS", "ggml.c:5837 ggml_add_rel_pos_impl (ggml_add_rel_pos, _inplace)", 3, _add_rel_pos,
           params=1, since=(4, 0, 1)),
)
