"""One ``Link`` per proxied connection: the glue between two endpoints and the lifecycle.

Stays whole (over 400 lines): the relay side of one link: the lifecycle's actions are carried out
here against the two endpoints and the upstream provider, in the order the lifecycle made them;
splitting the action handlers from the write path would split that order across modules.

How this works: a listener's accept loop (proxy/server.py) hands each accepted socket to a new
``Link``, which owns two ``Endpoint`` protocols (proxy/endpoint.py: the client side and the upstream
side) and one sans-IO ``Lifecycle`` (protocol/lifecycle.py: states, deadlines, refusals at
HELLO, close classification, the audit record) which owns the ``Session``. The link is glue: it
turns transport callbacks into lifecycle events and carries out the actions the lifecycle
answers (write, dial, take or free the upstream slot, half-close, close, count, log). The clock
and the dialer are injectable. The ``Route`` (proxy/route.py) holds what the links of a listener
share and decides admission.

* ``serve``: the socket is wrapped with ``loop.connect_accepted_socket(ssl=...)`` (client
  certificate required), so a failed handshake raises here, where it is classified and counted;
  then admission, the upstream slot (the server serves one client at a time) and a plain TCP
  connection to the loopback ``ggml-rpc-server``, half-closed and drained at the end, never cut
  under a response (the server dies of SIGPIPE).
* ``connect``: the accepted loopback socket reads at once; a TLS connection to the node is
  opened with the node's expected name. When the node negotiates the ALPN ``rpcguard/1`` (it is
  an rpcguard ``serve``), the session leaves the request firewall to it
  (``SessionPolicy.validate_requests``).

Bytes read on one side go through ``Lifecycle.feed`` (the session's
feed, its refusals and events handed to the lifecycle: the one feed contract); what the session
queued is written to the other side as memoryviews into the read buffer (proxy/endpoint.py). Small
client frames the server does not answer (``Output.urgent`` False) are copied aside and go out
with the next frame that needs the server, in one write (``HOLD_MAX_BYTES``).

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
from typing import Any, Awaitable, Callable, TypeVar

from rpcguard.proxy.endpoint import FAIR_READ_BYTES, JOIN_MAX_BYTES, Dialer, Endpoint, check_node, dial
from rpcguard.errors import UPSTREAM, Refusal
from rpcguard.protocol.commands import BATCH_MAX_BYTES
from rpcguard.protocol.lifecycle import Lifecycle
from rpcguard.protocol.linkstate import (
    ACTIONS, ACTIVE, CLOSED, VALIDATING, AbortUpstream, CloseClient, CloseUpstream, CountTlsFailure, CountViolation,
    End, FreeSlot, HalfCloseUpstream, OpenUpstream, TakeSlot, Validate, WriteClient, WriteUpstream,
)
from rpcguard.protocol.session import Output
from rpcguard.protocol.settings import Limits
from rpcguard.proxy.plaintext import plaintext_hello
from rpcguard.proxy.route import Route
from rpcguard.proxy.validators import Validators
from rpcguard.pki.identity import PeerIdentity, source_of
from rpcguard.pki.tls import classify_handshake_error, negotiated_rpcguard, notices

__all__ = ["Link", "HOLD_MAX_BYTES", "TICK_S", "FAIR_CHUNKS", "FAIR_READ_NS", "FAIR_WIDEN_CHUNKS", "VALIDATORS"]

# The session-end line's level by result: a probe (rpcguard check, connect's /readyz every few
# seconds) is no news; a refusal or an error is.
_END_LEVEL = {"ok": logging.INFO, "no_hello": logging.INFO, "probe": logging.DEBUG}

log = logging.getLogger("rpcguard.relay")

# Client frames the server does not answer (Output.urgent False: SET_TENSOR) wait, copied, until
# the next urgent frame, up to this many bytes; then they go out with it in one write (one TLS
# record on the tunnel, one wake-up of the far side). Held bytes also go out before any other
# write to the upstream, before its close or half-close, on the client's EOF and at the next tick.
HOLD_MAX_BYTES = BATCH_MAX_BYTES

_ids = itertools.count(1)
TICK_S = 1.0  # how often the lifecycle's deadlines are checked

# Loop fairness: a read that produced more than FAIR_CHUNKS frames (chunks, each way) and took
# longer than FAIR_READ_NS makes its side read FAIR_READ_BYTES (proxy/endpoint.py) at a time, one
# read per loop turn, so that other sessions, handshakes and /healthz run between its reads
# (one 256 KiB read of GET_ALIGNMENTs is ~29,000 frames, tens of ms). llama.cpp's reads carry a
# few frames each (a decode step is ~8), so it never gets here and pays one len() per read;
# a read of FAIR_WIDEN_CHUNKS or fewer frames gives the side its full buffer back.
FAIR_CHUNKS = 64
FAIR_READ_NS = 1_000_000
FAIR_WIDEN_CHUNKS = 4
assert FAIR_READ_BYTES >= 1024

# Large graphs (session.DEFER_GRAPH_BYTES and up) are validated off the loop, fairly between
# identities (proxy/validators.py): a crafted graph takes up to policy max_graph_cpu_s (500 ms)
# to validate, and every other session, handshake and probe of the process would wait that long.
# While one runs, its link holds both sides' reads and defers every other callback (``_later``).
VALIDATORS = Validators()



class Link:
    """One proxied connection: two endpoints, the lifecycle, and the glue between them."""

    def __init__(self, route: Route, *, clock_ns: Callable[[], int] = time.monotonic_ns, dialer: Dialer = dial,
                 check_upstream: Callable[[Route, asyncio.BaseTransport], None] = check_node) -> None:
        self.route = route
        self.id = next(_ids)
        self._clock_ns = clock_ns
        self.dialer = dialer
        self.check_upstream = check_upstream
        self.lc = Lifecycle(
            link_id=self.id, side=route.side, listener=route.name,
            upstream=f"{route.upstream_host}:{route.upstream_port}", default=route.default, facts=route.facts,
            clock=self._clock,
        )
        self.client = Endpoint(self, True)
        self.upstream: Endpoint | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self._held = bytearray()  # client frames waiting for the next urgent one (HOLD_MAX_BYTES)
        # While the link is VALIDATING a graph off the loop: its callbacks that came meanwhile, in order.
        self._later: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self.peer_cert: PeerIdentity | None = None  # serve: the client certificate (Route.admit)
        self._expiry: asyncio.TimerHandle | None = None  # ends the session at its notAfter
        self._gone = False  # serve: the upstream closed under an active session, the crash check runs

    def _clock(self) -> float:
        return self._clock_ns() / 1e9

    @property
    def identity(self) -> str:
        """The session's client identity ("" before admission)."""
        return self.lc.identity

    # ----------------------------------------------------------------------------- set-up
    async def run(self, sock: socket.socket) -> None:
        """Serve one accepted socket: TLS (serve) and admission; the lifecycle drives the rest."""
        route = self.route
        loop = asyncio.get_running_loop()
        try:
            peer = sock.getpeername()
            self.lc.accepted(f"{peer[0]}:{peer[1]}", source_of(str(peer[0])))  # per-source caps: an IPv6 host's /64
        except OSError:
            pass
        route.links.add(self)
        route.traffic.session_started(self.lc.stats)
        self._schedule_tick()
        try:
            if route.side.client_tls:
                assert route.ssl_context is not None
                too_many = route.handshake_refusal(self.lc.source)
                if too_many is not None:
                    self.lc.rejected(too_many)  # closed at once (finally), no TLS spent on it
                else:
                    await self._handshake(loop, sock)
            else:
                await loop.connect_accepted_socket(lambda: self.client, sock)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never let one link take the listener down
            log.exception("link %d: unexpected error during set-up", self.id)
            self.lc.handshake_failed("error", "internal_error", f"internal error: {exc!r}")
        finally:
            if self.client.transport is None:
                sock.close()
        self._apply()

    async def _handshake(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        """serve: the TLS handshake, counted among its source's (``max_handshakes_per_source``)."""
        route, source = self.route, self.lc.source
        route.handshaking[source] = route.handshaking.get(source, 0) + 1
        try:
            if await plaintext_hello(loop, sock, route.default.limits.handshake_timeout_s):
                self.lc.handshake_failed("refused", "tls_not_tls", "a plaintext ggml-rpc HELLO on the TLS port: "
                                         "llama.cpp must reach serve through rpcguard connect (answered 0.0.25)")
                return
            await loop.connect_accepted_socket(
                lambda: self.client, sock, ssl=route.ssl_context(),  # type: ignore[misc]
                ssl_handshake_timeout=route.default.limits.handshake_timeout_s or None,
            )
        except (ssl.SSLError, OSError, asyncio.TimeoutError, ConnectionError) as exc:
            self.lc.handshake_failed("refused", classify_handshake_error(exc), f"TLS handshake failed: {exc}")
        finally:
            left = route.handshaking[source] - 1
            if left:
                route.handshaking[source] = left
            else:
                del route.handshaking[source]

    def made(self, endpoint: Endpoint) -> None:
        """A transport is up: the client's (admission) or the upstream's (the dial worked)."""
        try:
            if endpoint.is_client:
                self._admit(endpoint)
            else:
                self._upstream_made(endpoint)
        except Exception as exc:
            log.exception("link %d: unexpected error during set-up", self.id)
            refusal = Refusal("refused", f"internal error: {exc!r}")
            self.lc.admit(self.route.default, "", refusal) if endpoint.is_client else self.lc.upstream_failed(refusal)
        self._apply()

    def _admit(self, endpoint: Endpoint) -> None:
        ssl_object = endpoint.transport.get_extra_info("ssl_object") if self.route.side.client_tls else None  # type: ignore[union-attr]
        self.lc.admit(*self.route.admit(self, ssl_object))
        cert = self.peer_cert
        if cert is not None:  # a session never outlives its client certificate (docs/revocation.md)
            left = max(0.0, cert.not_after - time.time())
            self._expiry = asyncio.get_running_loop().call_later(
                left, self.end, Refusal("tls_cert_expired", "the client certificate expired during the session"))

    def end(self, refusal: Refusal) -> None:
        """End the session now with ``refusal``: its certificate expired, was revoked, or a reload
        took its identity off the allow-list. Counted and logged like any refusal."""
        if self._put_off(self.end, refusal):
            return
        if self.lc.state == CLOSED:
            return
        if self.lc.session is not None:
            self.lc.refused(refusal)
        else:  # still in its handshake or before its HELLO: the session never started
            self.lc.rejected(refusal)
        self._apply()

    def _upstream_made(self, endpoint: Endpoint) -> None:
        route = self.route
        if route.provider is not None and self.lc.session is not None:  # post-mortem of a crash
            self.lc.session.record_recent()
        try:
            self.check_upstream(route, endpoint.transport)  # type: ignore[arg-type]
        except Refusal as refusal:
            endpoint.transport.close()  # type: ignore[union-attr]
            route.traffic.tls_failure(refusal.reason)
            self.lc.upstream_failed(Refusal(refusal.reason, f"node {self.lc.upstream}: {refusal.detail}", party=UPSTREAM))
            return
        session = self.lc.session
        # auto: an rpcguard node runs the request firewall; connect keeps it in monitor mode, whose
        # point is to report what it would refuse (docs/firewall.md).
        if (route.side.upstream_is_guard and session is not None and session.policy.validate_requests == "auto"
                and session.policy.mode == "enforce" and negotiated_rpcguard(endpoint.transport.get_extra_info("ssl_object"))):  # type: ignore[union-attr]
            session.leave_requests_to_node()
        if session is not None and route.side.upstream_is_guard and notices(
                endpoint.transport.get_extra_info("ssl_object")):  # type: ignore[union-attr]
            session.expect_notices()  # the node says why it ends a session (protocol/notice.py)
        if session is not None:
            route.traffic.requests_checked(session.requests_checked_by)
            session.defer_graphs()  # large graphs: validated off the loop (VALIDATORS)
        self.lc.upstream_connected()

    # ----------------------------------------------------------------------------- data path
    def data(self, endpoint: Endpoint, view: memoryview) -> None:
        lc = self.lc
        if lc.state is VALIDATING:  # a graph is being validated: this waits (a copy: the buffer is reused)
            self._later.append((self.data, (endpoint, memoryview(bytes(view)))))
            return
        t_ns = self._clock_ns()
        try:  # the lifecycle's feed contract: a refusal reported, the session's events handled
            out = lc.feed(endpoint.is_client, view, t_ns)
        except Exception:  # a bug must cost one session, never the process
            self._internal_error("parsing")
            return
        self._deliver(endpoint, out, t_ns)

    def _internal_error(self, doing: str) -> None:
        log.exception("session %d: internal error while %s", self.id, doing)
        self.lc.out.clear()
        self.lc.internal_error()
        self._apply()

    def _deliver(self, endpoint: Endpoint, out: Output, t_ns: int) -> None:
        """Carry out one feed's ``Output`` (read on ``endpoint`` at ``t_ns``): writes, then actions."""
        lc = self.lc
        to_server = out.to_server
        many = len(to_server) + len(out.to_client)
        if many > FAIR_CHUNKS:
            # Many small frames in one read (a pipelined flood): past FAIR_READ_NS of work, this
            # side reads FAIR_READ_BYTES at a time, one read per loop turn (Endpoint.narrow).
            if self._clock_ns() - t_ns > FAIR_READ_NS:
                endpoint.narrow()
        elif endpoint.narrowed and many <= FAIR_WIDEN_CHUNKS:
            endpoint.widen()
        if to_server:
            if endpoint.is_client and not out.urgent:
                held = self._held
                if len(held) + sum(map(len, to_server)) <= HOLD_MAX_BYTES:
                    for chunk in to_server:
                        held += chunk
                    to_server.clear()
            if to_server:
                if self._held:  # held frames go first
                    to_server.insert(0, self._take_held())
                self._send(self.upstream, to_server, endpoint if endpoint.is_client else None)
        if out.to_client:
            self._send(self.client, out.to_client, None if endpoint.is_client else endpoint)
        if lc.actions:
            self._apply()

    @staticmethod
    def _send(dest: Endpoint | None, chunks: list[Any], source: Endpoint | None) -> None:
        """Write ``chunks`` to ``dest`` (if it is open) and clear the list: one chunk as it is, small
        ones joined into one write (a TLS transport makes a record, often a syscall, per element of
        writelines), large ones never copied (``JOIN_MAX_BYTES``). ``source``: the endpoint whose
        read buffer the chunks are views of; while ``dest`` holds unsent data (uvloop keeps the
        views, it does not copy) that endpoint reads into a fresh buffer."""
        transport = dest.transport if dest is not None else None
        if transport is not None and not dest.closed:  # type: ignore[union-attr]
            if len(chunks) == 1:
                transport.write(chunks[0])
            elif sum(map(len, chunks)) <= JOIN_MAX_BYTES:
                transport.write(b"".join(chunks))
            else:
                transport.writelines(chunks)
            if source is not None and transport.get_write_buffer_size():
                source.fresh_buffer()
        chunks.clear()

    # ----------------------------------------------------------------------------- large graphs
    def _validate(self, _: Validate) -> None:
        """The link is VALIDATING: queue the session's deferred graph validation (VALIDATORS, its
        identity's turn); reads stop meanwhile, and the link's other callbacks wait (``_later``)."""
        session = self.lc.session
        if session is None or not session.deferred:
            return
        for endpoint in (self.client, self.upstream):
            if endpoint is not None and endpoint.transport is not None and not endpoint.closed:
                endpoint.parked = True
                endpoint.transport.pause_reading()
        VALIDATORS.submit(self.lc.identity, session.validate_deferred, self._validated)

    def _validated(self, future: asyncio.Future) -> None:
        """The validation is over: the graph is refused or goes out with what followed it, then
        what the link was told meanwhile is replayed in order, then reads resume."""
        later, self._later = self._later, []
        lc, session = self.lc, self.lc.session
        if session is not None and session.deferred and lc.state is VALIDATING:
            t_ns = self._clock_ns()
            try:
                error = future.exception()
                if error is not None:
                    raise error
                out = lc.graph_validated(t_ns)
            except BaseException:  # a bug (or the executor shut down) costs this session only
                self._internal_error("validating a graph")
            else:
                self._deliver(self.client, out, t_ns)
        for i, (call, args) in enumerate(later):
            if self.lc.state is VALIDATING:  # another large graph: the rest waits for that one
                self._later.extend(later[i:])
                return
            call(*args)
        if self.lc.state is not VALIDATING:
            for endpoint in (self.client, self.upstream):
                if endpoint is not None and endpoint.parked:
                    endpoint.parked = False
                    if endpoint.transport is not None and not endpoint.closed and not endpoint.held:
                        endpoint.transport.resume_reading()

    def _put_off(self, call: Callable[..., None], *args: object) -> bool:
        """While a graph is validated off the loop, ``call(*args)`` waits: True if it was put off
        (``_validated`` replays it in order)."""
        if self.lc.state is not VALIDATING:
            return False
        self._later.append((call, args))
        return True

    def flush_held(self) -> None:
        """Send the held client frames (``HOLD_MAX_BYTES``) now."""
        if self._held:
            self._send(self.upstream, [self._take_held()], None)

    def _take_held(self) -> memoryview:
        """The held client frames, handed over whole: the link holds into a fresh buffer, since the
        transport may keep a view of this one."""
        held, self._held = self._held, bytearray()
        return memoryview(held)

    def eof(self, endpoint: Endpoint) -> None:
        if self._put_off(self.eof, endpoint):
            return
        if endpoint.is_client:
            self.flush_held()
            self.lc.client_closed()
        elif endpoint is self.upstream:
            if self._upstream_gone():
                return
            self.lc.upstream_closed()
        self._apply()

    def lost(self, endpoint: Endpoint, exc: Exception | None) -> None:
        if self._put_off(self.lost, endpoint, exc):
            return
        if endpoint.is_client:
            self.lc.client_closed(str(exc) if exc else "")
        elif endpoint is self.upstream:
            if self._upstream_gone(str(exc) if exc else ""):
                return
            tls_reason = classify_handshake_error(exc) if isinstance(exc, ssl.SSLError) else None
            self.lc.upstream_closed(str(exc) if exc else "", tls_reason)
        self._apply()

    def _upstream_gone(self, error: str = "") -> bool:
        """serve runs the server: an active session's upstream closed. Ask the pool whether the
        process died under it (``upstream_crashed``) before the lifecycle hears of the close."""
        provider = self.route.provider
        if provider is None or self.lc.state != ACTIVE:
            return False
        if not self._gone:
            self._gone = True
            self._spawn(self._crash_check(provider, error))
        return True

    async def _crash_check(self, provider, error: str) -> None:
        cause = await provider.crash_cause(self.id)
        self.lc.upstream_closed(error, crashed=cause)
        self._apply()

    def pause_other(self, endpoint: Endpoint) -> None:
        if self._put_off(self.pause_other, endpoint):
            return
        if endpoint.is_client:
            self.lc.client_blocked(True)  # the client is not reading its responses
        else:
            self.lc.upstream_blocked(True)  # the client's frames wait for the upstream: not its delay
        other = self.upstream if endpoint.is_client else self.client
        if other is not None and other.transport is not None and not other.closed:
            other.held = True
            other.transport.pause_reading()

    def resume_other(self, endpoint: Endpoint) -> None:
        if self._put_off(self.resume_other, endpoint):
            return
        if endpoint.is_client:
            self.lc.client_blocked(False)
        else:
            self.lc.upstream_blocked(False)
        other = self.upstream if endpoint.is_client else self.client
        if other is not None and other.transport is not None and not other.closed:
            other.held = False
            if not other.parked:
                other.transport.resume_reading()

    # ----------------------------------------------------------------------------- timers
    def _schedule_tick(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(TICK_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self.lc.state is VALIDATING:  # a graph is being validated: the deadlines wait for it
            self._schedule_tick()
            return
        self.flush_held()
        slot = self.route.slot
        self.lc.tick(self._clock(), slot.waiting_for(self.id) if slot is not None else 0)
        self._apply()
        if self.lc.state != CLOSED:
            self._schedule_tick()

    def close_for_shutdown(self) -> None:
        if self._put_off(self.close_for_shutdown):
            return
        self.lc.shutdown()
        self._apply()

    # ----------------------------------------------------------------------------- actions
    def _apply(self) -> None:
        """Carry out what the lifecycle asked for, in order (an action may raise new ones)."""
        actions = self.lc.actions
        while actions:
            action = actions.pop(0)
            _APPLY[type(action)](self, action)
        if self.lc.state == CLOSED and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.lc.state == CLOSED and self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _write_client(self, a: WriteClient) -> None:
        transport = self.client.transport
        if transport is not None and not self.client.closed:
            transport.write(a.data)

    def _write_upstream(self, a: WriteUpstream) -> None:
        self.flush_held()
        up = self.upstream
        if up is not None and up.transport is not None and not up.closed:
            up.transport.writelines(a.chunks)

    def _open_upstream(self, a: OpenUpstream) -> None:
        self._spawn(self._dial(a.limits))

    async def _dial(self, limits: Limits) -> None:
        endpoint = self.upstream = Endpoint(self, False)
        try:
            await self.dialer(self.route, lambda: endpoint, limits)
        except Refusal as refusal:
            self.lc.upstream_failed(refusal)
        except Exception as exc:
            log.exception("link %d: unexpected error while dialling the upstream", self.id)
            self.lc.upstream_failed(Refusal("refused", f"internal error: {exc!r}"))
        self._apply()

    def _take_slot(self, a: TakeSlot) -> None:
        self._spawn(self._queue(a.limits))

    async def _queue(self, limits: Limits) -> None:
        """Take the single upstream slot (serve), or be refused per ``upstream_busy``."""
        refusal = await self.route.take_slot(limits, self.id, self.lc.identity)
        self.lc.slot_granted() if refusal is None else self.lc.slot_refused(refusal)
        self._apply()

    def _free_slot(self, _: FreeSlot) -> None:
        if self.route.slot is not None:
            self.route.slot.release(self.id)

    def _half_close_upstream(self, a: HalfCloseUpstream) -> None:
        """Half-close the upstream and drop what it still sends until it hangs up; the slot is
        kept until then (``UPSTREAM_DRAIN_S`` without progress, ``UPSTREAM_DRAIN_MAX_S`` in all).

        ggml-rpc-server does not ignore SIGPIPE: a response written to a connection closed under
        it (a client gone while a command runs, a refusal, a drain) kills the server. After our
        EOF it answers the command it is running, reads the EOF and closes its side.
        """
        self.flush_held()
        up = self.upstream
        transport = up.transport if up is not None else None
        try:
            transport.write_eof()  # type: ignore[union-attr]
            transport.resume_reading()  # type: ignore[union-attr]  # flow control may have paused it
        except Exception:
            if transport is not None:
                transport.close()
            self.lc.upstream_closed()
            return
        if a.slot_held and self.route.slot is not None:
            self.route.slot.drain(self.id)

    def _close_client(self, _: CloseClient) -> None:
        # close() flushes what is queued (the refusal answer).
        if self.client.transport is not None and not self.client.closed:
            self.client.transport.close()

    def _close_upstream(self, _: CloseUpstream) -> None:
        self.flush_held()  # accepted frames go out before the close, as unheld ones would have
        up = self.upstream
        if up is not None and up.transport is not None and not up.closed:
            up.transport.close()

    def _abort_upstream(self, _: AbortUpstream) -> None:
        up = self.upstream
        if up is not None and up.transport is not None and not up.closed:
            up.transport.abort()

    def _count_tls_failure(self, a: CountTlsFailure) -> None:
        self.route.traffic.tls_failure(a.reason)

    def _count_violation(self, a: CountViolation) -> None:
        self.route.violation(self.id, self.lc.identity, (a.reason, a.mode, a.violation, a.command))

    def _end(self, a: End) -> None:
        """The session is over: metrics, the session-end log line and the audit record."""
        lc = self.lc
        route = self.route
        route.session_over(self, lc)
        if route.provider is not None:
            route.provider.ended(self.id, a.record)
        result, reason, detail = lc.result, lc.reason, lc.detail
        level = _END_LEVEL.get(result, logging.WARNING)
        log.log(
            level,
            "session end id=%d role=%s listener=%s profile=%s peer=%s identity=%s result=%s reason=%s party=%s "
            "command=%s detail=%s",
            self.id, route.role, route.name, lc.profile.name, lc.peer, lc.identity or "-", result, reason or "-",
            lc.party or "-", lc.command, detail,
            extra={"audit": a.record},
        )
        if route.on_session_end is not None:
            route.on_session_end(a.record)


A = TypeVar("A")


def does(action: type[A], handler: Callable[[Link, A], None]) -> tuple[type, Callable[[Link, Any], None]]:
    """One action handler: mypy checks that ``handler`` takes ``action``'s class (linkstate.Action)."""
    return action, handler


# The relay's handler of each action class.
_APPLY: dict[type, Callable[[Link, Any], None]] = dict([
    does(WriteClient, Link._write_client),
    does(WriteUpstream, Link._write_upstream),
    does(OpenUpstream, Link._open_upstream),
    does(TakeSlot, Link._take_slot),
    does(FreeSlot, Link._free_slot),
    does(HalfCloseUpstream, Link._half_close_upstream),
    does(CloseClient, Link._close_client),
    does(CloseUpstream, Link._close_upstream),
    does(AbortUpstream, Link._abort_upstream),
    does(CountTlsFailure, Link._count_tls_failure),
    does(CountViolation, Link._count_violation),
    does(Validate, Link._validate),
    does(End, Link._end),
])
assert set(_APPLY) == set(ACTIONS), set(ACTIONS) ^ set(_APPLY)
