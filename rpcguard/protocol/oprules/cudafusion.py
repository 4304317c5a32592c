"""The CUDA layer's pair rules: what a fused kernel of consecutive nodes assumes that neither
node's own row (oprules/cuda.py) checks.

Stays whole (over 400 lines): one rule per fused kernel of one ggml_cuda_try_fuse, plus the port of
its top-k matcher they share; split by pattern, the rules would lose the graph view and the cache
key they have in common.

How this works: ``ggml_cuda_graph_evaluate_and_capture`` calls ``ggml_cuda_try_fuse``
(ggml-cuda.cu:3506-4288, llama.cpp b11434; called at :4425) for every computed node and, when a run of
consecutive nodes matches a pattern and its predicate (``ggml_cuda_can_fuse``, ggml-cuda.cu:3239;
``ggml_can_fuse`` / ``ggml_can_fuse_subgraph``, ggml-impl.h / ggml.c:7769), runs them as one
kernel that reads the *later* nodes' operands with assumptions of its own: a bias of F32 read with
the output's strides, an index read as one packed int64 per token, a write of the first node's
shape packed into the last node's tensor. Each rule below restates the structural part of a
predicate (ops, edges, types, shapes) and refuses the graph when the fused kernel would then
abort (a GGML_ASSERT, a host read past the node list) or write past a tensor (a packed write over
a strided tensor stays inside its buffer, the layout rule's packed-size bound, but lands on other
tensors' bytes; no real graph has one, so it is refused too); it returns
what the kernel reads past the nodes' own tensors as (tensor, bytes from its data), which
``backend.check_fusions`` keeps inside the tensor's buffer.

Deliberately not restated: ``ggml_can_fuse``'s "used only by the fused nodes" test (the use
counts the server holds and GGML_TENSOR_FLAG_OUTPUT, both from the client), the COMPUTE flag,
the memory-range check (ggml-cuda.cu:3030) and the device-dependent kernel choice: a graph is
held to a rule whenever the nodes *could* be fused. Every condition refused here is one no graph
of llama.cpp builds (an F16 bias, a bias with fewer rows than experts, a broadcast weight of one
column with a stride, an index shorter than the rope's tokens, a top-k view wider than the
logits), so assuming the fusion costs no real graph. Only backend cuda runs these rules
(graph.py: one set lookup per node; a rule runs only at a node whose op starts a pattern).
"""

from __future__ import annotations

from typing import Callable, Final, Mapping, Protocol, Sequence

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.oprules.attention import ROPE_TYPE_NEOX
from rpcguard.protocol.oprules.base import is_contiguous, nelements, rows_contiguous
from rpcguard.protocol.tensor import RpcTensor

__all__ = ["FusionGraph", "HEADS", "NOTES", "span", "TOPK_TAIL", "REASON", "check_node", "check_tail", "RULES"]

_T: Final = {info.name: tid for tid, info in TYPES.items()}
F32, F16, BF16, I32, I64, NVFP4 = _T["f32"], _T["f16"], _T["bf16"], _T["i32"], _T["i64"], _T["nvfp4"]
#: the refusal of a fused kernel's abort or out-of-tensor write (reads past a buffer:
#: backend_reach_out_of_buffer, as for single nodes)
REASON: Final = "backend_fusion_unsupported"
#: ggml.h enum ggml_unary_op (3.6.1 on): the unary ops the fusions look at
UNARY_TANH, UNARY_RELU, UNARY_SIGMOID, UNARY_SILU, UNARY_SOFTPLUS = 4, 6, 7, 10, 15
#: ggml.h GGML_ROPE_TYPE_NORMAL / _NEOX: the only modes with fused kernels (ggml-cuda.cu:2751, :2794)
_ROPE_MODES: Final = (0, ROPE_TYPE_NEOX)
#: mmvq.cuh MMVQ_MAX_BATCH_SIZE (= MMVF_MAX_BATCH_SIZE, ggml-cuda.cu:1979): get_mmvq_mmid_max_batch
#: never exceeds it (mmvq.cu:147), so a MUL_MAT_ID with more tokens is never fused
MMVQ_MAX_BATCH: Final = 8
#: ggml_cuda_topk_moe_fusion's longest walk: gating (2 with softplus+sqrt), reshape, bias add,
#: argsort, view, get_rows, reshape, sum_rows, clamp, div, reshape, scale (ggml-cuda.cu:2875-3027)
TOPK_TAIL: Final = 16


class FusionGraph(Protocol):
    """The node list of one graph as the rules see it (graph.py builds it over the payload)."""

    n: int  # number of nodes

    def op(self, i: int) -> str: ...  # op name of node i

    def nid(self, i: int) -> int: ...  # id of node i

    def sid(self, i: int, k: int) -> int: ...  # id of src[k] of node i (0: none)

    def node(self, i: int) -> RpcTensor: ...

    def tensor(self, tid: int) -> RpcTensor | None: ...  # any tensor of the list by id

    def key(self, i: int, span: int) -> bytes | None: ...  # cache key of nodes i..i+span-1 (None: no cache)

    def cached(self, key: bytes) -> bool: ...  # a verdict of this key was "passes"

    def remember(self, key: bytes) -> None: ...


def _refuse(g: FusionGraph, i: int, what: str, cite: str) -> FirewallRefusal:
    return FirewallRefusal("backend_fusion_unsupported",  # REASON
                           f"nodes {i}.. (id={g.nid(i):#x} op {g.op(i)}) fused on CUDA: {what} ({cite})")


def _same_shape(a: RpcTensor, b: RpcTensor) -> bool:
    return a.ne0 == b.ne0 and a.ne1 == b.ne1 and a.ne2 == b.ne2 and a.ne3 == b.ne3


def _uses(g: FusionGraph, j: int, i: int) -> int:
    """Which of src[0] / src[1] of node j is node i: 0 or 1, -1 when neither."""
    x = g.nid(i)
    return 0 if g.sid(j, 0) == x else 1 if g.sid(j, 1) == x else -1


def _src(g: FusionGraph, i: int, k: int) -> RpcTensor | None:
    s = g.sid(i, k)
    return g.tensor(s) if s else None


def _extent(ne: Sequence[int], nb: Sequence[int], size: int) -> int:
    """Bytes from a tensor's data to the end of what a kernel addresses at shape ``ne`` and
    strides ``nb`` (elements of ``size`` bytes)."""
    if not all(ne):
        return 0
    return size + sum((x - 1) * s for x, s in zip(ne, nb))


Reach = list[tuple[RpcTensor, int]]


# -- MUL_MAT / MUL_MAT_ID + bias (ADD / ADD_ID), alone or inside the GLU and scale patterns --------

def _mat_bias(g: FusionGraph, i: int) -> Reach:
    """ggml-cuda.cu:4169-4224 (mul_mat + add), :3969-4030 (gate/up + bias + glu, the bias add right
    after each matrix), :4078-4160 (NVFP4 mul_mat + scale [+ bias]): the bias goes to
    ggml_cuda_mul_mat_vec_f / _q as fusion.x_bias (gate_bias), which assert an F32 bias of dst's
    ne0 and, for MUL_MAT_ID, one row per expert (mmvq.cu:1486-1497, mmvf.cu:666-680), and read it
    with *dst's* strides (mmvq.cu:688-701,
    mmvf.cu:91-97, :352)."""
    mm_is_id = g.op(i) == "MUL_MAT_ID"
    n = g.n
    bias_op = "ADD_ID" if mm_is_id else "ADD"
    scale_tail = ("RESHAPE", "REPEAT", "GET_ROWS", "MUL", bias_op) if mm_is_id else ("MUL", bias_op)
    direct = i + 1 < n and g.op(i + 1) == bias_op
    scaled = i + len(scale_tail) < n and all(g.op(i + 1 + k) == op for k, op in enumerate(scale_tail))
    if not (direct or scaled):
        return []  # the common case: decided on op names alone
    mm = g.node(i)
    a, b = _src(g, i, 0), _src(g, i, 1)
    if a is None or b is None or b.type != F32:
        return []  # MMVF and MMVQ take an F32 src1 only (ggml-cuda.cu:1787, :1807): never fused
    if (mm.ne2 > MMVQ_MAX_BATCH) if mm_is_id else (mm.ne1 != 1):
        return []  # "we only support fusion for ncols_dst = 1" (ggml-cuda.cu:1785-1792, :1815-1822)
    pairs: list[tuple[int, int]] = []  # (bias node, the node it adds to)
    if direct:
        pairs.append((i + 1, i))
    if scaled and a.type == NVFP4:  # the scale MUL in between (ggml-cuda.cu:4086-4105)
        scale_at = i + len(scale_tail) - 1
        pairs.append((scale_at + 1, scale_at))
    reach: Reach = []
    for jb, jp in pairs:
        bn = g.node(jb)
        if bias_op == "ADD":
            side = _uses(g, jb, jp)
            s0, s1 = _src(g, jb, 0), _src(g, jb, 1)
            if side < 0 or s0 is None or s1 is None or not _same_shape(s0, s1):
                continue  # get_bias_tensor, "we don't support repeating adds" (ggml-cuda.cu:4189-4205)
            bias = s1 if side == 0 else s0
            if bias.type != F32:
                raise _refuse(g, i, f"bias id={bias.id:#x} is {TYPES[bias.type].name}, the fused matrix-vector "
                                    "kernel asserts F32", "mmvq.cu:1487, mmvf.cu:668")
            # dst's nb0 (mmvq.cu:1451, mmvf.cu:653): the binary row holds it (a unit src0 nb0, a result new
            # or in place into src0)
            reach.append((bias, _extent(bias.ne, bn.nb, 4)))
        else:
            if g.sid(jb, 0) != g.nid(jp) or g.sid(jb, 2) != g.sid(i, 2):
                continue  # ggml-cuda.cu:4185-4187, :4201-4203
            src1 = _src(g, jb, 1)
            if src1 is None:
                continue
            bias = src1
            if bias.ne1 != a.ne2:
                raise _refuse(g, i, f"ADD_ID bias id={bias.id:#x} has {bias.ne1} rows for {a.ne2} experts: the "
                                    "fused kernel asserts one per expert", "mmvq.cu:1489, mmvf.cu:670")
            # row channel_x (an expert) at dst's channel stride (mmvq.cu:688-690)
            reach.append((bias, (a.ne2 - 1) * bn.nb1 + bn.ne0 * 4))
    return reach


# -- RMS_NORM + MUL (+ ADD): the fused norm (norm.cu:535-681) and norm+rope (rope.cu:853-937) ------

def _rms_norm(g: FusionGraph, i: int) -> Reach:
    """ggml-cuda.cu:3330-3369 and :2759-2810: the MUL's other operand needs only contiguous *rows*
    (ggml_is_contiguous_rows, which looks at nb0 only when ne0 > 1), then norm.cu:571 / :649 and
    rope.cu:903 assert its nb0; the fused kernel writes the result packed (norm.cu:114) into the
    MUL's tensor, which a MUL in place into its other operand lays out with that operand's strides."""
    j = i + 1
    if j >= g.n or g.op(j) != "MUL":
        return []
    side = _uses(g, j, i)
    rms, x = g.node(i), _src(g, i, 0)
    s0, s1 = _src(g, j, 0), _src(g, j, 1)
    if side < 0 or x is None or s0 is None or s1 is None:
        return []
    mul = g.node(j)
    other = s1 if side == 0 else s0
    if not (rms.type == x.type == mul.type == other.type == F32):
        return []  # ggml-cuda.cu:3341-3352
    if side == 1 and not _same_shape(s0, rms):
        return []  # "if rms norm is the B operand, then we don't handle broadcast" (:3355)
    if not (rows_contiguous(s0) and rows_contiguous(s1)):
        return []  # :3360
    if other.nb0 != 4:
        raise _refuse(g, i, f"the MUL's other operand id={other.id:#x} has one column and nb0 {other.nb0}: the "
                            "fused norm asserts nb0 == 4", "norm.cu:571, rope.cu:903")
    if not is_contiguous(mul):
        raise _refuse(g, i, f"the MUL's result id={mul.id:#x} is not contiguous: the fused norm writes it packed, "
                            "past its own elements", "norm.cu:114")
    k = j + 1
    if k < g.n and g.op(k) == "ADD":
        side2 = _uses(g, k, j)
        a0, a1, add = _src(g, k, 0), _src(g, k, 1), g.node(k)
        if side2 >= 0 and a0 is not None and a1 is not None and a0.type == a1.type == add.type == F32 \
                and is_contiguous(a0) and rows_contiguous(a1):  # ggml-cuda.cu:3349-3366
            add_other = a1 if side2 == 0 else a0
            if add_other.nb0 != 4:
                raise _refuse(g, i, f"the ADD's other operand id={add_other.id:#x} has one column and nb0 "
                                    f"{add_other.nb0}: the fused norm asserts nb0 == 4", "norm.cu:649")
    return []


# -- UNARY (SILU / SIGMOID / SOFTPLUS) + MUL: unary.cu:663-701 ---------------------------------------

_GATED_TYPES: Final = frozenset({F32, F16, BF16})


def _unary(g: FusionGraph, i: int) -> Reach:
    """ggml-cuda.cu:3427-3451: the predicate takes ggml_is_contiguous_1 operands (nb0 not looked at
    for one column), unary.cu:672 / :674 then assert nb0; unary_gated_op_kernel writes dst[i]
    packed (unary.cu:277) into the MUL's tensor. The top-k MoE gating (SIGMOID / SOFTPLUS) is
    ``_topk_moe``'s."""
    u = g.node(i)
    reach = _topk_moe(g, i) if u.param0 in (UNARY_SIGMOID, UNARY_SOFTPLUS) else []
    j = i + 1
    if u.param0 not in (UNARY_SILU, UNARY_SIGMOID, UNARY_SOFTPLUS) or j >= g.n or g.op(j) != "MUL":
        return reach
    side = _uses(g, j, i)
    usrc = _src(g, i, 0)
    other = _src(g, j, 1 - side) if side >= 0 else None
    mul = g.node(j)
    if usrc is None or other is None or u.type not in _GATED_TYPES or not (u.type == mul.type == other.type):
        return reach
    if not (is_contiguous(other, 1) and is_contiguous(usrc, 1) and _same_shape(other, u)):
        return reach
    es = TYPES[u.type].type_size
    for t, at in ((usrc, "unary.cu:672"), (other, "unary.cu:674")):
        if t.nb0 != es:
            raise _refuse(g, i, f"operand id={t.id:#x} has one column and nb0 {t.nb0}: the fused gated kernel "
                                f"asserts nb0 == {es}", at)
    if not is_contiguous(mul):
        raise _refuse(g, i, f"the MUL's result id={mul.id:#x} is not contiguous: the fused gated kernel writes "
                            "it packed, past its own elements", "unary.cu:277")
    return reach


# -- ROPE + VIEW + SET_ROWS (rope.cu:536-705), also after RMS_NORM + MUL (rope.cu:711-790) --------

def _rope(g: FusionGraph, i: int) -> Reach:
    """ggml-cuda.cu:2725-2757, :3317-3326 (ggml_can_fuse_subgraph: the ops and the use counts, no
    edge from the VIEW to the SET_ROWS): the rope's rows go straight into the SET_ROWS tensor at
    ``row_indices[i2]``, one packed int64 per rope token i2 (rope.cu:85, :167, :750-752), each a
    row of rope.ne0*rope.ne1 values of the SET_ROWS type, stored two at a time in the normal mode
    (rope.cu:88-96: the SET_ROWS data and row stride must be multiples of the pair), and the rope
    kernel has no F16 -> F32 instance (rope.cu:647, :691 GGML_ABORT)."""
    k = i + 2
    if k >= g.n or g.op(i + 1) != "VIEW" or g.op(k) != "SET_ROWS":
        return []
    rope, view, sr = g.node(i), g.node(i + 1), g.node(k)
    a, idx = _src(g, i, 0), _src(g, k, 1)
    if a is None or idx is None or a.ne3 != 1 or sr.type not in (F32, F16) or idx.type != I64:
        return []
    if not is_contiguous(view) or view.ne0 != rope.ne0 * rope.ne1 or rope.param2 not in _ROPE_MODES:
        return []
    if (a.type, sr.type) not in ((F32, F32), (F32, F16), (F16, F16)):
        raise _refuse(g, i, f"a {TYPES[a.type].name} rope into a {TYPES[sr.type].name} SET_ROWS: the fused rope "
                            "has no such kernel", "rope.cu:647, :691")
    if sr.ne0 < view.ne0:
        raise _refuse(g, i, f"rows of {view.ne0} rope values into SET_ROWS rows of {sr.ne0}: the fused rope "
                            "writes past the row", "rope.cu:84-85")
    pair = 2 * TYPES[sr.type].type_size
    if rope.param2 == 0 and (sr.data % pair or (sr.ne1 > 1 and sr.nb1 % pair)):
        raise _refuse(g, i, f"SET_ROWS id={sr.id:#x} data {sr.data:#x} / row stride {sr.nb1} not multiples of the "
                            f"{pair}-byte pair the fused normal-mode rope stores at once", "rope.cu:85-96")
    return [(idx, rope.ne2 * 8)]  # row_indices[i2] for every rope token


# -- the top-k MoE gating: ggml_cuda_topk_moe_fusion (ggml-cuda.cu:2875-3027), topk-moe.cu -------

def _topk_walk(g: FusionGraph, i: int) -> tuple[bool, tuple[int, int, int, int, bool, bool] | None]:
    """ggml_cuda_topk_moe_fusion from node i: (reads past the node list, the match as (logits' node,
    ids node, weights node, bias-add node or -1, norm, delayed softmax) or None)."""
    n = g.n
    op = g.op(i)
    start = i
    if op == "UNARY":
        p = g.node(i).param0
        if p == UNARY_SOFTPLUS and i + 1 < n and g.op(i + 1) == "SQRT" and g.sid(i + 1, 0) == g.nid(i):
            i += 1
        elif p != UNARY_SIGMOID:
            return False, None
    delayed = op == "ARGSORT"
    i += 1
    bias_at = -1
    if not delayed:
        if i >= n or g.op(i) != "RESHAPE" or g.sid(i, 0) != g.nid(i - 1):
            return False, None
        probs_reshaped = g.nid(i)
        i += 1
        if i >= n:
            return False, None
        if g.op(i) == "ADD" and g.sid(i, 0) == g.nid(i - 2):
            bias_at = i
            i += 1
        if i >= n or g.op(i) != "ARGSORT":
            return False, None
        if g.sid(i, 0) != g.nid(i - 1 if bias_at >= 0 else i - 2):
            return False, None
        i += 1
        if i >= n or g.op(i) != "VIEW" or g.sid(i, 0) != g.nid(i - 1):
            return False, None
        ids_at = i
        i += 1
        if i >= n or g.op(i) != "GET_ROWS" or g.sid(i, 0) != probs_reshaped or g.sid(i, 1) != g.nid(i - 1):
            return False, None
        weights_at = i
        i += 1
    else:
        if i - 2 < 0:
            return False, None
        probs_reshaped = g.nid(i - 2)
        if i >= n or g.op(i) != "VIEW" or g.sid(i, 0) != g.nid(i - 1):
            return False, None
        i += 1
        if i >= n or g.sid(i, 1) != g.nid(i - 1) or g.sid(i, 0) != probs_reshaped:
            return False, None
        i += 1
        for want in ("RESHAPE", "SOFT_MAX", "RESHAPE"):
            if i >= n or g.op(i) != want or g.sid(i, 0) != g.nid(i - 1):
                return False, None
            i += 1
        ids_at, weights_at = start + 1, i - 1
    match = (start, ids_at, weights_at, bias_at, False, delayed)
    if i >= n:
        return False, match
    norm = False
    if g.op(i) == "RESHAPE":
        # RESHAPE -> SUM_ROWS -> CLAMP with no bound check between them (ggml-cuda.cu:2983-2990),
        # then DIV and RESHAPE (:2993-3004) and SCALE (:3006): nodes[n_nodes] is read when the list
        # ends inside this chain (leafs[0] of the server's graph, uninitialised: ggml.c:7497)
        for want in ("RESHAPE", "SUM_ROWS", "CLAMP"):
            if i >= n:
                return True, match
            if g.op(i) == want and g.sid(i, 0) == g.nid(i - 1):
                i += 1
            else:
                return False, match
        if i >= n:
            return True, match
        if g.op(i) != "DIV" or g.sid(i, 1) != g.nid(i - 1) or g.sid(i, 0) != g.nid(i - 3):
            return False, match
        i += 1
        if i >= n:
            return True, match
        if g.op(i) != "RESHAPE" or g.sid(i, 0) != g.nid(i - 1):
            return False, match
        i += 1
        norm = True
        if i >= n:
            return True, match
    if delayed:
        # the delayed-softmax form fuses without norm only, its weights the last RESHAPE (:3620-3623)
        return False, None if norm else match
    if norm:
        weights_at = i - 1
    if g.op(i) == "SCALE" and g.sid(i, 0) == g.nid(i - 1):
        weights_at = i
    return False, (start, ids_at, weights_at, bias_at, norm, delayed)


def _pow2_experts(n_expert: int) -> bool:
    """topk-moe.cu:409-412 (ggml_cuda_should_use_topk_moe): the expert counts with a kernel."""
    return n_expert > 0 and ((n_expert & (n_expert - 1)) == 0 and n_expert <= 512 or n_expert in (288, 576))


def _topk_moe(g: FusionGraph, i: int) -> Reach:
    """The fused top-k (topk-moe.cu:92-280, ggml_cuda_op_topk_moe :355-401): n_experts = logits.ne0,
    n_rows = logits.ne1, n_expert_used = weights.ne1, none of them tied to the VIEW / GET_ROWS
    shapes by the matcher. It asserts ids' row stride == n_experts (topk-moe.cu:377), keeps
    n_expert_used values per lane in an array of n_experts/32 (:180, :246), writes
    n_rows*n_expert_used packed weights (:112, :275) and ids at row*n_experts + k (:113, :250),
    and reads bias[expert] (:170)."""
    past, m = _topk_walk(g, i)
    if past:
        raise _refuse(g, i, "the node list ends inside the top-k MoE pattern: the matcher reads the node after "
                            "the last one, outside the server's node array", "ggml-cuda.cu:2983-3006")
    if m is None:
        return []
    start, ids_at, weights_at, bias_at, _norm, delayed = m
    logits = _src(g, start, 0)
    ids, weights = g.node(ids_at), g.node(weights_at)
    if logits is None or not ids.nb0 or not _pow2_experts(ids.nb1 // ids.nb0):
        return []  # ggml_cuda_should_use_topk_moe (topk-moe.cu:409-412)
    if not (is_contiguous(weights) and is_contiguous(logits)):
        return []  # topk-moe.cu:414
    softmax = start + 4 if delayed else start
    if g.op(softmax) == "SOFT_MAX" and (g.sid(softmax, 1) or g.sid(softmax, 2)):
        return []  # "don't fuse when masks or sinks are present" (topk-moe.cu:435)
    n_exp, n_rows, n_used = logits.ne0, logits.ne1, weights.ne1
    if ids.nb1 != n_exp * 4:
        raise _refuse(g, i, f"the top-k view id={ids.id:#x} has a row stride of {ids.nb1} bytes for {n_exp} "
                            "experts: the fused top-k asserts one row per expert count", "topk-moe.cu:377")
    if logits.type != F32 or weights.type != F32:
        raise _refuse(g, i, "the fused top-k asserts F32 logits and weights", "topk-moe.cu:363-364")
    if n_used > n_exp or n_used * n_rows > nelements(weights):
        raise _refuse(g, i, f"{n_rows} rows x {n_used} experts used (of {n_exp}) into weights id={weights.id:#x} "
                            f"of {nelements(weights)} values: the fused top-k writes past them",
                      "topk-moe.cu:112, :246, :275")
    reach: Reach = [(ids, ((n_rows - 1) * n_exp + n_used) * 4)]
    if bias_at >= 0:
        bias = _src(g, bias_at, 1)
        if bias is not None:
            reach.append((bias, n_exp * 4))
    return reach


#: op name -> the rule that starts at a node of that op (graph.py looks each node's op up once)
RULES: Final[Mapping[str, Callable[[FusionGraph, int], Reach]]] = {
    "MUL_MAT": _mat_bias, "MUL_MAT_ID": _mat_bias, "RMS_NORM": _rms_norm, "UNARY": _unary, "ROPE": _rope,
    "SOFT_MAX": _topk_moe, "ARGSORT": _topk_moe,
}
HEADS: Final = frozenset(RULES)
#: op name -> (op of the next node -> how many nodes from the head the rule looks at): its verdict
#: depends on those nodes and their src[0..2] only (graph.py caches it under their bytes); a next
#: op not listed means no pattern can match there (each rule returns nothing for it)
_SPANS: Final[Mapping[str, Mapping[str, int]]] = {
    "MUL_MAT": {"ADD": 2, "MUL": 3},  # bias add; NVFP4 scale then bias
    "MUL_MAT_ID": {"ADD_ID": 2, "RESHAPE": 6},
    "RMS_NORM": {"MUL": 3},  # the MUL and an ADD after it
    "UNARY": {"MUL": 2, "RESHAPE": TOPK_TAIL, "SQRT": TOPK_TAIL},  # gated; top-k gating
    "ROPE": {"VIEW": 3},
    "SOFT_MAX": {"RESHAPE": TOPK_TAIL},
    "ARGSORT": {"VIEW": TOPK_TAIL},  # the delayed-softmax top-k
}


#: op name -> (what its pair rule refuses, where read), for ``rpcguard ops --backend cuda``
#: (cuda.layer_notes, docs/firewall.md "On a CUDA node, per op")
NOTES: Final[Mapping[str, tuple[tuple[str, str], ...]]] = {
    "MUL_MAT": (("fused with the next ADD (bias): a bias not F32; the bias read with the result's strides "
                 "inside its buffer", "mmvq.cu:1486-1497; mmvf.cu:666-680"),),
    "MUL_MAT_ID": (("fused with the next ADD_ID: a bias without one row per expert; its rows read inside "
                    "its buffer", "mmvq.cu:1489; mmvf.cu:670"),),
    "RMS_NORM": (("fused with the next MUL (+ ADD): an operand of one column with nb0 != 4; a MUL result "
                  "that is not contiguous", "norm.cu:114,571,649; rope.cu:903"),),
    "UNARY": (("SILU/SIGMOID/SOFTPLUS fused with the next MUL: an operand of one column with nb0 != its "
               "element size; a MUL result that is not contiguous", "unary.cu:277,672-674"),
              ("SIGMOID/SOFTPLUS gating of a top-k MoE: as SOFT_MAX", "ggml-cuda.cu:2875-3027")),
    "ROPE": (("fused with VIEW + SET_ROWS: F16 rope into F32 rows, rows longer than the SET_ROWS row, a "
              "misaligned pair store; the index read per rope token inside its buffer",
              "rope.cu:85-96,647,691"),),
    "SOFT_MAX": (("top-k MoE gating: the node list ending inside the pattern; a top-k view whose row stride "
                  "is not the expert count; more weights written than the weights tensor holds; ids and bias "
                  "inside their buffers", "ggml-cuda.cu:2983-3006; topk-moe.cu:112-113,170,377"),),
    "ARGSORT": (("the delayed-softmax top-k MoE: as SOFT_MAX", "ggml-cuda.cu:2875-3027; topk-moe.cu:377"),),
}


def span(g: FusionGraph, i: int) -> int:
    """How many nodes from node i (whose op is one of HEADS) its rule looks at; 0: none can fuse,
    told by the next node's op alone."""
    return _SPANS[g.op(i)].get(g.op(i + 1), 0) if i + 1 < g.n else 0


def check_node(g: FusionGraph, i: int) -> Reach:
    """The pair rule of node i's op (a key of RULES): raises FirewallRefusal(REASON) for an abort
    or an out-of-tensor write, returns the reads past the nodes' tensors."""
    return RULES[g.op(i)](g, i)


def check_tail(g: FusionGraph) -> None:
    """The top-k matcher's read past the end of the node list (``_topk_walk``) can only start in
    the last TOPK_TAIL nodes: checked for every graph, whatever its cache says."""
    for i in range(max(0, g.n - TOPK_TAIL), g.n):
        op = g.op(i)
        if op in ("SOFT_MAX", "ARGSORT") or (op == "UNARY" and g.node(i).param0 in (UNARY_SIGMOID, UNARY_SOFTPLUS)):
            if _topk_walk(g, i)[0]:
                raise _refuse(g, i, "the node list ends inside the top-k MoE pattern: the matcher reads the node "
                                    "after the last one, outside the server's node array", "ggml-cuda.cu:2983-3006")
