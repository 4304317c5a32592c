"""The sandbox's limits against code running inside it (issue 28 item 5), with the REAL server.

A payload standing for an exploit's code execution inside the contained server
(tests/support/limits_payload.c, built here with one -DMODE each) goes for a limit, reports what
it got on stderr ("LIMIT <mode>: ...") and execs the real ggml-rpc-server, run as
``serve -- payload ggml-rpc-server``:

* a fork bomb stops at ``pids`` (cgroup pids.max / RLIMIT_NPROC of the server's own uid);
* children each touching 64 MiB hold no more than ``data_bytes`` together (the cgroup bounds the
  tree; RLIMIT_DATA was per process: 8 x 64 MiB held under a 256 MiB limit);
* writing the identity's cache past ``cache_bytes`` during a session ends that session
  ``upstream_cache_quota`` (the quota was enforced only when a process started);
* 200,000 lines of output reach the log at ``log_lines_per_s`` after a burst, and one line
  says how many were dropped;
* the ASan build of the server runs contained (RLIMIT_DATA stopped its shadow reservation);
* serve SIGKILLed with a session open and a daemon forked inside the sandbox: every process
  of the tree is gone and reaped (under a subreaper standing for the init: systemd, tini);
* sessions ending, a server crashing and serve's start leave nothing for the init to reap
  (serve is the subreaper of its servers' trees: bwrap's orphaned inits were zombies under
  pid 1, ``[bwrap] <defunct>``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.test_containment_real import server_binary, write_config
from tests.support import realpeer
from tests.support.guard import READY_MESSAGE, Guard, bound_metrics_port, bound_ports, start_guard, wait_for_line
from tests.support.rawclient import RawClient, mtls_socket
from tests.support.waiting import wait_until

HERE = Path(__file__).resolve().parent
PAYLOAD_SRC = HERE.parent / "support" / "limits_payload.c"
MODES = {"forks": 1, "memory": 2, "cache": 3, "flood": 4, "daemon": 5}
SMALL = 1 << 16
MIB = 1 << 20


def build(workdir: Path, mode: str, **defs: int) -> str:
    out = workdir / f"payload-{mode}"
    flags = [f"-DMODE={MODES[mode]}", *(f"-D{k}={v}" for k, v in defs.items())]
    subprocess.run(["gcc", "-O1", "-Wall", *flags, "-o", str(out), str(PAYLOAD_SRC)], check=True)
    return str(out)


def reports(serve: Guard, mode: str) -> list[str]:
    return re.findall(rf"LIMIT {mode}: (.*)", serve.output())


def serve_payload(pki, workdir: Path, mode: str, sandbox: str, *, cache: bool = False, **defs: int) -> Guard:
    payload = build(workdir, mode, **defs)
    cfg = write_config(workdir, f"{mode}.yaml", f"      exec: [{payload}, {server_binary()}{', -c' if cache else ''}]\n"
                                                 f"      sandbox: {{{sandbox}}}\n")
    return start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg])


def a_session_is_served(pki, serve: Guard) -> None:
    c = RawClient.session(mtls_socket(pki, serve.port))
    assert c.alloc(SMALL).buffer
    c.close()


def test_a_fork_bomb_stops_at_the_pids_limit(pki, workdir):
    serve = serve_payload(pki, workdir, "forks", "pids: 64", MAX_FORKS=2000)
    try:
        line = wait_until(lambda: reports(serve, "forks"), 30, "the payload's report")[0]
        n = int(line.split()[0])
        assert n < 64 and "Resource temporarily unavailable" in line, line
        assert serve.logged("pids.max 64 for the whole process tree"), serve.output()[-3000:]
        assert serve.value("rpcguard_upstream_limit", limit="tasks", mechanism="cgroup_v1") + \
            serve.value("rpcguard_upstream_limit", limit="tasks", mechanism="cgroup_v2") == 64
        a_session_is_served(pki, serve)  # the server started once the children were gone
    finally:
        serve.stop()


def test_the_memory_of_the_whole_process_tree_is_bounded(pki, workdir):
    """8 children x 64 MiB under data_bytes 256 MiB: the tree holds at most 256 MiB at once
    (RLIMIT_DATA gave each child its own 256 MiB: all 512 MiB held)."""
    serve = serve_payload(pki, workdir, "memory", f"data_bytes: {256 * MIB}", CHILDREN=8, CHILD_MIB=64)
    try:
        line = wait_until(lambda: reports(serve, "memory"), 60, "the payload's report")[0]
        held, died = int(line.split()[1]), int(re.search(r"\((\d+) died\)", line).group(1))
        assert held * MIB <= 256 * MIB and died >= 1, line
        assert serve.logged(f"limit {256 * MIB} bytes for the whole process tree"), serve.output()[-3000:]
        a_session_is_served(pki, serve)
    finally:
        serve.stop()


def test_a_cache_filled_past_its_quota_during_a_session_ends_the_session(pki, workdir):
    """4 MiB files every 100 ms into /cache once a session is open, up to 128 MiB, quota 64 MiB:
    the session is ended upstream_cache_quota before the payload is done."""
    serve = serve_payload(pki, workdir, "cache", f"cache_root: {workdir / 'cache'}, cache_bytes: {64 * MIB}",
                          cache=True, FILE_MIB=4, TOTAL_MIB=128)
    try:
        c = RawClient.session(mtls_socket(pki, serve.port))
        wait_until(lambda: "reason=upstream_cache_quota" in serve.output(), 30, "the session ended for its cache")
        line = [ln for ln in serve.output().splitlines() if "reason=upstream_cache_quota" in ln][-1]
        assert "identity=CN=client1" in line and "result=error" in line, line
        wrote = [int(r.split()[1]) for r in reports(serve, "cache") if r.startswith("wrote")]
        assert wrote and max(wrote) < 128 and "done" not in reports(serve, "cache"), reports(serve, "cache")
        c.close()
        assert serve.value("rpcguard_sessions_total", result="error") >= 1
    finally:
        serve.stop()


def test_a_flood_of_output_is_rate_limited_and_the_drop_is_counted(pki, workdir):
    t0 = time.monotonic()
    serve = serve_payload(pki, workdir, "flood", "log_lines_per_s: 20, log_burst: 200", FLOOD_LINES=200_000)
    try:
        c = RawClient.session(mtls_socket(pki, serve.port))  # the spare: it listens once the flood is written
        assert c.alloc(SMALL).buffer
        c.close()  # its process is killed: the output's end
        # the first process's lines (the next spare floods too)
        final = re.compile(r"process=1 pid=\d+: output dropped in all: (\d+) lines \((\d+) bytes\)")
        total = wait_until(lambda: final.search(serve.output()), 30, "the drop count")
        elapsed = time.monotonic() - t0
        flood = [ln for ln in serve.output().splitlines() if re.search(r"process=1 pid=\d+ session=\S+: FLOOD \d+$", ln)]
        assert 200 <= len(flood) <= 200 + 20 * (elapsed + 1), (len(flood), elapsed)
        assert total and int(total.group(1)) + len(flood) >= 200_000, total  # (+ the server's own lines)
        assert int(total.group(1)) < 200_000 + 50
    finally:
        serve.stop()


def test_the_asan_server_runs_contained(pki, workdir):
    from tests.fuzz.sanserver import asan_binary

    cfg = write_config(workdir, "asan.yaml", f"      exec: [{asan_binary()}]\n")
    serve = start_guard("serve", workdir, [*pki.serve_args(), "--config", cfg])
    try:
        a_session_is_served(pki, serve)
        assert serve.logged("an ASan build: no RLIMIT_DATA/RLIMIT_AS")
        assert serve.value("rpcguard_upstream_start_failures_total") == 0
    finally:
        serve.stop()


REAPER = """
import os, subprocess, sys, ctypes
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the init of this tree (systemd, tini)
log = open(sys.argv[1], "wb")
serve = subprocess.Popen(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT)
print(serve.pid, flush=True)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""


def _serve_under(wrapper: str, log, pki, cfg: str) -> subprocess.Popen:
    """serve with ``cfg``, started by the Python ``wrapper`` (a reaper or a launcher), which prints
    serve's pid first and logs its output to ``log``."""
    cmd = [realpeer.PYTHON, "-m", "rpcguard", "serve", "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
           *pki.serve_args(), "--config", cfg, "--allow-all"]
    return subprocess.Popen([sys.executable, "-c", wrapper, str(log), *cmd], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def _ready(wrapper: subprocess.Popen, log, name: str) -> tuple[int, "realpeer.Proc", int]:
    """(serve's pid, its Proc, its listening port) once it is ready."""
    assert wrapper.stdout is not None
    serve_pid = int(wrapper.stdout.readline())
    proc = realpeer.Proc(wrapper, log, name)
    wait_for_line(proc, READY_MESSAGE)
    return serve_pid, proc, next(iter(bound_ports(log.read_text()).values()))


def test_a_killed_serve_leaves_no_process_and_no_zombie(pki, workdir):
    """serve SIGKILLed with a session open on a server whose payload forked a daemon (setsid,
    double fork) inside the sandbox: everything of the tree exits (PDEATHSIG, bwrap
    --die-with-parent, the pid namespace's end) and the subreaper above serve has nothing left
    to reap, alive or zombie."""
    payload = build(workdir, "daemon")
    cfg = write_config(workdir, "daemon.yaml", f"      exec: [{payload}, {server_binary()}]\n")
    log = workdir / "serve-reaped.log"
    reaper = _serve_under(REAPER, log, pki, cfg)
    try:
        serve_pid, proc, port = _ready(reaper, log, "rpcguard serve (reaped)")
        serve = Guard(proc, port, bound_metrics_port(log.read_text()) or 0, "serve")
        c = RawClient.session(mtls_socket(pki, port))
        assert c.alloc(SMALL).buffer
        daemons = wait_until(lambda: reports(serve, "daemon"), 30, "the daemon's report")
        assert "started" in daemons[0], daemons
        tree = descendants(reaper.pid)
        assert len(tree) >= 4, tree  # serve, bwrap (outside and in), the server, the daemon
        os.kill(serve_pid, signal.SIGKILL)
        reaper.wait(15)  # it ends once it has no child left: every orphan was reaped
        left = [p for p in tree if os.path.exists(f"/proc/{p}")]
        assert not left, [(p, open(f"/proc/{p}/stat").read()) for p in left if os.path.exists(f"/proc/{p}")]
        c.close()
    finally:
        if reaper.poll() is None:
            os.killpg(reaper.pid, signal.SIGKILL)
            reaper.wait()


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for t in os.listdir(f"/proc/{p}/task")
                    for k in open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


LAUNCHER = """
import ctypes, subprocess, sys
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER, and never reaps: an init that does not
log = open(sys.argv[1], "wb")
serve = subprocess.Popen(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT)
print(serve.pid, flush=True)
serve.wait()
"""


def test_sessions_and_crashes_leave_no_zombie_for_the_init(pki, workdir):
    """serve under a subreaper that never reaps (an init that does not, like the one issue 31 saw):
    four sessions (each process killed at its end), a server SIGKILLed mid-session (its own
    death) and serve's start (the sandbox probe runs bwrap): no process of serve's trees is
    left to the launcher, and serve's own children are reaped within seconds."""
    cfg = write_config(workdir, "reap.yaml", f"      exec: [{server_binary()}]\n")
    log = workdir / "serve-launched.log"
    launcher = _serve_under(LAUNCHER, log, pki, cfg)
    try:
        serve_pid, proc, port = _ready(launcher, log, "rpcguard serve (launched)")
        for _ in range(4):
            c = RawClient.session(mtls_socket(pki, port))
            assert c.alloc(SMALL).buffer
            c.close()
        c = RawClient.session(mtls_socket(pki, port))
        assert c.alloc(SMALL).buffer
        server = wait_until(lambda: [p for p in descendants(serve_pid) if _exe(p).endswith("ggml-rpc-server")
                                     and _state(p) != "Z"], 10, "the session's server")
        # the session's tree: each server and its bwraps up to serve
        tree = set()
        for pid in server:
            while pid not in (serve_pid, 0, 1) and pid not in tree:
                tree.add(pid)
                pid = _parent(pid)
        for pid in server:
            os.kill(pid, signal.SIGKILL)  # dies by itself: its bwraps exit on their own
        wait_until(lambda: "reason=upstream_crashed" in log.read_text(), 15, "the crash")
        c.close()
        # The event, not a time after it: every process of that tree has exited and been reaped
        # (gone from /proc), or has been handed to the launcher (which never reaps: it stays).
        # serve reaps its orphaned bwrap inits every REAP_S; the deadline only bounds a failure.
        wait_until(lambda: all(not os.path.exists(f"/proc/{p}") or _parent(p) == launcher.pid for p in tree), 60,
                   "the crashed session's processes reaped")
        wait_until(lambda: not [p for p in descendants(serve_pid) if _state(p) == "Z"], 60, "no zombie under serve")
        orphans = [p for p in descendants(launcher.pid) if p != serve_pid and _parent(p) == launcher.pid]
        assert not orphans, [(p, _state(p), _exe(p)) for p in orphans]
        zombies = [p for p in descendants(serve_pid) if _state(p) == "Z"]
        assert not zombies, zombies
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(30)


def _stat(pid: int) -> list[str]:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return ["", "0"]


def _state(pid: int) -> str:
    return _stat(pid)[0]


def _parent(pid: int) -> int:
    return int(_stat(pid)[1])


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""
