"""The metrics HTTP endpoint: /metrics, /refusals, /healthz, /readyz; optional TLS and basic auth.

How this works: one asyncio server on the event-loop thread (no ``start_http_server`` thread),
one request per connection (``Connection: close``), bounded header size, read time and
connection count. Nobody can starve the probes: a source address holds at most
``MAX_HTTP_PER_SOURCE`` connections; when ``MAX_HTTP_CONNECTIONS`` are open, the oldest one that
has not sent its request yet (in its handshake, silent, or trickling its head) makes room for the
new one; the handshake and the request head must arrive within ``READ_TIMEOUT_S`` of the accept,
by age. Every error is answered (when the client can still read an answer) and counted in
``rpcguard_web_refusals_total{reason}`` (``HTTP_REASONS``, the TLS and auth reasons). With a web config (``rpcguard.observe.webconfig``) each accepted socket does its TLS
handshake in ``loop.connect_accepted_socket``, so a failed handshake is
classified (``tls.classify_handshake_error``), counted in ``rpcguard_web_refusals_total`` and
logged with the peer, like a refused proxy session. The guard is fetched per connection through
a callable, so a reload swaps it for new connections only.

Which paths are protected: ``/metrics`` and ``/refusals`` (peer addresses and identities)
need everything the web config asks for (client certificate, allowed SAN, basic auth).
``/healthz`` and ``/readyz`` skip basic auth so that a load balancer can probe them; they are
still served over TLS, and with ``RequireAndVerifyClientCert`` the handshake itself already
requires a client certificate from every caller (use ``VerifyClientCertIfGiven`` plus basic
auth when the load balancer has no certificate).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable

from prometheus_client import exposition

from rpcguard.pki.identity import source_of
from rpcguard.pki.tls import classify_handshake_error
from rpcguard.observe.webconfig import WebGuard

__all__ = ["start_http", "HttpServer", "MAX_HEADER_BYTES", "READ_TIMEOUT_S", "MAX_HTTP_CONNECTIONS",
           "MAX_HTTP_PER_SOURCE", "PROTECTED_PATHS", "HEALTH_PATHS", "HTTP_REASONS"]

log = logging.getLogger("rpcguard.metrics")

# A scrape request is a request line plus a few headers (well under 1 KiB); 8 KiB is what
# common servers accept and bounds the memory a client can make us buffer per connection.
MAX_HEADER_BYTES = 8 * 1024
# Time allowed for the TLS handshake and to send the request headers (and to take the
# response): a slow or silent client cannot hold a connection open longer than this.
READ_TIMEOUT_S = 5.0
# Connections open at once (in their handshake, sending their request, or being answered);
# past it the oldest connection that has not sent its request yet makes room (a silent flood
# cannot keep a probe out), or, when every one is being answered, the new one gets 503.
MAX_HTTP_CONNECTIONS = 64
# Connections open at once from one source address: one host cannot take the endpoint. A
# Prometheus server and a kubelet need one or two each.
MAX_HTTP_PER_SOURCE = 8
# Paths that need the web config's authentication; the health probes do not.
PROTECTED_PATHS = frozenset({"/metrics", "/refusals"})
HEALTH_PATHS = frozenset({"/healthz", "/readyz"})
# Stable reasons of a request the endpoint answered with an error, besides the TLS and auth
# ones (rpcguard_web_refusals_total{reason}): every error path is a response and a count.
HTTP_REASONS = ("too_many_connections", "too_many_connections_per_source", "evicted", "request_timeout",
                "request_incomplete", "bad_request", "method_not_allowed", "header_too_large", "not_found",
                "internal_error")

ReadyCheck = Callable[[], Awaitable[tuple[bool, str]]]
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable"}
_TEXT = "text/plain; charset=utf-8"
# generate_latest() writes text format 0.0.4. client_python >= 0.22 made CONTENT_TYPE_LATEST
# "version=1.0.0" (which also wants an escaping= parameter) and serves 0.0.4 by default itself;
# older releases only have CONTENT_TYPE_LATEST, which is 0.0.4 there.
_METRICS_TYPE = getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", exposition.CONTENT_TYPE_LATEST)
_UNAUTHORIZED = 'WWW-Authenticate: Basic realm="rpcguard", charset="UTF-8"\r\n'


def _response(status: int, body: bytes, content_type: str = _TEXT, extra: str = "") -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
    return head.encode("latin-1") + body


def _gzip_accepted(headers: dict[str, str]) -> bool:
    tokens = headers.get("accept-encoding", "").split(",")
    return any(t.split(";", 1)[0].strip().lower() == "gzip" for t in tokens)


class _Endpoint:
    """Routes requests of one server; ``metrics`` is a ``rpcguard.observe.metrics.Metrics``."""

    def __init__(self, metrics, ready: ReadyCheck | None, web: Callable[[], WebGuard | None] | None,
                 before_scrape: Callable[[], Awaitable[None]] | None, timeout_s: float) -> None:
        self.metrics, self.ready, self.web, self.before_scrape = metrics, ready, web, before_scrape
        self.timeout_s = timeout_s

    def refuse(self, reason: str, peer: object, detail: str) -> None:
        self.metrics.web_refusal(reason)
        log.warning("metrics endpoint refused peer=%s reason=%s detail=%s", peer, reason, detail)

    async def answer(self, head: bytes, guard: WebGuard | None, ssl_object, peer: object) -> bytes:
        """Route one request head to its response bytes."""
        extra = guard.headers if guard is not None else ""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self.refuse("bad_request", peer, repr(lines[0][:80]))
            return _response(400, b"bad request\n", extra=extra)
        method, target = parts[0], parts[1]
        if method == "HEAD":  # what GET would answer, without the body (probes use it)
            out = await self.answer(b" ".join((b"GET", head.split(b" ", 1)[1])), guard, ssl_object, peer)
            split = out.index(b"\r\n\r\n") + 4
            return out[:split]
        if method != "GET":
            self.refuse("method_not_allowed", peer, method[:20])
            return _response(405, b"method not allowed\n", extra=extra + "Allow: GET, HEAD\r\n")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        path = target.split("?", 1)[0]
        if path in PROTECTED_PATHS and guard is not None:
            peercert = ssl_object.getpeercert() if ssl_object is not None else None
            reason = await guard.authorize(headers.get("authorization"), peercert)
            if reason is not None:
                self.refuse(reason, peer, f"GET {path}")
                if reason == "client_san_not_allowed":
                    return _response(403, b"forbidden\n", extra=extra)
                return _response(401, b"unauthorized\n", extra=extra + _UNAUTHORIZED)
        if path == "/metrics":
            if self.before_scrape is not None:
                try:
                    await asyncio.wait_for(self.before_scrape(), self.timeout_s)
                except Exception as exc:  # stale gauges beat no scrape
                    log.warning("metrics: refreshing gauges failed: %r", exc)
            try:
                body = self.metrics.exposition()
            except Exception as exc:  # a bug in a collector must not kill the endpoint
                self.refuse("internal_error", peer, f"collect failed: {exc!r}")
                return _response(500, f"collect failed: {type(exc).__name__}\n".encode(), extra=extra)
            if _gzip_accepted(headers):
                return _response(200, gzip.compress(body), _METRICS_TYPE, extra + "Content-Encoding: gzip\r\n")
            return _response(200, body, _METRICS_TYPE, extra)
        if path == "/healthz":
            return _response(200, b"ok\n", extra=extra)
        if path == "/refusals":
            body = json.dumps(list(self.metrics.recent_refusals), separators=(",", ":")).encode() + b"\n"
            return _response(200, body, "application/json", extra)
        if path == "/readyz":
            ok, text = True, "ready"
            if self.ready is not None:
                try:
                    ok, text = await asyncio.wait_for(self.ready(), self.timeout_s)
                except Exception as exc:
                    ok, text = False, f"readiness check failed: {type(exc).__name__}"
            body = text.encode() if text.endswith("\n") else (text + "\n").encode()
            return _response(200 if ok else 503, body, extra=extra)
        self.refuse("not_found", peer, path[:80])
        return _response(404, b"not found\n", extra=extra)


class HttpServer:
    """The listening socket and its accept task; ``sockets``/``close``/``wait_closed`` like asyncio's."""

    def __init__(self, sock: socket.socket, task: asyncio.Task) -> None:
        self.sockets = [sock]
        self._task = task

    def close(self) -> None:
        self._task.cancel()
        self.sockets[0].close()

    async def wait_closed(self) -> None:
        try:
            await self._task
        except asyncio.CancelledError:
            pass


async def start_http(metrics, host: str, port: int, *, ready: ReadyCheck | None = None,
                     web: Callable[[], WebGuard | None] | None = None,
                     before_scrape: Callable[[], Awaitable[None]] | None = None,
                     read_timeout_s: float = READ_TIMEOUT_S) -> HttpServer:
    """Serve GET /metrics, /refusals, /healthz and /readyz on ``host:port`` from the running loop.

    ``ready`` returns ``(ok, text)`` for /readyz (200 or 503); without it /readyz is always 200.
    ``web`` returns the current :class:`~rpcguard.observe.webconfig.WebGuard` (TLS, basic auth,
    headers), read once per connection; None or a guard without context = plain HTTP.
    ``before_scrape`` refreshes gauges before /metrics is rendered. Port 0 picks a free port
    (see ``server.sockets``). Close the returned server to stop.

    Sockets are accepted here and wrapped with ``connect_accepted_socket`` (TLS included), so a
    failed handshake raises to us and is counted; a TLS upgrade after ``start_server`` would race
    the ClientHello into the plain reader.
    """
    endpoint = _Endpoint(metrics, ready, web, before_scrape, read_timeout_s)
    loop = asyncio.get_running_loop()
    # Open connections: task -> [source, still waiting for its request, peer, the socket until the
    # task runs]; in accept order, so the first waiting one is the oldest (evicted when full).
    conns: dict[asyncio.Task, list] = {}
    per_source: dict[str, int] = {}

    async def handle(conn: socket.socket, peer: str, state: list) -> None:
        """One connection: the handshake and the request head within ``read_timeout_s`` of the
        accept (by age, however the bytes are spread), then the answer."""
        state[3] = None  # the socket is this task's from here (closed by it, whatever happens)
        guard = web() if web is not None else None
        context = guard.context if guard is not None else None
        deadline = loop.time() + read_timeout_s
        writer = None
        try:
            if context is not None and not await _tls_or_plain_answered(loop, conn, read_timeout_s, endpoint, peer):
                return
            reader = asyncio.StreamReader(limit=MAX_HEADER_BYTES)
            protocol = asyncio.StreamReaderProtocol(reader)
            try:
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol, conn, ssl=context,
                    ssl_handshake_timeout=max(deadline - loop.time(), 0.01) if context else None)
            except (ssl.SSLError, OSError, asyncio.TimeoutError, ConnectionError) as exc:
                endpoint.refuse(classify_handshake_error(exc), peer, f"TLS handshake failed: {exc}")
                conn.close()
                return
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), max(deadline - loop.time(), 0.01))
            except asyncio.LimitOverrunError:
                endpoint.refuse("header_too_large", peer, f"more than {MAX_HEADER_BYTES} bytes")
                out = _response(431, b"request header too large\n")
            except asyncio.TimeoutError:
                endpoint.refuse("request_timeout", peer, f"no request within {read_timeout_s:g} s")
                out = _response(408, b"request timeout\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial:  # a bare connect and close (a TCP probe) is no error
                    endpoint.refuse("request_incomplete", peer, f"closed after {len(exc.partial)} bytes")
                return
            except (ConnectionError, ssl.SSLError):
                return  # the client went away: nothing can be answered
            else:
                state[1] = False  # being answered: no longer evictable
                out = await endpoint.answer(head, guard, writer.get_extra_info("ssl_object"), peer)
            writer.write(out)
            await asyncio.wait_for(writer.drain(), read_timeout_s)
        except (asyncio.TimeoutError, ConnectionError, ssl.SSLError):
            if writer is not None:
                writer.transport.abort()  # peer not reading: drop instead of buffering
        except asyncio.CancelledError:
            # evicted (or the server closes): the socket goes with it
            if writer is not None:
                writer.transport.abort()
            else:
                conn.close()
            raise
        finally:
            if writer is not None and not writer.transport.is_closing():
                writer.close()
                try:
                    await asyncio.wait_for(writer.wait_closed(), read_timeout_s)
                except (asyncio.TimeoutError, ConnectionError, OSError, ssl.SSLError, asyncio.CancelledError):
                    writer.transport.abort()

    def refuse_at_once(conn: socket.socket, peer: str, reason: str, plain: bool) -> None:
        endpoint.refuse(reason, peer, "connection refused at accept")
        if plain:  # plain HTTP: say why; a TLS client could not read it anyway
            try:
                conn.send(_response(503, f"{reason.replace('_', ' ')}\n".encode()))
            except OSError:
                pass
        conn.close()

    def done(task: asyncio.Task) -> None:
        source, _, _, unstarted = conns.pop(task)
        if unstarted is not None:  # evicted before it ran
            unstarted.close()
        left = per_source[source] - 1
        if left:
            per_source[source] = left
        else:
            del per_source[source]

    def admit(conn: socket.socket, addr: object) -> None:
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        source = source_of(str(addr[0])) if isinstance(addr, tuple) else peer  # an IPv6 host's /64
        guard = web() if web is not None else None
        plain = guard is None or guard.context is None
        if per_source.get(source, 0) >= MAX_HTTP_PER_SOURCE:
            refuse_at_once(conn, peer, "too_many_connections_per_source", plain)
            return
        if len(conns) >= MAX_HTTP_CONNECTIONS:
            oldest = next((t for t, st in conns.items() if st[1]), None)
            if oldest is None:  # every connection is being answered
                refuse_at_once(conn, peer, "too_many_connections", plain)
                return
            conns[oldest][1] = False
            endpoint.refuse("evicted", conns[oldest][2], "the oldest connection without a request made room")
            oldest.cancel()
        state = [source, True, peer, conn]
        task = loop.create_task(handle(conn, peer, state))
        conns[task] = state
        per_source[source] = per_source.get(source, 0) + 1
        task.add_done_callback(done)

    async def accept(sock: socket.socket) -> None:
        while True:
            try:
                conn, addr = await loop.sock_accept(sock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # EMFILE and friends: back off instead of spinning
                log.error("metrics endpoint: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            admit(conn, addr)

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    sock.setblocking(False)
    return HttpServer(sock, loop.create_task(accept(sock)))


async def _tls_or_plain_answered(loop: asyncio.AbstractEventLoop, conn: socket.socket, timeout_s: float,
                                 endpoint: _Endpoint, peer: str) -> bool:
    """TLS port: wait for the first byte; a plain HTTP request is answered 400 in plain text
    (it could not read a TLS alert) and counted. True when the client speaks TLS (or said
    nothing yet: the handshake's timeout decides)."""
    ready: asyncio.Future[None] = loop.create_future()
    fd = conn.fileno()

    def readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await asyncio.wait_for(ready, timeout_s)
        first = conn.recv(1, socket.MSG_PEEK)
    except (asyncio.TimeoutError, OSError):
        return True
    finally:
        loop.remove_reader(fd)
    if first and first != b"\x16" and first.isalpha():  # 0x16: a TLS handshake record
        endpoint.refuse("tls_not_tls", peer, "plain HTTP on the TLS port")
        try:
            conn.recv(MAX_HEADER_BYTES)  # read what came, or the close resets the answer away
            conn.send(_response(400, b"this endpoint speaks HTTPS (TLS)\n"))
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        conn.close()
        return False
    return True
