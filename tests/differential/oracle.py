"""The differential oracle: rpcguard's GraphValidator against the real ggml constructors.

How this works, in two batches of real-constructor builds (tests/support/ggmlref.py):

1. Every generator of ops.py makes ``cases`` recipes (seeded per generator). The constructors
   accept some (a real client could send that graph: the validator must ACCEPT it, or it is a
   false refusal) and refuse others (only counted).
2. For the first ``mutated`` accepted cases of each generator, single-field mutations of the
   op's node (dst ne[i]+-1, nb[i]+esz, a size-1 dim's nb made huge, type; the integer op_params
   the generator maps to arguments; the view offset past the source; view_offs alone; each src
   dropped; two srcs swapped) and of its leaf sources (ne[i]+1, a size-1 dim's nb made huge,
   padded rows, elements strided, type) are made on the serialised graph. Each mutation that corresponds to other
   constructor inputs is rebuilt with the real constructors: the mutated graph is *legitimate*
   when every one of its nodes is, field for field and through all its sources, a node of the
   rebuilt or of the original graph (``canon``). Otherwise (the constructor refuses the mutated
   inputs, or builds something else, or no inputs can produce it) the validator must REFUSE it.

With ``kernel`` on (the default), step 1 also COMPUTES every built graph on the real CPU backend
(tests/support/ggmlkernel.py): a constructor-built graph is then one of

* kernel-clean: computed without abort, fault or hang. rpcguard must forward it; a refusal is a
  FALSE REFUSAL, except ``op_not_verified`` (an op with no rule yet: a coverage gap, counted apart);
* kernel-refused: the kernel aborted, faulted (guard page) or hung. rpcguard must refuse it; a
  forwarded one is a MISSED attack (one GRAPH_COMPUTE kills or corrupts the real server).

Legitimate mutations are reported, not asserted: they include graphs the constructor accepts
but a kernel could still mishandle (e.g. a view whose strides reach past its source, which
ggml_view_impl's contiguous-size check lets through), so a refusal there is the lead's call.
"""

from __future__ import annotations

import random
import re
import struct
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import TENSOR_STRUCT
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.graph import GraphValidator
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.tensor import RpcTensor, decode_tensor
from rpcguard.protocol.versions import TENSOR_BYTES, spec_for
from tests.differential.ops import GENERATORS, KEEP, Case
from tests.support.ggmlref import SIGNATURES, Built, Refused, build_many, kernel_refused

__all__ = ["OpResult", "Mutation", "run", "validate", "refusal", "V7", "LAST_RESULTS", "GAP"]

LAST_RESULTS: "dict[str, OpResult] | None" = None  # the last run in this process (for the pytest summary)

V7 = (7, 0, 0)
GAP = "op_not_verified"  # the reason for an op without a rule: a coverage gap, not a false refusal
CRASH = "EXCEPTION "  # prefix of validate()'s answer when the validator raised something else
HUGE_STRIDE_BYTES = 1 << 30  # a stride for a size-1 dim: never addressed by ggml_nbytes, far away
F32, F16 = 0, 1


def validate(payload: bytes, handle: int, base: int, size: int) -> str | None:
    """None when rpcguard's validator accepts the GRAPH_COMPUTE payload, else its reason."""
    got = refusal(payload, handle, base, size)
    return None if got is None else got[0]


def refusal(payload: bytes, handle: int, base: int, size: int) -> tuple[str, str] | None:
    """None when rpcguard's validator accepts the payload, else (reason, detail)."""
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    st.add_buffer(handle, 0, size)
    st.buffers[handle].base = base
    try:
        GraphValidator(max_nodes=4096, max_tensors=16384).check(memoryview(payload), st)
    except FirewallRefusal as exc:
        return exc.reason, exc.detail
    except Exception as exc:  # noqa: BLE001  a validator bug: reported, never counted as a refusal
        return f"{CRASH}{type(exc).__name__}: {exc}", ""
    return None


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


@dataclass
class OpResult:
    op: str
    generated: int = 0
    built: int = 0  # accepted by the real constructors
    accepted: int = 0  # ... and by rpcguard
    # Refused by rpcguard though the kernel computed it (or was not asked): (gen, recipe, reason, detail)
    false_refusals: list[tuple[str, dict, str, str]] = field(default_factory=list)
    gap: int = 0  # kernel-clean graphs refused as op_not_verified (no rule yet)
    gap_ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # detail's op -> count
    kernel_clean: int = 0  # built graphs the real CPU kernel computed (kernel on)
    kernel_skipped: int = 0  # ... it was not asked to (too large)
    # Built graphs the real kernel aborted / faulted / hung on: (gen, recipe, verdict, rpcguard reason or None)
    kernel_refusals: list[tuple[str, dict, str, str | None]] = field(default_factory=list)
    must_refuse: int = 0
    refused: int = 0
    missed: list[Mutation] = field(default_factory=list)  # must refuse, but accepted (or crashed)
    legit: int = 0
    legit_accepted: int = 0
    legit_refused: list[Mutation] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    gens: set[str] = field(default_factory=set)
    spec_errors: list[str] = field(default_factory=list)
    mutations: list[Mutation] = field(default_factory=list)  # all of them, payloads dropped
    built_graphs: list[tuple[str, dict, Built]] = field(default_factory=list)  # run(keep_built=True) only

    @property
    def missed_kernel(self) -> list[tuple[str, dict, str, str | None]]:
        """Kernel-refused graphs rpcguard forwards (or crashed on): attacks that get through."""
        return [k for k in self.kernel_refusals if k[3] is None or k[3].startswith(CRASH)]


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


def _canon_nodes(payload: bytes) -> list[tuple]:
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


def _with_arg(recipe: dict, i: int, v: Any) -> dict:
    args = list(recipe["ops"][-1]["args"])
    args[i] = v
    return _with_args(recipe, args)


def _with_leaf(recipe: dict, i: int, leaf: dict) -> dict:
    leaves = list(recipe["leaves"])
    leaves[i] = leaf
    return {"leaves": leaves, "ops": recipe["ops"]}


# -- mutations --------------------------------------------------------------------------------


def _mutations(gen: str, case: Case, b: Built) -> list[Mutation]:
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


# -- the run ----------------------------------------------------------------------------------


def run(
    seed: int = 1, cases: int = 40, mutated: int = 6, only: set[str] | None = None, kernel: bool = True,
    keep_built: bool = False,
) -> dict[str, OpResult]:
    """Generate, build (and compute, with ``kernel``), validate and mutate; results per GGML op name."""
    results: dict[str, OpResult] = {}
    made: list[tuple[str, Case]] = []
    for name, (op, fn) in GENERATORS.items():
        if only and op not in only:
            continue
        rng = random.Random(f"{seed}:{name}")
        res = results.setdefault(op, OpResult(op))
        res.gens.add(name)
        for _ in range(cases):
            made.append((name, fn(rng)))
            res.generated += 1
    built = build_many([c.recipe for _, c in made], compute=kernel)
    muts: list[Mutation] = []
    per_gen: dict[str, int] = defaultdict(int)
    for (name, case), b in zip(made, built):
        res = results[case.op]
        if not isinstance(b, Built):
            if b.message.startswith("harness"):
                res.spec_errors.append(f"{name}: {b.message}")
            continue
        res.built += 1
        if keep_built:
            res.built_graphs.append((name, case.recipe, b))
        got = refusal(b.payload, b.handle, b.base, b.size)
        if got is None:
            res.accepted += 1
        if kernel_refused(b.kernel):
            res.kernel_refusals.append((name, case.recipe, b.kernel, None if got is None else got[0]))
        else:
            res.kernel_clean += b.kernel == "ok"
            res.kernel_skipped += b.kernel is not None and b.kernel != "ok"
            if got is not None and got[0] == GAP:
                res.gap += 1
                m = re.search(r"op (\w+) has no verified rule", got[1])
                res.gap_ops[m.group(1) if m else "?"] += 1
            elif got is not None:
                res.false_refusals.append((name, case.recipe, *got))
        if per_gen[name] < mutated:
            per_gen[name] += 1
            for m in _mutations(name, case, b):
                m.original, m.op = b.payload, case.op
                muts.append(m)
    rebuilt = build_many([m.rebuild for m in muts if m.rebuild is not None])
    it = iter(rebuilt)
    for m in muts:
        res = results[m.op]
        rb = next(it) if m.rebuild is not None else None
        if isinstance(rb, Built):
            mine = _canon_nodes(m.payload)
            known = set(_canon_nodes(rb.payload)) | set(_canon_nodes(m.original))
            m.legit = all(c in known for c in mine)
            m.rebuild_note = "rebuilt: same graph" if m.legit else "rebuilt: constructor builds another node"
        elif isinstance(rb, Refused):
            m.rebuild_note = "constructor refuses: " + rb.message.split(": ", 1)[-1][:120]
        else:
            m.rebuild_note = "no constructor inputs give this node"
        m.reason = validate(m.payload, *_buf())
        forwarded = m.reason is None or m.reason.startswith(CRASH)
        if m.legit or not forwarded:
            m.payload = b""  # results keep the verdicts, not ~10k payloads (missed ones keep theirs)
        m.original = b""
        res.mutations.append(m)
        if m.legit:
            res.legit += 1
            if m.reason is None:
                res.legit_accepted += 1
            else:
                res.legit_refused.append(m)
        else:
            res.must_refuse += 1
            if m.reason is None or m.reason.startswith(CRASH):
                res.missed.append(m)
            else:
                res.refused += 1
                res.reasons[m.reason] += 1
    return results


def _buf() -> tuple[int, int, int]:
    from tests.support.ggmlref import BUFFER_BASE, BUFFER_HANDLE, BUFFER_SIZE

    return BUFFER_HANDLE, BUFFER_BASE, BUFFER_SIZE
