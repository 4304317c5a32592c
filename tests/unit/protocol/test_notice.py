"""The end notice (protocol/notice.py): its bytes, its decoding, and FrameReader carrying it
whole, byte by byte and with trailing data."""

import struct

import pytest

from rpcguard.errors import UPSTREAM, ProtocolRefusal
from rpcguard.protocol.framing import FrameReader
from rpcguard.protocol.notice import NOTICE_BYTES, NOTICE_HEAD, NOTICE_SIZE, Notice, decode_notice, encode_notice
from rpcguard.reasons import REFUSAL_REASONS
from tests.support import vectors as V

RSP = struct.Struct("<Q")
# A notice written out by hand: the size field is the bytes \xff\xffrgEND\x01, then reason NUL detail.
HAND = b"\xff\xffrgEND\x01" + (b"idle_while_waiting\0held 21 s while 1 waited").ljust(NOTICE_HEAD, b"\0")


def test_the_bytes_are_the_documented_ones():
    assert encode_notice("idle_while_waiting", "held 21 s while 1 waited") == HAND
    assert len(HAND) == NOTICE_BYTES
    assert RSP.unpack_from(HAND)[0] == NOTICE_SIZE > 1 << 56  # no response is that large (64 PiB)


def test_round_trip_and_a_long_detail_is_cut_on_a_character():
    detail = "é" * 400
    raw = encode_notice("certificate_revoked", detail)
    assert len(raw) == NOTICE_BYTES
    got = decode_notice(raw[8:])
    assert got.reason == "certificate_revoked" and detail.startswith(got.detail) and len(got.detail) > 100


def test_control_characters_of_a_detail_are_not_sent():
    assert decode_notice(encode_notice("shutdown", "a\nb\tc\x1b")[8:]) == Notice("shutdown", "a b c ")


@pytest.mark.parametrize("reason", ["", "Refused", "x" * 65, "bad reason", "naïve"])
def test_a_reason_that_is_no_reason_string_is_not_encoded(reason):
    with pytest.raises((ValueError, UnicodeEncodeError)):
        encode_notice(reason, "")


@pytest.mark.parametrize("head, why", [
    (bytes(NOTICE_HEAD), "without a reason"),
    (b"NotAReason\0".ljust(NOTICE_HEAD, b"\0"), "without a reason"),
    (b"x" * NOTICE_HEAD, "without a reason"),
    (b"ok\0a\0b".ljust(NOTICE_HEAD, b"\0"), "after its padding"),
    (b"ok\0\xff\xfe".ljust(NOTICE_HEAD, b"\0"), "not UTF-8"),
    (b"ok\0line\nfake=1".ljust(NOTICE_HEAD, b"\0"), "control characters"),
    (b"ok\0short", "bytes, expected"),
])
def test_a_malformed_notice_is_the_nodes_fault(head, why):
    with pytest.raises(ProtocolRefusal) as exc:
        decode_notice(head)
    assert exc.value.reason == "notice_invalid" and why in exc.value.detail
    assert exc.value.party == UPSTREAM
    assert "notice_invalid" in REFUSAL_REASONS


def test_frame_reader_carries_a_notice_whole_bytewise_and_with_trailing_data():
    def plan(fields):
        return (NOTICE_HEAD, 0) if fields[0] == NOTICE_SIZE else (fields[0], 0)

    for how, chunks in V.runs(HAND, trailing=V.GET_ALIGNMENT_RSP_32):
        got = []
        fr = FrameReader(RSP, plan, lambda f, head, raw: got.append((f[0], bytes(head))), lambda c: None)
        for c in chunks:
            fr.feed(memoryview(c))
        assert got[0] == (NOTICE_SIZE, HAND[8:]), how
        assert decode_notice(got[0][1]) == Notice("idle_while_waiting", "held 21 s while 1 waited")
        assert len(got) == (2 if how == "trailing" else 1) and fr.at_boundary, how
