"""The op table (oprules/) and its evaluation (opcheck.py): constructor-shaped nodes pass,
single-field mutations that change what a kernel addresses are refused with a stable reason.
The differential proof against the real libggml constructors is tests/differential/."""

from __future__ import annotations

import struct

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import TensorSpec, graph_payload
from rpcguard.protocol.ggml import TYPES, op_table
from rpcguard.protocol.graph import GraphValidator, coverage
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.oprules import RULES, rule_for
from rpcguard.protocol.oprules import kerneltypes
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.versions import KNOWN_VERSIONS, spec_for

HANDLE, BASE, SIZE = 0x5555DEADBE00, 0x7F0000000000, 1 << 24
V7 = (7, 0, 0)
OPS = op_table(V7).ids  # type: ignore[union-attr]
F32, F16, Q4_0, Q8_0, I32 = 0, 1, 2, 8, 26


def override(over: dict, **tensors) -> None:
    """Set fields of a builder's tensors: ``{"a_nb": (...)}`` sets ``a.nb`` of the tensor named ``a``."""
    for key, value in over.items():
        setattr(tensors[key[0]], key[2:], value)


def f(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def state(version=V7) -> SessionState:
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(version))
    st.add_buffer(HANDLE, 0, SIZE)
    st.buffers[HANDLE].base = BASE
    return st


_slot = iter(range(1, 1 << 20))


def T(id: int, type: int = F32, ne=(4, 1, 1, 1), **kw) -> TensorSpec:
    """A tensor of ``type`` in the test buffer, each at its own 64 KiB slot."""
    info = TYPES[type]
    kw.setdefault("buffer", HANDLE)
    kw.setdefault("data", BASE + (id & 0xFF) * 0x10000)
    return TensorSpec(id=id, type=type, ne=ne, type_size=info.type_size, blck_size=info.blck_size, **kw)


def run(tensors: list[TensorSpec], node: TensorSpec, version=V7) -> None:
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64))
    v.check(memoryview(graph_payload([node.id], tensors + [node])), state(version))


def reason(tensors, node, version=V7) -> str:
    with pytest.raises(FirewallRefusal) as exc:
        run(tensors, node, version)
    return exc.value.reason


# -- builders of constructor-shaped nodes ---------------------------------------------------


def mul_mat(**over):
    a = T(0x10, Q8_0, (64, 8, 2, 1))  # weights, 8 rows of 64 q8_0 values, 2 matrices
    b = T(0x11, F32, (64, 3, 4, 1))  # 3 columns, broadcast 4 / 2 over ne2
    d = T(0x20, F32, (8, 3, 4, 1), op=OPS["MUL_MAT"], src=(0x10, 0x11))
    override(over, a=a, b=b, d=d)
    return [a, b], d


def rope(**over):
    a = T(0x10, F32, (8, 2, 3, 1))
    pos = T(0x11, I32, (3, 1, 1, 1))
    params = [0, 8, 0, 0, 512, f(10000.0), f(1.0), 0, f(1.0), f(32.0), f(1.0), 0, 0, 0, 0, 0]
    d = T(0x20, F32, (8, 2, 3, 1), op=OPS["ROPE"], src=(0x10, 0x11), op_params=tuple(params))
    override(over, a=a, p=pos, d=d)
    return [a, pos], d


def view(offset: int = 32, **over):
    a = T(0x10, F32, (8, 4, 1, 1))
    d = T(0x20, F32, (4, 2, 1, 1), nb=(4, 64, 128, 128), op=OPS["VIEW"], src=(0x10,), view_src=0x10,
          view_offs=offset, op_params=(offset, 0), data=BASE + 0x100000 + offset)
    a.data = BASE + 0x100000
    override(over, a=a, d=d)
    return [a], d


def test_constructor_shaped_nodes_pass():
    for build in (mul_mat, rope, view):
        run(*build())


@pytest.mark.parametrize("over", [
    {"d_ne": (8, 3, 2, 1)},  # dst shape is not (a.ne1, b.ne1, b.ne2, b.ne3)
    {"d_nb": (4, 32, 100, 400)},  # a gap the constructor never leaves
    {"d_nb": (4, 32, 96, 1 << 20)},  # the size-1 dim's stride moved far away
    {"d_type": F16},  # MUL_MAT always builds F32
    {"b_ne": (32, 3, 4, 1)},  # inner dims differ: the kernel would read past a row
    {"b_ne": (64, 3, 3, 1)},  # 3 % 2: broadcast ratio the constructor refuses
    {"d_view_src": 0x10},  # a fresh tensor claiming a view source
])
def test_mul_mat_mutations_refused(over):
    assert reason(*mul_mat(**over)) in ("graph_shape_invalid", "tensor_layout_invalid")


def test_mul_mat_sources_and_params():
    tensors, d = mul_mat()
    d.src = (0x10, 0x11, 0x10)  # a third source MUL_MAT never sets
    assert reason(tensors, d) == "graph_src_unexpected"
    tensors, d = mul_mat(d_op_params=(0, 0, 7))  # only prec and hint slots exist
    assert reason(tensors, d) == "graph_op_params_invalid"
    tensors, d = mul_mat(b_type=F16, b_type_size=2)  # src1 must be F32 or src0's vec_dot type
    assert reason(tensors, d) == "graph_shape_invalid"


@pytest.mark.parametrize("i,value", [
    (2, 1),  # mode & 1: no longer supported, the kernel aborts
    (2, 4),  # no such rope mode
    (1, 10),  # n_dims > ne0
    (1, 3),  # odd n_dims
    (15, 2),  # n_offs + n_dims > ne0
])
def test_rope_params_refused(i, value):
    tensors, d = rope()
    params = list(d.op_params)
    params[i] = value
    d.op_params = tuple(params)
    assert reason(tensors, d) == "graph_op_params_invalid"


def test_mrope_sections_cannot_divide_by_zero():
    # The kernel takes (i0/2) % (s0+s1+s2+s3) and asserts only that one section is > 0.
    tensors, d = rope(p_ne=(12, 1, 1, 1))
    params = list(d.op_params)
    params[2] = 8  # MROPE
    params[11:15] = [2, 2, 0, 0]
    d.op_params = tuple(params)
    run(tensors, d)
    params[11:15] = [1, -1, 0, 0]
    d.op_params = tuple(params)
    assert reason(tensors, d) == "graph_op_params_invalid"


def test_rope_n_offs_is_a_7_0_0_param():
    tensors, d = rope()
    params = list(d.op_params)
    params[15] = 2
    params[1] = 6
    d.op_params = tuple(params)
    run(tensors, d)  # 7.0.0: n_offs set by ggml_rope_set_offset
    assert reason(tensors, d, version=(5, 0, 0)) == "graph_op_params_invalid"  # 5.0.0 sets 15 params


@pytest.mark.parametrize("over", [
    {"d_op_params": (200, 0)},  # the constructor's offset is not the view's
    {"d_view_offs": 64},  # view_offs and data disagree with the offset param
    {"d_data": BASE + 0x100000 + 64},  # data is not root data + offset
])
def test_view_mutations_refused(over):
    assert reason(*view(**over)) in ("graph_shape_invalid", "tensor_layout_invalid")


def test_views_read_by_a_kernel_keep_the_layout_rule():
    # A view node is never computed (ggml-cpu skips view ops); once a kernel reads it, its
    # strides must stay inside its buffer.
    tensors, v = view(d_nb=(4, 64, 128, 1 << 30))
    run(tensors, v)
    cont = T(0x30, F32, (4, 2, 1, 1), op=OPS["CONT"], src=(0x20,))
    assert reason(tensors + [v], cont) == "tensor_layout_invalid"


def test_view_past_its_source_refused():
    assert reason(*view(offset=128 - 8 + 64)) == "graph_shape_invalid"


def test_zero_stride_giants_are_refused_by_the_layout_rule():
    # 2^28 elements in 4 bytes: a work size from the element count (bad_alloc) or a kernel busy
    # for years; no constructor makes overlapping strides.
    a = T(0x10, F32, (1 << 10, 1 << 10, 1 << 8, 1), nb=(4, 0, 0, 0))
    d = T(0x20, F32, (1, 1 << 10, 1 << 8, 1), op=OPS["SUM_ROWS"], src=(0x10,))
    assert reason([a], d) == "tensor_layout_invalid"


def test_node_cache_is_keyed_by_the_sources():
    # A node accepted with one source must not stand in for the same node bytes with another.
    st = state()
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64))
    tensors, d = mul_mat()
    v.check(memoryview(graph_payload([d.id], tensors + [d])), st)
    assert st.node_cache
    tensors[1].ne = (64, 5, 4, 1)  # same ids, same node bytes, other source shape
    with pytest.raises(FirewallRefusal):
        v.check(memoryview(graph_payload([d.id], tensors + [d])), st)


def test_every_row_cites_its_constructor_and_ops_exist():
    names = set(op_table(V7).names)  # type: ignore[union-attr]
    for op, rows in RULES.items():
        assert op in names, op
        for r in rows:
            assert "ggml" in r.ctor and r.since < r.until
            assert r.srcs + r.optional <= 10 and 0 <= r.params <= 16


def test_rows_do_not_overlap_in_versions():
    for op in RULES:
        for v in KNOWN_VERSIONS:
            hits = [r for r in RULES[op] if r.since <= v < r.until]
            assert len(hits) <= 1, (op, v)
            # the row, with the version's kernel gaps bound (oprules/kerneltypes.py; none from 7.0.0 on)
            assert rule_for(op, v) is (kerneltypes.bind(hits[0], v) if hits else None)
            if v >= (7, 0, 0) and hits:
                assert rule_for(op, v) is hits[0]


def test_coverage_report():
    for v in sorted(KNOWN_VERSIONS):
        have, total, missing = coverage(v)
        print(f"{'.'.join(map(str, v))}: {have}/{total} ops verified; without a rule: {' '.join(missing)}")
        if total:
            assert have >= 50


def test_cost_per_graph_is_bounded():
    # A crafted graph that would keep the event loop busy is refused once its validation has
    # used the CPU budget, not after it finished. The clock is the I/O layer's (proxy/validators.py
    # installs thread CPU time outside the collector); here one that ticks 1 ms per reading.
    leaves = [T(0x10 + i, F32, (4, 1, 1, 1)) for i in range(4)]
    nodes = [T(0x100000 + j, F32, (4, 1, 1, 1), op=OPS["ADD"], src=(0x10 + j % 4, 0x10 + (j + 1) % 4),
               data=BASE + 0x100 * (j % 4096)) for j in range(3000)]
    payload = memoryview(graph_payload([t.id for t in nodes], leaves + nodes))
    readings: list[int] = []

    def clock() -> float:
        readings.append(1)
        return len(readings) * 1e-3

    GraphValidator(FirewallPolicy(max_graph_nodes=1 << 16, max_graph_tensors=1 << 16), clock).check(payload, state())
    whole = len(readings)  # the budget is read all along a validation (every 256 tensors or nodes)
    assert whole > 8
    readings.clear()
    with pytest.raises(FirewallRefusal) as exc:
        GraphValidator(FirewallPolicy(max_graph_nodes=1 << 16, max_graph_tensors=1 << 16, max_graph_cpu_s=0.0035),
                       clock).check(payload, state())
    assert exc.value.reason == "graph_too_costly"
    assert len(readings) == 5  # at the first reading past the budget, long before the end


def test_uncomputed_nodes_need_no_allocation():
    # LFM2's recurrent-state copy (llama-memory-recurrent.cpp build_rs): VIEW nodes of a client-side
    # input (buffer 0, data 0) and empty nodes reach the RPC device; ggml-cpu computes neither.
    src = T(0x10, I32, (2, 1, 1, 1), buffer=0, data=0)
    v = T(0x20, I32, (1, 1, 1, 1), buffer=0, data=0, op=OPS["VIEW"], src=(0x10,), view_src=0x10,
          view_offs=4, op_params=(4, 0))
    st = state()
    payload = graph_payload([0x20], [src, v])
    GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=8)).check(memoryview(payload), st)
    a = T(0x30, F32, (256, 0, 1, 1))
    idx = T(0x31, I32, (0, 1, 1, 1))
    empty = T(0x32, F32, (256, 0, 1, 1), op=OPS["GET_ROWS"], src=(0x30, 0x31))
    run([a, idx], empty)
    # ... but a computed node that reads an empty source is refused (modulo by zero, #SIGFPE)
    b = T(0x40, F32, (4, 2, 1, 1))
    add = T(0x41, F32, (4, 2, 1, 1), op=OPS["ADD"], src=(0x40, 0x30))
    assert reason([b, a], add) == "tensor_layout_invalid"


def test_docs_show_the_table():
    from pathlib import Path

    from rpcguard.protocol.oprules import table_markdown

    doc = (Path(__file__).resolve().parents[3] / "docs" / "firewall.md").read_text(encoding="utf-8")
    begin = doc.index("\n", doc.index("<!-- op-table:begin")) + 1
    assert doc[begin : doc.index("<!-- op-table:end -->")] == table_markdown()


@pytest.mark.parametrize("params,ok", [
    ((10, 0, 0, 0), True),  # ggml_mul_mat_set_prec / ggml_prec_set_acc(GGML_PREC_F32): llama.cpp's attention
    ((0, 0, 0, 30), True),  # ggml_prec_set_src(GGML_PREC_Q8, 1) (7.0.0)
    ((1, 0, 0, 0), False),  # not an enum ggml_prec value
    ((0, 1, 0, 0), False),  # Hadamard hint: fwht would write ne10 floats into ne01-float rows
    ((0, 0, 5, 0), False),  # a slot no modifier sets
])
def test_mul_mat_op_params(params, ok):
    tensors, d = mul_mat(d_op_params=params)
    if ok:
        run(tensors, d)
    else:
        assert reason(tensors, d) in ("graph_op_params_invalid", "graph_shape_invalid")


@pytest.mark.parametrize("eps", [-1e-6, float("nan")])
def test_norm_eps_the_kernel_asserts(eps):
    # sanitizer fuzz finding ggml_abort-e036b901ff: RMS_NORM with eps < 0 -> GGML_ASSERT(eps >= 0.0f)
    a = T(0x10, F32, (8, 2, 1, 1))
    d = T(0x20, F32, (8, 2, 1, 1), op=OPS["RMS_NORM"], src=(0x10,), op_params=(f(eps),))
    assert reason([a], d) == "graph_op_params_invalid"
    d.op_params = (f(1e-6),)
    run([a], d)


def test_small_buffer_handles_do_not_hide_nodes():
    # Regression: the empty-node test once read the buffer handle's words instead of ne[0..3],
    # so with a handle below 2^32 every node looked empty and skipped the op rules.
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    st.add_buffer(1, 0, SIZE)
    st.set_base(1, BASE)
    a = T(0x10, F32, (8, 2, 1, 1), buffer=1, data=BASE)
    d = T(0x20, F32, (4, 2, 1, 1), buffer=1, data=BASE + 64, op=OPS["ADD"], src=(0x10, 0x10))
    with pytest.raises(FirewallRefusal) as exc:
        GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=8)).check(memoryview(graph_payload([0x20], [a, d])), st)
    assert exc.value.reason == "graph_shape_invalid"


# Cases the acceptance-region fuzz (tests/fuzz/accept_gen.py) found forwarded and fatal to the
# real server: each is refused now (issue 20).
def _unary_size1(op):
    a = T(0x10, F32, (1, 12, 43, 1), nb=(5, 5, 60, 2580))  # ne0 == 1: rows "contiguous", nb0 5
    return [a], T(0x20, F32, (1, 12, 43, 1), op=OPS[op], src=(0x10,))


def _diag_mask_size1():
    a = T(0x10, F32, (1, 1, 8, 3), nb=(64, 100, 4, 32))  # unary-ops/ops.cpp assert nb0 == 4
    return [a], T(0x20, F32, (1, 1, 8, 3), op=OPS["DIAG_MASK_INF"], src=(0x10,), op_params=(1,))


def _mrope_fourth_section_only():
    tensors, d = rope()
    params = list(d.op_params)
    params[2], params[11:15] = 8, [0, 0, 0, 2]  # mrope, sections (0, 0, 0, 2): ops.cpp:6382 asserts
    d.op_params = tuple(params)
    tensors[1].ne = (12, 1, 1, 1)  # 4 positions per token
    return tensors, d


def _timestep_strided():
    a = T(0x10, F32, (66, 1, 1, 1), nb=(12, 792, 792, 792))
    return [a], T(0x20, F32, (16, 66, 1, 1), op=OPS["TIMESTEP_EMBEDDING"], src=(0x10,), op_params=(16, 790))


def _ssm_conv_strided_weights():
    sx = T(0x10, F32, (4, 8, 1, 1))
    c = T(0x11, F32, (1, 8, 1, 1), nb=(32, 4, 32, 32))
    return [sx, c], T(0x20, F32, (8, 4, 1, 1), op=OPS["SSM_CONV"], src=(0x10, 0x11))


@pytest.mark.parametrize("build", [
    *(lambda op=op: _unary_size1(op) for op in ("SQR", "SQRT", "LOG", "SIN", "COS")),
    _diag_mask_size1, _mrope_fourth_section_only, _timestep_strided, _ssm_conv_strided_weights,
])
def test_fuzz_findings_are_refused(build):
    assert reason(*build()) in ("graph_shape_invalid", "graph_op_params_invalid")


def test_arange_counts_steps_in_float():
    # (stop - start) / step in double is 396.0000...2 (ceil 397); in float, as ops.cpp:8628, 396
    start, stop, step = 72.99748992919922, 884.6215209960938, 2.049555540084839
    for steps, ok in ((396, True), (397, False)):
        d = T(0x20, F32, (steps, 1, 1, 1), op=OPS["ARANGE"], op_params=(f(start), f(stop), f(step)))
        if ok:
            run([], d)
        else:
            assert reason([], d) == "graph_shape_invalid"


def test_quantized_kv_cache_dequantizes_into_f32():
    # the K-shift of a q8_0 cache (llama.cpp build_rope_shift): ggml_cast(view of k, F32), and
    # ggml_cpy of a q8_0 view into an F32 tensor (ggml_compute_forward_dup_from_q)
    k = T(0x10, Q8_0, (64, 2, 8, 1))
    cast = T(0x20, F32, (64, 2, 8, 1), op=OPS["CPY"], src=(0x10, 0x20))
    run([k], cast)
    out = T(0x11, F32, (64, 2, 8, 1))
    cpy = T(0x21, F32, (64, 2, 8, 1), op=OPS["CPY"], src=(0x10, 0x11), view_src=0x11, data=out.data)
    run([k, out], cpy)
    strided = T(0x11, F32, (64, 2, 8, 1), nb=(8, 512, 1024, 8192))  # the kernel asserts nb10 == 4
    cpy = T(0x21, F32, (64, 2, 8, 1), nb=(8, 512, 1024, 8192), op=OPS["CPY"], src=(0x10, 0x11), view_src=0x11,
            data=strided.data)
    assert reason([k, strided], cpy) == "graph_shape_invalid"


def test_docs_show_what_holds_per_op():
    from pathlib import Path

    from rpcguard.protocol.oprules import status_markdown

    doc = (Path(__file__).resolve().parents[3] / "docs" / "firewall.md").read_text(encoding="utf-8")
    begin = doc.index("\n", doc.index("<!-- op-status:begin")) + 1
    assert doc[begin : doc.index("<!-- op-status:end -->")] == status_markdown(V7, op_table(V7).names)  # type: ignore[union-attr]


def ssm_scan(n_seqs=2, state_nb3=None, nh=2, state_nb2=None, K=1):
    ds, hd, t = 16, 3, 2
    nb = None
    if state_nb3 is not None or state_nb2 is not None:
        nb = (4, 64, 192 if state_nb2 is None else state_nb2, nh * 192 if state_nb3 is None else state_nb3)
    st = T(0x10, F32, (ds, hd, nh, n_seqs), nb=nb)
    x = T(0x11, F32, (hd, nh, t, n_seqs))
    dt = T(0x12, F32, (nh, t, n_seqs, 1))
    a = T(0x13, F32, (1, nh, 1, 1))
    b = T(0x14, F32, (ds, 1, t, n_seqs))
    c = T(0x15, F32, (ds, 1, t, n_seqs))
    ids = T(0x16, I32, (n_seqs, 1, 1, 1))
    n = hd * nh * t * n_seqs + K * ds * hd * nh * n_seqs
    d = T(0x20, F32, (n, 1, 1, 1), op=OPS["SSM_SCAN"], src=tuple(range(0x10, 0x17)), op_params=(K,))
    return [st, x, dt, a, b, c, ids], d


def test_ssm_scan_needs_containment():
    tensors, d = ssm_scan()
    assert reason(tensors, d) == "op_needs_containment"
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, contained=True))
    v.check(memoryview(graph_payload([d.id], tensors + [d])), state())
    # one sequence whose state stride (ne3 == 1: not looked at by ggml_is_contiguous) is not the
    # packed size: the kernel writes the new state at dst + i3*nb3
    tensors, d = ssm_scan(n_seqs=1, state_nb3=1 << 20)
    with pytest.raises(FirewallRefusal) as exc:
        v.check(memoryview(graph_payload([d.id], tensors + [d])), state())
    assert exc.value.reason == "graph_shape_invalid"


def test_ssm_scan_state_head_stride_is_packed():
    # acceptance fuzz (accept-asan-c850bb77a1, contained=True): one head, so ggml_is_contiguous never
    # looks at the state's nb2, and the K > 1 snapshot copies nb2 bytes per head (ops.cpp:10216):
    # heap-buffer-overflow past the result
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, contained=True))
    tensors, d = ssm_scan(nh=1, state_nb2=196, K=3)
    with pytest.raises(FirewallRefusal) as exc:
        v.check(memoryview(graph_payload([d.id], tensors + [d])), state())
    assert exc.value.reason == "graph_shape_invalid"
    tensors, d = ssm_scan(nh=1, state_nb2=192, K=3)  # packed: forwarded
    v.check(memoryview(graph_payload([d.id], tensors + [d])), state())


def test_concat_empty_source_needs_data():
    # acceptance fuzz (accept-ubsan-ba85bf9c0a): an ne0 == 0 source with data NULL is still
    # memcpy'd from, 0 bytes per row (ops.cpp:1934): UBSan "null pointer passed as argument 2"
    full = T(0x11, Q4_0, (32, 1, 1, 1))
    empty = T(0x10, Q4_0, (0, 1, 1, 1), buffer=0, data=0)
    d = T(0x20, Q4_0, (32, 1, 1, 1), op=OPS["CONCAT"], src=(0x10, 0x11), op_params=(0,))
    assert reason([empty, full], d) == "graph_shape_invalid"
    run([T(0x10, Q4_0, (0, 1, 1, 1)), full], d)  # the same source as a view into a buffer


def wkv(op, S=64, H=2, T_=4, n_seqs=2, tf_ne=None):
    n_in = {"RWKV_WKV6": 5, "RWKV_WKV7": 6, "GATED_LINEAR_ATTN": 4}[op]
    ins = [T(0x10 + i, F32, (S, H, T_, 1)) for i in range(n_in)]
    if tf_ne is not None:
        ins[3] = T(0x13, F32, tf_ne)
    st = T(0x10 + n_in, F32, (S * S * H, n_seqs, 1, 1))
    params = (f(0.5),) if op == "GATED_LINEAR_ATTN" else ()
    d = T(0x20, F32, (S * H, T_ + S * n_seqs, 1, 1), op=OPS[op], src=tuple(range(0x10, 0x11 + n_in)),
          op_params=params)
    return ins + [st], d


@pytest.mark.parametrize("op", ["RWKV_WKV6", "RWKV_WKV7", "GATED_LINEAR_ATTN"])
def test_linear_attention_rules(op):
    run(*wkv(op))
    # 5 tokens over 2 sequences: the kernel takes state t / (5 // 2) for token t, past the end
    assert reason(*wkv(op, T_=5)) == "graph_shape_invalid"


def test_wkv6_reads_head_size_times_heads_of_time_first():
    assert reason(*wkv("RWKV_WKV6", tf_ne=(4, 1, 1, 1))) == "graph_shape_invalid"


def test_wkv7_head_size_is_a_multiple_of_the_simd_step():
    assert reason(*wkv("RWKV_WKV7", S=4)) == "graph_shape_invalid"
    run(*wkv("RWKV_WKV6", S=4))  # WKV6 has a remainder loop


def test_block_type_cont_of_a_strided_view_into_another_shape_is_refused():
    # ops.cpp dup_bytes copies rows of ne00 * type_size bytes into a contiguous result: for q8_0
    # that is 32 rows' worth (the acceptance fuzz's SIGSEGV)
    a = T(0x10, Q8_0, (64, 4, 2, 1), nb=(34, 68 * 2, 68 * 8, 68 * 16))  # every other row of a parent
    assert reason([a], T(0x20, Q8_0, (512, 1, 1, 1), op=OPS["CONT"], src=(0x10,))) == "graph_shape_invalid"
    run([a], T(0x20, Q8_0, (64, 4, 2, 1), op=OPS["CONT"], src=(0x10,)))  # same shape: copied by rows


def test_set_rows_needs_a_destination_type_with_from_float():
    rows = T(0x10, F32, (4, 1, 1, 1))
    idx = T(0x11, 27, (1, 1, 1, 1))  # I64
    for dst_type, ok in ((F32, True), (27, False)):  # I64 has no from_float: a NULL call
        dst = T(0x12, dst_type, (4, 3, 1, 1))
        d = T(0x20, dst_type, (4, 3, 1, 1), op=OPS["SET_ROWS"], src=(0x10, 0x11, 0x12), view_src=0x12,
              data=dst.data)
        if ok:
            run([rows, idx, dst], d)
        else:
            assert reason([rows, idx, dst], d) == "graph_shape_invalid"


def test_circular_pad_past_the_source_is_refused():
    a = T(0x10, F32, (1, 2, 7, 1))
    params = (0, 0, 7, 1, 0, 0, 0, 0, 1)  # circular, 7 left pads on a dimension of 2
    d = T(0x20, F32, (1, 10, 7, 1), op=OPS["PAD"], src=(0x10,), op_params=params)
    assert reason([a], d) == "graph_op_params_invalid"
    params = (0, 0, 2, 1, 0, 0, 0, 0, 1)
    run([a], T(0x20, F32, (1, 5, 7, 1), op=OPS["PAD"], src=(0x10,), op_params=params))


def test_concat_takes_an_empty_source():
    # RWKV's token shift for a one-token batch: concat(view of ne1 = n_tokens - 1 = 0, state)
    empty = T(0x10, F32, (128, 0, 1, 1))
    state_ = T(0x11, F32, (128, 1, 1, 1))
    run([empty, state_], T(0x20, F32, (128, 1, 1, 1), op=OPS["CONCAT"], src=(0x10, 0x11), op_params=(1,)))
    # ... but a broadcasting kernel that reads it is still refused (its index modulo 0)
    b = T(0x12, F32, (128, 2, 1, 1))
    assert reason([b, empty], T(0x21, F32, (128, 2, 1, 1), op=OPS["ADD"], src=(0x12, 0x10))) == "tensor_layout_invalid"


def test_pool_2d_window_area_fits_an_int():
    # acceptance fuzz (tests/fuzz/findings/accept-ubsan-*, POOL_2D): ops.cpp:8028 ``const int ka =
    # k0 * k1``; a 65536 x 65536 window padded to fit a small plane passed every per-side check
    a = T(0x10, F32, (47, 1, 4, 28))
    params = (1, 65536, 65536, 65536, 65536, 32768, 32768)
    d = T(0x20, F32, (1, 1, 4, 28), op=OPS["POOL_2D"], src=(0x10,), op_params=params)
    assert reason([a], d) == "graph_op_params_invalid"
    # the widest window whose area still fits: 46340^2 < 2^31 <= 46341^2
    params = (0, 46340, 46340, 1, 1, 23170, 23170)
    run([T(0x11, F32, (3, 1, 1, 1))], T(0x21, F32, (4, 2, 1, 1), op=OPS["POOL_2D"], src=(0x11,), op_params=params))
    params = (0, 46341, 46341, 1, 1, 23170, 23170)
    d = T(0x22, F32, (3, 1, 1, 1), op=OPS["POOL_2D"], src=(0x11,), op_params=params)
    assert reason([T(0x11, F32, (3, 1, 1, 1))], d) == "graph_op_params_invalid"


# -- UPSCALE (ggml_interpolate_impl) ---------------------------------------------------------


def upscale(src_ne=(2, 5, 7, 11), dst_ne=(5, 7, 11, 13), mode=0, **over):
    a = T(0x10, F32, src_ne)
    d = T(0x20, F32, dst_ne, op=OPS["UPSCALE"], src=(0x10,), op_params=(mode,))
    override(over, a=a, d=d)
    return [a], d


@pytest.mark.parametrize("mode", [0, 1, 2, 0x100, 0x101, 0x102, 0x201, 0x301])
def test_upscale_modes_pass(mode):
    run(*upscale(mode=mode))
    run(*upscale(src_ne=(5, 7, 11, 13), dst_ne=(2, 5, 7, 11), mode=mode))


@pytest.mark.parametrize("mode", [3, 0xFF, 0x200, 0x202, 0x400, -(1 << 31)])
def test_upscale_bad_modes_refused(mode):
    # 3: GGML_SCALE_MODE_COUNT; 0x200/0x202: antialias without bilinear; 0x400, 1<<31: no such flag
    assert reason(*upscale(mode=mode)) == "graph_op_params_invalid"


def test_upscale_mutations_refused():
    assert reason(*upscale(d_type=F16, d_type_size=2)) == "graph_shape_invalid"  # the result is F32
    assert reason(*upscale(a_type=F16, a_type_size=2)) == "graph_type_invalid"  # only an F32 source
    assert reason(*upscale(d_nb=(4, 20, 140, 1540 * 2))) == "graph_shape_invalid"  # a fresh tensor is packed
    tensors, d = upscale()
    d.src = (0x10, 0x10)
    assert reason(tensors, d) == "graph_src_unexpected"


def test_upscale_float_rounding_past_the_source_is_refused():
    # ne == ne_src == 20986228 (> 2^24): sf = 1.0f, but (float)(ne - 1) rounds up to ne: NEAREST
    # would read one element past dimension 0; BILINEAR clamps dims 0-1 but not dims 2-3.
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    st.add_buffer(HANDLE, 0, 1 << 34)
    st.buffers[HANDLE].base = BASE
    big = 20986228

    def check(src_ne, dst_ne, mode):
        a = T(0x10, F32, src_ne, data=BASE)
        d = T(0x20, F32, dst_ne, op=OPS["UPSCALE"], src=(0x10,), op_params=(mode,), data=BASE + (1 << 33))
        GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64)).check(memoryview(graph_payload([d.id], [a, d])), st)

    for src_ne, dst_ne, mode in (((big, 1, 1, 1), (big, 1, 1, 1), 0), ((1, 1, big, 1), (1, 1, big, 1), 1)):
        with pytest.raises(FirewallRefusal) as exc:
            check(src_ne, dst_ne, mode)
        assert exc.value.reason == "graph_shape_invalid" and "float rounding" in exc.value.detail
    check((big, 1, 1, 1), (big, 1, 1, 1), 1)  # BILINEAR clamps dim 0: accepted


# -- CONV_2D_DW (ggml_conv_2d_dw_direct) -----------------------------------------------------


def conv_2d_dw(cwhn=False, kt=F32, params=(1, 1, 0, 0, 1, 1), **over):
    """input [17, 34, 9, 1], weights [3, 3, 1, 9] (test-backend-ops' first case): packed, or both
    made channel-contiguous and permuted back (cwhn)."""
    W, H, C, KW, KH = 17, 34, 9, 3, 3
    ke = TYPES[kt].type_size
    a = T(0x10, kt, (KW, KH, 1, C))
    b = T(0x11, F32, (W, H, C, 1))
    ne = (15, 32, C, 1)
    d = T(0x20, F32, ne, op=OPS["CONV_2D_DW"], src=(0x10, 0x11), op_params=params)
    if cwhn:
        a.nb = (C * ke, KW * C * ke, C * ke, ke)
        b.nb = (C * 4, W * C * 4, 4, W * H * C * 4)
        d.nb = (C * 4, 15 * C * 4, 4, 15 * 32 * C * 4)
    override(over, a=a, b=b, d=d)
    return [a, b], d


@pytest.mark.parametrize("cwhn", [False, True])
@pytest.mark.parametrize("kt", [F32, F16])
def test_conv_2d_dw_layouts_pass(cwhn, kt):
    run(*conv_2d_dw(cwhn, kt))


@pytest.mark.parametrize("cwhn,over,why", [
    (False, {"d_nb": (36, 540, 4, 17280)}, "graph_shape_invalid"),  # packed input: so is the result
    (True, {"d_nb": (4, 60, 60 * 32, 60 * 32 * 9)}, "graph_shape_invalid"),  # channels-first input: so is the result
    (False, {"b_nb": (4, 72, 72 * 34, 72 * 34 * 9)}, "graph_shape_invalid"),  # padded rows: the kernel aborts
    (True, {"b_nb": (36, 36 * 17, 4, 36 * 17 * 35)}, "graph_shape_invalid"),  # channels-first with a gap: read flat
    (True, {"a_nb": (4, 12, 36, 36)}, "graph_shape_invalid"),  # packed weights for a channels-first input
    (False, {"a_nb": (36, 108, 36, 4)}, "graph_shape_invalid"),  # channels-first weights, packed input
    (False, {"b_type": F16, "b_type_size": 2, "d_type": F16, "d_type_size": 2}, "graph_type_invalid"),  # read as float
    # the kernel asserts F32/F16 weights
    (False, {"a_type": Q8_0, "a_type_size": 34, "a_blck_size": 32, "a_ne": (32, 3, 1, 9)}, "graph_type_invalid"),
    (False, {"a_ne": (3, 3, 1, 8)}, "graph_shape_invalid"),  # a weight plane per channel
    (False, {"d_op_params": (0, 1, 0, 0, 1, 1)}, "graph_op_params_invalid"),  # stride 0
    (False, {"d_op_params": (1, 1, -1, 0, 1, 1)}, "graph_op_params_invalid"),  # negative padding
    (False, {"d_op_params": (1, 1, 1 << 30, 0, 1, 1)}, "graph_op_params_invalid"),  # 2*p overflows an int
    (False, {"d_op_params": (1, 1, 0, 0, 0, 1)}, "graph_op_params_invalid"),  # dilation 0
])
def test_conv_2d_dw_mutations_refused(cwhn, over, why):
    assert reason(*conv_2d_dw(cwhn, **over)) == why


# -- CONV_TRANSPOSE_1D (ggml_conv_transpose_1d) ----------------------------------------------


def conv_transpose_1d(kt=F32, s0=2, **over):
    a = T(0x10, kt, (3, 4, 5, 1))  # K = 3, Cout = 4, Cin = 5
    b = T(0x11, F32, (13, 5, 1, 1))  # L = 13
    d = T(0x20, F32, (12 * s0 + 3, 4, 1, 1), op=OPS["CONV_TRANSPOSE_1D"], src=(0x10, 0x11), op_params=(s0, 0, 1))
    override(over, a=a, b=b, d=d)
    return [a, b], d


@pytest.mark.parametrize("kt", [F32, F16])
@pytest.mark.parametrize("s0", [1, 2, 3])
def test_conv_transpose_1d_passes(kt, s0):
    run(*conv_transpose_1d(kt, s0))


@pytest.mark.parametrize("over,why", [
    ({"d_op_params": (0, 0, 1), "d_ne": (3, 4, 1, 1)}, "graph_op_params_invalid"),  # s0 = 0
    ({"d_op_params": (-1, 0, 1), "d_ne": (1, 4, 1, 1)}, "graph_op_params_invalid"),  # writes before the result
    ({"d_op_params": (2, 1, 1)}, "graph_op_params_invalid"),  # p0 != 0: the constructor asserts it
    ({"d_op_params": (2, 0, 2)}, "graph_op_params_invalid"),  # d0 != 1
    ({"d_ne": (28, 4, 1, 1)}, "graph_shape_invalid"),  # one past (L-1)*s0 + K
    ({"a_ne": (3, 4, 6, 1)}, "graph_shape_invalid"),  # channels differ: the dot reads past b's row
    ({"b_ne": (13, 5, 2, 1)}, "graph_shape_invalid"),  # b not a matrix (the planner asserts it)
    ({"a_nb": (8, 24, 96, 480)}, "graph_shape_invalid"),  # nb00 != sizeof(float): the kernel asserts it
    ({"a_type": 30}, "graph_type_invalid"),  # BF16: the planner takes it, the kernel aborts
    ({"b_type": F16, "b_type_size": 2}, "graph_type_invalid"),
])
def test_conv_transpose_1d_mutations_refused(over, why):
    assert reason(*conv_transpose_1d(**over)) == why


def test_conv_transpose_1d_empty_node_keeps_the_planner_asserts():
    # ggml_graph_plan sizes the work buffer of an empty node too and GGML_ABORTs on a kernel type it
    # has no case for (ggml-cpu.c:2956): the node is never computed, the sources still checked
    a = T(0x10, Q8_0, (32, 4, 5, 1))
    b = T(0x11, F32, (13, 5, 1, 1))
    d = T(0x20, F32, (0, 4, 1, 1), op=OPS["CONV_TRANSPOSE_1D"], src=(0x10, 0x11), op_params=(1, 0, 1))
    assert reason([a, b], d) == "graph_type_invalid"
    a = T(0x10, F32, (3, 4, 5, 1))
    b = T(0x11, F32, (13, 5, 2, 1))  # the planner asserts src[1]->ne[2] == 1
    assert reason([a, b], d) == "graph_shape_invalid"
    run([a, T(0x11, F32, (13, 5, 1, 1))], d)  # a plannable empty node still passes


# -- convolutions (3D, transposed, col2im) -----------------------------------------------------


def conv_2d(kt=F32, params=(1, 1, 0, 0, 1, 1), **over):
    """test-backend-ops' default: input [64, 64, 16, 1], weights [3, 3, 16, 4]."""
    a = T(0x10, kt, (3, 3, 16, 4))
    b = T(0x11, F32, (20, 18, 16, 2))
    s0, s1, p0, p1, d0, d1 = params
    ow = (20 + 2 * p0 - d0 * 2 - 1) // s0 + 1
    oh = (18 + 2 * p1 - d1 * 2 - 1) // s1 + 1
    d = T(0x20, F32, (ow, oh, 4, 2), op=OPS["CONV_2D"], src=(0x10, 0x11), op_params=params)
    override(over, a=a, b=b, d=d)
    return [a, b], d


@pytest.mark.parametrize("kt", [F32, F16])
@pytest.mark.parametrize("params", [(1, 1, 0, 0, 1, 1), (2, 3, 1, 2, 2, 1), (1, 5, 5, 2, 2, 4)])
def test_conv_2d_passes(kt, params):
    run(*conv_2d(kt, params))


def test_conv_2d_takes_a_strided_input():
    # channels-first input permuted back (test-backend-ops' cwhn): the kernel reads b through its strides
    run(*conv_2d(b_nb=(16 * 4, 20 * 16 * 4, 4, 20 * 18 * 16 * 4)))


@pytest.mark.parametrize("over,why", [
    ({"d_op_params": (0, 1, 0, 0, 1, 1)}, "graph_op_params_invalid"),  # stride 0 divides by zero
    ({"d_op_params": (1, 1, -1, 0, 1, 1), "d_ne": (16, 16, 4, 2)}, "graph_op_params_invalid"),
    ({"d_op_params": (1, 1, 1 << 30, 0, 1, 1)}, "graph_op_params_invalid"),  # 2*p overflows an int
    ({"d_op_params": (1, 1, 0, 0, 0, 1), "d_ne": (20, 16, 4, 2)}, "graph_op_params_invalid"),  # dilation 0
    ({"a_ne": (3, 3, 15, 4)}, "graph_shape_invalid"),  # channels differ
    ({"d_ne": (19, 16, 4, 2)}, "graph_shape_invalid"),
    ({"b_type": F16, "b_type_size": 2, "d_type": F16, "d_type_size": 2}, "graph_type_invalid"),  # read as float
    ({"a_type": 30, "a_type_size": 2}, "graph_type_invalid"),  # BF16 weights: the kernel asserts F16/F32
    ({"a_nb": (4, 16, 48, 48 * 16)}, "graph_shape_invalid"),  # padded weight rows: the kernel asserts contiguity
])
def test_conv_2d_mutations_refused(over, why):
    assert reason(*conv_2d(**over)) == why


def _run_big(tensors, node) -> None:
    """run() in a 256 MiB buffer (a patch of 16 MiB needs weights and a result of that size)."""
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    st.add_buffer(HANDLE, 0, 1 << 28)
    st.buffers[HANDLE].base = BASE
    GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64)).check(memoryview(graph_payload([node.id], tensors + [node])), st)


@pytest.mark.parametrize("kt,taps,oc,ok", [(F16, 1, (1 << 22) - 1, True), (F16, 1, 1 << 22, False),
                                           (F32, (1 << 22) - 1, 1, True), (F32, 1 << 22, 1, False)])
def test_conv_2d_patch_fits_the_planner_buffer(kt, taps, oc, ok):
    # one patch is KW*KH*IC taps of the weights' type plus OC floats of product; the kernel sizes
    # its batches as wsize / that and asserts at least one (ops.cpp:7355): the planner only
    # promises 16 MiB (GGML_IM2COL_WORK_SIZE)
    a = T(0x10, kt, (1, 1, taps, oc), data=BASE)
    b = T(0x11, F32, (1, 1, taps, 1), data=BASE + (1 << 26))
    d = T(0x20, F32, (1, 1, oc, 1), data=BASE + (1 << 27), op=OPS["CONV_2D"], src=(0x10, 0x11),
          op_params=(1, 1, 0, 0, 1, 1))
    if ok:
        _run_big([a, b], d)
    else:
        with pytest.raises(FirewallRefusal) as exc:
            _run_big([a, b], d)
        assert exc.value.reason == "graph_shape_invalid" and "work buffer" in exc.value.detail


def conv_3d(kt=F32, c=2, bn=2, oc=3, params=(1, 1, 1, 0, 0, 0, 1, 1, 1), **over):
    a = T(0x10, kt, (3, 3, 3, c * oc))
    b = T(0x11, F32, (10, 9, 8, c * bn))
    s = params
    o = [max(1, (w + 2 * s[3 + i] - s[6 + i] * 2 - 1) // max(1, s[i]) + 1) for i, w in enumerate((10, 9, 8))]
    d = T(0x20, F32, (*o, oc * bn), op=OPS["CONV_3D"], src=(0x10, 0x11), op_params=(*params, c, bn, oc))
    override(over, a=a, b=b, d=d)
    return [a, b], d


@pytest.mark.parametrize("kt", [F32, F16])
@pytest.mark.parametrize("params", [(1, 1, 1, 0, 0, 0, 1, 1, 1), (2, 1, 3, 2, 0, 1, 1, 2, 2)])
def test_conv_3d_passes(kt, params):
    run(*conv_3d(kt, params=params))


@pytest.mark.parametrize("over,why", [
    ({"c": -1, "bn": -4, "oc": -6}, "graph_op_params_invalid"),  # negative counts whose products match
    ({"a_ne": (3, 3, 3, 5)}, "graph_shape_invalid"),  # a.ne3 is IC*OC
    ({"params": (1, 1, 0, 0, 0, 0, 1, 1, 1)}, "graph_op_params_invalid"),  # stride 0
    ({"params": (1, 1, 1, 0, 0, -1, 1, 1, 1)}, "graph_op_params_invalid"),
    ({"b_type": F16, "b_type_size": 2}, "graph_type_invalid"),  # read as float
    ({"a_type": Q8_0, "a_type_size": 34, "a_blck_size": 32, "a_ne": (32, 3, 3, 6)}, "graph_type_invalid"),
    ({"a_nb": (4, 12, 36, 4096)}, "graph_shape_invalid"),  # the kernel asserts contiguous weights
    ({"d_ne": (8, 7, 6, 5)}, "graph_shape_invalid"),
])
def test_conv_3d_mutations_refused(over, why):
    assert reason(*conv_3d(**over)) == why


def im2col_3d(dt=F32, ic=3, params=(1, 1, 1, 1, 1, 1, 1, 1, 1), **over):
    """test-backend-ops' default: input [10, 10, 10, 9], kernel [3, 3, 3, 1], IC = 3."""
    a = T(0x10, F16, (3, 3, 3, 1))
    b = T(0x11, F32, (10, 10, 10, 9))
    s = params
    o = [max(1, (10 + 2 * s[3 + i] - s[6 + i] * 2 - 1) // max(1, s[i]) + 1) for i in range(3)]
    d = T(0x20, dt, (max(1, 27 * ic), o[0], o[1], max(1, o[2] * (9 // max(1, ic)))), op=OPS["IM2COL_3D"], src=(0x10, 0x11),
          op_params=(*params, ic))
    override(over, a=a, b=b, d=d)
    return [a, b], d


@pytest.mark.parametrize("dt", [F32, F16])
@pytest.mark.parametrize("ic", [1, 3, 9, 4])
def test_im2col_3d_passes(dt, ic):
    run(*im2col_3d(dt, ic))


def test_im2col_3d_reads_a_view_through_its_strides():
    # test-backend-ops' v=1: a [8, 8, 8, 7] view of the [10, 10, 10, 9] input
    a = T(0x10, F16, (3, 3, 3, 1))
    b = T(0x11, F32, (8, 8, 8, 7), nb=(4, 40, 400, 4000))
    d = T(0x20, F32, (27 * 7, 8, 8, 8), op=OPS["IM2COL_3D"], src=(0x10, 0x11), op_params=(1, 1, 1, 1, 1, 1, 1, 1, 1, 7))
    run([a, b], d)


@pytest.mark.parametrize("over,why", [
    ({"ic": 0}, "graph_op_params_invalid"),  # the kernel divides by IC
    ({"ic": 10, "d_ne": (270, 10, 10, 10)}, "graph_op_params_invalid"),  # N = 9 / 10 = 0: divides by N
    ({"ic": -3}, "graph_op_params_invalid"),
    ({"dt": 30, "d_type_size": 2}, "graph_shape_invalid"),  # BF16 result: the kernel aborts
    ({"b_type": F16, "b_type_size": 2}, "graph_type_invalid"),  # both kernels assert F32 input
    ({"b_nb": (8, 80, 800, 8000)}, "graph_shape_invalid"),  # nb10 != sizeof(float): asserted
    ({"params": (0, 1, 1, 1, 1, 1, 1, 1, 1)}, "graph_op_params_invalid"),
    ({"d_ne": (81, 10, 10, 29)}, "graph_shape_invalid"),
])
def test_im2col_3d_mutations_refused(over, why):
    assert reason(*im2col_3d(**over)) == why


def col2im_1d(t=F32, k=4, oc=3, t_in=7, s0=2, p0=0, **over):
    ts = TYPES[t].type_size
    a = T(0x10, t, (k * oc, t_in, 1, 1))
    d = T(0x20, t, ((t_in - 1) * s0 + k - 2 * p0, oc, 1, 1), op=OPS["COL2IM_1D"], src=(0x10,), op_params=(s0, oc, p0))
    assert ts
    override(over, a=a, d=d)
    return [a], d


@pytest.mark.parametrize("t", [F32, F16, 30])
@pytest.mark.parametrize("k,oc,t_in,s0,p0", [(4, 3, 7, 2, 0), (1, 5, 13, 1, 0), (8, 4, 13, 4, 2), (4, 3, 1, 2, 0),
                                             (6, 4, 11, 3, 1)])
def test_col2im_1d_passes(t, k, oc, t_in, s0, p0):
    run(*col2im_1d(t, k, oc, t_in, s0, p0))


@pytest.mark.parametrize("over,why", [
    ({"s0": 0}, "graph_op_params_invalid"),
    ({"d_op_params": (2, 0, 0)}, "graph_op_params_invalid"),  # OC = 0: the kernel divides by it
    ({"d_op_params": (2, 3, -1)}, "graph_op_params_invalid"),
    ({"d_op_params": (2, 5, 0)}, "graph_shape_invalid"),  # OC does not divide ne0 (12)
    # ... even with the result the kernel would then write (K = 12 / 5 = 2): the constructor asserts it
    ({"d_op_params": (2, 5, 0), "d_ne": (14, 5, 1, 1)}, "graph_shape_invalid"),
    ({"d_ne": (17, 3, 1, 1)}, "graph_shape_invalid"),
    ({"a_nb": (4, 52, 52 * 7, 52 * 7)}, "graph_shape_invalid"),  # padded rows: the kernel reads it flat
    ({"a_ne": (12, 7, 2, 1)}, "graph_shape_invalid"),  # not a matrix
    ({"a_type": I32, "d_type": I32}, "graph_type_invalid"),
    ({"d_type": F16, "d_type_size": 2}, "graph_shape_invalid"),  # the result has a's type
])
def test_col2im_1d_mutations_refused(over, why):
    assert reason(*col2im_1d(**over)) == why


def conv_transpose_2d(kt=F32, st=2, **over):
    """test-backend-ops: input [10, 10, 9, 2], kernel [3, 3, 1, 9]."""
    a = T(0x10, kt, (3, 3, 4, 9))
    b = T(0x11, F32, (10, 7, 9, 2))
    d = T(0x20, F32, (9 * st + 3, 6 * st + 3, 4, 2), op=OPS["CONV_TRANSPOSE_2D"], src=(0x10, 0x11), op_params=(st,))
    override(over, a=a, b=b, d=d)
    return [a, b], d


@pytest.mark.parametrize("kt", [F32, F16])
@pytest.mark.parametrize("st", [1, 2, 3])
def test_conv_transpose_2d_passes(kt, st):
    run(*conv_transpose_2d(kt, st))


@pytest.mark.parametrize("over,why", [
    ({"st": 0}, "graph_op_params_invalid"),
    ({"d_op_params": (-1,), "d_ne": (3, 3, 4, 2)}, "graph_op_params_invalid"),  # writes before the result
    ({"a_ne": (3, 3, 4, 8)}, "graph_shape_invalid"),  # channels differ
    ({"d_ne": (22, 15, 4, 2)}, "graph_shape_invalid"),
    ({"a_nb": (8, 24, 72, 288)}, "graph_shape_invalid"),  # nb00 != type size: the kernel asserts it
    ({"b_nb": (8, 80, 560, 5040)}, "graph_shape_invalid"),  # nb10 != sizeof(float)
    # overlapping kernel rows: the kernel copies a plane as ne00*ne01 packed elements, past the
    # rows' own extent
    ({"a_nb": (4, 4, 36, 144)}, "graph_shape_invalid"),
    ({"a_type": 30, "a_type_size": 2}, "graph_type_invalid"),  # BF16: the planner asserts F16/F32
    ({"b_type": F16, "b_type_size": 2}, "graph_type_invalid"),
])
def test_conv_transpose_2d_mutations_refused(over, why):
    assert reason(*conv_transpose_2d(**over)) == why


def test_conv_transpose_2d_int_counters():
    # 2^31 input channels: the kernel's ``int nk`` (ops.cpp:7607) and ``int i1n`` overflow; the
    # constructor takes it (12 GiB of sources, a 1-element result)
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    st.add_buffer(HANDLE, 0, 1 << 36)
    st.buffers[HANDLE].base = BASE
    c = 1 << 31
    a = T(0x10, F16, (1, 1, 1, c), nb=(2, 2, 2, 2), data=BASE)
    b = T(0x11, F32, (1, 1, c, 1), nb=(4, 4, 4, 4), data=BASE + (1 << 33))
    d = T(0x20, F32, (1, 1, 1, 1), data=BASE + (1 << 35), op=OPS["CONV_TRANSPOSE_2D"], src=(0x10, 0x11), op_params=(1,))
    with pytest.raises(FirewallRefusal) as exc:
        GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64)).check(memoryview(graph_payload([d.id], [a, b, d])), st)
    assert exc.value.reason == "graph_shape_invalid" and "int counters" in exc.value.detail


def test_conv_transpose_2d_empty_node_keeps_the_planner_asserts():
    a = T(0x10, 30, (3, 3, 4, 9))  # BF16: ggml_graph_plan asserts F16/F32 (ggml-cpu.c:2976)
    b = T(0x11, F32, (10, 7, 9, 2))
    d = T(0x20, F32, (0, 15, 4, 2), op=OPS["CONV_TRANSPOSE_2D"], src=(0x10, 0x11), op_params=(2,))
    assert reason([a, b], d) == "graph_type_invalid"
    run([T(0x10, F16, (3, 3, 4, 9)), b], d)


@pytest.mark.parametrize("at,bt,ok", [
    (F32, 30, True), (F32, F16, True),  # widened into the F32 work buffer (ggml-cpu.c:1338-1341)
    (F16, 30, False), (Q8_0, F16, False), (Q8_0, 30, False),  # vec_dot_type is not F32: the kernel asserts
    (30, F16, False),
])
def test_mul_mat_widens_a_half_src1_of_an_f32_src0(at, bt, ok):
    # ggml_conv_1d_dw with a BF16 kernel: mul_mat(im2col F32, kernel BF16) (test-backend-ops CONV_1D_DW)
    ne0 = 32 if at == Q8_0 else 48
    a = T(0x10, at, (ne0, 8, 1, 1))
    b = T(0x11, bt, (ne0, 3, 1, 1))
    d = T(0x20, F32, (8, 3, 1, 1), op=OPS["MUL_MAT"], src=(0x10, 0x11))
    if ok:
        run([a, b], d)
    else:
        assert reason([a, b], d) == "graph_shape_invalid"


@pytest.mark.parametrize("side", [0, 1, 2])
def test_conv_3d_takes_an_empty_kernel_side(side):
    # test-backend-ops CONV_3D(..., KW=0 / KH=0 / KD=0): the output stays [3, 2, 2, 1] over a
    # [2, 2, 2, 1] input, the kernel gathers no taps and multiplies over an inner dimension of 0
    ke = [1, 1, 1]
    ke[side] = 0
    a = T(0x10, F32, (*ke, 1))
    b = T(0x11, F32, (2, 2, 2, 1))
    o = [3 if i == side else 2 for i in range(3)]
    d = T(0x20, F32, (*o, 1), op=OPS["CONV_3D"], src=(0x10, 0x11), op_params=(1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1))
    run([a, b], d)
    a.data = 0  # an empty source is still pointer arithmetic: it must have data
    a.buffer = 0
    assert reason([a, b], d) == "graph_shape_invalid"


def test_conv_2d_takes_an_empty_input_padded_to_an_output():
    a = T(0x10, F16, (1, 1, 2, 3))
    b = T(0x11, F32, (0, 4, 2, 1))  # W = 0, padded by 1 on each side: OW = 2
    d = T(0x20, F32, (2, 4, 3, 1), op=OPS["CONV_2D"], src=(0x10, 0x11), op_params=(1, 1, 1, 0, 1, 1))
    run([a, b], d)


@pytest.mark.parametrize("kt,dt,ok", [
    (30, F32, True),  # ggml_conv_1d_dw with a BF16 kernel: its im2col is F32 (ggml.c:4665), the kernel's type unread
    (30, F16, True),
    (F16, 30, False),  # a BF16 result: ggml_compute_forward_im2col aborts (ops.cpp:6889)
])
def test_im2col_kernel_type_is_not_read_result_is_f32_or_f16(kt, dt, ok):
    a = T(0x10, kt, (3, 1, 16, 1))  # [K, 1, C]: conv_1d_dw's kernel
    b = T(0x11, F32, (64, 1, 16, 1))  # the input reshaped to [T, 1, C, 1]
    d = T(0x20, dt, (3, 62, 16, 1), op=OPS["IM2COL"], src=(0x10, 0x11), op_params=(1, 0, 0, 0, 1, 0, 0))
    if ok:
        run([a, b], d)
    else:
        assert reason([a, b], d) == "graph_shape_invalid"


def test_conv_2d_empty_input_keeps_the_strides_of_an_empty_tensor():
    # no layout rule runs on an empty source: the kernel still forms src + batch*nb3 (ops.cpp:7376),
    # which a stride of 4 GiB times 2^20 batches would wrap
    a = T(0x10, F16, (1, 1, 2, 3))
    b = T(0x11, F32, (0, 4, 2, 1 << 20), nb=(4, 0, 0, (1 << 32) - 1))
    d = T(0x20, F32, (2, 4, 3, 1 << 20), op=OPS["CONV_2D"], src=(0x10, 0x11), op_params=(1, 1, 1, 0, 1, 1))
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    st.add_buffer(HANDLE, 0, 1 << 36)
    st.buffers[HANDLE].base = BASE
    with pytest.raises(FirewallRefusal) as exc:
        GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64)).check(memoryview(graph_payload([d.id], [a, b, d])), st)
    assert exc.value.reason == "graph_shape_invalid" and "empty source" in exc.value.detail
    b.nb = None  # ggml_new_tensor's strides: every offset past the empty dim is 0
    GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64)).check(memoryview(graph_payload([d.id], [a, b, d])), st)

# -- recurrent and newer-model ops -------------------------------------------------------------


def gdn(S=4, H=2, T_=3, n_seqs=2, K=1, kda=False, Hk=None, qs=None, **over):
    """ggml_gated_delta_net(q, k, v, g, beta, state, K) as test-backend-ops builds it."""
    Hk = H if Hk is None else Hk
    qs = n_seqs if qs is None else qs
    q = T(0x10, F32, (S, Hk, T_, qs))
    k = T(0x11, F32, (S, Hk, T_, qs))
    v = T(0x12, F32, (S, H, T_, n_seqs))
    g = T(0x13, F32, (S if kda else 1, H, T_, n_seqs))
    beta = T(0x14, F32, (1, H, T_, n_seqs))
    st = T(0x15, F32, (S, S, H, n_seqs))
    d = T(0x20, F32, (S * H, T_ * n_seqs + K * S * n_seqs, 1, 1), op=OPS["GATED_DELTA_NET"],
          src=tuple(range(0x10, 0x16)), op_params=(K,))
    override(over, q=q, k=k, v=v, g=g, b=beta, s=st, d=d)
    return [q, k, v, g, beta, st], d


@pytest.mark.parametrize("kw", [
    {}, {"kda": True}, {"K": 3}, {"K": 2, "T_": 1}, {"n_seqs": 1, "S": 1},
    {"H": 4, "Hk": 2},  # v_repeat: q/k heads taken modulo (iq1 = iv1 % q.ne1)
    {"n_seqs": 4, "qs": 2},  # fewer q/k sequences: iq3 = iv3 / (n_seqs / q.ne3)
    # v as test-backend-ops' permuted view ([S, T, H] created, dims 1 and 2 swapped)
    {"v_nb": (4, 4 * 4 * 3, 4 * 4, 4 * 4 * 3 * 2)},
])
def test_gated_delta_net_passes(kw):
    run(*gdn(**kw))


@pytest.mark.parametrize("kw,why", [
    ({"K": 0}, "graph_op_params_invalid"),  # the constructor and the kernel assert K >= 1
    ({"n_seqs": 2, "qs": 3}, "graph_shape_invalid"),  # n_seqs / q.ne3 == 0: a division by zero
    ({"n_seqs": 3, "qs": 2}, "graph_shape_invalid"),  # iq3 = iv3 / 1 reaches 2: past q
    ({"q_ne": (4, 2, 2, 2)}, "graph_shape_invalid"),  # fewer q tokens than v's: t*nb2 past q
    ({"k_ne": (3, 2, 3, 2)}, "graph_shape_invalid"),  # rows shorter than S_v: the dot reads past k
    # g of one head, H = 2: its nb1 is not looked at by ggml_is_contiguous, the kernel reads iv1*nb1
    ({"g_ne": (1, 1, 3, 2), "g_nb": (4, 1 << 20, 4, 12)}, "graph_shape_invalid"),
    ({"b_ne": (1, 2, 2, 2)}, "graph_shape_invalid"),  # beta of fewer tokens
    ({"g_ne": (2, 2, 3, 2)}, "graph_shape_invalid"),  # gate neither scalar nor per channel
    ({"s_ne": (4, 4, 2, 1)}, "graph_shape_invalid"),  # the state is [S_v, S_v, H, n_seqs]
    ({"v_nb": (8, 64, 128, 384)}, "graph_shape_invalid"),  # v's rows not contiguous (asserted)
    ({"g_nb": (4, 4, 12, 12)}, "graph_shape_invalid"),  # g not contiguous (asserted)
    ({"q_type": F16}, "graph_type_invalid"),
])
def test_gated_delta_net_refusals(kw, why):
    assert reason(*gdn(**kw)) == why


def test_gated_delta_net_is_not_content_indexed():
    # the state is found by shape (iv3 * state.nb3), no slot ids: forwarded uncontained
    from rpcguard.protocol.oprules import op_status
    assert op_status("GATED_DELTA_NET", V7) == "verified"
    # its constructor and kernel were compared in the releases of 4.0.1 to 7.0.0 (issue 27), not before
    assert rule_for("GATED_DELTA_NET", (5, 0, 0)) is not None and rule_for("GATED_DELTA_NET", (4, 0, 0)) is None


def test_gated_delta_net_empty_node_work_buffer_is_bounded():
    # ggml_graph_plan sizes S_v + S_v^2 floats per thread for K > 1 even for an empty node
    # (ggml-cpu.c:3025): a 16 KiB v of S_v = 4096 asks 4.3 GB for 64 threads
    tensors, _ = gdn(S=4, n_seqs=1)
    tensors[2] = T(0x12, F32, (4096, 1, 1, 1))
    d = T(0x20, F32, (0, 1, 1, 1), op=OPS["GATED_DELTA_NET"], src=tuple(range(0x10, 0x16)), op_params=(2,))
    assert reason(tensors, d) == "graph_work_too_large"
    d.op_params = (1,)  # K = 1: S_v floats per thread
    run(tensors, d)


def solve_tri(n=4, k=3, b1=2, b2=1, **over):
    a = T(0x10, F32, (n, n, b1, b2))
    b = T(0x11, F32, (k, n, b1, b2))
    d = T(0x20, F32, (k, n, b1, b2), op=OPS["SOLVE_TRI"], src=(0x10, 0x11))
    override(over, a=a, b=b, d=d)
    return [a, b], d


@pytest.mark.parametrize("kw", [{}, {"n": 1}, {"k": 1}, {"b1": 1, "b2": 3}])
def test_solve_tri_passes(kw):
    run(*solve_tri(**kw))


@pytest.mark.parametrize("kw,why", [
    ({"a_ne": (4, 3, 2, 1)}, "graph_shape_invalid"),  # A not square
    ({"b_ne": (3, 4, 1, 1), "d_ne": (3, 4, 1, 1)}, "graph_shape_invalid"),  # batch dims differ
    # B padded rows: the kernel reads B[i00*k + i01] as packed (the constructor asserts contiguity)
    ({"b_nb": (4, 16, 64, 128)}, "graph_shape_invalid"),
    ({"a_nb": (4, 20, 80, 160)}, "graph_shape_invalid"),
    ({"a_type": F16}, "graph_type_invalid"),
    ({"d_op_params": (1,)}, "graph_op_params_invalid"),  # ggml_solve_tri sets no op_params
])
def test_solve_tri_refusals(kw, why):
    assert reason(*solve_tri(**kw)) == why


@pytest.mark.parametrize("tri_type", [0, 1, 2, 3])
def test_tri_passes(tri_type):
    run([T(0x10, F32, (5, 5, 2, 1))], T(0x20, F32, (5, 5, 2, 1), op=OPS["TRI"], src=(0x10,), op_params=(tri_type,)))


@pytest.mark.parametrize("a,params,why", [
    (T(0x10, F32, (5, 5, 2, 1)), (4,), "graph_op_params_invalid"),  # the kernel aborts on it
    (T(0x10, F32, (5, 5, 2, 1)), (-1,), "graph_op_params_invalid"),
    (T(0x10, F32, (5, 4, 2, 1)), (0,), "graph_shape_invalid"),
    (T(0x10, F32, (5, 5, 2, 1), nb=(4, 24, 120, 240)), (0,), "graph_shape_invalid"),  # asserted contiguous
    (T(0x10, F16, (5, 5, 2, 1)), (0,), "graph_type_invalid"),
])
def test_tri_refusals(a, params, why):
    assert reason([a], T(0x20, F32, a.ne, op=OPS["TRI"], src=(0x10,), op_params=params)) == why


def lightning(kt=F32, D=32, H=4, T_=3, n_kv=7, ns=2, m3=1, **over):
    info = TYPES[kt]
    q = T(0x10, F32, (D, H, T_, ns))
    k = T(0x11, kt, (D, 1, n_kv, ns))
    w = T(0x12, F32, (H, T_, 1, ns))
    m = T(0x13, F16, (n_kv, T_, 1, m3))
    d = T(0x20, F32, (n_kv, T_, 1, ns), op=OPS["LIGHTNING_INDEXER"], src=(0x10, 0x11, 0x12, 0x13))
    assert info.blck_size == 1 or D % info.blck_size == 0
    override(over, q=q, k=k, w=w, m=m, d=d)
    return [q, k, w, m], d


@pytest.mark.parametrize("kt", [F32, F16, 30, Q8_0, Q4_0, 12])
def test_lightning_indexer_passes(kt):
    D = max(32, TYPES[kt].blck_size)
    run(*lightning(kt, D=D))
    run(*lightning(kt, D=D, ns=2, m3=2))


@pytest.mark.parametrize("kw,why", [
    ({"kt": I32}, "graph_type_invalid"),  # no to_float: the kernel asserts
    ({"kt": 9}, "graph_type_invalid"),  # q8_1: no to_float either
    ({"m_type": F32, "m_type_size": 4}, "graph_type_invalid"),
    ({"ns": 3, "m3": 2}, "graph_shape_invalid"),  # the mask's streams must divide q's
    ({"k_ne": (32, 2, 7, 2)}, "graph_shape_invalid"),  # k.ne1 == 1
    ({"w_ne": (3, 3, 1, 2)}, "graph_shape_invalid"),  # one weight per head
    ({"m_nb": (4, 28, 84, 84)}, "graph_shape_invalid"),  # the kernel asserts unit nb0 of every tensor
    ({"q_nb": (8, 256, 1024, 3072)}, "graph_shape_invalid"),
])
def test_lightning_indexer_refusals(kw, why):
    assert reason(*lightning(**kw)) == why


def test_lightning_indexer_int_sizes():
    # the work offset ith*(n_embd + CACHE_LINE_SIZE_F32) is an int (ops.cpp:12400): refused before
    # it could wrap with up to GGML_MAX_N_THREADS threads (checked on the rule alone: the rows
    # this needs do not fit the test buffer)
    from rpcguard.protocol.encode import pack_tensor
    from rpcguard.protocol.tensor import decode_tensor
    rule = rule_for("LIGHTNING_INDEXER", V7)
    assert rule is not None
    D = (2**31 - 1) // 511 - 63
    tensors, d = lightning(D=D)
    ts = [decode_tensor(pack_tensor(t)) for t in tensors]
    with pytest.raises(FirewallRefusal) as exc:
        rule.derive(decode_tensor(pack_tensor(d)), ts + [None] * 6)
    assert exc.value.reason == "graph_shape_invalid"
    tensors, d = lightning(D=D - 1)
    rule.derive(decode_tensor(pack_tensor(d)), [decode_tensor(pack_tensor(t)) for t in tensors] + [None] * 6)


def dsv4_comb(T_=5, n_iter=4, **over):
    mixes, scale, base = T(0x10, F32, (24, T_, 1, 1)), T(0x11, F32, (3, 1, 1, 1)), T(0x12, F32, (24, 1, 1, 1))
    d = T(0x20, F32, (4, 4, T_, 1), op=OPS["DSV4_HC_COMB"], src=(0x10, 0x11, 0x12), op_params=(f(1e-6), n_iter))
    override(over, x=mixes, s=scale, b=base, d=d)
    return [mixes, scale, base], d


def test_dsv4_hc_comb():
    run(*dsv4_comb())
    run(*dsv4_comb(x_nb=(8, 200, 1000, 1000)))  # read per dimension: any strides
    assert reason(*dsv4_comb(n_iter=0)) == "graph_op_params_invalid"
    assert reason(*dsv4_comb(x_ne=(20, 5, 1, 1))) == "graph_shape_invalid"  # hc == 4 only
    assert reason(*dsv4_comb(s_ne=(2, 1, 1, 1))) == "graph_shape_invalid"  # scale[2] is read
    assert reason(*dsv4_comb(b_ne=(24, 2, 1, 1))) == "graph_shape_invalid"


def test_dsv4_hc_pre_and_post():
    x, w = T(0x10, F32, (31, 4, 5, 1)), T(0x11, F32, (4, 5, 1, 1))
    pre = T(0x20, F32, (31, 5, 1, 1), op=OPS["DSV4_HC_PRE"], src=(0x10, 0x11), op_params=(f(1.0), 0))
    run([x, w], pre)
    gate = T(0x11, F32, (31, 4, 5, 1))
    run([x, gate], T(0x20, F32, (31, 5, 1, 1), op=OPS["DSV4_HC_PRE"], src=(0x10, 0x11), op_params=(f(0.25), 1)))
    assert reason([x, w], T(0x20, F32, (31, 5, 1, 1), op=OPS["DSV4_HC_PRE"], src=(0x10, 0x11),
                            op_params=(f(0.25), 1))) == "graph_shape_invalid"  # gated weights are [n_embd, hc, T]
    assert reason([x, w], T(0x20, F32, (31, 5, 1, 1), op=OPS["DSV4_HC_PRE"], src=(0x10, 0x11),
                            op_params=(f(0.25), 2))) == "graph_op_params_invalid"
    xp, res, post = T(0x10, F32, (31, 5, 1, 1)), T(0x11, F32, (31, 4, 5, 1)), T(0x12, F32, (4, 5, 1, 1))
    comb = T(0x13, F32, (4, 4, 5, 1))
    out = T(0x20, F32, (31, 4, 5, 1), op=OPS["DSV4_HC_POST"], src=(0x10, 0x11, 0x12, 0x13))
    run([xp, res, post, comb], out)
    run([xp, res, post], T(0x20, F32, (31, 4, 5, 1), op=OPS["DSV4_HC_POST"], src=(0x10, 0x11, 0x12)))  # identity
    assert reason([xp, res, post, T(0x13, F32, (4, 3, 5, 1))], out) == "graph_shape_invalid"
    assert reason([xp, res, T(0x12, F32, (4, 4, 1, 1)), comb], out) == "graph_shape_invalid"


# SAM-style windows and relative positions (no test-backend-ops cases: the acceptance fuzz alone)


def test_win_part():
    a = T(0x10, F32, (8, 5, 3, 1))  # C, W, H; w = 2: 3 x 2 windows
    node = T(0x20, F32, (8, 2, 2, 6), op=OPS["WIN_PART"], src=(0x10,), op_params=(3, 2, 2))
    run([a], node)
    assert reason([a], T(0x20, F32, (8, 2, 2, 6), op=OPS["WIN_PART"], src=(0x10,), op_params=(2, 3, 2))) == \
        "graph_op_params_invalid"  # npx, npy as the constructor computes them
    assert reason([a], T(0x20, F32, (8, 2, 2, 6), op=OPS["WIN_PART"], src=(0x10,), op_params=(3, 2, 0))) == \
        "graph_op_params_invalid"  # w = 0 (the constructor divides by it)
    # padded rows: the constructor takes them, the kernel reads a as a packed array
    padded = T(0x10, F32, (8, 5, 3, 1), nb=(4, 64, 320, 960))
    assert reason([padded], node) == "graph_shape_invalid"


def test_win_unpart():
    a = T(0x10, F32, (8, 2, 2, 6))
    node = T(0x20, F32, (8, 5, 3, 1), op=OPS["WIN_UNPART"], src=(0x10,), op_params=(2,))
    run([a], node)
    # the constructor asks nothing of a: fewer windows than ceil(5/2)*ceil(3/2) = 6, or windows
    # smaller than w x w, read past a
    assert reason([T(0x10, F32, (8, 2, 2, 5))], node) == "graph_shape_invalid"
    assert reason([T(0x10, F32, (8, 1, 2, 12))], node) == "graph_shape_invalid"
    assert reason([T(0x10, F32, (8, 2, 2, 6), nb=(4, 36, 72, 144))], node) == "graph_shape_invalid"
    assert reason([a], T(0x20, F32, (8, 5, 3, 1), op=OPS["WIN_UNPART"], src=(0x10,), op_params=(0,))) == \
        "graph_op_params_invalid"  # the kernel takes ne1 % w


@pytest.mark.parametrize("t", [F16, 30])
def test_get_rel_pos(t):
    a = T(0x10, t, (16, 7, 1, 1))  # 2*4 - 1 positions
    node = T(0x20, F16, (16, 4, 4, 1), op=OPS["GET_REL_POS"], src=(0x10,))
    run([a], node)
    assert reason([T(0x10, t, (16, 8, 1, 1))], node) == "graph_shape_invalid"  # not 2*q - 1
    # padded rows: the kernel reads src[pos*ne00 + i0]
    assert reason([T(0x10, t, (16, 7, 1, 1), nb=(2, 34, 238, 238))], node) == "graph_shape_invalid"
    assert reason([T(0x10, F32, (16, 7, 1, 1))], node) == "graph_type_invalid"


def test_add_rel_pos():
    a = T(0x10, F32, (9, 6, 2, 1))  # w^2 = 9, h*w' = 6, 2 patches
    pw, ph = T(0x11, F32, (3, 2, 3, 2)), T(0x12, F32, (3, 2, 3, 2))
    run([a, pw, ph], T(0x20, F32, (9, 6, 2, 1), op=OPS["ADD_REL_POS"], src=(0x10, 0x11, 0x12), op_params=(0,)))
    view = dict(view_src=0x10, data=a.data)
    run([a, pw, ph], T(0x20, F32, (9, 6, 2, 1), op=OPS["ADD_REL_POS"], src=(0x10, 0x11, 0x12), op_params=(1,), **view))
    # a view of a whose flag says "not in place": the kernel memcpy's a onto itself
    assert reason([a, pw, ph], T(0x20, F32, (9, 6, 2, 1), op=OPS["ADD_REL_POS"], src=(0x10, 0x11, 0x12),
                                 op_params=(0,), **view)) == "graph_shape_invalid"
    assert reason([a, pw, T(0x12, F32, (3, 2, 3, 1))], T(0x20, F32, (9, 6, 2, 1), op=OPS["ADD_REL_POS"],
                                                        src=(0x10, 0x11, 0x12))) == "graph_shape_invalid"
# -- training and backward ops ---------------------------------------------------------------

BF16, I64, Q8_1, IQ2_XXS = 30, 27, 9, 16
PARAM = 4  # GGML_TENSOR_FLAG_PARAM


def big_run(tensors, node, size=1 << 30, **kw) -> None:
    """run() against one buffer of ``size`` bytes (strides past the 16 MiB test buffer)."""
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    st.add_buffer(HANDLE, 0, size)
    st.buffers[HANDLE].base = BASE
    GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, **kw)).check(memoryview(graph_payload([node.id], tensors + [node])), st)


def _over(ts: dict, over: dict) -> None:
    for k, v in over.items():
        name, field = k.split("_", 1)
        setattr(ts[name], field, v)
        if field == "type":
            ts[name].type_size, ts[name].blck_size = TYPES[v].type_size, TYPES[v].blck_size


def out_prod(at=F32, k=8, **over):
    a = T(0x10, at, (32, k, 2, 1))
    b = T(0x11, F32, (5, k, 4, 1))  # broadcast 4 / 2 over ne2 (F32 only)
    d = T(0x20, F32, (32, 5, 4, 1), op=OPS["OUT_PROD"], src=(0x10, 0x11))
    _over({"a": a, "b": b, "d": d}, over)
    return [a, b], d


def two(op, t=F32, ne=(8, 3, 2, 1), dt=None, dne=None, params=(), view=False, **over):
    """A node of ``op`` over two sources of one shape, its result dup(a)."""
    a, b = T(0x10, t, ne), T(0x11, t, ne)
    dtype = t if dt is None else dt
    d = T(0x20, dtype, ne if dne is None else dne, op=OPS[op], src=(0x10, 0x11), op_params=params)
    if view:
        d.view_src, d.data, d.nb = 0x10, a.data, a.nb
    _over({"a": a, "b": b, "d": d}, over)
    return [a, b], d


@pytest.mark.parametrize("at,k", [(F32, 8), (F32, 40), (F16, 8), (Q8_0, 8), (Q4_0, 33)])
def test_out_prod_passes(at, k):
    if at != F32:  # those kernels assert no broadcast over ne2/ne3
        tensors, d = out_prod(at, k, b_ne=(5, k, 2, 1), d_ne=(32, 5, 2, 1))
    else:
        tensors, d = out_prod(at, k)
    run(tensors, d)


@pytest.mark.parametrize("over,why", [
    ({"a_type": F16}, "graph_shape_invalid"),  # broadcast: out_prod_f16_f32 asserts ne02 == ne12
    ({"a_type": Q8_0}, "graph_shape_invalid"),  # the same in out_prod_q_f32
    ({"a_type": BF16}, "graph_type_invalid"),  # no kernel: GGML_ABORT
    ({"a_type": Q8_1}, "graph_type_invalid"),  # no to_float
    ({"b_type": F16}, "graph_type_invalid"),  # read as floats (only the F32 path asserts it)
    ({"a_nb": (4, 0, 1024, 2048)}, "graph_shape_invalid"),  # nb0 > nb1: transposed (the constructor)
    ({"b_ne": (5, 7, 4, 1)}, "graph_shape_invalid"),  # a.ne1 != b.ne1
    ({"b_ne": (5, 8, 3, 1), "d_ne": (32, 5, 3, 1)}, "graph_shape_invalid"),  # 3 % 2
    ({"d_ne": (32, 5, 2, 1)}, "graph_shape_invalid"),  # not (a.ne0, b.ne0, b.ne2, b.ne3)
])
def test_out_prod_mutations_refused(over, why):
    assert reason(*out_prod(**over)) == why


def test_out_prod_unrolled_int_offsets():
    # 32+ rows of an F32 a: ggml_vec_mad_f32_unroll(int n, int xs = nb01, int vs = nb11) forms
    # i*xs for i < 32 (vec.h:591): a row stride past 2^31 / 31 overflows an int (UBSan), or
    # truncates into another address
    row = ((1 << 31) // 31 + 64) // 4 * 4
    a = T(0x10, F32, (4, 32, 1, 1), nb=(4, row, row * 32, row * 32), data=BASE)
    b = T(0x11, F32, (2, 32, 1, 1), data=BASE + (3 << 30))
    d = T(0x20, F32, (4, 2, 1, 1), op=OPS["OUT_PROD"], src=(0x10, 0x11), data=BASE + (3 << 30) + 4096)
    with pytest.raises(FirewallRefusal) as exc:
        big_run([a, b], d, size=1 << 32)
    assert exc.value.reason == "graph_shape_invalid"
    a.ne = (4, 31, 1, 1)  # 31 rows: the unrolled path is not taken (bne01_unroll = 0)
    b.ne = (2, 31, 1, 1)
    big_run([a, b], d, size=1 << 32)


def test_out_prod_work_buffer_is_priced():
    from rpcguard.protocol.workbuf import work_bytes
    from rpcguard.protocol.tensor import decode_tensor
    from rpcguard.protocol.encode import pack_tensor

    tensors, d = out_prod(F16, b_ne=(5, 8, 2, 1), d_ne=(32, 5, 2, 1))
    srcs = [decode_tensor(pack_tensor(t)) for t in tensors]
    assert work_bytes("OUT_PROD", decode_tensor(pack_tensor(d)), srcs, 8) == 4 * 32 * 8  # ggml-cpu.c:2915
    srcs[0] = srcs[0]._replace(type=F32)
    assert work_bytes("OUT_PROD", decode_tensor(pack_tensor(d)), srcs, 8) == 0


@pytest.mark.parametrize("t", [F32, F16])
def test_silu_back(t):
    run(*two("SILU_BACK", t))
    assert reason(*two("SILU_BACK", t, b_type=F32 if t == F16 else F16)) == "graph_shape_invalid"  # read as a's type
    assert reason(*two("SILU_BACK", t, b_ne=(8, 3, 1, 1))) == "graph_shape_invalid"  # the kernel's nr is b's
    assert reason(*two("SILU_BACK", BF16)) == "graph_type_invalid"
    # the differential oracle: a transposed gradient (the kernel reads ne0 consecutive elements
    # from each flat row start, other elements of its own rows: inside its reach)
    ts = TYPES[t].type_size
    run(*two("SILU_BACK", t, (3, 8, 2, 1), a_ne=(3, 8, 2, 1), a_nb=(8 * ts, ts, 24 * ts, 48 * ts)))
    # ... but a flat walk through the nb1 of a size-1 dim past the buffer is refused (opcheck.check_flat_rows)
    tensors, d = two("SILU_BACK", t, (8, 1, 2, 1), a_nb=(ts, SIZE - 0x100000, 8 * ts, 16 * ts))
    assert reason(tensors, d) == "tensor_layout_invalid"


def test_rms_norm_back():
    run(*two("RMS_NORM_BACK", params=(f(1e-6),)))
    run(*two("RMS_NORM_BACK", params=(f(-1.0),)))  # the kernel asserts nothing of eps
    run(*two("RMS_NORM_BACK", a_nb=(4, 64, 256, 512)))  # per dimension: any row strides
    assert reason(*two("RMS_NORM_BACK", b_type=F16)) == "graph_type_invalid"  # read as floats
    assert reason(*two("RMS_NORM_BACK", b_ne=(8, 3, 1, 1))) == "graph_shape_invalid"
    assert reason(*two("RMS_NORM_BACK", a_nb=(8, 64, 256, 512))) == "graph_shape_invalid"


def test_soft_max_back():
    run(*two("SOFT_MAX_BACK", params=(f(0.5), 0)))
    run(*two("SOFT_MAX_BACK", params=(f(0.5), f(-0.0))))  # -0.0f == 0.0f
    run(*two("SOFT_MAX_BACK", view=True))  # ggml_soft_max_ext_back_inplace
    for mb in (1.0, float("nan")):  # ops.cpp:5966 GGML_ASSERT(max_bias == 0.0f)
        assert reason(*two("SOFT_MAX_BACK", params=(0, f(mb)))) == "graph_op_params_invalid"
    assert reason(*two("SOFT_MAX_BACK", b_nb=(4, 64, 256, 512))) == "graph_shape_invalid"  # asserted contiguous
    assert reason(*two("SOFT_MAX_BACK", b_type=F16)) == "graph_type_invalid"


def test_repeat_back():
    a = T(0x10, F32, (8, 6, 4, 1))
    d = T(0x20, F32, (4, 3, 1, 1), op=OPS["REPEAT_BACK"], src=(0x10,))
    run([a], d)
    d.ne = (3, 3, 1, 1)  # 8 % 3
    assert reason([a], d) == "graph_shape_invalid"
    a16 = T(0x10, F16, (8, 6, 4, 1))
    d16 = T(0x20, F16, (4, 3, 1, 1), op=OPS["REPEAT_BACK"], src=(0x10,))
    assert reason([a16], d16) == "graph_type_invalid"  # F32 only (GGML_ABORT)


def test_rope_back_is_ropes_rule_never_in_place():
    tensors, d = rope()
    d.op = OPS["ROPE_BACK"]
    run(tensors, d)
    d.view_src, d.data, d.nb = 0x10, tensors[0].data, (4, 32, 64, 192)  # ggml_rope_ext_back is never in place
    assert reason(tensors, d) == "graph_shape_invalid"
    tensors, d = rope(d_op_params=(0, 10, 0, 0, 512, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))  # n_dims > ne0
    d.op = OPS["ROPE_BACK"]
    assert reason(tensors, d) == "graph_op_params_invalid"


def _rope_ff(op: str, ne0: int = 8, n_dims: int = 4, mode: int = 0, ff: int = 2, ff_end: int | None = None):
    """A ROPE/ROPE_BACK node with freq factors ``c`` of ``ff`` floats; ``ff_end``: c placed so that
    its buffer ends that many bytes after c's data (else in a slot of its own, with room)."""
    per = 4 if mode & 8 else 1
    params = [0, n_dims, mode, 0, 512, f(10000.0), f(1.0), 0, f(1.0), f(32.0), f(1.0), 0, 0, 0, 0, 0]
    if mode & 8:
        params[11:13] = [1, 1]
    a = T(0x10, F32, (ne0, 2, 3, 1))
    pos = T(0x11, I32, (3 * per, 1, 1, 1))
    c = T(0x12, F32, (ff, 1, 1, 1))
    if ff_end is not None:
        c.data = BASE + SIZE - ff_end
    d = T(0x20, F32, (ne0, 2, 3, 1), op=OPS[op], src=(0x10, 0x11, 0x12), op_params=tuple(params))
    return [a, pos, c], d


@pytest.mark.parametrize("op", ["ROPE", "ROPE_BACK"])
@pytest.mark.parametrize("mode, ne0, n_dims", [(0, 8, 4), (2, 8, 4), (8, 8, 4), (40, 8, 4), (24, 8, 4), (0, 8, 8)])
def test_rope_freq_factors_are_read_to_ne0_over_2_inside_their_buffer(op, mode, ne0, n_dims):
    """ops.cpp:6209-6210 / 6234-6235 read freq_factors[i0/2] for every even i0 < ne0: ceil(ne0/2)
    floats whatever c's ne0. The constructor (and test-backend-ops) gives n_dims/2: accepted when
    the kernel's reach stays in c's buffer, refused when c ends its buffer with too little room."""
    reach = (ne0 + 1) // 2 * 4
    run(*_rope_ff(op, ne0, n_dims, mode, ff=n_dims // 2))  # room after c in its buffer
    run(*_rope_ff(op, ne0, n_dims, mode, ff=n_dims // 2, ff_end=reach))  # exactly the kernel's reach
    if n_dims < ne0:
        tensors, d = _rope_ff(op, ne0, n_dims, mode, ff=n_dims // 2, ff_end=n_dims // 2 * 4)  # flush: c at the end
        with pytest.raises(FirewallRefusal) as exc:
            run(tensors, d)
        assert exc.value.reason == "tensor_layout_invalid" and f"addresses {reach} bytes" in exc.value.detail
        assert reason(*_rope_ff(op, ne0, n_dims, mode, ff=n_dims // 2, ff_end=reach - 4)) == "tensor_layout_invalid"
    assert reason(*_rope_ff(op, ne0, n_dims, mode, ff=n_dims // 2 - 1)) == "graph_shape_invalid"  # below n_dims/2


@pytest.mark.parametrize("op", ["ROPE", "ROPE_BACK"])
def test_rope_odd_ne0_copies_one_element_past_every_row(op):
    """ops.cpp:6450-6462: the unrotated pairs (i0, i0+1), even i0 < ne0: with an odd ne0 the last
    one ends one element past the row, of src0 and of dst (a write). Inside their buffers only."""
    params = (0, 4, 0, 0, 512, f(10000.0), f(1.0), 0, f(1.0), f(32.0), f(1.0), 0, 0, 0, 0, 0)

    def build(a_end: int | None = None, d_end: int | None = None):
        a = T(0x10, F32, (5, 2, 3, 1))
        pos = T(0x11, I32, (3, 1, 1, 1))
        d = T(0x20, F32, (5, 2, 3, 1), op=OPS[op], src=(0x10, 0x11), op_params=params)
        if a_end is not None:
            a.data = BASE + SIZE - a_end
        if d_end is not None:
            d.data = BASE + SIZE - d_end
        return [a, pos], d

    n = 5 * 2 * 3 * 4
    run(*build())
    run(*build(a_end=n + 4))
    run(*build(d_end=n + 4))
    assert reason(*build(a_end=n)) == "tensor_layout_invalid"  # src0 flush against its buffer's end
    assert reason(*build(d_end=n)) == "tensor_layout_invalid"  # dst: the write would leave the buffer
    tensors, d = build(a_end=n)
    d.op_params = (0, 2, 24, 0, 512, *d.op_params[5:11], 1, 1, 0, 0, 0)  # vision: no copy of unrotated pairs
    tensors[1].ne = (12, 1, 1, 1)
    run(tensors, d)


def get_rows_back(n=3, rows=5, R=7, at=F32):
    a = T(0x10, at, (16, rows, 1, 1))
    b = T(0x11, I32, (n, 1, 1, 1))
    d = T(0x20, F32, (16, R, 1, 1), op=OPS["GET_ROWS_BACK"], src=(0x10, 0x11))
    return [a, b], d


def test_get_rows_back():
    from rpcguard.protocol.oprules import op_status

    run(*get_rows_back())
    run(*get_rows_back(at=F16))
    run(*get_rows_back(n=5))
    # the kernel reads row i of a for every index i < nelements(b): nothing checks a has them
    assert reason(*get_rows_back(n=6)) == "graph_shape_invalid"
    tensors, d = get_rows_back(at=Q8_0)
    tensors[0].ne, d.ne = (32, 5, 1, 1), (32, 7, 1, 1)
    assert reason(tensors, d) == "graph_type_invalid"
    tensors, d = get_rows_back()
    d.ne = (8, 7, 1, 1)  # c.ne0 != a.ne0
    assert reason(tensors, d) == "graph_shape_invalid"
    # the row index (contents) is GGML_ASSERTed inside the result (ops.cpp:5579, 5614): an abort
    assert op_status("GET_ROWS_BACK", V7) == "verified, contents abort"


@pytest.mark.parametrize("ne,ok", [
    ((4, 500, 1, 1), True), ((4, 3, 3, 1), True), ((4, 3, 1, 3), True), ((4, 2, 2, 4), True),
    ((4, 3, 2, 1), False),  # i01 = ir - i02*ne02 reaches row 3 of 3 (ops.cpp:1652): a read past the tensor
    ((4, 2, 2, 2), False),  # i02 = (ir - i03*ne03)/ne01 reaches plane 2 of 2
    ((4, 3, 2, 8), True),  # a miscomputed split whose rows all lie inside the packed tensors (the
    ((1, 4, 2, 9), True),  # differential oracle's kernel-clean cases)
])
def test_count_equal_row_split(ne, ok):
    tensors, d = two("COUNT_EQUAL", I32, ne, dt=I64, dne=(1, 1, 1, 1))
    if ok:
        run(tensors, d)
    else:
        assert reason(tensors, d) == "graph_shape_invalid"


def test_count_equal_miscomputed_split_needs_packed_sources():
    # (4, 3, 2, 8): i01 goes negative (ops.cpp:1652); inside packed tensors, before a strided one
    tensors, d = two("COUNT_EQUAL", I32, (4, 3, 2, 8), dt=I64, dne=(1, 1, 1, 1), a_nb=(4, 64, 192, 384))
    assert reason(tensors, d) == "graph_shape_invalid"


def test_count_equal_types():
    assert reason(*two("COUNT_EQUAL", F32, dt=I64, dne=(1, 1, 1, 1))) == "graph_type_invalid"
    assert reason(*two("COUNT_EQUAL", I32, dt=I64, dne=(1, 1, 1, 1), b_type=F32)) == "graph_type_invalid"
    assert reason(*two("COUNT_EQUAL", I32, dt=I32, dne=(1, 1, 1, 1))) == "graph_shape_invalid"  # result I64


def test_cross_entropy_loss():
    run(*two("CROSS_ENTROPY_LOSS", dne=(1, 1, 1, 1)))
    assert reason(*two("CROSS_ENTROPY_LOSS", F16, dne=(1, 1, 1, 1))) == "graph_type_invalid"
    assert reason(*two("CROSS_ENTROPY_LOSS", dne=(1, 1, 1, 1), b_nb=(8, 64, 256, 512))) == "graph_shape_invalid"
    # an empty node is planned: ggml-cpu.c:3021 a row of src0 per thread (here 2^26 floats x 64)
    a = T(0x10, F32, (1 << 26, 1, 1, 1), buffer=0, data=0)
    d = T(0x20, F32, (0, 1, 1, 1), op=OPS["CROSS_ENTROPY_LOSS"], src=(0x10, 0x10))
    assert reason([a], d) == "graph_work_too_large"


def ce_back(g_ne=(1, 1, 1, 1), **over):
    g = T(0x10, F32, g_ne)
    a, b = T(0x11, F32, (10, 3, 1, 1)), T(0x12, F32, (10, 3, 1, 1))
    d = T(0x20, F32, (10, 3, 1, 1), op=OPS["CROSS_ENTROPY_LOSS_BACK"], src=(0x10, 0x11, 0x12))
    _over({"g": g, "a": a, "b": b, "d": d}, over)
    return [g, a, b], d


def test_cross_entropy_loss_back():
    run(*ce_back())
    assert reason(*ce_back((2, 1, 1, 1))) == "graph_shape_invalid"
    assert reason(*ce_back(b_type=F16)) == "graph_type_invalid"  # read as floats
    assert reason(*ce_back(a_nb=(4, 64, 192, 192))) == "graph_shape_invalid"  # flat rows: asserted contiguous


def opt_step(op="OPT_STEP_ADAMW", n_prm=None, **over):
    n = 4 if op == "OPT_STEP_ADAMW" else 2
    ts = {"a": T(0x10, F32, (8, 3, 2, 1), flags=PARAM)}
    for i, k in enumerate("gmv"[: n - 1]):
        ts[k] = T(0x11 + i, F32, (8, 3, 2, 1))
    ts["p"] = T(0x10 + n, F32, ((7 if n == 4 else 2) if n_prm is None else n_prm, 1, 1, 1))
    ts["d"] = T(0x20, F32, (8, 3, 2, 1), op=OPS[op], src=tuple(range(0x10, 0x11 + n)), view_src=0x10,
                data=ts["a"].data)
    _over(ts, over)
    return [t for k, t in ts.items() if k != "d"], ts["d"]


@pytest.mark.parametrize("op", ["OPT_STEP_ADAMW", "OPT_STEP_SGD"])
def test_opt_step(op):
    run(*opt_step(op))
    strided = {f"{k}_nb": (4, 64, 256, 512) for k in ("agmvd" if op == "OPT_STEP_ADAMW" else "agd")}
    run(*opt_step(op, **strided))  # strided, all alike
    # the kernel addresses grad (and m, v) at src0's offsets (ops.cpp:12146): their strides are a's
    assert reason(*opt_step(op, g_nb=(4, 64, 256, 512))) == "graph_shape_invalid"
    assert reason(*opt_step(op, g_type=F16)) == "graph_type_invalid"
    assert reason(*opt_step(op, a_flags=0)) == "graph_shape_invalid"  # not a parameter: the constructor asserts it
    assert reason(*opt_step(op, n_prm=8)) == "graph_shape_invalid"
    assert reason(*opt_step(op, p_nb=(4, 0, 0, 0), p_ne=(1, 7 if op == "OPT_STEP_ADAMW" else 2, 1, 1)))\
        == "graph_shape_invalid"  # float[n] read from data: packed


def test_opt_step_adamw_state_strides():
    assert reason(*opt_step(v_nb=(4, 32, 128, 256))) == "graph_shape_invalid"
    assert reason(*opt_step(m_nb=(8, 64, 192, 384))) == "graph_shape_invalid"


def test_diag():
    a = T(0x10, F32, (5, 1, 3, 2))
    d = T(0x20, F32, (5, 5, 3, 2), op=OPS["DIAG"], src=(0x10,))
    run([a], d)
    a.ne = (5, 2, 3, 2)  # the constructor asserts ne1 == 1
    assert reason([a], d) == "graph_shape_invalid"


@pytest.mark.parametrize("at,bt,ok", [
    (F32, F32, True), (F16, F16, True), (F16, F32, True), (BF16, BF16, True), (BF16, F32, True), (Q8_0, F32, True),
    (F32, F16, False),  # add1_f32 reads a float from a 2-byte scalar
    (Q8_0, F16, False),  # asserted F32
    (Q8_1, F32, False),  # no to_float: a NULL call
    (IQ2_XXS, F32, False),  # no CPU from_float: a NULL call
])
def test_add1_types(at, bt, ok):
    ne = (256, 3, 2, 1)
    a, b = T(0x10, at, ne), T(0x11, bt, (1, 1, 1, 1))
    d = T(0x20, at, ne, op=OPS["ADD1"], src=(0x10, 0x11))
    if ok:
        run([a, b], d)
    else:
        assert reason([a, b], d) == "graph_type_invalid"


def test_add1_padded_1d_and_scalar():
    a, b = T(0x10, F32, (8, 3, 2, 1), nb=(4, 64, 192, 384)), T(0x11, F32, (1, 1, 1, 1))
    d = T(0x20, F32, (8, 3, 2, 1), op=OPS["ADD1"], src=(0x10, 0x11))
    run([a, b], d)
    a.nb = (4, 64, 256, 512)  # not padded 1d
    assert reason([a, b], d) == "graph_shape_invalid"
    a.nb, b.ne = (4, 64, 192, 384), (2, 1, 1, 1)
    assert reason([a, b], d) == "graph_shape_invalid"


def test_flat_row_walks_stay_on_the_tensors_rows():
    # acceptance fuzz (accept-read_canary-409e3bd9f8): SOFT_MAX_BACK in place over [1, 1, 1, 7] with
    # nb1 = 3 (ggml_is_contiguous skips size-1 dims): the kernel's rows at i1*nb1 overlap, threads race
    a = T(0x10, F32, (1, 1, 1, 7), nb=(4, 3, 65535, 4))
    b = T(0x11, F32, (1, 1, 1, 7), nb=(4, 28, 4, 4))
    d = T(0x20, F32, (1, 1, 1, 7), op=OPS["SOFT_MAX_BACK"], src=(0x10, 0x11), view_src=0x10, data=a.data, nb=a.nb,
          op_params=(f(1.0), 0))
    assert reason([a, b], d) == "graph_shape_invalid"
    a.nb = d.nb = (4, 4, 65535, 4)  # nb1 == nb3 for one-element rows: the flat walk is the tensor's
    b.nb = (4, 4, 4, 4)
    run([a, b], d)
    for op, dne in (("CROSS_ENTROPY_LOSS", (1, 1, 1, 1)), ("CROSS_ENTROPY_LOSS_BACK", None)):
        x, y = T(0x11, F32, (1, 1, 1, 7), nb=(4, 8, 4, 4)), T(0x12, F32, (1, 1, 1, 7))
        g = T(0x10, F32, (1, 1, 1, 1))
        if dne:
            node = T(0x20, F32, dne, op=OPS[op], src=(0x11, 0x12))
            assert reason([x, y], node) == "graph_shape_invalid"
        else:
            node = T(0x20, F32, (1, 1, 1, 7), op=OPS[op], src=(0x10, 0x11, 0x12))
            assert reason([g, x, y], node) == "graph_shape_invalid"


def test_add1_block_type_rows_of_ne3():
    # acceptance fuzz (accept-read_canary-dac8244612): add1_q_f32 writes row (i1, i2, i3) at
    # i1*nb1 + i2*nb2 + i3*nb0 (ops.cpp:973): with ne3 > 1 rows overwrite one another, threads race
    a, b = T(0x10, Q8_0, (32, 3, 2, 2)), T(0x11, F32, (1, 1, 1, 1))
    d = T(0x20, Q8_0, (32, 3, 2, 2), op=OPS["ADD1"], src=(0x10, 0x11))
    assert reason([a, b], d) == "graph_shape_invalid"
    a.ne = d.ne = (32, 3, 2, 1)
    run([a, b], d)



# -- IM2COL_BACK, POOL_2D_BACK (what ggml_build_backward_expand makes of IM2COL and POOL_2D) ---


# (gradient, kernel type and shape, image, params): 2D, the gradient of im2col(kernel [3, 3, 2, 4],
# image [8, 6, 2, 1], s=1, p=1, d=1); 1D, kernel [3, 2 channels, 4], image [10, 2, 3], s=1, p=0, d=1
IM2COL_BACK_2D = ((18, 8, 6, 1), F16, (3, 3, 2, 4), (8, 6, 2, 1), (1, 1, 1, 1, 1, 1, 1))
IM2COL_BACK_1D = ((6, 8, 3, 1), F32, (3, 2, 4, 1), (10, 2, 3, 1), (1, 0, 0, 0, 1, 0, 0))


def im2col_back(shapes=IM2COL_BACK_2D, **over):
    g_ne, k_type, k_ne, image, params = shapes
    g, k = T(0x10, F32, g_ne), T(0x11, k_type, k_ne)
    d = T(0x20, F32, image, op=OPS["IM2COL_BACK"], src=(0x10, 0x11), op_params=params)
    override(over, g=g, k=k, d=d)
    return [g, k], d


@pytest.mark.parametrize("shapes", [IM2COL_BACK_2D, IM2COL_BACK_1D])
def test_im2col_back_accepts_what_the_backward_pass_builds(shapes):
    run(*im2col_back(shapes))


@pytest.mark.parametrize("over,why", [
    ({"g_ne": (18, 8, 5, 1)}, "graph_shape_invalid"),  # OH one short: the kernel reads OH rows of it
    ({"g_ne": (18, 8, 6, 2)}, "graph_shape_invalid"),  # a batch the image does not have
    ({"g_nb": (4, 72, 72 * 8 * 2, 72 * 8 * 6 * 2)}, "graph_shape_invalid"),  # strided: read flat
    ({"g_type": F16, "g_ne": (18, 8, 6, 1)}, "graph_type_invalid"),  # GGML_ASSERT(src0 F32)
    ({"k_type": 30}, "graph_type_invalid"),  # a BF16 kernel: the kernel asserts F32 or F16
    ({"k_ne": (3, 3, 3, 4)}, "graph_shape_invalid"),  # kernel channels != image channels
    ({"d_type": F16}, "graph_shape_invalid"),  # the constructor's result is F32
    ({"d_op_params": (0, 1, 1, 1, 1, 1, 1)}, "graph_op_params_invalid"),  # tmpw % 0
    ({"d_op_params": (1, 0, 1, 1, 1, 1, 1)}, "graph_op_params_invalid"),  # tmph % 0 in 2D
    ({"d_op_params": (1, 1, 1, 1, 1, 1, 2)}, "graph_op_params_invalid"),  # is_2D neither 0 nor 1
])
def test_im2col_back_refuses_what_the_kernel_would_misread(over, why):
    assert reason(*im2col_back(**over)) == why


def test_im2col_back_image_planes_fit_the_kernels_int_offsets():
    # ops.cpp: ``int ofs0 = is_2D ? nb3 : nb2``: an image of 2^31 bytes per batch wraps it
    g = T(0x10, F32, (1, 1 << 16, 1 << 13, 2))
    k = T(0x11, F32, (1, 1, 1, 1))
    d = T(0x20, F32, (1 << 16, 1 << 13, 1, 2), op=OPS["IM2COL_BACK"], src=(0x10, 0x11),
          op_params=(1, 1, 0, 0, 1, 1, 1))
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    st.add_buffer(HANDLE, 0, 1 << 36)
    st.buffers[HANDLE].base = BASE
    with pytest.raises(FirewallRefusal) as exc:
        GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64)).check(memoryview(graph_payload([d.id], [g, k, d])), st)
    assert exc.value.reason == "graph_shape_invalid" and "int offsets" in exc.value.detail


def pool_2d_back(**over):
    # the gradient of pool_2d(af [7, 5, 3, 1], MAX, k=2, s=2, p=0): [3, 2, 3, 1]
    g = T(0x10, F32, (3, 2, 3, 1))
    f = T(0x11, F32, (7, 5, 3, 1))  # af, the pooled source
    d = T(0x20, F32, (7, 5, 3, 1), op=OPS["POOL_2D_BACK"], src=(0x10, 0x11), op_params=(1, 2, 2, 2, 2, 0, 0))
    override(over, g=g, f=f, d=d)
    return [g, f], d


@pytest.mark.parametrize("pool", [0, 1])
def test_pool_2d_back_accepts_what_the_backward_pass_builds(pool):
    run(*pool_2d_back(d_op_params=(pool, 2, 2, 2, 2, 0, 0)))


@pytest.mark.parametrize("over,why", [
    ({"g_ne": (3, 3, 3, 1)}, "graph_shape_invalid"),  # more gradient rows than POOL_2D gives
    ({"g_ne": (3, 2, 4, 1)}, "graph_shape_invalid"),  # a plane more: read as af's next plane
    ({"g_nb": (4, 16, 32, 96)}, "graph_shape_invalid"),  # strided: read as packed planes
    ({"f_type": 30}, "graph_type_invalid"),  # af BF16: read at dst's strides as F32
    ({"f_nb": (4, 32, 160, 480)}, "graph_shape_invalid"),  # af strided: read at dst's strides
    ({"d_ne": (7, 5, 2, 1)}, "graph_shape_invalid"),  # the result is af's shape
    ({"d_op_params": (2, 2, 2, 2, 2, 0, 0)}, "graph_op_params_invalid"),  # GGML_ASSERT(false)
    ({"d_op_params": (1, 2, 2, 0, 2, 0, 0)}, "graph_op_params_invalid"),  # stride 0
])
def test_pool_2d_back_refuses_what_the_kernel_would_misread(over, why):
    assert reason(*pool_2d_back(**over)) == why


def test_pool_2d_back_window_area_fits_an_int():
    # as POOL_2D's (ops.cpp:8117 ``const int ka = k0 * k1``): 46340^2 < 2^31 <= 46341^2
    for k, ok in ((46340, True), (46341, False)):
        pad = k // 2
        g, af = T(0x10, F32, (3 + 2 * pad - k + 1, 1 + 2 * pad - k + 1, 1, 1)), T(0x11, F32, (3, 1, 1, 1))
        d = T(0x20, F32, (3, 1, 1, 1), op=OPS["POOL_2D_BACK"], src=(0x10, 0x11), op_params=(0, k, k, 1, 1, pad, pad))
        if ok:
            run([g, af], d)
        else:
            assert reason([g, af], d) == "graph_op_params_invalid"
