"""Nothing shared between tenants (issue 28 item 3).

(a) SET_TENSOR_HASH answers from the server's -c cache, which holds what any identity uploaded: the
proxy answers it "not cached" itself unless the cache is this identity's own (a contained serve),
so the client uploads the tensor, and keeps that tensor out of a shared cache (cache_flag cleared).
(b) What a server says about itself (max size, alignment, padded sizes, memory) is the session's:
a lying server's answers never reach the next session, and an answer the protocol rules out ends
only the session that got it."""

from __future__ import annotations

import struct

import pytest

from rpcguard.errors import ProtocolRefusal
from rpcguard.protocol import encode
from rpcguard.protocol.firewall import FirewallPolicy
from rpcguard.protocol.session import Session, SessionPolicy
from rpcguard.protocol.state import UpstreamFacts
from tests.support import vectors as V

V7 = (7, 0, 0)
BIG = (10 << 20) + 4  # above HASH_THRESHOLD: the client asks SET_TENSOR_HASH first
SHARED = SessionPolicy(clear_new_buffers=False)  # --upstream, connect, an uncontained serve
OWN_CACHE = SessionPolicy(clear_new_buffers=False, firewall=FirewallPolicy(contained=True))
TRAILING = V.DEVICE_COUNT_REQ


take = V.take


def start(template: UpstreamFacts, policy: SessionPolicy = SHARED) -> Session:
    s = Session(policy, template)
    s.client_data(memoryview(encode.hello_request(V7)))
    s.server_data(memoryview(encode.hello_response(V7)))
    assert s.greeted
    if s.state.upstream.device_count is None:  # the session's own DEVICE_COUNT, GET_DEVICE_MEMORY, GET_ALIGNMENT
        s.server_data(memoryview(encode.response(struct.pack("<I", 1))))
        s.server_data(memoryview(encode.response(struct.pack("<QQ", 1 << 30, 1 << 30))))
        s.server_data(memoryview(encode.response(struct.pack("<Q", 32))))
    take(s.to_server), take(s.to_client), s.out.events.clear()
    return s


def with_buffer(s: Session, size: int = 1 << 26) -> bytes:
    s.state.add_buffer(V.HANDLE, 0, size)
    s.state.set_base(V.HANDLE, V.BASE)
    return encode.pack_tensor(encode.TensorSpec(buffer=V.HANDLE, data=V.BASE, ne=(BIG // 4, 1, 1, 1)))


def hash_req(t: bytes) -> bytes:
    return encode.request("SET_TENSOR_HASH", t + struct.pack("<QQ", 0, 0xCBF29CE484222325))


def set_tensor(t: bytes, flag: int) -> bytes:
    return encode.request("SET_TENSOR", t + bytes([flag]) + struct.pack("<Q", 0) + bytes(BIG))


def fed(s: Session, data: bytes, how: str) -> None:
    for kind, chunks in V.runs(data, TRAILING):
        if kind == how:
            for c in chunks:
                s.client_data(memoryview(bytearray(c)))


# -- (a) SET_TENSOR_HASH ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
def test_hash_on_a_shared_cache_is_answered_not_cached_by_the_proxy(how):
    s = start(UpstreamFacts())
    t = with_buffer(s)
    fed(s, hash_req(t), how)
    assert take(s.to_server) == (TRAILING if how == "trailing" else b"")  # the server's cache is never asked
    assert take(s.to_client) == encode.response(b"\x00")
    assert s.stats.hash_answered_by_proxy == 1
    if how == "trailing":
        s.server_data(memoryview(V.DEVICE_COUNT_RSP_2[:8] + struct.pack("<I", 1)))
        assert take(s.to_client) == encode.response(struct.pack("<I", 1))
    # the client uploads it as after any miss, cache_flag=1: forwarded with the flag cleared, so the
    # tensor stays out of the cache that another identity's hash would read
    s.client_data(memoryview(set_tensor(t, 1)))
    sent = take(s.to_server)
    assert sent == set_tensor(t, 0) and s.idle


def test_hash_reaches_a_server_whose_cache_is_the_identitys_own():
    s = start(UpstreamFacts(), OWN_CACHE)
    t = with_buffer(s)
    s.client_data(memoryview(hash_req(t)))
    assert take(s.to_server) == hash_req(t) and take(s.to_client) == b""
    s.server_data(memoryview(encode.response(b"\x00")))
    s.client_data(memoryview(set_tensor(t, 1)))
    assert take(s.to_server) == set_tensor(t, 1) and s.stats.hash_answered_by_proxy == 0


def test_connect_leaves_the_hash_to_the_nodes_serve():
    s = start(UpstreamFacts())
    s.leave_requests_to_node()
    t = with_buffer(s)
    s.client_data(memoryview(hash_req(t)))
    assert take(s.to_server) == hash_req(t)


# -- (b) facts per session -------------------------------------------------------------------------


def lying_session(template: UpstreamFacts) -> None:
    """A server that answers a tiny max size, a tiny memory total and a huge padded size."""
    s = start(template)
    for req, rsp in [
        (encode.request("GET_MAX_SIZE", struct.pack("<I", 0)), struct.pack("<Q", 4096)),
        (encode.request("GET_DEVICE_MEMORY", struct.pack("<I", 0)), struct.pack("<QQ", 4096, 4096)),
        (encode.request("GET_ALLOC_SIZE", struct.pack("<I", 0) + quantized() + bytes(2960)), struct.pack("<Q", 1 << 40)),
    ]:
        s.client_data(memoryview(req))
        s.server_data(memoryview(encode.response(rsp)))
    assert s.state.upstream.max_size == {0: 4096}


def quantized(buffer: int = 0) -> bytes:
    # a q8_0 row of 32 (34 bytes), the kind of tensor a padding backend is asked about
    return encode.pack_tensor(encode.TensorSpec(type=8, ne=(32, 1, 1, 1), nb=(34, 34, 34, 34), buffer=buffer,
                                                data=V.BASE if buffer else 0))


def test_a_lying_server_does_not_poison_the_next_tenants_session():
    template = UpstreamFacts("upstream")
    lying_session(template)
    honest = start(template)  # the next tenant (a contained serve: a new process)
    assert honest.state.upstream.max_size == {} and honest.state.upstream.alloc_sizes == {}
    honest.client_data(memoryview(encode.request("ALLOC_BUFFER", struct.pack("<IQ", 0, 1 << 20))))
    assert take(honest.to_server)  # not alloc_size_invalid / alloc_quota_exceeded
    honest.server_data(memoryview(encode.response(struct.pack("<QQ", V.HANDLE, 1 << 20))))
    honest.client_data(memoryview(V.GET_BASE_REQ))
    honest.server_data(memoryview(V.GET_BASE_RSP))
    honest.client_data(memoryview(encode.request("INIT_TENSOR", quantized(V.HANDLE))))
    assert take(honest.to_server).endswith(quantized(V.HANDLE))  # not tensor_out_of_buffer
    assert template.version == V7  # only the version goes back (it words a later HELLO refusal)


@pytest.mark.parametrize("req,rsp", [
    (encode.request("GET_ALIGNMENT", struct.pack("<I", 0)), struct.pack("<Q", 48)),
    (encode.request("GET_ALIGNMENT", struct.pack("<I", 0)), struct.pack("<Q", 0)),
    (encode.request("GET_ALLOC_SIZE", struct.pack("<I", 0) + quantized() + bytes(2960)), struct.pack("<Q", 33)),
])
def test_an_answer_the_protocol_rules_out_ends_only_that_session(req, rsp):
    template = UpstreamFacts()
    s = start(template)
    s.client_data(memoryview(req))
    with pytest.raises(ProtocolRefusal) as e:
        s.server_data(memoryview(encode.response(rsp)))
    assert e.value.reason == "response_value_invalid" and e.value.party == "upstream"
    other = start(template)
    other.client_data(memoryview(req))
    other.server_data(memoryview(encode.response(struct.pack("<Q", 64))))
    assert take(other.to_client) == encode.response(struct.pack("<Q", 64))
