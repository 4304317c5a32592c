"""Prometheus metrics: lock-free counters, a custom collector, and an asyncio HTTP endpoint.

How this works: client_python's ``Counter.labels(...).inc()`` looks the child up in a dict
and takes a lock on every call; at tens of thousands of frames per second that is real cost
on the single proxy thread. So the hot path only bumps plain ints in
:class:`~rpcguard.protocol.stats.SessionStats` lists and in :class:`ListenerTraffic` dicts,
and a custom collector (registered on an injectable ``CollectorRegistry``) turns them into
metric families at scrape time: for each listener it sums the folded totals of finished
sessions and the live counters of running ones.

Everything runs on the event-loop thread, including the HTTP server below (no
``start_http_server`` thread), so a scrape never races the counters it reads. The caller
chooses the bind address; the config default is loopback (``127.0.0.1:9450`` for serve,
``127.0.0.1:9451`` for connect) because the metrics name peers and listeners.

Reading the exposition back (``rpcguard status``, tests):
``prometheus_client.parser.text_string_to_metric_families``.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import platform
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client import exposition
from prometheus_client.exposition import generate_latest
from prometheus_client.utils import floatToGoString

from rpcguard import __version__
from rpcguard.protocol.stats import (
    DEFAULT_COMMAND_NAMES,
    LATENCY_BUCKETS_S,
    N_COMMANDS,
    SessionStats,
    command_name,
)

__all__ = [
    "ROLES",
    "SESSION_RESULTS",
    "RELOAD_RESULTS",
    "CERTIFICATES",
    "FIREWALL_MODES",
    "ListenerTraffic",
    "Metrics",
    "start_http",
    "MAX_HEADER_BYTES",
    "READ_TIMEOUT_S",
    "MAX_HTTP_CONNECTIONS",
]

ROLES = ("serve", "connect")
SESSION_RESULTS = ("ok", "refused", "error")
RELOAD_RESULTS = ("ok", "error")
CERTIFICATES = ("cert", "ca")
FIREWALL_MODES = ("enforce", "monitor")

_LE = tuple(floatToGoString(b) for b in LATENCY_BUCKETS_S) + ("+Inf",)
_NS_PER_S = 1_000_000_000


class ListenerTraffic:
    """Counters of one listener (serve) or tunnel (connect). Event-loop thread only."""

    __slots__ = (
        "role", "listener", "command_names", "totals", "live", "sessions_total",
        "refusals", "tls_failures", "firewall_violations", "queue_depth", "upstream",
        "upstream_version",
    )

    def __init__(self, role: str, listener: str, *, upstream: str = "",
                 command_names: Mapping[int, str] = DEFAULT_COMMAND_NAMES) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self.role = role
        self.listener = listener
        self.command_names = command_names
        self.totals = SessionStats()  # finished sessions, folded in by session_ended()
        self.live: set[SessionStats] = set()  # running sessions, read at scrape time
        self.sessions_total: dict[str, int] = dict.fromkeys(SESSION_RESULTS, 0)
        self.refusals: dict[str, int] = {}
        self.tls_failures: dict[str, int] = {}
        self.firewall_violations: dict[tuple[str, str], int] = {}
        self.queue_depth = 0  # sessions waiting for the upstream (upstream_queue_depth)
        self.upstream = upstream  # upstream address, label of upstream_protocol_info
        self.upstream_version: str | None = None  # "3.0.0" once the upstream answered HELLO

    def session_started(self, stats: SessionStats) -> None:
        """Make a running session's counters visible to scrapes."""
        self.live.add(stats)

    def session_ended(self, stats: SessionStats, result: str) -> None:
        """Fold a finished session into the totals and count it under ``result``.

        Call exactly once per session (a second call would count it twice).
        """
        if result not in self.sessions_total:
            raise ValueError(f"result must be one of {SESSION_RESULTS}, not {result!r}")
        self.live.discard(stats)
        stats.add_into(self.totals)
        self.sessions_total[result] += 1

    def refusal(self, reason: str) -> None:
        """Count a refused session (``refusals_total{reason}``)."""
        self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def tls_failure(self, reason: str) -> None:
        """Count a failed TLS handshake or identity check (``tls_handshake_failures_total``)."""
        self.tls_failures[reason] = self.tls_failures.get(reason, 0) + 1

    def firewall_violation(self, reason: str, mode: str) -> None:
        """Count a firewall rule violation; ``mode`` is ``enforce`` or ``monitor``."""
        key = (reason, mode)
        self.firewall_violations[key] = self.firewall_violations.get(key, 0) + 1

    def snapshot(self) -> SessionStats:
        """Return a new SessionStats holding finished + running sessions' counters."""
        agg = SessionStats()
        self.totals.add_into(agg)
        for stats in tuple(self.live):
            stats.add_into(agg)
        return agg


def _families() -> dict[str, CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
    """One empty family per metric of the design table, in table order."""
    rl = ["role", "listener"]
    c, g = CounterMetricFamily, GaugeMetricFamily
    return {
        "frames": c("rpcguard_frames", "Frames relayed.", labels=rl + ["direction", "command"]),
        "bytes": c("rpcguard_bytes", "Wire bytes relayed, headers included.",
                   labels=rl + ["direction", "command"]),
        "duration": HistogramMetricFamily(
            "rpcguard_command_duration_seconds",
            "Time from request fully sent to response header received.",
            labels=rl + ["command"]),
        "sessions": c("rpcguard_sessions", "Finished sessions.", labels=rl + ["result"]),
        "active": g("rpcguard_sessions_active", "Running sessions.", labels=rl),
        "refusals": c("rpcguard_refusals", "Refused sessions.", labels=rl + ["reason"]),
        "tls": c("rpcguard_tls_handshake_failures", "Failed TLS handshakes.", labels=rl + ["reason"]),
        "upstream": g("rpcguard_upstream_protocol_info", "RPC protocol version of the upstream.",
                      labels=["listener", "upstream", "version"]),
        "build": g("rpcguard_build_info", "rpcguard build.", labels=["version", "python"]),
        "cert": g("rpcguard_certificate_expiry_timestamp_seconds",
                  "notAfter of the loaded certificates, Unix time.", labels=["role", "certificate"]),
        "certwarn": g("rpcguard_certificate_warning", "1 while the loaded certificate has this problem.",
                      labels=["role", "kind"]),
        "reload": c("rpcguard_reload", "Configuration / certificate reloads.", labels=["result"]),
        "queue": g("rpcguard_upstream_queue_depth", "Sessions waiting for the upstream.",
                   labels=["listener"]),
        "alloc": c("rpcguard_alloc_bytes", "ALLOC_BUFFER sizes granted.", labels=rl),
        "upload": c("rpcguard_upload_bytes", "Tensor bytes uploaded.", labels=rl + ["kind"]),
        "firewall": c("rpcguard_firewall_violations", "Firewall rule violations.",
                      labels=rl + ["reason", "mode"]),
        "rdma": c("rpcguard_rdma_caps_zeroed", "RDMA capability fields zeroed.",
                  labels=rl + ["direction"]),
    }


class _Collector:
    """Builds the metric families from a :class:`Metrics` at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator:
        # Lets the registry reject a second collector exporting the same names.
        return iter(_families().values())

    def collect(self) -> Iterator:
        m = self._metrics
        f = _families()
        for lt in tuple(m._listeners.values()):
            self._listener(f, lt)
        f["build"].add_metric([__version__, platform.python_version()], 1)
        for (role, cert), epoch_s in m._cert_expiry.items():
            f["cert"].add_metric([role, cert], epoch_s)
        for (role, kind), on in m.cert_warnings.items():
            f["certwarn"].add_metric([role, kind], on)
        for result, n in m._reloads.items():
            f["reload"].add_metric([result], n)
        return iter(f.values())

    @staticmethod
    def _listener(f: dict, lt: ListenerTraffic) -> None:
        agg = lt.snapshot()
        rl = [lt.role, lt.listener]
        for cmd in range(N_COMMANDS):
            name = None
            for direction, frames, nbytes in (("request", agg.req_frames[cmd], agg.req_bytes[cmd]),
                                              ("response", agg.rsp_frames[cmd], agg.rsp_bytes[cmd])):
                if frames or nbytes:
                    name = name or command_name(lt.command_names, cmd)
                    if frames:
                        f["frames"].add_metric(rl + [direction, name], frames)
                    if nbytes:
                        f["bytes"].add_metric(rl + [direction, name], nbytes)
            if agg.lat_count[cmd]:
                cumulative, buckets = 0, []
                for le, n in zip(_LE, agg.lat_buckets[cmd]):
                    cumulative += n
                    buckets.append((le, cumulative))
                f["duration"].add_metric(rl + [command_name(lt.command_names, cmd)], buckets,
                                         agg.lat_sum_ns[cmd] / _NS_PER_S)
        for result, n in lt.sessions_total.items():
            f["sessions"].add_metric(rl + [result], n)
        f["active"].add_metric(rl, len(lt.live))
        for reason, n in lt.refusals.items():
            f["refusals"].add_metric(rl + [reason], n)
        for reason, n in lt.tls_failures.items():
            f["tls"].add_metric(rl + [reason], n)
        if lt.upstream_version is not None:
            f["upstream"].add_metric([lt.listener, lt.upstream, lt.upstream_version], 1)
        f["queue"].add_metric([lt.listener], lt.queue_depth)
        f["alloc"].add_metric(rl, agg.alloc_bytes)
        f["upload"].add_metric(rl + ["set_tensor"], agg.upload_bytes_set)
        f["upload"].add_metric(rl + ["hash_hit"], agg.upload_bytes_hash_hit)
        for (reason, mode), n in lt.firewall_violations.items():
            f["firewall"].add_metric(rl + [reason, mode], n)
        f["rdma"].add_metric(rl + ["request"], agg.rdma_caps_zeroed_req)
        f["rdma"].add_metric(rl + ["response"], agg.rdma_caps_zeroed_rsp)


class Metrics:
    """All rpcguard metrics of one process, exported through ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._listeners: dict[tuple[str, str], ListenerTraffic] = {}
        self._cert_expiry: dict[tuple[str, str], float] = {}
        self._reloads: dict[str, int] = dict.fromkeys(RELOAD_RESULTS, 0)
        self.cert_warnings: dict[tuple[str, str], float] = {}  # (role, kind) -> 0/1, set by server.Runtime
        # The last refusals with their peer, for a person at a terminal (GET /refusals,
        # `rpcguard status`); bounded, and never a metric label (peers are unbounded).
        self.recent_refusals: deque[dict] = deque(maxlen=RECENT_REFUSALS)
        self.registry.register(_Collector(self))

    def note_refusal(self, **fields: object) -> None:
        """Remember one refusal (time, role, listener, peer, identity, reason, detail)."""
        self.recent_refusals.append({"time": round(time.time(), 3), **fields})

    def listener(self, role: str, listener: str, *, upstream: str = "",
                 command_names: Mapping[int, str] | None = None) -> ListenerTraffic:
        """Return the counters of ``(role, listener)``, creating them on first use.

        Counters survive a reload that keeps the name; a non-empty ``upstream`` or a given
        ``command_names`` updates an existing entry.
        """
        key = (role, listener)
        lt = self._listeners.get(key)
        if lt is None:
            lt = ListenerTraffic(role, listener, upstream=upstream,
                                 command_names=command_names or DEFAULT_COMMAND_NAMES)
            self._listeners[key] = lt
        else:
            if upstream:
                lt.upstream = upstream
            if command_names is not None:
                lt.command_names = command_names
        return lt

    def set_certificate_expiry(self, role: str, certificate: str, epoch_s: float) -> None:
        """Record the notAfter (Unix seconds) of the loaded ``cert`` or ``ca``."""
        if role not in ROLES or certificate not in CERTIFICATES:
            raise ValueError(f"bad role/certificate {role!r}/{certificate!r}")
        self._cert_expiry[(role, certificate)] = float(epoch_s)

    def reload(self, result: str) -> None:
        """Count a reload attempt; ``result`` is ``ok`` or ``error``."""
        if result not in self._reloads:
            raise ValueError(f"result must be one of {RELOAD_RESULTS}, not {result!r}")
        self._reloads[result] += 1

    def exposition(self) -> bytes:
        """The text exposition of the registry (what GET /metrics returns)."""
        return generate_latest(self.registry)


RECENT_REFUSALS = 50  # refusals kept for /refusals


# --- HTTP endpoint ----------------------------------------------------------------------

# A scrape request is a request line plus a few headers (well under 1 KiB); 8 KiB is what
# common servers accept and bounds the memory a client can make us buffer per connection.
MAX_HEADER_BYTES = 8 * 1024
# Time allowed to send the request headers (and to take the response): a slow or silent
# client cannot hold a connection open longer than this.
READ_TIMEOUT_S = 5.0
# Concurrent connections served; beyond it new ones get 503 at once (bounds fds and tasks).
MAX_HTTP_CONNECTIONS = 64

ReadyCheck = Callable[[], Awaitable[tuple[bool, str]]]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}
_TEXT = "text/plain; charset=utf-8"
# generate_latest() writes text format 0.0.4. client_python >= 0.22 made CONTENT_TYPE_LATEST
# "version=1.0.0" (which also wants an escaping= parameter) and serves 0.0.4 by default itself;
# older releases only have CONTENT_TYPE_LATEST, which is 0.0.4 there.
_METRICS_TYPE = getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", exposition.CONTENT_TYPE_LATEST)


def _response(status: int, body: bytes, content_type: str = _TEXT, extra: str = "") -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
    return head.encode("latin-1") + body


def _gzip_accepted(headers: dict[str, str]) -> bool:
    tokens = headers.get("accept-encoding", "").split(",")
    return any(t.split(";", 1)[0].strip().lower() == "gzip" for t in tokens)


async def _answer(metrics: Metrics, ready: ReadyCheck | None, head: bytes, timeout_s: float) -> bytes:
    """Route one request head to its response bytes."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _response(400, b"bad request\n")
    method, target = parts[0], parts[1]
    if method != "GET":
        return _response(405, b"method not allowed\n", extra="Allow: GET\r\n")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    path = target.split("?", 1)[0]
    if path == "/metrics":
        try:
            body = metrics.exposition()
        except Exception as exc:  # a bug in a collector must not kill the endpoint
            return _response(500, f"collect failed: {type(exc).__name__}\n".encode())
        if _gzip_accepted(headers):
            return _response(200, gzip.compress(body), _METRICS_TYPE, "Content-Encoding: gzip\r\n")
        return _response(200, body, _METRICS_TYPE)
    if path == "/healthz":
        return _response(200, b"ok\n")
    if path == "/refusals":
        body = json.dumps(list(metrics.recent_refusals), separators=(",", ":")).encode() + b"\n"
        return _response(200, body, "application/json")
    if path == "/readyz":
        ok, text = True, "ready"
        if ready is not None:
            try:
                ok, text = await asyncio.wait_for(ready(), timeout_s)
            except Exception as exc:
                ok, text = False, f"readiness check failed: {type(exc).__name__}"
        body = text.encode() if text.endswith("\n") else (text + "\n").encode()
        return _response(200 if ok else 503, body)
    return _response(404, b"not found\n")


async def start_http(metrics: Metrics, host: str, port: int, *, ready: ReadyCheck | None = None,
                     read_timeout_s: float = READ_TIMEOUT_S) -> asyncio.AbstractServer:
    """Serve GET /metrics, /healthz and /readyz on ``host:port`` from the running loop.

    One request per connection (``Connection: close``). ``ready`` returns ``(ok, text)``
    for /readyz (200 or 503); without it /readyz is always 200. Port 0 picks a free port
    (see ``server.sockets``). Close the returned server to stop.
    """
    active = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal active
        if active >= MAX_HTTP_CONNECTIONS:
            writer.write(_response(503, b"too many connections\n"))
            writer.close()
            return
        active += 1
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), read_timeout_s)
            except asyncio.LimitOverrunError:
                out = _response(431, b"request header too large\n")
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                return  # client went away or stayed silent: nothing worth answering
            else:
                out = await _answer(metrics, ready, head, read_timeout_s)
            writer.write(out)
            await asyncio.wait_for(writer.drain(), read_timeout_s)
        except (asyncio.TimeoutError, ConnectionError):
            writer.transport.abort()  # peer not reading: drop instead of buffering
        finally:
            active -= 1
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), read_timeout_s)
            except (asyncio.TimeoutError, ConnectionError, OSError):
                writer.transport.abort()

    return await asyncio.start_server(handle, host, port, limit=MAX_HEADER_BYTES)
