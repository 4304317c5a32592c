"""``/readyz``: could this process serve a session now? The certificates in use, and each upstream.

How this works: ``readiness`` answers ``/readyz`` from what is known: not while draining, not with
a certificate in use that has expired, then per listener. serve's listener that runs its server
asks its pool; one with ``--upstream`` reads its ``UpstreamProbe`` (below); connect's tunnel asks
``NodeChecks``, which trusts a session's outcome or a probe's for ``NODE_CHECK_INTERVAL_S`` and
otherwise runs the TLS-only probe of pki/probe.py (no HELLO: the node's single upstream slot is
never taken for it). A broken file on disk does not matter here: the loaded material keeps working
and a failed reload is reported by ``rpcguard_reload_total{result="error"}``.

``/readyz`` must tell the truth and never cost a session anything (issue 31.2).
A TCP connect is not the truth: an HTTP server on the upstream port accepts it too. So
``UpstreamProbe`` keeps, per listener with a server it does not run (``--upstream``), the verdict
of the last HELLO exchange with that server: ready only when the server answered HELLO with a
protocol version the listener accepts. The probe runs on its own every ``PROBE_INTERVAL_S``
while no session holds the upstream; while one does, the session itself is the proof (its HELLO
was answered) and the verdict stays "in use". ``/readyz`` reads the verdicts and never waits on
the network, so polling it neither blocks nor refuses a session, and a busy node stays ready.

The probe is a client of the real server like any other: it connects, sends a HELLO (the
24-byte form of 4.0.0 and later, then the empty form of 1.0.0-3.6.1 if the server hung up on the
first) and hangs up once answered. A probe that gives up waiting never closes under the
unanswered HELLO (the server would die of SIGPIPE answering it): it half-closes and the
connection lingers until the server hangs up. It never takes the listener's upstream slot: a session that arrives during a
probe connects at once and the single-client server serves it right after the probe (milliseconds).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from rpcguard.pki.probe import tls_probe
from rpcguard.protocol.encode import hello_request
from rpcguard.protocol.endings import UPSTREAM_DRAIN_MAX_S
from rpcguard.protocol.versions import (
    HEADER_RSP_BYTES, HELLO_CAPS_SINCE, HELLO_RESPONSE_SIZES, LAST_BEFORE_CAPS, Version, format_version,
)

__all__ = ["UpstreamProbe", "Verdict", "NodeChecks", "readiness", "hello_probe", "LINGERING", "PROBE_INTERVAL_S",
           "PROBE_TIMEOUT_S", "NODE_CHECK_INTERVAL_S", "NODE_PROBE_TIMEOUT_S"]

PROBE_INTERVAL_S = 5.0  # how stale a verdict may be: an upstream that dies shows within this
PROBE_TIMEOUT_S = 3.0  # a server that takes the connection but does not answer HELLO in this is not ready
# a HELLO reply of any era: header + its payload (3 bytes before 4.0.0, 28 since)
_REPLY_MIN, _REPLY_MAX = HEADER_RSP_BYTES + min(HELLO_RESPONSE_SIZES), HEADER_RSP_BYTES + max(HELLO_RESPONSE_SIZES)
# connect's /readyz: how long what is known about a node (a probe's or a session's outcome) is
# trusted before the next /readyz probes it again (TLS handshake only, pki/probe.py tls_probe).
NODE_CHECK_INTERVAL_S = 15.0
# ...and how long that probe may take: /readyz answers within metrics.READ_TIMEOUT_S (5 s), and a
# node that drops packets must read as "node_unreachable", not as a timed-out readiness check.
NODE_PROBE_TIMEOUT_S = 3.0
# Session outcomes that say the tunnel cannot work now (the node's rpcguard or server is at fault).
_NODE_DOWN_REASONS = frozenset({"node_unreachable", "tls_failed", "node_name_mismatch", "identity_not_allowed",
                                "version_not_accepted", "upstream_unavailable"})


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    why: str  # one line for /readyz's body and the log
    at: float  # time.monotonic() of the probe


async def hello_probe(host: str, port: int, accepted: frozenset[Version],
                      timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """One HELLO exchange with a ggml-rpc-server: (ready, why)."""
    for era in (HELLO_CAPS_SINCE, LAST_BEFORE_CAPS):  # 24-byte caps first; a pre-4.0 server closes on them
        try:
            got = await _exchange(host, port, hello_request(era), timeout)
        except asyncio.TimeoutError:
            return False, (f"{host}:{port} took the connection but did not answer HELLO within {timeout:g} s "
                           "(not a ggml-rpc-server, or one serving a client of its own)")
        except OSError as exc:
            return False, f"{host}:{port} unreachable ({exc.strerror or exc})"
        if got:
            return _judge(got, accepted, host, port)
    return False, f"{host}:{port} closed the connection at HELLO (not a ggml-rpc-server, or a v0 one)"


# Probe connections given up on before the server answered, still open until it hangs up.
LINGERING: set[asyncio.Task] = set()


async def _exchange(host: str, port: int, hello: bytes, timeout: float) -> bytes:
    """Send ``hello``, read the answer, hang up. The probe never closes under an unanswered HELLO:
    ggml-rpc-server does not ignore SIGPIPE, and one that answers a connection already closed dies
    (a server still draining the last session, or slow on a loaded machine, takes the probe's
    connection from its backlog after the probe gave up on it). So on timeout the connection is
    left to ``_linger`` until the server hangs up."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    head = bytearray()
    answered = False
    try:
        writer.write(hello)
        await asyncio.wait_for(_reply(reader, head), timeout)
        answered = True
        return bytes(head)
    except asyncio.TimeoutError:  # (an OSError since Python 3.11): no answer in time, the connection lingers
        raise
    except OSError:  # a server that hangs up on a HELLO it does not take resets (ECONNRESET, EPIPE, ENOTCONN)
        answered = True
        return bytes(head)
    finally:
        if answered:
            writer.close()
        else:
            task = asyncio.ensure_future(_linger(reader, writer))
            LINGERING.add(task)
            task.add_done_callback(LINGERING.discard)


async def _reply(reader: asyncio.StreamReader, head: bytearray) -> None:
    """Read a HELLO reply of any era into ``head`` (or what the server sends before it hangs up)."""
    while len(head) < _REPLY_MIN:
        more = await reader.read(_REPLY_MAX - len(head))
        if not more:
            return
        head += more


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close, read what the server still sends until it hangs up (it answers the HELLO, reads
    EOF), ``UPSTREAM_DRAIN_MAX_S`` at most, then close."""
    try:
        writer.write_eof()
        await asyncio.wait_for(_until_eof(reader), UPSTREAM_DRAIN_MAX_S)
    except (asyncio.TimeoutError, OSError):
        pass
    finally:
        writer.close()


async def _until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass


def _judge(got: bytes, accepted: frozenset[Version], host: str, port: int) -> tuple[bool, str]:
    if len(got) < _REPLY_MIN:
        return False, f"{host}:{port} answered {len(got)} bytes to HELLO (not a ggml-rpc-server)"
    size = int.from_bytes(got[:HEADER_RSP_BYTES], "little")
    if size not in HELLO_RESPONSE_SIZES:
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


class NodeChecks:
    """connect: what is known about each tunnel's node, from sessions' outcomes and TLS-only probes."""

    def __init__(self, context: Callable[[], ssl.SSLContext], timeout_s: Callable[[], float],
                 own_warnings: Callable[[], Iterable[str]]) -> None:
        self._context, self._timeout_s, self._own_warnings = context, timeout_s, own_warnings
        self._seen: dict[str, tuple[float, bool, str]] = {}  # tunnel -> (when, ok, why)
        self._lock: dict[str, asyncio.Lock] = {}

    def note(self, record: dict) -> None:
        """A finished session's outcome: the freshest news about its node."""
        down = record.get("result") == "refused" and record.get("reason") in _NODE_DOWN_REASONS
        if down or record.get("version"):
            why = f"{record.get('reason')}: {record.get('detail')}" if down else "a session got through"
            self._seen[record["listener"]] = (time.monotonic(), not down, why)

    async def ready(self, name: str, host: str, port: int, server_name: str) -> tuple[bool, str]:
        """Does the node answer? The last known outcome if fresh, else a TLS-only probe.

        The probe stops after the TLS handshake (and the node's verdict on our certificate), so
        it never sends HELLO and never takes the node's single upstream slot (serve takes it at
        HELLO). It runs at most once per NODE_CHECK_INTERVAL_S per tunnel, and only when asked.
        """
        async with self._lock.setdefault(name, asyncio.Lock()):
            seen = self._seen.get(name)
            if seen is None or time.monotonic() - seen[0] > NODE_CHECK_INTERVAL_S:
                result = await tls_probe(name, host, port, self._context(), server_name,
                                         timeout=min(NODE_PROBE_TIMEOUT_S, self._timeout_s()),
                                         own_warnings=self._own_warnings())
                why = "TLS accepted" if result.ok else f"{result.reason}: {result.detail}"
                seen = self._seen[name] = (time.monotonic(), result.ok, why)
            return seen[1], seen[2]


class _Route(Protocol):
    """What readiness reads of a route (proxy/route.py ``Route``)."""

    name: str
    upstream_host: str
    upstream_port: int
    server_name: str | None
    draining: bool

    @property
    def provider(self) -> _Provider | None: ...

    @property
    def traffic(self) -> _Traffic: ...

    @property
    def side(self) -> _Side: ...


class _Provider(Protocol):
    def ready(self) -> tuple[bool, str]: ...


class _Traffic(Protocol):
    upstream_up: bool | None


class _Side(Protocol):
    @property
    def upstream_is_guard(self) -> bool: ...


class _Listener(Protocol):
    """What readiness reads of a listener (proxy/listeners.py ``Listener``)."""

    @property
    def route(self) -> _Route: ...

    @property
    def probe(self) -> UpstreamProbe | None: ...


async def readiness(listeners: Iterable[_Listener], expiry: dict[str, float],
                    nodes: NodeChecks | None) -> tuple[bool, str]:
    """/readyz: the certificates IN USE valid (``expiry``: certificate -> notAfter), and every upstream
    (serve) or node (connect, ``nodes``) answering; (ready, one line per listener)."""
    listeners = list(listeners)
    if any(lst.route.draining for lst in listeners):
        return False, "draining: not accepting new sessions"  # take this node out of rotation
    now = time.time()
    for name, when in expiry.items():
        if when <= now:
            return False, f"{name} certificate in use expired"
    lines = []
    tunnels = [lst.route for lst in listeners if lst.route.side.upstream_is_guard]
    verdicts: list[tuple[bool, str]] = []  # serve has no tunnels, and no NodeChecks
    if nodes is not None:
        verdicts = list(await asyncio.gather(*(nodes.ready(r.name, r.upstream_host, r.upstream_port,
                                                           r.server_name or r.upstream_host) for r in tunnels)))
    for route, (ok, why) in zip(tunnels, verdicts, strict=True):
        if not ok:
            return False, f"{route.name}: node {route.upstream_host}:{route.upstream_port}: {why}"
        lines.append(f"{route.name}: node answers ({why})")
    for lst in listeners:
        route = lst.route
        if route.side.upstream_is_guard:
            continue
        if route.provider is not None:  # serve runs the server: its pool knows
            ok, why = route.provider.ready()
            route.traffic.upstream_up = ok
            if not ok:
                return False, f"{route.name}: upstream {why}"
            lines.append(f"{route.name}: upstream {why}")
            continue
        probe = lst.probe
        assert probe is not None
        if probe.verdict is None:  # only right after start: the first probe, once
            await probe.probe_now()
        ok, why = probe.read()  # the background HELLO's verdict: never waits, never takes the slot
        if not ok:
            return False, f"{route.name}: {why}"
        lines.append(f"{route.name}: {why}")
    return True, "; ".join(lines)
