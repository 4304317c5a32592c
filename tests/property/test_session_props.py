"""Properties of the sans-IO session (the decoder invariant).

1. Any byte stream, in either direction, split anywhere, yields forwarded bytes or a Refusal
   (our error), never any other exception.
2. Chunking does not matter: the bytes forwarded and the refusal raised are the same whether a
   stream arrives whole or in arbitrary pieces.
3. What is forwarded is a prefix of what came in, except HELLO whose RDMA caps are zeroed.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpcguard.errors import Refusal
from rpcguard.protocol import encode
from rpcguard.protocol.session import Session
from rpcguard.protocol.state import UpstreamFacts
from tests.support import vectors as V

settings.register_profile("ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=20000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

VALID_REQUESTS = [V.GET_ALIGNMENT_REQ, V.ALLOC_REQ_1MIB, V.GET_BASE_REQ, V.FREE_REQ, V.DEVICE_COUNT_REQ,
                  V.GET_DEVICE_MEMORY_REQ_1, V.RECOMPUTE_REQ_0]


def run(direction: str, stream: bytes, cuts: list[int]) -> tuple[bytes, str | None]:
    s = Session(upstream=UpstreamFacts(device_count=2))
    if direction != "hello":
        s.client_data(memoryview(V.HELLO_REQ_V4))
        s.server_data(memoryview(V.HELLO_RSP_700))
        s.to_server.clear(), s.to_client.clear()
    feed = s.server_data if direction == "response" else s.client_data
    out = s.to_client if direction == "response" else s.to_server
    pieces, last = [], 0
    for c in sorted(set(c % (len(stream) + 1) for c in cuts)) + [len(stream)]:
        pieces.append(stream[last:c])
        last = c
    reason = None
    try:
        for p in pieces:
            if p:
                feed(memoryview(bytearray(p)))  # a fresh buffer per read, as the relay may
    except Refusal as r:
        reason = r.reason
    return b"".join(bytes(c) for c in out), reason


def streams():
    valid = st.lists(st.sampled_from(VALID_REQUESTS), max_size=4).map(b"".join)
    return st.one_of(st.binary(max_size=600), st.tuples(valid, st.binary(max_size=64)).map(b"".join))


@given(st.sampled_from(["hello", "request", "response"]), streams(), st.lists(st.integers(0, 700), max_size=8))
def test_any_stream_yields_bytes_or_our_refusal_and_chunking_does_not_matter(direction, stream, cuts):
    whole = run(direction, stream, [])
    split = run(direction, stream, cuts)
    assert whole == split
    forwarded = whole[0]
    if direction != "hello":
        assert stream.startswith(forwarded)


@given(st.binary(min_size=24, max_size=24))
def test_hello_caps_are_always_zeroed(caps):
    s = Session(upstream=UpstreamFacts(device_count=1))
    s.client_data(memoryview(encode.request("HELLO", caps)))
    assert b"".join(bytes(c) for c in s.to_server) == V.HELLO_REQ_V4
    s.server_data(memoryview(encode.hello_response((7, 0, 0), caps=caps)))
    assert b"".join(bytes(c) for c in s.to_client) == V.HELLO_RSP_700
