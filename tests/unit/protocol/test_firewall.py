"""Per-command firewall rules (spec §6.2), with the byte vectors of spec §8."""

from __future__ import annotations

import struct

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import TensorSpec, graph_payload, pack_tensor
from rpcguard.protocol.ggml import op_table
from rpcguard.protocol.graph import op_rules
from rpcguard.protocol.firewall import CHECK_NAMES, Firewall, FirewallPolicy
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.versions import COMMAND_NAMES, spec_for

H = bytes.fromhex
HANDLE = 0x00005555DEADBE00
BASE = 0x00007F0000000000
SIZE = 1 << 20
V7, V51 = (7, 0, 0), (5, 1, 0)

# Spec §8 payloads (request header stripped).
ALLOC_1MIB = H("00000000 0000100000000000")
GET_BASE = H("00bead de55550000")
RECOMPUTE_0 = H("00000000")
GET_ALIGNMENT_0 = H("00000000")
GET_DEVICE_MEMORY_1 = H("01000000")
SET_TENSOR_51 = H(
    "0010000000000000 00000000 00beadde55550000 04000000 01000000 01000000 01000000"
    "04000000 10000000 10000000 10000000 00000000"
) + bytes(164) + H("00000000007f0000") + b"x" + bytes(63) + bytes(4) + bytes(8) + struct.pack("<4f", 1, 2, 3, 4)


def state(version=V7, devices: int = 1, base: int | None = BASE) -> SessionState:
    st = SessionState(UpstreamFacts(device_count=devices), spec=spec_for(version))
    st.add_buffer(HANDLE, 0, SIZE)
    st.buffers[HANDLE].base = base
    return st


def T(**kw) -> bytes:
    kw.setdefault("buffer", HANDLE)
    kw.setdefault("data", BASE if kw["buffer"] else 0)
    return pack_tensor(TensorSpec(**kw))


def check(name: str, payload: bytes, body_len: int = 0, st: SessionState | None = None, **policy) -> SessionState:
    st = st or state()
    rule = st.spec.commands[COMMAND_NAMES.index(name)]  # type: ignore[union-attr]
    Firewall(st, FirewallPolicy(**policy)).check_request(rule, memoryview(payload), body_len)
    return st


def reason(name: str, payload: bytes, body_len: int = 0, st: SessionState | None = None, **policy) -> str:
    with pytest.raises(FirewallRefusal) as exc:
        check(name, payload, body_len, st, **policy)
    return exc.value.reason


# -- policy and dispatch --------------------------------------------------------------------


def test_policy_defaults_and_check_names():
    p = FirewallPolicy()
    assert (p.max_graph_nodes, p.max_graph_tensors, p.max_alloc_bytes) == (262144, 1048576, 0)
    assert set(CHECK_NAMES) == {
        "tensor", "buffer_bounds", "graph_structure", "graph_ops", "op_params", "recompute_after_free", "device_index"
    }  # fmt: skip
    with pytest.raises(ValueError):
        FirewallPolicy(disabled_checks=frozenset({"tensors"}))


def test_commands_without_rules_pass():
    check("HELLO", bytes(24))
    check("DEVICE_COUNT", b"")


def test_wrong_head_size_is_a_firewall_refusal():
    assert reason("BUFFER_GET_BASE", GET_BASE[:7]) == "frame_size_invalid"
    assert reason("SET_TENSOR", SET_TENSOR_51[:304], 16) == "frame_size_invalid"  # 7.0.0 head is 305


# -- device index ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["GET_ALIGNMENT", "GET_MAX_SIZE", "GET_DEVICE_MEMORY", "GRAPH_RECOMPUTE"])
def test_device_index(name):
    st = state(devices=2)
    st.graph_stored(1)
    check(name, GET_DEVICE_MEMORY_1, st=st)
    assert reason(name, GET_DEVICE_MEMORY_1) == "device_out_of_range"
    check(name, GET_DEVICE_MEMORY_1, disabled_checks=frozenset({"device_index", "recompute_after_free"}))


def test_pre_3_0_has_no_device_field():
    check("GET_ALIGNMENT", b"", st=state((2, 0, 0)))
    check("ALLOC_BUFFER", struct.pack("<Q", 1 << 20), st=state((2, 0, 0)))


# -- buffers --------------------------------------------------------------------------------


def test_alloc_buffer_spec_vector():
    check("ALLOC_BUFFER", ALLOC_1MIB)


def test_alloc_buffer_size_zero_is_legal():
    check("ALLOC_BUFFER", struct.pack("<IQ", 0, 0))


def test_alloc_buffer_device():
    assert reason("ALLOC_BUFFER", struct.pack("<IQ", 1, 16)) == "device_out_of_range"


def test_alloc_buffer_caps():
    assert reason("ALLOC_BUFFER", ALLOC_1MIB, max_alloc_bytes=(1 << 20) - 1) == "alloc_size_invalid"
    check("ALLOC_BUFFER", ALLOC_1MIB, max_alloc_bytes=1 << 20)
    st = state()
    st.upstream.max_size[0] = 1 << 19
    assert reason("ALLOC_BUFFER", ALLOC_1MIB, st=st) == "alloc_size_invalid"
    st.upstream.max_size[0] = (1 << 64) - 1  # CPU: SIZE_MAX
    check("ALLOC_BUFFER", ALLOC_1MIB, st=st)


@pytest.mark.parametrize("name,extra", [("BUFFER_GET_BASE", b""), ("FREE_BUFFER", b""), ("BUFFER_CLEAR", b"\0")])
def test_handle_commands(name, extra):
    check(name, GET_BASE + extra)
    assert reason(name, struct.pack("<Q", HANDLE + 1) + extra) == "buffer_unknown"
    st = state()
    st.free_buffer(HANDLE)
    assert reason(name, GET_BASE + extra, st=st) == "buffer_unknown"


# -- SET_TENSOR -----------------------------------------------------------------------------


def test_set_tensor_spec_vector_5_1():
    assert len(SET_TENSOR_51) == 0x140
    head = SET_TENSOR_51[:304]
    check("SET_TENSOR", head, 16, st=state(V51))


def test_set_tensor_spec_vector_7_0_with_cache_flag():
    head = SET_TENSOR_51[:296] + b"\x00" + SET_TENSOR_51[296:304]
    check("SET_TENSOR", head, 16)
    # cache_flag=1: only after a SET_TENSOR_HASH miss and above 10 MiB (tests/unit/protocol/test_session.py)
    assert reason("SET_TENSOR", SET_TENSOR_51[:296] + b"\x01" + SET_TENSOR_51[296:304], 16) == (
        "set_tensor_cache_flag_invalid")
    assert reason("SET_TENSOR", SET_TENSOR_51[:296] + b"\x02" + SET_TENSOR_51[296:304], 16) == "set_tensor_flag_invalid"


def set_head(offset: int = 0, **kw) -> bytes:
    return T(**kw) + b"\0" + struct.pack("<Q", offset)


def test_set_tensor_ranges():
    check("SET_TENSOR", set_head(8), 8)
    assert reason("SET_TENSOR", set_head(8), 9) == "range_out_of_tensor"  # abort in tensor_set
    assert reason("SET_TENSOR", set_head(SIZE), 1) == "range_out_of_buffer"  # CVE-2024-42477
    assert reason("SET_TENSOR", set_head((1 << 64) - 1), 2) == "range_out_of_buffer"  # no wrap here


def test_set_tensor_needs_a_buffer():
    assert reason("SET_TENSOR", set_head(buffer=0), 4) == "tensor_null"  # #14868
    assert reason("SET_TENSOR", set_head(buffer=HANDLE + 64), 4) == "buffer_unknown"


def test_set_tensor_without_base():
    assert reason("SET_TENSOR", set_head(), 4, st=state(base=None)) == "tensor_out_of_buffer"


def test_set_tensor_tensor_rules_apply():
    assert reason("SET_TENSOR", set_head(type=39), 4) == "tensor_shape_invalid"  # MXFP4, ne0=4
    assert reason("SET_TENSOR", set_head(type=1000), 4) == "tensor_type_invalid"  # #13067


def test_set_tensor_in_zero_size_buffer():
    st = state()
    st.add_buffer(0x77, 0, 0)
    st.buffers[0x77].base = 0  # a zero-size buffer has base NULL
    check("SET_TENSOR", set_head(buffer=0x77, data=0, ne=(0, 1, 1, 1)), 0, st=st)
    assert reason("SET_TENSOR", set_head(buffer=0x77, data=0, ne=(0, 1, 1, 1)), 1, st=st) == "range_out_of_buffer"


# -- SET_TENSOR_HASH / GET_TENSOR / MEMSET_TENSOR -------------------------------------------


def test_set_tensor_hash():
    check("SET_TENSOR_HASH", T() + struct.pack("<QQ", 16, 0x1234))
    assert reason("SET_TENSOR_HASH", T() + struct.pack("<QQ", SIZE + 1, 0x1234)) == "range_out_of_buffer"
    assert reason("SET_TENSOR_HASH", T() + struct.pack("<QQ", 17, 0x1234)) == "range_out_of_tensor"
    assert reason("SET_TENSOR_HASH", T(buffer=0) + struct.pack("<QQ", 0, 1)) == "tensor_null"


@pytest.mark.parametrize("name,tail", [("GET_TENSOR", b""), ("MEMSET_TENSOR", b"\xaa")])
def test_get_and_memset_ranges(name, tail):
    check(name, T() + struct.pack("<QQ", 4, 12) + tail)
    assert reason(name, T() + struct.pack("<QQ", 4, 13) + tail) == "range_out_of_tensor"
    assert reason(name, T() + struct.pack("<QQ", 0, SIZE + 1) + tail) == "range_out_of_buffer"  # read-what-where
    assert reason(name, T(buffer=0) + struct.pack("<QQ", 0, 4) + tail) == "tensor_null"
    assert reason(name, T(data=BASE - 16) + struct.pack("<QQ", 0, 4) + tail) == "tensor_out_of_buffer"


# -- COPY_TENSOR ----------------------------------------------------------------------------


def test_copy_tensor():
    check("COPY_TENSOR", T() + T(id=0x2000, data=BASE + SIZE - 16))
    big = T(ne=(1024, 1, 1, 1))  # 4096 bytes
    assert reason("COPY_TENSOR", big + T(id=0x2000, data=BASE + SIZE - 16)) == "copy_out_of_buffer"  # PR #1103
    assert reason("COPY_TENSOR", T(buffer=0) + T(id=0x2000)) == "tensor_null"
    assert reason("COPY_TENSOR", T() + T(id=0x2000, buffer=HANDLE + 1)) == "buffer_unknown"


# -- INIT_TENSOR / GET_ALLOC_SIZE -----------------------------------------------------------


def test_init_tensor():
    check("INIT_TENSOR", T(type=8, ne=(32, 1, 1, 1), nb=(34, 34, 34, 34)))
    assert reason("INIT_TENSOR", T(buffer=0)) == "tensor_null"
    assert reason("INIT_TENSOR", T(data=BASE + SIZE - 8)) == "tensor_out_of_buffer"


def alloc_size(tensor: bytes, srcs: list[bytes] = (), device: int = 0) -> bytes:  # type: ignore[assignment]
    srcs = list(srcs) + [bytes(296)] * (10 - len(srcs))
    return struct.pack("<I", device) + tensor + b"".join(srcs)


def test_get_alloc_size():
    check("GET_ALLOC_SIZE", alloc_size(T(buffer=0, type=8, ne=(64, 1, 1, 1), nb=(34, 68, 68, 68)), [T()]))
    # A src with id 0 is "no src": the server skips it, whatever its other bytes say.
    check("GET_ALLOC_SIZE", alloc_size(T(buffer=0), [T(id=0, type=1000)]))
    # A handle of another RPC server (7.0.0 client, multi-server): treated as no buffer.
    check("GET_ALLOC_SIZE", alloc_size(T(buffer=0x1234, data=0x5678)))
    assert reason("GET_ALLOC_SIZE", alloc_size(T(), [T(data=BASE + SIZE)])) == "tensor_out_of_buffer"
    assert reason("GET_ALLOC_SIZE", alloc_size(T(), [T(type=4)])) == "tensor_type_invalid"  # #20712
    assert reason("GET_ALLOC_SIZE", alloc_size(T(buffer=0, data=8))) == "tensor_data_without_buffer"
    assert reason("GET_ALLOC_SIZE", alloc_size(T(), device=1)) == "device_out_of_range"


@pytest.mark.parametrize("version,prefix", [((3, 0, 0), b"\0" * 4), ((2, 0, 0), b"")])
def test_get_alloc_size_older_layouts(version, prefix):
    check("GET_ALLOC_SIZE", prefix + T(), st=state(version))
    assert reason("GET_ALLOC_SIZE", prefix + T(flags=0x40), st=state(version)) == "tensor_flags_invalid"


# -- GRAPH_COMPUTE / GRAPH_RECOMPUTE --------------------------------------------------------


OPS7 = op_table((7, 0, 0)).ids  # type: ignore[union-attr]


def graph(**node) -> bytes:
    node.setdefault("src", (0x10, 0x10))
    node.setdefault("op", 2)  # ADD
    leaf = TensorSpec(id=0x10, buffer=HANDLE, data=BASE)
    return graph_payload([0x20], [leaf, TensorSpec(id=0x20, buffer=HANDLE, data=BASE + 16, **node)])


def test_graph_compute():
    check("GRAPH_COMPUTE", graph())
    assert reason("GRAPH_COMPUTE", graph(src=(0x99,))) == "graph_src_missing"
    assert reason("GRAPH_COMPUTE", graph(src=(0x10,))) == "graph_src_missing"  # ADD reads src[1]
    assert reason("GRAPH_COMPUTE", graph(op=95)) == "graph_op_denied"
    assert reason("GRAPH_COMPUTE", graph(), max_graph_tensors=1) == "graph_too_large"


def test_graph_compute_disabled_groups():
    check("GRAPH_COMPUTE", graph(op=95), disabled_checks=frozenset({"graph_ops"}))
    # Without the structure group the op rule still needs the node's sources to re-derive it.
    assert reason("GRAPH_COMPUTE", graph(src=(0x99, 0x99)), disabled_checks=frozenset({"graph_structure"})) \
        == "graph_src_missing"
    check("GRAPH_COMPUTE", graph(src=(0x99, 0x99)), disabled_checks=frozenset({"graph_structure", "op_params"}))
    payload = graph(op=33, src=(0x10, 0x10), op_params=(-1,))  # SET with a negative stride
    assert reason("GRAPH_COMPUTE", payload) == "graph_op_params_invalid"
    check("GRAPH_COMPUTE", payload, disabled_checks=frozenset({"op_params"}))
    # With graph_ops off an op without a rule is no longer refused by default deny.
    check("GRAPH_COMPUTE", graph(op=OPS7["FLASH_ATTN_BACK"]), disabled_checks=frozenset({"graph_ops"}))


def test_graph_recompute_spec_vector():
    st = state()
    assert reason("GRAPH_RECOMPUTE", RECOMPUTE_0, st=st) == "recompute_without_graph"
    st.graph_stored(0)
    check("GRAPH_RECOMPUTE", RECOMPUTE_0, st=st)
    st.free_buffer(HANDLE)  # GHSA-2phh-px2f-2qmx: recompute would reuse freed tensors
    assert reason("GRAPH_RECOMPUTE", RECOMPUTE_0, st=st) == "recompute_after_free"
    st.graph_stored(0)
    check("GRAPH_RECOMPUTE", RECOMPUTE_0, st=st)
    check("GRAPH_RECOMPUTE", RECOMPUTE_0, st=state(), disabled_checks=frozenset({"recompute_after_free"}))


# -- disabled groups ------------------------------------------------------------------------


def test_disabled_tensor_and_bounds():
    check("SET_TENSOR", set_head(flags=0x40), 4, disabled_checks=frozenset({"tensor"}))
    check("SET_TENSOR", set_head(data=0), 4, disabled_checks=frozenset({"buffer_bounds"}))
    check("BUFFER_CLEAR", struct.pack("<QB", 1, 0), disabled_checks=frozenset({"buffer_bounds"}))
    check("ALLOC_BUFFER", ALLOC_1MIB, max_alloc_bytes=1, disabled_checks=frozenset({"buffer_bounds"}))


# -- the regression corpus (tests/corpus), offline --------------------------------------------

from rpcguard.protocol.versions import KNOWN_VERSIONS, STREAM  # noqa: E402
from tests.corpus import CASES, CaseContext  # noqa: E402


def run_case(case, version) -> str | None:
    """Feed a case's frames to the firewall after a simulated preamble; all but the last must
    pass. Returns the last frame's refusal reason (None if it passed)."""
    st = state(version, base=BASE)
    ctx = CaseContext(version, HANDLE, BASE, SIZE)
    fw = Firewall(st, FirewallPolicy(**case.policy))
    frames = case.build(ctx)
    for i, frame in enumerate(frames):
        cmd, length = struct.unpack_from("<BQ", frame)
        rule = st.spec.commands[cmd]
        if length > (4 << 30):  # the session's request cap, before the firewall sees anything
            assert i == len(frames) - 1
            return "request_too_large"
        payload = memoryview(frame)[9:]
        head = payload[: rule.request] if rule.layout == STREAM else payload
        try:
            fw.check_request(rule, head, length - len(head))
        except FirewallRefusal as exc:
            # Default deny: a version without a verified op table forwards no graph at all, so a
            # case that needs a graph first is refused there, earlier and more strictly.
            early_ok = exc.reason == "op_not_verified" and op_rules(version) is None
            assert i == len(frames) - 1 or early_ok, f"{case.id}: frame {i} refused early: {exc}"
            return exc.reason
        if rule.name == "FREE_BUFFER":
            st.free_buffer(HANDLE)
        elif rule.name == "GRAPH_COMPUTE":
            st.graph_stored(0)
    return None


def test_corpus_ids_unique_and_well_formed():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    for c in CASES:
        assert c.effect in {"abort", "close", "memory", "silent", "hang"}
        assert c.dangerous or c.effect in {"abort", "close"}, c.id


@pytest.mark.parametrize(
    "case,version",
    [(c, v) for c in CASES for v in KNOWN_VERSIONS if c.applies(v)],
    ids=lambda x: x.id if hasattr(x, "id") else "%d.%d.%d" % x,
)
def test_corpus_case_refused_with_its_reason(case, version):
    got = run_case(case, version)
    if got == "op_not_verified" and op_rules(version) is None:
        return  # refused at its graph: this version has no verified op table
    assert got == case.expected_reason


def test_corpus_policy_cases_are_refused_without_the_opt_in():
    # The opt-in deny list of the first firewall is now the default: ops without a verified rule
    # are not forwarded unless a site allows them by name, content-indexed ops with one (SSM_SCAN)
    # only to a contained server (issue 20), and GATED_DELTA_NET, which has a shape rule since
    # branch rules-recur (its state is found by shape), refuses the corpus' node by that rule.
    for case in CASES:
        if case.policy:
            st = state()
            frame = case.build(CaseContext((7, 0, 0), HANDLE, BASE, SIZE))[-1]
            rule = st.spec.commands[frame[0]]
            with pytest.raises(FirewallRefusal) as exc:
                Firewall(st, FirewallPolicy()).check_request(rule, memoryview(frame)[9:], 0)
            assert exc.value.reason in ("op_not_verified", "op_needs_containment", "graph_src_missing")


def test_accepted_heads_are_cached_until_a_buffer_is_freed():
    st = state()
    check("SET_TENSOR", set_head(8), 8, st=st)
    assert st.head_cache  # the next identical head costs a dict lookup
    check("SET_TENSOR", set_head(8), 8, st=st)
    assert reason("SET_TENSOR", set_head(8), 9, st=st) == "range_out_of_tensor"  # body length is part of the key
    st.free_buffer(HANDLE)
    assert not st.head_cache
    assert reason("SET_TENSOR", set_head(8), 8, st=st) == "buffer_unknown"


# -- verdict caches: keyed by everything the verdict depends on -------------------------------


def test_head_cache_verdict_of_one_command_does_not_stand_in_for_another():
    # SET_TENSOR_HASH (T, offset, hash) and GET_TENSOR (T, offset, size) heads have the same size.
    # The hash is not a size, so a SET_TENSOR_HASH head passes whatever its last 8 bytes; the same
    # bytes as a GET_TENSOR ask for a read past the tensor and the buffer (CVE-2024-42478).
    st = state()
    fw = Firewall(st, FirewallPolicy())
    head = memoryview(T(ne=(4, 1, 1, 1)) + struct.pack("<QQ", 0, SIZE * 4))
    rules = {n: st.spec.commands[COMMAND_NAMES.index(n)] for n in ("SET_TENSOR_HASH", "GET_TENSOR")}
    fw.check_request(rules["SET_TENSOR_HASH"], head, 0)
    with pytest.raises(FirewallRefusal) as exc:
        fw.check_request(rules["GET_TENSOR"], head, 0)
    assert exc.value.reason == "range_out_of_buffer"


@pytest.mark.parametrize("change", ["alloc_same_handle", "base_moved", "free"])
def test_head_cache_is_emptied_by_every_change_of_the_buffer_map(change):
    st = state()
    fw = Firewall(st, FirewallPolicy())
    rule = st.spec.commands[COMMAND_NAMES.index("GET_TENSOR")]
    head = memoryview(T(ne=(1024, 1, 1, 1), data=BASE + SIZE - 4096) + struct.pack("<QQ", 0, 4096))
    fw.check_request(rule, head, 0)
    if change == "alloc_same_handle":  # the server answered a handle again, for a smaller buffer
        st.add_buffer(HANDLE, 0, SIZE // 2)
        st.set_base(HANDLE, BASE)
    elif change == "base_moved":
        st.set_base(HANDLE, BASE - 4096)
    else:
        st.free_buffer(HANDLE)
    assert not st.head_cache
    with pytest.raises(FirewallRefusal) as exc:
        fw.check_request(rule, head, 0)
    assert exc.value.reason in ("tensor_out_of_buffer", "buffer_unknown")


def test_set_tensor_with_cache_flag_is_never_answered_from_the_cache():
    st = state()
    fw = Firewall(st, FirewallPolicy())
    rule = st.spec.commands[COMMAND_NAMES.index("SET_TENSOR")]
    big = (10 << 20) + 4
    st.add_buffer(HANDLE, 0, 1 << 26)
    st.set_base(HANDLE, BASE)
    head = memoryview(T(ne=(big // 4, 1, 1, 1)) + b"\x01" + struct.pack("<Q", 0))
    from rpcguard.protocol.state import hash_miss_key

    st.hash_misses.add(hash_miss_key(head))
    fw.check_request(rule, head, big)
    st.hash_misses.clear()  # the session consumes the miss when it forwards the SET_TENSOR
    with pytest.raises(FirewallRefusal) as exc:
        fw.check_request(rule, head, big)
    assert exc.value.reason == "set_tensor_cache_flag_invalid"


@pytest.mark.parametrize("name,tail", [("INIT_TENSOR", b""), ("GET_TENSOR", struct.pack("<QQ", 0, 4)),
                                       ("SET_TENSOR", b"\0" + struct.pack("<Q", 0))])
def test_tensor_group_off_unknown_type_still_gets_the_buffer_rules(name, tail):
    # Found by tests/property/test_checks_off_props.py: with `tensor` off a type without size
    # information skipped the buffer lookup and the range check raised KeyError.
    head = T(type=1 << 24, buffer=0x0100000000000000, data=BASE) + tail
    assert reason(name, head, 4 if name == "SET_TENSOR" else 0, disabled_checks=frozenset({"tensor"})) == (
        "buffer_unknown")
