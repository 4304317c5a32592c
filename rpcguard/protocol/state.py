"""What the proxy knows about an upstream server and about one session.

How this works: ``UpstreamFacts`` outlives connections. llama.cpp opens several short
connections (HELLO + DEVICE_COUNT, HELLO + GET_DEVICE_MEMORY, ...) before the long one that
carries the model, so server-wide answers (version, device count, alignment, max size) are
cached per upstream and reused by later sessions (spec §2.4, §6.1). ``SessionState`` dies
with its connection: the buffer map learned from ALLOC_BUFFER / BUFFER_GET_BASE replies and
emptied by FREE_BUFFER, and which devices hold a stored graph that GRAPH_RECOMPUTE may rerun.
Both are plain data: the session fills them, the firewall reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rpcguard.protocol.versions import ProtocolSpec, Version

__all__ = ["UpstreamFacts", "Buffer", "SessionState"]


@dataclass(slots=True)
class UpstreamFacts:
    """Server-wide answers cached across connections to one upstream."""

    name: str = ""
    version: Version | None = None
    device_count: int | None = None
    alignment: dict[int, int] = field(default_factory=dict)
    max_size: dict[int, int] = field(default_factory=dict)
    memory: dict[int, tuple[int, int]] = field(default_factory=dict)  # device -> (free, total)

    def learn_version(self, version: Version) -> None:
        """A new version invalidates everything learned from the previous server."""
        if version != self.version:
            self.version = version
            self.device_count = None
            self.alignment.clear()
            self.max_size.clear()
            self.memory.clear()


@dataclass(slots=True)
class Buffer:
    """One server buffer allocated in this session."""

    handle: int
    device: int
    size: int
    base: int | None = None  # learned from BUFFER_GET_BASE

    def contains(self, start: int, length: int) -> bool:
        """True when ``[start, start+length)`` lies inside the buffer (base must be known)."""
        return self.base is not None and self.base <= start and start + length <= self.base + self.size


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
    node_cache: set[bytes] = field(default_factory=set)  # accepted node + source bytes (graph.py)
    unverified_uses: dict[str, int] = field(default_factory=dict)  # allowed ops without a rule, per use
    head_cache: dict[bytes, int] = field(default_factory=dict)  # validated request heads -> body_len

    def device_count(self) -> int:
        """Devices the upstream exposes; 1 before multi-device versions or when unknown."""
        count = self.upstream.device_count
        return count if count is not None else 1

    def add_buffer(self, handle: int, device: int, size: int) -> None:
        self.buffers[handle] = Buffer(handle, device, size)

    def free_buffer(self, handle: int) -> None:
        """Forget a buffer; stored graphs may point into it, so they are no longer rerunnable."""
        self.buffers.pop(handle, None)
        self.graph_devices.clear()
        self.freed_since_graph = True
        self.tensor_cache.clear()
        self.layout_cache.clear()
        self.node_cache.clear()
        self.head_cache.clear()

    def graph_stored(self, device: int) -> None:
        self.graph_devices.add(device)
        self.freed_since_graph = False
