"""The CUDA layer's pair rules (oprules/cudafusion.py): for each fused kernel of llama.cpp b11434
that assumes what neither node's row checks, a graph of nodes that each pass is refused on a CUDA
node, forwarded on a CPU node (and with ``auto`` before the server said anything), and the same
graph with the condition that makes it safe is forwarded on CUDA; the graphs llama.cpp builds
(bias after a matrix-vector product, RMS_NORM * weight (+ residual), SiLU * up, ROPE -> VIEW ->
SET_ROWS into a KV cache, top-k MoE routing of 8..256 experts, gpt-oss's expert biases) pass."""

from __future__ import annotations

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import TensorSpec, graph_payload
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.graph import GraphValidator, op_rules
from rpcguard.protocol.oprules import cudafusion
from rpcguard.protocol.settings import FirewallPolicy
from tests.support.graphspec import BASE, OPS, SIZE, V7, T, f, state

F32, F16, Q4_0, Q8_0, I32, I64 = 0, 1, 2, 8, 26, 27
SILU, SIGMOID, SOFTPLUS = cudafusion.UNARY_SILU, cudafusion.UNARY_SIGMOID, cudafusion.UNARY_SOFTPLUS
GELU = 8
FUSION = cudafusion.REASON


def N(id: int, op: str, type: int, ne, src, params=(), **kw) -> TensorSpec:
    return T(id, type, ne, op=OPS[op], src=src, op_params=params, **kw)


def run(leaves, nodes, setting: str) -> None:
    # contained: the patterns hold GET_ROWS / SET_ROWS / MUL_MAT_ID / ADD_ID, which CUDA indexes
    # with tensor contents (forwarded to a contained server only, oprules/cuda.py CONTENT_INDEXED)
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, backend=setting, contained=True))
    v.check(memoryview(graph_payload([n.id for n in nodes], leaves + nodes)), state())


def cuda_reason(leaves, nodes) -> str:
    run(leaves, nodes, "cpu")
    run(leaves, nodes, "auto")
    with pytest.raises(FirewallRefusal) as exc:
        run(leaves, nodes, "cuda")
    return exc.value.reason


def forwarded(leaves, nodes) -> None:
    for setting in ("cpu", "auto", "cuda"):
        run(leaves, nodes, setting)


# -- builders ----------------------------------------------------------------------------------

def mat_bias(bias_type=F32, bias_first=False, w_type=Q8_0, k=256, rows=8, tok=1):
    w, x = T(0x10, w_type, (k, rows, 1, 1)), T(0x11, F32, (k, tok, 1, 1))
    bias = T(0x12, bias_type, (rows, tok, 1, 1))
    mm = N(0x20, "MUL_MAT", F32, (rows, tok, 1, 1), (0x10, 0x11), use_count=1)
    src = (0x12, 0x20) if bias_first else (0x20, 0x12)
    add = N(0x21, "ADD", bias_type if bias_first else F32, (rows, tok, 1, 1), src)
    return [w, x, bias], [mm, add]


def mat_id_bias(bias_rows=8, tok=1, experts=8):
    w = T(0x10, Q4_0, (256, 16, experts, 1))
    x, ids = T(0x11, F32, (256, 2, tok, 1)), T(0x12, I32, (2, tok, 1, 1))
    bias = T(0x13, F32, (16, bias_rows, 1, 1))
    mm = N(0x20, "MUL_MAT_ID", F32, (16, 2, tok, 1), (0x10, 0x11, 0x12))
    add = N(0x21, "ADD_ID", F32, (16, 2, tok, 1), (0x20, 0x13, 0x12))
    return [w, x, ids, bias], [mm, add]


def rms_mul(w_ne=(64, 1, 1, 1), w_nb=None, tok=3, residual=False, inplace_into_w=False, add_nb=None):
    x = T(0x10, F32, (64, tok, 1, 1))
    w = T(0x11, F32, w_ne, **({"nb": w_nb} if w_nb else {}))
    rms = N(0x20, "RMS_NORM", F32, (64, tok, 1, 1), (0x10,), (f(1e-6),))
    if inplace_into_w:
        mul = N(0x21, "MUL", F32, w_ne, (0x11, 0x20), nb=w.strides(), view_src=0x11, data=w.data)
    else:
        mul = N(0x21, "MUL", F32, (64, tok, 1, 1), (0x20, 0x11))
    leaves, nodes = [x, w], [rms, mul]
    if residual:
        r = T(0x12, F32, (64, tok, 1, 1)) if add_nb is None else T(0x12, F32, (1, tok, 1, 1), nb=add_nb)
        leaves.append(r)
        nodes.append(N(0x22, "ADD", F32, (64, tok, 1, 1), (0x21, 0x12)))
    return leaves, nodes


def gated(op=SILU, ne=(32, 3, 1, 1), u_nb=None, o_nb=None, type_=F32):
    u = T(0x10, type_, ne, **({"nb": u_nb} if u_nb else {}))
    o = T(0x11, type_, ne, **({"nb": o_nb} if o_nb else {}))
    act = N(0x20, "UNARY", type_, ne, (0x10,), (op,))
    return [u, o], [act, N(0x21, "MUL", type_, ne, (0x20, 0x11))]


def rope_set_rows(tok=3, idx_len=None, idx_data=None, rope_type=F32, cache_type=F16, cache_ne0=None, mode=0):
    d, heads = 8, 2
    a = T(0x10, rope_type, (d, heads, tok, 1))
    pos = T(0x11, I32, (tok, 1, 1, 1))
    params = (0, d, mode, 0, 512, f(10000.0), f(1.0), 0, f(1.0), f(32.0), f(1.0), 0, 0, 0, 0, 0)
    rope = N(0x20, "ROPE", rope_type, (d, heads, tok, 1), (0x10, 0x11), params)
    n = tok if idx_len is None else idx_len
    row = d * heads if cache_ne0 is None else cache_ne0
    ts = TYPES[rope_type].type_size
    view = N(0x21, "VIEW", rope_type, (d * heads, n, 1, 1), (0x20,), view_src=0x20, data=rope.data,
             nb=(ts, d * heads * ts, d * heads * n * ts, d * heads * n * ts))
    leaves = [a, pos]
    if cache_ne0 is not None:  # the SET_ROWS copies another source of its rows
        leaves.append(T(0x15, rope_type, (row, n, 1, 1)))
    src0 = 0x21 if cache_ne0 is None else 0x15
    cache = T(0x12, cache_type, (row, 64, 1, 1))
    idx = T(0x13, I64, (n, 1, 1, 1), **({"data": idx_data} if idx_data else {}))
    sr = N(0x22, "SET_ROWS", cache_type, (row, 64, 1, 1), (src0, 0x13, 0x12), view_src=0x12, data=cache.data)
    return leaves + [cache, idx], [rope, view, sr]


def topk(n_exp=8, tok=4, k=2, gating="softmax", bias=False, norm=False, scale=False, view_nb1=None,
         probs_ne=None, end=None, bias_ne0=None, consumer=False, argsort_data=None, view_offs=0):
    """llama.cpp's build_moe_ffn routing (softmax / sigmoid (+ bias) -> argsort -> top-k view ->
    get_rows of the probabilities, optional weight normalisation and scale; ``consumer``: then
    the experts' outputs times the weights, as the graph goes on)."""
    lg = T(0x10, F32, (n_exp, tok, 1, 1))
    leaves, nodes = [lg], []
    if gating == "softmax":
        nodes.append(N(0x20, "SOFT_MAX", F32, (n_exp, tok, 1, 1), (0x10,), (f(1.0), f(0.0))))
    else:
        nodes.append(N(0x20, "UNARY", F32, (n_exp, tok, 1, 1), (0x10,), (SIGMOID,)))
    pne = probs_ne or (1, n_exp, tok, 1)
    nodes.append(N(0x21, "RESHAPE", F32, pne, (0x20,), view_src=0x20, data=nodes[0].data))
    sel = 0x20
    if bias:
        leaves.append(T(0x11, F32, (bias_ne0 or n_exp, 1, 1, 1)))
        nodes.append(N(0x26, "ADD", F32, (n_exp, tok, 1, 1), (0x20, 0x11)))
        sel = 0x26
    nodes.append(N(0x22, "ARGSORT", I32, (n_exp, tok, 1, 1), (sel,), (1,),
                   **({"data": argsort_data} if argsort_data else {})))
    nb1 = view_nb1 or n_exp * 4
    vrows = pne[2]
    nodes.append(N(0x23, "VIEW", I32, (k, vrows, 1, 1), (0x22,), (view_offs, 0), nb=(4, nb1, nb1 * vrows, nb1 * vrows),
                   view_src=0x22, data=nodes[-1].data + view_offs, view_offs=view_offs))
    nodes.append(N(0x24, "GET_ROWS", F32, (pne[0], k, vrows, 1), (0x21, 0x23)))
    last = 0x24
    if norm:
        w2 = N(0x30, "RESHAPE", F32, (k, tok, 1, 1), (0x24,), view_src=0x24, data=nodes[-1].data)
        s = N(0x31, "SUM_ROWS", F32, (1, tok, 1, 1), (0x30,))
        c = N(0x32, "CLAMP", F32, (1, tok, 1, 1), (0x31,), (f(6.1e-5), f(float("inf"))))
        d = N(0x33, "DIV", F32, (k, tok, 1, 1), (0x30, 0x32))
        r = N(0x34, "RESHAPE", F32, (1, k, tok, 1), (0x33,), view_src=0x33, data=d.data)
        nodes += [w2, s, c, d, r][:end]
        last = 0x34
    if scale:
        nodes.append(N(0x35, "SCALE", F32, (1, k, tok, 1), (last,), (f(2.5), f(0.0))))
    if consumer:
        leaves.append(T(0x12, F32, (16, k, tok, 1)))
        nodes.append(N(0x37, "MUL", F32, (16, k, tok, 1), (0x12, nodes[-1].id)))
    return leaves, nodes


def topk_delayed(n_exp=32, tok=4, k=4):
    """gpt-oss: argsort of the logits, get_rows of the logits, softmax of the k picked."""
    lg = T(0x10, F32, (n_exp, tok, 1, 1))
    rs = N(0x20, "RESHAPE", F32, (1, n_exp, tok, 1), (0x10,), view_src=0x10, data=lg.data)
    ag = N(0x21, "ARGSORT", I32, (n_exp, tok, 1, 1), (0x10,), (1,))
    vw = N(0x22, "VIEW", I32, (k, tok, 1, 1), (0x21,), nb=(4, n_exp * 4, n_exp * 4 * tok, n_exp * 4 * tok),
           view_src=0x21, data=ag.data)
    gr = N(0x23, "GET_ROWS", F32, (1, k, tok, 1), (0x20, 0x22))
    r1 = N(0x24, "RESHAPE", F32, (k, tok, 1, 1), (0x23,), view_src=0x23, data=gr.data)
    sm = N(0x25, "SOFT_MAX", F32, (k, tok, 1, 1), (0x24,), (f(1.0), f(0.0)))
    r2 = N(0x26, "RESHAPE", F32, (1, k, tok, 1), (0x25,), view_src=0x25, data=sm.data)
    return [lg], [rs, ag, vw, gr, r1, sm, r2]


# -- what llama.cpp builds passes --------------------------------------------------------------

@pytest.mark.parametrize("tok", [1, 2, 8, 512])
def test_real_bias_after_matrix(tok):
    forwarded(*mat_bias(tok=tok))
    forwarded(*mat_bias(tok=tok, w_type=F16))


@pytest.mark.parametrize("tok", [1, 4])
def test_real_expert_biases(tok):
    forwarded(*mat_id_bias(tok=tok))


@pytest.mark.parametrize("tok", [1, 7, 4096])
def test_real_norm_times_weight(tok):
    forwarded(*rms_mul(tok=tok))
    forwarded(*rms_mul(tok=tok, residual=True))
    forwarded(*rms_mul(w_ne=(1, 1, 1, 1), tok=tok))  # a broadcast scalar weight, contiguous


@pytest.mark.parametrize("op", [SILU, SIGMOID, SOFTPLUS])
def test_real_gated_activation(op):
    forwarded(*gated(op))
    forwarded(*gated(op, ne=(1, 4, 1, 1)))  # one column, unit stride


@pytest.mark.parametrize("tok", [1, 3, 512])
@pytest.mark.parametrize("mode", [0, 2])
def test_real_rope_into_kv_cache(tok, mode):
    forwarded(*rope_set_rows(tok=tok, mode=mode))
    forwarded(*rope_set_rows(tok=tok, mode=mode, cache_type=F32))


@pytest.mark.parametrize("n_exp,k", [(8, 2), (32, 4), (64, 8), (128, 8), (256, 8)])
@pytest.mark.parametrize("tok", [1, 5])
def test_real_moe_routing(n_exp, k, tok):
    forwarded(*topk(n_exp, tok, k))
    forwarded(*topk(n_exp, tok, k, consumer=True))
    forwarded(*topk(n_exp, tok, k, norm=True, consumer=True))
    forwarded(*topk(n_exp, tok, k, norm=True, scale=True))
    forwarded(*topk(n_exp, tok, k, gating="sigmoid", bias=True, norm=True, scale=True, consumer=True))
    forwarded(*topk_delayed(n_exp, tok, k))


# -- the gaps ----------------------------------------------------------------------------------

def test_matrix_bias_not_f32_refused():
    # ADD(bias f16, mm): per node an F16 + F32 add (binbcast F16/F32/F16); fused, mmvq.cu:1487 asserts F32
    assert cuda_reason(*mat_bias(bias_type=F16, bias_first=True)) == FUSION
    forwarded(*mat_bias(bias_type=F16, bias_first=True, tok=2))  # two columns: never fused


def test_expert_bias_rows_refused():
    # ggml_add_id ties b.ne0 only; mmvq.cu:1489 / mmvf.cu:670 assert one bias row per expert
    assert cuda_reason(*mat_id_bias(bias_rows=4)) == FUSION
    forwarded(*mat_id_bias(bias_rows=4, tok=9))  # more than 8 tokens: never fused


def test_norm_weight_of_one_strided_column_refused():
    # ggml_is_contiguous_rows skips nb0 for one column; norm.cu:571 asserts it
    assert cuda_reason(*rms_mul(w_ne=(1, 3, 1, 1), w_nb=(8, 8, 24, 24))) == FUSION
    forwarded(*rms_mul(w_ne=(1, 3, 1, 1)))
    # the residual ADD's operand: norm.cu:649
    assert cuda_reason(*rms_mul(residual=True, add_nb=(8, 8, 24, 24))) == FUSION


def test_norm_into_a_strided_weight_refused():
    # MUL(w, rms) in place into w, whose rows overlap: the fused norm writes packed (norm.cu:114)
    leaves, nodes = rms_mul(w_ne=(64, 3, 1, 1), w_nb=(4, 128, 384, 384), inplace_into_w=True)
    assert cuda_reason(leaves, nodes) == FUSION
    forwarded(*rms_mul(w_ne=(64, 3, 1, 1), inplace_into_w=True))


@pytest.mark.parametrize("which", ["unary", "other"])
def test_gated_operand_of_one_strided_column_refused(which):
    kw = {"u_nb": (8, 4, 12, 12)} if which == "unary" else {"o_nb": (8, 4, 12, 12)}
    assert cuda_reason(*gated(ne=(1, 3, 1, 1), **kw)) == FUSION
    forwarded(*gated(ne=(1, 3, 1, 1)))
    forwarded(*gated(GELU, ne=(1, 3, 1, 1), **kw))  # GELU * x is never fused


def test_rope_index_read_past_the_buffer_refused():
    # the fused rope reads one int64 per rope token (rope.cu:85): an index of 1 for 3 tokens at
    # the end of the buffer
    leaves, nodes = rope_set_rows(tok=3, idx_len=1, idx_data=BASE + SIZE - 8)
    assert cuda_reason(leaves, nodes) == "backend_reach_out_of_buffer"
    forwarded(*rope_set_rows(tok=3, idx_data=BASE + SIZE - 24))


def test_rope_rows_past_the_set_rows_row_refused():
    # the SET_ROWS copies another source (rows of 8), the VIEW is of the rope (rows of 16): the
    # fused rope writes 16 values per row (rope.cu:84-85)
    assert cuda_reason(*rope_set_rows(cache_ne0=8)) == FUSION


def test_rope_f16_into_f32_rows_refused():
    # no F16 -> F32 fused rope (rope.cu:647); per node SET_ROWS F16 -> F32 is refused already, so
    # only a SET_ROWS of another source reaches the fused kernel
    leaves, nodes = rope_set_rows(rope_type=F16, cache_type=F32, cache_ne0=16)
    leaves[2] = T(0x15, F32, (16, 3, 1, 1))
    assert cuda_reason(leaves, nodes) == FUSION


def test_rope_pairs_into_misaligned_set_rows_refused():
    # the normal-mode rope stores (x0, x1) as one 4-byte int into the F16 cache (rope.cu:88-96):
    # a cache at 2 mod 4 faults; the NEOX mode stores one value at a time
    leaves, nodes = rope_set_rows()
    odd = T(0x12, F16, (16, 63, 1, 1), data=leaves[2].data + 2)
    leaves[2] = odd
    nodes[2] = N(0x22, "SET_ROWS", F16, (16, 63, 1, 1), (0x21, 0x13, 0x12), view_src=0x12, data=odd.data)
    assert cuda_reason(leaves, nodes) == FUSION
    leaves, nodes = rope_set_rows(mode=2)
    leaves[2] = odd
    nodes[2] = N(0x22, "SET_ROWS", F16, (16, 63, 1, 1), (0x21, 0x13, 0x12), view_src=0x12, data=odd.data)
    forwarded(leaves, nodes)


@pytest.mark.parametrize("end", [1, 2, 3, 4, 5])
def test_moe_routing_ending_the_node_list_refused(end):
    # ggml-cuda.cu:2983-3006 read nodes[n_nodes] when the list ends in the normalisation's RESHAPE /
    # SUM_ROWS / CLAMP / DIV / RESHAPE (the SCALE test after the last one has no bound check either)
    assert cuda_reason(*topk(norm=True, end=end)) == FUSION
    forwarded(*topk(norm=True, consumer=True))  # the graph goes on
    forwarded(*topk(norm=True, scale=True))  # ends at the SCALE
    forwarded(*topk())  # ends at GET_ROWS: the matcher stops (:2975-2977)


def test_moe_routing_view_stride_refused():
    # ids' row stride of 16 experts for 8 logits: topk-moe.cu:377 GGML_ASSERT
    assert cuda_reason(*topk(n_exp=8, tok=4, view_nb1=64, probs_ne=(1, 16, 2, 1))) == FUSION
    forwarded(*topk(n_exp=8, tok=4))


def test_moe_routing_weights_past_their_tensor_refused():
    # probabilities reshaped to [1, 16, 2]: 2 index rows, get_rows weights of 2 x 2 values, but
    # the kernel writes logits.ne1 = 4 rows of 2 (topk-moe.cu:112, :275)
    leaves, nodes = topk(n_exp=8, tok=4, probs_ne=(1, 16, 2, 1), view_nb1=32)
    assert cuda_reason(leaves, nodes) == FUSION


def test_moe_routing_ids_written_past_the_buffer_refused():
    # ids[row*n_experts + k] for logits.ne1 = 4 rows (topk-moe.cu:113, :250) from a view of 2 rows
    # (probabilities reshaped to [2, 8, 2]: 8 weights, enough) 88 bytes into an argsort that ends
    # the buffer: rows 2 and 3 land past it
    end = BASE + SIZE - 128
    leaves, nodes = topk(n_exp=8, tok=4, probs_ne=(2, 8, 2, 1), argsort_data=end, view_offs=88)
    assert cuda_reason(leaves, nodes) == "backend_reach_out_of_buffer"
    forwarded(*topk(n_exp=8, tok=4, probs_ne=(2, 8, 2, 1), argsort_data=end))


def test_moe_routing_bias_read_past_the_buffer_refused():
    # bias[expert] for every expert (topk-moe.cu:170): a broadcast bias of 1 value at the end
    leaves, nodes = topk(n_exp=8, gating="sigmoid", bias=True, bias_ne0=1)
    leaves[1] = T(0x11, F32, (1, 1, 1, 1), data=BASE + SIZE - 4)
    assert cuda_reason(leaves, nodes) == "backend_reach_out_of_buffer"
    leaves[1] = T(0x11, F32, (8, 1, 1, 1), data=BASE + SIZE - 32)
    forwarded(leaves, nodes)


def test_rope_normal_mode_pair_store_alignment_per_node():
    # not a fusion: every normal-mode ROPE stores its pair at once (oprules/cuda.py _rope_store)
    a, pos = T(0x10, F32, (8, 2, 3, 1), nb=(4, 36, 72, 216)), T(0x11, I32, (3, 1, 1, 1))
    params = (0, 8, 0, 0, 512, f(10000.0), f(1.0), 0, f(1.0), f(32.0), f(1.0), 0, 0, 0, 0, 0)
    inplace = N(0x20, "ROPE", F32, (8, 2, 3, 1), (0x10, 0x11), params, nb=a.nb, view_src=0x10, data=a.data)
    assert cuda_reason([a, pos], [inplace]) == "backend_misaligned"
    neox = params[:2] + (2,) + params[3:]
    forwarded([a, pos], [N(0x20, "ROPE", F32, (8, 2, 3, 1), (0x10, 0x11), neox, nb=a.nb, view_src=0x10, data=a.data)])
    forwarded([a, pos], [N(0x20, "ROPE", F32, (8, 2, 3, 1), (0x10, 0x11), params)])
    shifted = N(0x20, "ROPE", F32, (8, 2, 3, 1), (0x10, 0x11), params, data=BASE + 0x200004)
    assert cuda_reason([a, pos], [shifted]) == "backend_misaligned"


def test_heads_are_op_names_of_the_table():
    rules = op_rules(V7)
    assert rules is not None
    assert {rules.name(op) for op in rules.fusion_heads_cuda} == cudafusion.HEADS


def test_a_passing_window_is_cached_and_a_changed_neighbour_is_checked_again():
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, backend="cuda", contained=True))
    st = state()
    leaves, nodes = mat_bias()
    v.check(memoryview(graph_payload([n.id for n in nodes], leaves + nodes)), st)
    windows = [k for k in st.node_cache if len(k) % 296 == 2]
    assert len(windows) == 1 and windows[0].startswith(b"F:")
    v.check(memoryview(graph_payload([n.id for n in nodes], leaves + nodes)), st)  # from the cache
    leaves, nodes = mat_bias(bias_type=F16, bias_first=True)  # the same matrix node, another bias
    with pytest.raises(FirewallRefusal) as exc:
        v.check(memoryview(graph_payload([n.id for n in nodes], leaves + nodes)), st)
    assert exc.value.reason == FUSION


def test_a_cpu_node_runs_no_pair_rule():
    # the same refused graphs, on the CPU layer: nothing is looked at (no window cached)
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, backend="cpu", contained=True))
    st = state()
    for leaves, nodes in (mat_bias(bias_type=F16, bias_first=True), topk(norm=True, end=2), rope_set_rows(cache_ne0=8)):
        v.check(memoryview(graph_payload([n.id for n in nodes], leaves + nodes)), st)
    assert not [k for k in st.node_cache if len(k) % 296 == 2]
