"""The serve Runtime's side of the server processes: one pool per listener, their metrics.

How this works: ``server.Runtime`` holds one ``Upstreams``; a listener with ``upstream.exec``
asks it for its ``UpstreamPool`` (``pool``), ``start()`` probes the sandbox mechanisms once and
starts every pool (a required sandbox that cannot be had is a ``ConfigError``: serve exits 2),
``close()`` kills every process. The pools' counters are exported by one ``PoolCollector``.
"""

from __future__ import annotations

from rpcguard.errors import ConfigError
from rpcguard.metrics import Metrics
from rpcguard.upstream import sandbox
from rpcguard.upstream.pool import PoolCollector, SandboxUnavailable, UpstreamPool, UpstreamSettings

__all__ = ["Upstreams"]


class Upstreams:
    """Every UpstreamPool of one serve process."""

    def __init__(self, metrics: Metrics) -> None:
        self.pools: dict[str, UpstreamPool] = {}
        self._mech: sandbox.Mechanisms | None = None
        self._metrics = metrics
        self._collector: PoolCollector | None = None

    def pool(self, listener: str, settings: UpstreamSettings) -> UpstreamPool:
        if self._mech is None:
            self._mech = sandbox.probe()
        if self._collector is None:
            self._collector = PoolCollector(self.pools)
            self._metrics.registry.register(self._collector)
        pool = self.pools[listener] = UpstreamPool(listener, settings, self._mech)
        return pool

    async def start(self) -> None:
        for name, pool in self.pools.items():
            try:
                await pool.start()
            except SandboxUnavailable as exc:
                raise ConfigError(f"listener {name}: upstream.sandbox.mode",
                                  f"required, but the sandbox is not available here ({exc}); set best_effort "
                                  f"to start without it (a warning and rpcguard_upstream_sandbox_missing)") from None

    async def close(self) -> None:
        for pool in self.pools.values():
            await pool.close()
