"""Rows of the matrix products (MUL_MAT, MUL_MAT_ID) and the vec_dot type each weight type computes in.

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

from typing import Mapping

from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules.base import BF16, F16, F32, F32_F16, I32, New, OpRule, Result, Srcs, f32, need, refuse
from rpcguard.protocol.tensor import RpcTensor


def _mul_mat(n: RpcTensor, s: Srcs) -> Result:
    """ggml_mul_mat ggml.c:3350: can_mul_mat (a.ne0 == b.ne0, b.ne2 % a.ne2 == 0, b.ne3 % a.ne3
    == 0), a not transposed; result F32 (a.ne1, b.ne1, b.ne2, b.ne3). The CPU kernel (ggml-cpu.c
    ggml_compute_forward_mul_mat) asserts nb00 == type size, nb10 == type size of src1, and src1
    F32 or the vec_dot type (supports_op, ggml-cpu.cpp:446)."""
    a, b = s[0], s[1]
    assert a is not None and b is not None
    need(a.ne0 == b.ne0 and b.ne2 % a.ne2 == 0 and b.ne3 % a.ne3 == 0, n, "MUL_MAT",
          f"cannot multiply {a.ne} by {b.ne}")
    need(a.nb0 <= a.nb1, n, "MUL_MAT", "src0 is transposed")
    need(a.nb0 == TYPES[a.type].type_size and b.nb0 == TYPES[b.type].type_size, n, "MUL_MAT",
          "rows not contiguous")
    if a.type not in VEC_DOT:
        raise refuse(n, "MUL_MAT", f"no CPU vec_dot for {TYPES[a.type].name}", "graph_type_invalid")
    _mul_mat_params(n, "MUL_MAT")
    if n.param1 == HINT_SRC0_IS_HADAMARD:
        # ggml-cpu.c:1263 routes to ggml_compute_forward_fwht (ops.cpp:12256): a power-of-two
        # transform writing ne10 floats per dst row; the rows are ne01 long (square F32 matrix).
        n10 = b.ne0
        ok = a.ne0 == a.ne1 == n10 and n10 & (n10 - 1) == 0 and b.type in F32_F16  # src0 is not read
        need(ok, n, "MUL_MAT", f"Hadamard hint on {a.ne} x {b.ne}")
        return New(F32, (a.ne1, b.ne1, b.ne2, b.ne3))
    # an F16/BF16 src1 of an F32 src0 is widened row by row into the F32 work buffer
    # (ggml-cpu.c:1338-1341; test-backend-ops' CONV_1D_DW with a BF16 kernel multiplies its F32
    # im2col by it); the planner sizes that buffer as for any other conversion
    widened = b.type in (F16, BF16) and _vec_dot_type(a.type) == F32
    if b.type != F32 and not widened:
        need(b.type == _vec_dot_type(a.type), n, "MUL_MAT", "src1 is neither F32 nor src0's vec_dot type")
    return New(F32, (a.ne1, b.ne1, b.ne2, b.ne3))


# ggml-cpu.c type_traits_cpu (0.3.36): the types with a CPU vec_dot, and the vec_dot_type the
# other operand is converted to. A MUL_MAT/MUL_MAT_ID/FLASH_ATTN_EXT K of any other type calls a
# NULL function pointer on the server.
VEC_DOT: Mapping[int, int] = {
    0: 0, 1: 1, 30: 30,  # f32 f16 bf16
    2: 8, 3: 9, 6: 8, 7: 9, 8: 8, 20: 8, 39: 8, 40: 8, 41: 8, 42: 8,  # q4_0 q4_1 q5_0 q5_1 q8_0 iq4_nl mxfp4 nvfp4 q1_0 q2_0
    10: 15, 11: 15, 12: 15, 13: 15, 14: 15, 16: 15, 17: 15, 18: 15, 19: 15, 21: 15, 22: 15, 23: 15,
    29: 15, 34: 15, 35: 15,  # K-quants, iq2/iq3/iq1/iq4_xs, tq1_0 tq2_0 -> q8_K
}


def _vec_dot_type(t: int) -> int:
    """type_traits_cpu[t].vec_dot_type, or -1 when the CPU has no vec_dot for ``t``."""
    return VEC_DOT.get(t, -1)


HINT_SRC0_IS_HADAMARD = 1  # ggml.h:455 enum ggml_hint
PRECS = frozenset({0, 10, 15, 20, 30, 40})  # ggml.h:443-451 enum ggml_prec (0 and 10 before 6.0.0)


def _mul_mat_params(n: RpcTensor, op: str) -> None:
    """op_params of MUL_MAT/MUL_MAT_ID: [0] accumulator precision (ggml_prec_set_acc), [1] hint
    (ggml_mul_mat_set_hint, MUL_MAT only), [3] src1 precision (ggml_prec_set_src, 6.0.0), values of
    enum ggml_prec (ggml.h:443; llama.cpp sets GGML_PREC_F32 = 10)."""
    hints = (0, HINT_SRC0_IS_HADAMARD) if op == "MUL_MAT" else (0,)
    if n.param0 not in PRECS or n.param1 not in hints or n.param2 or n.param3 not in PRECS:
        raise refuse(n, op, f"op_params {n.op_params[:4]}", "graph_op_params_invalid")


def _mul_mat_id(n: RpcTensor, s: Srcs) -> Result:
    """ggml_mul_mat_id ggml.c:3401."""
    a, b, ids = s[0], s[1], s[2]
    assert a is not None and b is not None and ids is not None
    ok = (a.nb0 <= a.nb1 and ids.type == I32 and a.ne3 == 1 and b.ne3 == 1 and ids.ne2 == 1 and ids.ne3 == 1
          and ids.ne1 == b.ne2 and a.ne0 == b.ne0 and ids.ne0 % b.ne1 == 0)
    need(ok, n, "MUL_MAT_ID", f"shapes as {a.ne} b {b.ne} ids {ids.ne}")
    need(a.nb0 == TYPES[a.type].type_size and b.nb0 == TYPES[b.type].type_size, n, "MUL_MAT_ID", "rows")
    if a.type not in VEC_DOT:
        raise refuse(n, "MUL_MAT_ID", f"no CPU vec_dot for {TYPES[a.type].name}", "graph_type_invalid")
    _mul_mat_params(n, "MUL_MAT_ID")
    need(b.type == F32 or b.type == _vec_dot_type(a.type), n, "MUL_MAT_ID", "src1 type")
    return New(F32, (a.ne1, ids.ne0, b.ne2, 1))


ROWS: tuple[OpRule, ...] = (
    OpRule("MUL_MAT", "ggml.c:3350 ggml_mul_mat (+3290 ggml_prec_set_acc/src, 3377 set_hint)", 2, _mul_mat,
           params=4, since=(6, 0, 0)),  # ggml_prec_set_acc/src: b10970 on
    OpRule("MUL_MAT", "0.3.35 ggml.c ggml_mul_mat (+set_prec, set_hint)", 2, _mul_mat, params=2,
           until=(6, 0, 0)),
    OpRule("MUL_MAT_ID", "ggml.c:3401 ggml_mul_mat_id (+3290 ggml_prec_set_acc/src)", 3, _mul_mat_id, params=4,
           since=(6, 0, 0)),
    OpRule("MUL_MAT_ID", "0.3.35 ggml.c ggml_mul_mat_id", 3, _mul_mat_id, params=1, until=(6, 0, 0)),
)
