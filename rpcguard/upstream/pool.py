"""The upstream provider of one serve listener: the processes it runs, which session gets which.

Stays whole (over 400 lines): the spare, the per-session processes, quarantine and the cache
quota all decide on the same table of live processes per identity.

How this works: a route with ``upstream.exec`` asks its ``UpstreamPool`` for a connection per
session (``connect``) and tells it when the session ended and how (``ended``, with the audit
record). By ``isolation``:

* ``session`` (default): every session gets a server process no other session used, killed when
  the session ends, so nothing of one session (memory, heap state, code) exists during the next.
  A pre-started *spare* hides the start cost (50-200 ms here: bwrap, the dynamic loader, the
  backend's device set-up; a GPU context adds to it). llama.cpp opens several short probe
  sessions per start (HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY, GET_ALIGNMENT, GET_MAX_SIZE only:
  7 for llama-cpp-python, 13 for llama-server): a process whose sessions sent nothing else holds
  no tenant data, so it is kept for the next session of the same identity (``PROBE_COMMANDS``)
  instead of being killed.
* ``identity``: the process is kept across consecutive sessions of the same identity, killed
  when another identity comes.
* ``shared``: one process for every session (as with ``--upstream``), restarted with backoff
  when it exits.

With a ``-c`` cache in the command each identity has its own cache directory, bound into the
sandbox at spawn, so a spare is started for the identity that was served last. A process that
dies while it serves a session (not killed by us) is a crash of that session's identity:
``crash_cause`` gives the session its ending (``upstream_crashed``), and an identity with
``quarantine_crashes`` crashes within ``quarantine_window_s`` is refused
``identity_quarantined`` for ``quarantine_s``. The process tree's limits (sandbox.limits:
a cgroup per process, or rlimits) are decided once per pool and logged at start; while a
process with a cache directory runs, the directory is summed every ``CACHE_CHECK_S``: over
``cache_bytes``, earlier sessions' files go first, and a session whose own files pass the
quota is ended ``upstream_cache_quota`` (its process killed; it counts as a crash). Counters are plain integers read by
``PoolCollector`` at scrape time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rpcguard.errors import Refusal
from rpcguard.upstream import gpu, sandbox
from rpcguard.upstream.output import OutputLimiter
from rpcguard.upstream.process import ServerProcess, StartFailed

__all__ = ["ISOLATIONS", "PROBE_COMMANDS", "UpstreamSettings", "UpstreamPool", "PoolCollector", "SandboxUnavailable",
           "HOST_OPTIONS"]

log = logging.getLogger("rpcguard.upstream")

ISOLATIONS = ("session", "identity", "shared")
# Commands that put no tenant data into the server (no buffer, tensor, graph): a process whose
# sessions sent only these may serve the next session of the same identity.
PROBE_COMMANDS = frozenset({"HELLO", "DEVICE_COUNT", "GET_DEVICE_MEMORY", "GET_ALIGNMENT", "GET_MAX_SIZE"})
# rpcguard sets the server's address itself: a command that sets one is a config error.
HOST_OPTIONS = ("-H", "--host", "-p", "--port")
# shared: a server that ran this long before it exited is restarted without backoff.
RESTART_RESET_S = 10.0
# How long a session that saw its upstream close waits for the process's exit status.
EXIT_WAIT_S = 2.0
# How often a running process's cache directory is summed against cache_bytes: a walk of the
# directory (llama.cpp writes one file per cached tensor), off the loop. Between two walks the
# directory grows by what the disk takes in that time; RLIMIT_FSIZE bounds each file anyway.
CACHE_CHECK_S = 1.0


class SandboxUnavailable(Exception):
    """``sandbox: required`` and a mechanism is missing."""


@dataclass(frozen=True)
class UpstreamSettings:
    """``upstream: {exec: [...], isolation: ...}`` of a serve listener."""

    exec: tuple[str, ...]
    isolation: str = "session"
    sandbox: sandbox.SandboxSettings = field(default_factory=sandbox.SandboxSettings)
    spare: bool = True  # keep one process started ahead of the next session
    start_timeout_s: float = 30.0
    restart_backoff_s: float = 0.5  # shared: first restart delay, doubled per failure ...
    restart_backoff_max_s: float = 30.0  # ... up to this
    quarantine_crashes: int = 3  # crashes of one identity within the window ...
    quarantine_window_s: float = 600.0
    quarantine_s: float = 900.0  # ... refuse it this long (0: never quarantine)
    # the server may open a GPU (gpu.uses_gpu of exec, set by the config): a GPU listener, said at
    # start (observe/downgrades.py: contained, or gpu_uncontained)
    gpu: bool = False

    @property
    def uses_cache(self) -> bool:
        return "-c" in self.exec or "--cache" in self.exec

    @property
    def server_threads(self) -> int:
        """The CPU threads the server runs graphs on: its ``-t``/``--threads`` (rpc-server.cpp:114),
        else its default, half the hardware threads (rpc-server.cpp:89). The firewall checks every
        count up to it (protocol/workuse.py)."""
        for flag, value in zip(self.exec, self.exec[1:]):
            if flag in ("-t", "--threads") and value.isdigit() and int(value) > 0:
                return int(value)
        return max(1, (os.cpu_count() or 1) // 2)


class UpstreamPool:
    """The processes of one listener (see the module docstring)."""

    def __init__(self, listener: str, settings: UpstreamSettings, mech: sandbox.Mechanisms) -> None:
        self.listener = listener
        self.settings = settings
        self.mech = mech
        self.sandboxed = settings.sandbox.mode != "off" and mech.namespaces
        self.netns = self.sandboxed and "network_namespace" not in mech.missing
        self.missing = {} if settings.sandbox.mode == "off" else dict(mech.missing)
        self.limits = sandbox.limits(settings.sandbox, mech, settings.exec)  # again in start(), with the cgroups
        self.cgroups = False
        self._watchers: set[asyncio.Task] = set()
        self._number = 0
        self.by_link: dict[int, ServerProcess] = {}
        self.kept: ServerProcess | None = None  # a used process that may serve the next session
        self.spare: asyncio.Task[ServerProcess] | None = None
        self.spare_identity: str | None = None
        self.shared: ServerProcess | None = None
        self.closing = False
        self._restart: asyncio.Task | None = None
        self._failures = 0
        self.last_error = ""
        self._crashes: dict[str, deque[float]] = {}
        self.quarantine: dict[str, float] = {}  # identity -> until (monotonic)
        # counters (PoolCollector)
        self.starts = 0
        self.start_failures = 0
        self.exits: dict[str, int] = {}
        self.start_seconds_sum = 0.0
        self.last_start_s = 0.0
        self.sessions_by_start: dict[str, int] = dict.fromkeys(("spare", "kept", "cold", "shared"), 0)
        self.crashes = 0
        self.quarantines = 0
        self._live: set[ServerProcess] = set()

    # ----------------------------------------------------------------------------- processes
    async def _spawn(self, identity: str | None) -> ServerProcess:
        s = self.settings
        self._number += 1
        n = self._number
        uid = s.sandbox.uid_base + n % max(1, s.sandbox.uid_count)
        cache = None
        if s.uses_cache:
            cache = sandbox.cache_dir(s.sandbox, identity or "")
            os.makedirs(cache, mode=0o700, exist_ok=True)
            if self.sandboxed and "own_uid" not in self.mech.missing:
                os.chown(cache, uid, uid)  # the uid changes per process; the directory is the identity's
                os.chmod(cache, 0o700)
            # the identity's quota, before its server may add to it (a walk of the directory: off the loop)
            removed, freed = await asyncio.to_thread(sandbox.prune_cache, cache, s.sandbox.cache_bytes)
            if removed:
                log.info("upstream listener=%s process=%d: cache of its identity over cache_bytes=%d: %d oldest "
                         "files removed (%d bytes)", self.listener, n, s.sandbox.cache_bytes, removed, freed)
        port = sandbox.SANDBOX_PORT if self.netns else _free_port()
        try:
            argv = sandbox.command(list(s.exec), port=port, mech=self.mech, settings=s.sandbox, cache=cache, uid=uid,
                                   info_fd="{INFO_FD}")
        except gpu.GpuUnavailable as exc:  # a GPU node -d selects, or the driver's, is missing: one line
            self.start_failures += 1
            self.last_error = str(exc)
            log.error("upstream listener=%s process=%d failed to start: %s", self.listener, n, self.last_error)
            raise StartFailed(self.last_error) from None
        group = None
        if self.cgroups:
            try:
                group = self.mech.cgroups.make(str(n), self.limits.memory_bytes, self.limits.pids)
            except OSError as exc:
                self.start_failures += 1
                self.last_error = f"cannot make its cgroup: {exc}"
                log.error("upstream listener=%s process=%d failed to start: %s", self.listener, n, self.last_error)
                raise StartFailed(self.last_error) from None
        box = s.sandbox
        proc = ServerProcess(argv, port=port, listener=self.listener, number=n, wrapped=self.sandboxed,
                             limits=self.limits.rlimits, netns=self.netns, on_exit=self._exited,
                             identity=identity if s.uses_cache else None,
                             env=None if self.sandboxed or cache is None else {**os.environ, "LLAMA_CACHE": cache},
                             ns_helper=not self.mech.root, group=group,
                             output=OutputLimiter(box.log_lines_per_s, box.log_burst, box.log_bytes))
        self.starts += 1
        self._live.add(proc)
        try:
            await proc.start(s.start_timeout_s)
        except StartFailed as exc:
            self.start_failures += 1
            self.last_error = str(exc)
            log.error("upstream listener=%s process=%d failed to start: %s", self.listener, n, exc)
            raise
        self.last_error = ""
        if cache is not None and s.sandbox.cache_bytes:
            watcher = asyncio.get_running_loop().create_task(self._watch_cache(proc, cache))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
        self.start_seconds_sum += proc.ready_s
        self.last_start_s = proc.ready_s
        log.info("upstream listener=%s process=%d pid=%d listening in %.3f s%s", self.listener, n, proc.pid,
                 proc.ready_s, " (sandboxed)" if self.sandboxed else "")
        return proc

    async def _watch_cache(self, proc: ServerProcess, cache: str) -> None:
        """The identity's cache quota while ``proc`` runs (see the module docstring)."""
        limit = self.settings.sandbox.cache_bytes
        assert proc.exited is not None
        while proc.alive:
            await asyncio.wait([proc.exited], timeout=CACHE_CHECK_S)
            if not proc.alive:
                return
            used, freed = await asyncio.to_thread(sandbox.cache_over_quota, cache, limit, proc.started_s)
            if freed:
                log.info("upstream listener=%s process=%d: cache of its identity over cache_bytes=%d: %d bytes of "
                         "earlier sessions' files removed", self.listener, proc.number, limit, freed)
            if used > limit and proc.alive:
                detail = (f"its identity's cache directory holds {used} bytes, written since its server started, over "
                          f"cache_bytes={limit}")
                log.warning("upstream listener=%s process=%d pid=%d session=%s: %s: ending the session",
                            self.listener, proc.number, proc.pid, proc.session or "-", detail)
                proc.kill("upstream_cache_quota", detail)
                return

    def _exited(self, proc: ServerProcess) -> None:
        self._live.discard(proc)
        cause = "killed" if proc.killed else proc.cause()
        self.exits[cause] = self.exits.get(cause, 0) + 1
        if not proc.killed:
            log.warning("upstream listener=%s process=%d pid=%d exited (%s%s) session=%s", self.listener, proc.number,
                        proc.pid, proc.cause(), proc.limits_note(), proc.session or "-")
        if self.kept is proc:
            self.kept = None
        if proc is self.shared and not self.closing:
            self.shared = None
            # a server that dies soon after its start (a crash loop) backs off; one that ran for a
            # while, or that we killed (a hang), is restarted at once
            lived = time.time() - proc.started_s
            self._failures = 0 if proc.killed or lived >= RESTART_RESET_S else self._failures + 1
            self._restart_shared()

    def _restart_shared(self) -> None:
        if self._restart is None or self._restart.done():
            self._restart = asyncio.get_running_loop().create_task(self._run_shared())

    async def _run_shared(self) -> None:
        """shared: (re)start the one process, with backoff after failures."""
        s = self.settings
        while not self.closing and self.shared is None:
            if self._failures:
                delay = min(s.restart_backoff_max_s, s.restart_backoff_s * 2 ** (self._failures - 1))
                log.warning("upstream listener=%s: restarting the server in %.1f s", self.listener, delay)
                await asyncio.sleep(delay)
            try:
                self.shared = await self._spawn(None)
            except StartFailed:
                self._failures += 1
            else:
                if not self.shared.alive:  # died right after it listened
                    self.shared = None
                    self._failures += 1
        # the loop also ends when the restarted process died at once: _exited starts another round

    def _start_spare(self, identity: str | None) -> None:
        if not self.settings.spare or self.closing or self.settings.isolation == "shared":
            return
        key = identity if self.settings.uses_cache else None
        if self.spare is not None and self.spare_identity == key:
            return
        self._drop_spare()
        self.spare_identity = key
        self.spare = asyncio.get_running_loop().create_task(self._spawn(key))
        self.spare.add_done_callback(_quiet)

    def _drop_spare(self) -> None:
        if self.spare is not None:
            spare, self.spare = self.spare, None
            if spare.done() and not spare.cancelled() and spare.exception() is None:
                spare.result().kill()
            else:
                spare.cancel()

    async def _take(self, identity: str) -> tuple[ServerProcess, str]:
        """The process for a new session of ``identity`` and how it was got."""
        fits = (lambda p: p.identity == identity) if self.settings.uses_cache else (lambda p: True)
        kept = self.kept
        if kept is not None:
            self.kept = None
            if kept.alive and fits(kept) and (self.settings.isolation == "identity" or kept.clean) and \
                    kept.session_identity == identity:
                return kept, "kept"
            kept.kill()
        spare = self.spare
        if spare is not None and (not self.settings.uses_cache or self.spare_identity == identity):
            self.spare = None
            try:
                proc = await spare
            except (StartFailed, asyncio.CancelledError):
                proc = None
            if proc is not None and proc.alive:
                return proc, "spare"
        return await self._spawn(identity if self.settings.uses_cache else None), "cold"

    @property
    def contained(self) -> bool:
        """A fresh process per session in the full sandbox: what the firewall's contents-dependent
        ops (issue 20: SSM_SCAN, GATED_DELTA_NET, row indices) may be forwarded under."""
        return self.settings.isolation == "session" and self.sandboxed and not self.missing

    # ----------------------------------------------------------------------------- the route's side
    async def start(self) -> None:
        """At serve's start: check the sandbox, start the first process (shared) or the spare."""
        if self.sandboxed:
            sandbox.probe_cgroups(self.mech)
            self.missing = {} if self.settings.sandbox.mode == "off" else dict(self.mech.missing)
            self.limits = sandbox.limits(self.settings.sandbox, self.mech, self.settings.exec)
            self.cgroups = self.mech.cgroups.available
        if self.settings.sandbox.mode == "required" and self.missing:
            raise SandboxUnavailable("; ".join(f"{k}: {v}" for k, v in self.missing.items()))
        for mechanism, why in self.missing.items():
            log.warning("upstream listener=%s: sandbox mechanism %s unavailable, starting without it "
                        "(upstream.sandbox: best_effort): %s", self.listener, mechanism, why)
        if self.sandboxed:
            log.info("upstream listener=%s: limits of each server process: %s", self.listener, self.limits.describe())
        if self.settings.isolation == "shared":
            self.shared = await self._spawn(None)
        else:
            self._start_spare(None)

    async def connect(self, link_id: int, identity: str, timeout_s: float) -> socket.socket:
        """A connection to the server process of session ``link_id``; Refusal when there is none."""
        if self.settings.isolation == "shared":
            restart = self._restart
            if (self.shared is None or not self.shared.alive) and restart is not None and not restart.done():
                try:  # a restart under way (backoff 0 the first time): wait for it, up to the dial's timeout
                    await asyncio.wait_for(asyncio.shield(restart), timeout_s)
                except asyncio.TimeoutError:
                    pass
            proc = self.shared
            if proc is None or not proc.alive:
                raise Refusal("upstream_unavailable", f"the server is down ({self.last_error or 'restarting'})")
            how = "shared"
        else:
            try:
                proc, how = await self._take(identity)
            except StartFailed as exc:
                raise Refusal("upstream_unavailable", f"the server did not start: {exc}") from None
            # the next spare is started when this session ends (ended): started now, it would
            # compete with this session for the CPU (bench/studies/session_start.py). A kept process is
            # the exception: its session is a probe, or the first one that will dirty it (a
            # client's probes, then its model load), so the spare starts now and is ready for
            # the session after it (llama-server: two sessions per start need a fresh process).
            if how == "kept" and self.spare is None:
                self._start_spare(identity)
        self.sessions_by_start[how] += 1
        proc.session = link_id
        proc.session_identity = identity
        proc.sessions += 1
        self.by_link[link_id] = proc
        try:
            return await proc.connect(timeout_s)
        except OSError as exc:
            self.by_link.pop(link_id, None)
            if self.settings.isolation != "shared":
                proc.kill()
            raise Refusal("upstream_unavailable", f"cannot reach the server: {exc}") from None

    async def crash_cause(self, link_id: int) -> Refusal | None:
        """The session's server closed its connection: did it die (not killed by us)? Then the
        session's ending (``upstream_crashed``, how); ``ended`` counts it against the identity."""
        proc = self.by_link.get(link_id)
        if proc is None or proc.exited is None:
            return None
        try:
            await asyncio.wait_for(asyncio.shield(proc.exited), EXIT_WAIT_S)
        except asyncio.TimeoutError:
            return None
        if proc.end_reason is not None:  # we ended it: its session broke a limit of its process
            return Refusal("upstream_cache_quota", proc.end_reason[1])
        if proc.killed:
            return None
        return Refusal("upstream_crashed", f"the server (pid {proc.pid}) died: {proc.cause()}{proc.limits_note()}; "
                                           f"last output: {proc.last_stderr or '-'}")

    def ended(self, link_id: int, record: dict) -> None:
        """Session ``link_id`` is over (its audit record): count a crash, keep or kill its process."""
        proc = self.by_link.pop(link_id, None)
        if proc is None:
            return
        identity = str(record.get("identity") or "")
        if record.get("reason") in ("upstream_crashed", "upstream_hung", "upstream_cache_quota"):
            self._crashed(identity)
            log.warning("upstream listener=%s session=%d identity=%s post-mortem: %s", self.listener, link_id,
                        identity or "-", json.dumps(record.get("post_mortem"), separators=(",", ":")))
        if proc is self.shared:
            if record.get("reason") == "upstream_hung":
                log.warning("upstream listener=%s: the shared server hung in session %d; restarting it",
                            self.listener, link_id)
                proc.kill()
            return
        commands = set(record.get("commands") or ())
        proc.clean = proc.clean and commands <= PROBE_COMMANDS and record.get("result") == "ok"
        keep = proc.alive and (self.settings.isolation == "identity" or proc.clean)
        if keep:
            proc.session = 0
            if self.kept is not None and self.kept is not proc:
                self.kept.kill()
            self.kept = proc
        else:
            proc.kill()
            self._start_spare(identity)

    def _crashed(self, identity: str) -> None:
        self.crashes += 1
        s = self.settings
        if not s.quarantine_s or not s.quarantine_crashes:
            return
        now = time.monotonic()
        seen = self._crashes.setdefault(identity, deque(maxlen=s.quarantine_crashes))
        seen.append(now)
        if len(seen) >= s.quarantine_crashes and now - seen[0] <= s.quarantine_window_s:
            self.quarantine[identity] = now + s.quarantine_s
            self.quarantines += 1
            seen.clear()
            log.warning("upstream listener=%s: identity %s quarantined for %g s: its sessions crashed the server "
                        "%d times within %g s", self.listener, identity or "-", s.quarantine_s, s.quarantine_crashes,
                        s.quarantine_window_s)

    def quarantined(self, identity: str) -> Refusal | None:
        """``identity_quarantined`` while the identity's quarantine lasts."""
        until = self.quarantine.get(identity)
        if until is None:
            return None
        left = until - time.monotonic()
        if left <= 0:
            del self.quarantine[identity]
            return None
        return Refusal("identity_quarantined", f"its sessions crashed the server; quarantined for {left:.0f} s more")

    def ready(self) -> tuple[bool, str]:
        """/readyz: the shared process is up, or new sessions' processes start."""
        if self.settings.isolation == "shared":
            if self.shared is not None and self.shared.alive:
                return True, "server running"
            return False, f"server down ({self.last_error or 'restarting'})"
        if self.last_error:
            return False, f"the server does not start: {self.last_error}"
        return True, f"{self.settings.isolation} isolation, {len(self.by_link)} session(s)"

    async def close(self) -> None:
        self.closing = True
        self._drop_spare()
        if self._restart is not None:
            self._restart.cancel()
        for task in list(self._watchers):
            task.cancel()
        for proc in list(self._live):
            proc.kill()
        await asyncio.gather(*(p.stop() for p in list(self._live)), return_exceptions=True)


def _quiet(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a failed spare is logged by _spawn; retrieved here so asyncio does not warn


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PoolCollector(Collector):
    """rpcguard_upstream_* families from the pools of a Runtime, read at scrape time."""

    def __init__(self, pools: dict[str, UpstreamPool]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        starts = CounterMetricFamily("rpcguard_upstream_starts", "server processes started", labels=["role", "listener"])
        failed = CounterMetricFamily("rpcguard_upstream_start_failures", "server starts that failed",
                                     labels=["role", "listener"])
        exits = CounterMetricFamily("rpcguard_upstream_exits", "server processes that ended, by cause "
                                    "(killed: by rpcguard; exit N; signal NAME)", labels=["role", "listener", "cause"])
        ready = CounterMetricFamily("rpcguard_upstream_start_seconds", "time from spawn to listening, summed",
                                    labels=["role", "listener"])
        last = GaugeMetricFamily("rpcguard_upstream_last_start_seconds", "the last start's time to listening",
                                 labels=["role", "listener"])
        how = CounterMetricFamily("rpcguard_upstream_sessions_by_start", "sessions by where their process came "
                                  "from (spare, kept, cold, shared)", labels=["role", "listener", "start"])
        crashes = CounterMetricFamily("rpcguard_upstream_crashes", "sessions whose server died or hung",
                                      labels=["role", "listener"])
        quar = CounterMetricFamily("rpcguard_identity_quarantines", "identities quarantined", labels=["role", "listener"])
        qnow = GaugeMetricFamily("rpcguard_identities_quarantined", "identities in quarantine now",
                                 labels=["role", "listener"])
        limit = GaugeMetricFamily("rpcguard_upstream_limit", "what bounds each server process tree (bytes of "
                                  "memory, tasks), by mechanism: cgroup_v2/cgroup_v1 (the whole tree), rlimit_as/"
                                  "rlimit_data (per process), rlimit_nproc (the server's uid), none",
                                  labels=["role", "listener", "limit", "mechanism"])
        missing = GaugeMetricFamily("rpcguard_upstream_sandbox_missing", "1: this sandbox mechanism is not in "
                                    "use (unavailable here, or sandbox: off)", labels=["role", "listener", "mechanism"])
        for name, p in self.pools.items():
            starts.add_metric(["serve", name], p.starts)
            failed.add_metric(["serve", name], p.start_failures)
            for cause, n in p.exits.items():
                exits.add_metric(["serve", name, cause], n)
            ready.add_metric(["serve", name], p.start_seconds_sum)
            last.add_metric(["serve", name], p.last_start_s)
            for k, n in p.sessions_by_start.items():
                how.add_metric(["serve", name, k], n)
            crashes.add_metric(["serve", name], p.crashes)
            quar.add_metric(["serve", name], p.quarantines)
            now = time.monotonic()
            qnow.add_metric(["serve", name], sum(1 for until in p.quarantine.values() if until > now))
            if p.sandboxed:
                for what, mechanism, value in p.limits.gauges:
                    limit.add_metric(["serve", name, what, mechanism], value)
            off = p.settings.sandbox.mode == "off"
            for m in sandbox.MECHANISMS:
                missing.add_metric(["serve", name, m], 1 if off or m in p.missing else 0)
        yield from (starts, failed, exits, ready, last, how, crashes, quar, qnow, limit, missing)
