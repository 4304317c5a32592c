"""Runtime wiring: listeners, TLS material and its reload, readiness, graceful drain.

Over 400 lines until the runtime is split by job (issue 30.3): listeners, reload and file watch,
readiness (now proxy/readiness.py) and drain.

How this works: ``Runtime`` turns a ``Config`` into one ``route.Route`` per listener (serve)
or tunnel (connect) and one accept loop per route. TLS contexts live in ``TlsMaterial``;
routes reach them through a callable. A route holds its settings as immutable objects (the
``default`` Profile, the named ``profiles``, the ``allow`` list) and a link takes the Profile it
needs when it starts, so a reload (SIGHUP, or a changed file with ``tls.reload_interval_s``)
applies to *new* sessions only by swapping those objects. A reload is prepared in full first
(config parsed, TLS contexts and web config loaded, new listener sockets bound) and only then
committed, so one that fails (bad file, key not matching, busy port) changes nothing. It
applies TLS, allow-lists, policy, limits, profiles and listeners: a new listener starts, a
removed one stops accepting and lets its sessions finish, one whose address or upstream changed
is replaced (remove + add). ``diff.RESTART_KEYS`` cannot change live: logged, old value
kept, counted in ``rpcguard_reload_kept_keys``. One log line names what changed. ``drain()``
stops accepting, waits for running sessions up to the drain timeout, then closes the rest.
Nothing here prints or exits: the CLI does.
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

from rpcguard.config.model import Config, ListenerConfig, TunnelConfig
from rpcguard.config.flags import build_config, log_warnings
from rpcguard.config.diff import RESTART_KEYS, diff_configs, keep_restart_keys
from rpcguard.observe.downgrades import enforces, report as report_downgrades
from rpcguard.errors import RpcGuardError
from rpcguard.observe.metrics import ListenerTraffic, Metrics, start_http
from rpcguard.observe.http import HttpServer
from rpcguard.pki.preflight import WARNING_KINDS, certificate_warnings
from rpcguard.observe.sdnotify import Notifier
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.proxy.link import Link
from rpcguard.proxy.route import UPSTREAM_DRAIN_S, Route, UpstreamSlot
from rpcguard.proxy.material import TlsMaterial
from rpcguard.proxy.readiness import UpstreamProbe
from rpcguard.upstream.runtime import Upstreams, contain, contain_all
from rpcguard.observe.webconfig import WebGuard

__all__ = ["TlsMaterial", "Runtime", "NODE_CHECK_INTERVAL_S"]

log = logging.getLogger("rpcguard.server")

# connect's /readyz: how long what is known about a node (a probe's or a session's outcome) is
# trusted before the next /readyz probes it again (TLS handshake only, see check.tls_probe).
NODE_CHECK_INTERVAL_S = 15.0
# ...and how long that probe may take: /readyz answers within metrics.READ_TIMEOUT_S (5 s), and a
# node that drops packets must read as "node_unreachable", not as a timed-out readiness check.
NODE_PROBE_TIMEOUT_S = 3.0
# Session outcomes that say the tunnel cannot work now (the node's rpcguard or server is at fault).
_NODE_DOWN_REASONS = frozenset({"node_unreachable", "tls_failed", "node_name_mismatch", "identity_not_allowed",
                                "version_not_accepted", "upstream_unavailable"})


@dataclass
class _Listener:
    route: Route
    host: str
    port: int  # the configured port until bound (0 = any), then the bound one
    sock: socket.socket | None = None
    task: asyncio.Task | None = None
    item: ListenerConfig | TunnelConfig | None = None  # the config it was built from
    probe: UpstreamProbe | None = None  # serve with --upstream: the HELLO verdict /readyz reads

    def __post_init__(self) -> None:
        self.config_port = self.port  # as configured: a reload compares this, not the bound port

    def bind(self) -> None:
        """Bind the listening socket (raises OSError on a busy port)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self.sock = socket.create_server((self.host, self.port), family=family, backlog=128, reuse_port=False)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def accept(self) -> None:
        """Start accepting connections on the bound socket."""
        assert self.sock is not None
        route = self.route
        self.task = asyncio.get_running_loop().create_task(_accept_loop(route, self.sock))
        if self.probe is not None:
            self.probe.start()
        log.info("%s %s listening on %s:%d -> %s", route.role, route.name, self.host, self.port,
                 route.traffic.upstream or f"{route.upstream_host}:{route.upstream_port}")

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.sock is not None:
            self.sock.close()
        if self.probe is not None:
            self.probe.stop()


def _apply_settings(route: Route, item: ListenerConfig | TunnelConfig | None) -> None:
    """Give ``route`` the settings of ``item``: new links take them, running links keep theirs."""
    assert item is not None
    route.default = item.default
    if isinstance(item, ListenerConfig):
        route.profiles = item.profiles
        route.allow = item.allow
        if route.provider is not None and route.provider.contained:  # content-indexed ops may reach it
            threads = route.provider.settings.server_threads
            route.default, route.profiles = contain(route.default, threads), contain_all(route.profiles, threads)
        for name in (route.default.name, *item.profiles):  # every profile's series exists from the start
            route.traffic.profile_sessions.setdefault(name, 0)


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
        self.metrics.role = cfg.role
        self.tls = TlsMaterial(cfg)
        self.web = WebGuard.load(cfg.metrics.web_config)  # metrics endpoint TLS/auth; swapped on reload
        self.listeners: list[_Listener] = []
        self.retired: list[_Listener] = []  # removed or replaced by a reload: their sessions finish
        self._slots: dict[tuple[str, int], UpstreamSlot] = {}  # serve: one per upstream, shared by routes
        self._facts: dict[tuple[str, int], UpstreamFacts] = {}
        self._http: HttpServer | None = None
        self._tasks: list[asyncio.Task] = []
        self.upstreams = Upstreams(self.metrics)  # serve's own server processes (upstream.exec)
        self._watcher: asyncio.Task | None = None
        self.stopping = asyncio.Event()
        self._record_expiry()
        report_downgrades(cfg, self.metrics, self.web.config)  # a WARNING each, and the gauges
        self._reloading = asyncio.Lock()  # one reload at a time (SIGHUP and the file poll may race)
        self.listeners = [self._listener(item) for item in cfg.items]
        for lst in self.listeners:
            self._register(lst)

    def _listener(self, item: ListenerConfig | TunnelConfig) -> _Listener:
        """A route (not yet accepting, not yet in the metrics) for one listener (serve) or tunnel (connect)."""
        if isinstance(item, ListenerConfig):
            key = (item.upstream.host, item.upstream.port) if item.managed is None else (f"exec:{item.name}", 0)
            where = f"{key[0]}:{key[1]}" if item.managed is None else f"exec {item.managed.exec[0]}"
            route = Route(
                role="serve", name=item.name, upstream_host=key[0], upstream_port=key[1],
                traffic=ListenerTraffic("serve", item.name, upstream=where),  # placeholder until _register
                facts=self._facts.setdefault(key, UpstreamFacts(where)),
                # the listener says in ALPN whether it enforces everything (downgrades.enforces, pki/tls.py)
                ssl_context=lambda: self.tls.context_for(enforces(route.default, route.profiles)),
                slot=self._slots.setdefault(key, UpstreamSlot()),
            )
        else:
            where = f"{item.server.host}:{item.server.port}"
            route = Route(
                role="connect", name=item.name, upstream_host=item.server.host, upstream_port=item.server.port,
                traffic=ListenerTraffic("connect", item.name, upstream=where),
                facts=UpstreamFacts(where), ssl_context=lambda: self.tls.context, server_name=item.server_name,
            )
        route.on_session_end = self._session_ended
        lst = _Listener(route, item.listen.host, item.listen.port)
        lst.item = item
        return lst

    def _register(self, lst: _Listener) -> None:
        """Give a new route its counters (kept across a reload that keeps the name) and settings."""
        route = lst.route
        route.traffic = self.metrics.listener(route.role, route.name, upstream=route.traffic.upstream)
        if isinstance(lst.item, ListenerConfig) and lst.item.managed is not None:  # serve runs the server
            route.provider = self.upstreams.pool(route.name, lst.item.managed)
        elif isinstance(lst.item, ListenerConfig):  # a server it only reaches: /readyz asks it HELLO
            lst.probe = UpstreamProbe(
                route.upstream_host, route.upstream_port, lambda: route.default.policy.accepted_versions,
                lambda: route.slot is not None and route.slot.busy,
                lambda ok: setattr(route.traffic, "upstream_up", ok))
        _apply_settings(route, lst.item)

    def _session_ended(self, record: dict) -> None:
        if self.cfg.side.upstream_is_guard and record.get("listener"):
            # A session's outcome is the freshest news about its node (connect's /readyz).
            down = record.get("result") == "refused" and record.get("reason") in _NODE_DOWN_REASONS
            if down or record.get("version"):
                why = f"{record.get('reason')}: {record.get('detail')}" if down else "a session got through"
                self._node_seen[record["listener"]] = (time.monotonic(), not down, why)
        up = _upstream_outcome(record)
        if up is not None:
            self.metrics.listener(record["role"], record["listener"]).upstream_up = up
        if record.get("result") == "refused":
            self.metrics.note_refusal(**{k: record.get(k) for k in (
                "role", "listener", "peer", "identity", "reason", "command", "detail")})

    def _record_expiry(self) -> None:
        for certificate, when in self.tls.loaded_expiry.items():
            self.metrics.set_certificate_expiry(self.cfg.role, certificate, when, getattr(self.tls.tls, certificate))
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
        try:
            await self.upstreams.start()
            for lst in self.listeners:
                lst.bind()
                lst.accept()
            if self.cfg.metrics.listen is not None:
                m = self.cfg.metrics.listen
                self._http = await start_http(self.metrics, m.host, m.port, ready=self.ready, web=lambda: self.web)
                log.info("metrics on %s://%s:%d/metrics", "https" if self.web.context else "http", m.host,
                         self.metrics_port)
        except BaseException:
            await self.close()
            raise
        self._watch()
        self._tasks.append(asyncio.get_running_loop().create_task(self.notifier.watchdog()))

    def _watch(self) -> None:
        """Run the file watcher while ``tls.reload_interval_s`` > 0 (a reload may turn it on or off)."""
        if self.cfg.tls.reload_interval_s and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch_files(self._files_stamp()))
            self._tasks.append(self._watcher)

    @property
    def metrics_port(self) -> int | None:
        return self._http.sockets[0].getsockname()[1] if self._http else None

    def install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload("SIGHUP")))
        loop.add_signal_handler(signal.SIGTERM, self.stopping.set)
        loop.add_signal_handler(signal.SIGINT, self.stopping.set)

    async def reload(self, why: str) -> bool:
        """Apply the config file (and flags) again: TLS, allow-lists, policy, limits, profiles, listeners.

        Everything is prepared before anything changes: a bad file, bad TLS material or a port
        that cannot be bound changes nothing. New sessions get the new settings; running ones
        keep theirs. systemd hears RELOADING=1 first and READY=1 with the outcome in STATUS=
        after (``Type=notify-reload`` makes ``systemctl reload`` wait for it).
        """
        async with self._reloading:
            return await self._reload(why)

    async def _reload(self, why: str) -> bool:
        self.notifier.reloading()
        fresh: list[_Listener] = []
        try:
            if any(lst.route.draining for lst in self.listeners):
                raise RpcGuardError("shutting down")
            new_cfg = (build_config(self.cfg.role, file=self.config_path, overrides=self.overrides)
                       if self.config_path or self.overrides else self.cfg)
            if new_cfg is not self.cfg:
                log_warnings(new_cfg)
            web = WebGuard.load(new_cfg.metrics.web_config)
            tls = self.tls.prepare(new_cfg.tls)
            diff = diff_configs(self.cfg, new_cfg)
            items = {x.name: x for x in new_cfg.items}
            gone = set(diff.removed) | set(diff.replaced)
            # a new route on the address of one going away (new upstream, or renamed) takes its socket over
            sockets = {(lst.host, lst.config_port): lst for lst in self.listeners
                       if lst.route.name in gone and lst.config_port}
            donors: dict[str, _Listener] = {}
            for name in (*diff.added, *diff.replaced):
                lst = self._listener(items[name])
                fresh.append(lst)
                donor = sockets.pop((lst.host, lst.port), None) if lst.port else None
                if donor is not None:
                    donors[name] = donor
                else:
                    lst.bind()
        except (RpcGuardError, OSError, ValueError, ssl.SSLError) as exc:
            for lst in fresh:
                lst.close()
            self.metrics.reload("error")
            log.error("reload (%s) failed, nothing changed, keeping the previous certificates and configuration: %s",
                      why, exc)
            self.notifier.ready(f"reload ({why}) failed, nothing changed (previous certificates kept): {exc}")
            return False
        # ---- commit: nothing below can fail on bad input
        for key in diff.kept:
            section, name = key.split(".")
            log.warning("reload (%s): %s cannot change while running (%s); keeping %s until a restart (file: %s)",
                        why, key, RESTART_KEYS[key], getattr(getattr(self.cfg, section), name),
                        getattr(getattr(new_cfg, section), name))
        files = [n for n in ("cert", "key", "ca", "crl") if tls.digest.get(n) != self.tls.digest.get(n)]
        web_changed = web.config != self.web.config and "metrics.web_config" not in diff.changed
        self.tls.use(tls)
        self.web = web
        self.cfg = keep_restart_keys(self.cfg, new_cfg)
        if self.cfg.log.level != logging.getLevelName(logging.getLogger().level).lower():
            logging.getLogger().setLevel(self.cfg.log.level.upper())
        for lst in fresh:
            self._register(lst)
            donor = donors.get(lst.route.name)
            if donor is not None:
                lst.sock, lst.port, donor.sock = donor.sock, donor.port, None
        kept: list[_Listener] = []
        for lst in self.listeners:
            name = lst.route.name
            if name in gone:
                self._retire(lst)
            else:
                lst.item = items[name]
                _apply_settings(lst.route, lst.item)
                kept.append(lst)
        order = list(items)  # config order
        self.listeners = sorted(kept + fresh, key=lambda lst: order.index(lst.route.name))
        await asyncio.sleep(0)  # the retired accept loops let go of their sockets (one handed over) first
        for lst in fresh:
            lst.accept()
        await self.upstreams.start_new()  # a pool that cannot start logs why; its sessions are refused
        ended = sum(lst.route.revoke(self.tls.revoked) for lst in (*self.listeners, *self.retired)
                    if lst.route.side.client_tls)
        if ended:
            log.warning("reload (%s): ended %d live session(s) whose certificate is revoked or identity no longer "
                        "allowed", why, ended)
        self._record_expiry()
        report_downgrades(self.cfg, self.metrics, self.web.config)  # again: a reload that keeps them says so
        self._watch()
        self.metrics.reload("ok")
        self.metrics.reload_kept_keys = len(diff.kept)
        summary = diff.summary(self.cfg.side.item)
        news = ([f"new tls files ({', '.join(files)})"] if files else []) + (["new metrics web config"] if web_changed else [])
        if news:
            summary = "; ".join(news) + ("" if diff.empty else f"; {summary}")
        log.info("config reloaded (%s): %s", why, summary)
        self.notifier.ready(f"reloaded ({why}): {summary}" + "".join(f"; warning: {w.kind}" for w in self.cert_warnings))
        return True

    def _retire(self, old: _Listener) -> None:
        """Stop accepting on ``old``; its running sessions finish on its route (drain() still waits)."""
        old.close()
        if old.route.provider is not None:  # its server processes end with its last session
            self.upstreams.retire(old.route.provider)
        log.info("%s %s stopped accepting on %s:%d (%d running sessions finish as they are)",
                 old.route.role, old.route.name, old.host, old.port, len(old.route.links))
        self.retired = [lst for lst in self.retired if lst.route.links] + [old]

    def _files_stamp(self) -> tuple:
        """TLS files and the config file (allow-lists): what a file-change reload watches."""
        try:
            st = os.stat(self.config_path) if self.config_path else None
            conf = (st.st_mtime_ns, st.st_size, st.st_ino) if st else None
        except OSError:
            conf = None
        web: list[tuple[int, int, int] | None] = []
        for path in self.web.config.files() if self.web.config else ():
            try:
                st = os.stat(path)
                web.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                web.append(None)
        return self.tls._stamp(), conf, tuple(web)

    async def _watch_files(self, seen: tuple) -> None:
        # Reload when the files differ from the last ones seen, whether that reload worked or
        # not: a broken file is reported once (not at every poll) and retried when it changes.
        # The interval is read each round: a reload may change it (0 ends the watcher). ``seen``
        # is taken when the watcher is started, so a change right after that is not missed.
        while self.cfg.tls.reload_interval_s:
            await asyncio.sleep(self.cfg.tls.reload_interval_s)
            now = self._files_stamp()
            if now != seen:
                seen = now
                await self.reload("file change")

    async def ready(self) -> tuple[bool, str]:
        """/readyz: the certificates IN USE valid, and every upstream (serve) or node (connect) answering:
        serve's upstreams a real HELLO with an accepted version (proxy/readiness.py, in the background).

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
        tunnels = [lst.route for lst in self.listeners if lst.route.side.upstream_is_guard]
        for route, (ok, why) in zip(tunnels, await asyncio.gather(*(self._node_ready(r) for r in tunnels))):
            if not ok:
                return False, f"{route.name}: node {route.upstream_host}:{route.upstream_port}: {why}"
            lines.append(f"{route.name}: node answers ({why})")
        for lst in self.listeners:
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
            assert lst.probe is not None
            if lst.probe.verdict is None:  # only right after start: the first probe, once
                await lst.probe.probe_now()
            ok, why = lst.probe.read()  # the background HELLO's verdict: never waits, never takes the slot
            if not ok:
                return False, f"{route.name}: {why}"
            lines.append(f"{route.name}: {why}")
        return True, "; ".join(lines)

    async def _node_ready(self, route: Route) -> tuple[bool, str]:
        """connect: does the node answer? The last known outcome if fresh, else a TLS-only probe.

        The probe stops after the TLS handshake (and the node's verdict on our certificate), so
        it never sends HELLO and never takes the node's single upstream slot (serve takes it at
        HELLO). It runs at most once per NODE_CHECK_INTERVAL_S per tunnel, and only when asked.
        """
        from rpcguard.admin.check import tls_probe

        lock = self._node_lock.setdefault(route.name, asyncio.Lock())
        async with lock:
            seen = self._node_seen.get(route.name)
            if seen is None or time.monotonic() - seen[0] > NODE_CHECK_INTERVAL_S:
                result = await tls_probe(route.name, route.upstream_host, route.upstream_port, self.tls.probe_context,
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
        every = self.listeners + self.retired  # routes a reload removed may still run sessions
        while any(lst.route.links for lst in every) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cut = 0
        for lst in every:
            for link in list(lst.route.links):
                link.close_for_shutdown()
                cut += 1
        # An ended session keeps its upstream slot until the server has hung up (the lifecycle's
        # DRAINING state: ggml-rpc-server dies of SIGPIPE on a connection closed under it).
        deadline = time.monotonic() + UPSTREAM_DRAIN_S
        while any(lst.route.slot is not None and lst.route.slot.busy for lst in every) and (
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
        await self.upstreams.close()
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

# Session-end reasons that say the upstream (serve: ggml-rpc-server; connect: the node) is down.
_UPSTREAM_DOWN = frozenset({"upstream_unavailable", "node_unreachable", "tls_failed", "node_name_mismatch"})


def _upstream_outcome(record: dict) -> bool | None:
    """What a finished session tells about its upstream: True up, False down, None nothing."""
    if record.get("reason") in _UPSTREAM_DOWN:
        return False
    if record.get("reason") == "node_refused":  # the node's rpcguard answered
        return True
    if record.get("version"):  # the upstream answered HELLO
        return True
    return None
