"""serve's TLS port, before the handshake: is the first thing on it a plaintext ggml-rpc HELLO?

llama.cpp pointed straight at serve (``--rpc node:PORT`` without connect) sends a plaintext HELLO
where serve expects a TLS ClientHello. It is answered in plaintext with the refusal version
0.0.25, which llama.cpp prints as a version mismatch, instead of a TLS alert it would report as
a crashed server. Used by proxy/link.py before ``connect_accepted_socket(ssl=...)``.
"""

from __future__ import annotations

import asyncio
import socket

from rpcguard.protocol.encode import hello_response
from rpcguard.protocol.versions import HEADER_REQ_BYTES, HELLO, HELLO_REQUEST_SIZES, REFUSAL_CODES

__all__ = ["plaintext_hello"]


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
    try:
        head = sock.recv(HEADER_REQ_BYTES, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return False
    if len(head) < HEADER_REQ_BYTES or head[0] != HELLO:
        return False
    size = int.from_bytes(head[1:HEADER_REQ_BYTES], "little")
    if size not in HELLO_REQUEST_SIZES:
        return False
    try:
        sock.recv(HEADER_REQ_BYTES + size)  # take the HELLO: closing over unread bytes would reset the answer
        sock.send(hello_response((0, 0, REFUSAL_CODES["tls_not_tls"]), new_layout=size == 24))
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    return True
