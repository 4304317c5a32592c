"""Rows of the reductions and orderings: SUM, SUM_ROWS, MEAN, ARGMAX, CUMSUM, ARGSORT, TOP_K.

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

from rpcguard.protocol.oprules.base import (
    Derive, F32, FLOAT, I32, INT32_MAX, New, ONLY_F32, OpRule, Result, Srcs, check_types, need, refuse,
)
from rpcguard.protocol.tensor import RpcTensor


def _argsort(n: RpcTensor, s: Srcs) -> Result:
    a = s[0]
    assert a is not None
    if n.param0 not in (0, 1):
        raise refuse(n, "ARGSORT", f"order {n.param0}", "graph_op_params_invalid")
    check_types(n, "ARGSORT", ONLY_F32, a)
    need(a.ne0 <= INT32_MAX and a.nb0 == 4, n, "ARGSORT", "rows")
    return New(I32, a.ne)


def _top_k(n: RpcTensor, s: Srcs) -> Result:
    """ggml_top_k ggml.c:5468: k = the node's ne0, at most a.ne0."""
    a = s[0]
    assert a is not None
    check_types(n, "TOP_K", ONLY_F32, a)
    need(0 < n.ne0 <= a.ne0, n, "TOP_K", f"k {n.ne0} for ne0 {a.ne0}")
    return New(I32, (n.ne0, a.ne1, a.ne2, a.ne3))


def _reduce_rows(type_: int | None) -> Derive:
    def derive(n: RpcTensor, s: Srcs) -> Result:
        a = s[0]
        assert a is not None
        check_types(n, "reduce", ONLY_F32, a)
        need(a.nb0 == 4, n, "reduce", "nb0")
        return New(a.type if type_ is None else type_, (1, a.ne1, a.ne2, a.ne3))

    return derive


def _sum(n: RpcTensor, s: Srcs) -> Result:
    a = s[0]
    assert a is not None
    check_types(n, "SUM", FLOAT, a)
    return New(a.type, (1, 1, 1, 1))


def _argmax(n: RpcTensor, s: Srcs) -> Result:
    a = s[0]
    assert a is not None
    check_types(n, "ARGMAX", ONLY_F32, a)
    need(a.ne2 == 1 and a.ne3 == 1 and a.ne0 <= INT32_MAX, n, "ARGMAX", "not a matrix")
    return New(I32, (a.ne1, 1, 1, 1))


def _cumsum(n: RpcTensor, s: Srcs) -> Result:
    a = s[0]
    assert a is not None
    check_types(n, "CUMSUM", ONLY_F32, a)
    need(a.nb0 == 4, n, "CUMSUM", "nb0")
    return New(a.type, a.ne)


ROWS: tuple[OpRule, ...] = (
    OpRule("SUM", "ggml.c:2486 ggml_sum", 1, _sum),
    OpRule("SUM_ROWS", "ggml.c:2499 ggml_sum_rows", 1, _reduce_rows(None)),
    OpRule("CUMSUM", "ggml.c:2517 ggml_cumsum", 1, _cumsum),
    OpRule("MEAN", "ggml.c:2532 ggml_mean", 1, _reduce_rows(F32)),
    OpRule("ARGMAX", "ggml.c:2546 ggml_argmax", 1, _argmax),
    OpRule("ARGSORT", "ggml.c:5432 ggml_argsort", 1, _argsort, params=1),
    OpRule("TOP_K", "ggml.c:5468 ggml_top_k", 1, _top_k),
)
