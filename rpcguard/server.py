"""Runtime wiring: listeners, TLS material and its reload, readiness, graceful drain.

How this works: ``Runtime`` turns a ``Config`` into one ``relay.Route`` per listener (serve)
or tunnel (connect) and one asyncio server per route. TLS contexts live in ``TlsMaterial``;
routes reach them through a callable, so a reload (SIGHUP, a timer, or a changed file)
swaps the contexts and allow-lists for *new* sessions while running sessions keep theirs. A
reload that fails (bad file, key not matching) is logged and counted and the old material
stays. ``drain()`` stops accepting, waits for running sessions up to the drain timeout, then
closes the rest. Nothing here prints or exits: the CLI does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import ssl
import time
from dataclasses import dataclass

from rpcguard import policy as policy_mod
from rpcguard.certs import cert_not_after
from rpcguard.config import Config, build_config
from rpcguard.errors import RpcGuardError
from rpcguard.identity import Acl
from rpcguard.metrics import Metrics, start_http
from rpcguard.preflight import WARNING_KINDS, certificate_warnings
from rpcguard.sdnotify import Notifier
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.relay import Link
from rpcguard.route import UPSTREAM_DRAIN_S, Route, UpstreamSlot
from rpcguard.tls import client_context, server_context

__all__ = ["TlsMaterial", "Runtime", "NODE_CHECK_INTERVAL_S"]

log = logging.getLogger("rpcguard.server")

# connect's /readyz: how long what is known about a node (a probe's or a session's outcome) is
# trusted before the next /readyz probes it again (TLS handshake only, see probe.tls_probe).
NODE_CHECK_INTERVAL_S = 15.0
# ...and how long that probe may take: /readyz answers within metrics.READ_TIMEOUT_S (5 s), and a
# node that drops packets must read as "node_unreachable", not as a timed-out readiness check.
NODE_PROBE_TIMEOUT_S = 3.0
# Session outcomes that say the tunnel cannot work now (the node's rpcguard or server is at fault).
_NODE_DOWN_REASONS = frozenset({"node_unreachable", "tls_failed", "node_name_mismatch", "identity_not_allowed",
                                "version_not_accepted", "upstream_unavailable"})


class TlsMaterial:
    """The current certificate, key and CA as SSL contexts; replaced whole on reload."""

    def __init__(self, cfg: Config) -> None:
        self.role = cfg.role
        self.tls = cfg.tls
        self.context: ssl.SSLContext = self._build()
        self.loaded_expiry = self._read_expiry()  # of the material in use, not of the files now on disk
        self.stamp = self._stamp()

    def _build(self) -> ssl.SSLContext:
        t = self.tls
        if self.role == "serve":
            return server_context(t.cert, t.key, t.ca, min_version=t.min_version)
        # One client context serves every tunnel: the expected node name is given per connection.
        return client_context(t.cert, t.key, t.ca, server_name="rpcguard-node", min_version=t.min_version)

    def _read_expiry(self) -> dict[str, float]:
        """notAfter of the certificate and of the CA bundle (its first CA to expire)."""
        from cryptography import x509

        with open(self.tls.ca, "rb") as f:
            cas = x509.load_pem_x509_certificates(f.read())
        return {"cert": cert_not_after(self.tls.cert), "ca": min(c.not_valid_after_utc.timestamp() for c in cas)}

    def _stamp(self) -> tuple:
        out = []
        for path in (self.tls.cert, self.tls.key, self.tls.ca):
            try:
                st = os.stat(path)
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)

    def changed(self) -> bool:
        return self._stamp() != self.stamp

    def reload(self, tls_cfg=None) -> None:
        """Build new contexts; on any error the old ones stay and the error propagates."""
        old = self.tls
        if tls_cfg is not None:
            self.tls = tls_cfg
        try:
            context = self._build()
            expiry = self._read_expiry()
        except Exception:
            self.tls = old
            raise
        self.context = context
        self.loaded_expiry = expiry
        self.stamp = self._stamp()

    def expiry(self) -> dict[str, float]:
        """notAfter of the files on disk now (raises if one became unreadable)."""
        return {"cert": cert_not_after(self.tls.cert), "ca": cert_not_after(self.tls.ca)}


@dataclass
class _Listener:
    route: Route
    host: str
    port: int
    sock: socket.socket | None = None
    task: asyncio.Task | None = None

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.sock is not None:
            self.sock.close()


class Runtime:
    """Everything one ``rpcguard serve`` or ``connect`` process runs."""

    def __init__(self, cfg: Config, metrics: Metrics | None = None, config_path: str | None = None,
                 overrides: dict | None = None, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.notifier = notifier or Notifier(None)  # systemd sd_notify; a no-op outside systemd
        self.cert_warnings: list = []  # preflight.CertWarning of the material in use
        self._node_seen: dict[str, tuple[float, bool, str]] = {}  # connect: tunnel -> (when, ok, why)
        self._node_lock: dict[str, asyncio.Lock] = {}
        self.config_path = config_path
        self.overrides = dict(overrides or {})  # CLI flags: a reload lays them over the file again
        self.metrics = metrics or Metrics()
        self.tls = TlsMaterial(cfg)
        self.listeners: list[_Listener] = []
        self._acls: dict[str, Acl] = {}
        self._http: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task] = []
        self.stopping = asyncio.Event()
        self._record_expiry()
        limits = policy_mod.limits(cfg.limits)
        if cfg.role == "serve":
            slots: dict[tuple[str, int], UpstreamSlot] = {}
            facts: dict[tuple[str, int], UpstreamFacts] = {}
            for lc in cfg.listeners:
                key = (lc.upstream.host, lc.upstream.port)
                self._acls[lc.name] = policy_mod.acl(lc.allow)
                route = Route(
                    role="serve", name=lc.name, upstream_host=lc.upstream.host, upstream_port=lc.upstream.port,
                    policy=policy_mod.session_policy(lc.policy), limits=limits,
                    traffic=self.metrics.listener("serve", lc.name, upstream=f"{key[0]}:{key[1]}"),
                    facts=facts.setdefault(key, UpstreamFacts(f"{key[0]}:{key[1]}")),
                    ssl_context=lambda: self.tls.context, acl=self._acl_getter(lc.name),
                    slot=slots.setdefault(key, UpstreamSlot()),
                )
                route.on_session_end = self._session_ended
                self.listeners.append(_Listener(route, lc.listen.host, lc.listen.port))
        else:
            for tc in cfg.tunnels:
                route = Route(
                    role="connect", name=tc.name, upstream_host=tc.server.host, upstream_port=tc.server.port,
                    policy=policy_mod.session_policy(tc.policy), limits=limits,
                    traffic=self.metrics.listener("connect", tc.name, upstream=f"{tc.server.host}:{tc.server.port}"),
                    facts=UpstreamFacts(f"{tc.server.host}:{tc.server.port}"),
                    ssl_context=lambda: self.tls.context, server_name=tc.server_name,
                )
                route.on_session_end = self._session_ended
                self.listeners.append(_Listener(route, tc.listen.host, tc.listen.port))

    def _session_ended(self, record: dict) -> None:
        if self.cfg.role == "connect" and record.get("listener"):
            # A session's outcome is the freshest news about its node (connect's /readyz).
            down = record.get("result") == "refused" and record.get("reason") in _NODE_DOWN_REASONS
            if down or record.get("version"):
                why = f"{record.get('reason')}: {record.get('detail')}" if down else "a session got through"
                self._node_seen[record["listener"]] = (time.monotonic(), not down, why)
        if record.get("result") == "refused":
            self.metrics.note_refusal(**{k: record.get(k) for k in (
                "role", "listener", "peer", "identity", "reason", "command", "detail")})

    def _acl_getter(self, name: str):
        return lambda: self._acls[name]

    def _record_expiry(self) -> None:
        for certificate, when in self.tls.loaded_expiry.items():
            self.metrics.set_certificate_expiry(self.cfg.role, certificate, when)
        # Warnings about the material just loaded (the same checks as `rpcguard check-config`).
        self.cert_warnings = certificate_warnings(self.tls.tls.cert, self.tls.tls.ca)
        kinds = {w.kind for w in self.cert_warnings}
        for kind in WARNING_KINDS:
            self.metrics.cert_warnings[(self.cfg.role, kind)] = float(kind in kinds)
        for w in self.cert_warnings:
            log.warning("certificate %s: %s", w.kind, w.message)

    # ----------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Bind every listener (and the metrics endpoint); raises OSError on a busy port."""
        loop = asyncio.get_running_loop()
        try:
            for lst in self.listeners:
                route = lst.route
                family = socket.AF_INET6 if ":" in lst.host else socket.AF_INET
                lst.sock = socket.create_server((lst.host, lst.port), family=family, backlog=128, reuse_port=False)
                lst.sock.setblocking(False)
                lst.port = lst.sock.getsockname()[1]
                lst.task = loop.create_task(_accept_loop(route, lst.sock))
                log.info("%s %s listening on %s:%d -> %s:%d", route.role, route.name, lst.host, lst.port,
                         route.upstream_host, route.upstream_port)
            if self.cfg.metrics.listen is not None:
                m = self.cfg.metrics.listen
                self._http = await start_http(self.metrics, m.host, m.port, ready=self.ready)
                log.info("metrics on http://%s:%d/metrics", m.host, self._http.sockets[0].getsockname()[1])
        except BaseException:
            await self.close()
            raise
        if self.cfg.tls.reload_interval_s:
            self._tasks.append(loop.create_task(self._watch_files(self.cfg.tls.reload_interval_s)))
        self._tasks.append(loop.create_task(self.notifier.watchdog()))

    @property
    def metrics_port(self) -> int | None:
        return self._http.sockets[0].getsockname()[1] if self._http else None

    def install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload("SIGHUP")))
        loop.add_signal_handler(signal.SIGTERM, self.stopping.set)
        loop.add_signal_handler(signal.SIGINT, self.stopping.set)

    async def reload(self, why: str) -> bool:
        """Reload TLS material and allow-lists; keep the old ones if anything is wrong.

        systemd hears RELOADING=1 first and READY=1 with the outcome in STATUS= after
        (``Type=notify-reload`` makes ``systemctl reload`` wait for it).
        """
        self.notifier.reloading()
        try:
            new_cfg = (build_config(self.cfg.role, file=self.config_path, overrides=self.overrides)
                       if self.config_path or self.overrides else None)
            self.tls.reload(new_cfg.tls if new_cfg else None)
            if new_cfg is not None and self.cfg.role == "serve":
                for lc in new_cfg.listeners:
                    if lc.name in self._acls:
                        self._acls[lc.name] = policy_mod.acl(lc.allow)
            self._record_expiry()
        except (RpcGuardError, OSError, ValueError, ssl.SSLError) as exc:
            self.metrics.reload("error")
            log.error("reload (%s) failed, keeping the previous certificates: %s", why, exc)
            self.notifier.ready(f"reload ({why}) failed, previous certificates kept: {exc}")
            return False
        self.metrics.reload("ok")
        log.info("reloaded certificates and allow-lists (%s)", why)
        self.notifier.ready(f"reloaded ({why})" + "".join(f"; warning: {w.kind}" for w in self.cert_warnings))
        return True

    def _files_stamp(self) -> tuple:
        """TLS files and the config file (allow-lists): what a file-change reload watches."""
        try:
            st = os.stat(self.config_path) if self.config_path else None
            conf = (st.st_mtime_ns, st.st_size, st.st_ino) if st else None
        except OSError:
            conf = None
        return self.tls._stamp(), conf

    async def _watch_files(self, interval: float) -> None:
        # Reload when the files differ from the last ones seen, whether that reload worked or
        # not: a broken file is reported once (not at every poll) and retried when it changes.
        seen = self._files_stamp()
        while True:
            await asyncio.sleep(interval)
            now = self._files_stamp()
            if now != seen:
                seen = now
                await self.reload("file change")

    async def ready(self) -> tuple[bool, str]:
        """/readyz: the certificates IN USE valid, and every upstream (serve) or node (connect) answering.

        A broken file on disk does not matter here: the loaded material keeps working and a
        failed reload is reported by ``rpcguard_reload_total{result="error"}``.
        """
        if any(lst.route.draining for lst in self.listeners):
            return False, "draining: not accepting new sessions"  # take this node out of rotation
        now = time.time()
        for name, when in self.tls.loaded_expiry.items():
            if when <= now:
                return False, f"{name} certificate in use expired"
        lines = []
        tunnels = [lst.route for lst in self.listeners if lst.route.role != "serve"]
        for route, (ok, why) in zip(tunnels, await asyncio.gather(*(self._node_ready(r) for r in tunnels))):
            if not ok:
                return False, f"{route.name}: node {route.upstream_host}:{route.upstream_port}: {why}"
            lines.append(f"{route.name}: node answers ({why})")
        for lst in self.listeners:
            route = lst.route
            if route.role != "serve":
                continue
            if route.slot is not None and route.slot.busy:
                lines.append(f"{route.name}: upstream in use by a session")
                continue
            ok = await _probe_tcp(route.upstream_host, route.upstream_port, route.slot)
            if not ok:
                return False, f"{route.name}: upstream {route.upstream_host}:{route.upstream_port} unreachable"
            lines.append(f"{route.name}: upstream reachable")
        return True, "; ".join(lines)

    async def _node_ready(self, route: Route) -> tuple[bool, str]:
        """connect: does the node answer? The last known outcome if fresh, else a TLS-only probe.

        The probe stops after the TLS handshake (and the node's verdict on our certificate), so
        it never sends HELLO and never takes the node's single upstream slot (serve takes it at
        HELLO). It runs at most once per NODE_CHECK_INTERVAL_S per tunnel, and only when asked.
        """
        from rpcguard.probe import tls_probe

        lock = self._node_lock.setdefault(route.name, asyncio.Lock())
        async with lock:
            seen = self._node_seen.get(route.name)
            if seen is None or time.monotonic() - seen[0] > NODE_CHECK_INTERVAL_S:
                result = await tls_probe(route.name, route.upstream_host, route.upstream_port, self.tls.context,
                                         route.server_name or route.upstream_host,
                                         timeout=min(NODE_PROBE_TIMEOUT_S, self.cfg.limits.connect_timeout_s
                                                     + self.cfg.limits.handshake_timeout_s),
                                         own_warnings=[w.kind for w in self.cert_warnings])
                why = "TLS accepted" if result.ok else f"{result.reason}: {result.detail}"
                seen = self._node_seen[route.name] = (time.monotonic(), result.ok, why)
            return seen[1], seen[2]

    async def drain(self, timeout_s: float) -> int:
        """Stop accepting, let sessions finish up to ``timeout_s``, close the rest; returns how many were cut."""
        self.notifier.stopping(f"draining sessions for up to {timeout_s:g} s")
        for lst in self.listeners:
            lst.route.draining = True
            lst.close()
        deadline = time.monotonic() + timeout_s
        while any(lst.route.links for lst in self.listeners) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cut = 0
        for lst in self.listeners:
            for link in list(lst.route.links):
                link.close_for_shutdown()
                cut += 1
        # An ended session keeps its upstream slot until the server has hung up (relay's
        # _drain_upstream: ggml-rpc-server dies of SIGPIPE on a connection closed under it).
        deadline = time.monotonic() + UPSTREAM_DRAIN_S
        while any(lst.route.slot is not None and lst.route.slot.busy for lst in self.listeners) and (
            time.monotonic() < deadline
        ):
            await asyncio.sleep(0.02)
        await self.close()
        return cut

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for lst in self.listeners:
            lst.close()
        if self._http is not None:
            self._http.close()
        await asyncio.sleep(0)


async def _accept_loop(route: Route, sock: socket.socket) -> None:
    """Accept connections for one route; each runs as its own link task."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn, _ = await loop.sock_accept(sock)
        except asyncio.CancelledError:
            raise
        except OSError as exc:  # EMFILE and friends: back off instead of spinning
            log.error("%s %s: accept failed: %s", route.role, route.name, exc)
            await asyncio.sleep(0.1)
            continue
        conn.setblocking(False)
        link = Link(route)
        task = loop.create_task(link.run(conn))
        _LINK_TASKS.add(task)
        task.add_done_callback(_LINK_TASKS.discard)


_LINK_TASKS: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones


async def _probe_tcp(host: str, port: int, slot: UpstreamSlot | None) -> bool:
    """Connect and hang up, only while no session holds the upstream.

    The probe never takes the slot itself: with ``upstream_busy: refuse`` a session arriving
    during a probe would be refused as busy (a scraper polling /readyz refused real llama.cpp
    sessions). A session that races the probe is harmless: the single-client server handles
    the two connections one after the other, and the probe's carries no bytes.
    """
    if slot is not None and slot.busy:
        return True
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
        writer.close()
        return True
    except (OSError, asyncio.TimeoutError):
        return False
