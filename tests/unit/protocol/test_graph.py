"""GRAPH_COMPUTE validation: spec §3.2 layout and the §6.2 GRAPH_COMPUTE invariants."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol import graph as graph_mod
from rpcguard.protocol.encode import TensorSpec, graph_payload, pack_tensor
from rpcguard.protocol.ggml import op_table
from rpcguard.protocol.graph import GraphValidator, op_rules, set_clock
from rpcguard.protocol.settings import CHECK_NAMES, FirewallPolicy
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.versions import spec_for

HANDLE = 0x00005555DEADBE00
BASE = 0x00007F0000000000
SIZE = 1 << 20
V7 = (7, 0, 0)
OPS = op_table(V7).ids  # type: ignore[union-attr]
F32, F16, I32, I64 = 0, 1, 26, 27


def state(version=V7, devices: int = 1) -> SessionState:
    st = SessionState(UpstreamFacts(device_count=devices), spec=spec_for(version))
    st.add_buffer(HANDLE, 0, SIZE)
    st.buffers[HANDLE].base = BASE
    return st


def validator(**policy) -> GraphValidator:
    """A validator built from a FirewallPolicy with these fields (small graph caps unless given)."""
    policy.setdefault("max_graph_nodes", 1024)
    policy.setdefault("max_graph_tensors", 4096)
    return GraphValidator(FirewallPolicy(**policy))


def T(id: int, slot: int = 0, **kw) -> TensorSpec:
    """An F32 [4,1,1,1] tensor in the test buffer at slot * 64 (unless overridden)."""
    kw.setdefault("buffer", HANDLE)
    kw.setdefault("data", BASE + slot * 64 if kw["buffer"] else 0)
    return TensorSpec(id=id, **kw)


def chain() -> tuple[list[int], list[TensorSpec]]:
    """Two weights, an ADD node on them, a MUL node on the ADD and a weight, a VIEW of the MUL."""
    tensors = [
        T(0x10, 0, name=b"w0", use_count=1),
        T(0x20, 1, name=b"w1", use_count=2),
        T(0x30, 2, op=OPS["ADD"], src=(0x10, 0x20), use_count=1),
        T(0x40, 3, op=OPS["MUL"], src=(0x30, 0x20), use_count=1),
        T(0x50, 3, op=OPS["VIEW"], src=(0x40,), view_src=0x40),
    ]
    return [0x30, 0x40, 0x50], tensors


def run(nodes, tensors, st=None, v=None, device: int | None = 0, raw: bytes | None = None) -> int:
    st = st or state()
    payload = raw if raw is not None else graph_payload(nodes, tensors, device=device)
    return (v or validator()).check(memoryview(payload), st)


def reason(nodes, tensors, **kw) -> str:
    with pytest.raises(FirewallRefusal) as exc:
        run(nodes, tensors, **kw)
    return exc.value.reason


# -- accepted -------------------------------------------------------------------------------


def test_spec_vector_header_and_layout():
    # Spec §8: header `0a 8c 03 00 ...`, device 0, 1 node id 0x2000, 3 tensors, len 0x38c.
    tensors = [T(0x1000, 0), T(0x1001, 1), T(0x2000, 2, op=OPS["ADD"], src=(0x1000, 0x1001))]
    payload = graph_payload([0x2000], tensors)
    assert len(payload) == 0x38C
    assert payload[:20] == bytes.fromhex("00000000" "01000000" "0020000000000000" "03000000")
    assert run(None, None, raw=payload) == 0


def test_accepts_chain_with_views_and_use_counts():
    nodes, tensors = chain()
    assert run(nodes, tensors) == 0


def test_accepts_cpu_side_tensors_without_buffer():
    # 7.0.0 sends buffer=0, data=0 for tensors outside this server's buffers (transitive srcs).
    # No kernel touches them: only the nodes and their direct sources must be allocated here.
    tensors = [
        T(0x10, buffer=0),
        T(0x11, buffer=0),
        T(0x20, 1, op=OPS["GET_ROWS"], src=(0x10, 0x11)),
        T(0x25, 2),
        T(0x30, 2, op=OPS["CPY"], src=(0x20, 0x25), view_src=0x25),
    ]
    assert run([0x30], tensors) == 0
    tensors[1].buffer = 0  # unchanged: 0x11 is still only a transitive source
    tensors[2].buffer, tensors[2].data = 0, 0  # CPY's src[0] read by the kernel, unallocated
    assert reason([0x30], tensors) == "graph_tensor_unallocated"


@pytest.mark.parametrize("op,srcs", [("MUL_MAT", 1), ("SET_ROWS", 1), ("SET_ROWS", 2), ("ROPE", 1)])
def test_ops_that_read_several_sources_need_them_all(op, srcs):
    # A 4.0.0 client's GLU (op 95) reaches a 4.0.2 server as OPT_STEP_ADAMW: its kernel reads
    # src[0..4] and the server crashed on the NULL ones (found by the version matrix).
    leaves = [T(0x10 + i) for i in range(5)]
    node = T(0x30, 5, op=OPS[op], src=tuple(0x10 + i for i in range(srcs)))
    assert reason([0x30], leaves + [node]) == "graph_src_missing"


def test_returns_device_and_checks_it():
    nodes, tensors = chain()
    st = state(devices=2)
    st.buffers[HANDLE].device = 1
    assert run(nodes, tensors, st=st, device=1) == 1
    assert reason(nodes, tensors, device=1) == "device_out_of_range"
    # A graph runs on one device: tensors of another device's buffers are refused.
    assert reason(nodes, tensors, st=state(devices=2), device=1) == "graph_tensor_wrong_device"


def test_pre_3_0_layout_without_device():
    nodes, tensors = chain()
    # 2.0.0 op ids were not tied to the protocol version: only with every op allowed.
    v = validator(allow_unverified_ops=frozenset({"*"}))
    assert run(nodes, tensors, st=state((2, 0, 0)), device=None, v=v) == 0
    assert reason(nodes, tensors, st=state((2, 0, 0)), device=None) == "op_not_verified"


def test_no_op_table_means_no_graph_unless_every_op_is_allowed():
    # 3.0.0 has no verified op table: no node can be re-derived, so default deny refuses the
    # graph; a site that accepts the risk ("*") gets the structure checks only.
    tensors = [T(0x10), T(0x20, 1, op=500, src=(0x10,)), T(0x30, 2, op=95, src=(0x20,))]
    assert op_rules((3, 0, 0)) is None
    assert reason([0x20, 0x30], tensors, st=state((3, 0, 0))) == "op_not_verified"
    v = validator(allow_unverified_ops=frozenset({"*"}))
    assert run([0x20, 0x30], tensors, st=state((3, 0, 0)), v=v) == 0


def test_non_node_tensors_are_not_op_checked():
    # Custom op on a tensor that is only a transitive src (never executed by the server).
    tensors = [T(0x10, op=OPS["CUSTOM"]), T(0x20, 1, op=OPS["ADD"], src=(0x10, 0x10))]
    assert run([0x20], tensors) == 0


def _f(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def test_arange_and_none_nodes_need_no_src0():
    # ARANGE(0, 4, 1) builds 4 F32 elements from its params alone; a NONE node (a PARAM) is data.
    tensors = [T(0x10, op=OPS["ARANGE"], op_params=(_f(0.0), _f(4.0), _f(1.0))), T(0x20, 1, flags=4)]
    assert run([0x10, 0x20], tensors) == 0


# -- sizes and caps -------------------------------------------------------------------------


def test_refuses_trailing_bytes():
    nodes, tensors = chain()
    raw = graph_payload(nodes, tensors) + b"\0"
    assert reason(None, None, raw=raw) == "graph_size_mismatch"


@pytest.mark.parametrize("cut", [1, 296, 297])
def test_refuses_short_payload(cut):
    nodes, tensors = chain()
    raw = graph_payload(nodes, tensors)[:-cut]
    assert reason(None, None, raw=raw) == "graph_size_mismatch"


@pytest.mark.parametrize("raw", [b"", b"\0\0\0", struct.pack("<II", 0, 2) + bytes(8)])
def test_refuses_truncated_header(raw):
    assert reason(None, None, raw=raw) == "graph_size_mismatch"


def test_refuses_huge_counts_before_reading():
    assert reason(None, None, raw=struct.pack("<II", 0, 0xFFFFFFFF)) == "graph_too_large"
    raw = struct.pack("<IIQI", 0, 1, 0x10, 0xFFFFFFFF)
    assert reason(None, None, raw=raw) == "graph_too_large"


def test_caps_on_nodes_and_tensors():
    nodes, tensors = chain()
    assert reason(nodes, tensors, v=validator(max_graph_nodes=2)) == "graph_too_large"
    assert reason(nodes, tensors, v=validator(max_graph_tensors=4)) == "graph_too_large"


# -- structure ------------------------------------------------------------------------------


def test_refuses_zero_nodes():
    assert reason([], [T(0x10)]) == "graph_node_invalid"


def test_refuses_node_id_zero():
    nodes, tensors = chain()
    assert reason([0x30, 0], tensors) == "graph_node_invalid"


def test_refuses_tensor_id_zero():
    assert reason([0x10], [T(0, 1), T(0x10, op=OPS["ADD"], src=(0x20,))]) == "graph_node_invalid"


def test_refuses_duplicate_node_id():
    nodes, tensors = chain()
    assert reason([0x30, 0x40, 0x40], tensors) == "graph_node_duplicate"


def test_refuses_duplicate_tensor_id():
    nodes, tensors = chain()
    assert reason(nodes, tensors + [T(0x10, 5)]) == "graph_node_duplicate"


def test_refuses_node_not_in_list():
    nodes, tensors = chain()
    assert reason(nodes + [0x99], tensors) == "graph_node_missing"


def test_refuses_more_nodes_than_tensors():
    assert reason([0x10, 0x20], [T(0x10)]) == "graph_node_missing"


@pytest.mark.parametrize("field", ["src", "view_src"])
def test_refuses_missing_src(field):
    nodes, tensors = chain()
    if field == "src":
        tensors[2].src = (0x10, 0x99)
    else:
        tensors[4].view_src = 0x99
    assert reason(nodes, tensors) == "graph_src_missing"


def test_refuses_src_in_high_slot_missing():
    nodes, tensors = chain()
    tensors[2].src = (0x10, 0x20) + (0,) * 7 + (0x99,)
    assert reason(nodes, tensors) == "graph_src_missing"


def test_refuses_src_after_user():
    nodes, tensors = chain()
    tensors[2].src = (0x10, 0x40)  # ADD reads the MUL that comes after it
    assert reason(nodes, tensors) == "graph_order_invalid"


def test_refuses_self_reference():
    nodes, tensors = chain()
    tensors[3].src = (0x40, 0x20)
    assert reason(nodes, tensors) == "graph_order_invalid"


def test_refuses_nodes_out_of_order():
    nodes, tensors = chain()
    assert reason([0x40, 0x30, 0x50], tensors) == "graph_order_invalid"


def test_refuses_node_without_src0():
    tensors = [T(0x10), T(0x20, 1, op=OPS["MUL_MAT"], src=(0, 0x10))]
    assert reason([0x20], tensors) == "graph_src_missing"


def test_every_tensor_gets_the_tensor_checks():
    nodes, tensors = chain()
    tensors[0].buffer = 0  # CVE-2026-34159: no buffer, arbitrary data pointer
    tensors[0].data = 0x4141414141
    assert reason(nodes, tensors) == "tensor_data_without_buffer"
    nodes, tensors = chain()
    tensors[1].data = BASE + SIZE
    assert reason(nodes, tensors) == "tensor_out_of_buffer"


@pytest.mark.parametrize("use_count", [-1, 10 * 1024 + 1])
def test_refuses_use_count_out_of_range(use_count):
    nodes, tensors = chain()
    tensors[1].use_count = use_count
    assert reason(nodes, tensors) == "graph_use_count_invalid"
    # Before 5.1.0 the field was padding (older clients left garbage): not checked.
    assert run(nodes, tensors, st=state((5, 0, 0))) == 0


# -- ops ------------------------------------------------------------------------------------


def test_refuses_op_beyond_op_count():
    nodes, tensors = chain()
    tensors[0].op = 101  # OP_COUNT of 7.0.0, on a non-node tensor
    assert reason(nodes, tensors) == "graph_op_invalid"


@pytest.mark.parametrize("name", ["MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3", "CUSTOM"])
def test_refuses_custom_ops(name):
    nodes, tensors = chain()
    tensors[3].op = OPS[name]
    tensors[3].op_params = (0x41414141, 0x4141, 0x42424242, 0x4242)  # fun, userdata
    assert reason(nodes, tensors) == "graph_op_denied"


def test_custom_op_ids_follow_the_version():
    # 3.6.1: CUSTOM is 90, not 95 (OP_COUNT 96 - 6).
    tensors = [T(0x10), T(0x20, 1, op=90, src=(0x10,))]
    assert reason([0x20], tensors, st=state((3, 6, 1))) == "graph_op_denied"
    tensors[1].op = 95  # GLU on 3.6.1: halves ne0
    tensors[1].ne = (2, 1, 1, 1)
    assert run([0x20], tensors, st=state((3, 6, 1))) == 0


def test_opt_in_deny_list_and_unverified_ops():
    # FLASH_ATTN_BACK: an op without a 7.0.0 rule (no ggml constructor builds it; GATED_DELTA_NET, ADD1
    # and IM2COL_BACK, the examples here before, have one now)
    tensors = [T(0x10), T(0x20, 1, op=OPS["FLASH_ATTN_BACK"], src=(0x10,))]
    assert reason([0x20], tensors) == "op_not_verified"  # no rule: default deny
    assert reason([0x20], tensors, v=validator(contained=True)) == "op_not_verified"  # contained or not
    st = state()
    assert run([0x20], tensors, st=st, v=validator(allow_unverified_ops=frozenset({"FLASH_ATTN_BACK"}))) == 0
    assert st.unverified_uses == {"FLASH_ATTN_BACK": 1}
    v = validator(denied_ops=frozenset({"FLASH_ATTN_BACK", "SSM_SCAN"}), allow_unverified_ops=frozenset({"*"}))
    assert reason([0x20], tensors, v=v) == "graph_op_denied"


# ACC / SET: dst (slot 0, 16 F32 = 64 bytes), a (same shape), b (4 F32); op_params nb1,nb2,nb3,offset.
def acc_graph(op: str, params, b_ne=(4, 1, 1, 1), a_type: int = F32) -> tuple[list[int], list[TensorSpec]]:
    a = T(0x10, 0, ne=(16, 1, 1, 1), type=a_type, type_size=2 if a_type == F16 else 4)
    b = T(0x20, 2, ne=b_ne)
    dst = T(0x30, 4, ne=(16, 1, 1, 1), op=OPS[op], src=(0x10, 0x20), op_params=params)
    return [0x30], [a, b, dst]


@pytest.mark.parametrize("op", ["ACC", "SET"])
def test_accepts_acc_set_inside(op):
    assert run(*acc_graph(op, (64, 64, 64, 48, 0))) == 0  # last 4 floats
    assert run(*acc_graph(op, (16, 64, 64, 0, 0), b_ne=(4, 4, 1, 1))) == 0  # 4 rows of 4 floats


@pytest.mark.parametrize(
    "params",
    [
        (64, 64, 64, 52, 0),  # one float past the end
        (64, 64, 64, -4, 0),  # negative offset
        (-16, 64, 64, 48, 0),  # negative stride
        (32, 64, 64, 0, 0),  # with 4 rows: 3 * 32 + 16 > 64
    ],
)
@pytest.mark.parametrize("op", ["ACC", "SET"])
def test_refuses_acc_set_outside(op, params):
    b_ne = (4, 4, 1, 1) if params[0] == 32 else (4, 1, 1, 1)
    assert reason(*acc_graph(op, params, b_ne=b_ne)) == "graph_op_params_invalid"


def test_refuses_negative_strides_that_cancel():
    # #25764: stride -16 on 2 rows and offset 48: the far corner (48 - 16 + 12) passes ggml's
    # own assert, the rows land at 48 and 32... here any negative value is refused.
    assert reason(*acc_graph("ACC", (-16, 0, 0, 48, 0), b_ne=(4, 2, 1, 1))) == "graph_op_params_invalid"


def test_refuses_acc_dst_differing_from_src0():
    assert reason(*acc_graph("ACC", (64, 64, 64, 0, 0), a_type=F16)) == "graph_type_invalid"


def test_refuses_acc_without_src1():
    nodes, tensors = acc_graph("ACC", (64, 64, 64, 0, 0))
    tensors[2].src = (0x10,)
    assert reason(nodes, tensors) == "graph_src_missing"


def pad_graph(p0: int, p1: int, dst_ne0: int | None = None, dst_ne1: int = 2) -> tuple[list[int], list[TensorSpec]]:
    a = T(0x10, 0, ne=(4, 2, 1, 1))
    ne0 = 4 + p0 + p1 if dst_ne0 is None else dst_ne0
    dst = T(0x20, 2, ne=(ne0, dst_ne1, 1, 1), op=OPS["PAD_REFLECT_1D"], src=(0x10,), op_params=(p0, p1))
    return [0x20], [a, dst]


def test_accepts_pad_reflect_1d():
    assert run(*pad_graph(3, 2)) == 0


@pytest.mark.parametrize("p0,p1", [(-1, 0), (0, -5), (4, 0), (0, 4)])
def test_refuses_pad_reflect_1d_pads(p0, p1):
    assert reason(*pad_graph(p0, p1, dst_ne0=8)) == "graph_op_params_invalid"


@pytest.mark.parametrize("dst_ne0,dst_ne1", [(6, 2), (8, 2), (7, 1)])
def test_refuses_pad_reflect_1d_shape(dst_ne0, dst_ne1):
    assert reason(*pad_graph(1, 2, dst_ne0=dst_ne0, dst_ne1=dst_ne1)) == "graph_shape_invalid"


def get_rows_graph(**over) -> tuple[list[int], list[TensorSpec]]:
    a = dict(ne=(8, 10, 2, 1), type=F32)
    b = dict(ne=(3, 2, 1, 1), type=I32)
    d = dict(ne=(8, 3, 2, 1), type=F32)
    for key, value in over.items():
        {"a": a, "b": b, "d": d}[key[0]][key[2:]] = value
    ta = T(0x10, 0, **a)
    tb = T(0x20, 20, **b)
    td = T(0x30, 40, op=OPS["GET_ROWS"], src=(0x10, 0x20), **d)
    return [0x30], [ta, tb, td]


def test_accepts_get_rows():
    assert run(*get_rows_graph()) == 0


@pytest.mark.parametrize(
    "over",
    [
        {"b_type": F32},  # indices must be I32
        {"b_ne": (3, 1, 1, 1)},  # a.ne2 != b.ne1
        {"a_ne": (8, 10, 2, 2)},  # a.ne3 != b.ne2
        {"d_ne": (8, 4, 2, 1)},  # dst rows != b.ne0 (#26825: writes past dst)
        {"d_ne": (16, 3, 2, 1)},  # dst ne0 != a.ne0
        {"d_type": F16},  # dst must be F32 unless a is I32
        {"d_nb": (2, 16, 48, 96)},  # dst rows not contiguous
    ],
)
def test_refuses_get_rows_shapes(over):
    # Strides a constructor never makes are refused by the layout rule before the op rule.
    want = "tensor_layout_invalid" if "d_nb" in over else "graph_shape_invalid"
    assert reason(*get_rows_graph(**over)) == want


def set_rows_graph(**over) -> tuple[list[int], list[TensorSpec]]:
    a = dict(ne=(8, 16, 2, 1), type=F16, type_size=2)
    b = dict(ne=(8, 3, 2, 1), type=F32)
    c = dict(ne=(3, 1, 1, 1), type=I64, type_size=8)
    d = dict(a)
    for key, value in over.items():
        {"a": a, "b": b, "c": c, "d": d}[key[0]][key[2:]] = value
    ta = T(0x10, 0, **a)
    tb = T(0x20, 20, **b)
    tc = T(0x30, 40, **c)
    td = T(0x40, 0, op=OPS["SET_ROWS"], src=(0x20, 0x30, 0x10), view_src=0x10, **d)
    return [0x40], [ta, tb, tc, td]


def test_accepts_set_rows():
    assert run(*set_rows_graph()) == 0
    assert run(*set_rows_graph(c_type=I32, c_type_size=4)) == 0
    # no rows to set (test-backend-ops r=1,v=1): the kernel loops over b.ne1 = 0 rows
    assert run(*set_rows_graph(b_ne=(8, 0, 2, 1), c_ne=(0, 1, 1, 1))) == 0


@pytest.mark.parametrize(
    "over",
    [
        {"c_ne": (2, 1, 1, 1)},  # b.ne1 != c.ne0
        {"c_ne": (3, 0, 1, 1)},  # c.ne1 == 0: b.ne2 % c.ne1 is a division by zero (empty c)
        {"c_ne": (3, 3, 1, 1)},  # b.ne2 % c.ne1 != 0
        {"c_ne": (3, 1, 1, 2)},  # c.ne3 != 1
        {"c_type": F32},  # indices must be I64/I32
        {"b_type": I32},  # source rows F32/F16 only
        {"d_ne": (16, 16, 2, 1), "a_ne": (16, 16, 2, 1)},  # dst.ne0 != b.ne0 (#26912)
        {"d_ne": (8, 16, 1, 1)},  # dst.ne2 != b.ne2
        {"d_type": F32, "d_type_size": 4},  # dst is not a view of src[2]
        {"d_nb": (1, 16, 256, 512)},  # dst rows not contiguous
    ],
)
def test_refuses_set_rows_shapes(over):
    # Strides a constructor never makes are refused by the layout rule; an empty c (SET_ROWS takes
    # empty sources) by the rule's own c.ne1 check.
    layout = "d_nb" in over
    assert reason(*set_rows_graph(**over)) == ("tensor_layout_invalid" if layout else "graph_shape_invalid")


# -- the tensor cache -----------------------------------------------------------------------


def test_cache_remembers_validated_tensors_and_free_clears_it():
    st = state()
    nodes, tensors = chain()
    run(nodes, tensors, st=st)
    assert set(st.tensor_cache) == {pack_tensor(t) for t in tensors}
    run(nodes, tensors, st=st)  # all hits
    st.free_buffer(HANDLE)
    assert not st.tensor_cache
    assert reason(nodes, tensors, st=st) == "buffer_unknown"


def test_cache_is_bounded(monkeypatch):
    from rpcguard.protocol import graph

    monkeypatch.setattr(graph, "TENSOR_CACHE_MAX", 3)
    st = state()
    nodes, tensors = chain()
    run(nodes, tensors, st=st)
    assert 1 <= len(st.tensor_cache) <= 3


# -- what the validator takes from outside: the policy itself, the clock -------------------


def test_built_from_the_policy_itself():
    # each graph check the policy switches off is off in the validator, and only that one
    graph_checks = {"tensor": "tensor_checks", "buffer_bounds": "tensor_checks", "graph_structure": "structure",
                    "graph_ops": "ops", "op_params": "op_params", "device_index": "device"}
    on = validator()
    assert on.tensor_checks == 3 and on.structure and on.ops and on.op_params and on.device
    for check in CHECK_NAMES:
        off = validator(disabled_checks=frozenset({check}))
        changed = {a for a in set(graph_checks.values()) if getattr(off, a) != getattr(on, a)}
        assert changed == ({graph_checks[check]} if check in graph_checks else set()), check
    p = FirewallPolicy(max_graph_nodes=7, max_graph_tensors=9, denied_ops=frozenset({"SSM_SCAN"}),
                       allow_unverified_ops=frozenset({"*"}), max_graph_cpu_s=0.25, max_graph_compute_s=3.0,
                       node_gflops=2.0, max_work_bytes=5, server_threads=3, contained=True, backend="cuda")
    v = GraphValidator(p)
    assert (v.max_nodes, v.max_tensors, v.max_use_count, v.extra_denied, v.allow_unverified) == (
        7, 9, 70, frozenset({"SSM_SCAN"}), frozenset({"*"}))
    assert (v.max_cpu_s, v.max_compute_s, v.node_flops, v.max_work_bytes, v.server_threads, v.contained,
            v.backend) == (0.25, 3.0, 2e9, 5, 3, True, "cuda")
    # a structure check switched off in the policy: a duplicate tensor id passes
    dup = [T(0x10, 0), T(0x10, 1), T(0x30, 2, op=OPS["ADD"], src=(0x10, 0x10))]
    assert reason([0x30], dup) == "graph_node_duplicate"
    run([0x30], dup, v=validator(disabled_checks=frozenset({"graph_structure"})))


def test_the_budget_reads_the_installed_clock_or_its_own():
    nodes = list(range(0x100, 0x100 + 600))
    tensors = [T(0x10, 0), T(0x20, 1)] + [T(n, 2 + i, op=OPS["ADD"], src=(0x10, 0x20)) for i, n in enumerate(nodes)]
    tight = validator(max_graph_cpu_s=1e-3)
    readings: list[float] = []

    def clock() -> float:
        readings.append(len(readings) * 1e-3)
        return readings[-1]

    before = graph_mod._CLOCK[0]
    set_clock(clock)
    try:
        assert reason(nodes, tensors, v=tight) == "graph_too_costly"
        assert len(readings) == 3  # the start and two budget checks: 0, 1 ms, 2 ms > 1 ms
        set_clock(None)  # none installed (pure protocol use): the budget never trips
        run(nodes, tensors, v=tight)
        readings.clear()
        assert reason(nodes, tensors, v=GraphValidator(FirewallPolicy(max_graph_cpu_s=1e-3), clock)) == "graph_too_costly"
        assert len(readings) == 3
    finally:
        set_clock(before)


def test_importing_the_protocol_core_installs_nothing():
    # sans-IO: no process-global hook at import (the proxy's validators install the clock's)
    code = "import gc; import rpcguard.protocol.session, rpcguard.protocol.graph; print(len(gc.callbacks))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"
