"""SessionState: the buffer map, the allocation charge, and the verdict caches it owns.

The graph validator's ``tensor_cache`` remembers rpc_tensors it accepted; each verdict depends on
the buffer map (is the handle live, is the data inside it), so every change to the map must empty
the cache: a tensor accepted in a buffer must not stay accepted once that buffer is freed,
re-allocated smaller under the same handle, or its base moves.
"""

from __future__ import annotations

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import TensorSpec, graph_payload
from rpcguard.protocol.ggml import op_table
from rpcguard.protocol.graph import GraphValidator
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.versions import spec_for

HANDLE = 0x00005555DEADBE00
BASE = 0x00007F0000000000
SIZE = 1 << 20
V7 = (7, 0, 0)
ADD = op_table(V7).ids["ADD"]  # type: ignore[union-attr]


def state() -> SessionState:
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    st.add_buffer(HANDLE, 0, SIZE)
    st.set_base(HANDLE, BASE)
    return st


def graph(at: int) -> memoryview:
    """A weight at BASE+at (4 f32) and an ADD node on it, in the test buffer."""
    w = TensorSpec(id=0x10, buffer=HANDLE, data=BASE + at, name=b"w")
    node = TensorSpec(id=0x20, buffer=HANDLE, data=BASE, op=ADD, src=(0x10, 0x10))
    return memoryview(graph_payload([0x20], [w, node]))


def validate(st: SessionState, payload: memoryview) -> None:
    GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64)).check(payload, st)


@pytest.mark.parametrize("change", ["free", "alloc_same_handle_smaller", "base_moved", "alloc_other"])
def test_tensor_cache_is_emptied_by_every_buffer_change(change):
    st = state()
    payload = graph(SIZE - 16)  # the weight ends exactly at the buffer end
    validate(st, payload)
    assert st.tensor_cache
    if change == "free":
        st.free_buffer(HANDLE)
    elif change == "alloc_same_handle_smaller":
        st.add_buffer(HANDLE, 0, SIZE // 2)
        st.set_base(HANDLE, BASE)
    elif change == "base_moved":
        st.set_base(HANDLE, BASE + 64)
    else:
        st.add_buffer(HANDLE + 1, 0, SIZE)
    assert not st.tensor_cache
    if change == "alloc_other":
        validate(st, payload)  # still valid, re-checked
        return
    with pytest.raises(FirewallRefusal) as exc:
        validate(st, payload)
    assert exc.value.reason in ("buffer_unknown", "tensor_out_of_buffer")


def test_same_base_again_keeps_the_caches():
    st = state()
    validate(st, graph(0))
    st.set_base(HANDLE, BASE)  # BUFFER_GET_BASE asked twice: nothing changed
    assert st.tensor_cache


def test_alloc_charge_follows_add_and_free():
    st = state()
    st.charge_alloc(0, SIZE)  # the session charges at the request, add_buffer at the answer
    assert st.alloc_total == SIZE
    st.free_buffer(HANDLE)
    assert st.alloc_total == 0
    st.free_buffer(HANDLE)  # twice: never negative
    assert st.alloc_by_device == {0: 0}
