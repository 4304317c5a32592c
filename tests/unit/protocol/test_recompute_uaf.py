"""GHSA-2phh-px2f-2qmx: GRAPH_RECOMPUTE after a FREE_BUFFER of a buffer the stored graph uses.

A server whose stored graphs survive FREE_BUFFER (every version with GRAPH_RECOMPUTE: the fix,
llama.cpp b11003, shipped inside 7.0.0) reruns the graph on freed memory. The firewall refuses
that rerun on the device whose graph uses the freed buffer, until a new GRAPH_COMPUTE there; a
free of another buffer, or a graph on another device, leaves GRAPH_RECOMPUTE alone."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol import encode
from rpcguard.protocol.commands import graph_buffers
from rpcguard.protocol.graph import op_rules
from rpcguard.protocol.session import Session, SessionPolicy
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.protocol.versions import COMMAND_IDS, KNOWN_VERSIONS, STORED_GRAPH_FIXED, spec_for
from tests.support import vectors as V

MIB = 1 << 20
# (handle, device, base): A and C on device 0, B on device 1; the graphs use A (device 0) and B (device 1)
A, B, C = (0x5555_0000_A000, 0, 0x7F00_0000_0000), (0x5555_0000_B000, 1, 0x7F00_1000_0000), \
    (0x5555_0000_C000, 0, 0x7F00_2000_0000)
VERSIONS = [v for v in KNOWN_VERSIONS if v >= (3, 6, 1) and op_rules(v) is not None]


def graph(buf: tuple[int, int, int], version) -> bytes:
    """Two ADDs of a weight in ``buf`` on ``buf``'s device."""
    handle, device, base = buf
    add = op_rules(version).names.index("ADD")  # type: ignore[union-attr]

    def t(id: int, slot: int, **kw) -> encode.TensorSpec:
        return encode.TensorSpec(id=id, buffer=handle, data=base + slot * 64, **kw)

    tensors = [t(0x10, 0, name=b"w", use_count=3), t(0x100, 1, op=add, src=(0x10, 0x10), use_count=1, flags=16),
               t(0x110, 2, op=add, src=(0x100, 0x10), flags=16)]
    return encode.request("GRAPH_COMPUTE", encode.graph_payload([0x100, 0x110], tensors, device=device))


def recompute(device: int) -> bytes:
    return encode.request("GRAPH_RECOMPUTE", struct.pack("<I", device))


def free(buf: tuple[int, int, int]) -> bytes:
    return encode.request("FREE_BUFFER", struct.pack("<Q", buf[0]))


def session(version) -> Session:
    s = Session(SessionPolicy(clear_new_buffers=False),
                UpstreamFacts(version=version, device_count=2, memory={0: (1 << 30,) * 2, 1: (1 << 30,) * 2}))
    s.client_data(memoryview(encode.hello_request(version)))
    s.server_data(memoryview(encode.hello_response(version)))
    assert s.greeted
    for handle, device, base in (A, B, C):
        s.state.add_buffer(handle, device, MIB)
        s.state.set_base(handle, base)
    s.client_data(memoryview(graph(A, version) + graph(B, version)))
    s.to_server.clear(), s.to_client.clear()
    return s


def send(s: Session, data: bytes, how: str = "whole") -> bytes:
    for kind, chunks in V.runs(data):
        if kind == how:
            for c in chunks:
                s.client_data(memoryview(bytearray(c)))
    out = b"".join(bytes(c) for c in s.to_server)
    s.to_server.clear()
    return out


def refused(s: Session, data: bytes, how: str = "whole") -> str:
    with pytest.raises(FirewallRefusal) as e:
        send(s, data, how)
    return e.value.reason


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("how", ["whole", "bytewise"])
def test_recompute_after_freeing_a_buffer_of_the_stored_graph_is_refused(version, how):
    s = session(version)
    assert send(s, recompute(0), how) == recompute(0)
    send(s, free(A), how)
    assert refused(s, recompute(0), how) == "recompute_after_free"


@pytest.mark.parametrize("version", VERSIONS)
def test_a_new_graph_compute_on_the_device_makes_recompute_safe_again(version):
    s = session(version)
    send(s, free(A))
    s.state.add_buffer(A[0], 0, MIB)  # the same handle again (the server reused the address)
    s.state.set_base(A[0], A[2])
    assert refused(s, recompute(0)) == "recompute_after_free"  # the stored graph still points at the old one
    send(s, graph(A, version))
    assert send(s, recompute(0)) == recompute(0)


@pytest.mark.parametrize("version", VERSIONS)
def test_other_device_and_other_buffers_are_unaffected(version):
    s = session(version)
    send(s, free(A))
    assert send(s, recompute(1)) == recompute(1)  # device 1's graph uses B only
    s = session(version)
    send(s, free(C))  # no stored graph uses C
    assert send(s, recompute(0)) + send(s, recompute(1)) == recompute(0) + recompute(1)
    send(s, free(B))
    assert send(s, recompute(0)) == recompute(0)
    assert refused(s, recompute(1)) == "recompute_after_free"


def test_a_fixed_server_drops_every_stored_graph_on_any_free():
    """b11003+ (rpc_server::free_buffer clears stored_graphs): a rerun after any free would make the
    server close the connection: refused as it has no graph, not as a use-after-free."""
    s = session((7, 0, 0))
    s.state.spec = dataclasses.replace(s.state.spec, stored_graph_survives_free=False)  # type: ignore[arg-type]
    send(s, free(C))
    assert refused(s, recompute(0)) == "recompute_without_graph"


def test_the_version_table_says_who_carries_the_bug():
    for v in KNOWN_VERSIONS:
        spec = spec_for(v)
        has_recompute = spec.rule(COMMAND_IDS["GRAPH_RECOMPUTE"]) is not None  # type: ignore[union-attr]
        assert spec.stored_graph_survives_free == (has_recompute and v not in STORED_GRAPH_FIXED), v  # type: ignore[union-attr]
    assert spec_for((7, 0, 0)).stored_graph_survives_free  # type: ignore[union-attr]  # early 7.0.0 (< b11003)
    assert spec_for((7, 0, 1)).stored_graph_survives_free  # type: ignore[union-attr]  # @02d1e60c lacks the fix


def test_graph_buffers_reads_every_tensors_handle():
    payload = graph(A, (7, 0, 0))[9:]
    assert graph_buffers(payload, 8) == frozenset({A[0]})
    assert graph_buffers(payload[:-1], 8) is None  # not a whole graph: unknown, every free counts
