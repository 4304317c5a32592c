"""Session: HELLO rules, the response FIFO, state learning, refusals; vectors whole/bytewise/trailing."""

from __future__ import annotations

import struct
import threading

import pytest

from rpcguard.errors import PolicyRefusal, ProtocolRefusal, Refusal
from rpcguard.protocol import encode
from rpcguard.protocol.session import (
    Active, Deferred, Hello, NodeRefused, Session, Violation,
    SessionPolicy,
)
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.state import UpstreamFacts
from tests.support import vectors as V


def out(chunks) -> bytes:
    data = b"".join(bytes(c) for c in chunks)
    chunks.clear()
    return data


def feed(fn, data: bytes, how: str) -> None:
    for _, chunks in [r for r in V.runs(data) if r[0] == how]:
        for c in chunks:
            fn(memoryview(bytearray(c)))


GIB = 1 << 30
CLEAR_REQ = encode.request("BUFFER_CLEAR", struct.pack("<QB", V.HANDLE, 0))


def active(version=(7, 0, 0), devices=1, policy=None, memory: int | None = 64 * GIB) -> Session:
    """A session after HELLO whose upstream facts are known (memory None: device memory unknown)."""
    known = {} if memory is None else {d: (memory, memory) for d in range(devices)}
    s = Session(policy, UpstreamFacts(device_count=devices, version=version, memory=known))
    s.client_data(memoryview(encode.hello_request(version)))
    s.server_data(memoryview(encode.hello_response(version)))
    out(s.to_server), out(s.to_client)
    assert s.greeted and [type(e) for e in s.out.events] == [Hello, Active]
    s.out.events.clear()
    return s


@pytest.mark.parametrize("how", ["whole", "bytewise"])
def test_hello_exchange_forwards_unchanged(how):
    s = Session(upstream=UpstreamFacts(device_count=1))
    feed(s.client_data, V.HELLO_REQ_V4, how)
    assert out(s.to_server) == V.HELLO_REQ_V4 and s.hello_request_len == 24 and not s.greeted
    feed(s.server_data, V.HELLO_RSP_700, how)
    assert out(s.to_client) == V.HELLO_RSP_700
    assert s.greeted and s.version == (7, 0, 0)


def test_rdma_caps_zeroed_both_directions():
    s = Session(upstream=UpstreamFacts(device_count=1))
    s.client_data(memoryview(V.HELLO_REQ_RDMA))
    assert out(s.to_server) == V.HELLO_REQ_V4
    caps = bytes(range(1, 25))
    s.server_data(memoryview(encode.hello_response((7, 0, 0), caps=caps)))
    assert out(s.to_client) == V.HELLO_RSP_700
    assert s.stats.rdma_caps_zeroed_req == 1 and s.stats.rdma_caps_zeroed_rsp == 1


def test_old_era_hello():
    s = Session(upstream=UpstreamFacts(device_count=1))
    s.client_data(memoryview(V.HELLO_REQ_V1))
    s.server_data(memoryview(V.HELLO_RSP_361))
    assert s.version == (3, 6, 1) and out(s.to_client) == V.HELLO_RSP_361


@pytest.mark.parametrize("frame,reason", [
    (V.DEVICE_COUNT_REQ, "first_frame_not_hello"),
    (encode.request("HELLO", bytes(5)), "hello_bad_size"),
])
def test_bad_first_frame(frame, reason):
    with pytest.raises(ProtocolRefusal) as e:
        Session().client_data(memoryview(frame))
    assert e.value.reason == reason


def test_data_before_hello_reply_and_second_hello():
    s = Session()
    with pytest.raises(ProtocolRefusal) as e:
        s.client_data(memoryview(V.HELLO_REQ_V4 + V.DEVICE_COUNT_REQ))
    assert e.value.reason == "data_before_hello_reply"
    s = active()
    with pytest.raises(ProtocolRefusal) as e:
        s.client_data(memoryview(V.HELLO_REQ_V4))
    assert e.value.reason == "hello_repeated"


@pytest.mark.parametrize("version,accepted,expect", [
    ((7, 0, 0), None, None),
    ((7, 0, 0), {(5, 0, 0)}, "version_not_accepted"),
    ((6, 0, 1), None, "version_not_accepted"),  # unknown to this build (6.0.0 is known: issue 27)
    ((5, 2, 0), None, "version_not_accepted"),  # a fork's number
])
def test_version_policy(version, accepted, expect):
    policy = SessionPolicy(accepted_versions=frozenset(accepted)) if accepted else None
    s = Session(policy, UpstreamFacts(device_count=1))
    s.client_data(memoryview(V.HELLO_REQ_V4))
    if expect is None:
        s.server_data(memoryview(encode.hello_response(version)))
        assert s.greeted
    else:
        with pytest.raises(PolicyRefusal) as e:
            s.server_data(memoryview(encode.hello_response(version)))
        assert e.value.reason == expect and out(s.to_client) == b""


def test_refusal_answer_matches_the_clients_hello_era():
    s = Session()
    s.client_data(memoryview(V.HELLO_REQ_V4))
    ans = s.refusal_answer("upstream_busy")
    assert ans == encode.response(bytes([0, 0, 6, 0]) + bytes(24))
    s = Session()
    s.client_data(memoryview(V.HELLO_REQ_V1))
    assert s.refusal_answer("nonsense") == encode.response(bytes([0, 0, 1]))


def test_node_refusal_is_passed_through_and_decoded():
    s = Session()
    s.client_data(memoryview(V.HELLO_REQ_V4))
    o = s.server_data(memoryview(encode.hello_response((0, 0, 3), new_layout=True)))
    assert s.node_refusal == "identity_not_allowed"
    assert NodeRefused("identity_not_allowed") in o.events and not s.greeted
    assert out(s.to_client) == encode.response(bytes([0, 0, 3, 0]) + bytes(24))


@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
def test_feeding_returns_the_output_with_what_happened(how):
    """client_data/server_data return what to send each way and the events of the call: the relay
    reads one list instead of polling attributes, and the data path adds no event."""
    s = Session(upstream=UpstreamFacts(version=(7, 0, 0), device_count=1, memory={0: (GIB, GIB)}))
    trailing = V.DEVICE_COUNT_REQ[:4] if how == "trailing" else b""
    for _, chunks in [r for r in V.runs(V.HELLO_REQ_V4, trailing) if r[0] == ("bytewise" if how == "bytewise" else "whole")]:
        for c in chunks:
            o = s.client_data(memoryview(bytearray(c)))
    assert o is s.out and o.to_server is s.to_server and o.to_client is s.to_client
    assert o.events == [Hello(24)] and out(o.to_server) == V.HELLO_REQ_V4
    o.events.clear()
    o = s.server_data(memoryview(V.HELLO_RSP_700))
    assert o.events == [Active((7, 0, 0))] and out(o.to_client) == V.HELLO_RSP_700
    o.clear()
    if not trailing:
        o = s.client_data(memoryview(V.DEVICE_COUNT_REQ))
        assert out(o.to_server) == V.DEVICE_COUNT_REQ and o.events == []


def test_every_command_has_one_row_whose_parts_exist():
    from rpcguard.protocol import commands
    from rpcguard.protocol.versions import COMMAND_NAMES, KNOWN_VERSIONS, NO_RESPONSE, spec_for

    # (that each check is a RequestChecks method and each learner takes its effect's context is
    # mypy's: commands.row)
    assert list(commands.ROWS) == list(COMMAND_NAMES)
    for version in KNOWN_VERSIONS:
        for rule in spec_for(version).commands:
            if rule is None:
                continue
            row = commands.ROWS[rule.name]
            # a learner needs an exactly sized response, and what its request effect decoded
            if row.learn is not None:
                assert rule.response >= 0, rule
                assert row.effect is not None or rule.name == "DEVICE_COUNT", rule
            if rule.response == NO_RESPONSE:
                assert row.learn is None
    assert len(commands.EFFECTS) == len(commands.LEARNERS) == len(commands.CHECKS) == len(COMMAND_NAMES)
    assert len(commands.CACHEABLE) == len(COMMAND_NAMES)


@pytest.mark.parametrize("how", ["whole", "bytewise"])
def test_alloc_and_base_are_learned(how):
    s = active()
    feed(s.client_data, V.ALLOC_REQ_1MIB, how)
    feed(s.server_data, V.ALLOC_RSP, how)
    feed(s.client_data, V.GET_BASE_REQ, how)
    feed(s.server_data, V.GET_BASE_RSP, how)
    buf = s.state.buffers[V.HANDLE]
    assert (buf.size, buf.base, buf.device) == (1 << 20, V.BASE, 0)
    assert s.stats.alloc_bytes == 1 << 20
    assert out(s.to_server) == V.ALLOC_REQ_1MIB + CLEAR_REQ + V.GET_BASE_REQ  # clear_new_buffers by default
    assert out(s.to_client) == V.ALLOC_RSP + V.GET_BASE_RSP
    s.client_data(memoryview(V.FREE_REQ))
    assert V.HANDLE not in s.state.buffers and s.idle  # 7.0.0: FREE_BUFFER has no response


def test_failed_alloc_learns_nothing():
    s = active()
    s.client_data(memoryview(V.ALLOC_REQ_1MIB))
    s.server_data(memoryview(V.ALLOC_RSP_FAILED))
    assert s.state.buffers == {}


def test_response_fifo_and_size_checks():
    s = active()
    with pytest.raises(ProtocolRefusal) as e:
        s.server_data(memoryview(V.GET_ALIGNMENT_RSP_32))
    assert e.value.reason == "response_unexpected"
    s = active()
    s.client_data(memoryview(V.GET_ALIGNMENT_REQ))
    with pytest.raises(ProtocolRefusal) as e:
        s.server_data(memoryview(V.DEVICE_COUNT_RSP_2))
    assert e.value.reason == "response_size_invalid"


@pytest.mark.parametrize("frame,reason", [
    (encode.request(99), "command_unknown"),
    (encode.request("GET_ALIGNMENT", bytes(8)), "frame_size_invalid"),
    (encode.request("SET_TENSOR", bytes(10)), "frame_size_invalid"),
    (encode.request("GRAPH_COMPUTE", b"", length=1 << 40), "request_too_large"),
    (encode.request("SET_TENSOR", b"", length=1 << 40), "request_too_large"),
])
def test_frame_rules(frame, reason):
    s = active()
    with pytest.raises(Refusal) as e:
        s.client_data(memoryview(frame))
    assert e.value.reason == reason and out(s.to_server) == b""


def test_allow_list_enforce_and_monitor():
    allowed = frozenset({"HELLO", "DEVICE_COUNT", "GET_ALIGNMENT"})
    s = active(policy=SessionPolicy(allowed_commands=allowed))
    with pytest.raises(PolicyRefusal):
        s.client_data(memoryview(V.ALLOC_REQ_1MIB))
    s = active(policy=SessionPolicy(allowed_commands=allowed, mode="monitor"))
    s.client_data(memoryview(V.ALLOC_REQ_1MIB))
    assert out(s.to_server) == V.ALLOC_REQ_1MIB
    assert [v.reason for v in s.violations] == ["command_not_allowed"]
    assert [(type(v), v.reason) for v in s.out.events] == [(Violation, "command_not_allowed")]


def test_device_count_is_learned_by_injection_when_unknown():
    s = Session()
    s.client_data(memoryview(V.HELLO_REQ_V4))
    out(s.to_server)
    s.server_data(memoryview(V.HELLO_RSP_700))
    assert out(s.to_server) == V.DEVICE_COUNT_REQ  # injected
    s.server_data(memoryview(V.DEVICE_COUNT_RSP_2))
    assert s.state.upstream.device_count == 2
    # Then the memory of each device: the default allocation quota.
    # and the alignment of each: it tells the backend (protocol/backend.py), and is this session's own
    assert out(s.to_server) == encode.request("GET_DEVICE_MEMORY", struct.pack("<I", 0)) + encode.request(
        "GET_DEVICE_MEMORY", struct.pack("<I", 1)) + encode.request("GET_ALIGNMENT", struct.pack("<I", 0)) + \
        encode.request("GET_ALIGNMENT", struct.pack("<I", 1))
    s.server_data(memoryview(encode.response(struct.pack("<QQ", 5, 6))))
    s.server_data(memoryview(encode.response(struct.pack("<QQ", 7, 8))))
    s.server_data(memoryview(encode.response(struct.pack("<Q", 128)) + encode.response(struct.pack("<Q", 32))))
    assert out(s.to_client) == V.HELLO_RSP_700  # the injected answers are swallowed
    assert s.state.upstream.memory == {0: (5, 6), 1: (7, 8)} and s.idle
    assert s.state.upstream.alignment == {0: 128, 1: 32}


def test_get_tensor_response_is_streamed():
    s = active()
    s.state.add_buffer(V.HANDLE, 0, 1 << 20)
    s.state.buffers[V.HANDLE].base = V.BASE
    t = encode.TensorSpec(buffer=V.HANDLE, data=V.BASE, ne=(4096, 1, 1, 1))
    s.client_data(memoryview(encode.request("GET_TENSOR", encode.pack_tensor(t) + struct.pack("<QQ", 0, 16384))))
    payload = bytes(range(256)) * 64
    rsp = encode.response(payload)
    for i in range(0, len(rsp), 1000):
        s.server_data(memoryview(rsp[i:i + 1000]))
    assert out(s.to_client) == rsp and s.idle


def test_latency_is_measured_request_to_response():
    s = active()
    s.client_data(memoryview(V.GET_ALIGNMENT_REQ), now_ns=1_000)
    s.server_data(memoryview(V.GET_ALIGNMENT_RSP_32), now_ns=301_000)
    assert s.stats.lat_sum_ns[1] == 300_000 and s.stats.lat_count[1] == 1
    assert s.state.upstream.alignment[0] == 32


# A contained serve gives each identity its own -c cache: only there does SET_TENSOR_HASH reach the server.
OWN_CACHE = SessionPolicy(clear_new_buffers=False, firewall=FirewallPolicy(contained=True))


def test_hash_hit_counts_the_tensor_bytes_the_cache_saved():
    s = active(policy=OWN_CACHE)
    s.state.add_buffer(V.HANDLE, 0, 1 << 24)
    s.state.buffers[V.HANDLE].base = V.BASE
    t = encode.TensorSpec(buffer=V.HANDLE, data=V.BASE, ne=(1 << 20, 1, 1, 1))  # 4 MiB of f32
    frame = encode.request("SET_TENSOR_HASH", encode.pack_tensor(t) + struct.pack("<QQ", 0, 0xFEED))
    s.client_data(memoryview(frame))
    s.server_data(memoryview(encode.response(b"\x01")))
    s.client_data(memoryview(frame))
    s.server_data(memoryview(encode.response(b"\x00")))  # a miss: the client sends SET_TENSOR next
    assert s.stats.upload_bytes_hash_hit == 4 << 20


@pytest.mark.parametrize("version,clear_response", [((7, 0, 0), None), ((5, 0, 0), b"")])
def test_clear_new_buffers_injects_a_clear_before_the_client_can_read(version, clear_response):
    s = active(version=version, policy=SessionPolicy(clear_new_buffers=True))
    s.client_data(memoryview(V.ALLOC_REQ_1MIB))
    s.server_data(memoryview(V.ALLOC_RSP))
    assert out(s.to_server) == V.ALLOC_REQ_1MIB + encode.request("BUFFER_CLEAR", struct.pack("<QB", V.HANDLE, 0))
    assert out(s.to_client) == V.ALLOC_RSP
    s.client_data(memoryview(V.GET_BASE_REQ))
    if clear_response is not None:  # <= 5.x answers BUFFER_CLEAR with an empty frame: swallowed
        s.server_data(memoryview(encode.response(clear_response)))
    s.server_data(memoryview(V.GET_BASE_RSP))
    assert out(s.to_client) == V.GET_BASE_RSP and s.idle


# -- allocation quota ----------------------------------------------------------------------------


def alloc_req(size: int, device: int = 0) -> bytes:
    return encode.request("ALLOC_BUFFER", struct.pack("<IQ", device, size))


def alloc_rsp(handle: int, size: int) -> bytes:
    return encode.response(struct.pack("<QQ", handle, size))


NO_CLEAR = SessionPolicy(clear_new_buffers=False)


def test_alloc_quota_is_the_device_total_and_free_gives_it_back():
    s = active(policy=NO_CLEAR, memory=3 << 20)
    for h in (1, 2, 3):
        s.client_data(memoryview(alloc_req(1 << 20)))
        s.server_data(memoryview(alloc_rsp(h, 1 << 20)))
    assert s.state.alloc_total == 3 << 20
    with pytest.raises(Refusal) as e:
        s.client_data(memoryview(alloc_req(1)))
    assert e.value.reason == "alloc_quota_exceeded" and out(s.to_server) == alloc_req(1 << 20) * 3
    s = active(policy=NO_CLEAR, memory=3 << 20)
    for h in (1, 2, 3):
        s.client_data(memoryview(alloc_req(1 << 20)))
        s.server_data(memoryview(alloc_rsp(h, 1 << 20)))
    s.client_data(memoryview(encode.request("FREE_BUFFER", struct.pack("<Q", 2))))
    s.client_data(memoryview(alloc_req(1 << 20)))  # the freed MiB is available again
    assert s.state.alloc_total == 3 << 20


def test_failed_alloc_is_refunded_and_pipelined_allocs_are_counted_before_their_answer():
    s = active(policy=NO_CLEAR, memory=2 << 20)
    s.client_data(memoryview(alloc_req(2 << 20)))
    s.server_data(memoryview(alloc_rsp(0, 0)))  # the server could not allocate
    assert s.state.alloc_total == 0
    s.client_data(memoryview(alloc_req(1 << 20)))
    s.client_data(memoryview(alloc_req(1 << 20)))  # sent before the first answer: still counted
    with pytest.raises(Refusal) as e:
        s.client_data(memoryview(alloc_req(1 << 20)))
    assert e.value.reason == "alloc_quota_exceeded"


def test_explicit_session_quota_covers_all_devices():
    from rpcguard.protocol.firewall import FirewallPolicy

    policy = SessionPolicy(clear_new_buffers=False, firewall=FirewallPolicy(max_session_alloc_bytes=3 << 20))
    s = active(devices=2, policy=policy)
    s.client_data(memoryview(alloc_req(2 << 20, 0)))
    with pytest.raises(Refusal) as e:
        s.client_data(memoryview(alloc_req(2 << 20, 1)))
    assert e.value.reason == "alloc_quota_exceeded"


def test_unknown_device_memory_is_asked_and_allocs_sent_before_the_answer_are_held_to_it():
    s = Session(NO_CLEAR, UpstreamFacts(device_count=1, version=(7, 0, 0)))
    s.client_data(memoryview(encode.hello_request((7, 0, 0))))
    out(s.to_server)
    s.server_data(memoryview(encode.hello_response((7, 0, 0))))
    assert out(s.to_server) == encode.request("GET_DEVICE_MEMORY", struct.pack("<I", 0))
    s.client_data(memoryview(alloc_req(4 << 20)))  # before the answer: no quota known yet
    assert out(s.to_server) == alloc_req(4 << 20)
    with pytest.raises(Refusal) as e:
        s.server_data(memoryview(encode.response(struct.pack("<QQ", 1 << 20, 2 << 20))))  # total 2 MiB
    assert e.value.reason == "alloc_quota_exceeded"


def test_alloc_quota_in_monitor_mode_is_a_violation():
    s = active(policy=SessionPolicy(clear_new_buffers=False, mode="monitor"), memory=1 << 20)
    s.client_data(memoryview(alloc_req(2 << 20)))
    assert out(s.to_server) == alloc_req(2 << 20)
    assert [v.reason for v in s.violations] == ["alloc_quota_exceeded"]


# -- SET_TENSOR cache_flag -------------------------------------------------------------------------

BIG = (10 << 20) + 4  # just above HASH_THRESHOLD


def cache_session() -> tuple[Session, bytes]:
    s = active(policy=OWN_CACHE)
    s.state.add_buffer(V.HANDLE, 0, 1 << 26)
    s.state.set_base(V.HANDLE, V.BASE)
    t = encode.pack_tensor(encode.TensorSpec(buffer=V.HANDLE, data=V.BASE, ne=(BIG // 4, 1, 1, 1)))
    return s, t


def set_tensor(t: bytes, flag: int, size: int = BIG, offset: int = 0) -> bytes:
    return encode.request("SET_TENSOR", t + bytes([flag]) + struct.pack("<Q", offset) + bytes(size))


def hash_req(t: bytes, offset: int = 0) -> bytes:
    return encode.request("SET_TENSOR_HASH", t + struct.pack("<QQ", offset, 0xFEED))


def test_cache_flag_only_after_a_hash_miss_of_that_tensor_and_only_once():
    s, t = cache_session()
    s.client_data(memoryview(hash_req(t)))
    s.server_data(memoryview(encode.response(b"\x00")))  # miss
    s.client_data(memoryview(set_tensor(t, 1)))  # what the real client sends next
    assert s.idle
    with pytest.raises(Refusal) as e:
        s.client_data(memoryview(set_tensor(t, 1)))  # the miss was used
    assert e.value.reason == "set_tensor_cache_flag_invalid"


@pytest.mark.parametrize("case", ["no_hash", "hit", "other_offset", "small"])
def test_cache_flag_refused_when_the_client_would_not_send_it(case):
    s, t = cache_session()
    if case != "no_hash":
        s.client_data(memoryview(hash_req(t)))
        s.server_data(memoryview(encode.response(b"\x01" if case == "hit" else b"\x00")))
    frame = set_tensor(t, 1, offset=4 if case == "other_offset" else 0,
                       size=(10 << 20) if case == "small" else BIG - (4 if case == "other_offset" else 0))
    with pytest.raises(Refusal) as e:
        s.client_data(memoryview(frame))
    assert e.value.reason == "set_tensor_cache_flag_invalid"
    s, t = cache_session()
    s.client_data(memoryview(set_tensor(t, 0)))  # cache_flag=0 is always fine


def test_absurd_device_count_does_not_flood_the_server_with_memory_probes():
    s = Session(NO_CLEAR, UpstreamFacts())
    s.client_data(memoryview(V.HELLO_REQ_V4))
    s.server_data(memoryview(V.HELLO_RSP_700))
    out(s.to_server)
    s.server_data(memoryview(encode.response(struct.pack("<I", 0xFFFFFFFF))))  # DEVICE_COUNT answer
    probes = out(s.to_server)
    assert len(probes) == 2 * 16 * 13  # MEMORY_PROBES_MAX GET_DEVICE_MEMORY and GET_ALIGNMENT frames of 9 + 4 bytes


# -- padded allocation sizes ------------------------------------------------------------------------


@pytest.mark.parametrize("answer_extra,refused", [(0, False), (34 * 352 // 32, True)])
def test_init_tensor_is_held_to_the_padded_size_the_server_answered(answer_extra, refused):
    """CUDA pads quantized rows (ne0 % 512): its init_tensor zeroes up to GET_ALLOC_SIZE's answer,
    past nbytes. A tensor whose nbytes ends at the buffer end but whose padding does not fit is
    refused once the server has said it pads that shape."""
    s = active(policy=NO_CLEAR)
    s.state.add_buffer(V.HANDLE, 0, 1 << 20)
    s.state.set_base(V.HANDLE, V.BASE)
    q8 = encode.TensorSpec(type=8, ne=(160, 4, 1, 1), type_size=34, blck_size=32, buffer=V.HANDLE)
    n = 34 * 160 // 32 * 4
    q8.data = V.BASE + (1 << 20) - n  # nbytes ends exactly at the buffer end
    free = encode.TensorSpec(type=8, ne=(160, 4, 1, 1), type_size=34, blck_size=32)  # buffer 0: default buft
    s.client_data(memoryview(encode.request("GET_ALLOC_SIZE", struct.pack("<I", 0) + encode.pack_tensor(free)
                                            + bytes(10 * 296))))
    s.server_data(memoryview(encode.response(struct.pack("<Q", n + answer_extra))))
    frame = encode.request("INIT_TENSOR", encode.pack_tensor(q8))
    if refused:
        with pytest.raises(Refusal) as e:
            s.client_data(memoryview(frame))
        assert e.value.reason == "tensor_out_of_buffer" and "padded size" in e.value.detail
    else:
        s.client_data(memoryview(frame))


# ----------------------------------------------------------------------------- urgency (Output.urgent)
def small_set(t: bytes, size: int = 64) -> bytes:
    return encode.request("SET_TENSOR", t + bytes([0]) + struct.pack("<Q", 0) + bytes(size))


def urgency_session() -> tuple[Session, bytes]:
    s = active(policy=NO_CLEAR)
    s.state.add_buffer(V.HANDLE, 0, 1 << 26)
    s.state.set_base(V.HANDLE, V.BASE)
    return s, encode.pack_tensor(encode.TensorSpec(buffer=V.HANDLE, data=V.BASE, ne=(16, 1, 1, 1)))


@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
def test_set_tensor_alone_is_not_urgent_and_any_frame_with_an_answer_is(how):
    s, t = urgency_session()
    sets = small_set(t) * 3
    for run_how, chunks in V.runs(sets, trailing=encode.request("GET_ALIGNMENT", bytes(4))[:5]):
        if run_how != how:
            continue
        for c in chunks:
            s.client_data(memoryview(bytearray(c)))
            assert not s.out.urgent, "SET_TENSOR frames (and a partial header) may wait"
    assert out(s.to_server).startswith(sets)
    s, t = urgency_session()
    get = encode.request("GET_TENSOR", t + struct.pack("<QQ", 0, 64))
    s.client_data(memoryview(bytearray(small_set(t) + get)))
    assert s.out.urgent and out(s.to_server) == small_set(t) + get


def test_a_set_tensor_above_the_batch_limit_is_urgent_in_every_read():
    from rpcguard.protocol.commands import BATCH_MAX_BYTES

    s, t = urgency_session()
    t = encode.pack_tensor(encode.TensorSpec(buffer=V.HANDLE, data=V.BASE, ne=(BATCH_MAX_BYTES // 4, 1, 1, 1)))
    big = encode.request("SET_TENSOR", t + bytes(1) + struct.pack("<Q", 0) + bytes(BATCH_MAX_BYTES))
    for at in range(0, len(big), 4096):  # a model load's tensor, read by read
        s.client_data(memoryview(bytearray(big[at : at + 4096])))
        assert s.out.urgent, at
    assert out(s.to_server) == big
    s.client_data(memoryview(bytearray(small_set(urgency_session()[1]))))
    assert not s.out.urgent  # the next small one may wait again


def test_a_frame_keeps_its_urgency_until_it_is_whole():
    s, t = urgency_session()
    get = encode.request("GET_TENSOR", t + struct.pack("<QQ", 0, 64))
    s.client_data(memoryview(bytearray(get[:9])))  # planned: urgent, nothing forwarded yet
    assert s.out.urgent and not s.to_server
    s.client_data(memoryview(bytearray(get[9:])))
    assert s.out.urgent and out(s.to_server) == get
    s.client_data(memoryview(bytearray(small_set(t))))  # a new frame at a boundary: not urgent
    assert not s.out.urgent


def test_injected_frames_are_urgent():
    s = active()  # the default policy clears each new buffer: the proxy injects a BUFFER_CLEAR
    s.state.add_buffer(V.HANDLE, 0, 1 << 26)
    s.state.set_base(V.HANDLE, V.BASE)
    t = encode.pack_tensor(encode.TensorSpec(buffer=V.HANDLE, data=V.BASE, ne=(16, 1, 1, 1)))
    s.client_data(memoryview(bytearray(alloc_req(1 << 20))))
    out(s.to_server)
    s.client_data(memoryview(bytearray(small_set(t))))
    assert not s.out.urgent
    new = V.HANDLE + (1 << 26)
    s.server_data(memoryview(bytearray(alloc_rsp(new, 1 << 20))))
    clear = encode.request("BUFFER_CLEAR", struct.pack("<QB", new, 0))
    assert s.out.urgent and out(s.to_server).endswith(clear)


def test_requests_left_to_the_node_skip_the_firewall_but_not_framing_or_the_allow_list():
    s, t = urgency_session()
    bad = encode.request("SET_TENSOR", t + bytes(1) + struct.pack("<Q", 1 << 20) + bytes(64))  # past the tensor
    with pytest.raises(Refusal) as refused:
        s.client_data(memoryview(bytearray(bad)))
    assert refused.value.reason == "range_out_of_tensor"

    s, t = urgency_session()
    s.leave_requests_to_node()
    assert s.requests_checked_by == "node"
    s.client_data(memoryview(bytearray(bad)))
    assert out(s.to_server) == bad  # the node's serve refuses it (tests/integration/test_pair_checks.py)
    with pytest.raises(ProtocolRefusal) as refused:
        s.client_data(memoryview(bytearray(encode.request("SET_TENSOR", t[:100]))))
    assert refused.value.reason == "frame_size_invalid"

    s = active(policy=SessionPolicy(allowed_commands=frozenset({"HELLO", "GET_ALIGNMENT"})))
    s.leave_requests_to_node()
    with pytest.raises(PolicyRefusal) as refused:
        s.client_data(memoryview(bytearray(V.DEVICE_COUNT_REQ)))
    assert refused.value.reason == "command_not_allowed"


def test_the_post_mortem_ring_keeps_the_last_request_heads_only_when_asked():
    quiet, s = active(), active()
    s.record_recent()
    frame = encode.request("GET_ALIGNMENT", struct.pack("<I", 0))
    for sess in (quiet, s):
        for _ in range(20):
            sess.client_data(memoryview(frame))
            out(sess.to_server)
    assert not quiet.recent and quiet.post_mortem() == {"last_requests": [], "last_graph": None}
    pm = s.post_mortem()
    assert pm["last_requests"] == [["GET_ALIGNMENT", 4]] * 16 and pm["last_graph"] is None


def test_the_post_mortem_has_the_last_graphs_digest():
    import zlib

    from rpcguard.protocol.settings import SessionPolicy
    s = active(policy=SessionPolicy(mode="monitor"))
    s.record_recent()
    graph = struct.pack("<III", 0, 0, 0)  # device 0, no nodes, no tensors
    s.client_data(memoryview(encode.request("GRAPH_COMPUTE", graph)))
    out(s.to_server)
    pm = s.post_mortem()
    assert pm["last_requests"] == [["GRAPH_COMPUTE", 12]]
    assert pm["last_graph"] == {"bytes": 12, "crc32": f"{zlib.crc32(graph):08x}"}


# ----------------------------------------------------------------------------- large graphs
def graph_session(policy=None) -> Session:
    """Active, with the test buffer (V.HANDLE at V.BASE, 1 MiB) allocated and its base known."""
    s = active(policy=policy)
    for request, answer in [(V.ALLOC_REQ_1MIB, V.ALLOC_RSP), (V.GET_BASE_REQ, V.GET_BASE_RSP)]:
        s.client_data(memoryview(request))
        s.server_data(memoryview(answer))
    out(s.to_server), out(s.to_client)
    return s


def graph_frame(bad: bool = False) -> bytes:
    from tests.support.floods import chain_graph
    payload, _ = chain_graph(V.HANDLE, V.BASE + (1 << 30 if bad else 0), 40)  # bad: outside the buffer
    return encode.request("GRAPH_COMPUTE", bytes(payload))


@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
def test_a_large_graph_waits_for_its_validation_and_what_follows_keeps_its_order(how):
    s = graph_session()
    s.defer_graphs(from_bytes=1024)
    graph = graph_frame()
    stream = V.GET_ALIGNMENT_REQ + graph + V.DEVICE_COUNT_REQ
    for _, chunks in [r for r in V.runs(stream, trailing=V.GET_ALIGNMENT_REQ) if r[0] == how]:
        for c in chunks:
            s.client_data(memoryview(bytearray(c)))
    assert out(s.to_server) == V.GET_ALIGNMENT_REQ  # the graph and what follows wait
    assert s.deferred and s.out.events == [Deferred(len(graph) - 9)]
    s.out.events.clear()
    worker = threading.Thread(target=s.validate_deferred)  # as the relay does: another thread
    worker.start()
    worker.join()
    s.resume_deferred()
    assert not s.deferred and s.out.urgent
    assert out(s.to_server) == graph + V.DEVICE_COUNT_REQ + (V.GET_ALIGNMENT_REQ if how == "trailing" else b"")
    s.server_data(memoryview(V.GET_ALIGNMENT_RSP_32))  # the FIFO holds the frames in their order
    assert out(s.to_client) == V.GET_ALIGNMENT_RSP_32


def test_a_small_graph_is_validated_at_once_and_a_large_one_refused_after_its_validation():
    s = graph_session()
    s.defer_graphs(from_bytes=len(graph_frame()) - 9)  # the 40-node graph's payload: deferred; 39 nodes: not
    small = encode.request("GRAPH_COMPUTE", bytes(chain_graph_payload(39)))
    s.client_data(memoryview(small))
    assert out(s.to_server) == small and not s.deferred and not s.out.events
    s.client_data(memoryview(graph_frame(bad=True) + V.GET_ALIGNMENT_REQ))
    assert s.deferred and out(s.to_server) == b""
    s.validate_deferred()
    with pytest.raises(Refusal) as e:
        s.resume_deferred()
    assert e.value.reason == "tensor_out_of_buffer" and out(s.to_server) == b""  # nothing of it went out


def test_monitor_mode_forwards_a_large_refused_graph_with_a_violation():
    s = graph_session(SessionPolicy(mode="monitor"))
    s.defer_graphs(from_bytes=1024)
    bad = graph_frame(bad=True)
    s.client_data(memoryview(bad))
    s.out.events.clear()
    s.validate_deferred()
    s.resume_deferred()
    assert out(s.to_server) == bad and [type(e) for e in s.out.events] == [Violation]


def chain_graph_payload(nodes: int) -> bytes:
    from tests.support.floods import chain_graph
    return bytes(chain_graph(V.HANDLE, V.BASE, nodes)[0])
