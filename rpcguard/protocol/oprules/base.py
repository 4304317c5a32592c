"""The op table's vocabulary: type ids, the results a rule derives (New, View), the row (OpRule),
the refusal, and the layout predicates and checks every family of rules shares.

Part of the op table (rpcguard/protocol/oprules/__init__.py says how it works); each row cites
the constructor it mirrors (``ggml.c:LINE`` of the pinned sdist) and its derive function the kernels.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.ggml import TYPES, Version
from rpcguard.protocol.tensor import RpcTensor


F32, F16, I8, I16, I32, I64, BF16 = 0, 1, 24, 25, 26, 27, 30
FLOAT = frozenset({F32, F16, BF16})
F32_F16 = frozenset({F32, F16})
ONLY_F32 = frozenset({F32})
QUANTIZED = frozenset(t for t, info in TYPES.items() if info.blck_size > 1)
MAX_DIMS = 4
GGML_MAX_SRC = 10
INT32_MAX = (1 << 31) - 1

_F = struct.Struct("<f")
_I = struct.Struct("<i")


def round_f32(x: float) -> float:
    """``x`` rounded to single precision, as a C float expression of two floats is: a double
    result of one + - * / of two floats, rounded once, is the correctly rounded float result."""
    if not math.isfinite(x) or abs(x) >= 3.4028235677973366e38:
        return math.inf if x > 0 else -math.inf if x < 0 else x
    value: float = _F.unpack(_F.pack(x))[0]
    return value


def f32(i32: int) -> float:
    """An op_param slot (int32 on the wire) read as the float ggml_set_op_params stored there."""
    value: float = _F.unpack(_I.pack(i32))[0]
    return value


@dataclass(frozen=True, slots=True)
class New:
    """A fresh tensor of ``type`` and shape ``ne``: contiguous, or with the strides ``nb`` its
    constructor sets after ggml_new_tensor (ggml_conv_2d_dw_direct's channels-first result)."""

    type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class View:
    """A view of source ``src`` (an index into the node's srcs) with shape ``ne`` and strides ``nb``."""

    src: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    offs: int = 0


Result = New | View
Srcs = Sequence["RpcTensor | None"]
Derive = Callable[[RpcTensor, Srcs], "Result | tuple[Result, ...]"]
# (tensor, bytes) pairs: the kernel addresses ``[t.data, t.data + bytes)`` of each (OpRule.reach)
Reach = Callable[[RpcTensor, Srcs], Sequence["tuple[RpcTensor, int]"]]


@dataclass(frozen=True, slots=True)
class OpRule:
    """One op: the constructor it mirrors, its sources and params, and how to derive the result."""

    op: str
    ctor: str  # "ggml.c:LINE ggml_xxx" of the pinned sdist
    srcs: int  # leading sources the constructor always sets (must be present)
    derive: Derive
    optional: int = 0  # further sources it may set (masks, freq factors, sinks)
    params: int = 0  # leading op_params slots it may set; the rest must be 0
    since: Version = (0, 0, 0)  # first protocol version the row holds for
    until: Version = (99, 0, 0)  # first version it no longer holds for (a later row takes over)
    self_src1: bool = False  # src[1] may be the node itself (ggml_cast)
    # The CPU kernel may walk rows flattened (row i at data + i*nb1, i < ne1*ne2*ne3): the reach
    # of that walk is checked for the node and its sources (opcheck.check_flat_rows). True unless
    # every kernel of the op was read to index each dimension with its own stride.
    flat_rows: bool = True
    # A source may be empty (a 0 in ne): the kernel's loops then copy nothing from it (CONCAT).
    # Else an empty source is refused: broadcasting kernels take an index modulo its ne (SIGFPE).
    empty_sources: bool = False
    # What ggml_graph_plan asserts of the node's sources before any kernel runs: it plans empty
    # nodes too, which no derive sees (opcheck.check_sources calls it for every node).
    plan: "Callable[[RpcTensor, Srcs], None] | None" = None
    # What the kernel addresses from a tensor's data pointer past the tensor's own range (its
    # ggml_nbytes, which the range check bounds): (tensor, bytes from its data) pairs of the node
    # and its sources, for a node the derive accepted. The project's invariant is per buffer
    # (issue 20 point 3): each such reach must stay inside the tensor's buffer, not its bytes
    # (opcheck.check_reach). ROPE's freq factors: ne0/2 floats read whatever their ne0.
    reach: "Reach | None" = None


def refuse(node: RpcTensor, op: str, what: str, reason: str = "graph_shape_invalid") -> FirewallRefusal:
    return FirewallRefusal(reason, f"node id={node.id:#x} op {op}: {what}")


def contiguous_nb(type_: int, ne: Sequence[int]) -> tuple[int, int, int, int]:
    """Strides ggml_new_tensor_impl gives a fresh tensor (every dimension, size 1 included)."""
    info = TYPES[type_]
    nb0 = info.type_size
    nb1 = nb0 * (ne[0] // info.blck_size)
    nb2 = nb1 * ne[1]
    return (nb0, nb1, nb2, nb2 * ne[2])


def is_contiguous(t: RpcTensor, n: int = 0) -> bool:
    """ggml_is_contiguous_n (ggml.c:1474 ggml_is_contiguous_m_n): dims above ``n`` packed, a
    size-1 dim's stride not looked at there; dims 1..n may be strided, their ``ne*nb`` sets the
    next expected stride (size-1 dims included)."""
    info = TYPES[t.type]
    nxt = info.type_size
    if t.ne0 != info.blck_size and t.nb0 != nxt:
        return False
    nxt *= t.ne0 // info.blck_size
    ne, nb = t.ne, t.nb
    for i in range(1, MAX_DIMS):
        if i > n:
            if ne[i] != 1 and nb[i] != nxt:
                return False
            nxt *= ne[i]
        else:
            nxt = ne[i] * nb[i]
    return True


def is_padded_1d(t: RpcTensor) -> bool:
    """ggml_is_padded_1d: unit nb0, dims 2 and 3 packed after the row stride (size-1 included)."""
    return t.nb0 == TYPES[t.type].type_size and t.nb2 == t.nb1 * t.ne1 and t.nb3 == t.nb2 * t.ne2


def rows_contiguous(t: RpcTensor) -> bool:
    """ggml_is_contiguous_rows: elements of a row are adjacent."""
    return t.ne0 == TYPES[t.type].blck_size or t.nb0 == TYPES[t.type].type_size


def nelements(t: RpcTensor) -> int:
    return t.ne0 * t.ne1 * t.ne2 * t.ne3


def can_repeat(b: RpcTensor, a: RpcTensor) -> bool:
    """ggml_can_repeat(b, a) without its empty-tensor escape (graphs carry no empty tensors)."""
    return all(x % y == 0 for x, y in zip(a.ne, b.ne))


def need(cond: bool, node: RpcTensor, op: str, what: str) -> None:
    if not cond:
        raise refuse(node, op, what)


def check_types(node: RpcTensor, op: str, allowed: frozenset[int], *ts: RpcTensor) -> None:
    for t in ts:
        if t.type not in allowed:
            raise refuse(node, op, f"type {TYPES[t.type].name} of id={t.id:#x} not handled by the kernel",
                         "graph_type_invalid")


def dup_or_inplace(a: RpcTensor, type_: int | None = None) -> tuple[Result, ...]:
    """ggml_dup_tensor(a) or, for the _inplace variant, ggml_view_tensor(a)."""
    t = a.type if type_ is None else type_
    return (New(t, a.ne), View(0, a.ne, a.nb, 0))


