"""What a process holds, read from /proc: file descriptors, sockets, memory, threads.

The fault and soak scenarios assert that rpcguard gives back everything a session took. rpcguard
has no debug endpoint (and gets none for tests), so "nothing leaked" is measured from outside:

* ``/proc/<pid>/fd``: every socket, pipe and file the process holds; an asyncio task that never
  ends holds its sockets, so a leaked link shows up here even though tasks cannot be counted;
* ``/proc/net/tcp``: the state of each of those sockets (a ``CLOSE_WAIT`` is a peer that hung up
  and a transport nobody closed);
* ``/proc/<pid>/status``: ``VmRSS`` (resident now) and ``VmHWM`` (peak resident), ``Threads``;
* the process's own metrics: ``sessions_active`` and ``upstream_queue_depth`` back to 0.

RSS of a CPython process rarely shrinks after a burst (arenas stay mapped), so memory is asserted
as "bounded" (peak under a ceiling) and "flat" (no growth from one batch of sessions to the next),
and file descriptors as "back to the baseline".
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Snapshot", "snapshot", "fd_count", "sockets", "tcp_states", "wait_settled", "mib", "Tracker",
           "record", "start_config_guard", "start_config_pair", "pair_configs"]

# RPCGUARD_RESILIENCE_REPORT=FILE: each scenario appends one JSON line of measured numbers
# (the source of the tables in docs/resilience.md and the README).
REPORT = os.environ.get("RPCGUARD_RESILIENCE_REPORT")

# /proc/net/tcp state codes (include/net/tcp_states.h)
TCP_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
    "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}


@dataclass(frozen=True)
class Snapshot:
    """One reading of a process."""

    fds: int
    rss_kib: int
    hwm_kib: int
    threads: int
    tcp: dict  # state name -> count, over the process's TCP sockets

    @property
    def rss_mib(self) -> float:
        return self.rss_kib / 1024

    @property
    def hwm_mib(self) -> float:
        return self.hwm_kib / 1024

    def text(self) -> str:
        tcp = " ".join(f"{k}={v}" for k, v in sorted(self.tcp.items()))
        return f"fds={self.fds} rss={self.rss_mib:.1f}MiB hwm={self.hwm_mib:.1f}MiB threads={self.threads} tcp[{tcp}]"


def _status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def sockets(pid: int) -> list[tuple[str, str, str]]:
    """(local, remote, state) of each TCP socket (IPv4 and IPv6) the process holds."""
    inodes = _socket_inodes(pid)
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[9] in inodes:
                out.append((_addr(cols[1]), _addr(cols[2]), TCP_STATES.get(cols[3], cols[3])))
    return out


def _addr(hexaddr: str) -> str:
    host, port = hexaddr.split(":")
    if len(host) == 8:
        return f"{socket.inet_ntoa(bytes.fromhex(host)[::-1])}:{int(port, 16)}"
    return f"[{host}]:{int(port, 16)}"


def tcp_states(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, _, state in sockets(pid):
        out[state] = out.get(state, 0) + 1
    return out


def snapshot(pid: int) -> Snapshot:
    st = _status(pid)
    return Snapshot(
        fds=fd_count(pid),
        rss_kib=int(st["VmRSS"].split()[0]),
        hwm_kib=int(st["VmHWM"].split()[0]),
        threads=int(st["Threads"]),
        tcp=tcp_states(pid),
    )


def mib(kib: int) -> float:
    return kib / 1024


def wait_settled(pid: int, fds: int | None = None, timeout: float = 10.0) -> Snapshot:
    """Wait until the process holds no TCP socket but its listeners (and at most ``fds``
    descriptors); return the last reading (the caller asserts on it, so a timeout shows what
    was left)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = snapshot(pid)
        settled = (fds is None or snap.fds <= fds) and not (snap.tcp.keys() - {"LISTEN"})
        if settled or time.monotonic() > deadline:
            return snap
        time.sleep(0.05)


class Tracker:
    """Baseline and later readings of the rpcguard processes of one scenario.

    ``baseline()`` once everything is started and idle; ``check()`` after the scenario: every
    process is back to its baseline fd count with no TCP socket other than its listeners, and
    its metrics say no session is running or queued. Readings are kept for the report.
    """

    def __init__(self, **guards) -> None:
        self.guards = guards
        self.base: dict[str, Snapshot] = {}
        self.after: dict[str, Snapshot] = {}
        self.peak_kib: dict[str, int] = {}

    def baseline(self) -> dict[str, Snapshot]:
        for name, g in self.guards.items():
            _settle_metrics(g)
            pid = g.proc.popen.pid
            self.base[name] = wait_settled(pid, timeout=5.0)  # e.g. the metrics scrape's socket closing
        return self.base

    def sample_peak(self) -> None:
        """Record the current RSS as a candidate peak (VmHWM covers the whole life instead)."""
        for name, g in self.guards.items():
            rss = snapshot(g.proc.popen.pid).rss_kib
            self.peak_kib[name] = max(self.peak_kib.get(name, 0), rss)

    def check(self, *, timeout: float = 10.0, rss_slack_mib: float = 24.0) -> dict[str, Snapshot]:
        """Assert fds, sockets, sessions and queue back to baseline; RSS within ``rss_slack_mib``."""
        for name, g in self.guards.items():
            assert g.proc.alive(), f"{name} died:\n{g.output()[-3000:]}"
            _settle_metrics(g, timeout)
            assert g.value("rpcguard_sessions_active") == 0, f"{name}: sessions still active"
            assert g.value("rpcguard_upstream_queue_depth") == 0, f"{name}: sessions still queued"
            base = self.base[name]
            snap = wait_settled(g.proc.popen.pid, base.fds, timeout)
            self.after[name] = snap
            assert snap.fds <= base.fds, f"{name}: fds {base.fds} -> {snap.fds}: {sockets(g.proc.popen.pid)}"
            assert not (snap.tcp.keys() - {"LISTEN"}), f"{name}: sockets left: {sockets(g.proc.popen.pid)}"
            grown = snap.rss_mib - base.rss_mib
            assert grown <= rss_slack_mib, f"{name}: RSS grew {grown:.1f} MiB ({base.text()} -> {snap.text()})"
        return self.after

    def report(self) -> str:
        lines = []
        for name in self.guards:
            b, a = self.base.get(name), self.after.get(name)
            if b and a:
                lines.append(f"{name}: fds {b.fds}->{a.fds} rss {b.rss_mib:.1f}->{a.rss_mib:.1f} MiB "
                             f"(peak {a.hwm_mib:.1f} MiB) threads {b.threads}->{a.threads}")
        return "; ".join(lines)


def _settle_metrics(guard, timeout: float = 10.0) -> None:
    """Wait until the guard reports no running or queued session."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if guard.value("rpcguard_sessions_active") == 0 and guard.value("rpcguard_upstream_queue_depth") == 0:
            return
        time.sleep(0.05)


def record(scenario: str, **fields) -> None:
    """Append one scenario's measured numbers to ``$RPCGUARD_RESILIENCE_REPORT`` (if set)."""
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"scenario": scenario, **fields}, default=str) + "\n")


def start_config_guard(role: str, workdir: Path, config: str, ports: list[int] | None = None, *,
                       args: tuple = (), tag: str = ""):
    """Start ``rpcguard ROLE --config FILE`` for a config with several listeners/tunnels (which the
    single-listener ``start_guard`` flags cannot express) and wait until it is ready.

    Listen on port 0 in the config: the bound ports are read from the log, in the order of the
    config's ``name:`` entries (``extra["ports"]``; ``extra["names"]`` maps names to ports).
    ``ports`` is for a config that names fixed ports (a restart on the ports of a first run)."""
    import re

    from rpcguard.cli import READY_MESSAGE
    from tests.support.guard import Guard, bound_metrics_port, bound_ports, wait_for_line
    from tests.support.realpeer import PYTHON, start, wait_port

    stamp = time.monotonic_ns()
    path = workdir / f"{role}{tag}-{stamp}.yaml"
    path.write_text(config)
    cmd = [PYTHON, "-m", "rpcguard", role, "--config", str(path), "--metrics", "127.0.0.1:0", *args]
    if role == "connect":
        cmd.append("--no-check")
    proc = start(cmd, workdir / f"rpcguard-{role}{tag}-{stamp}.log", f"rpcguard {role}")
    wait_for_line(proc, READY_MESSAGE)
    text = proc.output()
    names = bound_ports(text)
    order = [n for n in re.findall(r"name: (\S+)", config) if n in names]
    got = ports if ports is not None else [names[n] for n in order] or list(names.values())
    for port in got:
        wait_port(port, proc=proc.popen)
    return Guard(proc, got[0], bound_metrics_port(text) or 0, role, extra={"ports": got, "names": names,
                                                                            "config": path})


def start_config_pair(workdir: Path, pki, upstream_ports: list[int], extra: str = "", *,
                      restartable: bool = False):
    """serve with a listener ``gpu<i>`` per upstream and connect with a tunnel to each (see
    ``pair_configs``); returns (serve, connect, serve_config), serve_config naming serve's bound
    ports. Both bind port 0, except serve when it is ``restartable`` (the test restarts it on the
    same ports): it is then given reserved ports (realpeer.reserve_port) that stay its own while
    it is down."""
    from tests.support.realpeer import reserve_port

    zeros = [0] * len(upstream_ports)
    ports = [reserve_port() for _ in upstream_ports] if restartable else zeros
    first, _ = pair_configs(pki, ports, zeros, upstream_ports, extra)
    serve = start_config_guard("serve", workdir, first, ports if restartable else None)
    serve_cfg, connect_cfg = pair_configs(pki, serve.extra["ports"], zeros, upstream_ports, extra)
    try:
        connect = start_config_guard("connect", workdir, connect_cfg)
    except BaseException:
        serve.stop()
        raise
    return serve, connect, serve_cfg


def pair_configs(pki, serve_ports: list[int], connect_ports: list[int], upstream_ports: list[int],
                 extra: str = "") -> tuple[str, str]:
    """serve and connect YAML for one listener ``gpu<i>`` per upstream and one tunnel per listener."""
    def tls(name: str) -> str:
        return f"tls:\n  cert: {pki.path(name)}\n  key: {pki.path(name, 'key')}\n  ca: {pki.path('ca')}\n"

    allow = "" if "allow:" in extra else "allow:\n  all: true\n"  # serve refuses an empty allow-list
    serve = tls(pki.node) + extra + allow + "listeners:\n" + "".join(
        f"  - name: gpu{i}\n    listen: 127.0.0.1:{sp}\n    upstream: 127.0.0.1:{up}\n"
        for i, (sp, up) in enumerate(zip(serve_ports, upstream_ports)))
    connect = tls(pki.client) + extra + "tunnels:\n" + "".join(
        f"  - name: gpu{i}\n    listen: 127.0.0.1:{cp}\n    server: 127.0.0.1:{sp}\n    server_name: {pki.node}\n"
        for i, (cp, sp) in enumerate(zip(connect_ports, serve_ports)))
    return serve, connect
