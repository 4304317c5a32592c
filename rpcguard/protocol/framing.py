"""Incremental reader for length-prefixed frames: header, validated head, streamed body.

How this works: a ggml-rpc frame is a fixed header (``cmd:u8 len:u64`` for requests,
``len:u64`` for responses) and ``len`` payload bytes. The owner of a ``FrameReader`` decides,
per frame, how many payload bytes form the *head* (the part that must be seen whole and
validated before any byte of the frame is forwarded) and how many form the *body* (streamed
through untouched). ``feed()`` turns arbitrary chunks of the byte stream into two kinds of
events:

* ``(FRAME, header, head, raw)``: the header fields, the head as a memoryview, and ``raw``,
  the header and head bytes exactly as received (what to forward unless rewritten).
* ``(BODY, chunk)``: a slice of the body, a memoryview into the caller's buffer.

When a header and head arrive in one chunk, the views point into that chunk: no copy. Only
a head split across reads is copied into a small reassembly buffer, bounded by what
``plan`` accepted. Body bytes are never accumulated, whatever the frame size, so memory
stays flat for multi-GB tensors. The views are valid until the caller reuses its buffer.
"""

from __future__ import annotations

import struct
from typing import Callable

__all__ = ["FRAME", "BODY", "FrameReader"]

FRAME = 0
BODY = 1

# plan(header fields) -> (head_len, body_len); raises a Refusal to reject the frame.
Plan = Callable[[tuple], tuple[int, int]]


class FrameReader:
    """Splits a byte stream into frames; see the module docstring."""

    __slots__ = ("_header", "_hsize", "_plan", "_buf", "_need", "_parsed", "_body", "_body_after")

    def __init__(self, header: struct.Struct, plan: Plan) -> None:
        self._header = header
        self._hsize = header.size
        self._plan = plan
        self._buf = bytearray()  # reassembly of a header/head split across reads
        self._need = header.size  # bytes the reassembly buffer must reach
        self._parsed: tuple | None = None  # header fields once the header is complete
        self._body = 0  # body bytes still to stream
        self._body_after = 0  # body length of the frame being reassembled

    @property
    def at_boundary(self) -> bool:
        """True between frames (nothing partial buffered or streaming)."""
        return not self._buf and not self._body and self._parsed is None

    @property
    def body_remaining(self) -> int:
        return self._body

    def feed(self, data: memoryview) -> list[tuple]:
        """Consume ``data`` whole; return the events it completes, in order."""
        out: list[tuple] = []
        pos = 0
        n = len(data)
        hsize = self._hsize
        while pos < n:
            if self._body:
                take = min(self._body, n - pos)
                out.append((BODY, data[pos : pos + take]))
                self._body -= take
                pos += take
                continue
            if not self._buf and self._parsed is None and n - pos >= hsize:
                # Fast path: the header is contiguous in this chunk.
                fields = self._header.unpack_from(data, pos)
                head_len, body_len = self._plan(fields)
                end = pos + hsize + head_len
                if end <= n:
                    out.append((FRAME, fields, data[pos + hsize : end], data[pos:end]))
                    self._body = body_len
                    pos = end
                    continue
                # Head split across reads: keep what we have and wait for the rest.
                self._parsed = fields
                self._body_after = body_len
                self._need = hsize + head_len
                self._buf += data[pos:]
                return out
            # Slow path: reassemble the header and/or head.
            take = min(self._need - len(self._buf), n - pos)
            self._buf += data[pos : pos + take]
            pos += take
            if len(self._buf) < self._need:
                break
            if self._parsed is None:
                fields = self._header.unpack_from(self._buf, 0)
                head_len, body_len = self._plan(fields)
                self._parsed = fields
                self._body_after = body_len
                self._need = hsize + head_len
                if len(self._buf) < self._need:
                    continue
            raw = memoryview(bytes(self._buf))
            out.append((FRAME, self._parsed, raw[hsize:], raw))
            self._body = self._body_after
            self._buf.clear()
            self._parsed = None
            self._need = hsize
        return out
