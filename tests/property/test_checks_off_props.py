"""Whatever check groups are switched off, only a refusal can escape the session (hypothesis).

Switching a check group off (``policy.checks.<group>: false``) removes rules, never the parsing
that the remaining rules stand on: a frame the firewall no longer refuses must still be handled
without an exception other than ``FirewallRefusal`` / ``ProtocolRefusal`` (rpcguard/errors.py).
A KeyError once escaped with the ``tensor`` group off (a tensor of an unknown type skipped the
buffer lookup that the range checks then relied on).

The strategy drives a whole ``Session``: HELLO of some version, a few ALLOC_BUFFER /
BUFFER_GET_BASE exchanges whose answers are arbitrary (handles answered twice, absurd bases and
sizes), then arbitrary request frames of every command the version knows: heads built from an
rpc_tensor whose fields come from pools of interesting values (live handles, 0, unknown handles;
data at, inside and past buffers; valid, removed and out-of-range types) plus arbitrary tails, or
plain random bytes, with arbitrary responses fed back for whatever the session expects.
"""

from __future__ import annotations

import os
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpcguard.errors import FirewallRefusal, ProtocolRefusal
from rpcguard.protocol import encode
from rpcguard.protocol.firewall import CHECK_NAMES, FirewallPolicy
from rpcguard.protocol.session import Session, SessionPolicy
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.versions import COMMAND_NAMES, KNOWN_VERSIONS, TENSOR_BYTES, spec_for

_LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
PROPS = settings(
    max_examples=5000 if _LONG else 150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
U64 = (1 << 64) - 1
BASE = 0x7F0000000000
HANDLES = [0x1000, 0x2000, 0x3000]


def u64s(live: list[int]):
    return st.one_of(st.sampled_from(live + [0, 1, U64, 1 << 63]), st.integers(0, U64))


@st.composite
def tensor_bytes(draw) -> bytes:
    t = encode.TensorSpec(
        id=draw(u64s([0x10, 0x20])),
        type=draw(st.one_of(st.integers(0, 45), st.integers(0, 0xFFFFFFFF))),
        buffer=draw(u64s(HANDLES)),
        ne=tuple(draw(st.one_of(st.integers(0, 64), st.integers(0, 0xFFFFFFFF))) for _ in range(4)),  # type: ignore[arg-type]
        nb=tuple(draw(st.one_of(st.integers(0, 256), st.integers(0, 0xFFFFFFFF))) for _ in range(4)),  # type: ignore[arg-type]
        op=draw(st.integers(0, 120)),
        op_params=tuple(draw(st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=16))),
        flags=draw(st.integers(0, 0xFFFFFFFF)),
        src=tuple(draw(st.lists(u64s([0x10, 0x20]), max_size=10))),
        view_src=draw(u64s([0x10, 0x20])),
        view_offs=draw(u64s([])),
        data=draw(st.one_of(st.integers(BASE - 64, BASE + (1 << 21)), u64s([BASE]))),
        name=draw(st.binary(max_size=63)),
        use_count=draw(st.integers(-(1 << 31), (1 << 31) - 1)),
    )
    raw = encode.pack_tensor(t)
    if draw(st.booleans()):
        return raw
    return draw(st.binary(min_size=TENSOR_BYTES, max_size=TENSOR_BYTES))


@st.composite
def requests(draw, version) -> bytes:
    spec = spec_for(version)
    assert spec is not None
    rules = [r for r in spec.commands if r is not None and r.name != "HELLO"]
    rule = draw(st.sampled_from(rules))
    if rule.name == "GRAPH_COMPUTE":
        n = draw(st.integers(0, 3))
        m = draw(st.integers(0, 3))
        nodes = [draw(u64s([0x10, 0x20])) for _ in range(n)]
        head = struct.pack("<I", draw(st.integers(0, 3))) if spec.multi_device else b""
        payload = head + struct.pack("<I", n) + struct.pack(f"<{n}Q", *nodes) + struct.pack("<I", m)
        payload += b"".join(draw(tensor_bytes()) for _ in range(m))
        if draw(st.integers(0, 4)) == 0:
            payload = payload[: draw(st.integers(0, len(payload)))] + draw(st.binary(max_size=8))
    else:
        parts = []
        size = rule.request
        tensor_at = 4 if rule.has_device and rule.name == "GET_ALLOC_SIZE" else 0
        if rule.has_device:
            parts.append(struct.pack("<I", draw(st.integers(0, 3))))
        if size - tensor_at >= TENSOR_BYTES and "TENSOR" in rule.name or rule.name == "GET_ALLOC_SIZE":
            while sum(map(len, parts)) + TENSOR_BYTES <= size:
                parts.append(draw(tensor_bytes()))
        if rule.name == "BUFFER_GET_BASE" or rule.name in ("FREE_BUFFER", "BUFFER_CLEAR"):
            parts.append(struct.pack("<Q", draw(u64s(HANDLES))))
        if rule.name == "ALLOC_BUFFER":
            parts.append(struct.pack("<Q", draw(st.one_of(st.integers(0, 1 << 22), u64s([])))))
        payload = b"".join(parts)
        tail = max(0, size - len(payload))
        if tail:
            payload += draw(st.one_of(
                st.binary(min_size=tail, max_size=tail),
                st.tuples(st.sampled_from([b"\0", b"\1", b"\2"]), st.binary(min_size=tail, max_size=tail)).map(
                    lambda p: (p[0] + p[1])[:tail]),
            ))
        payload = payload[:size] if rule.name != "SET_TENSOR" else payload[:size] + draw(st.binary(max_size=64))
    length = len(payload) if draw(st.integers(0, 9)) else draw(st.integers(0, len(payload) + 8))
    return encode.request(rule.cmd, payload[:length], length=length)


def answer(session: Session, draw) -> None:
    """Answer what the session waits for with arbitrary payloads of the expected size."""
    while session._expect:  # noqa: SLF001 - the test plays the server
        exp = session._expect[0]  # noqa: SLF001
        if exp.length > 4096:  # a GET_TENSOR of a huge range: leave it outstanding
            return
        name = COMMAND_NAMES[exp.cmd]
        if name == "ALLOC_BUFFER":
            payload = struct.pack("<QQ", draw(st.sampled_from(HANDLES + [0])), draw(st.integers(0, 1 << 22)))
        elif name == "BUFFER_GET_BASE":
            payload = struct.pack("<Q", draw(st.one_of(st.just(BASE), u64s([BASE]))))
        else:
            payload = draw(st.binary(min_size=exp.length, max_size=exp.length))
        session.server_data(memoryview(encode.response(payload, length=exp.length)))


@PROPS
@given(st.data())
def test_only_refusals_escape_whatever_checks_are_off(data):
    draw = data.draw
    version = draw(st.sampled_from(KNOWN_VERSIONS))
    off = frozenset(draw(st.sets(st.sampled_from(CHECK_NAMES))))
    mode = draw(st.sampled_from(["enforce", "monitor"]))
    memory = {d: (1 << 30, 1 << 30) for d in range(2)} if draw(st.booleans()) else {}
    policy = SessionPolicy(mode=mode, firewall=FirewallPolicy(disabled_checks=off),
                           clear_new_buffers=draw(st.booleans()))
    s = Session(policy, UpstreamFacts(device_count=draw(st.sampled_from([None, 1, 2])), version=version,
                                      memory=memory))
    spec = spec_for(version)
    try:
        s.client_data(memoryview(encode.hello_request(version)))
        s.server_data(memoryview(encode.hello_response(version)))
        answer(s, draw)
        for handle in HANDLES[: draw(st.integers(0, 3))]:
            dev = struct.pack("<I", 0) if spec.multi_device else b""  # type: ignore[union-attr]
            s.client_data(memoryview(encode.request("ALLOC_BUFFER", dev + struct.pack("<Q", 1 << 20))))
            answer(s, draw)
            s.client_data(memoryview(encode.request("BUFFER_GET_BASE", struct.pack("<Q", handle))))
            answer(s, draw)
        for _ in range(draw(st.integers(1, 6))):
            frame = draw(st.one_of(requests(version), st.binary(max_size=400)))
            s.client_data(memoryview(frame))
            if s.idle or draw(st.booleans()):
                answer(s, draw)
    except (FirewallRefusal, ProtocolRefusal):
        pass
