"""The runtime of one ``rpcguard serve`` or ``connect`` process: its parts, composed.

How this works: ``Runtime`` builds the parts, each of one job, and wires them together; it does
no job itself. ``TlsMaterial`` (proxy/material.py) holds the certificate, key and CA in use as SSL
contexts; ``Listeners`` (proxy/listeners.py) turns the config's listeners (serve) or tunnels
(connect) into routes, binds and accepts, retires and drains them; ``Reloader`` (proxy/reload.py)
holds the config in use and applies a reload (SIGHUP, or a changed file), prepared in full then
committed; ``readiness`` and ``NodeChecks`` (proxy/readiness.py) answer ``/readyz``; ``Outcomes``
and ``certificates`` (proxy/outcomes.py) put finished sessions and the certificates in use into
the metrics. ``drain()`` stops accepting, waits for running sessions up to the drain timeout,
then closes the rest. Nothing here prints or exits: the CLI does.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from rpcguard.config.model import Config
from rpcguard.observe.downgrades import report as report_downgrades
from rpcguard.observe.http import HttpServer
from rpcguard.observe.metrics import Metrics, start_http
from rpcguard.observe.sdnotify import Notifier
from rpcguard.observe.webconfig import WebGuard
from rpcguard.pki.preflight import CertWarning
from rpcguard.proxy.listeners import Listener, Listeners
from rpcguard.proxy.material import TlsMaterial
from rpcguard.proxy.outcomes import Outcomes, certificates
from rpcguard.proxy.readiness import NodeChecks, readiness
from rpcguard.proxy.reload import Reloader
from rpcguard.upstream.runtime import Upstreams

__all__ = ["TlsMaterial", "Runtime"]

log = logging.getLogger("rpcguard.server")


class Runtime:
    """Everything one ``rpcguard serve`` or ``connect`` process runs."""

    def __init__(self, cfg: Config, metrics: Metrics | None = None, config_path: str | None = None,
                 overrides: dict | None = None, notifier: Notifier | None = None) -> None:
        self.notifier = notifier or Notifier(None)  # systemd sd_notify; a no-op outside systemd
        self.metrics = metrics or Metrics()
        self.metrics.role = cfg.role
        self.tls = TlsMaterial(cfg)
        self.cert_warnings: list[CertWarning] = []  # preflight.CertWarning of the material in use
        self.nodes = NodeChecks(
            lambda: self.tls.probe_context, lambda: self.cfg.limits.connect_timeout_s + self.cfg.limits.handshake_timeout_s,
            lambda: [w.kind for w in self.cert_warnings]) if cfg.side.upstream_is_guard else None
        self.outcomes = Outcomes(self.metrics, self.nodes)
        self.upstreams = Upstreams(self.metrics)  # serve's own server processes (upstream.exec)
        self.net = Listeners(self.tls, self.metrics, self.upstreams, self.outcomes.session_ended)
        self.reloader = Reloader(cfg, WebGuard.load(cfg.metrics.web_config), self.tls, self.net,
                                 metrics=self.metrics, notifier=self.notifier, upstreams=self.upstreams,
                                 config_path=config_path, overrides=overrides or {}, reported=self._report)
        self._http: HttpServer | None = None
        self._tasks: list[asyncio.Task] = []
        self.stopping = asyncio.Event()
        self._report()
        self.net.active = [self.net.build(item) for item in cfg.items]
        for lst in self.net.active:
            self.net.register(lst)

    @property
    def cfg(self) -> Config:
        """The config in use (a reload replaces it)."""
        return self.reloader.cfg

    @property
    def web(self) -> WebGuard:
        """The metrics endpoint's TLS and authentication in use (a reload replaces it)."""
        return self.reloader.web

    @property
    def listeners(self) -> list[Listener]:
        return self.net.active

    @property
    def retired(self) -> list[Listener]:
        return self.net.retired

    def _report(self) -> list[CertWarning]:
        """Certificate gauges and warnings, and the downgrades said loudly: at start and after a reload."""
        self.cert_warnings = certificates(self.tls, self.metrics, self.cfg.role)
        report_downgrades(self.cfg, self.metrics, self.web.config)  # a WARNING each, and the gauges
        return self.cert_warnings

    async def start(self) -> None:
        """Bind every listener (and the metrics endpoint); raises OSError on a busy port."""
        try:
            await self.upstreams.start()
            for lst in self.net.active:
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
        self.reloader.watch()
        self._tasks.append(asyncio.get_running_loop().create_task(self.notifier.watchdog()))

    @property
    def metrics_port(self) -> int | None:
        return self._http.sockets[0].getsockname()[1] if self._http else None

    def install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self.reload("SIGHUP")))
        loop.add_signal_handler(signal.SIGTERM, self.stopping.set)
        loop.add_signal_handler(signal.SIGINT, self.stopping.set)

    async def reload(self, why: str) -> bool:
        """Apply the config file (and flags) again (proxy/reload.py); False when nothing changed."""
        return await self.reloader.reload(why)

    async def ready(self) -> tuple[bool, str]:
        """/readyz (proxy/readiness.py): the certificates in use valid, every upstream or node answering."""
        return await readiness(self.net.active, self.tls.loaded_expiry, self.nodes)

    async def drain(self, timeout_s: float) -> int:
        """Stop accepting, let sessions finish up to ``timeout_s``, close the rest; returns how many were cut."""
        self.notifier.stopping(f"draining sessions for up to {timeout_s:g} s")
        cut = await self.net.drain(timeout_s)
        await self.close()
        return cut

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.reloader.stop()
        self.net.close()
        if self._http is not None:
            self._http.close()
        await self.upstreams.close()
        await asyncio.sleep(0)
