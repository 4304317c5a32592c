"""GET_DEVICE_SUPPORTS_OP (command 19, protocol 7.0.1): its row, its firewall check, the proxy's
own answer for ops never forwarded, the answers learnt per session; frames whole, byte by byte and
followed by another frame (ggml-org/llama.cpp@02d1e60c ggml-rpc.cpp: rpc_msg_get_device_supports_op_req,
rpc_server::get_device_supports_op)."""

from __future__ import annotations

import struct

import pytest

from rpcguard.errors import FirewallRefusal, ProtocolRefusal, Refusal
from rpcguard.protocol import encode
from rpcguard.protocol.firewall import Firewall, FirewallPolicy
from rpcguard.protocol.graph import op_rules
from rpcguard.protocol.session import Session, SessionPolicy
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.versions import COMMAND_IDS, KNOWN_VERSIONS, spec_for
from tests.support import vectors as V

V701, V700 = (7, 0, 1), (7, 0, 0)
CMD = COMMAND_IDS["GET_DEVICE_SUPPORTS_OP"]
OPS = op_rules(V701)
assert OPS is not None
MUL_MAT, ADD, CONCAT = OPS.names.index("MUL_MAT"), OPS.names.index("ADD"), OPS.names.index("CONCAT")
FLASH_ATTN_BACK, CUSTOM = OPS.names.index("FLASH_ATTN_BACK"), OPS.names.index("CUSTOM")
SSM_SCAN = OPS.names.index("SSM_SCAN")
NO_CLEAR = SessionPolicy(clear_new_buffers=False)
TRAILING = V.DEVICE_COUNT_REQ  # the next frame, in the same read


def T(id: int = 0x1000, buffer: int = 0, ne=(4, 4, 1, 1), op: int = 0, type: int = 0) -> bytes:
    return encode.pack_tensor(encode.TensorSpec(id=id, type=type, buffer=buffer, data=V.BASE if buffer else 0,
                                                ne=ne, op=op))


def query(op: int = MUL_MAT, srcs: tuple[bytes, ...] = (), device: int = 0, ne=(4, 4, 1, 1)) -> bytes:
    """A supports_op payload as ggml_backend_rpc_device_supports_op serializes one (srcs of id 0: none)."""
    if not srcs and op in (MUL_MAT, ADD, CONCAT):
        srcs = (T(0x2000, buffer=V.HANDLE), T(0x3000))  # a weight in a buffer of the session, an input
    padded = list(srcs) + [bytes(296)] * (10 - len(srcs))
    return struct.pack("<I", device) + T(0x1000, ne=ne, op=op) + b"".join(padded)


def frame(payload: bytes) -> bytes:
    return encode.request("GET_DEVICE_SUPPORTS_OP", payload)


def session(version=V701, devices: int = 1, policy: SessionPolicy = NO_CLEAR) -> Session:
    s = Session(policy, UpstreamFacts(version=version, device_count=devices,
                                      memory={d: (1 << 30, 1 << 30) for d in range(devices)}))
    s.client_data(memoryview(encode.hello_request(version)))
    s.server_data(memoryview(encode.hello_response(version)))
    assert s.greeted
    s.state.add_buffer(V.HANDLE, 0, 1 << 20)
    s.state.set_base(V.HANDLE, V.BASE)
    s.to_server.clear(), s.to_client.clear(), s.out.events.clear()
    return s


take = V.take


def fed(s: Session, data: bytes, how: str) -> None:
    for kind, chunks in V.runs(data, TRAILING):
        if kind == how:
            for c in chunks:
                s.client_data(memoryview(bytearray(c)))


# -- the table ---------------------------------------------------------------------------------


def test_command_19_exists_in_7_0_1_only():
    rule = spec_for(V701).rule(CMD)  # type: ignore[union-attr]
    assert rule is not None and (rule.request, rule.response, rule.has_device) == (3260, 1, True)
    for v in KNOWN_VERSIONS:
        if v != V701:
            assert spec_for(v).rule(CMD) is None, v  # type: ignore[union-attr]
        assert spec_for(v).rule(18) is None, v  # RPC_CMD_NONE is never sent  # type: ignore[union-attr]


def test_7_0_1_uses_7_0_0_op_ids():
    seven = op_rules(V700)
    assert seven is not None and OPS.names == seven.names and OPS.count == 101


# -- the firewall check ------------------------------------------------------------------------


def state(devices: int = 1) -> SessionState:
    st = SessionState(UpstreamFacts(device_count=devices), spec=spec_for(V701))
    st.add_buffer(V.HANDLE, 0, 1 << 20)
    st.set_base(V.HANDLE, V.BASE)
    return st


def check(payload: bytes, st: SessionState | None = None, **policy) -> None:
    st = st or state()
    Firewall(st, FirewallPolicy(**policy)).check_request(spec_for(V701).rule(CMD), memoryview(payload), 0)  # type: ignore[arg-type,union-attr]


def reason(payload: bytes, **policy) -> str:
    with pytest.raises(FirewallRefusal) as e:
        check(payload, **policy)
    return e.value.reason


def test_valid_queries_pass():
    check(query())
    check(query(ADD))
    check(query(CONCAT, (T(0x2000, ne=(4, 0, 1, 1)), T(0x3000))))  # CONCAT's kernels take an empty source
    check(query(MUL_MAT, ne=(4, 0, 1, 1), srcs=(T(0x2000, ne=(4, 0, 1, 1)), T(0x3000, ne=(4, 0, 1, 1)))))
    check(query(FLASH_ATTN_BACK))  # no rule: answered by the proxy, its sources never reach the server
    check(query(MUL_MAT, (T(0x2000, buffer=0x1234), T(0x3000))))  # another server's buffer: no buffer here


@pytest.mark.parametrize("payload,expected", [
    (query(device=1), "device_out_of_range"),
    (query(MUL_MAT, (T(0x2000),)), "graph_src_missing"),  # src1 missing: the backend reads src1->type
    (query(MUL_MAT, (bytes(296), T(0x3000))), "graph_src_missing"),
    (query(SSM_SCAN, (T(0x2000),) * 3), "graph_src_missing"),  # ggml-cpu.cpp reads SSM_SCAN's src[3]
    (query(ADD, (T(0x2000, ne=(4, 0, 1, 1)), T(0x3000))), "tensor_layout_invalid"),
    (query(101), "graph_op_invalid"),
    (query(0xFFFFFFFF), "graph_op_invalid"),
    (query(MUL_MAT, (T(0x2000, buffer=V.HANDLE, ne=(1 << 20, 1, 1, 1)), T(0x3000))), "tensor_out_of_buffer"),
    (query(MUL_MAT, (T(0x2000, type=4), T(0x3000))), "tensor_type_invalid"),
])
def test_malformed_queries_are_refused(payload, expected):
    assert reason(payload) == expected


def test_op_checks_follow_the_graph_ops_group():
    check(query(101), disabled_checks=frozenset({"graph_ops"}))
    assert reason(query(device=1), disabled_checks=frozenset({"graph_ops"})) == "device_out_of_range"


# -- through a session: whole, byte by byte, with the next frame in the same read ----------------


@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
def test_a_valid_query_is_forwarded_and_its_answer_learnt(how):
    s = session()
    payload = query()
    fed(s, frame(payload), how)
    assert take(s.to_server) == frame(payload) + (TRAILING if how == "trailing" else b"")
    s.server_data(memoryview(encode.response(b"\x01")))
    assert take(s.to_client) == encode.response(b"\x01")
    assert s.state.upstream.supports_op == {(0, MUL_MAT, (0, 0, 0) + (-1,) * 8): True}


@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
@pytest.mark.parametrize("payload,expected", [
    (query(device=1), "device_out_of_range"),
    (query(MUL_MAT, (T(0x2000),)), "graph_src_missing"),
    (query(101), "graph_op_invalid"),
])
def test_malformed_queries_never_reach_the_server(how, payload, expected):
    s = session()
    with pytest.raises(Refusal) as e:
        fed(s, frame(payload), how)
    assert e.value.reason == expected and take(s.to_server) == b""


@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
@pytest.mark.parametrize("op", [FLASH_ATTN_BACK, CUSTOM, SSM_SCAN])
def test_an_op_never_forwarded_is_not_supported_says_the_proxy(how, op):
    # SSM_SCAN: contained only (its state indexes), and this server is not contained
    s = session()
    srcs = tuple(T(0x2000 + i) for i in range(7)) if op == SSM_SCAN else ()
    fed(s, frame(query(op, srcs)), how)
    assert take(s.to_server) == (TRAILING if how == "trailing" else b"")
    assert take(s.to_client) == encode.response(b"\x00")
    assert s.state.upstream.supports_op == {}  # the proxy's answers are not the server's facts


def test_a_contained_server_is_asked_about_a_contained_only_op():
    s = session(policy=SessionPolicy(clear_new_buffers=False, firewall=FirewallPolicy(contained=True)))
    payload = query(SSM_SCAN, tuple(T(0x2000 + i) for i in range(7)))
    s.client_data(memoryview(frame(payload)))
    assert take(s.to_server) == frame(payload)


@pytest.mark.parametrize("answer", [b"\x02", b"\xff"])
def test_an_answer_not_0_or_1_ends_the_session(answer):
    s = session()
    s.client_data(memoryview(frame(query())))
    with pytest.raises(ProtocolRefusal) as e:
        s.server_data(memoryview(encode.response(answer)))
    assert e.value.reason == "response_value_invalid" and e.value.party == "upstream"
    assert take(s.to_client) == b""


def test_an_answer_of_another_size_ends_the_session():
    s = session()
    s.client_data(memoryview(frame(query())))
    with pytest.raises(ProtocolRefusal) as e:
        s.server_data(memoryview(encode.response(b"\x01\x00")))
    assert e.value.reason == "response_size_invalid"


@pytest.mark.parametrize("version", [V700, (5, 1, 0)])
def test_command_19_before_7_0_1_is_unknown(version):
    s = session(version)
    with pytest.raises(ProtocolRefusal) as e:
        s.client_data(memoryview(frame(query())))
    assert e.value.reason == "command_unknown"


def test_the_proxys_answer_waits_for_what_the_server_owes_first():
    """A pipelined GET_TENSOR (streamed answer) then a query the proxy answers: the client gets the
    tensor bytes first, then the proxy's answer, as a server would have sent them."""
    s = session()
    get = encode.request("GET_TENSOR", T(0x5000, buffer=V.HANDLE) + struct.pack("<QQ", 0, 64))
    s.client_data(memoryview(get + frame(query(FLASH_ATTN_BACK))))
    assert take(s.to_client) == b"" and take(s.to_server) == get
    body = encode.response(bytes(range(64)))
    s.server_data(memoryview(body[:20]))
    assert take(s.to_client) == body[:20]  # mid-body: the proxy's answer waits
    s.server_data(memoryview(body[20:]))
    assert take(s.to_client) == body[20:] + encode.response(b"\x00") and s.idle


def test_a_stray_answer_from_the_server_stays_unexpected_around_the_proxys_answer():
    s = session()
    s.server_data(memoryview(encode.response(b"\x01")[:4]))  # half a header nobody asked for
    s.client_data(memoryview(frame(query(FLASH_ATTN_BACK))))
    assert take(s.to_client) == encode.response(b"\x00")  # the proxy's answer, at once
    with pytest.raises(ProtocolRefusal) as e:
        s.server_data(memoryview(encode.response(b"\x01")[4:]))
    assert e.value.reason == "response_unexpected"


# -- the device's backend layer (protocol/supportsop.py): a CUDA device says what CUDA refuses ----

GET_ROWS, DIAG_MASK_ZERO, PAD, SQR = (OPS.names.index(n) for n in ("GET_ROWS", "DIAG_MASK_ZERO", "PAD", "SQR"))
I32 = 26


def S(id: int, ne=(4, 4, 1, 1), nb=None, type: int = 0) -> bytes:
    return encode.pack_tensor(encode.TensorSpec(id=id, type=type, ne=ne, nb=nb, type_size=4))


def layer_query(op: int, srcs: tuple[bytes, ...], ne=(4, 4, 1, 1), device: int = 0) -> bytes:
    return struct.pack("<I", device) + encode.pack_tensor(
        encode.TensorSpec(id=0x1000, ne=ne, op=op)) + b"".join(srcs) + bytes(296) * (10 - len(srcs))


# what each case is on the CUDA layer, and the row it comes from (oprules/cuda.py)
LAYER_CASES = {
    # contained only on CUDA (getrows.cu:23-26 checks no index), this server is not contained
    "get_rows_uncontained": (GET_ROWS, (S(0x2000), S(0x3000, ne=(2, 1, 1, 1), type=I32)), (4, 2, 1, 1)),
    # no CUDA kernel (ggml-cuda.cu:2474-2475, 5728-5729)
    "diag_mask_zero": (DIAG_MASK_ZERO, (S(0x2000),), (4, 4, 1, 1)),
    # SQR on a non-contiguous source (unary.cu:144)
    "sqr_non_contiguous": (SQR, (S(0x2000, nb=(4, 32, 128, 128)),), (4, 4, 1, 1)),
    # PAD launching ne1 = 70000 on grid y (pad.cu:70)
    "pad_grid_y": (PAD, (S(0x2000, ne=(1, 70000, 1, 1)),), (1, 70000, 1, 1)),
}


def layer_session(backend: str, devices: int = 1, alignment=None, contained: bool = False) -> Session:
    s = Session(SessionPolicy(clear_new_buffers=False, firewall=FirewallPolicy(backend=backend, contained=contained)),
                UpstreamFacts(version=V701, device_count=devices, alignment=dict(alignment or {}),
                              memory={d: (1 << 30, 1 << 30) for d in range(devices)}))
    s.client_data(memoryview(encode.hello_request(V701)))
    s.server_data(memoryview(encode.hello_response(V701)))
    s.to_server.clear(), s.to_client.clear(), s.out.events.clear()
    return s


@pytest.mark.parametrize("how", ["whole", "bytewise", "trailing"])
@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_a_cuda_node_says_not_supported_for_what_the_cuda_layer_refuses(case, how):
    op, srcs, ne = LAYER_CASES[case]
    s = layer_session("cuda")
    fed(s, frame(layer_query(op, srcs, ne)), how)
    assert take(s.to_server) == (TRAILING if how == "trailing" else b"")
    assert take(s.to_client) == encode.response(b"\x00")


@pytest.mark.parametrize("case", sorted(LAYER_CASES))
@pytest.mark.parametrize("backend,alignment", [("cpu", {}), ("auto", {}), ("auto", {0: 32})])
def test_a_cpu_node_forwards_the_same_queries(case, backend, alignment):
    op, srcs, ne = LAYER_CASES[case]
    s = layer_session(backend, alignment=alignment)
    payload = layer_query(op, srcs, ne)
    s.client_data(memoryview(frame(payload)))
    assert take(s.to_server) == frame(payload) and take(s.to_client) == b""


@pytest.mark.parametrize("backend,alignment", [("cuda", {}), ("auto", {0: 128})])
def test_a_query_the_cuda_layer_accepts_is_forwarded(backend, alignment):
    s = layer_session(backend, alignment=alignment)
    for payload in (query(), layer_query(SQR, (S(0x2000),))):
        s.client_data(memoryview(frame(payload)))
        assert take(s.to_server) == frame(payload) and take(s.to_client) == b""


def test_a_contained_cuda_node_is_asked_about_get_rows():
    op, srcs, ne = LAYER_CASES["get_rows_uncontained"]
    s = layer_session("cuda", contained=True)
    payload = layer_query(op, srcs, ne)
    s.client_data(memoryview(frame(payload)))
    assert take(s.to_server) == frame(payload)


def test_each_device_answers_from_its_own_layer():
    """Device 0 answered the CPU's alignment, device 1 CUDA's: the same query goes to device 0's
    server and is answered "not supported" for device 1."""
    op, srcs, ne = LAYER_CASES["diag_mask_zero"]
    s = layer_session("auto", devices=2, alignment={0: 32, 1: 128})
    cpu, gpu = layer_query(op, srcs, ne, device=0), layer_query(op, srcs, ne, device=1)
    s.client_data(memoryview(frame(cpu)))
    assert take(s.to_server) == frame(cpu) and take(s.to_client) == b""
    s.server_data(memoryview(encode.response(b"\x01")))  # device 0's server: supported
    assert take(s.to_client) == encode.response(b"\x01")
    s.client_data(memoryview(frame(gpu)))
    assert take(s.to_server) == b"" and take(s.to_client) == encode.response(b"\x00")


def test_a_device_whose_answers_contradict_the_setting_supports_nothing():
    s = layer_session("cuda", alignment={0: 32})  # backend_mismatch: every graph of it is refused
    s.client_data(memoryview(frame(query())))
    assert take(s.to_server) == b"" and take(s.to_client) == encode.response(b"\x00")
