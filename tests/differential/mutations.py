"""Single-field mutations of a constructor-built graph, and canonical forms to compare graphs.

How this works: ``mutations`` takes one accepted case of a generator and its serialised graph and
makes every single-field change the oracle checks (tests/differential/oracle.py's docstring lists
them): of the op's node (dst ne/nb/type, the op_params the generator maps to arguments, the view
offset, dropped and swapped sources) and of its leaf sources (shape, huge stride of a size-1
dim, padded rows, strided elements, type). Each ``Mutation`` carries the recipe with the
corresponding constructor inputs when there is one; the oracle rebuilds it and compares with
``canon_nodes`` (every node as a nested tuple of its fields and sources, ids dropped).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from rpcguard.protocol.encode import TENSOR_STRUCT
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.tensor import RpcTensor, decode_tensor
from rpcguard.protocol.versions import TENSOR_BYTES
from tests.differential.ops import KEEP, Case
from tests.support.ggmlref import SIGNATURES, Built

__all__ = ["Mutation", "mutations", "canon_nodes", "HUGE_STRIDE_BYTES"]

HUGE_STRIDE_BYTES = 1 << 30  # a stride for a size-1 dim: never addressed by ggml_nbytes, far away
F32, F16 = 0, 1


@dataclass
class Mutation:
    gen: str
    label: str
    payload: bytes
    rebuild: dict | None  # recipe with the corresponding inputs, when there is one
    recipe: dict
    op: str = ""
    original: bytes = b""  # the accepted payload it was made from
    legit: bool = False
    rebuild_note: str = ""
    reason: str | None = None  # validator outcome (None: accepted)



# -- graph decoding and canonical forms -------------------------------------------------------


def _tensors(b: Built) -> list[RpcTensor]:
    off = b.tensor_bytes
    return [decode_tensor(b.payload, off + TENSOR_BYTES * i) for i in range(b.n_tensors)]


def _nodes(payload: bytes) -> tuple[list[int], list[RpcTensor]]:
    n = struct.unpack_from("<I", payload, 4)[0]
    nodes = list(struct.unpack_from(f"<{n}Q", payload, 8))
    m = struct.unpack_from("<I", payload, 8 + 8 * n)[0]
    off = 12 + 8 * n
    return nodes, [decode_tensor(payload, off + TENSOR_BYTES * i) for i in range(m)]


def canon_nodes(payload: bytes) -> list[tuple]:
    """Each node as a nested tuple of its fields and (recursively) its sources, ids dropped."""
    nodes, ts = _nodes(payload)
    pos = {t.id: i for i, t in enumerate(ts)}
    memo: dict[int, tuple] = {}

    def canon(i: int) -> tuple:
        if i in memo:
            return memo[i]
        t = ts[i]
        memo[i] = ("self",)  # ggml_cast sets src[1] = the result itself
        srcs = tuple(canon(pos[s]) if s in pos else (None if s == 0 else ("dangling", s)) for s in t.src)
        vs = canon(pos[t.view_src]) if t.view_src in pos else t.view_src
        memo[i] = c = (t.type, t.ne, t.nb, t.op, t.op_params, t.view_offs, srcs, vs)
        return c

    return [canon(pos[n]) for n in nodes if n in pos]


def _pack(t: RpcTensor) -> bytes:
    return TENSOR_STRUCT.pack(*t)


def _replace(b: Built, i: int, t: RpcTensor) -> bytes:
    off = b.tensor_bytes + TENSOR_BYTES * i
    return b.payload[:off] + _pack(t) + b.payload[off + TENSOR_BYTES :]


def _contig(type_: int, ne: list[int]) -> tuple[int, ...]:
    info = TYPES[type_]
    nb = [info.type_size, info.type_size * (ne[0] // info.blck_size)]
    nb.append(nb[1] * ne[1])
    nb.append(nb[2] * ne[2])
    return tuple(nb)


def _nbytes(t: RpcTensor) -> int:
    info = TYPES[t.type]
    if not all(t.ne):
        return 0
    n = t.ne0 * t.nb0 // info.blck_size if info.blck_size > 1 else info.type_size + (t.ne0 - 1) * t.nb0
    return n + sum((t.ne[i] - 1) * t.nb[i] for i in (1, 2, 3))


def _with_args(recipe: dict, args: list[Any] | dict) -> dict:
    """``recipe`` with its last call's args replaced (KEEP: unchanged), or the whole call."""
    r = {"leaves": recipe["leaves"], "ops": [dict(o) for o in recipe["ops"]]}
    last = r["ops"][-1]
    if isinstance(args, dict):
        last["fn"] = args["fn"]
        args = args["args"]
        keep = last["args"] + [None] * len(args)
    else:
        keep = last["args"]
    last["args"] = [o if isinstance(a, str) and a == KEEP else a for a, o in zip(args, keep)]
    return r


def _with_arg(recipe: dict, i: int | tuple[int, int], v: Any) -> dict:
    """``recipe`` with argument ``i`` of its last call (or ``(call, argument)`` of an earlier
    one, e.g. the mask of a soft_max_ext that a soft_max_add_sinks call then modifies) set to ``v``."""
    if isinstance(i, tuple):
        r = {"leaves": recipe["leaves"], "ops": [dict(o) for o in recipe["ops"]]}
        call, arg = i
        args = list(r["ops"][call]["args"])
        args[arg] = v
        r["ops"][call]["args"] = args
        return r
    args = list(recipe["ops"][-1]["args"])
    args[i] = v
    return _with_args(recipe, args)


def _with_leaf(recipe: dict, i: int, leaf: dict) -> dict:
    leaves = list(recipe["leaves"])
    leaves[i] = leaf
    return {"leaves": leaves, "ops": recipe["ops"]}


# -- mutations --------------------------------------------------------------------------------


def mutations(gen: str, case: Case, b: Built) -> list[Mutation]:
    recipe = case.recipe
    n_leaves = len(recipe["leaves"])
    p = b.refs[-1]
    if p is None:
        return []
    ts = _tensors(b)
    dst = ts[p]
    pos = {t.id: i for i, t in enumerate(ts)}
    out: list[Mutation] = []

    def add(label: str, i: int, t: RpcTensor, rebuild: dict | None) -> None:
        out.append(Mutation(gen, label, _replace(b, i, t), rebuild, recipe))

    info = TYPES[dst.type]
    # dst ne / nb / type: the constructor derives them from the inputs, except for view-like ops
    # whose shape and strides are arguments (dst_args maps them back).
    for i in range(4):
        steps = [info.blck_size if i == 0 else 1]
        if dst.ne[i] > 1:
            steps.append(-steps[0])
        for d in steps:
            ne = list(dst.ne)
            ne[i] += d
            t = dst._replace(**{f"ne{i}": ne[i]})
            rb = _with_args(recipe, case.dst_args(tuple(ne), dst.nb)) if case.dst_args else None
            add(f"dst.ne[{i}]{d:+d}", p, t, rb)
        nb = list(dst.nb)
        nb[i] += info.type_size
        rb = _with_args(recipe, case.dst_args(dst.ne, tuple(nb))) if case.dst_args else None
        add(f"dst.nb[{i}]+{info.type_size}", p, dst._replace(**{f"nb{i}": nb[i]}), rb)
        if dst.ne[i] == 1 and i > 0:
            nb[i] = HUGE_STRIDE_BYTES
            rb = _with_args(recipe, case.dst_args(dst.ne, tuple(nb))) if case.dst_args else None
            add(f"dst.nb[{i}]=huge(ne=1)", p, dst._replace(**{f"nb{i}": nb[i]}), rb)
    new_type = F16 if dst.type == F32 else F32
    if info.blck_size == 1:
        rb = _with_arg(recipe, case.type_arg, new_type) if case.type_arg is not None else None
        add(f"dst.type={TYPES[new_type].name}", p, dst._replace(type=new_type), rb)
    # op_params that are integer constructor arguments.
    args = recipe["ops"][-1]["args"]
    for ai, (word, values) in case.params.items():
        for v in values:
            if v == args[ai]:
                continue
            t = dst._replace(**{f"param{word}": v})
            add(f"op_params[{word}]={v} (arg {ai})", p, t, _with_arg(recipe, ai, v))
    # The view offset: op_params[0..1], view_offs and data move together.
    if case.offset_arg is not None and dst.view_src in pos:
        vsrc = ts[pos[dst.view_src]]
        for v in (_nbytes(vsrc), dst.view_offs + info.type_size, _nbytes(vsrc) - _nbytes(dst) + info.type_size):
            if v == dst.view_offs or v < 0:
                continue
            lo, hi = struct.unpack("<ii", struct.pack("<Q", v))
            t = dst._replace(param0=lo, param1=hi, view_offs=v, data=vsrc.data + v)
            add(f"view offset={v}", p, t, _with_arg(recipe, case.offset_arg, v))
    elif dst.view_src in pos:
        vsrc = ts[pos[dst.view_src]]
        v = dst.view_offs + _nbytes(vsrc)
        add("view_offs past view_src", p, dst._replace(view_offs=v, data=vsrc.data + v), None)
        add("view_offs != data - view_src.data", p, dst._replace(view_offs=dst.view_offs + 64), None)
    # Dropped sources.
    for k, s in enumerate(dst.src):
        if not s:
            continue
        rb = _with_arg(recipe, case.nullable[k], None) if k in case.nullable else None
        add(f"src[{k}] dropped", p, dst._replace(**{f"src{k}": 0}), rb)
    # Two sources swapped, when the call's tensor arguments are exactly src[0..] in order (then
    # the swapped call is the rebuild: add(b, a) is legitimate, mul_mat(b, a) is not).
    fn = recipe["ops"][-1]["fn"]
    if fn in SIGNATURES:
        targ = [i for i, k in enumerate(SIGNATURES[fn][1].split()) if k == "t"]
        by_arg = [b.refs[args[i]] if args[i] is not None else None for i in targ]
        by_src = [pos.get(x) if x else None for x in dst.src[: len(targ)]]
        live = [k for k, q in enumerate(by_src) if q is not None]
        if by_arg == by_src and not any(dst.src[len(targ) :]):
            for i, j in zip(live, live[1:]):
                if dst.src[i] == dst.src[j]:
                    continue
                t = dst._replace(**{f"src{i}": dst.src[j], f"src{j}": dst.src[i]})
                sw = list(args)
                sw[targ[i]], sw[targ[j]] = sw[targ[j]], sw[targ[i]]
                add(f"src[{i}] <-> src[{j}]", p, t, _with_args(recipe, sw))
    # Leaf sources: other inputs (shape, type, strides) under the same node.
    done: set[int] = set()
    for k, s in enumerate(dst.src):
        q = pos.get(s) if s else None
        if q is None or q in done or ts[q].op != 0 or q not in b.refs[:n_leaves]:
            continue
        done.add(q)
        li = b.refs.index(q)
        leaf = ts[q]
        linfo = TYPES[leaf.type]
        spec = recipe["leaves"][li]
        tname = spec["type"]
        for i in range(4):
            ne = list(leaf.ne)
            ne[i] += linfo.blck_size if i == 0 else 1
            nb = _contig(leaf.type, ne)
            t = leaf._replace(**{f"ne{j}": ne[j] for j in range(4)}, **{f"nb{j}": nb[j] for j in range(4)})
            add(f"src[{k}].ne[{i}]+", q, t, _with_leaf(recipe, li, {"type": tname, "ne": ne}))
            if leaf.ne[i] == 1 and i > 0:
                nb = list(leaf.nb)
                nb[i] = HUGE_STRIDE_BYTES
                t = leaf._replace(**{f"nb{i}": nb[i]})
                add(f"src[{k}].nb[{i}]=huge(ne=1)", q, t, _with_leaf(recipe, li, {"type": tname, "ne": list(leaf.ne), "nb": nb}))
        if leaf.ne[1] > 1:
            nb = list(leaf.nb)
            nb[1] += linfo.type_size * 4
            nb[2] = max(nb[2], nb[1] * leaf.ne[1])
            nb[3] = max(nb[3], nb[2] * leaf.ne[2])
            t = leaf._replace(**{f"nb{j}": nb[j] for j in range(4)})
            add(f"src[{k}] rows padded", q, t, _with_leaf(recipe, li, {"type": tname, "ne": list(leaf.ne), "nb": nb}))
        if linfo.blck_size == 1:
            nb = [2 * x for x in leaf.nb]  # every element two apart: rows no longer dense
            t = leaf._replace(**{f"nb{j}": nb[j] for j in range(4)})
            add(f"src[{k}] elements strided", q, t, _with_leaf(recipe, li, {"type": tname, "ne": list(leaf.ne), "nb": nb}))
        alt = {0: 1, 1: 0, 26: 0}.get(leaf.type, 1)
        if linfo.blck_size == 1 or leaf.ne0 % TYPES[alt].blck_size == 0:
            ne = list(leaf.ne)
            nb = _contig(alt, ne)
            t = leaf._replace(type=alt, **{f"nb{j}": nb[j] for j in range(4)})
            add(f"src[{k}].type={TYPES[alt].name}", q, t,
                _with_leaf(recipe, li, {"type": TYPES[alt].name, "ne": ne}))  # fmt: skip
    return out
