"""Whether a serve listener could serve a session now: a real HELLO to its upstream, in the background.

How this works: ``/readyz`` must tell the truth and never cost a session anything (issue 31.2).
A TCP connect is not the truth: an HTTP server on the upstream port accepts it too. So
``UpstreamProbe`` keeps, per listener with a server it does not run (``--upstream``), the verdict
of the last HELLO exchange with that server: ready only when the server answered HELLO with a
protocol version the listener accepts. The probe runs on its own every ``PROBE_INTERVAL_S``
while no session holds the upstream; while one does, the session itself is the proof (its HELLO
was answered) and the verdict stays "in use". ``/readyz`` reads the verdicts and never waits on
the network, so polling it neither blocks nor refuses a session, and a busy node stays ready.

The probe is a client of the real server like any other: it connects, sends a HELLO (the
24-byte form of 4.0.0 and later, then the empty form of 1.0.0-3.6.1 if the server hung up on the
first) and hangs up. It never takes the listener's upstream slot: a session that arrives during a
probe connects at once and the single-client server serves it right after the probe (milliseconds).
"""

from __future__ import annotations

import asyncio
import struct
import time
from dataclasses import dataclass
from typing import Callable

from rpcguard.protocol.encode import hello_request
from rpcguard.protocol.versions import HEADER_RSP_BYTES, Version, format_version

__all__ = ["UpstreamProbe", "Verdict", "hello_probe", "PROBE_INTERVAL_S", "PROBE_TIMEOUT_S"]

PROBE_INTERVAL_S = 5.0  # how stale a verdict may be: an upstream that dies shows within this
PROBE_TIMEOUT_S = 3.0  # a server that takes the connection but does not answer HELLO in this is not ready


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    why: str  # one line for /readyz's body and the log
    at: float  # time.monotonic() of the probe


async def hello_probe(host: str, port: int, accepted: frozenset[Version],
                      timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """One HELLO exchange with a ggml-rpc-server: (ready, why)."""
    for era in ((4, 0, 0), (3, 6, 1)):  # 24-byte caps first; a pre-4.0 server closes on them
        try:
            got = await asyncio.wait_for(_exchange(host, port, hello_request(era)), timeout)
        except asyncio.TimeoutError:
            return False, (f"{host}:{port} took the connection but did not answer HELLO within {timeout:g} s "
                           "(not a ggml-rpc-server, or one serving a client of its own)")
        except OSError as exc:
            return False, f"{host}:{port} unreachable ({exc.strerror or exc})"
        if got:
            return _judge(got, accepted, host, port)
    return False, f"{host}:{port} closed the connection at HELLO (not a ggml-rpc-server, or a v0 one)"


async def _exchange(host: str, port: int, hello: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    head = b""
    try:
        writer.write(hello)
        await writer.drain()
        head = await reader.read(HEADER_RSP_BYTES + 28)
        while 0 < len(head) < HEADER_RSP_BYTES + 3:
            more = await reader.read(HEADER_RSP_BYTES + 28 - len(head))
            if not more:
                break
            head += more
        return head
    except ConnectionResetError:  # a server that hangs up on a HELLO it does not take resets (unread bytes)
        return head
    finally:
        writer.close()


def _judge(got: bytes, accepted: frozenset[Version], host: str, port: int) -> tuple[bool, str]:
    if len(got) < HEADER_RSP_BYTES + 3:
        return False, f"{host}:{port} answered {len(got)} bytes to HELLO (not a ggml-rpc-server)"
    (size,) = struct.unpack_from("<Q", got)
    if size not in (3, 28):
        shown = got[:16].decode("latin-1").encode("unicode_escape").decode("ascii")
        return False, f"{host}:{port} is not a ggml-rpc-server (answered {shown!r} to HELLO)"
    version = (got[8], got[9], got[10])
    if version not in accepted:
        return False, f"{host}:{port} speaks protocol {format_version(version)}, not accepted by this listener"
    return True, f"{host}:{port} answered HELLO, protocol {format_version(version)}"


class UpstreamProbe:
    """The last HELLO verdict of one listener's upstream, refreshed in the background."""

    def __init__(self, host: str, port: int, accepted: Callable[[], frozenset[Version]],
                 in_use: Callable[[], bool], on_verdict: Callable[[bool], None] = lambda ok: None) -> None:
        self.host, self.port = host, port
        self._accepted, self._in_use, self._on_verdict = accepted, in_use, on_verdict
        self.verdict: Verdict | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def read(self) -> tuple[bool, str]:
        """(ready, why) from what is known now; never waits."""
        if self._in_use():
            return True, f"upstream in use by a session ({self.host}:{self.port})"
        v = self.verdict
        if v is None:
            return False, f"upstream {self.host}:{self.port} not probed yet"
        return v.ok, ("" if v.ok else "upstream ") + v.why

    async def probe_now(self) -> Verdict:
        ok, why = await hello_probe(self.host, self.port, self._accepted())
        self.verdict = Verdict(ok, why, time.monotonic())
        self._on_verdict(ok)
        return self.verdict

    async def _run(self) -> None:
        while True:
            if not self._in_use():
                await self.probe_now()
            await asyncio.sleep(PROBE_INTERVAL_S)
