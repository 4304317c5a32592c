"""Applying the op table to one graph: nodes equal their re-derived result, tensors keep a layout.

How this works: ``check_node`` takes one GRAPH_COMPUTE node (already decoded), its decoded
sources and the row of its op (oprules/). It checks the source count against the row, the
op_params slots the constructor leaves zero, runs the row's ``derive`` and compares the node with
what the constructor would have produced (type, ne, nb, view_src, view_offs, and for views the
data address). ``check_layout`` is the rule for every tensor of a graph, leaves included: a
tensor in a buffer of the graph's device, non-empty, rows of its type (quantized rows packed),
no more packed element bytes than its buffer holds (so the element count, and every work size a
kernel derives from it, is bounded by the buffer) and no stride larger than the buffer. Together with the per-tensor range check (tensor.py) every index a
kernel derives from ``ne`` addresses bytes inside the tensor's own buffer range. ``check_reach``
covers what a kernel addresses past a tensor's own range (flat rows, the row's ``reach``): inside
the tensor's buffer, the invariant the project holds (issue 20 point 3).
"""

from __future__ import annotations

from typing import Final

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules import New, OpRule, Result, View, contiguous_nb, refuse
from rpcguard.protocol.state import SessionState
from rpcguard.protocol.tensor import RpcTensor

__all__ = [
    "check_node", "check_sources", "check_layout", "check_flat_rows", "check_reach", "check_in_buffer",
    "GGML_MAX_SRC",
]

GGML_MAX_SRC: Final = 10
_SRC0: Final = 29  # index of src0 in RpcTensor
_PARAM0: Final = 12  # index of op_params[0]


def check_sources(rule: OpRule, node: RpcTensor, srcs: list[RpcTensor | None]) -> None:
    """The sources the constructor always sets are there, those it never sets are not. Also
    applied to empty nodes, which no kernel computes but ggml_graph_plan reads (cost.py)."""
    op = rule.op
    for i, t in enumerate(srcs):
        if t is not None and t.id == node.id and not (i == 1 and rule.self_src1):
            raise refuse(node, op, f"src[{i}] is the node itself", "graph_order_invalid")
    for i in range(rule.srcs):
        if srcs[i] is None:
            raise FirewallRefusal("graph_src_missing", f"node id={node.id:#x} op {op} needs src[{i}]")
    for i in range(rule.srcs + rule.optional, GGML_MAX_SRC):
        if srcs[i] is not None:
            raise refuse(node, op, f"src[{i}] is set; the constructor sets at most {rule.srcs + rule.optional}",
                         "graph_src_unexpected")
    if rule.plan is not None:
        rule.plan(node, srcs)


def check_node(rule: OpRule, node: RpcTensor, srcs: list[RpcTensor | None], by_id: dict[int, RpcTensor]) -> None:
    """Refuse ``node`` unless it is what ``rule``'s constructor builds from ``srcs``."""
    op = rule.op
    for i, t in enumerate((node, *srcs)):
        if t is not None:
            if t.type not in TYPES:
                raise refuse(node, op, f"tensor id={t.id:#x} has type {t.type}", "tensor_type_invalid")
            if not (t.ne0 and t.ne1 and t.ne2 and t.ne3) and not (i and rule.empty_sources):
                raise refuse(node, op, f"tensor id={t.id:#x} is empty {t.ne}", "tensor_layout_invalid")
    check_sources(rule, node, srcs)
    params = node[_PARAM0 + rule.params : _PARAM0 + 16]
    if any(params):
        raise refuse(node, op, f"op_params[{rule.params}:] not zero: {params}", "graph_op_params_invalid")
    try:
        derived = rule.derive(node, srcs)
    except (ArithmeticError, LookupError, ValueError, TypeError) as e:  # fail closed on any input
        raise refuse(node, op, f"rule failed on this input ({type(e).__name__})") from None
    results: tuple[Result, ...] = derived if isinstance(derived, tuple) else (derived,)
    misses = [why for why in (_differs(node, r, srcs, by_id) for r in results) if why]
    if len(misses) == len(results):
        raise refuse(node, op, " / ".join(misses))


def _differs(node: RpcTensor, r: Result, srcs: list[RpcTensor | None], by_id: dict[int, RpcTensor]) -> str:
    """Why ``node`` is not ``r`` ("" when it is)."""
    if isinstance(r, New):
        if r.type not in TYPES:
            return f"result type {r.type} unknown"
        if node.type != r.type:
            return f"type {node.type} != {r.type}"
        if node.ne != r.ne:
            return f"ne {node.ne} != {r.ne}"
        want = r.nb if r.nb is not None else contiguous_nb(r.type, r.ne)
        if node.nb != want:
            return f"nb {node.nb} not contiguous for {r.ne}" if r.nb is None else f"nb {node.nb} != {want}"
        if node.view_src or node.view_offs:
            return "a fresh tensor with a view source"
        return ""
    src = srcs[r.src]
    assert isinstance(r, View) and src is not None
    if node.type != src.type:
        return f"view type {node.type} != source type {src.type}"
    if node.ne != r.ne or node.nb != r.nb:
        return f"view ne/nb {node.ne}/{node.nb} != {r.ne}/{r.nb}"
    root_id = src.view_src or src.id
    offs = (src.view_offs if src.view_src else 0) + r.offs
    if node.view_src != root_id or node.view_offs != offs:
        return f"view of {node.view_src:#x}+{node.view_offs}, expected {root_id:#x}+{offs}"
    root = by_id.get(root_id)
    if root is None:
        return f"view root {root_id:#x} not in the graph"
    # ggml_new_tensor_impl: data = view_src->data + view_offs, NULL while the root has no data
    if node.buffer != root.buffer or node.data != (root.data + offs if root.data else 0):
        return f"view data {node.data:#x} in {node.buffer:#x} is not its root's data + {offs}"
    return ""


def check_layout(t: RpcTensor, state: SessionState, device: int) -> None:
    """The layout rule for a graph tensor (see the module docstring)."""
    info = TYPES.get(t.type)
    if info is None:  # only with the tensor group off: nothing is known about it
        return
    buf = state.buffers.get(t.buffer)
    if buf is None:
        raise FirewallRefusal(
            "graph_tensor_unallocated", f"tensor id={t.id:#x}: not in a live buffer (buffer {t.buffer:#x})"
        )
    if buf.device != device:
        raise FirewallRefusal(
            "graph_tensor_wrong_device",
            f"tensor id={t.id:#x}: buffer {t.buffer:#x} is on device {buf.device}, the graph runs on {device}",
        )
    ne0, ne1, ne2, ne3 = t.ne
    nb0, nb1, nb2, nb3 = t.nb
    if not (ne0 and ne1 and ne2 and ne3):
        raise FirewallRefusal("tensor_layout_invalid", f"tensor id={t.id:#x}: empty shape {t.ne} in a graph")
    blck, size = info.blck_size, info.type_size
    if nb0 < size or (blck > 1 and nb0 != size):
        raise FirewallRefusal("tensor_layout_invalid", f"tensor id={t.id:#x}: nb0 {nb0} for {info.name} ({size})")
    if max(nb1, nb2, nb3) > buf.size:
        raise FirewallRefusal(
            "tensor_layout_invalid", f"tensor id={t.id:#x}: a stride of {t.nb} exceeds its {buf.size}-byte buffer"
        )
    # ggml_new_tensor_impl asserts that a view's packed size (plus its offset) fits in its source,
    # and a fresh tensor is packed: no tensor ggml builds has more element bytes, counted from its
    # first byte, than the rest of the buffer it lives in holds. This bounds the element count,
    # and every work size a kernel derives from it, by the buffer (zero strides would otherwise
    # give 2^62 elements in 4 bytes), and it is the reach of every kernel that walks a
    # contiguous tensor as one flat run of elements (memcpy of ggml_nbytes, ``i*type_size``).
    dense = ne0 // blck * size * ne1 * ne2 * ne3
    start = t.data - buf.base if buf.base is not None else 0
    if start + dense > buf.size:
        raise FirewallRefusal(
            "tensor_layout_invalid",
            f"tensor id={t.id:#x}: {t.ne} elements ({dense} bytes packed from offset {start}) exceed its "
            f"{buf.size}-byte buffer",
        )


def check_reach(rule: OpRule, node: RpcTensor, srcs: list[RpcTensor | None], state: SessionState) -> None:
    """Every byte the kernel of a node ``check_node`` accepted addresses past its tensors' own
    ranges lies in their buffers: the flat-row walk (``rule.flat_rows``, check_flat_rows) of the
    node and its sources, and what ``rule.reach`` names (a source read further than its
    ggml_nbytes from its data pointer: ROPE's freq factors). The project's invariant is per
    buffer (issue 20 point 3): a kernel may address bytes of the tensor's buffer outside the
    tensor (the session's own allocation), never past that buffer."""
    if rule.flat_rows:
        for t in (node, *srcs):
            if t is not None:
                check_flat_rows(t, state)
    if rule.reach is not None:
        for t, n in rule.reach(node, srcs):
            check_in_buffer(t, n, state, f"node id={node.id:#x} op {rule.op}")


def check_in_buffer(t: RpcTensor, n: int, state: SessionState, who: str) -> None:
    """``[t.data, t.data + n)`` lies inside ``t``'s buffer: a kernel addresses ``n`` bytes from
    ``t``'s data pointer (``who`` names the node whose kernel does, for the refusal's detail)."""
    buf = state.buffers.get(t.buffer)
    if buf is None or buf.base is None:
        return  # checks off, or a tensor no kernel computes on (the layout rule refuses the rest)
    end = t.data - buf.base + n
    if end > buf.size:
        raise FirewallRefusal(
            "tensor_layout_invalid",
            f"tensor id={t.id:#x}: {who} addresses {n} bytes from its data, to byte {end} of its {buf.size}-byte "
            "buffer",
        )


def check_flat_rows(t: RpcTensor, state: SessionState) -> None:
    """The reach of a kernel that walks a tensor's rows flattened, row ``i`` at ``data + i*nb1``
    for ``i < ne1*ne2*ne3`` (scale, clamp, argsort, top-k, glu, leaky_relu ...), lies in its
    buffer. ggml_is_contiguous ignores the stride of a size-1 dimension, so such a kernel would
    otherwise read and write anywhere through the nb1 of a tensor with ne1 == 1 (issue 20, class
    1). A tensor ggml builds for such a kernel has its rows packed above dimension 1, where this
    reach is the per-dimension one that the range check (tensor.py) already bounds."""
    info = TYPES.get(t.type)
    buf = state.buffers.get(t.buffer)
    if info is None or buf is None or buf.base is None:
        return  # checks off, or a tensor no kernel computes on (the layout rule refuses the rest)
    nrows = t.ne1 * t.ne2 * t.ne3
    if not (t.ne0 and nrows):
        return
    row = (t.ne0 // info.blck_size - 1) * t.nb0 + info.type_size
    end = t.data - buf.base + (nrows - 1) * t.nb1 + row
    if end > buf.size:
        raise FirewallRefusal(
            "tensor_layout_invalid",
            f"tensor id={t.id:#x}: {nrows} rows of stride nb1={t.nb1} reach byte {end} of its {buf.size}-byte "
            "buffer (the kernel walks rows flattened)",
        )

