"""Which ggml ops real llama.cpp sends in GRAPH_COMPUTE: a recording relay and a graph decoder.

How this works: a ``CaptureRelay`` (tests/support/capture.py, client->server bytes only) is put
in front of a real ``ggml-rpc-server``; it forwards every byte untouched and keeps the
client->server stream of every connection. ``survey_stream`` cuts that stream into request frames (``cmd:u8 |
size:u64 | payload``, spec §2.1), decodes every GRAPH_COMPUTE (``device u32 | n_nodes u32 |
node ids u64[n] | n_tensors u32 | rpc_tensor[n]``, 7.0.0) with rpcguard's own ``decode_tensor``
and the version's op table, and folds each node into an ``OpStat`` keyed by op name (UNARY and
GLU with their sub-op from op_params[0], names from ggml.h:607-644 of the pinned sdist). Per op
it keeps the (dst type <- src types) signatures, a few example shapes, the distinct op_params,
and notes on what a per-op rule must accept: srcs that are views, non-contiguous or permuted
srcs, broadcast second operands, a dst that is itself a view, and srcs that are not nodes of the
same graph (weights, KV cache, inputs).

``python -m tests.support.opsurvey_run`` records one client run per configuration and renders the
survey as markdown (see ``--help``); ``tests/integration/test_models_real.py`` uses the survey
to check that each test model really sends the ops it was built to exercise.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, field

from rpcguard.protocol.ggml import TYPES, op_table
from rpcguard.protocol.tensor import RpcTensor, decode_tensor
from rpcguard.protocol.versions import COMMAND_IDS, TENSOR_BYTES

__all__ = ["OpStat", "Survey", "survey_stream", "render", "render_summary", "UNARY_OPS",
           "GLU_OPS"]

# enum ggml_unary_op / enum ggml_glu_op, llama-cpp-python 0.3.36 ggml/include/ggml.h:607-644.
UNARY_OPS = ("ABS", "SGN", "NEG", "STEP", "TANH", "ELU", "RELU", "SIGMOID", "GELU", "GELU_QUICK",
             "SILU", "HARDSWISH", "HARDSIGMOID", "EXP", "EXPM1", "SOFTPLUS", "GELU_ERF", "XIELU",
             "FLOOR", "CEIL", "ROUND", "TRUNC")  # fmt: skip
GLU_OPS = ("REGLU", "GEGLU", "SWIGLU", "SWIGLU_OAI", "GEGLU_ERF", "GEGLU_QUICK", "SWIGLU_CLAMP")
GRAPH_COMPUTE = COMMAND_IDS["GRAPH_COMPUTE"]
BINARY = frozenset({"ADD", "SUB", "MUL", "DIV"})  # ops whose src[1] may be broadcast (ggml_can_repeat)
MAX_EXAMPLES = 4
_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<BQ")


@dataclass
class OpStat:
    """What one op (or UNARY/GLU sub-op) looked like over every node that used it."""

    count: int = 0
    signatures: Counter = field(default_factory=Counter)  # "dst <- src0, src1, ..."
    notes: Counter = field(default_factory=Counter)
    params: Counter = field(default_factory=Counter)  # op_params with trailing zeros cut
    shapes: list[str] = field(default_factory=list)
    seen_in: set = field(default_factory=set)  # labels of the runs (variants) that sent it


@dataclass
class Survey:
    graphs: int = 0
    nodes: int = 0
    max_nodes: int = 0
    devices: set = field(default_factory=set)
    ops: dict[str, OpStat] = field(default_factory=dict)
    leaf_ops: Counter = field(default_factory=Counter)  # ops of listed tensors that are not nodes
    leaf_notes: Counter = field(default_factory=Counter)  # empty / unallocated non-node tensors
    commands: Counter = field(default_factory=Counter)

    def merge(self, other: "Survey", label: str = "") -> None:
        self.graphs += other.graphs
        self.nodes += other.nodes
        self.max_nodes = max(self.max_nodes, other.max_nodes)
        self.devices |= other.devices
        self.leaf_ops.update(other.leaf_ops)
        self.leaf_notes.update(other.leaf_notes)
        self.commands.update(other.commands)
        for k, st in other.ops.items():
            mine = self.ops.setdefault(k, OpStat())
            mine.count += st.count
            mine.signatures.update(st.signatures)
            mine.notes.update(st.notes)
            mine.params.update(st.params)
            mine.seen_in |= st.seen_in | ({label} if label else set())
            for s in st.shapes:
                if s not in mine.shapes and len(mine.shapes) < MAX_EXAMPLES:
                    mine.shapes.append(s)


def _tname(t: RpcTensor) -> str:
    info = TYPES.get(t.type)
    return info.name if info else f"type{t.type}"


def _contiguous(t: RpcTensor) -> bool:
    """ggml_is_contiguous: strides are the packed strides of the shape (size-1 dims ignored)."""
    info = TYPES.get(t.type)
    if info is None:
        return False
    want = info.type_size
    if t.nb0 != want:
        return False
    want = info.type_size * (t.ne0 // info.blck_size)
    for ne, nb in ((t.ne1, t.nb1), (t.ne2, t.nb2), (t.ne3, t.nb3)):
        if ne != 1 and nb != want:
            return False
        want *= ne
    return True


def _permuted(t: RpcTensor) -> bool:
    nbs = [nb for ne, nb in zip(t.ne, t.nb) if ne != 1]
    return nbs != sorted(nbs)


def _shape(t: RpcTensor) -> str:
    ne = list(t.ne)
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return "x".join(map(str, ne))


def op_key(names: tuple[str, ...], t: RpcTensor) -> str:
    name = names[t.op] if 0 <= t.op < len(names) else f"op{t.op}"
    if name == "UNARY":
        sub = UNARY_OPS[t.param0] if 0 <= t.param0 < len(UNARY_OPS) else str(t.param0)
        return f"UNARY/{sub}"
    if name == "GLU":
        sub = GLU_OPS[t.param0] if 0 <= t.param0 < len(GLU_OPS) else str(t.param0)
        return f"GLU/{sub}" + ("(swapped)" if t.param1 else "")
    return name


def _params(t: RpcTensor) -> tuple[int, ...]:
    p = list(t.op_params)
    while p and p[-1] == 0:
        p.pop()
    return tuple(p)


def survey_graph(payload: memoryview | bytes, version=(7, 0, 0), out: Survey | None = None) -> Survey:
    """Fold one GRAPH_COMPUTE payload (7.0.0 layout: leading device u32) into ``out``."""
    out = out or Survey()
    names = op_table(version).names
    mv = memoryview(payload)
    device, n_nodes = struct.unpack_from("<II", mv, 0)
    nodes = struct.unpack_from(f"<{n_nodes}Q", mv, 8)
    at = 8 + 8 * n_nodes
    m = _U32.unpack_from(mv, at)[0]
    tensors = [decode_tensor(mv, at + 4 + i * TENSOR_BYTES) for i in range(m)]
    by_id = {t.id: t for t in tensors}
    node_set = set(nodes)
    out.graphs += 1
    out.nodes += n_nodes
    out.max_nodes = max(out.max_nodes, n_nodes)
    out.devices.add(device)
    for t in tensors:
        if t.id not in node_set:
            out.leaf_ops[op_key(names, t)] += 1
            if 0 in t.ne:
                out.leaf_notes["empty"] += 1
            if not t.buffer:
                out.leaf_notes["buffer 0"] += 1
    for nid in nodes:
        t = by_id[nid]
        key = op_key(names, t)
        st = out.ops.setdefault(key, OpStat())
        st.count += 1
        srcs = [by_id.get(s) if s else None for s in t.src]
        while srcs and srcs[-1] is None:
            srcs.pop()
        sig = f"{_tname(t)} <- " + ", ".join(_tname(s) if s else "-" for s in srcs)
        st.signatures[sig] += 1
        p = _params(t)
        if p:
            st.params[p] += 1
        shape = f"{_shape(t)} <- " + ", ".join(_shape(s) if s else "-" for s in srcs)
        if shape not in st.shapes and len(st.shapes) < MAX_EXAMPLES:
            st.shapes.append(shape)
        if t.view_src:
            st.notes["dst is a view"] += 1
        if 0 in t.ne:
            st.notes["dst empty (an ne is 0)"] += 1
        if not t.buffer:
            st.notes["dst buffer 0"] += 1
        for i, s in enumerate(srcs):
            if s is None:
                if i < len(srcs):
                    st.notes[f"src{i} absent"] += 1
                continue
            if s.view_src:
                st.notes[f"src{i} view"] += 1
            if 0 in s.ne:
                st.notes[f"src{i} empty"] += 1
            if not s.buffer:
                st.notes[f"src{i} buffer 0"] += 1
            if not _contiguous(s):
                st.notes[f"src{i} non-contiguous" + (" (permuted)" if _permuted(s) else "")] += 1
            if s.id not in node_set:
                st.notes[f"src{i} not a node ({op_key(names, s)})"] += 1
        if key in BINARY and len(srcs) > 1 and srcs[0] and srcs[1] and srcs[1].ne != srcs[0].ne:
            st.notes["src1 broadcast"] += 1
    return out


def survey_stream(stream: bytes, version=(7, 0, 0), out: Survey | None = None) -> Survey:
    """Every GRAPH_COMPUTE of one recorded client->server stream (a whole connection)."""
    out = out or Survey()
    mv = memoryview(stream)
    pos = 0
    while pos + 9 <= len(mv):
        cmd, n = _HEAD.unpack_from(mv, pos)
        if pos + 9 + n > len(mv):
            break
        out.commands[cmd] += 1
        if cmd == GRAPH_COMPUTE:
            survey_graph(mv[pos + 9 : pos + 9 + n], version, out)
        pos += 9 + n
    return out


def _fmt_params(p: tuple[int, ...]) -> str:
    """op_params are int32 words; a word that is not a small int is shown as the float it holds."""
    out = []
    for x in p:
        if abs(x) < 1 << 16:
            out.append(str(x))
        else:
            out.append(f"{struct.unpack('<f', struct.pack('<i', x))[0]:.6g}f")
    return "[" + ", ".join(out) + "]"


def render(label: str, s: Survey, config: str = "", variants: tuple[str, ...] = ()) -> str:
    """One markdown section for a survey (merged over ``variants``, the labels of its runs)."""
    lines = [f"### {label}", ""]
    if config:
        lines += [config, ""]
    lines += [f"{s.graphs} GRAPH_COMPUTE frames, {s.nodes} nodes (largest graph {s.max_nodes}), "
              f"devices {sorted(s.devices)}; non-node tensors by op: "
              + ", ".join(f"{k} {v}" for k, v in sorted(s.leaf_ops.items()))
              + "".join(f"; {k}: {v}" for k, v in sorted(s.leaf_notes.items())), ""]
    lines += ["| op | nodes | dst <- src types | example shapes (ne, dst <- srcs) | op_params seen | notes |"
              + (" only in |" if variants else ""),
              "|---|---|---|---|---|---|" + ("---|" if variants else "")]
    for key in sorted(s.ops):
        st = s.ops[key]
        sigs = "; ".join(f"{k} ({v})" for k, v in st.signatures.most_common())
        params = "; ".join(_fmt_params(p) for p, _ in st.params.most_common(3))
        if len(st.params) > 3:
            params += f"; ... ({len(st.params)} distinct)"
        notes = "; ".join(f"{k} ({v})" for k, v in sorted(st.notes.items()))
        row = f"| {key} | {st.count} | {sigs} | {'; '.join(st.shapes)} | {params} | {notes} |"
        if variants:
            only = "" if st.seen_in >= set(variants) else ", ".join(v for v in variants if v in st.seen_in)
            row += f" {only} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def render_summary(surveys: dict[str, Survey]) -> str:
    """The union over models: every op key, which models sent it, its type signatures."""
    keys = sorted(set().union(*(s.ops for s in surveys.values())))
    lines = ["| op | models | dst <- src types (union) |", "|---|---|---|"]
    for k in keys:
        models = [m for m, s in surveys.items() if k in s.ops]
        sigs = Counter()
        for m in models:
            sigs.update(surveys[m].ops[k].signatures)
        lines.append(f"| {k} | {', '.join(models)} | {'; '.join(sorted(sigs))} |")
    leaf, notes = Counter(), Counter()
    for s in surveys.values():
        leaf.update(s.leaf_ops)
        notes.update(s.leaf_notes)
    lines += ["", "Tensors in the list that are not nodes (weights, KV cache, inputs): ops "
              + ", ".join(f"{k} ({v})" for k, v in sorted(leaf.items()))
              + "".join(f"; {k}: {v}" for k, v in sorted(notes.items()))]
    return "\n".join(lines) + "\n"
