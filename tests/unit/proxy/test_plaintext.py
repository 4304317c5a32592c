"""proxy/plaintext.py: a plaintext ggml-rpc HELLO on serve's TLS port is answered 0.0.25 in the
layout it asked for, however its bytes arrive (llama.cpp sends a frame's command byte, size and
payload in three writes); anything else is left in the socket for the TLS handshake."""

from __future__ import annotations

import asyncio
import socket

import pytest

from rpcguard.protocol import encode
from rpcguard.protocol.versions import HEADER_REQ_BYTES, REFUSAL_CODES
from rpcguard.proxy.plaintext import plaintext_hello


class Peeked:
    """The accepted socket, with an event set on each MSG_PEEK read (what the server has looked at)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.peeks: list[int] = []
        self.peeked = asyncio.Event()

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv(self, n: int, flags: int = 0) -> bytes:
        data = self.sock.recv(n, flags)
        if flags & socket.MSG_PEEK:
            self.peeks.append(len(data))
            self.peeked.set()
        return data

    def send(self, data: bytes) -> int:
        return self.sock.send(data)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)


def pair() -> tuple[socket.socket, socket.socket]:
    client, server = socket.socketpair()
    server.setblocking(False)
    return client, server


def answer_of(client: socket.socket) -> bytes:
    client.settimeout(5)
    got = b""
    while chunk := client.recv(100):
        got += chunk
    return got


@pytest.mark.parametrize("version", [(7, 0, 0), (3, 6, 1)])
def test_a_whole_hello_is_answered_in_its_layout(version):
    async def main() -> None:
        client, server = pair()
        hello = encode.hello_request(version)
        client.sendall(hello)
        assert await plaintext_hello(asyncio.get_running_loop(), server, 5)
        got = answer_of(client)
        size = 28 if len(hello) - HEADER_REQ_BYTES == 24 else 3
        assert got[:8] == size.to_bytes(8, "little") and got[8:11] == bytes([0, 0, REFUSAL_CODES["tls_not_tls"]])
        client.close(), server.close()

    asyncio.run(main())


@pytest.mark.parametrize("version", [(7, 0, 0), (3, 6, 1)])
def test_a_hello_arriving_byte_by_byte_is_answered(version):
    """Each byte is sent only after the server looked at what came before it: the command byte
    alone, then a part of the size, ... (a loaded machine: the real llama.cpp client got a TLS
    alert instead of 0.0.25 in test_refusals when two suites ran at once)."""
    async def main() -> None:
        client, server = pair()
        peeked = Peeked(server)
        hello = encode.hello_request(version)
        task = asyncio.ensure_future(plaintext_hello(asyncio.get_running_loop(), peeked, 5))  # type: ignore[arg-type]
        for i in range(len(hello)):
            peeked.peeked.clear()
            client.sendall(hello[i:i + 1])
            if i + 1 < len(hello):
                await asyncio.wait_for(peeked.peeked.wait(), 5)
        assert await asyncio.wait_for(task, 5)
        assert min(peeked.peeks) == 1  # it did look at the command byte alone
        got = answer_of(client)
        assert got[8:11] == bytes([0, 0, REFUSAL_CODES["tls_not_tls"]]), got
        client.close(), server.close()

    asyncio.run(main())


def test_a_hello_with_trailing_data_takes_only_the_hello():
    async def main() -> None:
        client, server = pair()
        hello = encode.hello_request((7, 0, 0))
        client.sendall(hello + b"more")
        assert await plaintext_hello(asyncio.get_running_loop(), server, 5)
        assert server.recv(100) == b"more"  # left for the close
        client.close(), server.close()

    asyncio.run(main())


@pytest.mark.parametrize("first", [b"\x16\x03\x01\x02\x00", b"GET / HTTP/1.1\r\n\r\n",
                                   bytes([14]) + (5).to_bytes(8, "little") + bytes(5)])
def test_anything_else_is_left_for_the_handshake(first):
    """A TLS ClientHello, HTTP, a HELLO command with a size no version uses."""
    async def main() -> None:
        client, server = pair()
        client.sendall(first)
        assert not await plaintext_hello(asyncio.get_running_loop(), server, 5)
        assert server.recv(100) == first  # nothing taken
        client.close(), server.close()

    asyncio.run(main())


def test_a_peer_that_closes_after_the_command_byte_is_not_waited_for():
    async def main() -> None:
        client, server = pair()
        client.sendall(bytes([14]))
        client.shutdown(socket.SHUT_WR)
        loop = asyncio.get_running_loop()
        assert not await asyncio.wait_for(plaintext_hello(loop, server, 60), 5)  # not the 60 s
        client.close(), server.close()

    asyncio.run(main())
