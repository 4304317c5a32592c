"""The only module that touches transports: one ``Link`` per proxied connection.

How this works: a listener's accept loop (server.py) hands each accepted socket to a new
``Link``, which owns two ``Endpoint`` protocols (the client side and the upstream side) and one
sans-IO ``Session``; routes (``route.py``) hold what the links of a listener share.

* ``serve``: the socket is wrapped with ``loop.connect_accepted_socket(ssl=...)`` (server side,
  client certificate required), so a failed handshake raises here, where it is classified and
  counted; the verified certificate goes through the ACL; then the upstream slot is taken (the
  real server serves one client at a time) and a plain TCP connection is opened to the
  loopback ``ggml-rpc-server``. At the end the upstream is half-closed and drained, never cut
  under a response (the server dies of SIGPIPE).
* ``connect``: the accepted loopback socket reads at once; a TLS connection to the node is
  opened with the node's expected name.

Bytes read on one side go through ``Session.client_data`` / ``server_data`` and whatever the
session queued is written to the other side. Endpoints are ``BufferedProtocol``s reading into
a preallocated buffer (TLS decrypts straight into it); accepted frames are forwarded as
memoryviews into that buffer, so a payload byte is never copied by Python code. A transport
may keep a memoryview queued (uvloop does not copy), so when the destination still holds
unsent data after a write, the source switches to a fresh buffer instead of overwriting.
Flow control: when the destination's write buffer passes its high-water mark the source
stops reading until it drains, so memory stays flat whatever the tensor size.

A session refused before it is active (TLS, identity, version, upstream down or busy) is
answered at HELLO with the refusal version 0.0.N so llama.cpp reports a version mismatch
instead of a crashed server; a refusal mid-session closes both sides.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import ssl
import time

from rpcguard.errors import FirewallRefusal, Refusal
from rpcguard.protocol.firewall import Firewall
from rpcguard.protocol.session import ACTIVE, AWAIT_HELLO_REPLY, Session
from rpcguard.protocol.versions import format_version, spec_for
from rpcguard.route import UPSTREAM_DRAIN_S, Route
from rpcguard.identity import check_usage
from rpcguard.tls import classify_handshake_error, peer_identity

__all__ = ["Endpoint", "Link", "READ_BUFFER_BYTES"]

log = logging.getLogger("rpcguard.relay")

# One read lands in this buffer. 256 KiB: large enough that a multi-MB SET_TENSOR costs a few
# Python calls per MB, small enough that many sessions stay cheap.
READ_BUFFER_BYTES = 256 * 1024
# A destination holding more than this unsent stops the source from reading (flow control);
# with the read buffer this bounds per-session memory to a few MB.
WRITE_HIGH_WATER_BYTES = 2 * 1024 * 1024
WRITE_LOW_WATER_BYTES = 512 * 1024

# Several small frames queued in one turn are joined into one write: a TLS transport makes a
# record (and often a syscall) per element of writelines(). Large chunks are never copied.
JOIN_MAX_BYTES = 64 * 1024

_ids = itertools.count(1)


def _write(transport: asyncio.Transport, out: list) -> None:
    if len(out) == 1:
        transport.write(out[0])
    elif sum(map(len, out)) <= JOIN_MAX_BYTES:
        transport.write(b"".join(out))
    else:
        transport.writelines(out)


class Endpoint(asyncio.BufferedProtocol):
    """One side of a link: reads into a reusable buffer and reports to the link."""

    __slots__ = ("link", "is_client", "transport", "buf", "view", "closed")

    def __init__(self, link: Link, is_client: bool) -> None:
        self.link = link
        self.is_client = is_client
        self.transport: asyncio.Transport | None = None
        # Allocated on the first read, not here: a TLS handshake that never completes (a flood of
        # idle or garbage sockets) must not cost a read buffer per accepted socket.
        self.buf: bytearray | None = None
        self.view: memoryview | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        transport.set_write_buffer_limits(WRITE_HIGH_WATER_BYTES, WRITE_LOW_WATER_BYTES)  # type: ignore[attr-defined]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.view is None:
            self.fresh_buffer()
        return self.view  # type: ignore[return-value]

    def buffer_updated(self, nbytes: int) -> None:
        self.link.data(self, self.view[:nbytes])  # type: ignore[index]

    def eof_received(self) -> bool:
        self.link.eof(self)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        # Let the read buffer go now: the link, its endpoints and transports form reference
        # cycles that only the cyclic GC frees, and ended sessions wait in its oldest generation
        # (serve's RSS grew ~10 MiB per 100 llama.cpp runs until a full collection).
        self.buf = self.view = None
        self.link.lost(self, exc)

    def pause_writing(self) -> None:
        self.link.pause_other(self)

    def resume_writing(self) -> None:
        self.link.resume_other(self)

    def fresh_buffer(self) -> None:
        """The transport may still reference the old buffer: read into a new one."""
        self.buf = bytearray(READ_BUFFER_BYTES)
        self.view = memoryview(self.buf)


class Link:
    """One proxied session: client endpoint, upstream endpoint, session, timers, accounting."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self.id = next(_ids)
        self.peer = "-"
        self.identity = ""
        self.profile = route.default  # settings branch: replaced by the identity's profile (life reworks this)
        self.session = Session(self.profile.policy, route.facts)
        self.client = Endpoint(self, True)
        self.upstream: Endpoint | None = None
        self.upstream_ready = False
        self.pending: list[bytes] = []  # client bytes accepted before the upstream was connected
        self.refusal: Refusal | None = None  # refused before ACTIVE: answer at HELLO
        self.identity_refused = False  # the certificate is not on the allow-list (a refusal even without HELLO)
        self.result = ""
        self.reason = ""
        self.t0 = time.monotonic()
        self.last_activity = self.t0
        self.refused_command = "-"  # command of the frame that was refused
        self.detail = ""
        self._hello_seen: asyncio.Event | None = None  # serve: set when the client's HELLO arrives
        self.client_blocked_since = 0.0  # when the client's write buffer filled up (flow control)
        self.t_accepted = self.t0  # after the TLS handshake (serve) or the accept (connect)
        self.t_upstream = self.t0
        self.admitted = False  # past the TLS handshake (serve) / accepted (connect): counts in max_sessions
        self.frame_started = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._slot_held = False
        self._drain_timer: asyncio.TimerHandle | None = None  # serve: upstream being drained
        self._done = False

    # ----------------------------------------------------------------------------- set-up
    async def run(self, sock: socket.socket) -> None:
        """Serve one accepted socket: TLS (serve), identity, upstream slot, upstream connection."""
        route = self.route
        loop = asyncio.get_running_loop()
        try:
            peer = sock.getpeername()
            self.peer = f"{peer[0]}:{peer[1]}"
        except OSError:
            pass
        route.links.add(self)
        route.traffic.session_started(self.session.stats)
        self._schedule_check()
        try:
            if route.role == "serve":
                if not await self._accept_tls(loop, sock):
                    return
            else:
                await loop.connect_accepted_socket(lambda: self.client, sock)
            self.t_accepted = time.monotonic()
            # Only admitted links count: sockets still in their TLS handshake (bounded by
            # handshake_timeout_s) must not let an unauthenticated flood lock clients out.
            self.admitted = True
            if sum(link.admitted for link in route.links) > route.limits.max_sessions:
                raise Refusal("too_many_sessions", f"more than {route.limits.max_sessions} sessions")
            p = self.profile
            if p is not route.default and sum(x.admitted and x.profile.name == p.name for x in route.links) > p.limits.max_sessions:
                raise Refusal("too_many_sessions", f"more than {p.limits.max_sessions} sessions of profile {p.name}")
            if route.draining:
                raise Refusal("shutdown", "rpcguard is shutting down")
            if self.refusal is not None:
                return
            if route.slot is not None:
                # Take the single upstream slot only once the client has said HELLO: an
                # authenticated client that sends nothing must not block the node meanwhile
                # (it is cut by hello_timeout_s without ever holding the slot).
                if self.session.hello_request_len is None:
                    self._hello_seen = asyncio.Event()
                    await self._hello_seen.wait()
                    if self._done:
                        return
                route.traffic.queue_depth = route.slot.waiting + 1
                try:
                    await route.slot.acquire(self.profile.limits)
                finally:
                    route.traffic.queue_depth = route.slot.waiting
                self._slot_held = True
                if self._done:
                    route.slot.release()
                    self._slot_held = False
                    return
            await self._open_upstream(loop)
        except Refusal as refusal:
            self._refuse_early(refusal)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never let one link take the listener down
            log.exception("link %d: unexpected error during set-up", self.id)
            self._refuse_early(Refusal("refused", f"internal error: {exc!r}"))
        finally:
            if self.client.transport is None:
                sock.close()

    async def _accept_tls(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bool:
        route = self.route
        assert route.ssl_context is not None
        try:
            await loop.connect_accepted_socket(
                lambda: self.client,
                sock,
                ssl=route.ssl_context(),
                ssl_handshake_timeout=route.limits.handshake_timeout_s or None,
            )
        except (ssl.SSLError, OSError, asyncio.TimeoutError, ConnectionError) as exc:
            reason = classify_handshake_error(exc)
            route.traffic.tls_failure(reason)
            self._finish("refused", reason, f"TLS handshake failed: {exc}")
            return False
        transport = self.client.transport
        if transport is None or self.client.closed:
            self._finish("error", "tls_handshake_failed", "connection closed during TLS handshake")
            return False
        ident = peer_identity(transport.get_extra_info("ssl_object"))
        self.identity = ident.label()
        try:
            check_usage(ident, "client")  # clientAuth EKU, whoever issued the certificate
            if route.acl is not None:
                route.acl().authorize(ident)
                self.profile = p = route.profile_for(ident)  # no request was checked yet: swap its policy
                s = self.session
                s.policy, s.firewall, s._enforce = p.policy, Firewall(s.state, p.policy.firewall), p.policy.mode == "enforce"
        except Refusal as refusal:
            # Not a TLS failure (the handshake worked): counted in refusals_total when the
            # session ends, answered at HELLO so the client sees why.
            self.refusal = refusal
            self.identity_refused = True
        return True

    async def _open_upstream(self, loop: asyncio.AbstractEventLoop) -> None:
        route = self.route
        endpoint = Endpoint(self, False)
        kwargs: dict = {}
        if route.role == "connect":
            assert route.ssl_context is not None
            kwargs = dict(
                ssl=route.ssl_context(),
                server_hostname=route.server_name,
                ssl_handshake_timeout=route.limits.handshake_timeout_s or None,
            )
        try:
            await asyncio.wait_for(
                loop.create_connection(lambda: endpoint, route.upstream_host, route.upstream_port, **kwargs),
                (route.limits.connect_timeout_s + route.limits.handshake_timeout_s) or None,
            )
        except (ssl.SSLError, ssl.CertificateError) as exc:
            reason = classify_handshake_error(exc)
            route.traffic.tls_failure(reason)
            raise Refusal("tls_failed" if reason != "node_name_mismatch" else reason,
                          f"TLS to node {self._upstream_text()} failed ({reason}): {exc}") from None
        except (OSError, asyncio.TimeoutError) as exc:
            reason = "node_unreachable" if route.role == "connect" else "upstream_unavailable"
            raise Refusal(reason, f"cannot reach {self._upstream_text()}: {exc or 'timeout'}") from None
        if self._done:
            endpoint.transport.close()  # type: ignore[union-attr]
            return
        if route.role == "connect":
            try:  # the node's certificate must be a server certificate (serverAuth EKU)
                check_usage(peer_identity(endpoint.transport.get_extra_info("ssl_object")), "server")  # type: ignore[union-attr]
            except Refusal as refusal:
                endpoint.transport.close()  # type: ignore[union-attr]
                route.traffic.tls_failure(refusal.reason)
                raise Refusal(refusal.reason, f"node {self._upstream_text()}: {refusal.detail}") from None
        self.upstream = endpoint
        self.upstream_ready = True
        self.t_upstream = time.monotonic()
        if self.pending:
            endpoint.transport.writelines(self.pending)  # type: ignore[union-attr]
            self.pending.clear()

    def _upstream_text(self) -> str:
        return f"{self.route.upstream_host}:{self.route.upstream_port}"

    def _refuse_early(self, refusal: Refusal) -> None:
        self.refusal = refusal
        if self.session.phase == AWAIT_HELLO_REPLY:
            self._answer_refusal()  # else: answered once the HELLO arrives

    def _answer_refusal(self) -> None:
        refusal = self.refusal
        assert refusal is not None
        transport = self.client.transport
        if transport is not None and not self.client.closed:
            transport.write(self.session.refusal_answer(refusal.reason))
        self._finish("refused", refusal.reason, refusal.detail)

    # ----------------------------------------------------------------------------- data path
    def data(self, endpoint: Endpoint, view: memoryview) -> None:
        if self._done:
            return
        now = time.monotonic_ns()
        session = self.session
        try:
            if endpoint.is_client:
                session.client_data(view, now)
            else:
                session.server_data(view, now)
        except Refusal as refusal:
            self._refused(refusal)
            return
        except Exception:  # a bug must cost one session, never the process
            log.exception("session %d: internal error while parsing", self.id)
            self._finish("error", "internal_error", "internal error (logged)")
            return
        self.last_activity = now / 1e9
        if self._hello_seen is not None and session.hello_request_len is not None:
            self._hello_seen.set()
        if session.violations:
            self._report_violations()
        if session.to_server:
            self._flush_to_server(endpoint)
        if session.to_client:
            out = session.to_client
            transport = self.client.transport
            if transport is not None and not self.client.closed:
                _write(transport, out)
                if transport.get_write_buffer_size() and not endpoint.is_client:
                    endpoint.fresh_buffer()
            out.clear()
        if session.node_refusal is not None and not self._done:
            self.refusal = Refusal(session.node_refusal, "refused by the node")
            self._finish("refused", "node_refused", f"node refused the session: {session.node_refusal}")
            return
        if self.refusal is not None and session.phase == AWAIT_HELLO_REPLY:
            self._answer_refusal()

    def _flush_to_server(self, source: Endpoint) -> None:
        out = self.session.to_server
        if self.refusal is not None:
            out.clear()  # refused: never forward, just wait to answer HELLO
            return
        if not self.upstream_ready:
            self.pending.extend(bytes(chunk) for chunk in out)
            out.clear()
            return
        transport = self.upstream.transport  # type: ignore[union-attr]
        _write(transport, out)  # type: ignore[arg-type]
        out.clear()
        if source.is_client and transport.get_write_buffer_size():  # type: ignore[union-attr]
            source.fresh_buffer()

    def _refused(self, refusal: Refusal) -> None:
        self.refused_command = self.session.command_name
        if isinstance(refusal, FirewallRefusal):
            self.route.traffic.firewall_violation(refusal.reason, "enforce")
        if self.session.phase != ACTIVE and self.session.hello_request_len is not None:
            self.refusal = refusal
            self._answer_refusal()
        else:
            self._finish("refused", refusal.reason, refusal.detail)

    def _report_violations(self) -> None:
        for v in self.session.violations:
            self.route.traffic.firewall_violation(v.reason, "monitor")
            log.warning(
                "monitor: would refuse session=%d listener=%s identity=%s command=%s reason=%s detail=%s",
                self.id, self.route.name, self.identity or "-", v.command, v.reason, v.detail,
            )
        self.session.violations.clear()

    def eof(self, endpoint: Endpoint) -> None:
        self._finish_on_close(endpoint, None)

    def lost(self, endpoint: Endpoint, exc: Exception | None) -> None:
        if endpoint is self.upstream and self._drain_timer is not None:
            self._upstream_drained()
            return
        self._finish_on_close(endpoint, exc)

    def _drain_upstream(self, endpoint: Endpoint) -> bool:
        """Half-close the upstream and drop what it still sends until it hangs up; the slot is
        kept until then (``UPSTREAM_DRAIN_S`` at most).

        ggml-rpc-server does not ignore SIGPIPE: a response written to a connection closed under
        it (a client gone while a command runs, a refusal, a drain) kills the server. After our
        EOF it answers the command it is running, reads the EOF and closes its side.
        """
        transport = endpoint.transport
        try:
            transport.write_eof()  # type: ignore[union-attr]
            transport.resume_reading()  # type: ignore[union-attr]  # flow control may have paused it
        except Exception:
            return False
        self._drain_timer = asyncio.get_running_loop().call_later(UPSTREAM_DRAIN_S, self._upstream_drained, True)
        if self._slot_held and self.route.slot is not None:
            self.route.slot.draining = True
        return True

    def _upstream_drained(self, timed_out: bool = False) -> None:
        if self._drain_timer is None:
            return
        self._drain_timer.cancel()
        self._drain_timer = None
        upstream = self.upstream
        if timed_out and upstream is not None and upstream.transport is not None and not upstream.closed:
            upstream.transport.abort()
        if self._slot_held and self.route.slot is not None:
            self.route.slot.release()
            self._slot_held = False

    def _finish_on_close(self, endpoint: Endpoint, exc: Exception | None) -> None:
        if self._done:
            return
        if endpoint.is_client and self.identity_refused and self.refusal is not None:
            self._finish("refused", self.refusal.reason, self.refusal.detail)  # left before its HELLO
        elif endpoint.is_client:
            clean = self.session.idle or (self.session.phase == ACTIVE and not self.session.mid_frame)
            self._finish("ok" if clean else "error", "" if clean else "client_closed_mid_frame",
                         "client closed" + (f": {exc}" if exc else ""))
        elif self.session.phase != ACTIVE:
            # Before the session is active the client must get the 0.0.N answer, even when the
            # upstream went away before the client's HELLO arrived (then data() answers it).
            self.upstream_ready = False
            if isinstance(exc, ssl.SSLError):
                # TLS 1.3: the node rejects our certificate after the handshake, on the first read.
                reason = classify_handshake_error(exc)
                self.route.traffic.tls_failure(reason)
                self.refusal = Refusal("tls_failed", f"the node refused the TLS session ({reason}): {exc}")
            elif self.route.role == "connect":
                # A node's rpcguard answers every HELLO, refusals included: a bare close means
                # its TLS layer dropped us after the handshake (certificate refused).
                self.route.traffic.tls_failure("tls_handshake_failed")
                self.refusal = Refusal("tls_failed", "the node closed the TLS session before answering HELLO: "
                                       "its rpcguard refused this certificate (see the node's log)")
            else:
                self.refusal = self._hello_closed_refusal()
            if self.session.phase == AWAIT_HELLO_REPLY:
                self._answer_refusal()
        else:
            self._finish("error", "upstream_closed", "upstream closed" + (f": {exc}" if exc else ""))

    def _hello_closed_refusal(self) -> Refusal:
        """The upstream hung up on the HELLO: say why when its version tells (a HELLO of the other era)."""
        known = self.route.facts.version
        spec = spec_for(known) if known is not None else None
        sent = self.session.hello_request_len
        if spec is not None and sent is not None and sent != spec.hello_request:
            era = "pre-4.0.0 (0-byte)" if sent == 0 else ">= 4.0.0 (24-byte)"
            return Refusal("version_not_accepted", f"the client sent a {era} HELLO; the upstream speaks "
                                                   f"{format_version(known)} and closed the connection")
        return Refusal("upstream_unavailable", "upstream closed the connection at HELLO")

    def pause_other(self, endpoint: Endpoint) -> None:
        if endpoint.is_client:
            self.client_blocked_since = time.monotonic()  # the client is not reading its responses
        other = self.upstream if endpoint.is_client else self.client
        if other is not None and other.transport is not None and not other.closed:
            other.transport.pause_reading()

    def resume_other(self, endpoint: Endpoint) -> None:
        if endpoint.is_client:
            self.client_blocked_since = 0.0
        other = self.upstream if endpoint.is_client else self.client
        if other is not None and other.transport is not None and not other.closed:
            other.transport.resume_reading()

    # ----------------------------------------------------------------------------- timers
    def _schedule_check(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(1.0, self._check_timers)

    def _check_timers(self) -> None:
        if self._done:
            return
        limits = self.profile.limits
        now = time.monotonic()
        session = self.session
        if session.phase != ACTIVE and limits.hello_timeout_s:
            if session.hello_request_len is None:
                # The client has not sent its HELLO. The clock starts after the TLS handshake
                # (admitted); the handshake itself is bounded by handshake_timeout_s.
                if self.admitted and now - self.t_accepted > limits.hello_timeout_s:
                    self._finish("refused", "hello_timeout", f"no HELLO within {limits.hello_timeout_s:g} s")
                    return
            elif self.upstream_ready and now - self.t_upstream > limits.hello_timeout_s + (
                limits.queue_timeout_s if self.route.role == "connect" else 0
            ):
                # Queueing for the upstream is bounded by queue_timeout_s; a server that takes the
                # connection but never answers HELLO is bounded here. connect's upstream is the
                # node's serve, which may queue the HELLO behind another session for its own
                # queue_timeout_s (then answers upstream_busy itself).
                self.refusal = Refusal("upstream_unavailable", "the upstream did not answer HELLO")
                self._answer_refusal()
                return
        if session.phase == ACTIVE:
            quiet = now - self.last_activity
            if limits.idle_timeout_s and session.idle and quiet > limits.idle_timeout_s:
                self._finish("refused", "idle_timeout", f"idle for {quiet:.0f} s")
                return
            if limits.frame_timeout_s and not session.idle and quiet > limits.frame_timeout_s and session.mid_frame:
                self._finish("refused", "frame_timeout", f"a request frame stalled for {quiet:.0f} s")
                return
        if limits.frame_timeout_s and self.client_blocked_since and now - self.client_blocked_since > limits.frame_timeout_s:
            # A client that stops reading its responses would hold the single upstream slot forever.
            self._finish("refused", "frame_timeout",
                         f"the client has not read its responses for {now - self.client_blocked_since:.0f} s")
            return
        if limits.max_session_s and now - self.t0 > limits.max_session_s:
            self._finish("refused", "session_lifetime", f"session older than {limits.max_session_s:g} s")
            return
        self._schedule_check()

    # ----------------------------------------------------------------------------- teardown
    def close_for_shutdown(self) -> None:
        self._finish("refused", "shutdown", "drain timeout reached")

    def _finish(self, result: str, reason: str, detail: str) -> None:
        if self._done:
            return
        self._done = True
        if self._hello_seen is not None:
            self._hello_seen.set()  # wake run() so it ends
        self.result, self.reason, self.detail = result, reason, detail
        route = self.route
        for endpoint in (self.client, self.upstream):
            if endpoint is not None and endpoint.transport is not None and not endpoint.closed:
                if endpoint is self.upstream and route.role == "serve" and self._drain_upstream(endpoint):
                    continue
                # close() flushes what is queued (the refusal answer); an error aborts.
                endpoint.transport.close() if result != "error" or endpoint is self.client else endpoint.transport.abort()
        if self._timer is not None:
            self._timer.cancel()
        if self._slot_held and route.slot is not None and self._drain_timer is None:
            route.slot.release()
            self._slot_held = False
        route.links.discard(self)
        if result == "refused" and reason:
            route.traffic.refusal(reason)
        if self.session.version is not None:
            route.traffic.upstream_version = format_version(self.session.version)
        route.traffic.session_ended(self.session.stats, result)
        unverified = self.session.state.unverified_uses
        if unverified:  # ops the site allowed without a verified rule: counted, and in the log line
            for op, n in unverified.items():
                route.traffic.unverified_ops[op] = route.traffic.unverified_ops.get(op, 0) + n
            detail = f"{detail} unverified_ops={','.join(f'{op}:{n}' for op, n in sorted(unverified.items()))}"
            self.detail = detail
        record = self.audit_record()
        level = logging.INFO if result == "ok" else logging.WARNING
        log.log(
            level,
            "session end id=%d role=%s listener=%s peer=%s identity=%s result=%s reason=%s command=%s detail=%s",
            self.id, route.role, route.name, self.peer, self.identity or "-", result, reason or "-",
            self.refused_command, detail,
            extra={"audit": record},
        )
        if route.on_session_end is not None:
            route.on_session_end(record)

    def audit_record(self) -> dict:
        """The per-session audit record (one per session, logged at its end)."""
        s = self.session
        return {
            "event": "session_end",
            "session": self.id,
            "role": self.route.role,
            "listener": self.route.name,
            "peer": self.peer,
            "identity": self.identity,
            "profile": self.profile.name,
            "upstream": self._upstream_text(),
            "version": format_version(s.version) if s.version else None,
            "duration_s": round(time.monotonic() - self.t0, 6),
            "result": self.result,
            "reason": self.reason or None,
            "command": self.refused_command if self.refused_command != "-" else None,
            "detail": self.detail,
            "alloc_bytes": s.stats.alloc_bytes,
            "upload_bytes": s.stats.upload_bytes_set,
            "hash_hit_bytes": s.stats.upload_bytes_hash_hit,
            "commands": s.stats.per_command(),
        }
