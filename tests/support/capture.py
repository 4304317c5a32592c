"""A recording TCP relay on loopback: what real llama.cpp and a real server said to each other.

How this works: ``CaptureRelay(target_port)`` listens on 127.0.0.1 (``port``) and forwards every
connection to 127.0.0.1:target_port untouched, one thread per direction. Each connection is a
``Conn`` whose ``chunks`` are ``(direction, bytes)`` in the order they were read; a chunk is
recorded before it is forwarded, so a response is always recorded after the request that caused
it and the recorded order is a valid order to replay into a ``Session``. ``directions=(C2S,)``
keeps only the client->server bytes (what the op survey decodes), which saves the memory of
every GET_TENSOR answer. A connection the target refuses is closed on the client side (an
upstream that is down looks like one to rpcguard). An end is passed on as a half-close and the
other direction is drained until it ends too, never reset: a reset killed the real server
(SIGPIPE) when rpcguard's own GET_DEVICE_MEMORY was still being answered as the client left.

Used by the op survey (tests/support/opsurvey.py, tests/integration/test_models_real.py), the
sanitizer fuzzer's recorder (tests/fuzz/replay.py), the validation benchmark
(bench/studies/validation_bench.py) and, through ``record_real_session``, the replay tests that compare two
decoders or two protocol cores on real traffic.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["C2S", "S2C", "Conn", "CaptureRelay", "hello_version", "record_real_session"]

C2S, S2C = 0, 1
RECV_BYTES = 1 << 16
JOIN_TIMEOUT_S = 5.0


@dataclass
class Conn:
    """One relayed connection: its recorded chunks and the byte counts per direction."""

    chunks: list[tuple[int, bytes]] = field(default_factory=list)  # (direction, bytes) in order
    c2s: int = 0
    s2c: int = 0
    ended: int = 0  # directions that have ended (both: the sockets are closed)

    def stream(self, direction: int = C2S) -> bytes:
        """Everything recorded in one direction, joined."""
        return b"".join(d for way, d in self.chunks if way == direction)


class CaptureRelay:
    """127.0.0.1:port -> 127.0.0.1:target_port, recording each connection (see the module doc)."""

    def __init__(self, target_port: int, directions: tuple[int, ...] = (C2S, S2C)) -> None:
        self.target = target_port
        self.directions = frozenset(directions)
        self.conns: list[Conn] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._ls = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._ls.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._ls.accept()
            except OSError:
                return  # closed
            try:
                s = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                c.close()
                continue
            for x in (c, s):
                x.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Conn()
            with self._lock:
                self.conns.append(conn)
            for args in ((c, s, conn, C2S), (s, c, conn, S2C)):
                t = threading.Thread(target=self._pump, args=args, daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, conn: Conn, direction: int) -> None:
        """Forward ``src`` to ``dst`` until ``src`` ends, then pass the end on as a half-close.

        A side that stopped must not make the other one's writes fail: ggml-rpc-server does not
        ignore SIGPIPE (transport.cpp:552 ``send(fd, ..., 0)`` of the pinned sdist), so a
        response it writes into a reset connection kills it. So the relay never resets: when
        ``dst`` is gone the rest of ``src`` is read and dropped, and the sockets are closed only
        once both directions have ended."""
        keep = direction in self.directions
        forward = True
        try:
            while data := src.recv(RECV_BYTES):
                with self._lock:
                    if keep:
                        conn.chunks.append((direction, data))
                    if direction == C2S:
                        conn.c2s += len(data)
                    else:
                        conn.s2c += len(data)
                if forward:
                    try:
                        dst.sendall(data)
                    except OSError:
                        forward = False  # the reader left: keep draining this side
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)  # EOF for the other side, which may still answer
            except OSError:
                pass
            with self._lock:
                conn.ended += 1
                last = conn.ended == 2
            if last:
                src.close()
                dst.close()

    def close(self) -> None:
        """Stop accepting and wait (bounded) for the running connections' pumps to end."""
        self._ls.close()
        for t in self._threads:
            t.join(JOIN_TIMEOUT_S)


def hello_version(conn: Conn) -> tuple[int, int, int]:
    """The protocol version the server announced: bytes 8-10 of its HELLO reply (u64 size, then
    the version), the first bytes it sent on ``conn``."""
    reply = b""
    for way, data in conn.chunks:
        if way == S2C:
            reply += data
            if len(reply) >= 11:
                break
    return (reply[8], reply[9], reply[10])


def record_real_session(server_port: int, workdir: Path, n_tokens: int = 3) -> list[Conn]:
    """The real llama.cpp client runs a tiny model for ``n_tokens`` through a relay to the real
    server on ``server_port``; the recorded connections that carried client bytes."""
    from tests.support import realpeer

    model = realpeer.make_model(workdir / "tiny.gguf")
    relay = CaptureRelay(server_port)
    try:
        run = realpeer.run_client(relay.endpoint, model, n=n_tokens, timeout=300)
    finally:
        relay.close()
    assert run.ok, run.output[-3000:]
    conns = [c for c in relay.conns if c.c2s]
    assert conns
    return conns
