"""A hand-written ggml-rpc 7.0.0 client for the integration tests: what a certificate holder can send.

How this works: ``RawClient`` wraps one socket (plain TCP to connect's loopback port, or an mTLS
socket to serve from ``mtls_socket``) and speaks the wire format itself (spec §2.1: requests
``cmd:u8 | size:u64 | payload``, responses ``size:u64 | payload``), with the frame builders of
``rpcguard.protocol.encode``. Tests use it to stall, cut or misbehave mid-session in ways the
real llama.cpp client never would, and to check what the proxy and the server do then.
"""

from __future__ import annotations

import socket
import ssl
import struct

from rpcguard.protocol import encode
from rpcguard.protocol.encode import TensorSpec
from tests.support.guard import Pki

__all__ = ["RawClient", "PeerClosed", "recv_exact", "read_response", "mtls_context", "mtls_socket", "V7", "TIMEOUT_S"]

V7 = (7, 0, 0)
TIMEOUT_S = 10.0
RECV_MAX_BYTES = 1 << 20


class PeerClosed(EOFError, ConnectionError):
    """The peer closed the connection before a whole message came (an EOFError and a ConnectionError)."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock``; PeerClosed if it ends first."""
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), RECV_MAX_BYTES))
        if not chunk:
            raise PeerClosed(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def read_response(sock: socket.socket) -> bytes:
    """One response's payload (``size:u64 | payload``)."""
    return recv_exact(sock, struct.unpack("<Q", recv_exact(sock, 8))[0])


def mtls_context(pki: Pki) -> ssl.SSLContext:
    """What connect presents to serve: the client certificate, the private CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki.path("ca"))
    ctx.load_cert_chain(pki.path(pki.client), pki.path(pki.client, "key"))
    return ctx


def mtls_socket(pki: Pki, port: int, timeout: float = TIMEOUT_S) -> ssl.SSLSocket:
    """An mTLS connection to serve on 127.0.0.1:port, handshake done."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    return mtls_context(pki).wrap_socket(raw, server_hostname=pki.node)


class RawClient:
    """One ggml-rpc connection: ``target`` is a port on 127.0.0.1 (plain TCP) or a connected socket."""

    def __init__(self, target: int | socket.socket, timeout: float = TIMEOUT_S) -> None:
        if isinstance(target, int):
            target = socket.create_connection(("127.0.0.1", target), timeout=timeout)
        else:
            target.settimeout(timeout)
        self.sock = target

    @classmethod
    def session(cls, target: int | socket.socket, timeout: float = TIMEOUT_S) -> RawClient:
        """Connected and past a HELLO the server answered with 7.0.0."""
        c = cls(target, timeout)
        version = c.hello()
        assert version == V7, version
        return c

    def recv_exact(self, n: int) -> bytes:
        return recv_exact(self.sock, n)

    def response(self) -> bytes:
        return read_response(self.sock)

    def hello(self) -> tuple[int, int, int]:
        """Send the 7.0.0 HELLO; the version the answer carries (0.0.N when refused)."""
        self.sock.sendall(encode.hello_request(V7))
        major, minor, patch = self.response()[:3]
        return (major, minor, patch)

    def call(self, cmd: str, payload: bytes = b"") -> bytes:
        """One request and its response."""
        self.sock.sendall(encode.request(cmd, payload))
        return self.response()

    def alloc(self, size: int) -> TensorSpec:
        """ALLOC_BUFFER + BUFFER_GET_BASE: an F32 tensor spanning the whole new buffer."""
        handle, got = struct.unpack("<QQ", self.call("ALLOC_BUFFER", struct.pack("<IQ", 0, size)))
        assert handle and got >= size, (handle, got)
        (base,) = struct.unpack("<Q", self.call("BUFFER_GET_BASE", struct.pack("<Q", handle)))
        return TensorSpec(buffer=handle, data=base, ne=(size // 4, 1, 1, 1))

    def closed_after(self, frame: bytes) -> bool:
        """Send ``frame``; True when the connection is closed without an answer."""
        try:
            self.sock.sendall(frame)
            return self.sock.recv(1) == b""
        except (ConnectionError, ssl.SSLError):
            return True

    def close(self, reset: bool = False) -> None:
        if reset:  # like a killed process with unread data: RST instead of FIN
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
