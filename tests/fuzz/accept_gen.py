"""Acceptance-region generator: graphs each op rule ACCEPTS, sampled adversarially at its edges.

How this works: for every op with a rule for protocol 7.0.0 (``oprules.RULES`` through
``graph.op_rules``), a per-op *proto* draws the sources (type, shape), the op_params and, for
the few ops whose rule reads the node itself (TOP_K's k, REPEAT/CONT/RESHAPE/VIEW shapes, a
CPY cast's type), the node's own fields. The layout adversary then gives every source strides
and a place: contiguous, any stride on a size-1 dimension (0, 1, odd, the whole buffer: the
rules never look at them), zero strides (broadcast), padded rows, strided elements, permuted
strides, huge strides, sometimes a view of a bigger parent; the tensor sits flush against the
end (or the start) of its own buffer, so the sanitizer's redzone is the next byte. The node is
what the rule's own ``derive`` returns for those sources (the fresh result or the in-place view,
both when the rule allows both), so the node always matches; one variant instead gives the node
an empty dimension (the rules skip empty nodes, the CPU planner still reads their sources).
Params are drawn at the edges of their ranges and of float precision (0, -0, denormals, 2^24+1,
FLT_MAX, inf, NaN, k/n ratios that round differently in float and double).

A candidate is kept only when rpcguard's own firewall accepts it: the GRAPH_COMPUTE payload
goes through ``Firewall.check_request`` (what ``serve`` calls for every frame) against a session
state holding the case's buffers, so every case kept is one serve forwards. The runner
(accept_run.py) re-checks every frame through a real ``Session`` on the live connection.

Everything is seeded: case ``i`` of op ``X`` under seed ``s`` is the same on every machine.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import TENSOR_STRUCT
from rpcguard.protocol.firewall import Firewall
from rpcguard.protocol.ggml import TYPES, op_table
from rpcguard.protocol.graph import op_rules
from rpcguard.protocol.oprules import OpRule, New, View, contiguous_nb, needs_containment
from rpcguard.protocol.oprules.elementwise import GROUP_NORM_EXTRA
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.tensor import RpcTensor, decode_tensor, nbytes
from rpcguard.protocol.versions import COMMAND_IDS, spec_for

__all__ = ["VERSION", "Case", "Tensor", "ops", "generate", "accepts", "materialize", "payload_of", "span",
           "PROTOS", "WORK_OPS", "Q_DST", "FLOAT_EDGES", "CONTAINED_OPS", "policy_for", "WRITTEN_SOURCES", "output_spans"]

VERSION = (7, 0, 0)
SPEC = spec_for(VERSION)
assert SPEC is not None
TABLE = op_table(VERSION)
assert TABLE is not None
RULES = op_rules(VERSION)
assert RULES is not None
GRAPH_RULE = SPEC.commands[COMMAND_IDS["GRAPH_COMPUTE"]]
F32, F16, Q8_0, I8, I16, I32, I64, BF16 = 0, 1, 8, 24, 25, 26, 27, 30
FLAG_COMPUTE = 16  # ggml.h GGML_TENSOR_FLAG_COMPUTE, set by ggml_build_forward_expand
FLAG_OUTPUT = 2  # ggml.h GGML_TENSOR_FLAG_OUTPUT
ALL_TYPES = tuple(sorted(TYPES))
FLOATS = (F32, F16, BF16)
MAX_SLACK = 64
MIN_BUFFER = 64
FAKE_BASE = 0x7F0000000000  # acceptance is judged against fake bases; the runner re-judges live
FAKE_STEP = 1 << 32

_F = struct.Struct("<f")
_I = struct.Struct("<i")


def fbits(x: float) -> int:
    """The int32 slot ggml_set_op_params stores for the float ``x`` (rounded to float)."""
    try:
        packed = _F.pack(x)
    except OverflowError:
        packed = _F.pack(math.copysign(math.inf, x))
    return _I.unpack(packed)[0]


FLT_MAX = 3.4028234663852886e38
# float edges: signed zeros, denormals, the float/int boundary, overflow, non-finite, ratios
FLOAT_EDGES = (0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-45, -1e-45, 1.1754943508222875e-38, 1e-6, 1e-5,
               16777216.0, 16777218.0, 2147483648.0, FLT_MAX, -FLT_MAX, math.inf, -math.inf, math.nan,
               1 / 3, 0.1, 10000.0, 1e30, -1e30)
INT_EDGES = (0, 1, -1, 2, 3, -2, 0x7FFFFFFF, -0x80000000, 0x7FFFFFFE, 0x10000, 0xFFFF)


# -- cases -------------------------------------------------------------------------------------


@dataclass
class Tensor:
    """One rpc_tensor of a case; ``buf`` indexes ``Case.buffers`` (-1: no buffer, data NULL)."""

    id: int
    type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    buf: int = -1
    offs: int = 0  # byte offset of data inside its buffer
    op: int = 0
    params: list[int] = field(default_factory=lambda: [0] * 16)
    src: list[int] = field(default_factory=lambda: [0] * 10)
    view_src: int = 0
    view_offs: int = 0
    flags: int = 0  # GGML_TENSOR_FLAG_*: nodes carry COMPUTE (ggml-cpu skips a node without it)
    fill: str = "rand"  # rand / zero / none: what SET_TENSOR writes into a leaf
    # rpc_tensor.use_count (ggml-rpc.cpp: the server takes it as sent, into the graph's use counts):
    # 1 on a node the next one alone reads lets ggml-cpu fuse the two (fused())
    use_count: int = 0


@dataclass
class Case:
    op: str
    seed: int
    index: int
    variant: str  # what the adversary did (layouts, inplace, empty, limits, ...)
    buffers: list[int]
    tensors: list[Tensor]  # in list order: every src/view_src before its users
    nodes: list[int]  # ids of the computed nodes, in order
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "Case":
        ts = [Tensor(**{**t, "ne": tuple(t["ne"]), "nb": tuple(t["nb"])}) for t in obj["tensors"]]
        return cls(**{**obj, "tensors": ts})

    def by_id(self, i: int) -> Tensor:
        return next(t for t in self.tensors if t.id == i)

    def leaves(self) -> list[Tensor]:
        node_ids = set(self.nodes)
        return [t for t in self.tensors if t.id not in node_ids and t.buf >= 0]

    def describe(self) -> str:
        parts = []
        for t in self.tensors:
            role = "node" if t.id in self.nodes else "src"
            extra = f" params={t.params[:_used(t.params)]}" if any(t.params) and role == "node" else ""
            view = f" view_of={t.view_src:#x}+{t.view_offs}" if t.view_src else ""
            parts.append(f"{role} {t.id:#x} {TABLE.names[t.op]} {TYPES[t.type].name} ne={list(t.ne)} "
                         f"nb={list(t.nb)} buf{t.buf}+{t.offs}{view}{extra}")
        return f"{self.op}[{self.variant}] buffers={self.buffers}: " + "; ".join(parts)


def _used(params: list[int]) -> int:
    n = len(params)
    while n and not params[n - 1]:
        n -= 1
    return n


def span(t: Tensor) -> int:
    """ggml_nbytes of ``t`` (the bytes the server and the firewall agree it covers)."""
    return nbytes(_rt(t, 0, 0), TYPES[t.type])


def _rt(t: Tensor, handle: int, data: int) -> RpcTensor:
    return decode_tensor(_pack(t, handle, data))


class Unencodable(Exception):
    """A drawn shape or stride does not fit the wire's u32 fields."""


def _i32(x: int) -> int:
    return (x + (1 << 31)) % (1 << 32) - (1 << 31)


def _pack(t: Tensor, handle: int, data: int) -> bytes:
    if max(*t.ne, *t.nb) >= 1 << 32 or min(*t.ne, *t.nb) < 0:
        raise Unencodable(f"ne {t.ne} nb {t.nb}")
    return TENSOR_STRUCT.pack(t.id, t.type, handle, *t.ne, *t.nb, t.op, *map(_i32, t.params), t.flags, *t.src,
                              t.view_src, t.view_offs, data, b"t", t.use_count)


def handles_fake(case: Case) -> list[tuple[int, int]]:
    return [(0x1000 + 0x100 * i, FAKE_BASE + FAKE_STEP * i) for i in range(len(case.buffers))]


def materialize(case: Case, live: list[tuple[int, int]]) -> list[bytes]:
    """296 bytes per tensor, with ``live[i]`` = (handle, base) of the case's buffer i."""
    out = []
    for t in case.tensors:
        if t.buf < 0:
            out.append(_pack(t, 0, 0))
        else:
            h, b = live[t.buf]
            out.append(_pack(t, h, b + t.offs))
    return out


def payload_of(case: Case, live: list[tuple[int, int]]) -> bytes:
    """The GRAPH_COMPUTE payload (7.0.0: u32 device, u32 n_nodes, ids, u32 n_tensors, tensors)."""
    ts = materialize(case, live)
    return (struct.pack("<II", 0, len(case.nodes)) + struct.pack(f"<{len(case.nodes)}Q", *case.nodes)
            + struct.pack("<I", len(ts)) + b"".join(ts))


def fake_state(case: Case) -> SessionState:
    st = SessionState(UpstreamFacts(version=VERSION, device_count=1))
    st.spec = SPEC
    for (h, b), size in zip(handles_fake(case), case.buffers):
        st.add_buffer(h, 0, size)
        st.set_base(h, b)
    return st


def accepts(case: Case) -> str | None:
    """None when rpcguard's firewall (``policy_for(case.op)``: the default policy, contained for
    CONTAINED_OPS) forwards the case's GRAPH_COMPUTE, else the refusal reason."""
    state = fake_state(case)
    fw = Firewall(state, policy_for(case.op))
    try:
        fw.check_request(GRAPH_RULE, memoryview(payload_of(case, handles_fake(case))), 0)
    except FirewallRefusal as e:
        return e.reason
    return None


# -- drawing -----------------------------------------------------------------------------------


class Draw:
    """The seeded choices of one candidate."""

    def __init__(self, rng: random.Random) -> None:
        self.r = rng
        self.tags: list[str] = []
        # element counts at the limits: "big" dimensions may be drawn in the thousands
        self.limits = rng.random() < 0.1

    def p(self, x: float) -> bool:
        return self.r.random() < x

    def pick(self, seq):  # type: ignore[no-untyped-def]
        return seq[self.r.randrange(len(seq))]

    def dim(self, big: bool = False) -> int:
        x = self.r.random()
        if x < 0.35:
            return 1
        if x < 0.7:
            return self.r.randint(2, 8)
        if big and self.limits and self.r.random() < 0.6:
            return self.r.choice((1 << 12, 1 << 14, 1 << 16, (1 << 16) + 1, self.r.randint(4097, 1 << 17)))
        if x < 0.92 or not big:
            return self.r.randint(9, 70)
        return self.r.randint(71, 600)

    def shape(self, n: int = 4) -> tuple[int, int, int, int]:
        ne = [self.dim(big=i == 0) for i in range(4)]
        for i in range(n, 4):
            ne[i] = 1
        return tuple(ne)  # type: ignore[return-value]

    def ftype(self, pref: tuple[int, ...] = FLOATS) -> int:
        return self.pick(ALL_TYPES) if self.p(0.2) else self.pick(pref)

    def f(self, lo: float = -4.0, hi: float = 4.0) -> int:
        if self.p(0.45):
            return fbits(self.pick(FLOAT_EDGES))
        if self.p(0.15):  # a random float across the exponent range
            return fbits(self.r.choice((1, -1)) * 2.0 ** self.r.uniform(-149, 127))
        return fbits(self.r.uniform(lo, hi))

    def i(self, lo: int, hi: int) -> int:
        if self.p(0.25):
            return self.pick(INT_EDGES)
        if self.p(0.3):
            return self.pick((lo, hi, lo - 1, hi + 1))
        return self.r.randint(lo, hi)

    def tag(self, s: str) -> None:
        self.tags.append(s)


def blocked(t: int, ne0: int) -> int:
    """``ne0`` rounded up to a whole number of blocks of type ``t``."""
    b = TYPES[t].blck_size
    return max(b, (ne0 + b - 1) // b * b)


@dataclass
class Src:
    type: int
    ne: tuple[int, int, int, int]
    fill: str = "rand"
    layout: str | None = None  # force a layout mode
    flags: int = 0  # GGML_TENSOR_FLAG_* of the source (OPT_STEP_*: PARAM)
    # placed at the start of a buffer of its own that ends this many bytes after its span (0:
    # flush), for a kernel that reads past the tensor (ROPE's freq factors); None: Builder.place
    room: int | None = None


@dataclass
class Proto:
    srcs: list[Src | None]
    params: list[int] = field(default_factory=list)
    node_ne: tuple[int, int, int, int] | None = None
    node_nb: tuple[int, int, int, int] | None = None
    node_type: int | None = None
    cast: bool = False  # CPY as ggml_cast: src[1] is the node itself
    consumer: str | None = None  # view ops: a node that reads the view
    then: str | None = None  # a node the CPU backend may fuse with this one (FUSED_NEXT)


def S(t: int, ne: tuple[int, ...], fill: str = "rand", layout: str | None = None) -> Src:
    ne4 = tuple(ne) + (1,) * (4 - len(ne))
    return Src(t, (blocked(t, ne4[0]),) + ne4[1:], fill, layout)  # type: ignore[arg-type]


def params(*xs: int) -> list[int]:
    return list(xs)


# -- per-op protos ------------------------------------------------------------------------------


def _one(pref: tuple[int, ...] = FLOATS, *ps: Callable[[Draw], int]) -> Callable[[Draw], Proto]:
    def proto(d: Draw) -> Proto:
        return Proto([S(d.ftype(pref), d.shape())], [p(d) for p in ps])
    return proto


def _then(d: Draw, proto: Proto, op: str) -> Proto:
    """``proto`` followed, in 60 % of the draws, by the node ``op`` the CPU backend fuses it with."""
    if d.p(0.6):
        proto.then = op
    return proto


def _p_float(lo: float = -4, hi: float = 4) -> Callable[[Draw], int]:
    return lambda d: d.f(lo, hi)


def _p_int(lo: int, hi: int) -> Callable[[Draw], int]:
    return lambda d: d.i(lo, hi)


def p_top_k(d: Draw) -> Proto:
    a = S(d.ftype((F32,)), d.shape())
    k = d.pick((1, a.ne[0], max(1, a.ne[0] - 1), d.r.randint(1, a.ne[0]), a.ne[0] + 1))
    return Proto([a], node_ne=(k, *a.ne[1:]))  # type: ignore[arg-type]


def p_repeat(d: Draw) -> Proto:
    a = S(d.ftype((F32, F16, I32)), d.shape())
    mult = [d.pick((1, 1, 2, 3, 7)) for _ in range(4)]
    return Proto([a], node_ne=tuple(x * m for x, m in zip(a.ne, mult)))  # type: ignore[arg-type]


def _factor4(d: Draw, n: int, t: int) -> tuple[int, int, int, int]:
    """A 4-d shape with ``n`` elements (ne0 a block multiple of ``t`` where possible)."""
    ne = [1, 1, 1, 1]
    rest = n
    for i in (3, 2, 1):
        divs = [k for k in range(1, min(rest, 64) + 1) if rest % k == 0]
        ne[i] = d.pick(divs)
        rest //= ne[i]
    ne[0] = rest
    if ne[0] % TYPES[t].blck_size:
        return (n, 1, 1, 1)
    return tuple(ne)  # type: ignore[return-value]


def p_cont(d: Draw) -> Proto:
    a = S(d.ftype(), d.shape())
    n = a.ne[0] * a.ne[1] * a.ne[2] * a.ne[3]
    return Proto([a], node_ne=_factor4(d, n, a.type))


def p_reshape(d: Draw) -> Proto:
    a = S(d.ftype(), d.shape(), layout="contig" if d.p(0.7) else None)
    n = a.ne[0] * a.ne[1] * a.ne[2] * a.ne[3]
    return Proto([a], node_ne=_factor4(d, n, a.type), consumer=d.pick(("CONT", "SQR", "ADD")))


def p_view(d: Draw) -> Proto:
    a = S(d.ftype(), d.shape())
    info = TYPES[a.type]
    ne = tuple(max(1, d.r.randint(1, x)) for x in a.ne)
    ne = (blocked(a.type, ne[0]) if ne[0] >= info.blck_size else info.blck_size,) + ne[1:]
    row = ne[0] // info.blck_size * info.type_size
    # the caller's strides: those of the source, packed ones, or anything (the rule checks only
    # the packed size plus the offset against the source)
    choice = d.r.random()
    if choice < 0.4:
        nb = None  # the source's, filled in later
    elif choice < 0.7:
        nb = contiguous_nb(a.type, ne)
    else:
        nb = (info.type_size, d.pick((0, 1, row, row + 1, 4096)), d.pick((0, 3, row * 2)), d.pick((0, 1 << 16)))
    offs = d.pick((0, 0, info.type_size, 1, d.r.randint(0, 256)))
    return Proto([a], params=[offs & 0xFFFFFFFF, 0], node_ne=ne, node_nb=nb,  # type: ignore[arg-type]
                 consumer=d.pick(("CONT", "SQR", "ADD", "RMS_NORM", "ARGSORT", "CLAMP")))


def p_permute(d: Draw) -> Proto:
    a = S(d.ftype(), d.shape())
    axes = [0, 1, 2, 3]
    d.r.shuffle(axes)
    if d.p(0.1):
        axes[d.r.randrange(4)] = d.pick((4, -1, 0))
    return Proto([a], params=axes, consumer=d.pick(("CONT", "SQR", "ADD", "SOFT_MAX", "CPY")))


def p_transpose(d: Draw) -> Proto:
    return Proto([S(d.ftype(), d.shape())], consumer=d.pick(("CONT", "SQR", "ADD", "CPY", "MUL_MAT")))


# Block types CPY and SET_ROWS quantize into (a CPU from_float; ggml-cpu.cpp:434-442 abort on the
# others): every one is a planner/kernel edge of its own (its block size sets the row lengths).
Q_DST = tuple(t for t in ALL_TYPES if TYPES[t].blck_size > 1 and t not in (16, 17, 18, 19, 21, 22, 29))


def _cpy_planner_edge(d: Draw) -> Proto:
    """A quantizing copy whose source and destination rows differ in length (same element
    count): ggml_graph_plan sizes each thread's F32 row from the destination (ggml-cpu.c:2862),
    dup_to_q writes the source row into it (ops.cpp:297): longer source rows write past the work
    buffer, shorter or equal ones do not. Every block type with a quantizer; source rows split
    over 1 to 17 rows so that one to all of the server's threads write."""
    bt = d.pick(Q_DST)
    blk = TYPES[bt].blck_size
    ka = d.pick((1, 1, 2, 3, 4, 8))  # source row in blocks
    rows = d.pick((1, 2, 3, 4, 5, 8, 17))
    planes = d.pick((1, 1, 2, 3))
    blocks = ka * rows * planes
    kb = d.pick([k for k in range(1, blocks + 1) if blocks % k == 0 and k <= 4 * ka])  # destination row
    d.tag("planner-edge")
    d.tag("src-row-longer" if ka > kb else "src-row-shorter" if ka < kb else "rows-equal")
    a = Src(d.pick(FLOATS), (blk * ka, rows, planes, 1), layout="contig" if d.p(0.8) else None)
    return Proto([a, Src(bt, (blk * kb, blocks // kb, 1, 1), fill="zero", layout="contig")])


def p_cpy(d: Draw) -> Proto:
    if d.p(0.4):
        return _cpy_planner_edge(d)
    a = S(d.ftype((F32, F16, BF16, F32, Q8_0, 2, 12, 20)), d.shape())  # block sources: dequantizing copies
    if d.p(0.35):
        return Proto([a, None], node_type=d.ftype((F32, F16, BF16, Q8_0, 2, I32)), cast=True)
    n = a.ne[0] * a.ne[1] * a.ne[2] * a.ne[3]
    bt = d.ftype((F32, F16, BF16, Q8_0, 2, 20, I32))
    bne = _factor4(d, n, bt) if d.p(0.5) else a.ne
    return Proto([a, S(bt, bne, fill="zero")])


def p_binary(d: Draw) -> Proto:
    a = S(d.ftype(), d.shape())
    t = a.type if d.p(0.7) else d.ftype((F32, F16, BF16))
    bne = tuple(x if d.p(0.6) else d.pick([k for k in range(1, x + 1) if x % k == 0]) for x in a.ne)
    return Proto([a, S(t, bne)])


def p_acc_set(d: Draw, types: tuple[int, ...] = (F32,)) -> Proto:
    a = S(d.ftype(types), d.shape())
    bne = tuple(d.r.randint(1, x) for x in a.ne)
    b = S(a.type if d.p(0.9) else d.ftype(types), bne)
    cnb = contiguous_nb(F32, a.ne)
    n_a = cnb[3] * a.ne[3]
    s1 = d.pick((cnb[1], cnb[1], 0, 4, cnb[1] + 4, d.i(0, n_a)))
    s2 = d.pick((cnb[2], cnb[2], 0, s1 * bne[1], d.i(0, n_a)))
    s3 = d.pick((cnb[3], cnb[3], 0, s2 * bne[2], d.i(0, n_a)))
    end = (bne[0] - 1) * 4 + (bne[1] - 1) * s1 + (bne[2] - 1) * s2 + (bne[3] - 1) * s3 + 4
    offset = d.pick((0, max(0, n_a - end), max(0, n_a - end) + 1, max(0, n_a - end) // 4 * 4, d.i(0, n_a)))
    return Proto([a, b], params=[s1, s2, s3, offset, d.pick((0, 1))])


def p_set(d: Draw) -> Proto:
    return p_acc_set(d, (F32, I32))  # set_f32 and set_i32 (ops.cpp ggml_compute_forward_set)


def p_concat(d: Draw) -> Proto:
    # any type: the element-wise kernels (F32/F16/BF16/I32/I16/I8) and, for every other type, the
    # row-of-bytes copy of concat_any (block types need whole blocks per row: ne0 stays blocked)
    a = S(d.ftype((F32, F16, BF16, I32, I16, I8, I64, Q8_0, 2)), d.shape())
    dim = d.pick((0, 1, 2, 3, 0, d.i(0, 3)))
    bne = list(a.ne)
    if 0 <= dim < 4:
        bne[dim] = d.dim() if dim else blocked(a.type, d.dim())
    b = S(a.type, tuple(bne))
    srcs = [a, b]
    if 0 <= dim < 4 and d.p(0.25):
        # an empty source (RWKV's token shift concatenates an empty view for a one-token batch):
        # no layout rule runs on it; sometimes it has no buffer at all
        k = d.r.randrange(2)
        ne = list(srcs[k].ne)
        ne[dim] = 0
        srcs[k] = Src(a.type, tuple(ne), "none", "nobuf" if d.p(0.3) else None)  # type: ignore[arg-type]
        d.tag("empty-src")
    return Proto(srcs, params=[dim])  # type: ignore[arg-type]


def p_add_id(d: Draw) -> Proto:
    ne0, n_as, n_used, T = d.dim(True), d.dim(), d.dim(), d.dim()
    return Proto([S(d.ftype((F32,)), (ne0, n_used, T)), S(d.ftype((F32,)), (ne0, n_as)),
                  S(I32, (n_used, T), fill="zero")])


def p_get_rows(d: Draw) -> Proto:
    a = S(d.ftype((F32, F16, Q8_0, I32, 2, 12)), d.shape())
    b = S(d.ftype((I32,)), (d.dim(), a.ne[2], a.ne[3]), fill="zero")
    return Proto([a, b])


def p_set_rows(d: Draw) -> Proto:
    if d.p(0.4):
        # the planner's edge: F16 rows into another type go through one F32 row per thread, and
        # the planner counts one task (ggml-cpu.c:2367) while every thread writes (ops.cpp:5501)
        d.tag("planner-edge")
        dt = d.pick(Q_DST + (F32, BF16, F32, BF16))
        dst = S(dt, (blocked(dt, d.pick((1, 16, 17, 32, 64, 256, 1024))), d.pick((2, 4, 8, 9, 33)),
                     d.pick((1, 2)), 1), layout="contig")
        n = d.pick((1, 2, 3, 4, 5, 8, 16)) % dst.ne[1] or 1
        b = Src(F16, (dst.ne[0], n, dst.ne[2], 1), layout="contig" if d.p(0.8) else None)
        c = S(d.ftype((I64, I32)), (n, 1, 1), fill="zero")
        return Proto([b, c, dst])
    dst = S(d.ftype((F32, F16, Q8_0, BF16)), d.shape())
    n = d.dim()
    c1 = d.pick([k for k in range(1, dst.ne[2] + 1) if dst.ne[2] % k == 0])
    c2 = d.pick([k for k in range(1, dst.ne[3] + 1) if dst.ne[3] % k == 0])
    b = S(d.ftype((F32, F16)), (dst.ne[0], n, dst.ne[2], dst.ne[3]))
    c = S(d.ftype((I64, I32)), (n, c1, c2), fill="zero")
    if d.p(0.2):
        # no rows to set (test-backend-ops' r=1,v=1): empty rows and indices, sometimes no buffer
        b = Src(b.type, (dst.ne[0], 0, dst.ne[2], dst.ne[3]), "none", "nobuf" if d.p(0.3) else None)  # type: ignore[arg-type]
        c = Src(c.type, (0, c1, c2, 1), "none", "nobuf" if d.p(0.3) else None)  # type: ignore[arg-type]
        d.tag("empty-src")
    return Proto([b, c, dst])


def p_mul_mat(d: Draw) -> Proto:
    at = d.ftype((F32, F16, Q8_0, 2, 12, BF16, 20))
    K = blocked(at, d.dim(True))
    M, N = d.dim(True), d.dim(True)
    A2, A3 = d.dim(), d.pick((1, 1, 2, 3))
    r2, r3 = d.pick((1, 1, 2, 3)), d.pick((1, 1, 2))
    bt = F32 if d.p(0.7) else d.ftype((F32, F16, 8, 15, BF16))
    prm = [d.pick((0, 10, 0, 15, 20, 30, 40, 5)), d.pick((0, 0, 0, 1, 2)), 0, d.pick((0, 0, 10, 20, 7))]
    if prm[1] == 1:  # the Hadamard hint: a square power-of-two F32 src0
        n = d.pick((1, 2, 16, 64, 256, 3))
        return Proto([S(F32, (n, n)), S(d.pick((F32, F16)), (n, N, A2 * r2, A3 * r3))], params=prm)
    return Proto([S(at, (K, M, A2, A3)), S(bt, (K, N, A2 * r2, A3 * r3))], params=prm)


def p_mul_mat_id(d: Draw) -> Proto:
    at = d.ftype((F32, F16, Q8_0, 2, 12))
    K = blocked(at, d.dim(True))
    # every dimension the planner multiplies (n_as x ids.ne0 x ids.ne1, ggml_graph_plan) may be large
    M, n_as = d.dim(True), d.dim(True)
    n_used, T = d.dim(True), d.dim(True)
    if d.p(0.15):  # small tensors whose dimensions the planner multiplies into a work size
        d.tag("planner-product")
        K, M = blocked(at, 1), 1
        n_as, n_used, T = d.pick((1 << 12, 1 << 14, 1 << 16)), d.pick((1, 1 << 8, 1 << 12)), d.pick((16, 256, 1024))
    b1 = d.pick((1, n_used))
    bt = F32 if d.p(0.8) else d.ftype((F32, F16, 8, 15))
    prm = [d.pick((0, 10, 0, 20)), 0, 0, d.pick((0, 0, 10))]
    return Proto([S(at, (K, M, n_as)), S(bt, (K, b1, T)), S(I32, (n_used, T), fill="zero")], params=prm)


def p_soft_max(d: Draw) -> Proto:
    a = S(d.ftype((F32,)), d.shape())
    mask = sinks = None
    if d.p(0.6):
        m1 = a.ne[1] + d.pick((0, 0, 1, 7))
        m2 = d.pick([k for k in range(1, a.ne[2] + 1) if a.ne[2] % k == 0])
        m3 = d.pick([k for k in range(1, a.ne[3] + 1) if a.ne[3] % k == 0])
        mask = S(d.ftype((F32, F16)), (a.ne[0], m1, m2, m3))
    if d.p(0.3 if mask is not None else 0.5):  # one F32 per head, read with or without a mask
        sinks = S(F32, (a.ne[2],))
    return Proto([a, mask, sinks], params=[d.f(), d.f(0, 8) if d.p(0.5) else 0])


def p_rope(d: Draw) -> Proto:
    mode = d.pick((0, 2, 8, 24, 40, 0, 2, 1))
    ne0 = d.pick((2, 4, 8, 16, 32, 64, 128, 6, 10, 5, 7, 9))  # odd: the unrotated copy ends past each row
    a = S(d.ftype((F32, F16)), (ne0, d.dim(), d.dim(), d.pick((1, 1, 2))))
    per = 4 if mode & 8 else 1
    b = S(I32, (a.ne[2] * per,), fill="zero")
    n_dims = ne0 // 2 if mode == 24 else d.pick((ne0, ne0, ne0 // 2, 2, max(2, ne0 - 2)))
    n_dims -= n_dims % 2
    n_offs = 0 if mode == 24 else d.pick((0, 0, 0, 2, ne0 - n_dims))
    c = None
    if d.p(0.4):
        # freq factors: the kernel reads ceil(ne0/2) floats from c's data (ops.cpp:6209-6210,
        # 6234-6235), the constructor asks n_dims/2 (test-backend-ops passes that many): partial
        # rotation and vision read past c, in its buffer (room) or flush against its end (refused)
        short, reach = max(1, n_dims // 2), (ne0 + 1) // 2
        n = d.pick((short, short, short, reach, short + 1, short - 1))
        need = max(0, reach - n) * 4
        room = d.pick((0, 0, max(0, need - 4), need, need, need + 64))
        if need:
            d.tag("ff-room-short" if room < need else "ff-room")
        c = Src(F32, (max(1, n), 1, 1, 1), room=room)
    secs = [0, 0, 0, 0]
    if mode & 8:
        secs = [d.r.randint(0, ne0 // 2) for _ in range(4)]
        if not any(secs):
            secs[0] = 1
    prm = [0, n_dims, mode, 0, d.pick((0, 4096, 1)), d.f(1, 1e6), d.f(0, 2), d.f(-1, 1), d.f(0, 2), d.f(0, 64),
           d.f(0, 4), *secs, n_offs]
    return Proto([a, b, c], params=prm)


def p_flash(d: Draw) -> Proto:
    D = d.pick((4, 8, 16, 32, 64, 40))
    Dv = D if d.p(0.7) else d.pick((4, 8, 16, 32))
    nq, nkv = d.dim(), d.dim(True)
    H = d.pick((1, 2, 4, 8))
    Hkv = d.pick([k for k in (1, 2, 4, 8) if H % k == 0])
    kt = d.ftype((F16, F32, Q8_0, BF16))
    vt = kt if d.p(0.7) else d.ftype((F16, F32, Q8_0))
    q = S(F32, (D, nq, H))
    k = S(kt, (D, nkv, Hkv))
    v = S(vt, (Dv, nkv, Hkv))
    mask = sinks = None
    if d.p(0.7):
        mask = S(F16, (nkv + d.pick((0, 0, 3)), nq + d.pick((0, 0, 1)), d.pick((1, H)) if H > 1 else 1))
        if d.p(0.3):
            sinks = S(F32, (H,))
    prm = [d.f(0, 1), d.f(0, 8) if mask is not None and d.p(0.3) else 0, d.f(0, 50) if d.p(0.3) else 0,
           d.pick((0, 10, 0)), d.pick((0, 0, 1, nkv, nkv + 1)) if mask is not None else 0]
    return Proto([q, k, v, mask, sinks], params=prm)


def p_ssm_conv(d: Draw) -> Proto:
    d_conv, d_inner, n_t, n_s = d.pick((1, 2, 4)), d.dim(True), d.dim(), d.dim()
    return Proto([S(d.ftype((F32,)), (d_conv - 1 + n_t, d_inner, n_s)), S(d.ftype((F32,)), (d_conv, d_inner))])


def p_glu(d: Draw) -> Proto:
    t = d.ftype((F32, F16, BF16))
    ne = d.shape()
    b = None
    if d.p(0.4):  # split: a and b of the same shape, any width
        b = S(t, ne)
    else:  # fused: both halves in one row; an odd width leaves the last element out
        ne = (ne[0] * 2 + (1 if d.p(0.3) else 0),) + ne[1:]
    op = d.pick((0, 1, 2, 3, 4, 5, 6, d.i(0, 6)))
    return Proto([S(t, ne), b], params=[op, d.pick((0, 1)), d.f(0, 4), d.f(0, 16)])


def p_unary(d: Draw) -> Proto:
    op = d.r.randint(0, 21) if d.p(0.9) else d.i(0, 21)
    extra = [d.f() for _ in range(4)] if op == 17 else [0, 0, 0, 0]
    return Proto([S(d.ftype(), d.shape())], params=[op, *extra])


def p_arange(d: Draw) -> Proto:
    # float precision: (stop - start) / step rounded in float by the kernel
    big = d.pick((1.0, 100.0, 16777216.0, 1e7, 3e7, 1e5))
    start = d.pick((0.0, -big, big, d.r.uniform(-big, big), 0.1, 1 / 3))
    n = d.pick((1, 2, 3, 7, 100, 1000, 4097, d.r.randint(1, 5000)))
    step = d.pick((1.0, 0.1, 1 / 3, 0.7, 1e-3, d.r.uniform(1e-3, 10)))
    stop = start + n * step * d.pick((1.0, 1.0000001, 0.9999999, 1.0))
    if d.p(0.5):  # magnitudes apart: stop - start rounds in float (the kernel) but not in double
        start = d.pick((-1, 1)) * 10 ** d.r.uniform(-3, 7.5)
        step = 10 ** d.r.uniform(-3, 1)
        stop = start + d.r.randint(1, 3000) * step * d.pick((1.0, 1 + 1e-7, 1 - 1e-7))
    return Proto([], params=[fbits(start), fbits(stop), fbits(step)])


def p_timestep(d: Draw) -> Proto:
    return Proto([S(d.ftype((F32,)), (d.dim(True),))], params=[d.pick((1, 2, 3, 64, 320, 1001, d.i(1, 2048))),
                                                              d.i(1, 10000)])


def p_pad(d: Draw) -> Proto:
    pads = [d.pick((0, 0, 1, 2, 7, d.i(0, 16))) for _ in range(8)]
    return Proto([S(d.ftype((F32,)), d.shape())], params=[*pads, d.pick((0, 0, 1))])


def p_pad_reflect(d: Draw) -> Proto:
    a = S(d.ftype((F32,)), d.shape())
    return Proto([a], params=[d.pick((0, 1, a.ne[0] - 1, a.ne[0])), d.pick((0, 1, a.ne[0] - 1, a.ne[0]))])


def p_roll(d: Draw) -> Proto:
    a = S(d.ftype((F32,)), d.shape())
    return Proto([a], params=[d.pick((0, 1, -1, x - 1, 1 - x, x)) for x in a.ne])


def p_group_norm(d: Draw) -> Proto:
    a = S(d.ftype((F32,)), d.shape())
    # more groups than channels leaves the extra ones empty: up to GROUP_NORM_EXTRA of those
    many = d.pick((GROUP_NORM_EXTRA, GROUP_NORM_EXTRA - 1, GROUP_NORM_EXTRA + 1, d.r.randint(65, GROUP_NORM_EXTRA),
                   a.ne[2] + GROUP_NORM_EXTRA))
    g = d.pick((1, 2, a.ne[2], a.ne[2] + 1, d.i(1, 64), many, many))
    return Proto([a], params=[g, d.f(0, 1e-3)])


def p_diag_mask(d: Draw) -> Proto:
    a = S(d.ftype((F32,)), d.shape())
    return Proto([a], params=[d.pick((0, 1, a.ne[0], a.ne[0] + 1, d.i(0, 1000)))])


# -- the ops whose rules came with firewall v3 ---------------------------------------------------


def _lay(d: Draw) -> str | None:
    """A layout for a source the rule wants contiguous: packed, any stride on its size-1
    dimensions (what ggml_is_contiguous ignores), or the adversary's free choice (mostly refused)."""
    return d.pick(("contig", "size1", "size1", None))


def _conv_params(d: Draw, k: int, n: int) -> tuple[int, int, int]:
    """(stride, padding, dilation) of one im2col axis for a kernel of ``k`` over ``n`` inputs."""
    st = d.pick((1, 1, 2, 3, k, d.i(1, 8)))
    pad = d.pick((0, 0, 1, k // 2, k, n, d.i(0, 16)))
    dil = d.pick((1, 1, 2, 3, d.i(0, 4)))
    return st, pad, dil


def p_im2col(d: Draw) -> Proto:
    """ggml_im2col: a (the convolution kernel: only its shape is read), b the image; params
    {s0, s1, p0, p1, d0, d1, is_2D}; the result type is the caller's (F32 or F16)."""
    two_d = d.p(0.6)
    IW, IC, N = d.dim(True), d.pick((1, 1, 2, 3, d.dim())), d.pick((1, 1, 2, d.dim()))
    KW = d.pick((1, 2, 3, 5, 7, IW, IW + 1, d.dim()))
    bt = d.ftype((F32, F32, F16))
    kt = d.ftype((F16, F32))
    s0, p0, d0 = _conv_params(d, KW, IW)
    if two_d:
        IH = d.pick((1, 2, 3, d.dim(), d.dim(True)))
        KH = d.pick((1, 2, 3, 5, IH, IH + 1, d.dim()))
        s1, p1, d1 = _conv_params(d, KH, IH)
        a, b = S(kt, (KW, KH, IC, d.pick((1, 2, 4)))), S(bt, (IW, IH, IC, N))
    else:
        s1, p1, d1 = d.pick((0, 0, 1)), d.pick((0, 0, 1)), d.pick((0, 0, 1))  # not read in 1D
        a, b = S(kt, (KW, IC, d.pick((1, 2, 4)))), S(bt, (IW, IC, N))
    if d.p(0.6):  # rows packed (2D needs them; 1D any nb1)
        b.layout = _lay(d)
    node_type = F32 if bt == F32 and d.p(0.6) else d.pick((F16, F16, F32, d.ftype()))
    return Proto([a, b], params=[s0, s1, p0, p1, d0, d1, 1 if two_d else d.pick((0, 0, 0, 2))],
                 node_type=node_type)


def _pool_axis(d: Draw, n: int, window: int | None = None) -> tuple[int, int, int]:
    """(kernel, stride, padding) of one pooling axis over ``n`` inputs."""
    if window is not None:  # a window far wider than the input, padded to fit: k0 * k1 past 2^31
        return window, d.pick((1, 2, window)), window // 2
    k = d.pick((1, 2, 3, 5, n, n + 1, d.i(1, 16)))
    st = d.pick((1, 1, 2, 3, k, d.i(1, 8)))
    pad = d.pick((0, 0, 1, k // 2, k, -1, d.i(0, 8)))
    return k, st, pad


def p_pool_1d(d: Draw) -> Proto:
    a = S(d.ftype((F32, F16)), d.shape())
    window = d.pick((1 << 16, 1 << 20, 46341)) if d.p(0.1) else None
    k, st, pad = _pool_axis(d, a.ne[0], window)
    if max(k, pad) > 4096:
        # few short rows: the kernel visits every tap of the window (OW * k per row, out-of-range
        # ones too) and a padding of 2^16 makes rows of 2^16 outputs, a compute the cost model
        # charges (minutes are within its budget) but the sanitizer's 10-s oracle would time out
        a = S(a.type, (min(a.ne[0], 64), d.pick((1, 2)), 1, 1))
        d.tag("wide-window")
    return Proto([a], params=[d.pick((0, 1, 0, 1, 2)), k, st, pad])


def p_pool_2d(d: Draw) -> Proto:
    """ggml_pool_2d: the kernel walks planes of a packed source (the rule wants nb as ggml lays it
    out); params {op, k0, k1, s0, s1, p0, p1}."""
    a = S(d.ftype((F32, F16)), d.shape(), layout="contig" if d.p(0.7) else None)
    window = d.pick((46341, 50000, 1 << 16)) if d.p(0.15) else None
    if window is not None:
        d.tag("wide-window")
    k0, s0, p0 = _pool_axis(d, a.ne[0], window)
    k1, s1, p1 = _pool_axis(d, a.ne[1], window)
    return Proto([a], params=[d.pick((0, 1, 0, 1, 2)), k0, k1, s0, s1, p0, p1])


def _state(d: Draw, per_seq: int, n_seqs: int) -> Src:
    """A recurrent state of ``per_seq`` floats per sequence, ne1 = the sequences (what the
    constructor reads as n_seqs), the rest of the elements spread over ne0, ne2, ne3."""
    ne0, ne2 = per_seq, 1
    if d.p(0.3):
        ne2 = d.pick([k for k in (1, 2, 4, 8) if per_seq % k == 0])
        ne0 = per_seq // ne2
    return S(F32, (ne0, n_seqs, ne2), layout=_lay(d))


def _linear_attn_shape(d: Draw, heads: tuple[int, ...]) -> tuple[int, int, int, int]:
    S_ = d.pick(heads)
    H = d.pick((1, 1, 2, 3, 4))
    n_seqs = d.pick((1, 1, 2, 3))
    T = n_seqs * d.pick((1, 1, 2, 5, d.dim(), d.dim(True) if d.limits else 3))
    if d.p(0.08):
        T += 1  # not a multiple of the sequences: refused (the kernel divides T by n_seqs)
    return S_, H, T, n_seqs


def p_rwkv_wkv6(d: Draw) -> Proto:
    """k v r tf td state: [S, H, T] inputs, tf (time_faaaa) at least S*H floats, the state S*S*H
    floats per sequence."""
    S_, H, T, n = _linear_attn_shape(d, (1, 2, 4, 8, 16, 64, 3, 17))
    ins = [S(F32, (S_, H, T), layout=_lay(d)) for _ in range(3)]
    tf = S(F32, d.pick(((S_, H), (S_ * H,), (S_ * H + d.pick((1, 7)),), (S_, H, 2))), layout=_lay(d))
    return Proto([*ins, tf, S(F32, (S_, H, T), layout=_lay(d)), _state(d, S_ * S_ * H, n)])


def p_rwkv_wkv7(d: Draw) -> Proto:
    """r w k v a b state: the head size a multiple of 64 (what the rule asks beyond ggml)."""
    S_, H, T, n = _linear_attn_shape(d, (64, 64, 128, 32, 96))
    return Proto([*(S(F32, (S_, H, T), layout=_lay(d)) for _ in range(6)), _state(d, S_ * S_ * H, n)])


def p_gated_linear_attn(d: Draw) -> Proto:
    """k v q g state, param scale (a float)."""
    S_, H, T, n = _linear_attn_shape(d, (1, 2, 4, 8, 16, 64, 3, 17))
    return Proto([*(S(F32, (S_, H, T), layout=_lay(d)) for _ in range(4)), _state(d, S_ * S_ * H, n)],
                 params=[d.f(0, 2)])


def p_ssm_scan(d: Draw) -> Proto:
    """ggml_ssm_scan (s x dt A B C ids, param K): Mamba-2 (A {1, n_head}, any K) or Mamba-1 (A
    {d_state, n_head}, K = 1); n_head a multiple of the groups. The state slot ids are zero, so
    every sequence reads slot 0 (content-indexed: contained serves only)."""
    d_state = d.pick((1, 4, 16, 64, 128, 3, 17, d.dim(True)))
    head_dim, n_group = d.pick((1, 2, 4, 8, 16, 64, 5)), d.pick((1, 1, 2))
    n_head = n_group * d.pick((1, 1, 2, 3, 4))
    n_tok, n_seqs = d.pick((1, 1, 2, 7, d.dim())), d.pick((1, 1, 2, 3))
    mamba1 = d.p(0.35)
    K = 1 if mamba1 or d.p(0.5) else d.pick((2, 3, d.i(1, 8)))
    slots = n_seqs + d.pick((0, 0, 1, 3))

    def rows() -> str | None:  # x, B, C: only nb0 and nb1 fixed, their planes any stride
        return d.pick(("contig", "contig", "size1", "huge", "bcast", None))

    return Proto([
        S(F32, (d_state, head_dim, n_head, slots), layout=d.pick(("contig", "contig", "size1"))),
        S(F32, (head_dim, n_head, n_tok, n_seqs), layout=rows()),
        S(F32, (n_head, n_tok, n_seqs), layout=_lay(d)),
        S(F32, (d_state if mamba1 else 1, n_head), layout=_lay(d)),
        S(F32, (d_state, n_group, n_tok, n_seqs), layout=rows()),
        S(F32, (d_state, n_group, n_tok, n_seqs), layout=rows()),
        S(I32, (n_seqs,), fill="zero"),
    ], params=[K])


PROTOS: dict[str, Callable[[Draw], Proto]] = {
    "DUP": _one(),
    "ACC": p_acc_set, "SET": p_set,
    "PAD_REFLECT_1D": p_pad_reflect,
    "ADD": p_binary, "SUB": p_binary, "MUL": p_binary, "DIV": p_binary,
    "ADD_ID": p_add_id,
    "SQR": _one(), "SQRT": _one(), "LOG": _one(), "SIN": _one(), "COS": _one(),
    "SUM": _one(), "SUM_ROWS": _one((F32,)), "CUMSUM": _one((F32,)), "MEAN": _one((F32,)),
    "ARGMAX": _one((F32,)),
    "REPEAT": p_repeat,
    "CONCAT": p_concat,
    "NORM": _one((F32,), _p_float(0, 1e-3)), "RMS_NORM": lambda d: _then(d, _one((F32,), _p_float(0, 1e-3))(d), "MUL"),
    "L2_NORM": _one((F32,), _p_float(0, 1e-3)),
    "GROUP_NORM": p_group_norm,
    "MUL_MAT": p_mul_mat, "MUL_MAT_ID": p_mul_mat_id,
    "SCALE": _one((F32, F32, BF16), _p_float(), _p_float()),
    "CPY": p_cpy, "CONT": p_cont,
    "RESHAPE": p_reshape, "VIEW": p_view, "PERMUTE": p_permute, "TRANSPOSE": p_transpose,
    "GET_ROWS": p_get_rows, "SET_ROWS": p_set_rows,
    "DIAG_MASK_INF": p_diag_mask, "DIAG_MASK_ZERO": p_diag_mask,
    "SOFT_MAX": p_soft_max, "ROPE": p_rope,
    "CLAMP": _one((F32, F16), _p_float(), _p_float()),
    "PAD": p_pad, "TIMESTEP_EMBEDDING": p_timestep,
    "FILL": _one((F32, F16), _p_float()),
    "ARGSORT": _one((F32,), _p_int(0, 1)), "TOP_K": p_top_k,
    "ARANGE": p_arange, "ROLL": p_roll, "SSM_CONV": p_ssm_conv,
    "LEAKY_RELU": _one((F32, F16), _p_float(-2, 2)),
    "FLASH_ATTN_EXT": p_flash, "UNARY": p_unary, "GLU": p_glu,
    "IM2COL": p_im2col, "POOL_1D": p_pool_1d, "POOL_2D": p_pool_2d, "SSM_SCAN": p_ssm_scan,
    "RWKV_WKV6": p_rwkv_wkv6, "RWKV_WKV7": p_rwkv_wkv7, "GATED_LINEAR_ATTN": p_gated_linear_attn,
}
VIEW_OPS = frozenset({"RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"})
# Ops with a rule and no proto (each with the reason it cannot be sampled): none since firewall v3.
UNSAMPLED: frozenset[str] = frozenset()
# Ops forwarded only to a contained serve (oprules.needs_containment: content-indexed, unchecked).
# Their cases are judged, and run through the gate, with FirewallPolicy(contained=True): in
# production they would reach a fresh sandboxed process per session, never a shared server.
CONTAINED_OPS = frozenset(op for op in PROTOS if needs_containment(op))


# Ops whose CPU kernel addresses params->wdata, the work buffer ggml_graph_plan sizes (the kernel
# side in rpcguard/protocol/workuse.py; the planner's reservations for ACC, ADD_ID, MUL_MAT_ID,
# CONV_2D and CONV_3D, whose kernels never write past it, in workbuf.py): run at several server
# thread counts by accept_run --threads.
WORK_OPS = tuple(op for op in ("CPY", "DUP", "CONT", "ADD", "ADD1", "ACC", "ADD_ID", "OUT_PROD", "SET_ROWS",
                               "SOFT_MAX", "ROPE", "ROPE_BACK", "TOP_K", "FLASH_ATTN_EXT", "CONV_TRANSPOSE_1D",
                               "CONV_TRANSPOSE_2D", "CONV_2D", "CONV_3D", "COUNT_EQUAL", "CROSS_ENTROPY_LOSS",
                               "GATED_DELTA_NET", "LIGHTNING_INDEXER", "MUL_MAT", "MUL_MAT_ID"))


def policy_for(op: str) -> FirewallPolicy:
    """The firewall policy a case of ``op`` is judged by: the default, contained for CONTAINED_OPS."""
    return FirewallPolicy(contained=True) if op in CONTAINED_OPS else FirewallPolicy()


def ops() -> list[str]:
    """Every op with a rule for 7.0.0 and a proto, in op-id order."""
    return [RULES.names[i] for i in sorted(RULES.rows) if RULES.names[i] in PROTOS]



# -- protos of the rules of issue 20's second batch (branch rules2) ------------------------------


def p_upscale(d: Draw) -> Proto:
    """ggml_interpolate: any target shape (down, up, non-integer, 1), every mode and flag; unknown
    flags and antialias without bilinear are drawn too (the rule refuses them)."""
    a = S(d.ftype((F32,)), d.shape())
    tgt = tuple(max(1, d.pick((x, 2 * x, 3 * x, x // 2, x // 3, x + 1, x - 1, 1, d.r.randint(1, 64)))) for x in a.ne)
    mode = d.pick((0, 1, 2)) | d.pick((0, 0, 0x100, 0x200, 0x300))
    if d.p(0.05):
        mode = d.pick((3, 0xFF, 0x400, 0x202, -1))
    return Proto([a], params=[mode], node_ne=tgt)  # type: ignore[arg-type]


def p_conv_2d_dw(d: Draw) -> Proto:
    """ggml_conv_2d_dw_direct: packed or channels-first (both sources), F32/F16 weights, params at
    their edges (0, negative, past 2^30: refused by the rule)."""
    c, n = d.pick((1, 2, 3, 4, 8, 9, 16, 17, d.r.randint(1, 64))), d.pick((1, 1, 2, 3))
    kw, kh = (d.pick((1, 2, 3, 5, d.r.randint(1, 9))) for _ in range(2))
    w, h = (d.pick((1, 2, 3, 5, 8, 17, 34, d.r.randint(1, 70))) for _ in range(2))
    cwhn = d.p(0.45)
    a = S(d.ftype((F32, F16)), (kw, kh, 1, c), layout="cwhn_w" if cwhn else d.pick(("contig", None)))
    b = S(d.ftype((F32,)), (w, h, c, n), layout="cwhn" if cwhn else d.pick(("contig", None)))
    strides = [d.pick((1, 1, 2, 3)) if d.p(0.9) else d.i(1, 8) for _ in range(2)]
    pads = [d.pick((0, 0, 1, 2, kw)) if d.p(0.9) else d.i(0, 9) for _ in range(2)]
    dils = [d.pick((1, 1, 2, 3)) if d.p(0.9) else d.i(1, 4) for _ in range(2)]
    return Proto([a, b], params=[*strides, *pads, *dils])


def p_conv_transpose_1d(d: Draw) -> Proto:
    """ggml_conv_transpose_1d: F32/F16 kernels [K, Cout, Cin], a matrix input [L, Cin], s0 at its
    edges (0, negative, huge: refused), p0/d0 sometimes off their asserted 0/1."""
    k, oc, ic = d.pick((1, 2, 3, 7, 16, d.r.randint(1, 40))), d.pick((1, 2, 5, 17, d.r.randint(1, 64))), \
        d.pick((1, 2, 3, 8, 9, d.r.randint(1, 64)))
    a = S(d.ftype((F32, F16)), (k, oc, ic))
    b = S(d.ftype((F32,)), (d.pick((1, 2, 5, 13, 64, d.r.randint(1, 600))), ic))
    s0 = d.pick((1, 1, 2, 3, 4, k, k + 1)) if d.p(0.9) else d.i(1, 16)
    return Proto([a, b], params=[s0, 0 if d.p(0.95) else 1, 1 if d.p(0.95) else 2])


PROTOS.update({"UPSCALE": p_upscale, "CONV_2D_DW": p_conv_2d_dw, "CONV_TRANSPOSE_1D": p_conv_transpose_1d})



# -- convolutions (3D, transposed, col2im) --------------------------------------------------------


def _edge_param(d: Draw, usual: tuple[int, ...], lo: int, hi: int) -> int:
    """A stride/padding/dilation: mostly ``usual``, sometimes any in [lo, hi] or an int edge."""
    return d.pick(usual) if d.p(0.9) else d.i(lo, hi)


def _conv_weights_layout(d: Draw) -> str | None:
    """The kernels assert contiguous weights: packed, any stride on a size-1 dim, or free."""
    return d.pick(("contig", "contig", "size1", None))


def p_conv_2d(d: Draw) -> Proto:
    """ggml_conv_2d_direct: F32/F16 weights [KW, KH, IC, OC] (contiguous, asserted), an F32 input of
    any layout (test-backend-ops' cwhn permutes it), params at their edges; sometimes one patch
    at the 16 MiB the planner gives (the kernel asserts a batch of at least one)."""
    ic, oc, n = d.pick((1, 2, 3, 8, 16, d.r.randint(1, 40))), d.pick((1, 2, 4, 9, d.r.randint(1, 40))), d.pick((1, 1, 2, 3))
    kw, kh = (d.pick((1, 2, 3, 5, d.r.randint(1, 9))) for _ in range(2))
    w, h = (d.pick((1, 2, 3, 8, 17, 34, d.r.randint(1, 64))) for _ in range(2))
    kt = d.ftype((F32, F16))
    if d.p(0.05):  # a patch of ~16 MiB: 4M taps of F32 (or 8M of F16) with one output channel
        d.tag("wide-patch")
        kw, kh, w, h, oc, n = 1, 1, 1, 1, 1, 1
        ic = d.pick(((1 << 22) - 1, 1 << 22)) if kt == F32 else d.pick(((1 << 23) - 2, 1 << 23))
    strides = [_edge_param(d, (1, 1, 2, 3), 0, 8) for _ in range(2)]
    pads = [_edge_param(d, (0, 0, 1, 2, kw), -1, 9) for _ in range(2)]
    dils = [_edge_param(d, (1, 1, 2, 3), 0, 4) for _ in range(2)]
    if ic > 1 << 20:  # one output position: every patch gathers all ~8M taps (seconds each)
        strides, pads, dils = [d.pick((1, 2, 0x7FFFFFFF)), 1], [0, 0], [d.pick((1, 0x7FFFFFFF)), 1]
    elif max(pads) > 64:
        # a padding from the int edges makes rows of up to 2^17 output positions: few taps each,
        # else a compute the cost model charges (minutes are within its budget) but the
        # sanitizer's 10-s oracle would time out
        ic, oc, n, kw, kh = 1, d.pick((1, 2)), 1, min(kw, 3), min(kh, 3)
        d.tag("wide-pad")
    a = S(kt, (kw, kh, ic, oc), layout=_conv_weights_layout(d))
    b = S(d.ftype((F32,)), (w, h, ic, n), layout=d.pick(("cwhn", "contig", None, None)) if ic < 1 << 20 else "contig")
    return Proto(_conv_empty_src(d, [a, b], 2), params=[*strides, *pads, *dils])


def _conv_empty_src(d: Draw, srcs: list[Src], dims: int) -> list[Src | None]:
    """10 %: a 0 in one of the first ``dims`` sides of the weights or the input (test-backend-ops'
    KW = 0 cases of CONV_3D), no layout rule on it, sometimes without a buffer."""
    if d.p(0.1):
        k = d.r.randrange(2)
        ne = list(srcs[k].ne)
        ne[d.r.randrange(dims)] = 0
        # the strides ggml_new_tensor gives it (the rule asks them), else any (refused)
        layout = "nobuf" if d.p(0.3) else d.pick(("contig", "contig", "contig", None))
        srcs[k] = Src(srcs[k].type, tuple(ne), "none", layout)  # type: ignore[arg-type]
        d.tag("empty-src")
    return list(srcs)


def p_conv_3d(d: Draw) -> Proto:
    """ggml_conv_3d_direct: weights [KW, KH, KD, IC*OC], input [W, H, D, IC*N], params {s, p, d x3,
    IC, N, OC} (sometimes negative counts whose products match, or mismatched ones)."""
    ic, oc, n = d.pick((1, 2, 3, d.r.randint(1, 8))), d.pick((1, 2, 3, d.r.randint(1, 8))), d.pick((1, 1, 2))
    ks = [d.pick((1, 2, 3, d.r.randint(1, 5))) for _ in range(3)]
    ins = [d.pick((1, 2, 5, 9, d.r.randint(1, 24))) for _ in range(3)]
    strides = [_edge_param(d, (1, 1, 2), 0, 4) for _ in range(3)]
    pads = [_edge_param(d, (0, 0, 1, 2), -1, 5) for _ in range(3)]
    dils = [_edge_param(d, (1, 1, 2), 0, 3) for _ in range(3)]
    if max(pads) > 16:  # as p_conv_2d: many output positions, few taps each (the 10-s oracle)
        ic, oc, n, ks, ins = 1, 1, 1, [min(k, 2) for k in ks], [min(x, 2) for x in ins]
        d.tag("wide-pad")
    a = S(d.ftype((F32, F16)), (*ks, ic * oc), layout=_conv_weights_layout(d))
    b = S(d.ftype((F32,)), (*ins, ic * n))
    counts = [ic, n, oc] if d.p(0.9) else d.pick(([-ic, -n, -oc], [ic * oc, 1, 1], [0, n, oc]))
    return Proto(_conv_empty_src(d, [a, b], 3), params=[*strides, *pads, *dils, *counts])


def p_im2col_3d(d: Draw) -> Proto:
    """ggml_im2col_3d: kernel [KW, KH, KD, OC*IC] (only its shape is read), input [W, H, D, N*IC]
    of any layout (test-backend-ops' v=1 is a view), IC sometimes 0, negative or above b.ne3, the
    result F32/F16 (BF16 and others drawn too: the kernel aborts on them)."""
    ic, n = d.pick((1, 2, 3, d.r.randint(1, 9))), d.pick((1, 1, 2, 3))
    ks = [d.pick((1, 2, 3, d.r.randint(1, 5))) for _ in range(3)]
    ins = [d.pick((1, 2, 5, 10, d.r.randint(1, 24))) for _ in range(3)]
    a = S(d.ftype((F16, F32)), (*ks, ic * d.pick((1, 2))))
    b = S(d.ftype((F32,)), (*ins, ic * n + d.pick((0, 0, 0, 1))))
    strides = [_edge_param(d, (1, 1, 2), 0, 4) for _ in range(3)]
    pads = [_edge_param(d, (0, 0, 1, 2), -1, 5) for _ in range(3)]
    dils = [_edge_param(d, (1, 1, 2), 0, 3) for _ in range(3)]
    p_ic = ic if d.p(0.9) else d.pick((0, -ic, b.ne[3] + 1, 0x7FFFFFFF))
    return Proto([a, b], params=[*strides, *pads, *dils, p_ic], node_type=d.pick((F32, F16, F16, d.ftype())))


def p_col2im_1d(d: Draw) -> Proto:
    """ggml_col2im_1d: a contiguous F32/F16/BF16 matrix [K*OC, T_in], params {s0, OC, p0} at their
    edges (OC not dividing ne0, 0, negative; p0 cropping the whole signal)."""
    k, oc = d.pick((1, 2, 4, 5, 8, 16, d.r.randint(1, 40))), d.pick((1, 3, 4, 32, d.r.randint(1, 64)))
    t_in = d.pick((1, 7, 13, 197, d.r.randint(1, 400)))
    a = S(d.ftype(FLOATS), (k * oc, t_in), layout=_lay(d))
    s0 = _edge_param(d, (1, 2, 3, 4, 8, k), 0, 16)
    p0 = _edge_param(d, (0, 0, 1, 2, k // 2), -1, 64)
    p_oc = oc if d.p(0.9) else d.pick((0, -oc, oc + 1, k * oc + 1))
    return Proto([a], params=[s0, p_oc, p0])


def p_conv_transpose_2d(d: Draw) -> Proto:
    """ggml_conv_transpose_2d_p0: F32/F16 kernel [KW, KH, Cout, Cin], F32 input [W, H, Cin, N] of
    any layout, stride at its edges (0, negative: refused)."""
    cin, cout = d.pick((1, 2, 3, 9, 35, d.r.randint(1, 48))), d.pick((1, 2, 3, 48, d.r.randint(1, 16)))
    kw, kh = (d.pick((1, 2, 3, 5, d.r.randint(1, 7))) for _ in range(2))
    w, h = (d.pick((1, 2, 3, 10, d.r.randint(1, 40))) for _ in range(2))
    a = S(d.ftype((F32, F16)), (kw, kh, cout, cin))
    b = S(d.ftype((F32,)), (w, h, cin, d.pick((1, 1, 2))))
    st = _edge_param(d, (1, 1, 2, 3, kw), -1, 9)
    return Proto([a, b], params=[st])


PROTOS.update({"CONV_2D": p_conv_2d, "CONV_3D": p_conv_3d, "IM2COL_3D": p_im2col_3d, "COL2IM_1D": p_col2im_1d,
               "CONV_TRANSPOSE_2D": p_conv_transpose_2d})

# -- recurrent and newer-model ops --


def p_gated_delta_net(d: Draw) -> Proto:
    """ggml_gated_delta_net (q k v g beta state, param K): v [S_v, H, T, n_seqs], q/k with as
    many or fewer heads (iq1 = iv1 % q.ne1), sequences dividing n_seqs, rows of at least S_v;
    g scalar or per-channel (KDA), beta [1, ...], the state [S_v, S_v, H, n_seqs]; K snapshots.
    Also drawn: q/k/g/beta outer dims the kernel would read past (the rule refuses them)."""
    S_v = d.pick((1, 2, 3, 4, 16, 32, 64, 128, 17))
    Hk = d.pick((1, 1, 2, 3, 4))
    H = Hk * d.pick((1, 1, 2, 3))
    T, n_seqs = d.pick((1, 1, 2, 5, d.dim(), 64 if d.limits else 3)), d.pick((1, 1, 2, 3, 4))
    qs = d.pick([x for x in (1, 2, 3, 4) if n_seqs % x == 0] + [n_seqs, n_seqs])
    if d.p(0.05):
        qs = n_seqs + 1  # more q sequences than v's: n_seqs / q.ne3 == 0
    K = d.pick((1, 1, 1, 2, 3, T, T + 1, d.i(1, 8)))
    kda = d.p(0.35)

    def qk() -> Src:
        ne0 = S_v + (d.pick((1, 5)) if d.p(0.1) else 0)
        t = T + (d.pick((1, -1)) if d.p(0.05) else 0)
        return S(F32, (ne0, Hk, max(1, t), qs), layout=d.pick(("perm", "padded", "huge", "bcast", "parent", None)))

    outer = (H + (1 if d.p(0.05) else 0), T, n_seqs)
    return Proto([
        qk(), qk(),
        S(F32, (S_v, H, T, n_seqs), layout=d.pick(("perm", "padded", "huge", "bcast", "parent", None))),
        S(F32, (S_v if kda else 1, *outer), layout=_lay(d)),
        S(F32, (1, *outer), layout=_lay(d)),
        S(F32, (S_v, S_v, H, n_seqs), layout=_lay(d)),
    ], params=[K])


def p_solve_tri(d: Draw) -> Proto:
    """ggml_solve_tri: A [n, n, B1, B2] square, B [k, n, B1, B2], both contiguous (the rule's),
    A's diagonal random (a zero gives inf/NaN: asserts are compiled out)."""
    n, k = d.pick((1, 2, 3, 8, 16, 64, d.dim())), d.pick((1, 2, 5, 32, d.dim()))
    b1, b2 = d.pick((1, 1, 2, 4)), d.pick((1, 1, 3))
    return Proto([S(d.ftype((F32,)), (n, n, b1, b2), layout=_lay(d)),
                  S(d.ftype((F32,)), (k, n, b1, b2), layout=_lay(d))])


def p_tri(d: Draw) -> Proto:
    n = d.pick((1, 2, 3, 16, 64, d.dim(), d.dim(True) if d.limits else 5))
    a = S(d.ftype((F32,)), (n, n if d.p(0.95) else n + 1, d.pick((1, 1, 2, 5)), d.pick((1, 1, 3))), layout=_lay(d))
    return Proto([a], params=[d.pick((0, 1, 2, 3, 0, 1, 2, 3, d.i(0, 3)))])


def p_lightning_indexer(d: Draw) -> Proto:
    """ggml_lightning_indexer (q k weights mask): q F32 [D, n_head, T, n_stream], k of any type
    with a to_float [D, 1, n_kv, n_stream], weights F32 [n_head, T, 1, n_stream], mask F16
    [n_kv, T, 1, m3] with n_stream % m3 == 0; unit nb0 everywhere, the rest any stride."""
    kt = d.ftype((F32, F16, BF16, Q8_0, 2, 12))
    D = blocked(kt, d.pick((1, 4, 16, 32, 64, 128, d.dim(True))))
    n_head, T, n_kv, ns = d.pick((1, 2, 4, 8, 64)), d.dim(), d.dim(True), d.pick((1, 1, 2, 3))
    m3 = d.pick([x for x in (1, 2, 3) if ns % x == 0])
    if D * n_head * n_kv * T * ns > 1 << 25:
        # a dot of D per head, key and token: within the cost model's budget, but the sanitizer's
        # 10-s oracle would time out (the compute is priced in cost.py, not a memory question)
        T, ns, m3 = 1, 1, 1
        n_kv = min(n_kv, max(1, (1 << 25) // D))
        n_head = min(n_head, max(1, (1 << 25) // (D * n_kv)))
        d.tag("wide")

    def rows() -> str | None:  # nb0 kept (the kernel asserts it), the other strides free
        return d.pick(("contig", "size1", "padded", "perm", "huge", "bcast", "parent"))

    return Proto([S(F32, (D, n_head, T, ns), layout=rows()), S(kt, (D, 1, n_kv, ns), layout=rows()),
                  S(F32, (n_head, T, 1, ns), layout=rows()), S(F16, (n_kv, T, 1, m3), layout=rows())])


def p_dsv4_hc_comb(d: Draw) -> Proto:
    T = d.pick((1, 2, 17, d.dim(True)))
    n_iter = d.pick((1, 2, 4, 20, d.r.randint(1, 64), 1000))  # 2^31 iterations: priced (cost.py), minutes
    if T * n_iter > 1 << 22:
        # priced (cost.DSV4_COMB_FLOPS: 65537 tokens x 1000 iterations estimated 3.4 s, about 2 s
        # unsanitized), but past the sanitizer's 10-s oracle: the iterations stay, the tokens go
        T = max(1, (1 << 22) // n_iter)
        d.tag("many-iterations")
    return Proto([S(F32, (24 if d.p(0.95) else 20, T)), S(F32, (d.pick((3, 3, 4, 8)),)), S(F32, (24,))],
                 params=[d.f(0, 1e-3), n_iter])


def p_dsv4_hc_pre(d: Draw) -> Proto:
    n_embd, hc, T = d.dim(True), d.pick((1, 2, 4, d.dim())), d.dim()
    gated = d.pick((0, 1, 0, 1, d.i(0, 1)))
    w = (n_embd, hc, T) if gated == 1 else (hc, T)
    return Proto([S(F32, (n_embd, hc, T)), S(F32, w)], params=[d.f(0, 2), gated])


def p_dsv4_hc_post(d: Draw) -> Proto:
    n_embd, hc, T = d.dim(True), d.pick((1, 2, 4, d.dim())), d.dim()
    comb = S(F32, (hc, hc, T)) if d.p(0.6) else None
    return Proto([S(F32, (n_embd, T)), S(F32, (n_embd, hc, T)), S(F32, (hc, T)), comb])


def p_win_part(d: Draw) -> Proto:
    """ggml_win_part: a [C, W, H] F32, window w, params {npx, npy, w} as the constructor sets
    them (sometimes off by one: refused)."""
    C, W, H = d.dim(True), d.pick((1, 2, 5, 14, d.dim())), d.pick((1, 3, 14, d.dim()))
    w = d.pick((1, 2, 3, 7, 14, W, W + 1, d.r.randint(1, 16)))
    npx, npy = -(-W // w), -(-H // w)
    if d.p(0.05):
        npx += d.pick((1, -1))
    return Proto([S(d.ftype((F32,)), (C, W, H), layout=_lay(d))], params=[npx, npy, w])


def p_win_unpart(d: Draw) -> Proto:
    """ggml_win_unpart: windows a [C, w, w, np] back into [C, w0, h0]; the node's w0, h0 the
    caller's, covered by np windows (sometimes more than a holds: refused)."""
    C, w = d.dim(True), d.pick((1, 2, 3, 7, 14, d.r.randint(1, 16)))
    w0, h0 = d.pick((1, w, 2 * w, 2 * w - 1, d.r.randint(1, 40))), d.pick((1, w, 3 * w - 1, d.r.randint(1, 40)))
    np_ = -(-w0 // w) * -(-h0 // w) + d.pick((0, 0, 0, 1, -1 if d.p(0.1) else 0))
    a = S(d.ftype((F32,)), (C, w + d.pick((0, 0, 0, 1)), w, max(1, np_)), layout=_lay(d))
    return Proto([a], params=[w], node_ne=(C, w0, h0, 1))


def p_get_rel_pos(d: Draw) -> Proto:
    q = d.pick((1, 2, 7, 14, 64, d.dim()))
    a = S(d.ftype((F16, BF16)), (d.dim(True), 2 * q - 1 if d.p(0.95) else 2 * q, d.pick((1, 1, 2)), 1))
    return Proto([a])


def p_add_rel_pos(d: Draw) -> Proto:
    """ggml_add_rel_pos(_inplace): a [w^2, h*w', np] F32 contiguous, pw/ph [w, h, w', np]."""
    w, h, w2, np_ = d.pick((1, 2, 3, 14, d.dim())), d.pick((1, 2, 14, d.dim())), d.pick((1, 2, 14)), d.pick((1, 2, 5))
    pw = (w, h, w2, np_)
    return Proto([S(d.ftype((F32,)), (w * w, h * w2, np_, d.pick((1, 1, 2))), layout=_lay(d)),
                  S(F32, pw, layout=_lay(d)), S(F32, pw, layout=_lay(d))], params=[d.pick((0, 1))])


PROTOS.update({
    "GATED_DELTA_NET": p_gated_delta_net, "SOLVE_TRI": p_solve_tri, "TRI": p_tri,
    "LIGHTNING_INDEXER": p_lightning_indexer, "DSV4_HC_COMB": p_dsv4_hc_comb, "DSV4_HC_PRE": p_dsv4_hc_pre,
    "DSV4_HC_POST": p_dsv4_hc_post, "WIN_PART": p_win_part, "WIN_UNPART": p_win_unpart, "GET_REL_POS": p_get_rel_pos,
    "ADD_REL_POS": p_add_rel_pos,
})


# -- training and backward ops -------------------------------------------------------------------


def _same(d: Draw, t: int, ne: tuple[int, int, int, int], n: int) -> list[Src]:
    """``n`` sources of type ``t`` and shape ``ne`` (sometimes one of another type: refused)."""
    return [S(t if d.p(0.9) else d.ftype(), ne) for _ in range(n)]


def p_out_prod(d: Draw) -> Proto:
    """ggml_out_prod: a [M, K, A2, A3] (F32, F16 or a block type), b [N, K, A2*r2, A3*r3] F32; K
    at least 32 a third of the time (the unrolled F32 path, its int offsets); broadcast also for
    non-F32 a (refused: those kernels assert no broadcast); b sometimes another type (refused)."""
    at = d.ftype((F32, F32, F16, Q8_0, 2, 12, BF16))
    M = blocked(at, d.dim(True))
    K = d.pick((1, 2, 31, 32, 33, 64, 65, d.dim(), d.dim(True)))
    N, A2, A3 = d.dim(True), d.pick((1, 1, 2, 3)), d.pick((1, 1, 2))
    r2, r3 = d.pick((1, 1, 2, 3)), d.pick((1, 1, 2))
    bt = F32 if d.p(0.85) else d.ftype((F16, BF16))
    return Proto([S(at, (M, K, A2, A3)), S(bt, (N, K, A2 * r2, A3 * r3))])


def p_silu_back(d: Draw) -> Proto:
    t = d.ftype((F32, F16))
    ne = d.shape()
    return Proto(_same(d, t, ne, 2))


def p_rms_norm_back(d: Draw) -> Proto:
    return Proto(_same(d, d.ftype((F32,)), d.shape(), 2), params=[d.f(0, 1e-3)])


def p_soft_max_back(d: Draw) -> Proto:
    max_bias = d.pick((0, 0, 0, fbits(-0.0), d.f()))
    return Proto(_same(d, d.ftype((F32,)), d.shape(), 2), params=[d.f(), max_bias])


def p_repeat_back(d: Draw) -> Proto:
    ne = d.shape()
    mult = [d.pick((1, 1, 2, 3, 7)) for _ in range(4)]
    return Proto([S(d.ftype((F32,)), tuple(x * m for x, m in zip(ne, mult)))], node_ne=ne)


def p_get_rows_back(d: Draw) -> Proto:
    """ggml_get_rows_back: a [ne0, rows] F32/F16, b rows-or-fewer I32 indices (zero: row 0 of the
    result), the result [ne0, R] (R the caller's c.ne1); sometimes more indices than rows of a
    (refused: the kernel reads a row per index)."""
    ne0, rows = d.dim(True), d.dim()
    n = d.pick((rows, rows, max(1, rows - 1), 1, rows + 1))
    R = d.pick((1, 2, rows, d.dim()))
    return Proto([S(d.ftype((F32, F16)), (ne0, rows)), S(d.ftype((I32,)), (n,), fill="zero")], node_ne=(ne0, R, 1, 1))


def p_count_equal(d: Draw) -> Proto:
    """I32 of one shape; half of the time the shapes the kernel's row split handles (ne2 1 or
    ne1, ne3 1 or ne1*ne2), else any (mostly refused)."""
    ne = d.shape()
    if d.p(0.5):
        ne2 = d.pick((1, ne[1]))
        ne = (ne[0], ne[1], ne2, d.pick((1, ne[1] * ne2)))
    return Proto(_same(d, d.ftype((I32,)), ne, 2))  # type: ignore[arg-type]


def p_cross_entropy_loss(d: Draw) -> Proto:
    return Proto(_same(d, d.ftype((F32,)), d.shape(), 2))


def p_cross_entropy_loss_back(d: Draw) -> Proto:
    ne = d.shape()
    return Proto([S(d.ftype((F32,)), d.pick(((1,), (1,), (2,)))), *_same(d, d.ftype((F32,)), ne, 2)])


def _opt_states(d: Draw, n: int) -> list[Src]:
    """src0 (a parameter, 90 %) and ``n`` states of its shape: packed, or all with any stride on
    their size-1 dimensions (the kernel addresses them with src0's offsets)."""
    ne = d.shape()
    lay = d.pick(("contig", "contig", "size1", None))
    a = S(d.ftype((F32,)), ne, layout=lay)
    a.flags = 4 if d.p(0.9) else 0
    return [a, *(S(F32 if d.p(0.95) else d.ftype(), ne, layout=d.pick((lay, "contig", None))) for _ in range(n))]


def p_opt_step_adamw(d: Draw) -> Proto:
    return Proto([*_opt_states(d, 3), S(d.ftype((F32,)), d.pick(((7,), (7,), (1, 7), (8,))), layout=_lay(d))])


def p_opt_step_sgd(d: Draw) -> Proto:
    return Proto([*_opt_states(d, 1), S(d.ftype((F32,)), d.pick(((2,), (2,), (1, 2), (3,))), layout=_lay(d))])


def p_diag(d: Draw) -> Proto:
    return Proto([S(d.ftype((F32,)), (d.dim(True) if not d.limits else d.dim(), d.pick((1, 1, 1, 2)), d.dim(), d.dim()))])


def p_add1(d: Draw) -> Proto:
    """ggml_add1: a padded 1d of any type the kernels take (float and block types), b a scalar of
    each type they read (and others: refused)."""
    a = S(d.ftype((F32, F16, BF16, Q8_0, 2, 12, 16)), d.shape(), layout=d.pick(("contig", "padded", "size1", None)))
    if TYPES[a.type].blck_size > 1 and a.ne[0] * a.ne[1] * a.ne[2] * a.ne[3] > 1 << 20:
        # quantizing a row again (q2_K's search) under the sanitizers runs at ~5 M elements/s: a
        # million elements stay inside the 10-s oracle (the cost model charges them as a CPY)
        a = S(a.type, (a.ne[0], min(a.ne[1], 4), 1, 1), layout=a.layout)
        d.tag("block-small")
    return Proto([a, S(d.ftype((F32, F16, BF16)), d.pick(((1,), (1,), (2,))))])


def _c_out(n: int, k: int, st: int, pad: int, dil: int) -> int:
    """ggml_calc_conv_output_size in C's truncating division (the generator's own, not the rule's)."""
    num = n + 2 * pad - dil * (k - 1) - 1
    q = abs(num) // abs(st)
    return (q if (num >= 0) == (st > 0) else -q) + 1


def p_im2col_back(d: Draw) -> Proto:
    """ggml_im2col_back: src0 the gradient of an IM2COL result (F32, packed in IM2COL's shape for
    the image and kernel; sometimes one dimension off, or strided: refused), src1 the kernel (F16 or
    F32, only its shape read), the result the image's shape; params as IM2COL's."""
    two_d = d.p(0.6)
    IW, IC, N = d.dim(True), d.pick((1, 1, 2, 3, d.dim())), d.pick((1, 1, 2, d.dim()))
    KW = d.pick((1, 2, 3, 5, 7, IW, IW + 1, d.dim()))
    s0, p0, d0 = _conv_params(d, KW, IW)
    if two_d:
        IH = d.pick((1, 2, 3, d.dim(), d.dim(True)))
        KH = d.pick((1, 2, 3, 5, IH, IH + 1, d.dim()))
        s1, p1, d1 = _conv_params(d, KH, IH)
        image, kernel = (IW, IH, IC, N), (KW, KH, IC, d.pick((1, 2, 4)))
        OW, OH = (_c_out(IW, KW, s0, p0, d0), _c_out(IH, KH, s1, p1, d1)) if s0 and s1 else (1, 1)
        grad = [IC * KH * KW, OW, OH, N]
    else:
        s1, p1, d1 = d.pick((0, 0, 1)), d.pick((0, 0, 1)), d.pick((0, 0, 1))  # not read in 1D
        image, kernel = (IW, IC, N, 1), (KW, IC, d.pick((1, 2, 4)), 1)
        OW = _c_out(IW, KW, s0, p0, d0) if s0 else 1
        grad = [IC * KW, OW, N, 1]
    if d.p(0.1):  # a gradient of another shape
        i = d.r.randrange(4)
        grad[i] = max(1, grad[i] + d.pick((-1, 1)))
        d.tag("grad-shape")
    if min(grad) < 1:
        grad = [max(1, x) for x in grad]
    taps = kernel[0] * (kernel[1] if two_d else 1)
    if taps * image[0] * image[1] * image[2] * image[3] > 1 << 24:
        # the kernel visits every tap for every image element (7 ns each, ~10x that under the
        # sanitizers): a minute of compute, within the cost model's budget, past the 10-s oracle
        image = (min(image[0], max(1, (1 << 24) // taps)), *image[1:])  # type: ignore[assignment]
        OW = _c_out(image[0], KW, s0, p0, d0) if s0 else 1
        grad[1] = max(1, OW)
        d.tag("wide-kernel")
    g = S(F32 if d.p(0.9) else d.ftype(), tuple(grad), layout=_lay(d))
    k = S(d.ftype((F16, F32)), kernel, layout=d.pick(("contig", None)))
    return Proto([g, k], params=[s0, s1, p0, p1, d0, d1, 1 if two_d else d.pick((0, 0, 0, 2))],
                 node_ne=image, node_type=F32)  # type: ignore[arg-type]


def _c_pool_out(n: int, k: int, st: int, pad: int) -> int:
    """ggml_calc_pool_output_size in single precision, each operation rounded (the generator's own)."""
    def r(x: float) -> float:
        return float(struct.unpack("<f", struct.pack("<f", x))[0]) if abs(x) < 3.4e38 else x
    return int(r(r(r(r(float(n)) + r(2.0 * pad)) - k) / st) + 1.0)


def p_pool_2d_back(d: Draw) -> Proto:
    """ggml_pool_2d_back: src0 the gradient of a POOL_2D result (F32, packed in POOL_2D's shape
    for af; sometimes off by one or strided: refused), src1 af, the pooled source (F32, packed;
    the kernel reads it at dst's strides); params as POOL_2D's, the result af's shape."""
    af = S(F32 if d.p(0.9) else d.ftype((F16,)), d.shape(), layout="contig" if d.p(0.8) else None)
    window = d.pick((46341, 50000, 1 << 16)) if d.p(0.1) else None
    if window is not None:
        d.tag("wide-window")
    k0, s0, p0 = _pool_axis(d, af.ne[0], window)
    k1, s1, p1 = _pool_axis(d, af.ne[1], window)
    grad = [_c_pool_out(af.ne[0], k0, s0, p0) if s0 > 0 else 1, _c_pool_out(af.ne[1], k1, s1, p1) if s1 > 0 else 1,
            af.ne[2], af.ne[3]]
    if d.p(0.1):
        i = d.r.randrange(4)
        grad[i] += d.pick((-1, 1))
        d.tag("grad-shape")
    grad = [max(1, x) for x in grad]
    g = S(F32 if d.p(0.9) else d.ftype(), tuple(grad), layout=_lay(d))
    return Proto([g, af], params=[d.pick((0, 1, 0, 1, 2)), k0, k1, s0, s1, p0, p1], node_ne=af.ne, node_type=F32)


PROTOS.update({"IM2COL_BACK": p_im2col_back, "POOL_2D_BACK": p_pool_2d_back})


# Sources a kernel writes in place besides its node (their spans are outputs for the write oracle):
# OPT_STEP_ADAMW updates the moments m and v (ops.cpp:12155-12156).
WRITTEN_SOURCES: dict[str, tuple[int, ...]] = {"OPT_STEP_ADAMW": (2, 3)}


def output_spans(case: Case) -> list[tuple[int, int, int]]:
    """(buffer, offset, bytes) of every span the case's kernels may write: the computed nodes and
    the sources of WRITTEN_SOURCES."""
    out = []
    for t in case.tensors:
        if t.id in case.nodes:
            ts = [t] + [case.by_id(t.src[i]) for i in WRITTEN_SOURCES.get(case.op, ()) if t.src[i]]
            out += [(x.buf, x.offs, span(x)) for x in ts if x.buf >= 0]
    return out


PROTOS.update({
    "OUT_PROD": p_out_prod, "SILU_BACK": p_silu_back, "RMS_NORM_BACK": p_rms_norm_back,
    "SOFT_MAX_BACK": p_soft_max_back, "REPEAT_BACK": p_repeat_back, "ROPE_BACK": p_rope,
    "GET_ROWS_BACK": p_get_rows_back, "COUNT_EQUAL": p_count_equal, "CROSS_ENTROPY_LOSS": p_cross_entropy_loss,
    "CROSS_ENTROPY_LOSS_BACK": p_cross_entropy_loss_back, "OPT_STEP_ADAMW": p_opt_step_adamw,
    "OPT_STEP_SGD": p_opt_step_sgd, "DIAG": p_diag, "ADD1": p_add1,
})


# -- the layout adversary ----------------------------------------------------------------------

LAYOUTS = ("contig", "contig", "size1", "size1", "size1", "bcast", "padded", "elem", "perm", "huge", "parent")


def _strides(d: Draw, t: int, ne: tuple[int, int, int, int], mode: str, cap: int) -> tuple[int, int, int, int]:
    info = TYPES[t]
    ts, quant = info.type_size, info.blck_size > 1
    nb = list(contiguous_nb(t, ne))
    if mode in ("cwhn", "cwhn_w"):
        # channels-first (CONV_2D_DW, test-backend-ops' cwhn): the channel dim innermost, dim 2 of
        # an input [W, H, C, N], dim 3 of weights [KW, KH, 1, C] (their nb2 = C*es, as ggml_permute leaves it)
        c = ne[2] if mode == "cwhn" else ne[3]
        if mode == "cwhn":
            return (c * ts, ne[0] * c * ts, ts, ne[0] * ne[1] * c * ts)
        return (c * ts, ne[0] * c * ts, c * ts, ts)

    def any_stride() -> int:
        return d.pick((0, 1, 3, ts, cap, cap - 1, cap // 2 + 1, d.r.randint(0, cap), 1 << 20, nb[1] + 1))

    if mode == "size1":
        past = []  # size-1 dims whose stride lands right past the tensor's own bytes
        for i in range(1, 4):
            if ne[i] == 1:
                if d.p(0.4):
                    past.append(i)
                    nb[i] = 0
                else:
                    nb[i] = min(any_stride(), cap)
        if ne[0] == 1 and not quant and d.p(0.3):
            nb[0] = min(d.pick((ts + 1, ts * 2, 4096)), cap)
        if past:
            # the tensor sits flush against the end of its buffer (Builder.place), so a kernel that
            # walks rows through this stride reads or writes the sanitizer's redzone right after it
            n = nbytes(_rt(Tensor(0, t, ne, tuple(nb)), 0, 0), info)  # type: ignore[arg-type]
            for i in past:
                nb[i] = n + d.pick((0, 0, ts, 1, 32))
    elif mode == "bcast":
        dims = [i for i in range(1, 4) if ne[i] > 1]
        if not quant and ne[0] > 1 and d.p(0.3):
            dims.append(0)
        for i in dims:
            if d.p(0.6):
                nb[i] = 0
        if nb[0] == 0:
            nb[0] = ts  # nb0 >= the type size (layout rule)
    elif mode == "padded":
        pad = d.pick((ts, 1, 3, 64, 4096))
        nb[1] = nb[1] + pad
        nb[2] = nb[1] * ne[1] + d.pick((0, pad))
        nb[3] = nb[2] * ne[2] + d.pick((0, pad))
    elif mode == "elem" and not quant:
        nb[0] = ts * d.pick((2, 3)) if d.p(0.7) else ts + 1
        nb[1] = nb[0] * ne[0] + d.pick((0, 0, 1))
        nb[2] = nb[1] * ne[1]
        nb[3] = nb[2] * ne[2]
    elif mode == "perm":
        p = [0, 1, 2, 3]
        if not quant:
            d.r.shuffle(p)
        else:
            rest = [1, 2, 3]
            d.r.shuffle(rest)
            p = [0, *rest]
        pne = [ne[p[i]] for i in range(4)]
        pnb = contiguous_nb(t, pne)
        for i in range(4):
            nb[p[i]] = pnb[i]
    elif mode == "huge":
        i = d.r.randint(1, 3)
        nb[i] = cap // max(1, ne[i]) if d.p(0.5) else cap
    return tuple(min(x, (1 << 32) - 1) for x in nb)  # type: ignore[return-value]


class Builder:
    def __init__(self, d: Draw) -> None:
        self.d = d
        self.buffers: list[int] = []
        self.shareable: list[bool] = []  # buffers whose tensors may be overlapped by another's data
        self.tensors: list[Tensor] = []
        self.next_id = 0x100

    def new_id(self) -> int:
        self.next_id += 0x10
        return self.next_id

    def place(self, t: Tensor, cap: int, room: int | None = None) -> None:
        """``t`` in a buffer of its own, flush against the end (or the start); with ``room``, at
        the start of a buffer that ends ``room`` bytes after it (Src.room)."""
        n = max(span(t), 1)
        if room is not None:
            self.buffers.append(max(n + room, max(t.nb[1:])))
            self.shareable.append(False)
            t.buf, t.offs = len(self.buffers) - 1, 0
            return
        size = max(cap, n, MIN_BUFFER, max(t.nb[1:]))
        align = TYPES[t.type].type_size
        where = self.d.pick(("end", "end", "end", "start", "mid"))
        if where == "end":
            offs = (size - n) // align * align
            if offs + n < size:
                size = offs + n  # flush: the redzone is the next byte
                size = max(size, max(t.nb[1:]))
                offs = (size - n) // align * align
        elif where == "start":
            offs = 0
        else:
            offs = self.d.r.randint(0, size - n) // align * align
        # sometimes share the previous tensor's buffer (only random-filled sources: an index tensor
        # overlapped by another tensor's data would hold out-of-range indices, a known data-only
        # hole; a node's pre-fill would overwrite a source)
        if t.fill == "rand" and self.d.p(0.15) and self.buffers and self.shareable[-1]:
            i = len(self.buffers) - 1
            if self.buffers[i] >= max(n, *t.nb[1:]):
                t.buf, t.offs = i, self.d.r.randint(0, self.buffers[i] - n) // align * align
                return
        self.buffers.append(size)
        self.shareable.append(t.fill == "rand")
        t.buf, t.offs = len(self.buffers) - 1, offs

    def source(self, s: Src) -> Tensor:
        d = self.d
        mode = s.layout or d.pick(LAYOUTS)
        if s.room is not None and mode in ("parent", "nobuf"):
            mode = "contig"  # the room is its own buffer's
        if mode == "nobuf":  # no buffer, data NULL (an empty source the kernels never read)
            t = Tensor(self.new_id(), s.type, s.ne, contiguous_nb(s.type, s.ne), fill="none")
            d.tag("nobuf")
            self.tensors.append(t)
            return t
        cap = d.pick((4096, 65536, 1 << 20)) if mode in ("size1", "huge") else 0
        if mode == "parent":  # a view into a bigger parent (in-place results keep its root)
            pne = tuple(x + d.pick((0, 0, 1, 3)) for x in s.ne)
            pne = (blocked(s.type, pne[0]),) + pne[1:]
            parent = Tensor(self.new_id(), s.type, pne, contiguous_nb(s.type, pne), fill=s.fill)  # type: ignore[arg-type]
            self.place(parent, 0)
            self.tensors.append(parent)
            nb = parent.nb
            offs = d.pick((0, nb[0], nb[1], span(parent) - span(Tensor(0, s.type, s.ne, nb))))
            offs = max(0, offs)
            # its own bytes are filled too: a view may reach past its parent (ggml_view_impl checks only
            # the packed size), and what it covers is what a kernel may legitimately read
            t = Tensor(self.new_id(), s.type, s.ne, nb, parent.buf, parent.offs + offs, view_src=parent.id,
                       view_offs=offs, fill=s.fill, op=TABLE.ids["VIEW"] if d.p(0.5) else 0, flags=s.flags)
            if t.op:
                t.params[0] = offs
            d.tag("parent")
            self.tensors.append(t)
            return t
        nb = _strides(d, s.type, s.ne, mode, max(cap, 64))
        t = Tensor(self.new_id(), s.type, s.ne, nb, fill=s.fill, flags=s.flags)
        d.tag(mode)
        self.place(t, cap, s.room)
        self.tensors.append(t)
        return t


def _rpc(t: Tensor) -> RpcTensor:
    """What a rule's derive sees of ``t`` (a fake data pointer: NULL only for a tensor without a buffer)."""
    return _rt(t, 1, 0) if t.buf < 0 else _rt(t, 1, FAKE_BASE + t.offs)


def _node_from(rule: OpRule, op: str, proto: Proto, srcs: list[Tensor | None], b: Builder,
               want_view: bool) -> Tensor | str:
    """The node the rule derives from ``srcs`` (a Tensor), or why the rule refused (a str)."""
    d = b.d
    a = srcs[0] if srcs else None
    nid = b.new_id()
    ne = proto.node_ne or (a.ne if a is not None else (1, 1, 1, 1))
    ntype = proto.node_type if proto.node_type is not None else (a.type if a is not None else F32)
    if proto.node_nb is not None:
        nb = proto.node_nb
    elif op == "VIEW" and a is not None:
        nb = a.nb  # ggml_view_4d with the source's own strides
    else:
        nb = contiguous_nb(ntype, ne) if ntype in TYPES else (4, 4, 4, 4)
    src_ids = [s.id if s is not None else 0 for s in srcs] + [0] * (10 - len(srcs))
    if proto.cast:
        src_ids[1] = nid
    prm = (list(proto.params) + [0] * 16)[:16]
    probe = Tensor(nid, ntype, ne, nb, op=TABLE.ids[op], params=prm, src=src_ids)
    rs = [_rpc(s) if s is not None else None for s in srcs] + [None] * (10 - len(srcs))
    if proto.cast:
        rs[1] = _rpc(probe)
    try:
        derived = rule.derive(_rpc(probe), rs)
    except FirewallRefusal as e:
        return e.reason
    except (ArithmeticError, LookupError, ValueError, TypeError, AssertionError):
        return "derive_failed"
    results = derived if isinstance(derived, tuple) else (derived,)
    views = [r for r in results if isinstance(r, View)]
    news = [r for r in results if isinstance(r, New)]
    r = (views[0] if views and (want_view or not news) else news[0]) if (views or news) else None
    if isinstance(r, New):
        if r.type not in TYPES:
            return "result_type"
        if max(r.ne) >= 1 << 32 or min(r.ne) < 0 or max(contiguous_nb(r.type, r.ne)) >= 1 << 32:
            return "result_not_encodable"
        # pre-filled, so that bytes the kernel leaves alone are the same in both runs
        node = Tensor(nid, r.type, r.ne, r.nb or contiguous_nb(r.type, r.ne), op=TABLE.ids[op], params=prm, src=src_ids,
                      fill="prefill")
        b.place(node, 0)
        return node
    assert isinstance(r, View)
    src = srcs[r.src]
    assert src is not None
    root_id = src.view_src or src.id
    offs = (src.view_offs if src.view_src else 0) + r.offs
    root = next(t for t in b.tensors if t.id == root_id)
    d.tag("inplace")
    # an in-place result covers its source's bytes (already filled); a view op's result may reach
    # past its source, and its consumer may read all of it: filled as a source
    return Tensor(nid, src.type, r.ne, r.nb, root.buf, root.offs + offs, op=TABLE.ids[op], params=prm,
                  src=src_ids, view_src=root_id, view_offs=offs, fill="rand" if op in VIEW_OPS else "none")


CONSUMER_PROTO = {"CONT": lambda a: Proto([a], node_ne=a.ne), "SQR": lambda a: Proto([a]),
                  "ADD": lambda a: Proto([a, a]), "RMS_NORM": lambda a: Proto([a], params=[fbits(1e-6)]),
                  "ARGSORT": lambda a: Proto([a]), "CLAMP": lambda a: Proto([a], params=[fbits(-1), fbits(1)]),
                  "SOFT_MAX": lambda a: Proto([a], params=[fbits(1.0)]), "CPY": None, "MUL_MAT": None}


def candidate(op: str, seed: int, index: int, attempt: int) -> tuple[Case | None, str]:
    """One candidate of ``op`` (None and why when it could not even be built)."""
    rng = random.Random(f"{seed}:{op}:{index}:{attempt}")
    d = Draw(rng)
    rule = RULES.rows[TABLE.ids[op]]
    proto = PROTOS[op](d)
    b = Builder(d)
    try:
        return _candidate(op, seed, index, d, rule, proto, b)
    except Unencodable:
        return None, "not_encodable"


def _candidate(op: str, seed: int, index: int, d: Draw, rule: OpRule, proto: Proto,
               b: Builder) -> tuple[Case | None, str]:
    srcs: list[Tensor | None] = [b.source(s) if s is not None else None for s in proto.srcs]
    empty = d.p(0.08)
    want_view = d.p(0.1 if proto.then else 0.5)  # an in-place (view) result is never fused
    if empty:
        d.tag("empty")
        node = _empty_node(op, proto, srcs, b)
    else:
        got = _node_from(rule, op, proto, srcs, b, want_view)
        if isinstance(got, str):
            return None, got
        node = got
    nodes = [node.id]
    if op in WORK_OPS and not empty and ("planner-edge" in d.tags or d.p(0.5)):
        # listed first (the firewall wants nodes in tensor-list order); nodes[-1] stays the node under test
        nodes.insert(0, _all_threads_node(b))
    b.tensors.append(node)
    nxt: Tensor | None = None
    if proto.then and not empty:
        got_next = FUSED_NEXT[proto.then](node, b)
        if isinstance(got_next, str):
            return None, "then:" + got_next
        nxt = got_next
        b.tensors.append(nxt)
        nodes.append(nxt.id)
        d.tag("then=" + proto.then)
    if op in VIEW_OPS and proto.consumer and not empty:
        # the view op is never computed: a consumer reads the view as its source
        cons = _consumer(proto.consumer, node, b)
        if isinstance(cons, str):
            return None, "consumer:" + cons
        b.tensors.append(cons)
        nodes.append(cons.id)
        d.tag("consumer=" + proto.consumer)
    if d.limits:
        d.tag("limits")
    for t in b.tensors:
        if t.id in nodes:
            t.flags = FLAG_COMPUTE
    if d.p(0.04):  # planned but not computed: the planner alone reads the node
        node.flags = 0
        d.tag("no-compute-flag")
    if nxt is not None and fused(node, nxt, b.tensors):
        d.tag("fused")
    case = Case(op, seed, index, "+".join(dict.fromkeys(d.tags)) or "plain", b.buffers, b.tensors, nodes)
    return case, ""


def _fused_mul(rms: Tensor, b: Builder) -> Tensor | str:
    """RMS_NORM's result times a weight, the next node, as every llama.cpp model builds it
    (``ggml_mul(ggml_rms_norm(x), w)``): the pair ggml-cpu runs as one kernel
    (ggml_cpu_try_fuse_ops, ggml-cpu.c:3079-3095; ops.cpp ``ggml_compute_forward_rms_norm_f32``'s
    fused branch) when ``fused`` holds. The weight has any layout the MUL rule lets through: a row
    broadcast over the others (the model's case) or of the result's shape, sometimes another
    length or type (the fusion predicate or the MUL rule says no); the result's use count is
    mostly 1 (fusable), sometimes another count (no fusion: the pair runs apart)."""
    d = b.d
    ne = rms.ne
    if d.p(0.6):
        wne = (ne[0] if d.p(0.9) else d.pick((1, ne[0] + 1)),) + tuple(x if d.p(0.3) else 1 for x in ne[1:])
    else:
        wne = ne
    w = b.source(Src(F32 if d.p(0.9) else d.ftype(), wne))  # type: ignore[arg-type]
    srcs: list[Tensor | None] = [rms, w] if d.p(0.7) or wne != ne else [w, rms]
    rms.use_count = 1 if d.p(0.85) else d.pick((0, 2, 3))
    return _node_from(RULES.rows[TABLE.ids["MUL"]], "MUL", Proto([]), srcs, b, d.p(0.3))


FUSED_NEXT: dict[str, Callable[[Tensor, Builder], Tensor | str]] = {"MUL": _fused_mul}


def fused(node: Tensor, nxt: Tensor, tensors: list[Tensor]) -> bool:
    """Whether ggml-cpu runs ``node`` (RMS_NORM) and ``nxt`` (MUL, listed right after it) as one
    kernel: ggml_can_fuse (ggml-impl.h:653-708: both computed, ``node`` used once, not a view, not an
    output; ``nxt`` reads it and has its shape) and the type/stride predicate of
    ggml_cpu_try_fuse_ops (ggml-cpu.c:3082-3090)."""
    by_id = {t.id: t for t in tensors}
    src0 = by_id.get(node.src[0])
    w = by_id.get(nxt.src[1] if nxt.src[0] == node.id else nxt.src[0])
    return (TABLE.names[node.op] == "RMS_NORM" and TABLE.names[nxt.op] == "MUL"
            and bool(node.flags & FLAG_COMPUTE) and bool(nxt.flags & FLAG_COMPUTE)
            and node.use_count == 1 and not node.view_src and not node.flags & FLAG_OUTPUT
            and node.id in nxt.src[:2] and node.ne == nxt.ne
            and src0 is not None and w is not None and src0.type == F32 and nxt.type == F32 and w.type == F32
            and w.ne[0] == node.ne[0] and w.nb[0] == 4)


def fused_cases(seed: int, count: int, max_draws: int = 40) -> Iterator[tuple[Case | None, dict]]:
    """``count`` accepted RMS_NORM cases whose next node ggml-cpu fuses with it (``fused``), drawn
    from ``generate`` (at most ``max_draws`` per case yielded)."""
    n = 0
    for case, refused in generate("RMS_NORM", seed, count * max_draws):
        if case is not None and "fused" in case.variant.split("+"):
            yield case, refused
            n += 1
            if n == count:
                return


def _all_threads_node(b: Builder) -> int:
    """A small ADD in the graph beside the node: ADD plans ``n_threads`` tasks (ggml-cpu.c:2259-2270), and a graph
    runs every node on ``min(max tasks, n_threads)`` threads (ggml-cpu.c:3055), so the node under
    test runs on all the server's threads even when it plans fewer itself (SET_ROWS, SOFT_MAX)."""
    ne = (b.d.pick((4, 64, 257)), 2, 1, 1)
    xs = []
    for _ in range(2):
        x = Tensor(b.new_id(), F32, ne, contiguous_nb(F32, ne))
        b.place(x, 0)
        b.tensors.append(x)
        xs.append(x)
    node = Tensor(b.new_id(), F32, ne, contiguous_nb(F32, ne), op=TABLE.ids["ADD"], src=[xs[0].id, xs[1].id] + [0] * 8,
                  fill="prefill")
    b.place(node, 0)
    b.tensors.append(node)
    b.d.tag("all-threads")
    return node.id


def _consumer(name: str, view: Tensor, b: Builder) -> Tensor | str:
    op = name
    if name == "CPY":
        t = Tensor(b.new_id(), F32, view.ne, contiguous_nb(F32, view.ne), fill="zero")
        b.place(t, 0)
        b.tensors.append(t)
        proto = Proto([view, t])  # type: ignore[list-item]
        srcs: list[Tensor | None] = [view, t]
    elif name == "MUL_MAT":
        t = Tensor(b.new_id(), F32, (view.ne[0], 3, view.ne[2], view.ne[3]),
                   contiguous_nb(F32, (view.ne[0], 3, view.ne[2], view.ne[3])))
        b.place(t, 0)
        b.tensors.append(t)
        proto, srcs = Proto([], params=[0, 0, 0, 0]), [view, t]
    else:
        proto = CONSUMER_PROTO[name](view)  # type: ignore[misc]
        srcs = [view, view] if name == "ADD" else [view]
        proto.srcs = []
    rule = RULES.rows[TABLE.ids[op]]
    return _node_from(rule, op, proto, srcs, b, b.d.p(0.3))


def _empty_node(op: str, proto: Proto, srcs: list[Tensor | None], b: Builder) -> Tensor:
    """A node with a zero in ne: no node rule runs on it; the planner still reads its sources."""
    d = b.d
    a = srcs[0] if srcs else None
    ne = list(proto.node_ne or (a.ne if a is not None else (4, 1, 1, 1)))
    ne[d.r.randrange(4)] = 0
    t = proto.node_type if proto.node_type is not None else (a.type if a is not None else F32)
    src_ids = [s.id if s is not None else 0 for s in srcs] + [0] * (10 - len(srcs))
    if d.p(0.4):  # drop a source the constructor always sets
        live = [i for i, s in enumerate(src_ids) if s]
        if live:
            src_ids[d.pick(live)] = 0
            d.tag("src-dropped")
    prm = (list(proto.params) + [0] * 16)[:16]
    node = Tensor(b.new_id(), t, tuple(ne), contiguous_nb(t, ne), op=TABLE.ids[op], params=prm,  # type: ignore[arg-type]
                  src=src_ids, fill="none")
    b.place(node, 0)
    return node


def generate(op: str, seed: int, count: int, max_attempts: int = 60) -> Iterator[tuple[Case | None, dict]]:
    """Up to ``count`` accepted cases of ``op``; each yield carries the refusal counts of the
    candidates drawn for it (what the rule refused on the way)."""
    for index in range(count):
        refused: dict[str, int] = {}
        for attempt in range(max_attempts):
            case, why = candidate(op, seed, index, attempt)
            if case is not None:
                why = accepts(case) or ""
            if not why:
                yield case, refused
                break
            refused[why] = refused.get(why, 0) + 1
        else:
            yield None, refused
