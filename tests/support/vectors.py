"""Byte vectors from the protocol spec (§8), and the whole / byte-by-byte / trailing runner."""

from __future__ import annotations

from typing import Iterable

H = bytes.fromhex

HELLO_REQ_V4 = H("0e 18 00 00 00 00 00 00 00") + bytes(24)
HELLO_RSP_510 = H("1c 00 00 00 00 00 00 00 05 01 00 00") + bytes(24)
HELLO_RSP_700 = H("1c 00 00 00 00 00 00 00 07 00 00 00") + bytes(24)
HELLO_REQ_RDMA = H("0e 18 00 00 00 00 00 00 00 34 12 00 00 34 12 00 00 00 00 00 00 00 00 00 00 00 00 ff ff 0a 00 00 05")
HELLO_REQ_V1 = H("0e 00 00 00 00 00 00 00 00")
HELLO_RSP_361 = H("03 00 00 00 00 00 00 00 03 06 01")
DEVICE_COUNT_REQ = H("0f 00 00 00 00 00 00 00 00")
DEVICE_COUNT_RSP_2 = H("04 00 00 00 00 00 00 00 02 00 00 00")
GET_ALIGNMENT_REQ = H("01 04 00 00 00 00 00 00 00 00 00 00 00")
GET_ALIGNMENT_RSP_32 = H("08 00 00 00 00 00 00 00 20 00 00 00 00 00 00 00")
GET_DEVICE_MEMORY_REQ_1 = H("0b 04 00 00 00 00 00 00 00 01 00 00 00")
GET_DEVICE_MEMORY_RSP = H("10 00 00 00 00 00 00 00 00 00 00 00 02 00 00 00 00 00 00 00 06 00 00 00")
ALLOC_REQ_1MIB = H("00 0c 00 00 00 00 00 00 00 00 00 00 00 00 00 10 00 00 00 00 00")
ALLOC_RSP = H("10 00 00 00 00 00 00 00 00 be ad de 55 55 00 00 00 00 10 00 00 00 00 00")
ALLOC_RSP_FAILED = H("10 00 00 00 00 00 00 00") + bytes(16)
GET_BASE_REQ = H("03 08 00 00 00 00 00 00 00 00 be ad de 55 55 00 00")
GET_BASE_RSP = H("08 00 00 00 00 00 00 00 00 00 00 00 00 7f 00 00")
FREE_REQ = H("04 08 00 00 00 00 00 00 00 00 be ad de 55 55 00 00")
RECOMPUTE_REQ_0 = H("10 04 00 00 00 00 00 00 00 00 00 00 00")
HANDLE = 0x00005555DEADBE00
BASE = 0x00007F0000000000


def runs(data: bytes, trailing: bytes = b"") -> Iterable[tuple[str, list[bytes]]]:
    """The ways a test feeds one vector: whole, byte by byte, and followed by trailing bytes."""
    yield "whole", [data]
    yield "bytewise", [data[i : i + 1] for i in range(len(data))]
    if trailing:
        yield "trailing", [data + trailing]


def take(chunks: list) -> bytes:
    """What a list of frames (views or bytes) holds, joined; the list is emptied."""
    data = b"".join(bytes(c) for c in chunks)
    chunks.clear()
    return data
