"""Content-indexed ops per backend (issue 29.3): on a CUDA node GET_ROWS, SET_ROWS, ADD_ID,
MUL_MAT_ID and SSM_SCAN index device memory with tensor contents that no kernel checks
(oprules/cuda.py CONTENT_INDEXED cites each line), so they are "contained only" there: forwarded
to a contained server, refused op_needs_containment by an uncontained one unless the operator
names them in policy.allow_unverified_ops (each use counted). The CPU layer keeps its ratings
(an out-of-range index aborts: GET_ROWS, SET_ROWS, ADD_ID, GET_ROWS_BACK) and forwards them."""

from __future__ import annotations

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import graph_payload
from rpcguard.protocol.ggml import op_table
from rpcguard.protocol.graph import GraphValidator
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.oprules import CONTENT_INDEXED, cuda, needs_containment, op_status
from rpcguard.protocol.state import SessionState
from tests.unit.protocol.test_backend import V7, T  # the same tensors in one buffer, at CUDA's alignment or not
from tests.unit.protocol.test_backend import state as _state

OPS = op_table(V7).ids  # type: ignore[union-attr]
F32, I32, I64 = 0, 26, 27
INDEX_OPS = ("GET_ROWS", "SET_ROWS", "ADD_ID", "MUL_MAT_ID")


def test_cuda_rating_per_op():
    for op in INDEX_OPS + ("SSM_SCAN",):
        assert needs_containment(op, "cuda"), op
        assert op_status(op, V7, "cuda") == "contained only", op
        assert cuda.CONTENT_INDEXED[op][0] == "memory" and ".cu:" in cuda.CONTENT_INDEXED[op][1]
    # the CUDA kernel only compares GET_ROWS_BACK's rows (getrows.cu:148-151)
    assert not needs_containment("GET_ROWS_BACK", "cuda")
    assert op_status("GET_ROWS_BACK", V7, "cuda") == "verified"
    assert op_status("MUL_MAT", V7, "cuda") == "verified"


def test_cpu_rating_unchanged():
    for op in ("GET_ROWS", "SET_ROWS", "ADD_ID", "GET_ROWS_BACK"):
        assert not needs_containment(op) and not needs_containment(op, "cpu")
        assert op_status(op, V7) == op_status(op, V7, "cpu") == "verified, contents abort"
    assert op_status("MUL_MAT_ID", V7) == "verified, residual risk"
    assert op_status("SSM_SCAN", V7) == "contained only"
    # every op indexed by contents on the CPU has a CUDA rating, and the reverse
    assert set(cuda.CONTENT_INDEXED) == set(CONTENT_INDEXED)


def get_rows():
    a, b = T(0x10, F32, (8, 16, 1, 1)), T(0x11, I32, (3, 1, 1, 1))
    return [a, b], T(0x20, F32, (8, 3, 1, 1), op=OPS["GET_ROWS"], src=(0x10, 0x11))


def set_rows():
    rows, idx, dst = T(0x10, F32, (8, 3, 1, 1)), T(0x11, I64, (3, 1, 1, 1)), T(0x12, F32, (8, 16, 1, 1))
    return [rows, idx, dst], T(0x20, F32, (8, 16, 1, 1), op=OPS["SET_ROWS"], src=(0x10, 0x11, 0x12),
                               view_src=0x12, data=dst.data)


def add_id():
    a, b, ids = T(0x10, F32, (8, 2, 3, 1)), T(0x11, F32, (8, 4, 1, 1)), T(0x12, I32, (2, 3, 1, 1))
    return [a, b, ids], T(0x20, F32, (8, 2, 3, 1), op=OPS["ADD_ID"], src=(0x10, 0x11, 0x12))


def mul_mat_id():
    # 4 experts of 8x6, 2 used per token, 1 token (a decode batch: CUDA's MMVF path)
    w, x, ids = T(0x10, F32, (8, 6, 4, 1)), T(0x11, F32, (8, 1, 1, 1)), T(0x12, I32, (2, 1, 1, 1))
    return [w, x, ids], T(0x20, F32, (6, 2, 1, 1), op=OPS["MUL_MAT_ID"], src=(0x10, 0x11, 0x12))


BUILDERS = {"GET_ROWS": get_rows, "SET_ROWS": set_rows, "ADD_ID": add_id, "MUL_MAT_ID": mul_mat_id}


def run(op: str, setting: str, *, contained: bool = False, allow: frozenset[str] = frozenset(),
        st: SessionState | None = None) -> SessionState:
    tensors, node = BUILDERS[op]()
    st = st if st is not None else _state()
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, backend=setting, contained=contained, allow_unverified_ops=allow))
    v.check(memoryview(graph_payload([node.id], tensors + [node])), st)
    return st


@pytest.mark.parametrize("op", INDEX_OPS)
def test_uncontained_cuda_node_refuses_index_ops(op):
    run(op, "cpu")  # the CPU layer forwards them (an out-of-range index aborts the server)
    run(op, "auto")  # nothing detected yet: the CPU layer
    with pytest.raises(FirewallRefusal) as exc:
        run(op, "cuda")
    assert exc.value.reason == "op_needs_containment" and "unchecked on CUDA" in str(exc.value)
    with pytest.raises(FirewallRefusal) as exc:
        run(op, "auto", st=_state(alignment=cuda.ALIGNMENT))  # the server answered CUDA's alignment
    assert exc.value.reason == "op_needs_containment"


@pytest.mark.parametrize("op", INDEX_OPS)
def test_contained_cuda_node_forwards_index_ops(op):
    st = run(op, "cuda", contained=True)
    assert not st.unverified_uses


@pytest.mark.parametrize("op", INDEX_OPS)
def test_operator_acknowledgement_forwards_and_counts(op):
    st = run(op, "cuda", allow=frozenset({op}))
    assert st.unverified_uses == {op: 1}
    st = run(op, "cuda", allow=frozenset({"*"}))
    assert st.unverified_uses == {op: 1}
    with pytest.raises(FirewallRefusal):  # naming another op acknowledges nothing for this one
        run(op, "cuda", allow=frozenset({"SSM_SCAN"}))
