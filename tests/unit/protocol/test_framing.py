"""FrameReader: every vector whole, byte by byte, and with trailing bytes."""

import struct

import pytest

from rpcguard.errors import ProtocolRefusal
from rpcguard.protocol.framing import FrameReader
from tests.support import vectors as V

REQ = struct.Struct("<BQ")
RSP = struct.Struct("<Q")


class Reader:
    """A FrameReader whose callbacks materialise events (views die with their buffer)."""

    def __init__(self, header, plan):
        self.events = []
        self.views = []
        self.fr = FrameReader(header, plan, self.on_frame, self.on_body)

    def on_frame(self, fields, head, raw):
        self.events.append(("frame", fields, bytes(head), bytes(raw)))

    def on_body(self, chunk):
        self.views.append(chunk)
        self.events.append(("body", bytes(chunk)))

    def run(self, chunks):
        for c in chunks:
            self.fr.feed(memoryview(c))
        return self.events


def merge_bodies(events):
    merged = []
    for ev in events:
        if ev[0] == "body" and merged and merged[-1][0] == "body":
            merged[-1] = ("body", merged[-1][1] + ev[1])
        else:
            merged.append(ev)
    return merged


def whole_head(header):
    return header[-1], 0


@pytest.mark.parametrize("vector", [V.HELLO_REQ_V4, V.DEVICE_COUNT_REQ, V.ALLOC_REQ_1MIB, V.GET_BASE_REQ, V.FREE_REQ])
def test_request_vectors(vector):
    expected = [("frame", REQ.unpack_from(vector), vector[9:], vector)]
    for how, chunks in V.runs(vector, trailing=V.DEVICE_COUNT_REQ):
        reader = Reader(REQ, whole_head)
        got = reader.run(chunks)
        want = expected + ([("frame", (15, 0), b"", V.DEVICE_COUNT_REQ)] if how == "trailing" else [])
        assert got == want, how
        assert reader.fr.at_boundary


@pytest.mark.parametrize("vector", [V.HELLO_RSP_700, V.HELLO_RSP_361, V.ALLOC_RSP, V.GET_BASE_RSP])
def test_response_vectors(vector):
    for how, chunks in V.runs(vector, trailing=V.GET_ALIGNMENT_RSP_32):
        got = Reader(RSP, whole_head).run(chunks)
        assert got[0] == ("frame", RSP.unpack_from(vector), vector[8:], vector), how
        assert len(got) == (2 if how == "trailing" else 1)


def test_head_then_streamed_body_is_never_accumulated():
    head, body = b"H" * 10, bytes(range(256)) * 40
    frame = REQ.pack(6, len(head) + len(body)) + head + body
    for how, chunks in V.runs(frame, trailing=V.DEVICE_COUNT_REQ):
        reader = Reader(REQ, lambda h: (10, h[1] - 10) if h[0] == 6 else (h[1], 0))
        got = merge_bodies(reader.run(chunks))
        assert got[0] == ("frame", (6, len(head) + len(body)), head, frame[:19]), how
        assert got[1] == ("body", body), how
        assert len(reader.fr._buf) <= 19  # only a header/head is ever reassembled, never the body


def test_body_chunks_are_views_into_the_callers_buffer():
    frame = REQ.pack(6, 4 + 100) + b"HEAD" + b"x" * 100
    reader = Reader(REQ, lambda h: (4, h[1] - 4))
    data = memoryview(bytearray(frame))
    reader.fr.feed(data)
    assert [e[0] for e in reader.events] == ["frame", "body"]
    assert reader.views[0].obj is data.obj  # no copy of payload bytes


def test_plan_refusal_propagates_and_nothing_is_emitted():
    def plan(header):
        raise ProtocolRefusal("first_frame_not_hello", "x")

    reader = Reader(REQ, plan)
    with pytest.raises(ProtocolRefusal):
        reader.run([V.DEVICE_COUNT_REQ])
    assert reader.events == []


def test_head_split_across_reads_is_reassembled_once():
    frame = V.ALLOC_REQ_1MIB
    reader = Reader(REQ, whole_head)
    assert reader.run([frame[:12]]) == []
    assert not reader.fr.at_boundary
    assert reader.run([frame[12:]]) == [("frame", (0, 12), frame[9:], frame)]


def test_a_frame_can_change_the_plan_of_the_next_one_in_the_same_read():
    seen = []
    reader = Reader(REQ, lambda h: seen.append(len(reader.events)) or (h[1], 0))
    reader.run([V.DEVICE_COUNT_REQ * 3])
    assert seen == [0, 1, 2]  # each plan ran after the previous frame was delivered


class Pausing(Reader):
    """Pauses after every frame whose command is ``at``."""

    def __init__(self, at: int):
        super().__init__(REQ, whole_head)
        self.at = at

    def on_frame(self, fields, head, raw):
        super().on_frame(fields, head, raw)
        if fields[0] == self.at:
            self.fr.pause()


def test_a_paused_reader_stops_after_the_frame_and_hands_the_rest_back():
    # DEVICE_COUNT (15), then FREE_BUFFER (4) on which it pauses, then GET_BASE (3)
    stream = V.DEVICE_COUNT_REQ + V.FREE_REQ + V.GET_BASE_REQ
    for how, chunks in V.runs(stream, trailing=V.DEVICE_COUNT_REQ):
        reader = Pausing(at=4)
        reader.run(chunks)
        assert [e[1][0] for e in reader.events] == [15, 4], how
        assert reader.fr.paused
        rest = reader.fr.resume()
        assert rest == V.GET_BASE_REQ + (V.DEVICE_COUNT_REQ if how == "trailing" else b""), how
        assert not reader.fr.paused
        reader.fr.feed(memoryview(rest))
        assert [e[1][0] for e in reader.events] == [15, 4, 3] + ([15] if how == "trailing" else []), how
        assert reader.fr.at_boundary


def test_a_reader_paused_mid_chunk_keeps_a_copy_not_a_view():
    buf = bytearray(V.FREE_REQ + V.GET_BASE_REQ)
    reader = Pausing(at=4)
    reader.fr.feed(memoryview(buf))
    buf[:] = bytes(len(buf))  # the caller reuses its buffer
    assert reader.fr.resume() == V.GET_BASE_REQ
