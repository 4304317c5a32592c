"""The serve Runtime's side of the server processes: one pool per listener, their metrics.

How this works: ``server.Runtime`` holds one ``Upstreams``; a listener with ``upstream.exec``
asks it for its ``UpstreamPool`` (``pool``), ``start()`` probes the sandbox mechanisms once and
starts every pool (a required sandbox that cannot be had is a ``ConfigError``: serve exits 2),
``close()`` kills every process. The pools' counters are exported by one ``PoolCollector``.
serve is the child subreaper of its servers' trees (process.become_subreaper): a task reaps the
orphaned bwrap inits every ``REAP_S``, so none waits as a zombie for pid 1.
"""

from __future__ import annotations

import asyncio
import logging

from dataclasses import replace
from types import MappingProxyType
from typing import Mapping

from rpcguard.errors import ConfigError
from rpcguard.protocol.settings import Profile
from rpcguard.observe.metrics import Metrics
from rpcguard.upstream import sandbox
from rpcguard.upstream.process import become_subreaper, reap_orphans
from rpcguard.upstream.pool import PoolCollector, SandboxUnavailable, UpstreamPool, UpstreamSettings

__all__ = ["Upstreams", "contain", "contain_all"]

log = logging.getLogger("rpcguard.upstream")
_RETIRE_POLL_S = 0.5  # a replaced pool is closed once its last session is over
REAP_S = 1.0  # how often orphaned bwrap inits are reaped (a /proc read of serve's children)


def contain(profile: Profile, server_threads: int | None = None) -> Profile:
    """``profile`` for a contained listener (UpstreamPool.contained): its firewall may forward the
    content-indexed ops no shape rule bounds (oprules.needs_containment; FirewallPolicy.contained),
    and knows the thread count of the server serve runs (UpstreamSettings.server_threads)."""
    fw = replace(profile.policy.firewall, contained=True)
    if server_threads is not None:
        fw = replace(fw, server_threads=server_threads)
    return replace(profile, policy=replace(profile.policy, firewall=fw))


def contain_all(profiles: Mapping[str, Profile], server_threads: int | None = None) -> Mapping[str, Profile]:
    return MappingProxyType({name: contain(p, server_threads) for name, p in profiles.items()})


class Upstreams:
    """Every UpstreamPool of one serve process."""

    def __init__(self, metrics: Metrics) -> None:
        self.pools: dict[str, UpstreamPool] = {}
        self._mech: sandbox.Mechanisms | None = None
        self._metrics = metrics
        self._collector: PoolCollector | None = None
        self._started: set[int] = set()
        self._retiring: set[asyncio.Task] = set()
        self._retired: set[int] = set()
        self._reaper: asyncio.Task | None = None
        self._retiring_pools: set[UpstreamPool] = set()

    def pool(self, listener: str, settings: UpstreamSettings) -> UpstreamPool:
        if self._mech is None:
            become_subreaper()  # before the probe: its bwrap's init is an orphan too
            self._mech = sandbox.probe()
        if self._collector is None:
            self._collector = PoolCollector(self.pools)
            self._metrics.registry.register(self._collector)
        old = self.pools.get(listener)
        pool = self.pools[listener] = UpstreamPool(listener, settings, self._mech)
        if old is not None:  # a reload replaced the listener: its sessions finish on the old pool
            self.retire(old)
        return pool

    def retire(self, pool: UpstreamPool) -> None:
        """A reload removed or replaced the pool's listener: close it once its sessions are over."""
        if self.pools.get(pool.listener) is pool:
            del self.pools[pool.listener]
        if id(pool) in self._retired:
            return
        self._retired.add(id(pool))
        self._retiring_pools.add(pool)
        task = asyncio.get_running_loop().create_task(self._retire(pool))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, pool: UpstreamPool) -> None:
        while pool.by_link:
            await asyncio.sleep(_RETIRE_POLL_S)
        await pool.close()
        self._retiring_pools.discard(pool)

    async def start_new(self) -> None:
        """After a reload: start the pools of new listeners (a failure is logged, not raised:
        the reload is committed; the listener refuses its sessions upstream_unavailable)."""
        for name, pool in self.pools.items():
            if id(pool) not in self._started:
                try:
                    await self._start(name, pool)
                except Exception as exc:
                    log.error("upstream listener=%s: cannot start: %s", name, exc)
        self._start_reaper()

    async def start(self) -> None:
        for name, pool in self.pools.items():
            await self._start(name, pool)
        self._start_reaper()

    def _start_reaper(self) -> None:
        if self._reaper is None and self._mech is not None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    def _known(self) -> set[int]:
        pools = [*self.pools.values(), *(p for p in self._retiring_pools)]
        return {pid for pool in pools for proc in list(pool._live) for pid in (proc.pid, proc.helper_pid)}

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_S)
            reap_orphans(self._known())

    async def _start(self, name: str, pool: UpstreamPool) -> None:
        self._started.add(id(pool))
        try:
            await pool.start()
        except SandboxUnavailable as exc:
            raise ConfigError(f"listener {name}: upstream.sandbox.mode",
                              f"required, but the sandbox is not available here ({exc}); set best_effort "
                              f"to start without it (a warning and rpcguard_upstream_sandbox_missing)") from None

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._retiring):
            task.cancel()
        for pool in self.pools.values():
            await pool.close()
