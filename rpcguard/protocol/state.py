"""What the proxy knows about an upstream server and about one session.

How this works: ``UpstreamFacts`` outlives connections. llama.cpp opens several short
connections (HELLO + DEVICE_COUNT, HELLO + GET_DEVICE_MEMORY, ...) before the long one that
carries the model, so server-wide answers (version, device count, alignment, max size) are
cached per upstream and reused by later sessions (spec §2.4, §6.1). ``SessionState`` dies
with its connection: the buffer map learned from ALLOC_BUFFER / BUFFER_GET_BASE replies and
emptied by FREE_BUFFER, the bytes allocated per device (the session's allocation quota), which
SET_TENSOR_HASH requests missed (the only ones a SET_TENSOR may follow with cache_flag=1), and
which devices hold a stored graph that GRAPH_RECOMPUTE may rerun. Both are plain data: the
session fills them, the firewall reads them.

The verdict caches (``tensor_cache``, ``layout_cache``, ``node_cache``, ``head_cache``) hold
verdicts that depend on the buffer map: every change to it (a buffer added, freed, or its base
learned) goes through ``add_buffer``, ``free_buffer`` or ``set_base``, which empty all four.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rpcguard.protocol.versions import TENSOR_BYTES, ProtocolSpec, Version

if TYPE_CHECKING:
    from rpcguard.protocol.tensor import RpcTensor

__all__ = ["UpstreamFacts", "Buffer", "SessionState", "alloc_size_key", "hash_miss_key"]


@dataclass(slots=True)
class UpstreamFacts:
    """Server-wide answers cached across connections to one upstream."""

    name: str = ""
    version: Version | None = None
    device_count: int | None = None
    alignment: dict[int, int] = field(default_factory=dict)
    max_size: dict[int, int] = field(default_factory=dict)
    memory: dict[int, tuple[int, int]] = field(default_factory=dict)  # device -> (free, total)
    # GET_ALLOC_SIZE answers larger than nbytes (backends that pad, e.g. CUDA's quantized rows),
    # by (device, type, ne0..3, nb0..3, op): the server's INIT_TENSOR writes up to that size.
    alloc_sizes: dict[tuple[int, ...], int] = field(default_factory=dict)

    def learn_version(self, version: Version) -> None:
        """A new version invalidates everything learned from the previous server."""
        if version != self.version:
            self.version = version
            self.device_count = None
            self.alignment.clear()
            self.max_size.clear()
            self.memory.clear()
            self.alloc_sizes.clear()


@dataclass(slots=True)
class Buffer:
    """One server buffer allocated in this session."""

    handle: int
    device: int
    size: int
    base: int | None = None  # learned from BUFFER_GET_BASE


@dataclass(slots=True)
class SessionState:
    """Per-connection protocol state shared by the session and the firewall."""

    upstream: UpstreamFacts
    spec: ProtocolSpec | None = None
    buffers: dict[int, Buffer] = field(default_factory=dict)
    graph_devices: set[int] = field(default_factory=set)  # devices with a stored, validated graph
    freed_since_graph: bool = False  # a FREE_BUFFER happened after the last GRAPH_COMPUTE
    tensor_cache: dict[bytes, int] = field(default_factory=dict)  # validated rpc_tensor -> nbytes
    # graph device -> bytes of tensors a kernel touches that passed the layout rule (graph.py)
    layout_cache: dict[int, set[bytes]] = field(default_factory=dict)
    # accepted node + source bytes (graph.py) -> the node's estimated flop (cost.py)
    node_cache: dict[bytes, int] = field(default_factory=dict)
    graph_flops: dict[int, int] = field(default_factory=dict)  # device -> estimate of its stored graph
    compute_flops: int = 0  # estimated flop of every graph computed in this session, recomputes too
    inflight_flops: int = 0  # estimated flop forwarded since the server last answered (session.py)
    unverified_uses: dict[str, int] = field(default_factory=dict)  # allowed ops without a rule, per use
    # Validated request heads, keyed by (command id, head bytes, body_len): see Firewall.check_request.
    head_cache: set[tuple[int, bytes, int]] = field(default_factory=set)
    # ALLOC_BUFFER bytes charged per device: reserved when the request is forwarded, corrected by
    # the answer (refunded when the server returns no buffer), released by FREE_BUFFER.
    alloc_by_device: dict[int, int] = field(default_factory=dict)
    # SET_TENSOR_HASH misses not yet followed by their SET_TENSOR: rpc_tensor bytes + u64 offset.
    hash_misses: set[bytes] = field(default_factory=set)

    def device_count(self) -> int:
        """Devices the upstream exposes; 1 before multi-device versions or when unknown."""
        count = self.upstream.device_count
        return count if count is not None else 1

    @property
    def alloc_total(self) -> int:
        """Bytes this session holds (or has asked for) on all devices."""
        return sum(self.alloc_by_device.values())

    def charge_alloc(self, device: int, size: int) -> None:
        """Add ``size`` (negative: release) to the bytes charged to ``device``."""
        self.alloc_by_device[device] = max(0, self.alloc_by_device.get(device, 0) + size)

    def add_buffer(self, handle: int, device: int, size: int) -> None:
        old = self.buffers.get(handle)
        if old is not None:  # a handle answered twice: the old buffer is gone on the server
            self.charge_alloc(old.device, -old.size)
        self.buffers[handle] = Buffer(handle, device, size)
        self._buffers_changed()

    def set_base(self, handle: int, base: int) -> None:
        """Record a buffer's base (BUFFER_GET_BASE reply); unknown handles are ignored."""
        buf = self.buffers.get(handle)
        if buf is not None and buf.base != base:
            buf.base = base
            self._buffers_changed()

    def free_buffer(self, handle: int) -> None:
        """Forget a buffer; stored graphs may point into it, so they are no longer rerunnable."""
        buf = self.buffers.pop(handle, None)
        if buf is not None:
            self.charge_alloc(buf.device, -buf.size)
        self.graph_devices.clear()
        self.freed_since_graph = True
        self._buffers_changed()

    def _buffers_changed(self) -> None:
        # Cached verdicts were reached against the old buffer map.
        self.tensor_cache.clear()
        self.layout_cache.clear()
        self.node_cache.clear()
        self.head_cache.clear()

    def graph_stored(self, device: int) -> None:
        self.graph_devices.add(device)
        self.freed_since_graph = False


# -- the keys of two caches, written by the command table's learners and read by the firewall
def alloc_size_key(device: int, t: RpcTensor) -> tuple[int, ...]:
    """What a server's allocation size depends on (the client's own cache key, ggml-rpc.cpp:869-887)."""
    return (device, t.type, *t[3:11], t.op)


def hash_miss_key(set_tensor_head: memoryview | bytes) -> bytes:
    """What ties a 7.0.0 SET_TENSOR head to the SET_TENSOR_HASH that missed before it: the
    rpc_tensor and the offset (SET_TENSOR_HASH: rpc_tensor, offset, hash; SET_TENSOR: rpc_tensor,
    cache_flag, offset)."""
    return bytes(set_tensor_head[:TENSOR_BYTES]) + bytes(set_tensor_head[TENSOR_BYTES + 1 : TENSOR_BYTES + 9])
