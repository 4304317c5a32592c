"""Reload: the config file (and flags) again, prepared in full, then committed; and the file watch.

How this works: ``Reloader`` holds the settings in use (``cfg``, the metrics endpoint's ``web``
guard) and applies a reload (SIGHUP, or a changed file while ``tls.reload_interval_s`` > 0) to
*new* sessions only: a route's settings are immutable objects that a link takes when it starts,
so a reload swaps them (listeners.apply_settings). A reload is prepared in full first (config
parsed, TLS contexts and web config loaded, new listener sockets bound) and only then committed,
so one that fails (bad file, key not matching, busy port) changes nothing. It applies TLS,
allow-lists, policy, limits, profiles and listeners: a new listener starts, a removed one stops
accepting and lets its sessions finish, one whose address or upstream changed is replaced
(remove + add; a new route on the address of one going away takes its socket over).
``diff.RESTART_KEYS`` cannot change live: logged, old value kept, counted in
``rpcguard_reload_kept_keys``. One log line names what changed; systemd hears RELOADING=1 first
and READY=1 with the outcome in STATUS= after. The watcher polls the TLS files, the config file
and the web config's files, and reloads when they differ from the last ones seen.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from typing import Any, Callable, Mapping

from rpcguard.config.diff import RESTART_KEYS, diff_configs, keep_restart_keys
from rpcguard.config.flags import build_config, log_warnings
from rpcguard.config.model import Config
from rpcguard.errors import RpcGuardError
from rpcguard.observe.metrics import Metrics
from rpcguard.observe.sdnotify import Notifier
from rpcguard.observe.webconfig import WebGuard
from rpcguard.proxy.listeners import Listener, Listeners, apply_settings
from rpcguard.proxy.material import TlsMaterial
from rpcguard.upstream.runtime import Upstreams

__all__ = ["Reloader"]

log = logging.getLogger("rpcguard.server")


class Reloader:
    """The settings in use and their reload; ``reported`` runs after each commit (gauges, warnings)."""

    def __init__(self, cfg: Config, web: WebGuard, tls: TlsMaterial, listeners: Listeners, *, metrics: Metrics,
                 notifier: Notifier, upstreams: Upstreams, config_path: str | None, overrides: Mapping[str, Any],
                 reported: Callable[[], list]) -> None:
        self.cfg, self.web, self.tls, self.listeners = cfg, web, tls, listeners
        self.metrics, self.notifier, self.upstreams = metrics, notifier, upstreams
        self.config_path = config_path
        self.overrides = dict(overrides)  # CLI flags: a reload lays them over the file again
        self.reported = reported
        self.watcher: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one reload at a time (SIGHUP and the file poll may race)

    async def reload(self, why: str) -> bool:
        """Apply the config file (and flags) again: TLS, allow-lists, policy, limits, profiles, listeners.

        Everything is prepared before anything changes: a bad file, bad TLS material or a port
        that cannot be bound changes nothing. New sessions get the new settings; running ones
        keep theirs. systemd hears RELOADING=1 first and READY=1 with the outcome in STATUS=
        after (``Type=notify-reload`` makes ``systemctl reload`` wait for it).
        """
        async with self._lock:
            return await self._reload(why)

    async def _reload(self, why: str) -> bool:
        self.notifier.reloading()
        fresh: list[Listener] = []
        try:
            if self.listeners.draining:
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
            sockets = {(lst.host, lst.config_port): lst for lst in self.listeners.active
                       if lst.route.name in gone and lst.config_port}
            donors: dict[str, Listener] = {}
            for name in (*diff.added, *diff.replaced):
                lst = self.listeners.build(items[name])
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
        await self._commit_listeners(fresh, donors, gone, items)
        ended = sum(lst.route.revoke(self.tls.revoked) for lst in self.listeners.every if lst.route.side.client_tls)
        if ended:
            log.warning("reload (%s): ended %d live session(s) whose certificate is revoked or identity no longer "
                        "allowed", why, ended)
        warnings = self.reported()
        self.watch()
        self.metrics.reload("ok")
        self.metrics.reload_kept_keys = len(diff.kept)
        summary = diff.summary(self.cfg.side.item)
        news = ([f"new tls files ({', '.join(files)})"] if files else []) + (["new metrics web config"] if web_changed else [])
        if news:
            summary = "; ".join(news) + ("" if diff.empty else f"; {summary}")
        log.info("config reloaded (%s): %s", why, summary)
        self.notifier.ready(f"reloaded ({why}): {summary}" + "".join(f"; warning: {w.kind}" for w in warnings))
        return True

    async def _commit_listeners(self, fresh: list[Listener], donors: dict[str, Listener], gone: set[str],
                                items: dict[str, Any]) -> None:
        """New routes registered (taking over a donor's socket), removed ones retired, kept ones re-set."""
        for lst in fresh:
            self.listeners.register(lst)
            donor = donors.get(lst.route.name)
            if donor is not None:
                lst.sock, lst.port, donor.sock = donor.sock, donor.port, None
        kept: list[Listener] = []
        for lst in self.listeners.active:
            name = lst.route.name
            if name in gone:
                self.listeners.retire(lst)
            else:
                lst.item = items[name]
                apply_settings(lst.route, lst.item)
                kept.append(lst)
        order = list(items)  # config order
        self.listeners.active = sorted(kept + fresh, key=lambda lst: order.index(lst.route.name))
        await asyncio.sleep(0)  # the retired accept loops let go of their sockets (one handed over) first
        for lst in fresh:
            lst.accept()
        await self.upstreams.start_new()  # a pool that cannot start logs why; its sessions are refused

    # ----------------------------------------------------------------------------- file watch
    def watch(self) -> None:
        """Run the file watcher while ``tls.reload_interval_s`` > 0 (a reload may turn it on or off)."""
        if self.cfg.tls.reload_interval_s and (self.watcher is None or self.watcher.done()):
            self.watcher = asyncio.get_running_loop().create_task(self._watch_files(self.files_stamp()))

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()

    def files_stamp(self) -> tuple:
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
            now = self.files_stamp()
            if now != seen:
                seen = now
                await self.reload("file change")
