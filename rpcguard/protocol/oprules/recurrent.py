"""Rows of the recurrent-state ops: SSM_CONV, SSM_SCAN, the linear-attention kernels (RWKV, GLA,
GATED_DELTA_NET) and the triangular ops around them (TRI, SOLVE_TRI).

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

from rpcguard.protocol.oprules.base import (
    Derive, F32, I32, INT32_MAX, New, ONLY_F32, OpRule, Result, Srcs, check_types, is_contiguous, need,
    nelements,
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


ROWS: tuple[OpRule, ...] = (
    OpRule("SSM_CONV", "ggml.c:5668 ggml_ssm_conv", 2, _ssm_conv),
    OpRule("SSM_SCAN", "ggml.c:5696 ggml_ssm_scan", 7, _ssm_scan, params=1),
    OpRule("RWKV_WKV6", "ggml.c:5882 ggml_rwkv_wkv6", 6, _linear_attn(5, 5, "RWKV_WKV6")),
    OpRule("RWKV_WKV7", "ggml.c:5968 ggml_rwkv_wkv7", 7, _linear_attn(6, 6, "RWKV_WKV7")),
    OpRule("GATED_LINEAR_ATTN", "ggml.c:5925 ggml_gated_linear_attn", 5, _linear_attn(4, 4, "GATED_LINEAR_ATTN"), params=1),
)
