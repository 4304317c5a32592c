"""Tensors and a session for the graph validator's unit tests (protocol 7.0.0): one buffer of
``SIZE`` bytes at ``BASE``, each tensor at its own 64 KiB slot by default."""

from __future__ import annotations

import struct

from rpcguard.protocol.encode import TensorSpec
from rpcguard.protocol.ggml import TYPES, op_table
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.versions import spec_for

__all__ = ["HANDLE", "BASE", "SIZE", "V7", "OPS", "f", "state", "T"]

HANDLE, BASE, SIZE = 0x5555DEADBE00, 0x7F0000000000, 1 << 24
V7 = (7, 0, 0)
OPS = op_table(V7).ids  # type: ignore[union-attr]


def f(x: float) -> int:
    """The int32 op_params slot of the float ``x``."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def state(alignment: int | None = None, size: int = SIZE) -> SessionState:
    """A 7.0.0 session with the one buffer (its base known) and, if given, the device's alignment."""
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    st.add_buffer(HANDLE, 0, size)
    st.buffers[HANDLE].base = BASE
    if alignment is not None:
        st.upstream.alignment[0] = alignment
    return st


def T(id: int, type: int = 0, ne=(4, 1, 1, 1), **kw) -> TensorSpec:  # type: ignore[no-untyped-def]
    """A tensor in the buffer (type F32 by default), at ``BASE + (id & 0xFF) * 64 KiB`` unless ``data`` is given."""
    info = TYPES[type]
    kw.setdefault("buffer", HANDLE)
    kw.setdefault("data", BASE + (id & 0xFF) * 0x10000)
    return TensorSpec(id=id, type=type, ne=ne, type_size=info.type_size, blck_size=info.blck_size, **kw)
