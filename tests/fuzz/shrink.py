"""Make a finding's session small enough to read and to keep in the repository.

How this works: a finding is a list of frames that made the sanitizer server report. Candidates,
smallest first, are tried by the caller's ``reproduces(frames)`` (a real replay through serve
into the sanitizer server) and the first that still gives the same kind of report wins:

1. ``session_cuts``: only the set-up frames (HELLO, ALLOC_BUFFER, BUFFER_GET_BASE, queries) before
   the mutated frame, then the mutated frame and what followed it; then the same with the data of
   every SET_TENSOR zeroed (``wire.encode_frames`` stores trailing zeros as a count).
2. ``graph_cuts`` (a mutated GRAPH_COMPUTE tensor): one node (the mutated tensor or one of its
   direct users) whose srcs are made plain leaves (op NONE, same data, shape and strides); then
   the graph cut down to one node, the mutated
   tensor or one of its direct users, then to every node up to the last of them, each with only
   the tensors its nodes reach through ``src`` and ``view_src``, in their recorded order (a src
   before its users, as serve requires). ggml computes nodes in order, so nodes after the one
   that breaks never matter.
"""

from __future__ import annotations

import struct
from typing import Callable, Iterator

from tests.fuzz.wire import CMD, TENSOR_BYTES, TENSOR_FIELDS, Frame, graph_layout

__all__ = ["session_cuts", "graph_cuts", "shrink"]

SETUP = {CMD[n] for n in ("HELLO", "ALLOC_BUFFER", "BUFFER_GET_BASE", "GET_ALIGNMENT", "GET_MAX_SIZE",
                          "DEVICE_COUNT", "GET_DEVICE_MEMORY")}
SET_TENSOR_HEAD = TENSOR_BYTES + 9
SRC_AT, VIEW_AT, OP_AT = TENSOR_FIELDS["src"][0], TENSOR_FIELDS["view_src"][0], TENSOR_FIELDS["op"][0]


def _zero_data(frames: list[Frame]) -> list[Frame]:
    return [Frame(f.cmd, f.payload[:SET_TENSOR_HEAD] + bytes(len(f.payload) - SET_TENSOR_HEAD), f.answer, f.length)
            if f.cmd == CMD["SET_TENSOR"] and len(f.payload) > SET_TENSOR_HEAD else f for f in frames]


def session_cuts(frames: list[Frame], first_kept: int, offset: int) -> Iterator[tuple[list[Frame], int]]:
    """(frames, new index of frames[first_kept]) candidates, smallest first."""
    small = [f for f in frames[:first_kept] if f.cmd in SETUP]
    at = len(small)
    mutated = min(first_kept + offset, len(frames) - 1)  # offset: of the mutated frame from first_kept
    yield _zero_data(small + frames[first_kept : mutated + 1]), at  # nothing after the mutated frame
    small += frames[first_kept:]
    if len(small) < len(frames):
        yield _zero_data(small), at
        yield small, at
    yield _zero_data(frames), first_kept


def _parts(p: bytes) -> tuple[int, list[int], dict[int, bytes]] | None:
    g = graph_layout(p)
    if g is None:
        return None
    n_nodes, n_tensors, at = g
    nodes = list(struct.unpack_from(f"<{n_nodes}Q", p, 8))
    tensors = {}
    for k in range(n_tensors):
        t = p[at + k * TENSOR_BYTES : at + (k + 1) * TENSOR_BYTES]
        tensors.setdefault(struct.unpack_from("<Q", t)[0], t)
    return struct.unpack_from("<I", p)[0], nodes, tensors


def _refs(t: bytes) -> list[int]:
    return [x for x in struct.unpack_from("<10Q", t, SRC_AT) + struct.unpack_from("<Q", t, VIEW_AT) if x]


def _leaf(t: bytes) -> bytes:
    """The tensor as a leaf: op NONE, no src, no view_src (same data pointer, shape and strides)."""
    b = bytearray(t)
    struct.pack_into("<I", b, OP_AT, 0)
    b[SRC_AT : SRC_AT + 80] = bytes(80)
    b[VIEW_AT : VIEW_AT + 16] = bytes(16)  # view_src and view_offs
    return bytes(b)


def _reach(roots: list[int], tensors: dict[int, bytes]) -> list[int]:
    seen: list[int] = []
    stack = list(roots)
    while stack:
        tid = stack.pop()
        if tid in seen or tid not in tensors:
            continue
        seen.append(tid)
        stack.extend(_refs(tensors[tid]))
    return seen


def _build(device: int, nodes: list[int], tensors: dict[int, bytes], keep: list[int]) -> bytes:
    """The tensors stay in their recorded order (a src comes before its users on the wire)."""
    return (struct.pack("<II", device, len(nodes)) + struct.pack(f"<{len(nodes)}Q", *nodes)
            + struct.pack("<I", len(keep)) + b"".join(t for tid, t in tensors.items() if tid in keep))


def graph_cuts(payload: bytes, target_slot: int) -> Iterator[bytes]:
    """Smaller GRAPH_COMPUTE payloads around the tensor at ``target_slot``, smallest first."""
    parts = _parts(payload)
    g = graph_layout(payload)
    if parts is None or g is None or target_slot >= g[1]:
        return
    device, nodes, tensors = parts
    at = g[2] + target_slot * TENSOR_BYTES
    target = struct.unpack_from("<Q", payload, at)[0]
    # the target node itself and the nodes that use it directly: the op that breaks is one of them
    users = [i for i, n in enumerate(nodes) if n in tensors and (n == target or target in _refs(tensors[n]))][:4]
    for i in users:  # one node whose srcs are plain leaves (their data is already in the buffer)
        node = nodes[i]
        own = {node: tensors[node], **{r: _leaf(tensors[r]) for r in _refs(tensors[node]) if r in tensors}}
        yield _build(device, [node], {t: own[t] for t in tensors if t in own}, list(own))
    for i in users:
        yield _build(device, [nodes[i]], tensors, _reach([nodes[i]], tensors))
    if users:
        yield _build(device, nodes[: users[-1] + 1], tensors, _reach(nodes[: users[-1] + 1], tensors))


def shrink(frames: list[Frame], mutated: int, target_slot: int | None,
           reproduces: Callable[[list[Frame]], bool], tail: int) -> list[Frame]:
    """The smallest candidate that still reproduces (``frames`` itself if none does)."""
    best, best_at = frames, mutated
    first_kept = max(1, min(mutated, len(frames) - 1 - tail))
    for cand, at in session_cuts(frames, first_kept, mutated - first_kept):
        if reproduces(cand):
            best, best_at = cand, at + (mutated - first_kept)
            break
    f = best[best_at] if 0 <= best_at < len(best) else None
    if target_slot is not None and f is not None and f.cmd == CMD["GRAPH_COMPUTE"]:
        for payload in graph_cuts(f.payload, target_slot):
            cand = best[:best_at] + [Frame(f.cmd, payload, f.answer)] + best[best_at + 1:]
            if reproduces(cand):
                return cand
    return best
