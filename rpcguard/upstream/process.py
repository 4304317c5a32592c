"""One ggml-rpc-server process: start, wait until it listens, its stderr, connections, its end.

Stays whole (over 400 lines): one process's life, start to reaping, with its output limiter and
its end classified; each step reads the state the previous one left.

How this works: ``ServerProcess.start()`` spawns the command ``sandbox.command()`` built (rlimits
applied in the child before exec, inherited by bwrap and the server), reads bubblewrap's
``--info-fd`` JSON for the pid of the server's namespace, and waits until that pid's network
namespace has a socket in LISTEN on 127.0.0.1:PORT (``/proc/PID/net/tcp``): no probe connection
(the server serves one client at a time and logs each). With a cgroup (cgroup.py) the child
enters it before the exec, so bwrap, the server and every fork of it are counted together; the
group is removed once the process is gone. Its stdout/stderr is read in chunks into rpcguard's
log, line by line with the listener and the session it serves, as far as ``OutputLimiter``
(output.py) lets it: a flood is counted and dropped, and one line says how much. ``connect()`` opens a TCP
connection to it: inside its network namespace when it has one (a helper thread ``setns``es
into it, connects and hands back the socket, which stays in that namespace), else on the host's
loopback. ``exited`` resolves with the exit status; ``cause()`` names it (``exit 1``,
``signal SIGKILL``; bwrap reports a signal as 128 + N).
"""

from __future__ import annotations

import asyncio
import ctypes
import subprocess
import json
import logging
import os
import resource
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Callable

from rpcguard.upstream import seccomp
from rpcguard.upstream.cgroup import Group
from rpcguard.upstream.output import OutputLimiter
from rpcguard.upstream.sandbox import SECCOMP_FD

__all__ = ["ServerProcess", "StartFailed", "exit_cause", "listening", "become_subreaper", "reap_orphans"]

log = logging.getLogger("rpcguard.upstream")

_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)
# How often the namespace's socket table is read while the server starts (it takes 50-200 ms).
_LISTEN_POLL_S = 0.003
# A stderr line longer than this is cut (a server printing garbage must not grow our memory).
STDERR_LINE_BYTES = 4096
# The server's output is read this much at a time: a flood costs one read per 64 KiB, and its
# lines are only counted (not split) while the limiter has no room.
OUTPUT_CHUNK = 64 << 10
# While output is dropped, how often one line says how much was (seconds).
DROP_REPORT_S = 10.0
# kill(): bwrap outside gets this long to reap the namespace's init and exit by itself.
OUTER_GRACE_S = 1.0


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class StartFailed(Exception):
    """The server did not come up (its exit status or the timeout in ``detail``)."""


def become_subreaper() -> bool:
    """Make serve the reaper of its servers' orphans. bwrap outside exits as soon as the command
    in its pid namespace has, before that namespace's init is reaped: the init is orphaned and,
    without a subreaper, waits for pid 1 as a zombie (``[bwrap] <defunct>``), forever under an init
    that does not reap. As a subreaper serve gets it and ``reap_orphans`` reaps it."""
    return _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def reap_orphans(known: set[int]) -> int:
    """Reap serve's exited children that it did not spawn itself (orphans of its servers' trees,
    named ``bwrap``: never a child some other part of serve waits for); ``known``: the pids of
    processes serve spawned. Returns how many were reaped."""
    reaped = 0
    try:
        tasks = os.listdir(f"/proc/{os.getpid()}/task")
    except OSError:
        return 0
    kids: set[int] = set()
    for t in tasks:
        try:
            with open(f"/proc/{os.getpid()}/task/{t}/children") as f:
                kids.update(int(k) for k in f.read().split())
        except OSError:
            continue
    for pid in kids - known:
        try:
            with open(f"/proc/{pid}/stat") as f:
                name, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        if rest.split()[0] == "Z" and name.endswith("(bwrap"):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped += 1
            except ChildProcessError:
                pass
    return reaped


def exit_cause(status: int | None, wrapped: bool) -> str:
    """``exit N`` or ``signal NAME`` (bwrap turns the server's death by signal N into 128 + N)."""
    if status is None:
        return "running"
    if status < 0:
        return f"signal {signal.Signals(-status).name}"
    if wrapped and status > 128 and status - 128 in signal.valid_signals():
        return f"signal {signal.Signals(status - 128).name}"
    return f"exit {status}"


def listening(pid: int, port: int) -> bool:
    """Whether the network namespace of ``pid`` has 127.0.0.1:``port`` in LISTEN."""
    want = f"0100007F:{port:04X}"
    try:
        with open(f"/proc/{pid}/net/tcp") as f:
            next(f)
            for line in f:
                parts = line.split(None, 4)
                if parts[1] == want and parts[3] == "0A":
                    return True
    except (OSError, StopIteration):
        pass
    return False


def _connect_in(ns_path: str, port: int, timeout_s: float) -> socket.socket:
    """In a thread of its own: enter the network namespace, connect, return the socket."""
    result: list = []

    def run() -> None:
        try:
            fd = os.open(ns_path, os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {ns_path}: {os.strerror(err)}")
            finally:
                os.close(fd)
            result.append(socket.create_connection(("127.0.0.1", port), timeout_s))
        except BaseException as exc:  # handed to the caller
            result.append(exc)

    t = threading.Thread(target=run, name="rpcguard-netns", daemon=True)
    t.start()
    t.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _helper_python() -> str:
    """A Python for nshelper.py (standard library only): ours, or the system's if ours cannot be
    run by our uid (a venv whose interpreter lives under another user's home)."""
    if os.access(sys.executable, os.X_OK):
        return sys.executable
    return shutil.which("python3") or sys.executable


class ServerProcess:
    """One server process of a listener (see the module docstring)."""

    def __init__(self, argv: list[str], *, port: int, listener: str, number: int, wrapped: bool,
                 limits: list[tuple[int, int]], netns: bool, on_exit: Callable[[ServerProcess], None] | None = None,
                 identity: str | None = None, env: dict[str, str] | None = None, ns_helper: bool = False,
                 group: Group | None = None, output: OutputLimiter | None = None) -> None:
        self.argv = argv
        self.env = env  # None: rpcguard's (bwrap clears it for the sandbox)
        self.port = port
        self.listener = listener
        self.number = number  # the pool's count: names the process in logs
        self.wrapped = wrapped  # under bwrap: --info-fd, exit statuses 128 + N
        self.limits = limits
        self.netns = netns
        self.ns_helper = ns_helper  # not root: connections into its namespace come from nshelper.py
        self._helper: asyncio.subprocess.Process | None = None
        self._chan: socket.socket | None = None
        self._chan_lock = threading.Lock()
        self.on_exit = on_exit
        self.identity = identity  # whose cache directory it has (None: no cache directory)
        self.session_identity = ""  # the identity of that session
        self.session = 0  # the session it serves (0: none yet), for its stderr lines
        self.sessions = 0  # how many sessions it served
        self.clean = True  # no session put tenant data into it (pool.py: only probe commands)
        self.proc: asyncio.subprocess.Process | None = None
        self.ns_pid = 0  # a pid inside its namespaces (bwrap's child), or the process itself
        self.started_s = 0.0
        self.ready_s = 0.0  # seconds from spawn to LISTEN
        self.status: int | None = None
        self.killed = False  # we ended it (session over, watchdog, shutdown)
        self.exited: asyncio.Future[int] | None = None
        self._tasks: list[asyncio.Task] = []
        self.last_stderr = ""
        self.group = group  # its cgroup (cgroup.py), entered before the exec; None: rlimits only
        self.output = output or OutputLimiter(20, 200, 1 << 20)
        self.end_reason: tuple[str, str] | None = None  # (reason, detail): we ended it for its session
        self.limit_events: dict[str, int] = {}  # what the cgroup's limits did (after the exit)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    @property
    def helper_pid(self) -> int:
        return self._helper.pid if self._helper is not None else 0

    def cause(self) -> str:
        return exit_cause(self.status, self.wrapped)

    def limits_note(self) -> str:
        """What its cgroup's limits did, for the exit's log line (``""``: nothing)."""
        ev = self.limit_events
        notes = [f"the memory limit killed {ev['oom_kill']} task(s)"] if ev.get("oom_kill") else []
        if ev.get("pids_max"):
            notes.append(f"the pids limit refused {ev['pids_max']} fork(s)")
        return f"; {', '.join(notes)}" if notes else ""

    def _preexec(self) -> None:
        # The process dies with rpcguard, even SIGKILLed (bwrap --die-with-parent then takes the
        # server with it): a server nobody can reach any more must not outlive its proxy.
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if self.group is not None:  # before anything runs: every descendant is counted in it
            for path in self.group.procs_files:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, str(os.getpid()).encode())
                finally:
                    os.close(fd)
        for res, value in self.limits:
            soft, hard = resource.getrlimit(res)
            limit = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(res, (limit, limit))

    async def start(self, timeout_s: float) -> None:
        """Spawn and wait until it listens; raises StartFailed."""
        loop = asyncio.get_running_loop()
        self.exited = loop.create_future()
        t0 = time.monotonic()
        rfd, wfd = os.pipe() if self.wrapped else (-1, -1)
        fds = [wfd] if self.wrapped else []
        argv = [a.replace("{INFO_FD}", str(wfd)) for a in self.argv]
        if SECCOMP_FD in argv:  # bwrap reads the syscall filter from this descriptor
            filt = os.memfd_create("rpcguard-seccomp", 0)
            os.write(filt, seccomp.program())
            os.lseek(filt, 0, os.SEEK_SET)
            fds.append(filt)
            argv = [str(filt) if a == SECCOMP_FD else a for a in argv]
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, pass_fds=tuple(fds),
                preexec_fn=self._preexec, start_new_session=True, env=self.env)
        except (OSError, subprocess.SubprocessError) as exc:  # SubprocessError: the preexec (the cgroup) failed
            if self.group is not None:
                self.group.remove()
            raise StartFailed(f"cannot run {argv[0]}: {exc}") from None
        finally:
            for fd in fds:
                os.close(fd)
        self.started_s = time.time()
        self._tasks.append(loop.create_task(self._read_output()))
        self._tasks.append(loop.create_task(self._wait()))
        try:
            if self.wrapped:
                self.ns_pid = await asyncio.wait_for(self._info(rfd), timeout_s)
            else:
                self.ns_pid = self.proc.pid
            deadline = t0 + timeout_s
            while not listening(self.ns_pid, self.port):
                if self.exited.done():
                    raise StartFailed(f"the server exited at start ({self.cause()}): {self.last_stderr or '-'}")
                if time.monotonic() > deadline:
                    raise StartFailed(f"the server did not listen on its port within {timeout_s:g} s")
                await asyncio.sleep(_LISTEN_POLL_S)
            if self.netns and self.ns_helper:
                await self._start_helper(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.kill()
            raise
        self.ready_s = time.monotonic() - t0

    async def _start_helper(self, timeout_s: float) -> None:
        """nshelper.py, entered into the server's user and network namespaces (not root)."""
        from rpcguard.upstream import nshelper

        ours, theirs = socket.socketpair()
        try:
            self._helper = await asyncio.create_subprocess_exec(
                _helper_python(), "-I", "-S", nshelper.__file__, str(self.ns_pid), str(self.port), str(theirs.fileno()),
                stdin=asyncio.subprocess.DEVNULL, pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            theirs.close()
        ours.settimeout(timeout_s)
        loop = asyncio.get_running_loop()
        first = await loop.run_in_executor(None, ours.recv, 256)
        if first != b"R":
            ours.close()
            raise StartFailed(f"cannot enter the server's network namespace: {first[1:].decode(errors='replace') or 'the helper died'}")
        self._chan = ours

    def _helper_connect(self, timeout_s: float) -> socket.socket:
        chan = self._chan
        if chan is None:
            raise OSError("no namespace helper")
        with self._chan_lock:
            chan.settimeout(timeout_s)
            chan.sendall(b"c")
            msg, fds, _flags, _addr = socket.recv_fds(chan, 1, 1)
        if msg != b"K" or not fds:
            for fd in fds:
                os.close(fd)
            raise OSError("the server does not accept connections")
        return socket.socket(fileno=fds[0])

    async def _info(self, rfd: int) -> int:
        """bwrap's --info-fd: the pid of the server's namespace, once it is set up."""
        loop = asyncio.get_running_loop()
        data = b""
        try:
            while True:
                chunk = await loop.run_in_executor(None, os.read, rfd, 4096)
                if not chunk:
                    raise StartFailed(f"the sandbox did not start: {self.last_stderr or '-'}")
                data += chunk
                try:
                    return int(json.loads(data)["child-pid"])
                except ValueError:
                    continue
        finally:
            os.close(rfd)

    def _log_line(self, line: bytes) -> None:
        text = line[:STDERR_LINE_BYTES].decode(errors="replace").rstrip()
        if text:
            self.last_stderr = text
            log.info("upstream listener=%s process=%d pid=%d session=%s: %s", self.listener, self.number,
                     self.pid, self.session or "-", text)

    def _report_drops(self, final: bool = False) -> None:
        lines, nbytes = self.output.drops()
        lim = self.output
        if lines:
            log.warning("upstream listener=%s process=%d pid=%d session=%s: output over its limit (%g lines/s, "
                        "%d bytes in all): %d lines (%d bytes) dropped", self.listener, self.number, self.pid,
                        self.session or "-", lim.rate, lim.total_bytes, lines, nbytes)
        if final and lim.dropped_lines_all:
            log.warning("upstream listener=%s process=%d pid=%d: output dropped in all: %d lines (%d bytes); "
                        "logged %d bytes", self.listener, self.number, self.pid, lim.dropped_lines_all,
                        lim.dropped_bytes_all, lim.logged_bytes)

    def _take_output(self, data: bytes) -> bytes:
        """Log or count the complete lines of ``data``; returns the unfinished rest."""
        lim = self.output
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) < STDERR_LINE_BYTES:
                return data
            end = len(data)  # a line longer than the cut: taken as one
            data += b"\n"
        last = data[data.rfind(b"\n", 0, end) + 1:end][:STDERR_LINE_BYTES]
        if lim.room():
            lines = data[:end].split(b"\n")
            for i, line in enumerate(lines):
                if lim.admit(len(line) + 1):
                    self._log_line(line)
                else:  # out of room: the rest of the chunk is counted
                    lim.drop(len(lines) - i - 1, sum(len(x) + 1 for x in lines[i + 1:]))
                    break
        else:
            lim.drop(data.count(b"\n", 0, end + 1), end + 1)
        if last.strip():
            self.last_stderr = last.decode(errors="replace").rstrip()
        return data[end + 1:]

    async def _read_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        stream = self.proc.stdout
        pending = b""
        reported = time.monotonic()
        capped = False
        try:
            while True:
                chunk = await stream.read(OUTPUT_CHUNK)
                if not chunk:
                    break
                pending = self._take_output(pending + chunk)
                if self.output.capped and not capped:
                    capped = True
                    log.warning("upstream listener=%s process=%d pid=%d session=%s: its output reached log_bytes=%d: "
                                "the rest is counted, not logged", self.listener, self.number, self.pid,
                                self.session or "-", self.output.total_bytes)
                if self.output.dropped_lines and time.monotonic() - reported >= DROP_REPORT_S:
                    reported = time.monotonic()
                    self._report_drops()
            if pending:
                self._take_output(pending + b"\n")
        finally:
            self._report_drops(final=True)

    async def _wait(self) -> None:
        assert self.proc is not None and self.exited is not None
        status = await self.proc.wait()
        if self.group is not None:  # what its limits did; then the group goes (only an empty one can)
            self.limit_events = self.group.events()
            self.group.kill()
            if not self.group.remove():
                await asyncio.sleep(0.1)  # the pid namespace's last tasks are still being reaped
                self.group.kill()
                self.group.remove()
        self.status = status
        if not self.exited.done():
            self.exited.set_result(status)
        if self.on_exit is not None:
            self.on_exit(self)

    async def connect(self, timeout_s: float) -> socket.socket:
        """A connected, non-blocking TCP socket to the server (inside its namespace if it has one)."""
        if self.netns and self.ns_helper:
            sock = await asyncio.get_running_loop().run_in_executor(None, self._helper_connect, timeout_s)
        elif self.netns:
            sock = await asyncio.get_running_loop().run_in_executor(
                None, _connect_in, f"/proc/{self.ns_pid}/ns/net", self.port, timeout_s)
        else:
            sock = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                None, socket.create_connection, ("127.0.0.1", self.port), timeout_s), timeout_s)
        sock.setblocking(False)
        return sock

    @property
    def alive(self) -> bool:
        return self.exited is not None and not self.exited.done()

    def kill(self, reason: str = "", detail: str = "") -> None:
        """SIGKILL the server. With a ``reason``: it broke a limit of its session, which ends with
        that reason (pool.crash_cause). Under bwrap the namespace's init goes first (the end of its
        pid namespace takes the server and every fork with it); bwrap outside reaps it and exits,
        and serve reaps bwrap. Killed together, the init could be orphaned first and wait as a
        zombie for pid 1 to reap it (``[bwrap] <defunct>`` under an init that reaps late or
        never); bwrap outside is killed only if it has not exited ``OUTER_GRACE_S`` later."""
        if reason and self.end_reason is None and self.alive:
            self.end_reason = (reason, detail)
        self.killed = True
        if self._chan is not None:
            self._chan.close()  # the helper ends when its channel does
            self._chan = None
        helper = self._helper.pid if self._helper is not None else 0
        inner = self.ns_pid if self.wrapped and self.ns_pid not in (0, self.pid) else 0
        for pid in {inner or self.pid, helper} - {0}:
            _sigkill(pid)
        if inner and self.pid:
            try:
                asyncio.get_running_loop().call_later(OUTER_GRACE_S, self._kill_outer)
            except RuntimeError:  # no loop (shutdown): at once
                _sigkill(self.pid)

    def _kill_outer(self) -> None:
        if self.exited is not None and not self.exited.done():
            _sigkill(self.pid)

    async def stop(self) -> None:
        self.kill()
        if self.exited is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), 5.0)
            except asyncio.TimeoutError:
                pass
