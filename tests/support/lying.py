"""Servers that lie, for the faults the real ggml-rpc-server cannot produce (tests/integration).

``LyingRelay``: a loopback relay to a real server that, while ``lying`` is set, rewrites its
answers: every 8-byte answer (GET_ALIGNMENT, GET_MAX_SIZE, GET_ALLOC_SIZE) says ``u64``, every
16-byte one (GET_DEVICE_MEMORY) says ``(u64, u64)``; once the test clears it, answers pass as they
are. It stands for a compromised or broken server process of one session (a contained serve runs a
process per session) whose answers must not reach the next session.

``FakeServer701``: a ggml-rpc server announcing 7.0.1, for GET_DEVICE_SUPPORTS_OP (command 19)
ahead of any release that has it: it answers HELLO, DEVICE_COUNT (1), GET_DEVICE_MEMORY (1 GiB),
GET_ALIGNMENT (32), ALLOC_BUFFER / BUFFER_GET_BASE of one buffer, and command 19 with ``supports`` (a byte: 2 is a
lie); it records every command it receives, and closes on anything else (as the real one does).
"""

from __future__ import annotations

import socket
import struct
import threading

__all__ = ["LyingRelay", "FakeServer701"]

_HELLO, _DEVICE_COUNT, _GET_DEVICE_MEMORY, _GET_ALIGNMENT, _ALLOC, _BASE, _SUPPORTS_OP = 14, 15, 11, 1, 0, 3, 19


def _close(sock: socket.socket) -> None:
    """shutdown, then close: a bare close leaves another thread's recv on it blocked, and the
    connection open (a real server serves one client at a time)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _recv(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


class _Loopback:
    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.closed = False
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            self.socks.append(sock)
            threading.Thread(target=self._serve, args=(sock, self.connections), daemon=True).start()

    def _serve(self, sock: socket.socket, n: int) -> None:
        raise NotImplementedError

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True
        self.listener.close()
        for s in self.socks:
            _close(s)


class LyingRelay(_Loopback):
    def __init__(self, port: int, value: int) -> None:
        self.port_to, self.value = port, value
        self.lying = True
        super().__init__()

    def _serve(self, down: socket.socket, n: int) -> None:
        up = socket.create_connection(("127.0.0.1", self.port_to))
        self.socks.append(up)
        threading.Thread(target=self._pump, args=(down, up), daemon=True).start()
        try:
            while True:  # responses: u64 size | payload
                size = struct.unpack("<Q", _recv(up, 8))[0]
                payload = _recv(up, size)
                if self.lying and size == 8:
                    payload = struct.pack("<Q", self.value)
                elif self.lying and size == 16:
                    payload = struct.pack("<QQ", self.value, self.value)
                down.sendall(struct.pack("<Q", size) + payload)
        except (EOFError, OSError):
            _close(down)
            _close(up)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(1 << 16):
                dst.sendall(chunk)
            dst.shutdown(socket.SHUT_WR)  # a half-close passes as one: the server still answers
            return
        except OSError:
            pass
        _close(dst)


class FakeServer701(_Loopback):
    HANDLE, BASE, SIZE = 0x5555_0000_1000, 0x7F00_0000_0000, 1 << 20

    def __init__(self, supports: int = 1) -> None:
        self.supports = supports
        self.received: list[int] = []
        super().__init__()

    def _serve(self, sock: socket.socket, n: int) -> None:
        answers = {
            _HELLO: bytes([7, 0, 1, 0]) + bytes(24),
            _DEVICE_COUNT: struct.pack("<I", 1),
            _GET_DEVICE_MEMORY: struct.pack("<QQ", 1 << 30, 1 << 30),
            _GET_ALIGNMENT: struct.pack("<Q", 32),
            _ALLOC: struct.pack("<QQ", self.HANDLE, self.SIZE),
            _BASE: struct.pack("<Q", self.BASE),
            _SUPPORTS_OP: bytes([self.supports]),
        }
        try:
            while True:
                cmd, size = struct.unpack("<BQ", _recv(sock, 9))
                _recv(sock, size)
                self.received.append(cmd)
                if cmd not in answers:
                    break
                sock.sendall(struct.pack("<Q", len(answers[cmd])) + answers[cmd])
        except (EOFError, OSError):
            pass
        _close(sock)
