"""Hostile tenants that try to monopolise serve's event loop (issue 21, loop fairness), for
tests/integration/test_availability.py and bench/studies/fairness.py.

* ``FrameFlood``: one mTLS session pipelines GET_ALIGNMENT as fast as it can and drains the
  answers (millions of tiny frames).
* ``GraphFlood``: one mTLS session sends, again and again, a GRAPH_COMPUTE whose validation costs
  as much CPU as it can without being refused (a chain of ``nodes`` ADDs on 4-float tensors in a
  buffer of its own, ~30 us of validation per node cold), each time with a new name on the shared
  source so no node is in the session's cache, and waits for a GET_ALIGNMENT after it. The real
  server computes it in a few ms. A graph refused (too costly on a slow machine) closes the
  session: the flood reconnects and goes on.
* ``HandshakeFlood``: TLS handshakes opened and dropped as fast as a few threads can (no
  certificate needed to make the server do its half of the key exchange).
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
from typing import Callable

from rpcguard.protocol import encode
from rpcguard.protocol.encode import TensorSpec, graph_payload
from rpcguard.protocol.ggml import op_table
from tests.support.rawclient import RawClient

__all__ = ["FrameFlood", "GraphFlood", "HandshakeFlood", "chain_graph"]

_ADD = op_table((7, 0, 0)).ids["ADD"]  # type: ignore[union-attr]
_NAME_AT = 244  # rpc_tensor.name: after id, type, buffer, ne, nb, op, op_params, flags, src, view_src, view_offs, data
_SLOTS = 1000  # node outputs cycle through this many 64-byte slots of the buffer


def chain_graph(buffer: int, base: int, nodes: int) -> tuple[bytearray, int]:
    """A GRAPH_COMPUTE payload: ``nodes`` ADDs, each of the one before and a shared weight; and the
    offset in it of that weight's name (patch it to defeat the node cache)."""
    def t(id: int, slot: int, **kw) -> TensorSpec:
        return TensorSpec(id=id, buffer=buffer, data=base + slot * 64, **kw)

    tensors = [t(0x10, 0, name=b"w0", use_count=1), t(0x20, 1, name=b"w1", use_count=nodes)]
    ids, prev = [], 0x10
    for i in range(nodes):
        tid = 0x100 + i * 16
        tensors.append(t(tid, 2 + i % _SLOTS, op=_ADD, src=(prev, 0x20), use_count=1, name=b"n%d" % i))
        ids.append(tid)
        prev = tid
    payload = bytearray(graph_payload(ids, tensors))
    tensors_at = 4 + 4 + 8 * nodes + 4
    return payload, tensors_at + 296 + _NAME_AT


class _Flood(threading.Thread):
    def __init__(self, connect: Callable[[], ssl.SSLSocket]) -> None:
        super().__init__(daemon=True)
        self.connect = connect
        self.stop = False
        self.sent = self.answered = self.reconnects = 0
        self.sock: ssl.SSLSocket | None = None

    def close(self) -> None:
        self.stop = True
        self._drop_sock()

    def _drop_sock(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass


class FrameFlood(_Flood):
    """Pipelined GET_ALIGNMENT, 20,000 frames (260 KB) per write; ``answered`` counts responses."""

    BLOCK = encode.request("GET_ALIGNMENT", bytes(4)) * 20_000

    def run(self) -> None:
        self.sock = sock = RawClient.session(self.connect()).sock
        reader = threading.Thread(target=self._drain, args=(sock,), daemon=True)
        reader.start()
        try:
            while not self.stop:
                sock.sendall(self.BLOCK)
                self.sent += 20_000
        except OSError:
            pass

    def _drain(self, sock: socket.socket) -> None:
        try:
            while not self.stop:
                data = sock.recv(1 << 20)
                if not data:
                    return
                self.answered += len(data) // 16
        except OSError:
            pass


class GraphFlood(_Flood):
    """A costly-to-validate graph, renamed each time; ``answered`` counts graphs computed."""

    def __init__(self, connect: Callable[[], ssl.SSLSocket], nodes: int = 12_000) -> None:
        super().__init__(connect)
        self.nodes = nodes

    def run(self) -> None:
        while not self.stop:
            try:
                client = RawClient.session(self.connect())
                self.sock = client.sock
                buf = client.alloc(64 * (_SLOTS + 2))
                payload, name_at = chain_graph(buf.buffer, buf.data, self.nodes)
                frame = bytearray(encode.request("GRAPH_COMPUTE", bytes(payload)))
                while not self.stop:
                    frame[9 + name_at: 9 + name_at + 8] = struct.pack("<Q", self.sent + 1)
                    client.sock.sendall(frame)
                    self.sent += 1
                    client.call("GET_ALIGNMENT", bytes(4))  # the graph went through
                    self.answered += 1
            except (OSError, AssertionError, struct.error):
                self.reconnects += 1
            finally:
                self._drop_sock()


class HandshakeFlood(_Flood):
    """TLS handshakes as fast as ``threads`` threads can open them, each closed at once (without
    a client certificate: refused, but only after the server's key exchange and signature);
    ``answered`` counts handshakes the server took part in."""

    def __init__(self, connect: Callable[[], ssl.SSLSocket], threads: int = 4) -> None:
        super().__init__(connect)
        self.threads = threads

    def run(self) -> None:
        workers = [threading.Thread(target=self._loop, daemon=True) for _ in range(self.threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def _loop(self) -> None:
        while not self.stop:
            try:
                self.connect().close()
            except (OSError, ssl.SSLError):
                pass
            self.answered += 1
