"""Recorded ggml-rpc sessions as frames, and their replay onto a live server (sanitizer fuzzer).

How this works: a recording is the client->server and server->client byte streams of one real
llama.cpp connection. ``parse_session`` cuts the client stream into request frames (cmd:u8 |
len:u64 | payload) and pairs every request that has a response with its recorded answer, so the
buffers the recorded server handed out (ALLOC_BUFFER: handle + size, BUFFER_GET_BASE: base) are
known. A live server hands out other handles and bases; ``Remap`` learns the live values from
the live answers and rewrites every handle and every data pointer inside a known buffer (at the
same offset) before a frame is sent. Mutations are applied to the recorded frames first, so a
mutated pointer or handle that still points into some buffer is translated like a real one,
and one that points nowhere is sent as is.

Field offsets are those of ``rpc_tensor`` (ggml-rpc.cpp:40-57 of the pinned sdist, 296 bytes
packed), the command ids and layouts those of protocol 7.0.0 (rpcguard/protocol/versions.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from rpcguard.protocol.versions import COMMAND_IDS, COMMAND_NAMES, NO_RESPONSE, spec_for

__all__ = ["Frame", "Session", "Remap", "TENSOR_FIELDS", "parse_session", "tensor_slots", "frame_bytes",
           "VERSION", "TENSOR_BYTES", "C2S", "S2C"]

VERSION = (7, 0, 0)
SPEC = spec_for(VERSION)
TENSOR_BYTES = 296
C2S, S2C = 0, 1
MASK64 = (1 << 64) - 1
CMD = COMMAND_IDS

# name -> (offset, struct format, count) inside rpc_tensor
TENSOR_FIELDS: dict[str, tuple[int, str, int]] = {
    "id": (0, "Q", 1), "type": (8, "I", 1), "buffer": (12, "Q", 1), "ne": (20, "I", 4),
    "nb": (36, "I", 4), "op": (52, "I", 1), "op_params": (56, "i", 16), "flags": (120, "i", 1),
    "src": (124, "Q", 10), "view_src": (204, "Q", 1), "view_offs": (212, "Q", 1), "data": (220, "Q", 1),
    "use_count": (292, "i", 1),
}  # fmt: skip
BUFFER_AT, DATA_AT = TENSOR_FIELDS["buffer"][0], TENSOR_FIELDS["data"][0]


@dataclass
class Frame:
    """One request frame of a recorded session; ``answer`` is the recorded response payload."""

    cmd: int
    payload: bytes
    answer: bytes | None = None
    length: int | None = None  # header len when it differs from len(payload) (a mutation)

    @property
    def name(self) -> str:
        return COMMAND_NAMES[self.cmd] if self.cmd < len(COMMAND_NAMES) else f"CMD_{self.cmd}"

    def expects_answer(self) -> bool:
        rule = SPEC.rule(self.cmd)
        return rule is not None and rule.response != NO_RESPONSE


def frame_bytes(f: Frame, payload: bytes | None = None) -> bytes:
    p = f.payload if payload is None else payload
    return struct.pack("<BQ", f.cmd, len(p) if f.length is None else f.length) + p


@dataclass
class Session:
    """A recorded session: the frames in order (HELLO first) and the recorded buffers."""

    frames: list[Frame]
    buffers: dict[int, tuple[int, int]] = field(default_factory=dict)  # handle -> (base, size)

    def to_json(self) -> dict:
        return {"frames": [[f.cmd, f.payload.hex(), f.answer.hex() if f.answer is not None else None, f.length]
                           for f in self.frames],
                "buffers": {str(h): list(v) for h, v in self.buffers.items()}}

    @classmethod
    def from_json(cls, obj: dict) -> "Session":
        frames = [Frame(c, bytes.fromhex(p), bytes.fromhex(a) if a is not None else None, n)
                  for c, p, a, n in obj["frames"]]
        return cls(frames, {int(h): (v[0], v[1]) for h, v in obj["buffers"].items()})


def _response_len(f: Frame) -> int | None:
    rule = SPEC.rule(f.cmd)
    if rule is None or rule.response == NO_RESPONSE:
        return None
    return rule.response


def parse_session(chunks: list[tuple[int, bytes]]) -> Session:
    """Frames of a recorded connection (7.0.0), each with its recorded answer."""
    c2s = b"".join(d for direction, d in chunks if direction == C2S)
    s2c = b"".join(d for direction, d in chunks if direction == S2C)
    frames: list[Frame] = []
    pos = 0
    while pos + 9 <= len(c2s):
        cmd, n = struct.unpack_from("<BQ", c2s, pos)
        if pos + 9 + n > len(c2s):
            break  # cut at the end of the recording
        frames.append(Frame(cmd, c2s[pos + 9 : pos + 9 + n]))
        pos += 9 + n
    rpos = 0
    buffers: dict[int, tuple[int, int]] = {}
    sizes: dict[int, int] = {}
    for f in frames:
        if _response_len(f) is None or rpos + 8 > len(s2c):
            continue
        (n,) = struct.unpack_from("<Q", s2c, rpos)
        f.answer = s2c[rpos + 8 : rpos + 8 + n]
        rpos += 8 + n
        if f.cmd == CMD["ALLOC_BUFFER"] and len(f.answer) == 16:
            handle, size = struct.unpack("<QQ", f.answer)
            sizes[handle] = size
        elif f.cmd == CMD["BUFFER_GET_BASE"] and len(f.answer) == 8:
            (handle,) = struct.unpack_from("<Q", f.payload)
            buffers[handle] = (struct.unpack("<Q", f.answer)[0], sizes.get(handle, 0))
    return Session(frames, buffers)


def tensor_slots(f: Frame) -> list[int]:
    """Byte offsets of every rpc_tensor inside the frame's payload."""
    n = len(f.payload)
    c = f.cmd
    if c in (CMD["SET_TENSOR"], CMD["SET_TENSOR_HASH"], CMD["GET_TENSOR"], CMD["INIT_TENSOR"],
             CMD["MEMSET_TENSOR"]):
        return [0] if n >= TENSOR_BYTES else []
    if c == CMD["COPY_TENSOR"]:
        return [0, TENSOR_BYTES] if n >= 2 * TENSOR_BYTES else []
    if c == CMD["GET_ALLOC_SIZE"]:
        return [4 + i * TENSOR_BYTES for i in range(11) if 4 + (i + 1) * TENSOR_BYTES <= n]
    if c == CMD["GRAPH_COMPUTE"]:
        g = graph_layout(f.payload)
        return [] if g is None else [g[2] + i * TENSOR_BYTES for i in range(g[1])]
    return []


def graph_layout(p: bytes) -> tuple[int, int, int] | None:
    """(n_nodes, n_tensors, offset of the first tensor) of a GRAPH_COMPUTE payload, if well formed."""
    if len(p) < 8:
        return None
    (n_nodes,) = struct.unpack_from("<I", p, 4)
    at = 8 + 8 * n_nodes
    if at + 4 > len(p):
        return None
    (n_tensors,) = struct.unpack_from("<I", p, at)
    at += 4
    n_tensors = min(n_tensors, (len(p) - at) // TENSOR_BYTES)
    return n_nodes, n_tensors, at


class Remap:
    """Recorded handles/bases -> live ones, learned from the live answers of a replay."""

    def __init__(self, recorded: dict[int, tuple[int, int]]) -> None:
        self.recorded = recorded
        self.handles: dict[int, int] = {}  # recorded handle -> live handle
        self.bases: dict[int, int] = {}  # recorded handle -> live base

    def learn(self, sent: Frame, recorded_frame: Frame, live_answer: bytes) -> None:
        """Update the maps from a live answer to a frame the recording answered too."""
        if sent.cmd == CMD["ALLOC_BUFFER"] and len(live_answer) == 16 and recorded_frame.answer:
            old = struct.unpack("<Q", recorded_frame.answer[:8])[0]
            self.handles[old] = struct.unpack("<Q", live_answer[:8])[0]
        elif sent.cmd == CMD["BUFFER_GET_BASE"] and len(live_answer) == 8:
            old = struct.unpack("<Q", recorded_frame.payload[:8])[0]
            self.bases[old] = struct.unpack("<Q", live_answer)[0]

    def handle(self, value: int) -> int:
        return self.handles.get(value, value)

    def pointer(self, value: int) -> int:
        for handle, (base, size) in self.recorded.items():
            if base <= value <= base + size and handle in self.bases:
                return self.bases[handle] + (value - base)
        return value

    def apply(self, f: Frame) -> bytes:
        """The payload of ``f`` with recorded handles and pointers replaced by live ones."""
        p = bytearray(f.payload)
        if f.cmd in (CMD["BUFFER_GET_BASE"], CMD["FREE_BUFFER"], CMD["BUFFER_CLEAR"]) and len(p) >= 8:
            struct.pack_into("<Q", p, 0, self.handle(struct.unpack_from("<Q", p, 0)[0]))
        for at in tensor_slots(f):
            buf = struct.unpack_from("<Q", p, at + BUFFER_AT)[0]
            data = struct.unpack_from("<Q", p, at + DATA_AT)[0]
            struct.pack_into("<Q", p, at + BUFFER_AT, self.handle(buf))
            rec = self.recorded.get(buf)
            if rec is not None and buf in self.bases and data:
                # relative to the tensor's own buffer, so a mutated offset keeps its meaning
                data = (self.bases[buf] + data - rec[0]) & MASK64
            else:
                data = self.pointer(data)
            struct.pack_into("<Q", p, at + DATA_AT, data)
        return bytes(p)


ANSWERS_USED = (CMD["ALLOC_BUFFER"], CMD["BUFFER_GET_BASE"])  # the replay learns live handles from these


def encode_frames(frames: list[Frame], buffers: dict) -> dict:
    """Frames as hex with trailing zeros run-length coded (zeroed tensor data stays small), the
    answers the replay learns live handles from, and the session's buffers (reproducer format)."""
    out = []
    for f in frames:
        body = f.payload.rstrip(b"\x00")
        out.append({"cmd": f.cmd, "name": f.name, "hex": body.hex(), "zeros": len(f.payload) - len(body),
                    "answer": f.answer.hex() if f.answer is not None and f.cmd in ANSWERS_USED else None,
                    "length": f.length})
    return {"frames": out, "buffers": {str(h): list(v) for h, v in buffers.items()}}
