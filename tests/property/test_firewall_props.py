"""Property tests of the frame firewall (hypothesis).

Strategies build a valid session (a few buffers with known bases) and valid frames for every
tensor-bearing command and for GRAPH_COMPUTE; those pass. Then one field is mutated:

* any mutation, anywhere: the firewall either accepts or raises ``FirewallRefusal``, never
  another exception;
* mutations that break a stated invariant are refused, with the rule's reason (each test's
  docstring states the invariant).

Default: a modest example count (the file runs in well under 30 s). ``HYPOTHESIS_PROFILE=long``
runs many more examples.
"""

from __future__ import annotations

import os
import struct

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.encode import TensorSpec, graph_payload, pack_tensor
from rpcguard.protocol.firewall import Firewall, FirewallPolicy
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.graph import op_rules
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.tensor import decode_tensor, nbytes, types_of
from rpcguard.protocol.versions import COMMAND_IDS, KNOWN_VERSIONS, STREAM, WHOLE, spec_for

settings.register_profile("long", max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
PROPS = settings(
    max_examples=3000 if _LONG else 60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

U64 = (1 << 64) - 1
REMOVED_TYPES = [4, 5, 31, 32, 33, 36, 37, 38]
TENSOR_COMMANDS = ["SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "MEMSET_TENSOR", "INIT_TENSOR", "COPY_TENSOR"]


# -- strategies -----------------------------------------------------------------------------


@st.composite
def sessions(draw, versions=KNOWN_VERSIONS) -> SessionState:
    """A session of some version with 1-3 buffers of known base and size."""
    version = draw(st.sampled_from(versions))
    state = SessionState(UpstreamFacts(device_count=draw(st.integers(1, 3))), spec=spec_for(version))
    for _ in range(draw(st.integers(1, 3))):
        handle = draw(st.integers(1, U64).filter(lambda h: h not in state.buffers))
        size = draw(st.integers(1 << 12, 1 << 22))
        base = draw(st.integers(1 << 12, (1 << 47) - size)) & ~0x1F
        state.add_buffer(handle, 0, size)
        state.buffers[handle].base = base
    return state


@st.composite
def tensors(draw, state: SessionState, id: int | None = None, in_buffer: bool | None = True) -> TensorSpec:
    """A valid tensor of a valid type, contiguous, placed inside one of the session's buffers
    (or with buffer=0, data=0 when ``in_buffer`` is False)."""
    table = types_of(state.spec.version)  # type: ignore[union-attr]
    type_ = draw(st.sampled_from(sorted(table)))
    info = table[type_]
    ne = (info.blck_size * draw(st.integers(1, 4)),) + tuple(draw(st.integers(1, 4)) for _ in range(3))
    t = TensorSpec(
        id=id if id is not None else draw(st.integers(1, U64)),
        type=type_,
        ne=ne,  # type: ignore[arg-type]
        type_size=info.type_size,
        blck_size=info.blck_size,
        flags=draw(st.integers(0, 0x1F)),
        name=draw(st.binary(max_size=63)),
        use_count=draw(st.integers(0, 8)),
    )
    n = nbytes(decode_tensor(pack_tensor(t)), info)
    if in_buffer is None:
        in_buffer = draw(st.booleans())
    if in_buffer:
        buf = draw(st.sampled_from(sorted(state.buffers.values(), key=lambda b: b.handle)))
        assume(n <= buf.size)
        t.buffer = buf.handle
        t.data = buf.base + draw(st.integers(0, buf.size - n))  # type: ignore[operator]
    return t


def _n(t: TensorSpec) -> int:
    return nbytes(decode_tensor(pack_tensor(t)), TYPES[t.type])


@st.composite
def tensor_frames(draw, state: SessionState, command: str) -> tuple[str, bytes, int, TensorSpec]:
    """(command, validated head, body_len, the tensor) for a valid request of ``command``."""
    t = draw(tensors(state))
    n = _n(t)
    packed = pack_tensor(t)
    if command == "SET_TENSOR":
        offset = draw(st.integers(0, n))
        k = draw(st.integers(0, n - offset))
        # cache_flag=1 needs a SET_TENSOR_HASH miss first (session state): not a stand-alone valid frame.
        flag = b"\x00" if state.spec.version >= (7, 0, 0) else b""  # type: ignore[union-attr]
        return command, packed + flag + struct.pack("<Q", offset), k, t
    if command == "SET_TENSOR_HASH":
        return command, packed + struct.pack("<QQ", draw(st.integers(0, n)), draw(st.integers(0, U64))), 0, t
    if command in ("GET_TENSOR", "MEMSET_TENSOR"):
        offset = draw(st.integers(0, n))
        tail = b"\x00" if command == "MEMSET_TENSOR" else b""
        return command, packed + struct.pack("<QQ", offset, draw(st.integers(0, n - offset))) + tail, 0, t
    if command == "INIT_TENSOR":
        return command, packed, 0, t
    # COPY_TENSOR: dst in some buffer with room for nbytes(src) after dst.data.
    dst = draw(tensors(state))
    buf = state.buffers[dst.buffer]
    assume(dst.data + n <= buf.base + buf.size)  # type: ignore[operator]
    return command, packed + pack_tensor(dst), 0, t


def applicable(state: SessionState, command: str) -> bool:
    return state.spec.rule(COMMAND_IDS[command]) is not None  # type: ignore[union-attr]


@st.composite
def graphs(draw, state: SessionState) -> tuple[list[int], list[TensorSpec]]:
    """A valid graph as ggml's constructors build it: F32 leaves of one shape in the session's
    buffers, then DUP/ADD/MUL nodes (fresh contiguous F32 tensors of that shape) whose sources
    are earlier tensors, in depth-first post-order like the real client's serialize_graph."""
    n_leaves = draw(st.integers(1, 4))
    n_nodes = draw(st.integers(1, 6))
    ids = draw(st.lists(st.integers(1, U64), min_size=n_leaves + n_nodes, max_size=n_leaves + n_nodes, unique=True))
    ne = tuple(draw(st.integers(1, 4)) for _ in range(4))
    nbytes_ = 4 * ne[0] * ne[1] * ne[2] * ne[3]
    out: list[TensorSpec] = []
    nodes = []
    for i, id_ in enumerate(ids):
        buf = draw(st.sampled_from(sorted(state.buffers.values(), key=lambda b: b.handle)))
        t = TensorSpec(id=id_, type=0, ne=ne, buffer=buf.handle,  # type: ignore[arg-type]
                       data=buf.base + draw(st.integers(0, buf.size - nbytes_)),  # type: ignore[operator]
                       flags=draw(st.integers(0, 0x1F)), name=draw(st.binary(max_size=63)),
                       use_count=draw(st.integers(0, 8)))
        if i >= n_leaves:
            t.op = draw(st.sampled_from([1, 2, 7]))  # DUP, ADD, MUL: same ids in every op table read
            n_src = 1 if t.op == 1 else 2
            t.src = tuple(out[draw(st.integers(0, len(out) - 1))].id for _ in range(n_src))
            nodes.append(t.id)
        out.append(t)
    return nodes, out


def check(state: SessionState, command: str, head: bytes, body_len: int = 0) -> None:
    rule = state.spec.rule(COMMAND_IDS[command])  # type: ignore[union-attr]
    Firewall(state, FirewallPolicy()).check_request(rule, memoryview(head), body_len)


def reason(state: SessionState, command: str, head: bytes, body_len: int = 0) -> str | None:
    try:
        check(state, command, head, body_len)
    except FirewallRefusal as exc:
        return exc.reason
    return None


def gpayload(state: SessionState, nodes, ts) -> bytes:
    return graph_payload(nodes, ts, device=0 if state.spec.multi_device else None)  # type: ignore[union-attr]


# -- valid frames pass ----------------------------------------------------------------------



def valid_tensor_frame(data):
    """A session and a valid tensor-bearing frame in it: (state, command, name, head, body_len, tensor)."""
    state = data.draw(sessions())
    command = data.draw(st.sampled_from(TENSOR_COMMANDS).filter(lambda c: applicable(state, c)))
    return (state, command, *data.draw(tensor_frames(state, command)))

@PROPS
@given(st.data())
def test_valid_tensor_frames_pass(data):
    """Every tensor inside a known buffer, with offset/size inside nbytes, is accepted."""
    state, command, name, head, k, _ = valid_tensor_frame(data)
    check(state, name, head, k)


@PROPS
@given(st.data())
def test_valid_graphs_pass(data):
    """A graph whose node ids are unique, non-zero and listed, whose srcs precede their users and
    whose tensors are valid, is accepted."""
    state = data.draw(sessions())
    nodes, ts = data.draw(graphs(state))
    if op_rules(state.spec.version) is None:  # type: ignore[union-attr]
        # default deny: a version without a verified op table forwards no graph
        assert reason(state, "GRAPH_COMPUTE", gpayload(state, nodes, ts)) == "op_not_verified"
    else:
        check(state, "GRAPH_COMPUTE", gpayload(state, nodes, ts))


# -- any mutation: FirewallRefusal or accept, nothing else ----------------------------------


@PROPS
@given(st.data())
def test_any_byte_mutation_only_refuses(data):
    """Overwriting any bytes of a valid payload never raises anything but FirewallRefusal."""
    state = data.draw(sessions())
    if data.draw(st.booleans()):
        nodes, ts = data.draw(graphs(state))
        command, head, k = "GRAPH_COMPUTE", bytearray(gpayload(state, nodes, ts)), 0
    else:
        command = data.draw(st.sampled_from(TENSOR_COMMANDS).filter(lambda c: applicable(state, c)))
        command, h, k, _ = data.draw(tensor_frames(state, command))
        head = bytearray(h)
    at = data.draw(st.integers(0, len(head) - 1))
    patch = data.draw(st.binary(min_size=1, max_size=16))
    head[at : at + len(patch)] = patch[: len(head) - at]
    if command == "GRAPH_COMPUTE" and data.draw(st.booleans()):
        head = head[: data.draw(st.integers(0, len(head)))]  # truncated or intact
    reason(state, command, bytes(head), k)


FIELDS = ["type", "ne", "nb", "buffer", "data", "op", "op_params", "flags", "src", "view_src", "name", "use_count"]


@PROPS
@given(st.data())
def test_field_mutation_only_refuses(data):
    """Setting any one rpc_tensor field of a graph tensor to an arbitrary value never raises
    anything but FirewallRefusal."""
    state = data.draw(sessions())
    nodes, ts = data.draw(graphs(state))
    t = data.draw(st.sampled_from(ts))
    field = data.draw(st.sampled_from(FIELDS))
    u32, u64, i32 = st.integers(0, 0xFFFFFFFF), st.integers(0, U64), st.integers(-(1 << 31), (1 << 31) - 1)
    value = {
        "type": u32, "ne": st.tuples(u32, u32, u32, u32), "nb": st.tuples(u32, u32, u32, u32), "buffer": u64,
        "data": u64, "op": u32, "op_params": st.tuples(*[i32] * 16), "flags": u32,
        "src": st.tuples(*[st.sampled_from([0, *nodes, *(x.id for x in ts)]) | u64] * 10),
        "view_src": st.sampled_from([0, *(x.id for x in ts)]) | u64, "name": st.binary(min_size=64, max_size=64),
        "use_count": i32,
    }[field]  # fmt: skip
    t.nb = t.strides()  # keep the wire strides when ne changes
    setattr(t, field, data.draw(value))
    reason(state, "GRAPH_COMPUTE", gpayload(state, nodes, ts))


# -- invariant-breaking mutations are refused -----------------------------------------------


@PROPS
@given(st.data())
def test_invalid_type_refused(data):
    """Invariant: type is a valid ggml type of that version with a non-zero block size."""
    state, command, _, head, k, t = valid_tensor_frame(data)
    bad = data.draw(st.sampled_from(REMOVED_TYPES) | st.integers(43, 0xFFFFFFFF))
    assert reason(state, command, struct.pack("<I", bad).join([head[:8], head[12:]]), k) == "tensor_type_invalid"


@PROPS
@given(st.data())
def test_undefined_flags_refused(data):
    """Invariant: only flag bits 0-4 are defined."""
    state, command, _, head, k, t = valid_tensor_frame(data)
    flags = t.flags | (1 << data.draw(st.integers(5, 31)))
    assert reason(state, command, head[:120] + struct.pack("<I", flags) + head[124:], k) == "tensor_flags_invalid"


@PROPS
@given(st.data())
def test_unterminated_name_refused(data):
    """Invariant: the 64 name bytes contain a NUL."""
    state, command, _, head, k, _ = valid_tensor_frame(data)
    name = data.draw(st.binary(min_size=64, max_size=64).filter(lambda b: b"\0" not in b))
    assert reason(state, command, head[:228] + name + head[292:], k) == "tensor_name_unterminated"


@PROPS
@given(st.data())
def test_ne0_not_multiple_of_block_refused(data):
    """Invariant: ne[0] is a multiple of the type's block size."""
    state, command, _, head, k, t = valid_tensor_frame(data)
    blck = TYPES[t.type].blck_size
    assume(blck > 1)
    ne0 = t.ne[0] + data.draw(st.integers(1, blck - 1))
    assert reason(state, command, head[:20] + struct.pack("<I", ne0) + head[24:], k) == "tensor_shape_invalid"


@PROPS
@given(st.data())
def test_data_without_buffer_refused(data):
    """Invariant: buffer == 0 implies data == 0."""
    state, command, _, head, k, t = valid_tensor_frame(data)
    assert reason(state, command, head[:12] + bytes(8) + head[20:], k) == "tensor_data_without_buffer"


@PROPS
@given(st.data())
def test_unknown_buffer_refused(data):
    """Invariant: a non-zero buffer is a live handle of this session."""
    state, command, _, head, k, _ = valid_tensor_frame(data)
    handle = data.draw(st.integers(1, U64).filter(lambda h: h not in state.buffers))
    assert reason(state, command, head[:12] + struct.pack("<Q", handle) + head[20:], k) == "buffer_unknown"


@PROPS
@given(st.data())
def test_data_outside_buffer_refused(data):
    """Invariant: [data, data + nbytes) lies inside the tensor's buffer."""
    state, command, _, head, k, t = valid_tensor_frame(data)
    buf = state.buffers[t.buffer]
    n = _n(t)
    below = st.integers(0, buf.base - 1)  # type: ignore[operator]
    above = st.integers(buf.base + buf.size - n + 1, U64 - n)  # type: ignore[operator]
    data_ = data.draw(below | above)
    assert reason(state, command, head[:220] + struct.pack("<Q", data_) + head[228:], k) == "tensor_out_of_buffer"


@PROPS
@given(st.data())
def test_set_tensor_range_past_tensor_refused(data):
    """Invariant: SET_TENSOR's offset + k <= nbytes(T) and data + offset + k <= buffer end."""
    state = data.draw(sessions())
    _, head, _, t = data.draw(tensor_frames(state, "SET_TENSOR"))
    n = _n(t)
    offset = data.draw(st.integers(0, U64))
    k = data.draw(st.integers(0, 1 << 40))
    assume(offset + k > n)
    at = len(head) - 8
    got = reason(state, "SET_TENSOR", head[:at] + struct.pack("<Q", offset), k)
    assert got in ("range_out_of_tensor", "range_out_of_buffer")


@PROPS
@given(st.data())
def test_graph_node_mutations_refused(data):
    """Invariants: node ids are non-zero, unique and present in the tensor list."""
    state = data.draw(sessions())
    nodes, ts = data.draw(graphs(state))
    kind = data.draw(st.sampled_from(["zero", "duplicate", "missing"]))
    i = data.draw(st.integers(0, len(nodes) - 1))
    ids = {t.id for t in ts}
    if kind == "zero":
        nodes[i] = 0
        expected = "graph_node_invalid"
    elif kind == "duplicate":
        nodes.insert(i, nodes[data.draw(st.integers(0, len(nodes) - 1))])
        expected = "graph_node_duplicate"
    else:
        nodes[i] = data.draw(st.integers(1, U64).filter(lambda x: x not in ids))
        expected = "graph_node_missing"
    assert reason(state, "GRAPH_COMPUTE", gpayload(state, nodes, ts)) == expected


@PROPS
@given(st.data())
def test_graph_src_mutations_refused(data):
    """Invariants: every non-zero src/view_src is a tensor of the list, listed before its user."""
    state = data.draw(sessions())
    nodes, ts = data.draw(graphs(state))
    pos = {t.id: p for p, t in enumerate(ts)}
    user = data.draw(st.sampled_from([t for t in ts if t.src]))
    slot = data.draw(st.integers(0, 10))
    if data.draw(st.booleans()):
        target = data.draw(st.integers(1, U64).filter(lambda x: x not in pos))
        expected = "graph_src_missing"
    else:
        target = data.draw(st.sampled_from([t.id for t in ts if pos[t.id] >= pos[user.id]]))
        expected = "graph_order_invalid"
    if slot == 10:
        user.view_src = target
    else:
        src = list(user.src) + [0] * (10 - len(user.src))
        src[slot] = target
        user.src = tuple(src)
    if slot == 1 and target == user.id and op_rules(state.spec.version) is None:  # type: ignore[union-attr]
        # src[1] may point at its own tensor (ggml_cast); only the op table knows which op may,
        # and a version without one forwards no graph at all
        expected = "op_not_verified"
    assert reason(state, "GRAPH_COMPUTE", gpayload(state, nodes, ts)) == expected


@PROPS
@given(st.data())
def test_graph_op_mutations_refused(data):
    """Invariants (versions with an op table): op < OP_COUNT; custom ops are denied."""
    with_ops = [v for v in KNOWN_VERSIONS if op_rules(v) is not None]
    state = data.draw(sessions(with_ops))
    rules = op_rules(state.spec.version)  # type: ignore[union-attr]
    assert rules is not None
    nodes, ts = data.draw(graphs(state))
    node = data.draw(st.sampled_from([t for t in ts if t.id in nodes]))
    if data.draw(st.booleans()):
        node.op = data.draw(st.integers(rules.count, 0xFFFFFFFF))
        expected = "graph_op_invalid"
    else:
        node.op = data.draw(st.sampled_from(sorted(rules.denied)))
        expected = "graph_op_denied"
    assert reason(state, "GRAPH_COMPUTE", gpayload(state, nodes, ts)) == expected


@PROPS
@given(st.data())
def test_graph_length_mutations_refused(data):
    """Invariant: len == header + 8 n_nodes + 4 + 296 n_tensors exactly."""
    state = data.draw(sessions())
    nodes, ts = data.draw(graphs(state))
    payload = gpayload(state, nodes, ts)
    if data.draw(st.booleans()):
        payload += data.draw(st.binary(min_size=1, max_size=300))
    else:
        payload = payload[: data.draw(st.integers(0, len(payload) - 1))]
    got = reason(state, "GRAPH_COMPUTE", payload)
    assert got in ("graph_size_mismatch", "graph_node_invalid", "graph_too_large")


def test_rule_layouts_covered():
    # The strategies above build heads for every STREAM/WHOLE command the firewall sees.
    for v in KNOWN_VERSIONS:
        spec = spec_for(v)
        assert spec is not None
        for rule in spec.commands:
            if rule is not None and rule.layout in (STREAM, WHOLE):
                assert rule.name in ("SET_TENSOR", "GRAPH_COMPUTE")
