"""What the proxy knows about an upstream server and about one session.

How this works: ``UpstreamFacts`` holds what a server answered about itself (device count,
alignment, max size, memory, padded sizes, supports_op answers). Those facts belong to the server
process and the session that got them (issue 28): a lying server must not poison the next tenant's
session (a contained serve runs a process per session; a shared server may be restarted or swapped
between sessions), so every session learns into its own copy (``for_session``) of the route's
template. The only fact that flows back to the template is the version, which only words the
refusal of a later HELLO that the server closed (endings.hello_closed_refusal). ``SessionState``
dies with its connection: the buffer map learned from ALLOC_BUFFER / BUFFER_GET_BASE replies and
emptied by FREE_BUFFER, the bytes allocated per device (the session's allocation quota), which
SET_TENSOR_HASH requests missed (the only ones a SET_TENSOR may follow with cache_flag=1), and
which devices hold a stored graph that GRAPH_RECOMPUTE may rerun, with the buffers that graph
references (GHSA-2phh-px2f-2qmx: freeing one of them leaves the server's stored graph dangling).
Both are plain data: the session fills them, the firewall reads them.

The verdict caches (``tensor_cache``, ``layout_cache``, ``node_cache``, ``head_cache``) hold
verdicts that depend on the buffer map: every change to it (a buffer added, freed, or its base
learned) goes through ``add_buffer``, ``free_buffer`` or ``set_base``, which empty all four.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from rpcguard.protocol.versions import TENSOR_BYTES, ProtocolSpec, Version

__all__ = ["UpstreamFacts", "Buffer", "SessionState", "hash_miss_key"]


@dataclass(slots=True)
class UpstreamFacts:
    """A server's answers about itself, as one session learned them (see the module docstring)."""

    name: str = ""
    version: Version | None = None
    device_count: int | None = None
    alignment: dict[int, int] = field(default_factory=dict)
    max_size: dict[int, int] = field(default_factory=dict)
    memory: dict[int, tuple[int, int]] = field(default_factory=dict)  # device -> (free, total)
    # GET_ALLOC_SIZE answers larger than nbytes (backends that pad, e.g. CUDA's quantized rows),
    # by (device, type, ne0..3, nb0..3, op): the server's INIT_TENSOR writes up to that size.
    alloc_sizes: dict[tuple[int, ...], int] = field(default_factory=dict)
    # GET_DEVICE_SUPPORTS_OP answers (>= 7.0.1), by (device, op, type of the op tensor and of
    # src[0..9], -1 where absent): what the server's backend says it computes (issue 29's backend
    # layer reads them). Only the server's own answers, never the proxy's.
    supports_op: dict[tuple[int, int, tuple[int, ...]], bool] = field(default_factory=dict)
    # the route's template this session copy came from (for_session): the version goes back to it
    origin: UpstreamFacts | None = None

    def for_session(self) -> UpstreamFacts:
        """This session's own facts: a copy of what is known before the session (a test's
        seeded facts; nothing in production, where no session writes the template)."""
        return UpstreamFacts(self.name, self.version, self.device_count, dict(self.alignment), dict(self.max_size),
                             dict(self.memory), dict(self.alloc_sizes), dict(self.supports_op), origin=self)

    def learn_version(self, version: Version) -> None:
        """A new version invalidates everything learned from the previous server."""
        if self.origin is not None:
            self.origin.version = version  # wording only (endings.hello_closed_refusal)
        if version != self.version:
            self.version = version
            self.device_count = None
            self.alignment.clear()
            self.max_size.clear()
            self.memory.clear()
            self.alloc_sizes.clear()
            self.supports_op.clear()


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
    # device -> the buffer handles its stored graph references (None: not known, any free counts)
    graph_buffers: dict[int, frozenset[int] | None] = field(default_factory=dict)
    # devices whose stored graph references a buffer freed since (GHSA-2phh-px2f-2qmx), until the
    # next GRAPH_COMPUTE on them
    graph_freed: set[int] = field(default_factory=set)
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
            self._graph_buffer_gone(handle)
        self.buffers[handle] = Buffer(handle, device, size)
        self._buffers_changed()

    def set_base(self, handle: int, base: int) -> None:
        """Record a buffer's base (BUFFER_GET_BASE reply); unknown handles are ignored."""
        buf = self.buffers.get(handle)
        if buf is not None and buf.base != base:
            buf.base = base
            self._buffers_changed()

    def free_buffer(self, handle: int) -> None:
        """Forget a buffer. A server whose stored graphs survive FREE_BUFFER (the version's
        ``stored_graph_survives_free``, GHSA-2phh-px2f-2qmx) would rerun a graph that references
        it on freed memory: that device's graph is marked freed. A fixed server drops every stored
        graph on any FREE_BUFFER (ggml-rpc.cpp of b11434: rpc_server::free_buffer): so does this."""
        buf = self.buffers.pop(handle, None)
        if buf is not None:
            self.charge_alloc(buf.device, -buf.size)
        self._graph_buffer_gone(handle)
        self._buffers_changed()

    def _graph_buffer_gone(self, handle: int) -> None:
        spec = self.spec
        if spec is not None and not spec.stored_graph_survives_free:
            self.graph_devices.clear()
            self.graph_buffers.clear()
            return
        for device, handles in self.graph_buffers.items():
            if handles is None or handle in handles:
                self.graph_freed.add(device)

    def _buffers_changed(self) -> None:
        # Cached verdicts were reached against the old buffer map.
        self.tensor_cache.clear()
        self.layout_cache.clear()
        self.node_cache.clear()
        self.head_cache.clear()

    def graph_stored(self, device: int, buffers: frozenset[int] | None = None) -> None:
        """A GRAPH_COMPUTE went to ``device``: the server stores it for GRAPH_RECOMPUTE.
        ``buffers``: the handles its tensors name (None: unknown, any FREE_BUFFER counts)."""
        self.graph_devices.add(device)
        self.graph_buffers[device] = buffers
        self.graph_freed.discard(device)


# -- the key of a cache written by the command table's learners and read by the firewall (the
# other one, alloc_size_key, is a tensor's: tensor.py)
def hash_miss_key(set_tensor_head: memoryview | bytes) -> bytes:
    """What ties a 7.0.0 SET_TENSOR head to the SET_TENSOR_HASH that missed before it: the
    rpc_tensor and the offset (SET_TENSOR_HASH: rpc_tensor, offset, hash; SET_TENSOR: rpc_tensor,
    cache_flag, offset)."""
    return bytes(set_tensor_head[:TENSOR_BYTES]) + bytes(set_tensor_head[TENSOR_BYTES + 1 : TENSOR_BYTES + 9])
