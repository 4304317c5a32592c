"""Builders for ggml-rpc frames: the writer half of the sans-IO layer.

Used by ``rpcguard check`` (HELLO + DEVICE_COUNT probes), by the refusal answer, and by
tests, benchmarks and the exploit corpus to build frames with code instead of binary blobs.
All integers are little-endian and packed, as on the wire (spec §2.1).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from rpcguard.protocol.versions import COMMAND_IDS, HELLO, HELLO_CAPS_SINCE, TENSOR_BYTES, Version

__all__ = [
    "TensorSpec",
    "pack_tensor",
    "request",
    "response",
    "hello_request",
    "hello_response",
    "graph_payload",
    "TENSOR_STRUCT",
]

# id, type, buffer, ne[4], nb[4], op, op_params[16], flags, src[10], view_src, view_offs, data,
# name[64], use_count (padding before 5.1.0).
TENSOR_STRUCT = struct.Struct("<QIQ4I4II16iI10QQQQ64si")
assert TENSOR_STRUCT.size == TENSOR_BYTES

_REQ_HEADER = struct.Struct("<BQ")
_RSP_HEADER = struct.Struct("<Q")


@dataclass
class TensorSpec:
    """A serialized ``rpc_tensor`` with friendly defaults (a 4-element F32 tensor)."""

    id: int = 0x1000
    type: int = 0
    buffer: int = 0
    ne: tuple[int, int, int, int] = (4, 1, 1, 1)
    nb: tuple[int, int, int, int] | None = None  # None: contiguous strides for the type
    op: int = 0
    op_params: tuple[int, ...] = ()
    flags: int = 0
    src: tuple[int, ...] = ()
    view_src: int = 0
    view_offs: int = 0
    data: int = 0
    name: bytes = b"t"
    use_count: int = 0
    type_size: int = 4  # used only to derive default strides
    blck_size: int = 1

    def strides(self) -> tuple[int, int, int, int]:
        if self.nb is not None:
            return self.nb
        nb0 = self.type_size
        nb1 = nb0 * (self.ne[0] // self.blck_size)
        nb2 = nb1 * self.ne[1]
        nb3 = nb2 * self.ne[2]
        return (nb0, nb1, nb2, nb3)


def pack_tensor(t: TensorSpec | None) -> bytes:
    """296 bytes of ``rpc_tensor``; None packs the all-zero null tensor."""
    if t is None:
        return bytes(TENSOR_BYTES)
    params = (tuple(t.op_params) + (0,) * 16)[:16]
    src = (tuple(t.src) + (0,) * 10)[:10]
    return TENSOR_STRUCT.pack(
        t.id, t.type, t.buffer, *t.ne, *t.strides(), t.op, *params, t.flags, *src,
        t.view_src, t.view_offs, t.data, t.name, t.use_count,
    )  # fmt: skip


def request(cmd: int | str, payload: bytes = b"", *, length: int | None = None) -> bytes:
    """A request frame; ``length`` overrides the header's len field (for malformed frames)."""
    cmd_id = COMMAND_IDS[cmd] if isinstance(cmd, str) else cmd
    n = len(payload) if length is None else length
    return _REQ_HEADER.pack(cmd_id, n) + payload


def response(payload: bytes = b"", *, length: int | None = None) -> bytes:
    """A response frame (responses carry no command id)."""
    return _RSP_HEADER.pack(len(payload) if length is None else length) + payload


def hello_request(version: Version = (7, 0, 0), caps: bytes = bytes(24)) -> bytes:
    """The HELLO a client of ``version`` sends (24 caps bytes since 4.0.0, empty before)."""
    return request(HELLO, caps if version >= HELLO_CAPS_SINCE else b"")


def hello_response(version: Version, *, new_layout: bool | None = None, caps: bytes = bytes(24)) -> bytes:
    """The HELLO reply announcing ``version``; ``new_layout`` picks the >= 4.0.0 28-byte form."""
    if new_layout is None:
        new_layout = version >= HELLO_CAPS_SINCE
    payload = bytes(version)
    if new_layout:
        payload += b"\x00" + caps
    return response(payload)


def graph_payload(
    nodes: list[int], tensors: list[TensorSpec], *, device: int | None = 0
) -> bytes:
    """GRAPH_COMPUTE payload; ``device=None`` gives the pre-3.0.0 layout without a device."""
    head = b"" if device is None else struct.pack("<I", device)
    return (
        head
        + struct.pack("<I", len(nodes))
        + struct.pack(f"<{len(nodes)}Q", *nodes)
        + struct.pack("<I", len(tensors))
        + b"".join(pack_tensor(t) for t in tensors)
    )
