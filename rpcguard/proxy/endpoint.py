"""One side of a proxied link: the asyncio protocol that reads and writes, and the dialer.

How this works: an ``Endpoint`` is the ``BufferedProtocol`` of one transport of a ``link.Link``
(the client's, or the upstream's once dialled). It reads into a preallocated buffer (TLS
decrypts straight into it) and hands each read to the link as a memoryview, so a payload byte is
never copied by Python code; a transport may keep a memoryview queued (uvloop does not copy), so
when the destination still holds unsent data after a write the link switches the source to a
fresh buffer. Flow control: when the destination's write buffer passes its high-water mark the
link pauses the source until it drains, so memory stays flat whatever the tensor size. ``dial``
opens the upstream (plain TCP to serve's loopback server, TLS to connect's node) and turns
failures into refusals with a stable reason; ``check_node`` checks the node's certificate usage.
The link writes (proxy/link.py): a list of chunks, small ones joined into one write (one TLS
record, ``JOIN_MAX_BYTES``).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any, Awaitable, Callable, Protocol

from rpcguard.errors import Refusal
from rpcguard.pki.identity import check_usage
from rpcguard.protocol.settings import Limits
from rpcguard.proxy.route import Route
from rpcguard.pki.tls import classify_handshake_error, peer_identity

__all__ = ["Endpoint", "LinkPort", "Dialer", "dial", "check_node", "READ_BUFFER_BYTES", "WRITE_HIGH_WATER_BYTES",
           "WRITE_LOW_WATER_BYTES", "JOIN_MAX_BYTES", "FAIR_READ_BYTES"]

# A side that floods small frames reads this much at a time, one read per loop turn (proxy/link.py,
# loop fairness): ~450 GET_ALIGNMENTs, well under a millisecond of work.
FAIR_READ_BYTES = 4 * 1024
# One read lands in this buffer. 256 KiB: large enough that a multi-MB SET_TENSOR costs a few
# Python calls per MB, small enough that many sessions stay cheap.
READ_BUFFER_BYTES = 256 * 1024
# A destination holding more than this unsent stops the source from reading (flow control);
# with the read buffer this bounds per-session memory to a few MB.
WRITE_HIGH_WATER_BYTES = 2 * 1024 * 1024
WRITE_LOW_WATER_BYTES = 512 * 1024

# Several small frames queued in one turn are joined into one write: a TLS transport makes a
# record (and often a syscall) per element of writelines(). Large chunks are never copied.
JOIN_MAX_BYTES = 64 * 1024

class LinkPort(Protocol):
    """What an ``Endpoint`` needs of its link (proxy/link.py's ``Link``): whom it dials for, and
    where its transport's callbacks go."""

    @property
    def id(self) -> int: ...
    @property
    def identity(self) -> str: ...
    def made(self, endpoint: Endpoint) -> None: ...
    def data(self, endpoint: Endpoint, view: memoryview) -> None: ...
    def eof(self, endpoint: Endpoint) -> None: ...
    def lost(self, endpoint: Endpoint, exc: Exception | None) -> None: ...
    def pause_other(self, endpoint: Endpoint) -> None: ...
    def resume_other(self, endpoint: Endpoint) -> None: ...


# Dials the upstream: connects ``factory()``'s protocol to the route's upstream (TLS toward the node
# for connect) within the session's limits; raises Refusal with the stable reason when it cannot.
Dialer = Callable[[Route, Callable[[], asyncio.BaseProtocol], Limits], Awaitable[None]]


async def dial(route: Route, factory: Callable[[], asyncio.BaseProtocol], limits: Limits) -> None:
    """The real dialer: TCP to serve's loopback server, TLS to connect's node."""
    loop = asyncio.get_running_loop()
    if route.provider is not None:  # serve runs the server: the session's own process (upstream/pool.py)
        protocol = factory()
        link: LinkPort = protocol.link  # type: ignore[attr-defined]  # an Endpoint
        sock = await route.provider.connect(link.id, link.identity, limits.connect_timeout_s or 10.0)
        await loop.create_connection(lambda: protocol, sock=sock)
        return
    kwargs: dict[str, Any] = {}
    if route.side.upstream_is_guard:  # the node's serve: TLS with this side's client certificate
        assert route.ssl_context is not None
        kwargs = dict(ssl=route.ssl_context(), server_hostname=route.server_name,
                      ssl_handshake_timeout=limits.handshake_timeout_s or None)
    where = f"{route.upstream_host}:{route.upstream_port}"
    try:
        await asyncio.wait_for(loop.create_connection(factory, route.upstream_host, route.upstream_port, **kwargs),
                               (limits.connect_timeout_s + limits.handshake_timeout_s) or None)
    except (ssl.SSLError, ssl.CertificateError) as exc:
        reason = classify_handshake_error(exc)
        route.traffic.tls_failure(reason)
        raise Refusal("tls_failed" if reason != "node_name_mismatch" else reason,
                      f"TLS to node {where} failed ({reason}): {exc}") from None
    except (OSError, asyncio.TimeoutError) as exc:
        reason = route.side.unreachable_reason
        raise Refusal(reason, f"cannot reach {where}: {exc or 'timeout'}") from None


def check_node(route: Route, transport: asyncio.BaseTransport) -> None:
    """connect: the node's certificate must be a server certificate (serverAuth EKU); raises Refusal."""
    if route.side.upstream_is_guard:
        check_usage(peer_identity(transport.get_extra_info("ssl_object")), "server")


class Endpoint(asyncio.BufferedProtocol):
    """One side of a link: reads into a reusable buffer and reports to the link."""

    __slots__ = ("link", "is_client", "transport", "buf", "view", "closed", "held", "narrowed", "parked")

    def __init__(self, link: LinkPort, is_client: bool) -> None:
        self.link = link
        self.is_client = is_client
        self.transport: asyncio.Transport | None = None
        # Allocated on the first read, not here: a TLS handshake that never completes (a flood of
        # idle or garbage sockets) must not cost a read buffer per accepted socket.
        self.buf: bytearray | None = None
        self.view: memoryview | None = None
        self.closed = False
        self.held = False  # reading paused by flow control (the other side's write buffer is full)
        self.narrowed = False  # flooding small frames: small reads, one per loop turn
        self.parked = False  # reading paused while the link validates a graph off the loop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        transport.set_write_buffer_limits(WRITE_HIGH_WATER_BYTES, WRITE_LOW_WATER_BYTES)  # type: ignore[attr-defined]
        # Told here, not after the awaited accept/dial returns: bytes (or a TLS alert) may be
        # delivered before the awaiting coroutine resumes.
        self.link.made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.view is None:
            self.fresh_buffer()
        return self.view  # type: ignore[return-value]

    def buffer_updated(self, nbytes: int) -> None:
        self.link.data(self, self.view[:nbytes])  # type: ignore[index]
        if self.narrowed and not self.closed and not self.held and not self.parked and self.transport is not None:
            # One read per loop turn: others run before the next (libuv stops its read loop).
            self.transport.pause_reading()
            asyncio.get_running_loop().call_soon(self._next_read)

    def _next_read(self) -> None:
        if not self.closed and not self.held and not self.parked and self.transport is not None:
            self.transport.resume_reading()

    def narrow(self) -> None:
        """Read ``FAIR_READ_BYTES`` at a time, one read per loop turn (proxy/link.py, loop fairness)."""
        self.narrowed = True
        if self.view is not None:
            self.view = self.view[:FAIR_READ_BYTES]

    def widen(self) -> None:
        self.narrowed = False
        if self.buf is not None:
            self.view = memoryview(self.buf)

    def eof_received(self) -> bool:
        self.link.eof(self)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        # Let the read buffer go now: the link, its endpoints and transports form reference
        # cycles that only the cyclic GC frees, and ended sessions wait in its oldest generation
        # (serve's RSS grew ~10 MiB per 100 llama.cpp runs until a full collection).
        self.buf = self.view = None
        self.link.lost(self, exc)

    def pause_writing(self) -> None:
        self.link.pause_other(self)

    def resume_writing(self) -> None:
        self.link.resume_other(self)

    def fresh_buffer(self) -> None:
        """The transport may still reference the old buffer: read into a new one."""
        self.buf = bytearray(READ_BUFFER_BYTES)
        self.view = memoryview(self.buf)
        if self.narrowed:
            self.view = self.view[:FAIR_READ_BYTES]
