"""A control group per server process: its whole process tree's memory and number of tasks.

How this works: ``probe()`` finds, once, where serve may make child cgroups that carry the
``memory`` and ``pids`` controllers: cgroup v2 (the unified hierarchy, serve's own cgroup, the
controllers listed in its ``cgroup.controllers``: a systemd unit with ``Delegate=yes``, or root
on a host that enables them) or cgroup v1 (the ``memory`` and ``pids`` hierarchies, serve's
cgroup in each). v2's "no internal processes" rule: serve's own cgroup cannot hold processes
and enable controllers for its children, so serve first moves itself into a leaf child
(``rpcguard-serve``), as systemd's delegation documentation asks. ``Cgroups.make(name, memory,
pids)`` creates one group per process (``rpcguard-<serve pid>-<n>``) with ``memory.max`` /
``memory.limit_in_bytes`` (+ ``memory.memsw.limit_in_bytes``: swap counts too) and ``pids.max``;
process.py writes the child's pid into its ``cgroup.procs`` before the exec (so bwrap, the
server and every fork of it are inside from their first instruction) and removes the group
when the process is gone. Unlike an rlimit, the limits hold for the sum over the tree: a fork
does not get a fresh allowance. Groups left by a serve that was SIGKILLed (its pid no longer
running) are removed at the next probe.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field

__all__ = ["Cgroups", "Group", "probe"]

_PREFIX = "rpcguard-"
# sweep(): a left group's killed tasks are gone within milliseconds; at most this long in all.
_SWEEP_TRIES = 10
_SWEEP_WAIT_S = 0.05
_SERVE_LEAF = "rpcguard-serve"


def _mounts() -> tuple[str | None, dict[str, str]]:
    """(the cgroup2 mount point, {v1 controller: its mount point})."""
    v2: str | None = None
    v1: dict[str, str] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fstype, _src, opts = (right.split() + ["", "", ""])[:3]
                point = left.split()[4]
                if fstype == "cgroup2" and v2 is None:
                    v2 = point
                elif fstype == "cgroup":
                    for opt in opts.split(","):
                        if opt in ("memory", "pids"):
                            v1.setdefault(opt, point)
    except OSError:
        pass
    return v2, v1


def _own() -> dict[str, str]:
    """serve's cgroup path per controller ("" : the v2 one)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3:
                    for ctl in parts[1].split(",") if parts[1] else [""]:
                        out[ctl] = parts[2]
    except OSError:
        pass
    return out


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Group:
    """The cgroup(s) of one server process (one directory on v2, one per controller on v1)."""

    dirs: list[str]
    version: int

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def events(self) -> dict[str, int]:
        """What the limits did: ``oom_kill`` (tasks the memory limit killed), ``pids_max`` (forks refused)."""
        out = {"oom_kill": 0, "pids_max": 0}
        for d in self.dirs:
            for name, key, field_ in (("memory.events", "oom_kill", "oom_kill"), ("memory.oom_control", "oom_kill",
                                      "oom_kill"), ("pids.events", "pids_max", "max")):
                for line in _read(os.path.join(d, name)).splitlines():
                    k, _, v = line.partition(" ")
                    if k == field_ and v.strip().isdigit():
                        out[key] = max(out[key], int(v))
        return out

    def kill(self) -> None:
        """SIGKILL every process still in the group (the pid namespace's end normally took them)."""
        for d in self.dirs:
            if self.version == 2 and os.path.exists(os.path.join(d, "cgroup.kill")):
                try:
                    _write(os.path.join(d, "cgroup.kill"), "1")
                    continue
                except OSError:
                    pass
            for pid in _read(os.path.join(d, "cgroup.procs")).split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, PermissionError, ValueError):
                    pass

    def remove(self) -> bool:
        """rmdir each directory (only an empty group can go); True when all are gone."""
        ok = True
        for d in self.dirs:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                ok = False
        return ok


@dataclass
class Cgroups:
    """Where serve makes its servers' groups; ``why`` says why not when ``version`` is 0."""

    version: int = 0  # 2, 1, or 0: none
    parents: dict[str, str] = field(default_factory=dict)  # controller -> the directory children go in
    why: str = ""

    @property
    def available(self) -> bool:
        return self.version != 0

    def make(self, name: str, memory: int, pids: int) -> Group:
        """A new group ``rpcguard-<serve pid>-<name>`` with the limits (0: that limit not set)."""
        leaf = f"{_PREFIX}{os.getpid()}-{name}"
        dirs: list[str] = []
        try:
            for ctl in dict.fromkeys(self.parents.values()):
                d = os.path.join(ctl, leaf)
                os.mkdir(d, 0o755)
                dirs.append(d)
            group = Group(dirs, self.version)
            if self.version == 2:
                d = dirs[0]
                if memory:
                    _write(os.path.join(d, "memory.max"), str(memory))
                    if os.path.exists(os.path.join(d, "memory.swap.max")):
                        _write(os.path.join(d, "memory.swap.max"), "0")
                if pids:
                    _write(os.path.join(d, "pids.max"), str(pids))
            else:
                mem = os.path.join(self.parents["memory"], leaf)
                if memory:
                    _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory))
                    if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):
                        _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory))
                if pids:
                    _write(os.path.join(self.parents["pids"], leaf, "pids.max"), str(pids))
        except OSError:
            Group(dirs, self.version).remove()
            raise
        return group

    def sweep(self) -> int:
        """Remove the groups left by a serve that is no longer running (SIGKILLed), killing what is
        still in them first (a bwrap init whose parent died before it set its parent-death
        signal); how many went."""
        gone = 0
        for parent in dict.fromkeys(self.parents.values()):
            try:
                names = os.listdir(parent)
            except OSError:
                continue
            for n in names:
                if not n.startswith(_PREFIX) or n == _SERVE_LEAF:
                    continue
                pid = n[len(_PREFIX):].split("-", 1)[0]
                if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                    left = Group([os.path.join(parent, n)], self.version)
                    for _ in range(_SWEEP_TRIES):
                        left.kill()
                        if left.remove():
                            gone += 1
                            break
                        time.sleep(_SWEEP_WAIT_S)  # killed tasks leave the group when they are reaped
        return gone


def _probe_v2(mount: str, path: str) -> Cgroups:
    here = os.path.normpath(mount + path)
    controllers = _read(os.path.join(here, "cgroup.controllers")).split()
    lacking = [c for c in ("memory", "pids") if c not in controllers]
    if lacking:
        return Cgroups(why=f"cgroup v2 {here}: controller(s) {', '.join(lacking)} not delegated to serve's cgroup")
    enabled = _read(os.path.join(here, "cgroup.subtree_control")).split()
    if not {"memory", "pids"} <= set(enabled):
        if path != "/" and _read(os.path.join(here, "cgroup.procs")).split():
            # no internal processes: serve moves itself into a leaf of its own cgroup first
            leaf = os.path.join(here, _SERVE_LEAF)
            try:
                os.makedirs(leaf, exist_ok=True)
                _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
            except OSError as exc:
                return Cgroups(why=f"cgroup v2 {here}: cannot move serve into {leaf}: {exc.strerror}")
        try:
            _write(os.path.join(here, "cgroup.subtree_control"), "+memory +pids")
        except OSError as exc:
            why = "other processes share serve's cgroup" if exc.errno == errno.EBUSY else exc.strerror
            return Cgroups(why=f"cgroup v2 {here}: cannot enable memory and pids for children: {why}")
    return Cgroups(version=2, parents={"memory": here, "pids": here})


def probe() -> Cgroups:
    """Where this serve can make its servers' groups (see the module docstring)."""
    v2, v1 = _mounts()
    own = _own()
    tried: list[str] = []
    if v2 is not None and "" in own:
        found = _probe_v2(v2, own[""])
        if found.available and os.access(found.parents["memory"], os.W_OK):
            found.sweep()
            return found
        tried.append(found.why or f"cgroup v2 {v2}{own['']}: not writable")
    if "memory" in v1 and "pids" in v1 and "memory" in own and "pids" in own:
        parents = {c: os.path.normpath(v1[c] + own[c]) for c in ("memory", "pids")}
        if all(os.access(p, os.W_OK) for p in parents.values()):
            found = Cgroups(version=1, parents=parents)
            found.sweep()
            return found
        tried.append(f"cgroup v1 {parents['memory']}, {parents['pids']}: not writable (serve is not root?)")
    elif not tried:
        tried.append("no cgroup hierarchy with the memory and pids controllers is mounted")
    return Cgroups(why="; ".join(tried))
