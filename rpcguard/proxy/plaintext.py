"""serve's TLS port, before the handshake: is the first thing on it a plaintext ggml-rpc HELLO?

llama.cpp pointed straight at serve (``--rpc node:PORT`` without connect) sends a plaintext HELLO
where serve expects a TLS ClientHello. It is answered in plaintext with the refusal version
0.0.25, which llama.cpp prints as a version mismatch, instead of a TLS alert it would report as
a crashed server. Used by proxy/link.py before ``connect_accepted_socket(ssl=...)``.
"""

from __future__ import annotations

import asyncio
import select
import socket

from rpcguard.protocol.encode import hello_response
from rpcguard.protocol.versions import HEADER_REQ_BYTES, HELLO, HELLO_REQUEST_SIZES, REFUSAL_CODES

__all__ = ["plaintext_hello", "PEEK_WAIT_S"]

# How often the rest of a partly arrived plaintext HELLO is looked for (a few loop turns at most:
# llama.cpp's three writes of one frame follow each other at once).
PEEK_WAIT_S = 0.005


async def plaintext_hello(loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout_s: float) -> bool:
    """serve: is the first thing on this TLS port a plaintext ggml-rpc HELLO (llama.cpp pointed
    straight at serve)? Then answer it in plaintext with the refusal version 0.0.25, which
    llama.cpp prints ("RPC server version mismatch: 0.0.25"), and say so. A TLS ClientHello
    starts with 0x16 and is left in the socket for the handshake (MSG_PEEK)."""
    ready: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), readable)
    try:
        await asyncio.wait_for(ready, timeout_s or None)
    except asyncio.TimeoutError:
        return False  # the handshake's own timeout classifies it
    finally:
        loop.remove_reader(sock.fileno())
    # llama.cpp writes a frame's command byte, size and payload in separate send() calls, so the
    # first readable moment may hold only the command byte (a loaded client machine makes that
    # likely): while what came is a prefix of a plaintext HELLO, wait for the rest (the whole
    # HELLO: closing over its unread payload would reset the answer), within the same timeout.
    deadline = loop.time() + (timeout_s or 10.0)
    want = HEADER_REQ_BYTES
    while True:
        try:
            head: bytes | None = sock.recv(want, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            head = None  # nothing more yet
        except OSError:
            return False
        if head == b"" or _peer_closed(sock):
            return False  # the peer closed (with or without a part of a HELLO): the handshake classifies it
        if head is not None:
            if head[0] != HELLO:
                return False  # a TLS ClientHello (0x16) or anything else: the handshake classifies it
            if len(head) >= HEADER_REQ_BYTES and want == HEADER_REQ_BYTES:
                size = int.from_bytes(head[1:HEADER_REQ_BYTES], "little")
                if size not in HELLO_REQUEST_SIZES:
                    return False
                want = HEADER_REQ_BYTES + size
            if len(head) >= want:
                break
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(PEEK_WAIT_S)
    try:
        sock.recv(want)  # take the HELLO: closing over unread bytes would reset the answer
        sock.send(hello_response((0, 0, REFUSAL_CODES["tls_not_tls"]), new_layout=want - HEADER_REQ_BYTES == 24))
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    return True


def _peer_closed(sock: socket.socket) -> bool:
    """The peer shut down its side (POLLRDHUP), though bytes it sent are still unread: MSG_PEEK
    alone cannot tell a partial HELLO that stopped from one still arriving."""
    poll = select.poll()
    poll.register(sock.fileno(), select.POLLRDHUP)
    return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in poll.poll(0))
