"""Mutations of a recorded real session, as plain JSON-able records (sanitizer fuzzer).

How this works: ``Mutator(session, rng).pick()`` returns a ``Mutation``: which frame, what kind,
which field and the new value. ``apply(session, mutation)`` returns the mutated frame list;
the same record applied to the same recording gives the same bytes, so a finding is stored as
(mutation, frames) and replays exactly. Values are drawn from "interesting" sets per field
(0, 1, -1, the int32/uint32 edges, the original +-small deltas, x2, /2) and from values
elsewhere in the same frame (another tensor's id, shape or stride: splices that look real).
Kinds, by weight: tensor fields of GRAPH_COMPUTE tensors (nodes more often than leaves; ne, nb,
type, op, op_params, src, view_src, view_offs, flags, data, buffer, id), coherent reshapes and
retypes (ne and contiguous nb changed together, so the frame stays self-consistent), heads of
SET/GET/COPY/INIT/MEMSET tensor frames (tensor fields, offset, size, body length), buffer handles,
graph node ids and counts, command ids, and session edits (drop, duplicate, swap frames, a
FREE_BUFFER inserted). ALLOC_BUFFER sizes are only ever shrunk (a growing one plus BUFFER_CLEAR
would memset gigabytes on a shared machine).
"""

from __future__ import annotations

import random
import struct
from dataclasses import asdict, dataclass

from rpcguard.protocol.ggml import TYPES, op_table
from tests.fuzz.wire import CMD, TENSOR_BYTES, TENSOR_FIELDS, VERSION, Frame, Session, graph_layout, tensor_slots

__all__ = ["Mutation", "Mutator", "apply"]

OPS = op_table(VERSION)
U32, I32 = (1 << 32) - 1, (1 << 31) - 1
EDGE32 = (0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 64, 255, 256, 511, 512, 4096, 65535, 65536, I32, I32 + 1, U32, U32 - 1)
FLOAT_BITS = [struct.unpack("<i", struct.pack("<f", x))[0] for x in (0.0, 1.0, -1.0, 1e30, -1e30, float("inf"),
                                                                          float("-inf"), float("nan"))]


@dataclass
class Mutation:
    frame: int  # index in the recorded frame list
    kind: str  # tensor_field, reshape, retype, scalar, body_len, cmd, drop, dup, swap, insert_free
    field: str = ""  # tensor field or scalar name
    slot: int = 0  # which tensor of the frame (tensor kinds) / byte offset (scalar)
    elem: int = 0  # element of an array field
    value: int = 0  # new value (fields), new length (body_len), new command (cmd)
    fmt: str = ""  # struct format of a scalar
    extra: tuple = ()  # reshape: the new ne

    def to_json(self) -> dict:
        d = asdict(self)
        d["extra"] = list(self.extra)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Mutation":
        return cls(**{**d, "extra": tuple(d.get("extra", ()))})

    def describe(self, frames: list[Frame]) -> str:
        name = frames[self.frame].name if self.frame < len(frames) else "?"
        if self.kind == "tensor_field":
            return f"{name}#{self.frame} tensor {self.slot} {self.field}[{self.elem}] = {self.value:#x}"
        if self.kind in ("reshape", "retype"):
            return f"{name}#{self.frame} tensor {self.slot} {self.kind} type={self.value} ne={list(self.extra)}"
        if self.kind == "scalar":
            return f"{name}#{self.frame} {self.field} @{self.slot} = {self.value:#x}"
        return f"{name}#{self.frame} {self.kind} {self.value}"


def _get(p: bytes, at: int, name: str, elem: int = 0) -> int:
    off, fmt, _ = TENSOR_FIELDS[name]
    return struct.unpack_from("<" + fmt, p, at + off + elem * struct.calcsize(fmt))[0]


def _put(p: bytearray, at: int, name: str, elem: int, value: int) -> None:
    off, fmt, _ = TENSOR_FIELDS[name]
    size = struct.calcsize(fmt)
    struct.pack_into("<" + fmt.upper(), p, at + off + elem * size, value & ((1 << (8 * size)) - 1))


def _contiguous(type_id: int, ne: tuple[int, ...]) -> list[int]:
    info = TYPES.get(type_id)
    bs, ts = (info.blck_size, info.type_size) if info else (1, 4)
    nb = [ts, ts * (ne[0] // bs)]
    nb += [nb[1] * ne[1], nb[1] * ne[1] * ne[2]]
    return [x & U32 for x in nb]


class Mutator:
    """Draws mutations for one recorded session."""

    def __init__(self, session: Session, rng: random.Random) -> None:
        self.s, self.rng = session, rng
        frames = session.frames
        self.graphs = [i for i, f in enumerate(frames) if f.cmd == CMD["GRAPH_COMPUTE"]]
        self.heads = [i for i, f in enumerate(frames) if tensor_slots(f) and f.cmd != CMD["GRAPH_COMPUTE"]]
        self.handles = [i for i, f in enumerate(frames)
                        if f.cmd in (CMD["BUFFER_GET_BASE"], CMD["FREE_BUFFER"], CMD["BUFFER_CLEAR"])]
        self.others = [i for i, f in enumerate(frames) if i > 0]

    # values --------------------------------------------------------------------------------
    def _value(self, name: str, orig: int, frame: Frame, at: int) -> int:
        r = self.rng
        slots = tensor_slots(frame)
        other = r.choice(slots) if slots else at
        if name in ("src", "view_src", "id"):
            return r.choice([0, _get(frame.payload, other, "id"), _get(frame.payload, at, "id"),
                             orig + 8, r.getrandbits(64), 1])
        if name == "type":
            return r.choice(list(TYPES) + [4, 31, 40, 41, 42, 43, 44, U32, orig])
        if name == "op":
            return r.randrange(OPS.count + 3) if OPS and r.random() < 0.9 else r.choice([U32, I32])
        if name == "op_params":
            return r.choice([*EDGE32, -1, -2, -I32 - 1, orig + 1, orig - 1, -orig, orig * 2, *FLOAT_BITS,
                             r.getrandbits(32)])
        if name == "flags":
            return r.choice([0, 1, 2, 4, 8, 16, 32, -1, orig ^ (1 << r.randrange(6))])
        if name in ("view_offs", "data"):
            step = r.choice([1, 2, 4, 16, 32, 256, 4096, 1 << 20, 1 << 32, 1 << 63])
            return r.choice([orig + step, orig - step, 0, orig * 2, orig ^ step, (1 << 64) - step])
        if name == "buffer":
            handles = [h for h in self.s.buffers] or [orig]
            return r.choice([0, r.choice(handles), orig + 8, orig ^ 0x1000, r.getrandbits(64)])
        if name == "use_count":
            return r.choice([0, -1, 1, 2, I32, orig + 1])
        if name in ("ne", "nb"):
            splice = _get(frame.payload, other, name, r.randrange(4))
            return r.choice([*EDGE32, orig + 1, orig - 1, orig * 2, orig // 2, splice, orig * 3])
        return r.getrandbits(32)

    # kinds -----------------------------------------------------------------------------------
    def _tensor(self, i: int) -> Mutation:
        r, f = self.rng, self.s.frames[i]
        slots = tensor_slots(f)
        slot = r.randrange(len(slots))
        if f.cmd == CMD["GRAPH_COMPUTE"] and r.random() < 0.7:  # prefer nodes (tensors with an op)
            nodes = [k for k, at in enumerate(slots) if _get(f.payload, at, "op") != 0]
            slot = r.choice(nodes) if nodes else slot
        at = slots[slot]
        u = r.random()
        if u < 0.12:  # coherent reshape: ne and contiguous nb together
            ne = [_get(f.payload, at, "ne", k) for k in range(4)]
            k = r.randrange(4)
            ne[k] = r.choice([0, 1, 2, ne[k] + 1, ne[k] * 2, max(ne[k] // 2, 1), ne[k] + 32, 3, 1 << 16])
            return Mutation(i, "reshape", slot=slot, value=_get(f.payload, at, "type"), extra=tuple(ne))
        if u < 0.2:  # coherent retype
            ne = tuple(_get(f.payload, at, "ne", k) for k in range(4))
            return Mutation(i, "retype", slot=slot, value=r.choice(list(TYPES)), extra=ne)
        names = ["ne", "nb", "type", "op", "op_params", "op_params", "op_params", "src", "view_src", "view_offs",
                 "flags", "data", "buffer", "id", "use_count"]
        name = r.choice(names)
        n = TENSOR_FIELDS[name][2]
        elem = r.randrange(n) if name != "src" or r.random() < 0.3 else r.randrange(3)
        orig = _get(f.payload, at, name, elem)
        return Mutation(i, "tensor_field", name, slot, elem, self._value(name, orig, f, at))

    def _scalar(self, i: int) -> Mutation:
        r, f = self.rng, self.s.frames[i]
        p = f.payload
        fields: list[tuple[str, int, str]] = []
        c = f.cmd
        if c == CMD["SET_TENSOR"]:
            fields = [("cache_flag", TENSOR_BYTES, "B"), ("offset", TENSOR_BYTES + 1, "Q")]
        elif c in (CMD["GET_TENSOR"], CMD["SET_TENSOR_HASH"]):
            fields = [("offset", TENSOR_BYTES, "Q"), ("size_or_hash", TENSOR_BYTES + 8, "Q")]
        elif c == CMD["MEMSET_TENSOR"]:
            fields = [("offset", TENSOR_BYTES, "Q"), ("size", TENSOR_BYTES + 8, "Q")]
        elif c in (CMD["BUFFER_GET_BASE"], CMD["FREE_BUFFER"], CMD["BUFFER_CLEAR"]):
            fields = [("handle", 0, "Q")]
        elif c == CMD["GRAPH_COMPUTE"]:
            g = graph_layout(p)
            fields = [("device", 0, "I"), ("n_nodes", 4, "I")]
            if g:
                fields += [("n_tensors", g[2] - 4, "I")] + [("node_id", 8 + 8 * k, "Q") for k in range(min(g[0], 64))]
        elif c in (CMD["GRAPH_RECOMPUTE"], CMD["GET_ALIGNMENT"], CMD["GET_MAX_SIZE"], CMD["GET_DEVICE_MEMORY"],
                   CMD["GET_ALLOC_SIZE"]):
            fields = [("device", 0, "I")]
        elif c == CMD["ALLOC_BUFFER"]:
            fields = [("device", 0, "I")]
        if not fields or len(p) < max(at + struct.calcsize(fmt) for _, at, fmt in fields):
            return self._session_edit(i)
        name, at, fmt = r.choice(fields)
        orig = struct.unpack_from("<" + fmt, p, at)[0]
        step = r.choice([1, 4, 16, 32, 64, 1024, 1 << 20, 1 << 32, 1 << 63])
        bits = 8 * struct.calcsize(fmt)
        if name == "handle":
            value = r.choice([0, orig + 8, orig ^ 0x10, r.choice(list(self.s.buffers) or [orig])])
        elif name == "node_id":
            ids = [_get(p, a, "id") for a in tensor_slots(f)]
            value = r.choice([0, orig + 1, r.choice(ids) if ids else 0, r.getrandbits(64)])
        else:
            value = r.choice([0, 1, orig + step, orig - step, orig * 2, orig // 2, (1 << bits) - 1, 1 << (bits - 1)])
        return Mutation(i, "scalar", name, at, value=value & ((1 << bits) - 1), fmt=fmt)

    def _session_edit(self, i: int) -> Mutation:
        r, f = self.rng, self.s.frames[i]
        kind = r.choice(["drop", "dup", "swap", "insert_free", "cmd", "body_len"])
        if kind == "cmd":
            return Mutation(i, "cmd", value=r.randrange(20))
        if kind == "body_len":
            n = len(f.payload)
            return Mutation(i, "body_len", value=r.choice([0, max(n - 1, 0), n + 1, n + 8, n // 2, n + 296]))
        if kind == "insert_free":
            return Mutation(i, "insert_free", value=r.choice(list(self.s.buffers) or [0]))
        return Mutation(i, kind)

    def pick(self) -> Mutation:
        r = self.rng
        u = r.random()
        if u < 0.5 and self.graphs:
            return self._tensor(r.choice(self.graphs))
        if u < 0.72 and self.heads:
            return self._tensor(r.choice(self.heads))
        if u < 0.9:
            pool = self.graphs + self.heads + self.handles if r.random() < 0.7 else self.others
            return self._scalar(r.choice(pool or self.others))
        return self._session_edit(r.choice(self.others))


def apply(session: Session, m: Mutation) -> list[Frame]:
    """The recorded frames with ``m`` applied (the recording itself is not changed)."""
    frames = list(session.frames)
    f = frames[m.frame]
    p = bytearray(f.payload)
    if m.kind in ("tensor_field", "reshape", "retype"):
        slots = tensor_slots(f)
        if m.slot >= len(slots):
            return frames
        at = slots[m.slot]
        if m.kind == "tensor_field":
            _put(p, at, m.field, m.elem, m.value)
        else:
            for k in range(4):
                _put(p, at, "ne", k, m.extra[k])
            _put(p, at, "type", 0, m.value)
            for k, nb in enumerate(_contiguous(m.value, m.extra)):
                _put(p, at, "nb", k, nb)
        frames[m.frame] = Frame(f.cmd, bytes(p), f.answer, f.length)
    elif m.kind == "scalar":
        struct.pack_into("<" + m.fmt, p, m.slot, m.value)
        frames[m.frame] = Frame(f.cmd, bytes(p), f.answer, f.length)
    elif m.kind == "body_len":
        new = bytes(p[: m.value]) + bytes(max(0, m.value - len(p)))
        frames[m.frame] = Frame(f.cmd, new, f.answer, f.length)
    elif m.kind == "cmd":
        frames[m.frame] = Frame(m.value, f.payload, f.answer, f.length)
    elif m.kind == "drop":
        del frames[m.frame]
    elif m.kind == "dup":
        frames.insert(m.frame, f)
    elif m.kind == "swap" and m.frame + 1 < len(frames):
        frames[m.frame], frames[m.frame + 1] = frames[m.frame + 1], frames[m.frame]
    elif m.kind == "insert_free":
        frames.insert(m.frame, Frame(CMD["FREE_BUFFER"], struct.pack("<Q", m.value & ((1 << 64) - 1))))
    return frames
