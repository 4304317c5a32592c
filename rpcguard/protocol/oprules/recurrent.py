"""Rows of the recurrent-state ops: SSM_CONV, SSM_SCAN, the linear-attention kernels (RWKV, GLA,
GATED_DELTA_NET) and the triangular ops around them (TRI, SOLVE_TRI).

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

from rpcguard.protocol.oprules.base import (
    Derive, F32, I32, INT32_MAX, New, ONLY_F32, OpRule, Result, Srcs, check_types, is_contiguous, need,
    nelements, refuse, rows_contiguous,
)
from rpcguard.protocol.tensor import RpcTensor


def _ssm_conv(n: RpcTensor, s: Srcs) -> Result:
    """ggml_ssm_conv ggml.c:5668: sx 3d (d_conv - 1 + n_t, d_inner, n_s), c a matrix (d_conv,
    d_inner); result F32 (d_inner, n_t, n_s). The kernel (ops.cpp:9932) is F32 only, asserts unit
    nb0 of both and packed rows of sx, and reads c as ``c[i0 + i1*d_conv]``: c must be packed too."""
    sx, c = s[0], s[1]
    assert sx is not None and c is not None
    check_types(n, "SSM_CONV", ONLY_F32, sx, c)
    n_t = sx.ne0 - c.ne0 + 1
    ok = sx.ne3 == 1 and c.ne2 == 1 and c.ne3 == 1 and sx.ne1 == c.ne1 and n_t >= 0
    need(ok, n, "SSM_CONV", f"sx {sx.ne} c {c.ne}")
    # ops.cpp:9948-9949 assert unit nb0 of both (ggml_is_contiguous does not look at it for ne0 == 1)
    need(sx.nb0 == 4 and sx.nb1 == 4 * sx.ne0 and is_contiguous(c) and c.nb0 == 4, n, "SSM_CONV",
          "strides the kernel assumes")
    return New(F32, (c.ne1, n_t, sx.ne2, 1))


WKV7_HEAD_MULTIPLE = 64  # the widest GGML_F32_STEP of the CPU backends (AVX-512: 16 floats x 4)


def _linear_attn(state_src: int, n_inputs: int, op: str) -> Derive:
    """RWKV_WKV6 (ggml.c ggml_rwkv_wkv6: k v r tf td state), RWKV_WKV7 (r w k v a b state) and
    GATED_LINEAR_ATTN (k v q g state, param scale): S = head size, H = heads, T = tokens taken
    from the [S, H, T] inputs, all contiguous F32 (the kernels, ops.cpp:10642/11651/10854,
    dispatch on F32 and read every source as a flat float array); the state holds S*S*H floats
    per sequence, n_seqs = state.ne1. Result F32 (S*H, T + S*n_seqs): the output rows, then the
    new state. Beyond the constructor: the kernels take sequence ``t / (T / n_seqs)`` of the state
    for token t, so T must be a multiple of n_seqs (else T / n_seqs is 0, a division by zero, or
    the last tokens index a state past the end: a read and write out of bounds); WKV6 reads
    C = S*H values of tf (time_faaaa), which the constructor does not check."""
    def derive(n: RpcTensor, s: Srcs) -> Result:
        srcs = [s[i] for i in range(state_src + 1)]
        assert all(t is not None for t in srcs)
        ts = [t for t in srcs if t is not None]
        state = ts[state_src]
        check_types(n, op, ONLY_F32, *ts)
        need(all(is_contiguous(t) for t in ts), n, op, "sources not contiguous (the constructor asserts it)")
        shaped = [t for i, t in enumerate(ts[:n_inputs]) if not (op == "RWKV_WKV6" and i == 3)]  # tf: its own shape
        head = shaped[0]
        S, H, T = head.ne0, head.ne1, head.ne2
        need(all(t.ne0 == S and t.ne1 == H and t.ne2 == T and t.ne3 == 1 for t in shaped), n, op,
              f"inputs are not all [S, H, T] = {head.ne[:3]}")
        n_seqs = state.ne1
        need(nelements(state) == S * S * H * n_seqs, n, op, f"state {state.ne} for S={S} H={H}")
        need(T % n_seqs == 0, n, op, f"{T} tokens are not a multiple of {n_seqs} sequences")
        if op == "RWKV_WKV6":
            need(nelements(ts[3]) >= S * H, n, op, f"time_faaaa {ts[3].ne} holds fewer than {S * H} values")
        if op == "RWKV_WKV7":
            # ops.cpp:11747 loads GGML_F32_STEP floats at a time with no remainder loop (32 with
            # AVX2, 64 with AVX-512): a head size that is not a multiple reads and writes past
            # the rows (RWKV-7 models use 64)
            need(S % WKV7_HEAD_MULTIPLE == 0, n, op, f"head size {S} is not a multiple of {WKV7_HEAD_MULTIPLE}")
        return New(F32, (S * H, T + S * n_seqs, 1, 1))

    return derive


def _ssm_scan(n: RpcTensor, s: Srcs) -> Result:
    """ggml_ssm_scan ggml.c:5696 (srcs s x dt A B C ids, param K) with the kernel's asserts
    (ops.cpp ggml_compute_forward_ssm_scan_f32): F32 with unit nb0 everywhere, I32 ids, heads a
    multiple of groups. The kernel writes sequence i3's new state at dst + i3*s.nb3 + |x|, and with
    K > 1 copies ``s.nb2`` bytes per head into each snapshot (ops.cpp:10216): the state's nb2 and
    nb3 must be its packed sizes even where ne2 or ne3 is 1 (ggml_is_contiguous ignores them). The
    state it reads is ``s + ids[i3]*nb3``: contents (CONTENT_INDEXED), so contained only."""
    st, x, dt, A, B, C, ids = (s[i] for i in range(7))
    assert st is not None and x is not None and dt is not None and A is not None
    assert B is not None and C is not None and ids is not None
    K = n.param0
    check_types(n, "SSM_SCAN", ONLY_F32, st, x, dt, A, B, C)
    check_types(n, "SSM_SCAN", frozenset({I32}), ids)
    d_state, head_dim, n_head, n_tok, n_seqs = st.ne0, x.ne0, x.ne1, x.ne2, x.ne3
    ok = (1 <= K <= INT32_MAX and is_contiguous(st) and is_contiguous(dt) and is_contiguous(A)
          and all(t.nb0 == 4 for t in (st, x, dt, A, B, C, ids))
          and x.nb1 == x.ne0 * 4 and B.nb1 == B.ne0 * 4 and C.nb1 == C.ne0 * 4 and B.ne == C.ne
          and dt.ne == (n_head, n_tok, n_seqs, 1) and st.ne1 == head_dim and st.ne2 == n_head
          and B.ne0 == d_state and B.ne2 == n_tok and B.ne3 == n_seqs
          and ids.ne == (n_seqs, 1, 1, 1) and A.ne1 == n_head and A.ne2 == 1 and A.ne3 == 1
          and (A.ne0 == 1 or (A.ne0 == d_state and K == 1)) and n_head % B.ne1 == 0
          and st.nb2 == d_state * head_dim * 4 and st.nb3 == d_state * head_dim * n_head * 4)
    need(ok, n, "SSM_SCAN", f"s {st.ne} x {x.ne} dt {dt.ne} A {A.ne} B {B.ne} ids {ids.ne} K {K}")
    return New(F32, (nelements(x) + K * d_state * head_dim * n_head * ids.ne0, 1, 1, 1))


GDN_OP = "GATED_DELTA_NET"


def _gated_delta_net(n: RpcTensor, s: Srcs) -> Result:
    """ggml_gated_delta_net ggml.c:6375 (srcs q k v g beta state, param K): v [S_v, H, T, n_seqs],
    g [1 or S_v, ...], beta [1, ...], state [S_v, S_v, H, n_seqs] contiguous, K >= 1; result F32
    (S_v*H, T*n_seqs + K*S_v*n_seqs): the outputs, then K snapshots of the new state. All F32, q
    k v with contiguous rows, g beta state contiguous (the constructor and the kernel,
    ops.cpp:11142-11147, assert both). The kernel (ops.cpp:11124
    ggml_compute_forward_gated_delta_net_one_chunk) runs one (head iv1, sequence iv3) per row
    and per token t reads S_v floats of each row ``q + iq3*nb3 + t*nb2 + iq1*nb1`` (iq1 = iv1 %
    q.ne1, iq3 = iv3 / (n_seqs / q.ne3)), the same of k, v's own row, one float of beta and 1 or
    S_v of g at ``iv3*nb3 + t*nb2 + iv1*nb1``, and the state's ``iv3*nb3/4 + iv1*S_v*S_v``. The
    state is found by its shape, not by contents (no slot ids: not content-indexed). The
    constructor checks neither q nor k nor the outer dims of g and beta; every index above stays
    inside its dimension only if q and k have rows of at least S_v, at least T tokens and a
    sequence count dividing n_seqs (else ``n_seqs / q.ne3`` is 0, a division by zero, or the
    last sequences read past q), and g and beta at least H, T, n_seqs in dims 1-3 (a size-1 dim
    of a contiguous tensor has any stride: ggml_is_contiguous ignores it). Each dimension is
    indexed by its own stride (test-backend-ops hands it permuted q/k/v views): no flat-row walk."""
    q, k, v, g, beta, state = (s[i] for i in range(6))
    assert q is not None and k is not None and v is not None and g is not None
    assert beta is not None and state is not None
    check_types(n, GDN_OP, ONLY_F32, q, k, v, g, beta, state)
    need(all(rows_contiguous(t) for t in (q, k, v)) and all(is_contiguous(t) for t in (g, beta, state)), n,
          GDN_OP, "layouts the constructor asserts")
    S_v, H, T, n_seqs = v.ne
    K = n.param0
    if K < 1:  # ggml.c:6412, ops.cpp:11166 GGML_ASSERT(K >= 1)
        raise refuse(n, GDN_OP, f"K {K}", "graph_op_params_invalid")
    need(g.ne0 in (1, S_v) and beta.ne0 == 1 and state.ne == (S_v, S_v, H, n_seqs), n, GDN_OP,
          f"g {g.ne} beta {beta.ne} state {state.ne} for v {v.ne}")
    for t in (q, k):
        need(t.ne0 >= S_v and t.ne2 >= T and n_seqs % t.ne3 == 0, n, GDN_OP,
              f"q/k {t.ne}: rows of {S_v}, {T} tokens, sequences dividing {n_seqs}")
    for t in (g, beta):
        need(t.ne1 >= H and t.ne2 >= T and t.ne3 >= n_seqs, n, GDN_OP, f"g/beta {t.ne} for v {v.ne}")
    return New(F32, (S_v * H, T * n_seqs + K * S_v * n_seqs, 1, 1))


def _solve_tri(n: RpcTensor, s: Srcs) -> Result:
    """ggml_solve_tri ggml.c:6340: a (A) square F32 [n, n, B1, B2], b F32 [k, n, B1, B2], both
    contiguous; only lower/left/non-unit is built and no op_param records it; result F32 of b's
    shape. The kernel (ops.cpp:11053 ggml_compute_forward_solve_tri_f32) repeats those asserts
    (aborts) and walks each batch ``i02*nb02 + i03*nb03`` as packed rows (``A[i00*n + t]``,
    ``B[i00*k + i01]``), which the contiguity gives. A zero on A's diagonal is a plain assert
    (compiled out with NDEBUG, as both servers are built): a division giving inf/NaN."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    check_types(n, "SOLVE_TRI", ONLY_F32, a, b)
    ok = a.ne0 == a.ne1 == b.ne1 and a.ne2 == b.ne2 and a.ne3 == b.ne3
    need(ok, n, "SOLVE_TRI", f"A {a.ne} B {b.ne}")
    need(is_contiguous(a) and is_contiguous(b), n, "SOLVE_TRI", "sources not contiguous (the constructor asserts it)")
    return New(F32, b.ne)


TRI_TYPES = frozenset({0, 1, 2, 3})  # ggml.h:670 enum ggml_tri_type (the kernel aborts on others)


def _tri(n: RpcTensor, s: Srcs) -> Result:
    """ggml_tri ggml.c:5377: a square contiguous F32, param the triangle type; result
    ggml_dup_tensor(a). The kernel (ops.cpp:2339 ggml_compute_forward_tri_f32) asserts the
    contiguity, aborts on a type outside the enum, reads ``src[i0]`` of each row at
    ``i01*nb01 + i02*nb02 + i03*nb03`` and compares ``int`` indices (ne0 == ne1 keeps them far
    below 2^31: ne0^2 elements fit in a buffer)."""
    a = s[0]
    assert a is not None
    if n.param0 not in TRI_TYPES:
        raise refuse(n, "TRI", f"type {n.param0}", "graph_op_params_invalid")
    check_types(n, "TRI", ONLY_F32, a)
    need(a.ne0 == a.ne1 and is_contiguous(a), n, "TRI", f"{a.ne} not square and contiguous")
    return New(F32, a.ne)


ROWS: tuple[OpRule, ...] = (
    OpRule("SSM_CONV", "ggml.c:5668 ggml_ssm_conv", 2, _ssm_conv),
    OpRule("SSM_SCAN", "ggml.c:5696 ggml_ssm_scan", 7, _ssm_scan, params=1),
    OpRule("RWKV_WKV6", "ggml.c:5882 ggml_rwkv_wkv6", 6, _linear_attn(5, 5, "RWKV_WKV6")),
    OpRule("RWKV_WKV7", "ggml.c:5968 ggml_rwkv_wkv7", 7, _linear_attn(6, 6, "RWKV_WKV7")),
    OpRule("GATED_LINEAR_ATTN", "ggml.c:5925 ggml_gated_linear_attn", 5, _linear_attn(4, 4, "GATED_LINEAR_ATTN"), params=1),
    # GATED_DELTA_NET, SOLVE_TRI, TRI: constructor and kernel the same in every release from 4.0.1
    OpRule("GATED_DELTA_NET", "ggml.c:6375 ggml_gated_delta_net", 6, _gated_delta_net, params=1, since=(4, 0, 1),
           flat_rows=False),
    OpRule("SOLVE_TRI", "ggml.c:6340 ggml_solve_tri", 2, _solve_tri, since=(4, 0, 1)),
    OpRule("TRI", "ggml.c:5377 ggml_tri", 1, _tri, params=1, since=(4, 0, 1)),
)
