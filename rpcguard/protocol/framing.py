"""Incremental reader for length-prefixed frames: header, validated head, streamed body.

How this works: a ggml-rpc frame is a fixed header (``cmd:u8 len:u64`` for requests,
``len:u64`` for responses) and ``len`` payload bytes. The owner of a ``FrameReader`` decides,
per frame, how many payload bytes form the *head* (the part that must be seen whole and
validated before any byte of the frame is forwarded) and how many form the *body* (streamed
through untouched). ``feed()`` turns arbitrary chunks of the byte stream into two callbacks,
made in stream order and before the next frame is planned (so a frame can change the rules
for the one after it, as HELLO does):

* ``on_frame(header, head, raw)``: the header fields, the head as a memoryview, and ``raw``,
  the header and head bytes exactly as received (what to forward unless rewritten).
* ``on_body(chunk)``: a slice of the body, a memoryview into the caller's buffer.

When a header and head arrive in one chunk, the views point into that chunk: no copy. Only
a head split across reads is copied into a small reassembly buffer, bounded by what
``plan`` accepted. Body bytes are never accumulated, whatever the frame size, so memory
stays flat for multi-GB tensors. The views are valid until the caller reuses its buffer.

``on_frame`` may call ``pause()``: the reader then stops right after that frame and keeps the
rest of the chunk, and of any chunk fed while it is paused, as a copy; ``resume()`` hands those
bytes back to be fed again (the session validates a large graph off the event loop this way,
protocol/session.py).
"""

from __future__ import annotations

import struct
from typing import Any, Callable

__all__ = ["FrameReader"]

# plan(header fields) -> (head_len, body_len); raises a Refusal to reject the frame. The fields are
# the header struct's: (command, size) for requests, (size,) for responses; each reader's callbacks
# take their own shape, so the shared alias leaves it open.
Fields = Any
Plan = Callable[[Fields], tuple[int, int]]
OnFrame = Callable[[Fields, memoryview, memoryview], None]
OnBody = Callable[[memoryview], None]


class FrameReader:
    """Splits a byte stream into frames; see the module docstring."""

    __slots__ = ("_header", "_hsize", "_plan", "_on_frame", "_on_body", "_buf", "_need", "_parsed", "_body",
                 "_body_after",
                 "_paused", "_rest")

    def __init__(self, header: struct.Struct, plan: Plan, on_frame: OnFrame, on_body: OnBody) -> None:
        self._header = header
        self._hsize = header.size
        self._plan = plan
        self._on_frame = on_frame
        self._on_body = on_body
        self._buf = bytearray()  # reassembly of a header/head split across reads
        self._need = header.size  # bytes the reassembly buffer must reach
        self._parsed: tuple[int, ...] | None = None  # header fields once the header is complete
        self._body = 0  # body bytes still to stream
        self._body_after = 0  # body length of the frame being reassembled
        self._paused = False
        self._rest = bytearray()  # bytes after the frame that paused the reader, not parsed yet

    @property
    def at_boundary(self) -> bool:
        """True between frames (nothing partial buffered or streaming)."""
        return not self._buf and not self._body and self._parsed is None

    @property
    def body_remaining(self) -> int:
        return self._body

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Stop after the frame being called back (from ``on_frame`` only)."""
        self._paused = True

    def resume(self) -> bytes:
        """Unpause; returns the bytes kept meanwhile, for the caller to feed."""
        self._paused = False
        rest = bytes(self._rest)
        self._rest.clear()
        return rest

    def feed(self, data: memoryview) -> None:
        """Consume ``data`` whole, calling back for every frame head and body slice it completes
        (while paused, only keep it)."""
        if self._paused:
            self._rest += data
            return
        pos = 0
        n = len(data)
        hsize = self._hsize
        while pos < n:
            if self._body:
                take = min(self._body, n - pos)
                self._body -= take
                self._on_body(data[pos : pos + take])
                pos += take
                continue
            if not self._buf and self._parsed is None and n - pos >= hsize:
                # Fast path: the header is contiguous in this chunk.
                fields = self._header.unpack_from(data, pos)
                head_len, body_len = self._plan(fields)
                end = pos + hsize + head_len
                if end <= n:
                    self._body = body_len
                    self._on_frame(fields, data[pos + hsize : end], data[pos:end])
                    pos = end
                    if self._paused:
                        self._rest += data[pos:]
                        return
                    continue
                # Head split across reads: keep what we have and wait for the rest.
                self._parsed = fields
                self._body_after = body_len
                self._need = hsize + head_len
                self._buf += data[pos:]
                return
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
            fields = self._parsed
            self._body = self._body_after
            self._buf.clear()
            self._parsed = None
            self._need = hsize
            self._on_frame(fields, raw[hsize:], raw)
            if self._paused:
                self._rest += data[pos:]
                return
