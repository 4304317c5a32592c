"""rpcguard/protocol/oprules/kerneltypes.py: nodes 7.0.0's CPU kernels run but an older version's do not.

Each case is a constructor-shaped node that passes on 7.0.0 (and on the first version whose
kernel handles it) and is refused ``type_not_supported_by_version`` on the versions whose kernel
aborts or addresses past a tensor on it; the lines are those of the sdists read per version
(kerneltypes.py's docstring; scripts/kernel_types.py lists the differences). Every graph goes
through GraphValidator with the version's op table (op ids differ per version).
"""

from __future__ import annotations

import struct

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import TensorSpec, graph_payload, pack_tensor
from rpcguard.protocol.ggml import TYPES, op_table
from rpcguard.protocol.graph import GraphValidator
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.opcheck import check_node
from rpcguard.protocol.oprules import RULES, kerneltypes, rule_for
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.tensor import decode_tensor
from rpcguard.protocol.versions import KNOWN_VERSIONS, spec_for

HANDLE, BASE, SIZE = 0x5555DEADBE00, 0x7F0000000000, 1 << 24
F32, F16, Q4_0, Q8_0, I32, I64, BF16 = 0, 1, 2, 8, 26, 27, 30
V2, V361, V400, V401, V402, V403, V500, V510, V600, V7 = (
    (2, 0, 0), (3, 6, 1), (4, 0, 0), (4, 0, 1), (4, 0, 2), (4, 0, 3), (5, 0, 0), (5, 1, 0), (6, 0, 0), (7, 0, 0))
REASON = "type_not_supported_by_version"


def f(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def T(id: int, type: int = F32, ne=(4, 1, 1, 1), **kw) -> TensorSpec:
    info = TYPES[type]
    kw.setdefault("buffer", HANDLE)
    kw.setdefault("data", BASE + (id & 0xFF) * 0x10000)
    return TensorSpec(id=id, type=type, ne=ne, type_size=info.type_size, blck_size=info.blck_size, **kw)


def N(version, op: str, type: int, ne, srcs, **kw) -> TensorSpec:
    """The node (id 0x20) of ``op`` with ``version``'s op id."""
    return T(0x20, type, ne, op=op_table(version).ids[op], src=srcs, **kw)  # type: ignore[union-attr]


def run(version, tensors: list[TensorSpec], node: TensorSpec) -> str:
    """"" when the graph passes at ``version``, else the refusal's reason."""
    return run_msg(version, tensors, node)[0]


def run_msg(version, tensors: list[TensorSpec], node: TensorSpec) -> tuple[str, str]:
    """("", "") when the graph passes at ``version``, else the refusal's reason and detail. 2.0.0 has no op rules
    in the firewall (graph.py: op ids are tied to the version from 3.6.1 on): there its row is
    applied to the node directly (opcheck.check_node), as it would be were 2.0.0 given rules."""
    if version < V361:
        by_id = {t.id: decode_tensor(pack_tensor(t)) for t in tensors + [node]}
        n = by_id[node.id]
        srcs = [by_id.get(i) if i else None for i in (tuple(node.src) + (0,) * 10)[:10]]
        rule = rule_for(op_table(version).names[node.op], version)  # type: ignore[union-attr]
        assert rule is not None
        try:
            check_node(rule, n, srcs, by_id)
        except FirewallRefusal as e:
            return e.reason, str(e)
        return "", ""
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(version))
    st.add_buffer(HANDLE, 0, SIZE)
    st.buffers[HANDLE].base = BASE
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, contained=True))
    try:
        v.check(memoryview(graph_payload([node.id], tensors + [node])), st)
    except FirewallRefusal as e:
        return e.reason, str(e)
    return "", ""


# -- builders: (version) -> (tensors, node) ----------------------------------------------------


def scale(t):
    def build(v):
        a = T(0x10, t, (8, 2, 1, 1))
        return [a], N(v, "SCALE", t, a.ne, (0x10,), op_params=(f(2.0), 0))
    return build


def unary(uop, t):
    def build(v):
        a = T(0x10, t, (8, 2, 1, 1))
        return [a], N(v, "UNARY", t, a.ne, (0x10,), op_params=(uop,))
    return build


def mul_mat(at, bt, hint=0, n=64):
    def build(v):
        a, b = T(0x10, at, (n, n if hint else 8, 1, 1)), T(0x11, bt, (n, 3, 1, 1))
        return [a, b], N(v, "MUL_MAT", F32, (a.ne[1], 3, 1, 1), (0x10, 0x11), op_params=(0, hint))
    return build


def set_rows(rows_t, dst_t, idx_t=I64):
    def build(v):
        rows, idx, dst = T(0x10, rows_t, (4, 1, 1, 1)), T(0x11, idx_t, (1, 1, 1, 1)), T(0x12, dst_t, (4, 3, 1, 1))
        return [rows, idx, dst], N(v, "SET_ROWS", dst_t, dst.ne, (0x10, 0x11, 0x12), view_src=0x12, data=dst.data)
    return build


def im2col(kt, it, dt):
    def build(v):  # ggml_conv_1d_dw's im2col: kernel [3, 1, 16], image [64, 1, 16, 1]
        a, b = T(0x10, kt, (3, 1, 16, 1)), T(0x11, it, (64, 1, 16, 1))
        return [a, b], N(v, "IM2COL", dt, (3, 62, 16, 1), (0x10, 0x11), op_params=(1, 0, 0, 0, 1, 0, 0))
    return build


def im2col_back(kt):
    def build(v):  # the gradient of im2col(kernel [3, 3, 2, 4], image [8, 6, 2, 1], s=1, p=1, d=1)
        g, k = T(0x10, F32, (18, 8, 6, 1)), T(0x11, kt, (3, 3, 2, 4))
        return [g, k], N(v, "IM2COL_BACK", F32, (8, 6, 2, 1), (0x10, 0x11), op_params=(1, 1, 1, 1, 1, 1, 1))
    return build


def concat(gapped):
    def build(v):  # two q4_0 [32, 2] along dim 1; ``gapped``: a's rows every other row of a parent
        a = T(0x10, Q4_0, (32, 2, 1, 1), nb=(18, 36, 72, 72) if gapped else None)
        b = T(0x11, Q4_0, (32, 2, 1, 1))
        return [a, b], N(v, "CONCAT", Q4_0, (32, 4, 1, 1), (0x10, 0x11), op_params=(1,))
    return build


def conv_2d_dw(kt):
    def build(v):  # test-backend-ops' first case: input [17, 34, 9, 1], weights [3, 3, 1, 9]
        a, b = T(0x10, kt, (3, 3, 1, 9)), T(0x11, F32, (17, 34, 9, 1))
        return [a, b], N(v, "CONV_2D_DW", F32, (15, 32, 9, 1), (0x10, 0x11), op_params=(1, 1, 0, 0, 1, 1))
    return build


def norm(op, nb0):
    def build(v):  # every other float of a [8, 2] parent
        a = T(0x10, F32, (4, 2, 1, 1), nb=(nb0, 32, 64, 64))
        return [a], N(v, op, F32, a.ne, (0x10,), op_params=(f(1e-5),))
    return build


def fill(t):
    def build(v):
        a = T(0x10, t, (8, 2, 1, 1))
        return [a], N(v, "FILL", t, a.ne, (0x10,), op_params=(f(1.0),))
    return build


def ssm_scan(K):
    def build(v):  # state [16, 3, 2 heads, 2 seqs], 2 tokens; the result holds K snapshots
        ds, hd, nh, t, ns = 16, 3, 2, 2, 2
        srcs = [T(0x10, F32, (ds, hd, nh, ns)), T(0x11, F32, (hd, nh, t, ns)), T(0x12, F32, (nh, t, ns, 1)),
                T(0x13, F32, (1, nh, 1, 1)), T(0x14, F32, (ds, 1, t, ns)), T(0x15, F32, (ds, 1, t, ns)),
                T(0x16, I32, (ns, 1, 1, 1))]
        n = hd * nh * t * ns + K * ds * hd * nh * ns
        return srcs, N(v, "SSM_SCAN", F32, (n, 1, 1, 1), tuple(range(0x10, 0x17)), op_params=(K,))
    return build


def pool_1d(k0, s0, p0):
    def build(v):
        a = T(0x10, F32, (12, 2, 1, 1))
        ow = (12 + 2 * p0 - k0) // s0 + 1
        return [a], N(v, "POOL_1D", F32, (ow, 2, 1, 1), (0x10,), op_params=(0, k0, s0, p0))
    return build


def cpy(at, bt, a_nb=None):
    def build(v):
        a, b = T(0x10, at, (32, 2, 1, 1), nb=a_nb), T(0x11, bt, (32, 2, 1, 1))
        return [a, b], N(v, "CPY", bt, b.ne, (0x10, 0x11), view_src=0x11, data=b.data)
    return build


def add_strided_broadcast(strided):
    def build(v):  # b [4, 1] broadcast over a [4, 3]; ``strided``: b's elements every other float
        a, b = T(0x10, F32, (4, 3, 1, 1)), T(0x11, F32, (4, 1, 1, 1), nb=(8, 32, 32, 32) if strided else None)
        return [a, b], N(v, "ADD", F32, a.ne, (0x10, 0x11))
    return build


def sqr(packed):
    def build(v):  # a [4, 2, 3] whose dims 2 are one row apart from a padded parent when not packed
        a = T(0x10, F32, (4, 2, 3, 1), nb=(4, 16, 16 * 3, 16 * 9) if not packed else None)
        return [a], N(v, "SQR", F32, a.ne, (0x10,))
    return build


def im2col_3d(kt, dt):
    def build(v):  # test-backend-ops' default: input [10, 10, 10, 9], kernel [3, 3, 3, 1], IC = 3
        a, b = T(0x10, kt, (3, 3, 3, 1)), T(0x11, F32, (10, 10, 10, 9))
        return [a, b], N(v, "IM2COL_3D", dt, (81, 10, 10, 30), (0x10, 0x11), op_params=(1,) * 9 + (3,))
    return build


def conv_transpose_2d(kt):
    def build(v):  # test-backend-ops: input [10, 7, 9, 2], kernel [3, 3, 4, 9], stride 2
        a, b = T(0x10, kt, (3, 3, 4, 9)), T(0x11, F32, (10, 7, 9, 2))
        return [a, b], N(v, "CONV_TRANSPOSE_2D", F32, (21, 15, 4, 2), (0x10, 0x11), op_params=(2,))
    return build


def pad(nb0):
    def build(v):  # a [4, 2] (every other float of a parent when nb0 is 8) padded by 1 on the right of ne0
        a = T(0x10, F32, (4, 2, 1, 1), nb=(nb0, 32, 64, 64))
        return [a], N(v, "PAD", F32, (5, 2, 1, 1), (0x10,), op_params=(0, 1, 0, 0, 0, 0, 0, 0, 0))
    return build


def ssm_scan_groups(ng):
    def build(v):  # the ssm_scan case above with 6 heads in ``ng`` groups (B, C [16, ng, 2, 2])
        tensors, node = ssm_scan(1)(v)
        nh = 6
        tensors[0].ne, tensors[1].ne, tensors[2].ne, tensors[3].ne = (16, 3, nh, 2), (3, nh, 2, 2), (nh, 2, 2, 1), \
            (1, nh, 1, 1)
        tensors[4].ne = tensors[5].ne = (16, ng, 2, 2)
        for t in tensors:
            t.nb = None
        node.ne = (3 * nh * 2 * 2 + 16 * 3 * nh * 2, 1, 1, 1)
        return tensors, node
    return build


def binary(op, strided):
    def build(v):
        tensors, node = add_strided_broadcast(strided)(v)
        node.op = op_table(v).ids[op]  # type: ignore[union-attr]
        return tensors, node
    return build


def unary_like(op, packed):
    def build(v):
        tensors, node = sqr(packed)(v)
        node.op = op_table(v).ids[op]  # type: ignore[union-attr]
        return tensors, node
    return build


def unary_strided(uop):
    def build(v):  # ABS etc. (unary-ops.cpp) of the sqr case's source, not packed above its rows
        tensors, _ = sqr(False)(v)
        return tensors, N(v, "UNARY", F32, tensors[0].ne, (0x10,), op_params=(uop,))
    return build


# (what, build, versions refused, versions that run it): every "runs" list includes 7.0.0
CASES = [
    # 7.0.0 added BF16 to SCALE and the ops.cpp unary kernels (6.0.0 ops.cpp:4762, 2223, 2691, 2453)
    ("SCALE BF16", scale(BF16), [V2, V361, V400, V401, V402, V403, V500, V510, V600], [V7]),
    ("SCALE F32", scale(F32), [], [V2, V401, V600, V7]),
    ("GELU BF16", unary(8, BF16), [V2, V361, V401, V403, V510, V600], [V7]),
    ("SILU BF16", unary(10, BF16), [V2, V401, V600], [V7]),
    ("GELU_ERF BF16", unary(16, BF16), [V361, V401, V600], [V7]),
    ("GELU_ERF (14 in 2.0.0) BF16", unary(14, BF16), [V2], [V361, V600, V7]),  # 14: EXPM1 from 3.6.1 on (unary-ops.cpp)
    ("ABS BF16", unary(0, BF16), [], [V2, V401, V600, V7]),  # unary-ops.cpp had BF16 all along
    ("TRUNC (21) in 2.0.0", unary(21, F32), [V2], [V361, V7]),  # 2.0.0 ops.cpp:9251 GGML_ABORT
    # MUL_MAT: an F16/BF16 src1 of an F32 src0 is widened from 7.0.0 (6.0.0 ggml-cpu.c:1332)
    ("MUL_MAT F32 x F16", mul_mat(F32, F16), [V2, V361, V400, V401, V403, V510, V600], [V7]),
    ("MUL_MAT F32 x BF16", mul_mat(F32, BF16), [V401, V600], [V7]),
    ("MUL_MAT F16 x F16", mul_mat(F16, F16), [], [V2, V401, V600, V7]),  # src1 = vec_dot type
    ("MUL_MAT Q8_0 x F32", mul_mat(Q8_0, F32), [], [V2, V401, V600, V7]),
    # the Hadamard hint: fwht F32 only before 7.0.0 (6.0.0 ops.cpp:12077); before 4.0.0 no hint
    ("Hadamard F16 src1", mul_mat(F32, F16, hint=1), [V361, V400, V401, V600], [V7]),
    ("Hadamard F32 src1", mul_mat(F32, F32, hint=1), [], [V361, V400, V600, V7]),
    # SET_ROWS (4.0.0 ops.cpp:5054; 4.0.2 ops.cpp:5119; 2.0.0 ops.cpp:5397, 5388)
    ("SET_ROWS F16 -> F32", set_rows(F16, F32), [V400, V401, V402], [V403, V500, V7]),
    ("SET_ROWS F16 -> F16", set_rows(F16, F16), [V400], [V401, V402, V7]),
    ("SET_ROWS I32 index", set_rows(F32, F32, I32), [V2], [V361, V7]),
    ("SET_ROWS into I32", set_rows(F32, I32), [V2], [V361, V7]),
    # IM2COL into F16 from a kernel that is not F16 (4.0.2 ops.cpp:6365), from an F16 image in 2.0.0 (:6851)
    ("IM2COL F32 kernel -> F16", im2col(F32, F32, F16), [V2, V361, V400, V401, V402], [V403, V600, V7]),
    ("IM2COL F16 kernel -> F16", im2col(F16, F32, F16), [], [V2, V361, V402, V7]),
    ("IM2COL F16 image -> F16", im2col(F16, F16, F16), [V2], [V361, V402, V7]),
    # IM2COL_BACK with an F16 kernel (4.0.2 ops.cpp:6469)
    ("IM2COL_BACK F16 kernel", im2col_back(F16), [V2, V402], [V403, V7]),
    ("IM2COL_BACK F32 kernel", im2col_back(F32), [], [V2, V402, V7]),
    # CONCAT of block types: whole tensors contiguous in 4.0.1/4.0.2 (ops.cpp:2084-2085)
    ("CONCAT gapped q4_0", concat(True), [V401, V402], [V2, V400, V403, V7]),
    ("CONCAT packed q4_0", concat(False), [], [V401, V402, V7]),
    # CONV_2D_DW reads the kernel as floats before 4.0.1 (4.0.0 ops.cpp:7167): an F16 one past its end
    ("CONV_2D_DW F16 kernel", conv_2d_dw(F16), [V2, V400], [V401, V7]),
    ("CONV_2D_DW F32 kernel", conv_2d_dw(F32), [], [V2, V400, V7]),
    # NORM, L2_NORM assert a unit nb00 before 4.0.1 (4.0.0 ops.cpp:3691, 4145)
    ("NORM strided", norm("NORM", 8), [V2, V400], [V401, V7]),
    ("L2_NORM strided", norm("L2_NORM", 8), [V400], [V401, V7]),
    ("NORM packed", norm("NORM", 4), [], [V2, V400, V7]),
    # FILL writes floats whatever the type in 3.6.1 (ops.cpp:2229): an F16 tensor past its end
    ("FILL F16", fill(F16), [V361], [V400, V7]),
    ("FILL F32", fill(F32), [], [V361, V7]),
    # SSM_SCAN snapshots (K) from 5.0.0 (4.0.3 ops.cpp:9651 asserts the K = 1 size)
    ("SSM_SCAN K=2", ssm_scan(2), [V2, V401, V403], [V500, V7]),
    ("SSM_SCAN K=1", ssm_scan(1), [], [V2, V403, V7]),
    # 2.0.0 only
    ("POOL_1D k != s", pool_1d(3, 1, 0), [V2], [V361, V7]),  # ops.cpp:7542
    ("POOL_1D padded", pool_1d(2, 2, 1), [V2], [V361, V7]),  # ops.cpp:7541
    ("POOL_1D k == s", pool_1d(2, 2, 0), [], [V2, V7]),
    ("CPY F32 -> I32", cpy(F32, I32), [V2], [V361, V7]),  # no from_float for I32 (ops.cpp:720)
    ("CPY I32 -> F32", cpy(I32, F32), [V2], [V361, V7]),  # no I32 case (ops.cpp:1186)
    ("CPY F32 -> Q8_0", cpy(F32, Q8_0), [], [V2, V7]),
    ("ADD strided broadcast", add_strided_broadcast(True), [V2], [V361, V7]),  # binary-ops.cpp:65
    ("ADD broadcast", add_strided_broadcast(False), [], [V2, V7]),
    ("SQR not contiguous_1", sqr(False), [V2], [V361, V7]),  # unary-ops.cpp:81
    ("SQR packed", sqr(True), [], [V2, V7]),
    *((f"{op} not contiguous_1", unary_like(op, False), [V2], [V361, V7]) for op in ("SQRT", "LOG", "SIN", "COS")),
    *((f"{op} strided broadcast", binary(op, True), [V2], [V361, V7]) for op in ("SUB", "MUL", "DIV")),
    ("ABS not contiguous_1", unary_strided(0), [V2], [V361, V7]),  # unary-ops.cpp:81
    ("GELU not contiguous_1", unary_strided(8), [], [V2, V7]),  # an ops.cpp kernel: rows only
    # IM2COL_3D into F16 from a kernel that is not F16 (4.0.2 ops.cpp:6566)
    ("IM2COL_3D F32 kernel -> F16", im2col_3d(F32, F16), [V361, V402], [V403, V7]),
    ("IM2COL_3D F16 kernel -> F16", im2col_3d(F16, F16), [], [V361, V402, V7]),
    ("CONV_TRANSPOSE_2D F32 kernel", conv_transpose_2d(F32), [V2], [V361, V7]),  # 2.0.0 ops.cpp:7219
    ("CONV_TRANSPOSE_2D F16 kernel", conv_transpose_2d(F16), [], [V2, V7]),
    ("PAD strided", pad(8), [V2], [V361, V7]),  # 2.0.0 ops.cpp:7866
    ("PAD packed", pad(4), [], [V2, V7]),
    ("SSM_SCAN 3 groups", ssm_scan_groups(3), [V2], [V361, V7]),  # 2.0.0 ops.cpp:8865
    ("SSM_SCAN 2 groups", ssm_scan_groups(2), [], [V2, V7]),
    ("CPY F16 -> BF16 strided", cpy(F16, BF16, (4, 128, 256, 256)), [V2], [V361, V7]),  # 2.0.0 ops.cpp:780
    ("CPY F16 -> BF16", cpy(F16, BF16), [], [V2, V7]),  # contiguous: dup_f16's from_float branch
]


@pytest.mark.parametrize("what,build,refused,runs", CASES, ids=[c[0] for c in CASES])
def test_node_refused_where_the_kernel_does_not_run_it(what, build, refused, runs):
    for v in runs:
        assert run(v, *build(v)) == "", (what, v)
    for v in refused:
        assert run(v, *build(v)) == REASON, (what, v)


def test_every_gap_has_a_case():
    hit = set()
    for _what, build, refused, _runs in CASES:
        for v in refused:
            reason, msg = run_msg(v, *build(v))
            assert reason == REASON
            hit |= {g for g in kerneltypes.GAPS if f"op {g.op}: {g.what}:" in msg}
    assert set(kerneltypes.GAPS) - hit == set(), [f"{g.op}: {g.what}" for g in kerneltypes.GAPS if g not in hit]


def test_the_refusal_names_the_version_and_the_lines():
    v = V600
    tensors, node = scale(BF16)(v)
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(v))
    st.add_buffer(HANDLE, 0, SIZE)
    st.buffers[HANDLE].base = BASE
    with pytest.raises(FirewallRefusal) as exc:
        GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64)).check(memoryview(graph_payload([0x20], tensors + [node])), st)
    assert exc.value.reason == REASON
    assert "6.0.0 CPU kernel aborts" in str(exc.value) and "ops.cpp:4762" in str(exc.value)


def test_7_0_0_rows_are_unchanged():
    # no gap from 7.0.0 on: every rule is the row itself (no new refusal on 7.0.0)
    for op, rows in RULES.items():
        for v in [k for k in KNOWN_VERSIONS if k >= V7]:
            assert kerneltypes.gaps_for(op, v) == ()
            r = rule_for(op, v)
            assert r is None or r in rows, (op, v)


def test_gaps_are_well_formed():
    for g in kerneltypes.GAPS:
        assert g.op in RULES, g.op
        assert g.since < g.until <= V7 and g.effect in ("abort", "memory")
        assert g.old.split()[0] in {".".join(map(str, v)) for v in KNOWN_VERSIONS}, g.old
        assert g.new.startswith(("7: ", "5.0.0 ")), g.new
        # some version with a rule for the op is affected
        assert any(g.since <= v < g.until and rule_for(g.op, v) is not None for v in KNOWN_VERSIONS), g


def test_docs_matrix_shows_the_table():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "matrix.md").read_text(encoding="utf-8")
    assert kerneltypes.gaps_markdown() in doc, "docs/matrix.md 'Kernel types per release': paste gaps_markdown()"
