"""tests/fuzz/accept_gen.py: the acceptance-region generator (no server needed).

What must hold for the fuzz to mean anything: every case it yields is one rpcguard's firewall
forwards (judged by the same ``Firewall.check_request`` serve calls), the same seed gives the same
cases, every op with a 7.0.0 rule gets cases, and the adversarial edges are actually drawn (size-1
dimensions with strides the rules ignore, empty nodes, in-place views, non-finite params).
"""

from __future__ import annotations

import math
import struct

import pytest

from rpcguard.protocol.graph import op_rules
from rpcguard.protocol.tensor import decode_tensor
from tests.fuzz import accept_gen as gen
from tests.fuzz.accept_run import classify, fill_bytes, Outcome

COUNT = 12


@pytest.fixture(scope="module")
def cases() -> dict[str, list[gen.Case]]:
    out: dict[str, list[gen.Case]] = {}
    for op in gen.ops():
        out[op] = [c for c, _ in gen.generate(op, 3, COUNT) if c is not None]
    return out


def test_every_op_with_a_rule_has_a_proto():
    rules = op_rules(gen.VERSION)
    assert rules is not None
    names = {rules.names[i] for i in rules.rows}
    # an op with a rule and no proto must be named in UNSAMPLED (a new rule shows up here)
    assert names == set(gen.PROTOS) | gen.UNSAMPLED, names ^ (set(gen.PROTOS) | gen.UNSAMPLED)
    assert not set(gen.PROTOS) & gen.UNSAMPLED
    assert gen.ops() == sorted(gen.ops(), key=lambda n: rules.names.index(n))


def test_every_op_gets_accepted_cases(cases):
    short = {op: len(cs) for op, cs in cases.items() if len(cs) < COUNT * 3 // 4}
    assert not short, f"ops whose generator rarely finds an accepted case: {short}"


def test_every_case_is_one_the_firewall_forwards(cases):
    for op, cs in cases.items():
        for c in cs:
            assert gen.accepts(c) is None, c.describe()
            assert c.op == op


def test_a_refused_mutation_is_refused():
    # the acceptance check is not a rubber stamp: a node whose shape differs from the rule's is refused
    case = next(c for c, _ in gen.generate("SQR", 1, 10) if c is not None and "empty" not in c.variant)
    node = case.by_id(case.nodes[-1])
    node.ne = (node.ne[0] + 1, *node.ne[1:])
    assert gen.accepts(case) is not None


def test_same_seed_same_cases():
    a = [c.to_json() for c, _ in gen.generate("MUL_MAT", 5, 6) if c]
    b = [c.to_json() for c, _ in gen.generate("MUL_MAT", 5, 6) if c]
    c = [c.to_json() for c, _ in gen.generate("MUL_MAT", 6, 6) if c]
    assert a == b and a != c


def test_case_json_round_trip(cases):
    c = cases["ROPE"][0]
    assert gen.Case.from_json(c.to_json()) == c


def test_payload_is_a_graph_of_the_case(cases):
    c = cases["ADD"][0]
    live = [(0x5000 + i, 0x10000 * (i + 1)) for i in range(len(c.buffers))]
    p = gen.payload_of(c, live)
    device, n_nodes = struct.unpack_from("<II", p)
    assert device == 0 and n_nodes == len(c.nodes)
    at = 8 + 8 * n_nodes
    (m,) = struct.unpack_from("<I", p, at)
    assert m == len(c.tensors) and len(p) == at + 4 + 296 * m
    for k, t in enumerate(c.tensors):
        rt = decode_tensor(p, at + 4 + 296 * k)
        assert rt.id == t.id and rt.ne == t.ne and rt.nb == t.nb
        if t.buf >= 0:
            assert rt.buffer == live[t.buf][0] and rt.data == live[t.buf][1] + t.offs
            assert t.offs + gen.span(t) <= c.buffers[t.buf]


def test_the_edges_are_drawn(cases):
    every = [c for cs in cases.values() for c in cs]
    variants = {v for c in every for v in c.variant.split("+")}
    assert {"size1", "empty", "inplace", "bcast", "perm", "parent", "limits", "huge"} <= variants, variants
    # a size-1 dimension with a stride no packed layout has, in an accepted case
    odd = [c for c in every for t in c.tensors
           if any(t.ne[i] == 1 and t.nb[i] not in (t.nb[i - 1] * t.ne[i - 1],) for i in range(1, 4))]
    assert odd
    # tensors flush against the end of their buffer (the sanitizer's redzone is the next byte)
    assert any(t.offs + gen.span(t) == c.buffers[t.buf] for c in every for t in c.tensors if t.buf >= 0)
    # non-finite float params reach accepted nodes
    floats = [struct.unpack("<f", struct.pack("<i", p))[0] for c in every for t in c.tensors if t.id in c.nodes
              for p in t.params]
    assert any(math.isnan(f) for f in floats) and any(math.isinf(f) for f in floats)
    # more than one type combination per op where the rule allows it
    assert len({tuple(t.type for t in c.tensors) for c in cases["CPY"]}) > 3


def test_fill_bytes_small_values():
    import random

    rng = random.Random(1)
    f = struct.unpack("<64f", fill_bytes(rng, 0, 256, "rand"))
    assert all(math.isfinite(x) and 0.12 < abs(x) < 8 for x in f)
    assert fill_bytes(rng, 26, 64, "rand") == bytes(64)  # i32: indices stay 0
    assert fill_bytes(rng, 0, 16, "zero") == bytes(16)


def test_classify_names_the_issue_classes(cases):
    empty = next(c for cs in cases.values() for c in cs if "empty" in c.variant)
    assert classify(empty, Outcome("asan", "SEGV")).startswith("2")
    arange = cases["ARANGE"][0]
    assert classify(arange, Outcome("ggml_abort", "ops.cpp: GGML_ASSERT(ggml_nelements(dst) == steps)")).startswith("4")
    assert classify(cases["SQR"][0], Outcome("timeout")).startswith("5")


def test_overlap_of_a_layout():
    from tests.fuzz.accept_run import _overlaps

    assert not _overlaps((4, 3, 1, 1), (4, 16, 48, 48), 4)  # packed
    assert not _overlaps((4, 1, 3, 1), (4, 999, 16, 48), 4)  # a size-1 dim's stride never counts
    assert _overlaps((4, 3, 1, 1), (4, 8, 24, 24), 4)  # rows overlap
    assert _overlaps((4, 2, 1, 1), (4, 0, 0, 0), 4)  # broadcast: one element written twice
    assert not _overlaps((3, 4, 1, 1), (16, 4, 64, 64), 4)  # transposed, still disjoint


# -- the widenings firewall v3 made late: each must be drawn AND kept ----------------------------

BF16, I16, I32 = 30, 25, 26
WIDENING_SEED, WIDENING_BUDGET = 3, 40  # cases per op; each edge below turns up several times in it


def _kept_nodes(op: str) -> list[tuple[gen.Case, gen.Tensor, list[gen.Tensor | None]]]:
    """(case, node, sources) of the non-empty cases of ``op`` the firewall keeps (an empty node
    runs no rule: it would say nothing about what the rule accepts)."""
    out = []
    for c, _ in gen.generate(op, WIDENING_SEED, WIDENING_BUDGET):
        if c is None:
            continue
        node = c.by_id(c.nodes[-1])
        if 0 not in node.ne:
            out.append((c, node, [c.by_id(i) if i else None for i in node.src[:3]]))
    return out


def _ff_past(s: list[gen.Tensor | None]) -> bool:
    a, c = s[0], s[2]
    return a is not None and c is not None and (a.ne[0] + 1) // 2 * 4 > gen.span(c)


WIDENINGS = {
    "SCALE bf16": ("SCALE", lambda n, s: s[0].type == BF16),
    "SET i32": ("SET", lambda n, s: s[0].type == I32 and s[1].type == I32),
    "SOFT_MAX sinks without a mask": ("SOFT_MAX", lambda n, s: s[1] is None and s[2] is not None),
    "GLU bf16": ("GLU", lambda n, s: s[0].type == BF16),
    "GLU fused, odd width": ("GLU", lambda n, s: s[1] is None and s[0].ne[0] % 2 == 1 and s[0].ne[0] > 1),
    "GLU swapped": ("GLU", lambda n, s: n.params[1] == 1),
    "CONCAT of a row-copied type (concat_any)": ("CONCAT", lambda n, s: s[0].type not in (0, 1, BF16, I32, I16, 24)),
    "CONCAT bf16 or i16": ("CONCAT", lambda n, s: s[0].type in (BF16, I16)),
    "CONCAT with an empty source": ("CONCAT", lambda n, s: any(0 in t.ne for t in s[:2] if t is not None)),
    "GROUP_NORM with 2^10+ empty groups": ("GROUP_NORM", lambda n, s: n.params[0] - s[0].ne[2] >= 1 << 10),
    # freq factors shorter than the ceil(ne0/2) floats the kernel reads, the rest inside their buffer
    "ROPE freq factors read past the tensor": ("ROPE", lambda n, s: _ff_past(s)),
    "ROPE_BACK freq factors read past the tensor": ("ROPE_BACK", lambda n, s: _ff_past(s)),
}


@pytest.mark.parametrize("what", list(WIDENINGS))
def test_each_late_widening_is_drawn_and_kept(what):
    op, pred = WIDENINGS[what]
    kept = _kept_nodes(op)
    hits = [c for c, n, s in kept if pred(n, s)]
    assert len(hits) >= 2, f"{what}: {len(hits)} of {len(kept)} kept {op} cases (seed {WIDENING_SEED})"
    assert all(gen.accepts(c) is None for c in hits)


def test_new_ops_are_drawn_with_their_edges(cases):
    # the rules that came with firewall v3 have protos, and their cases reach the kernels' edges
    assert not gen.UNSAMPLED
    for op in ("IM2COL", "POOL_1D", "POOL_2D", "SSM_SCAN", "RWKV_WKV6", "RWKV_WKV7", "GATED_LINEAR_ATTN"):
        assert len([c for c in cases[op] if "empty" not in c.variant]) >= COUNT // 2, op
    node = lambda c: c.by_id(c.nodes[-1])  # noqa: E731
    im2col = [node(c) for c in cases["IM2COL"] if "empty" not in c.variant]
    assert {n.params[6] for n in im2col} == {0, 1} and {n.type for n in im2col} >= {0, 1}  # 1D and 2D, F32 and F16
    # SSM_SCAN: Mamba-1 (A of d_state rows) and Mamba-2 (A of one) both kept
    ssm = [(c, node(c)) for c in cases["SSM_SCAN"] if "empty" not in c.variant]
    assert {c.by_id(n.src[3]).ne[0] == 1 for c, n in ssm} == {True, False}
    # recurrent states of several sequences
    assert any(c.by_id(node(c).src[5]).ne[1] > 1 for c in cases["RWKV_WKV6"] if "empty" not in c.variant)


def test_ssm_scan_is_judged_as_a_contained_serve_would():
    assert gen.CONTAINED_OPS == {"SSM_SCAN"}
    assert gen.policy_for("SSM_SCAN").contained and not gen.policy_for("ADD").contained
    case = next(c for c, _ in gen.generate("SSM_SCAN", 1, 5) if c is not None and "empty" not in c.variant)
    assert gen.accepts(case) is None
    # the default policy refuses the same graph: SSM_SCAN reads state slots by contents
    from rpcguard.errors import FirewallRefusal
    from rpcguard.protocol.firewall import Firewall
    from rpcguard.protocol.settings import FirewallPolicy

    fw = Firewall(gen.fake_state(case), FirewallPolicy())
    with pytest.raises(FirewallRefusal) as exc:
        fw.check_request(gen.GRAPH_RULE, memoryview(gen.payload_of(case, gen.handles_fake(case))), 0)
    assert exc.value.reason == "op_needs_containment"


def test_fused_pairs_are_what_the_cpu_backend_fuses():
    # RMS_NORM then MUL, the one pair ggml-cpu runs as one kernel (accept_gen.fused): every pair
    # fused_cases yields is forwarded, meets the predicate, and carries its use count on the wire
    cs = [c for c, _ in gen.fused_cases(3, 6)]
    assert len(cs) == 6
    for c in cs:
        rms, mul = (c.by_id(i) for i in c.nodes[-2:])
        assert (gen.TABLE.names[rms.op], gen.TABLE.names[mul.op]) == ("RMS_NORM", "MUL")
        assert gen.accepts(c) is None, c.describe()
        assert gen.fused(rms, mul, c.tensors)
        wire = gen.materialize(c, gen.handles_fake(c))[c.tensors.index(rms)]
        assert decode_tensor(wire).use_count == 1
        rms.use_count = 2  # read twice: the server runs the two apart
        assert not gen.fused(rms, mul, c.tensors)
