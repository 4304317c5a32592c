"""The listeners of one process: routes built from config, their sockets and accept loops, drain.

How this works: ``Listeners`` turns one config item, a listener (serve) or a tunnel (connect), into
a ``Listener``: a ``route.Route`` with the settings of the item, its address, and once bound its
socket and accept loop. serve's routes to the same upstream share one ``UpstreamSlot`` and one
``UpstreamFacts``. ``register`` gives a new route its counters (kept across a reload that keeps
the name), serve's server pool (``upstream.exec``) or its background HELLO probe
(proxy/readiness.py). ``retire`` stops a listener accepting while its sessions run to their end on
its route (a reload removed or replaced it). ``drain`` stops every listener and waits for the
sessions, retired ones included, up to a deadline, then ends the rest. Each accepted connection
runs as its own ``Link`` task. What reload changes (which items to add, keep or retire) is
proxy/reload.py's; this module only does it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Callable

from rpcguard.config.model import ListenerConfig, TunnelConfig
from rpcguard.observe.downgrades import enforces
from rpcguard.observe.metrics import ListenerTraffic, Metrics
from rpcguard.protocol.state import UpstreamFacts
from rpcguard.proxy.link import Link
from rpcguard.proxy.material import TlsMaterial
from rpcguard.proxy.readiness import UpstreamProbe
from rpcguard.proxy.route import UPSTREAM_DRAIN_S, Route, UpstreamSlot
from rpcguard.upstream.runtime import Upstreams, contain, contain_all

__all__ = ["Listener", "Listeners", "apply_settings"]

log = logging.getLogger("rpcguard.server")

Item = ListenerConfig | TunnelConfig


@dataclass
class Listener:
    route: Route
    host: str
    port: int  # the configured port until bound (0 = any), then the bound one
    sock: socket.socket | None = None
    task: asyncio.Task | None = None
    item: Item | None = None  # the config it was built from
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


def apply_settings(route: Route, item: Item | None) -> None:
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


class Listeners:
    """The accepting listeners (``active``, config order) and the retired ones whose sessions still run."""

    def __init__(self, tls: TlsMaterial, metrics: Metrics, upstreams: Upstreams,
                 on_session_end: Callable[[dict], None]) -> None:
        self.tls, self.metrics, self.upstreams, self.on_session_end = tls, metrics, upstreams, on_session_end
        self.active: list[Listener] = []
        self.retired: list[Listener] = []  # removed or replaced by a reload: their sessions finish
        self._slots: dict[tuple[str, int], UpstreamSlot] = {}  # serve: one per upstream, shared by routes
        self._facts: dict[tuple[str, int], UpstreamFacts] = {}

    @property
    def every(self) -> list[Listener]:
        """Active and retired: every route that may still run sessions."""
        return self.active + self.retired

    @property
    def draining(self) -> bool:
        return any(lst.route.draining for lst in self.active)

    def build(self, item: Item) -> Listener:
        """A route (not yet accepting, not yet in the metrics) for one listener (serve) or tunnel (connect)."""
        if isinstance(item, ListenerConfig):
            key = (item.upstream.host, item.upstream.port) if item.managed is None else (f"exec:{item.name}", 0)
            where = f"{key[0]}:{key[1]}" if item.managed is None else f"exec {item.managed.exec[0]}"
            route = Route(
                role="serve", name=item.name, upstream_host=key[0], upstream_port=key[1],
                traffic=ListenerTraffic("serve", item.name, upstream=where),  # placeholder until register
                facts=self._facts.setdefault(key, UpstreamFacts(where)),
                ssl_context=lambda: self._server_context(route),
                slot=self._slots.setdefault(key, UpstreamSlot()),
            )
        else:
            where = f"{item.server.host}:{item.server.port}"
            route = Route(
                role="connect", name=item.name, upstream_host=item.server.host, upstream_port=item.server.port,
                traffic=ListenerTraffic("connect", item.name, upstream=where),
                facts=UpstreamFacts(where), ssl_context=lambda: self.tls.context, server_name=item.server_name,
            )
        route.on_session_end = self.on_session_end
        lst = Listener(route, item.listen.host, item.listen.port)
        lst.item = item
        return lst

    def _server_context(self, route: Route) -> ssl.SSLContext:
        # the listener says in ALPN whether it enforces everything (downgrades.enforces, pki/tls.py)
        return self.tls.context_for(enforces(route.default, route.profiles))

    def register(self, lst: Listener) -> None:
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
        apply_settings(route, lst.item)

    def retire(self, old: Listener) -> None:
        """Stop accepting on ``old``; its running sessions finish on its route (drain() still waits)."""
        old.close()
        if old.route.provider is not None:  # its server processes end with its last session
            self.upstreams.retire(old.route.provider)
        log.info("%s %s stopped accepting on %s:%d (%d running sessions finish as they are)",
                 old.route.role, old.route.name, old.host, old.port, len(old.route.links))
        self.retired = [lst for lst in self.retired if lst.route.links] + [old]

    async def drain(self, timeout_s: float) -> int:
        """Stop accepting, let sessions finish up to ``timeout_s``, close the rest; returns how many were cut."""
        for lst in self.active:
            lst.route.draining = True
            lst.close()
        deadline = time.monotonic() + timeout_s
        every = self.every  # routes a reload removed may still run sessions
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
        return cut

    def close(self) -> None:
        for lst in self.active:
            lst.close()


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
