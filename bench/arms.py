"""The arm registry: every path the benchmarks put between the real client and a real
ggml-rpc-server, and how to start each one.

An **arm** is one such path, and only that: ``direct`` (no proxy), a pair of mTLS proxies
(``stunnel``, ``haproxy``, ``rpcguard``, ``rpcguard@REV``) or a pass-through pair that parses
nothing (``aio``, ``bio``, ``thread``, ``sock``: bench/passthrough.py's I/O designs). ``ARM_TABLE``
lists them with what sits on the path; bench/run.py, bench/paired.py and bench/floor.py take
their ``--arms`` from it. A configuration of one arm that a study compares (clear_new_buffers
on or off, an isolation mode) is a *variant*, not an arm.

How this works: ``start_arm(name, ...)`` starts a fresh real ``ggml-rpc-server`` (the binary) on
a free loopback port, then the arm's proxy pair in front of it, and returns an ``ArmStack``
whose ``endpoint`` is what the client dials. Every pair is a client-side proxy (next to
llama.cpp, plain TCP in) and a server-side proxy (next to the server, plain TCP out), joined by
mutual TLS 1.3 with client certificates required, all from the same private CA minted by
rpcguard's own ``certs`` module (``tests.support.guard.Pki``):

* ``direct``: no proxy.
* ``stunnel``: two Debian ``stunnel4`` processes (``sslVersionMin = TLSv1.3``, ``verifyChain``,
  ``requireCert``/``checkHost``, TCP_NODELAY both ways).
* ``haproxy``: two Debian ``haproxy`` processes in ``mode tcp`` (``ssl crt ... ca-file ...
  verify required``, ``ssl-min-ver TLSv1.3``). HAProxy wants certificate and key in one PEM.
* ``rpcguard``: ``rpcguard connect`` -> ``rpcguard serve`` with validation in enforce mode.
* ``rpcguard@REV``: the same pair run from another source tree (``--baseline``, bench/baseline.py):
  each rpcguard process starts with ``cwd`` and ``PYTHONPATH`` at its tree and its tree's Python.
* ``aio``, ``bio``, ``thread``, ``sock``: two bench/passthrough.py processes of that I/O design
  (same TLS settings, no ggml-rpc work): the I/O floor under rpcguard's relay.

Each proxy process has a label (``client-side``/``server-side`` for stunnel and HAProxy,
``connect``/``serve`` for rpcguard and the pass-through pairs); ``SIDE`` maps it to the side of
the pair it is on, so a process is compared with HAProxy's process on the same side.
``ArmStack.sample()`` reads each proxy process's peak RSS (``VmHWM``) and CPU time from /proc.
With ``profile_dir`` set, each rpcguard process runs under cProfile, or gets ``py-spy record``
or ``perf record`` attached (bench/profile_summary.py reads all three).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from rpcguard.cli import READY_MESSAGE
from tests.support.guard import Pki, wait_for_line
from tests.support.realpeer import PYTHON, Proc, free_port, rpc_server_binary, start, start_rpc_server, wait_port

import passthrough

__all__ = ["Arm", "ARM_TABLE", "ARMS", "RUN_ARMS", "PROXIED", "SIDE", "SIDES", "ArmStack", "start_arm",
           "arm_list", "proc_sample", "cpu_sample", "check_mtls", "tool_versions", "is_rpcguard"]


@dataclass(frozen=True)
class Arm:
    """One path between the real client and the real server."""

    name: str
    kind: str  # "direct", "tool" (stunnel, HAProxy), "rpcguard" or "passthrough" (bench/passthrough.py)
    path: str  # what the client's bytes go through


ARM_TABLE = {a.name: a for a in (
    Arm("direct", "direct", "client -> server"),
    Arm("stunnel", "tool", "client -> stunnel (client mode) =mTLS=> stunnel (server mode) -> server"),
    Arm("haproxy", "tool", "client -> HAProxy =mTLS=> HAProxy -> server (mode tcp)"),
    Arm("rpcguard", "rpcguard", "client -> rpcguard connect =mTLS=> rpcguard serve (enforce) -> server"),
    Arm("contained", "rpcguard", "client -> rpcguard connect =mTLS=> rpcguard serve (enforce) -> the session's own "
                                 "sandboxed server (serve -- ggml-rpc-server: isolation session, spare, seccomp)"),
    Arm("aio", "passthrough", "pass-through pair: uvloop, BufferedProtocol, uvloop's TLS transport (rpcguard's layer)"),
    Arm("bio", "passthrough", "pass-through pair: uvloop plain transports, TLS by hand over two MemoryBIOs"),
    Arm("thread", "passthrough", "pass-through pair: a thread per connection, blocking socket, poll()"),
    Arm("sock", "passthrough", "pass-through pair: uvloop, non-blocking SSLSocket on add_reader/add_writer"),
)}
assert {a.name for a in ARM_TABLE.values() if a.kind == "passthrough"} == set(passthrough.DESIGNS)
ARMS = tuple(ARM_TABLE)  # every arm; rpcguard@REV is added by --baseline (bench/baseline.py)
RUN_ARMS = ("direct", "stunnel", "haproxy", "rpcguard")  # bench/run.py's default
PROXIED = tuple(a for a in ARMS if a != "direct")
# proxy process label -> the side of the pair it is on
SIDE = {"client-side": "client", "connect": "client", "server-side": "server", "serve": "server"}
SIDES = ("client", "server")
NODE = "node1"  # the node (server) certificate name; also the expected name on the client side
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_CPUCLOCK_SCHED = 2  # linux/include/linux/posix-timers.h: the process clock of sum_exec_runtime

# HAProxy: the model connection stays idle between requests for as long as llama.cpp runs, so
# client/server timeouts are long; connect is loopback. 64 KiB buffers (default 16 KiB) mean 4x
# fewer syscalls per MB; measured here: bulk 591 vs 535 MB/s, ~413 MB load 403 vs 391 MB/s.
HAPROXY_BUFSIZE = 65536
_HAPROXY_GLOBAL = f"""global
    tune.bufsize {HAPROXY_BUFSIZE}
    tune.ssl.cachesize 1000
    ssl-default-bind-options ssl-min-ver TLSv1.3
    ssl-default-server-options ssl-min-ver TLSv1.3

defaults
    mode tcp
    timeout connect 5s
    timeout client 1h
    timeout server 1h
    timeout client-fin 5s
    timeout server-fin 5s
"""


@dataclass
class ArmStack:
    """A running server plus the arm's proxies (label -> process)."""

    arm: str
    endpoint: str
    server: Proc
    tls_port: int = 0  # the server-side proxy's TLS port (0 for direct)
    proxies: dict[str, Proc] = field(default_factory=dict)
    profilers: list[subprocess.Popen] = field(default_factory=list)
    baseline: dict[str, dict] = field(default_factory=dict)  # sample() right after start-up

    def alive(self) -> bool:
        return self.server.alive() and all(p.alive() for p in self.proxies.values())

    def sample(self) -> dict[str, dict]:
        """Peak RSS (MB, VmHWM) and CPU seconds of each proxy process so far; ``*_delta`` keys
        subtract the start-up sample (Python start-up and imports cost ~0.3 s of CPU)."""
        out = {}
        for label, p in self.proxies.items():
            now = proc_sample(p.popen.pid)
            base = self.baseline.get(label, {})
            for key in ("cpu_s", "user_s", "sys_s", "syscr", "syscw"):
                if key in now and key in base:
                    now[key + "_delta"] = round(now[key] - base[key], 3)
            now["vmhwm_startup_mb"] = base.get("vmhwm_mb")
            out[label] = now
        return out

    def rebaseline(self) -> None:
        """Take the start-up sample again (after the mTLS check's handshakes)."""
        self.baseline = {label: proc_sample(p.popen.pid) for label, p in self.proxies.items()}

    def logs(self) -> dict[str, str]:
        return {label: p.output()[-2000:] for label, p in {"server": self.server, **self.proxies}.items()}

    def stop(self) -> None:
        for prof in self.profilers:
            if prof.poll() is None:
                prof.send_signal(signal.SIGINT)  # py-spy and perf write their output on SIGINT
        for prof in self.profilers:
            try:
                prof.wait(30)
            except subprocess.TimeoutExpired:
                prof.kill()
                prof.wait(5)
        for p in list(self.proxies.values())[::-1]:
            p.stop(timeout=10)
        self.server.stop(timeout=10)


def is_rpcguard(arm: str) -> bool:
    """``rpcguard``, ``contained`` or a baseline ``rpcguard@REV`` arm."""
    return arm in ("rpcguard", "contained") or arm.startswith("rpcguard@")


def arm_list(text: str, allowed: tuple[str, ...] = ARMS, at_least: int = 1) -> list[str]:
    """The arms of an ``--arms`` value (comma-separated); ValueError for an unknown one or too few."""
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in allowed]
    if unknown or len(arms) < at_least:
        raise ValueError(f"--arms: give at least {at_least} of {','.join(allowed)} "
                         f"(unknown: {','.join(unknown) or '-'})")
    return arms


def _arm_tag(arm: str) -> str:
    """Profile file prefix of an rpcguard arm: "" for ``rpcguard``, ``rpcguard-at-REV-`` for a baseline."""
    return "" if arm == "rpcguard" else arm.replace("@", "-at-") + "-"


def cpu_sample(pid: int) -> dict | None:
    """CPU time of a process so far, or None once it is gone: ``user_s`` and ``sys_s`` from
    /proc/PID/stat (clock ticks of 10 ms) and ``exact_s``, the kernel's exact on-CPU time of the
    whole process, threads that already exited included: the process CPU-time clock of ``pid``
    (``clock_getcpuclockid(3)``: clock id ``~pid << 3 | CPUCLOCK_SCHED``), read with clock_gettime."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        exact = time.clock_gettime((~pid << 3) | _CPUCLOCK_SCHED)
        return {"user_s": int(fields[11]) / _CLK_TCK, "sys_s": int(fields[12]) / _CLK_TCK, "exact_s": exact}
    except (OSError, IndexError, ValueError):
        return None


def proc_sample(pid: int) -> dict:
    """VmHWM / VmRSS in MB (1e6 bytes), user / system CPU seconds and syscall counts of a process."""
    out: dict = {"pid": pid}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    key, kb = line.split()[:2]
                    out[key[:-1].lower() + "_mb"] = int(kb) * 1024 / 1e6
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out["user_s"] = int(fields[11]) / _CLK_TCK
        out["sys_s"] = int(fields[12]) / _CLK_TCK
        out["cpu_s"] = out["user_s"] + out["sys_s"]
        with open(f"/proc/{pid}/io") as f:  # read/write-family syscall counts (reads include recv)
            for line in f:
                key, _, val = line.partition(":")
                if key in ("syscr", "syscw", "rchar", "wchar"):
                    out[key] = int(val)
    except (OSError, IndexError, ValueError):
        out["gone"] = True
    return out


def _combined_pem(pki: Pki, name: str) -> str:
    """HAProxy's ``crt``: certificate chain and private key in one file (mode 0600)."""
    path = pki.dir / f"{name}-combined.pem"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(Path(pki.path(name)).read_text() + Path(pki.path(name, "key")).read_text())
    return str(path)


def _stunnel(workdir: Path, tag: str, conf: str) -> Proc:
    path = workdir / f"stunnel-{tag}.conf"
    path.write_text(conf)
    return start([shutil.which("stunnel4") or "stunnel4", str(path)], workdir / f"stunnel-{tag}.log",
                 f"stunnel {tag}")


def _stunnel_pair(workdir: Path, pki: Pki, server_port: int) -> tuple[str, int, dict[str, Proc]]:
    mid, front = free_port(), free_port()
    common = "foreground = yes\npid =\ndebug = warning\nsocket = l:TCP_NODELAY=1\nsocket = r:TCP_NODELAY=1\n"
    srv = _stunnel(workdir, f"server-{mid}", common + f"""
[rpc]
accept = 127.0.0.1:{mid}
connect = 127.0.0.1:{server_port}
cert = {pki.path(NODE)}
key = {pki.path(NODE, 'key')}
CAfile = {pki.path('ca')}
requireCert = yes
verifyChain = yes
sslVersionMin = TLSv1.3
""")
    wait_port(mid, proc=srv.popen)
    cli = _stunnel(workdir, f"client-{front}", common + f"""
[rpc]
client = yes
accept = 127.0.0.1:{front}
connect = 127.0.0.1:{mid}
cert = {pki.path(pki.client)}
key = {pki.path(pki.client, 'key')}
CAfile = {pki.path('ca')}
verifyChain = yes
checkHost = {NODE}
sni = {NODE}
sslVersionMin = TLSv1.3
""")
    wait_port(front, proc=cli.popen)
    return f"127.0.0.1:{front}", mid, {"client-side": cli, "server-side": srv}


def _haproxy(workdir: Path, tag: str, conf: str) -> Proc:
    path = workdir / f"haproxy-{tag}.cfg"
    path.write_text(_HAPROXY_GLOBAL + conf)
    subprocess.run(["haproxy", "-c", "-q", "-f", str(path)], check=True, capture_output=True, timeout=30)
    # -db: foreground, no master/worker: the pid we hold is the process that proxies.
    return start(["haproxy", "-db", "-f", str(path)], workdir / f"haproxy-{tag}.log", f"haproxy {tag}")


def _haproxy_pair(workdir: Path, pki: Pki, server_port: int) -> tuple[str, int, dict[str, Proc]]:
    mid, front = free_port(), free_port()
    srv = _haproxy(workdir, f"server-{mid}", f"""
frontend tls_in
    bind 127.0.0.1:{mid} ssl crt {_combined_pem(pki, NODE)} ca-file {pki.path('ca')} verify required ssl-min-ver TLSv1.3
    default_backend rpc

backend rpc
    server rpc 127.0.0.1:{server_port}
""")
    wait_port(mid, proc=srv.popen)
    cli = _haproxy(workdir, f"client-{front}", f"""
frontend llama_in
    bind 127.0.0.1:{front}
    default_backend node

backend node
    server {NODE} 127.0.0.1:{mid} ssl crt {_combined_pem(pki, pki.client)} ca-file {pki.path('ca')} verify required verifyhost {NODE} sni str({NODE}) ssl-min-ver TLSv1.3
""")
    wait_port(front, proc=cli.popen)
    return f"127.0.0.1:{front}", mid, {"client-side": cli, "server-side": srv}


def _start_in(tree, cmd: list[str], log: Path, name: str) -> Proc:
    """``realpeer.start`` with the process's cwd and PYTHONPATH at ``tree`` (bench/baseline.py)."""
    fh = open(log, "wb")
    env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONUNBUFFERED="1", **tree.env())
    popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=tree.path,
                             start_new_session=True)
    fh.close()
    return Proc(popen, log, name)


def _start_rpcguard(role: str, workdir: Path, args: list[str], cprofile: Path | None, tree=None
                    ) -> tuple[Proc, int]:
    """``python -m rpcguard ROLE`` (as tests.support.guard.start_guard), optionally under cProfile
    (bench/cprofile_rpcguard.py: CPU-time clock; the file is written when the arm stops). With a
    ``tree`` (bench/baseline.Tree) it runs that tree's code with that tree's Python."""
    port = free_port()
    python = tree.python if tree is not None else PYTHON
    if cprofile:
        py = [python, str(Path(__file__).resolve().parent / "cprofile_rpcguard.py"), str(cprofile)]
    else:
        py = [python, "-m", "rpcguard"]
    cmd = py + [role, "--listen", f"127.0.0.1:{port}", "--metrics", f"127.0.0.1:{free_port()}",
                *args]
    log = workdir / f"rpcguard-{role}-{port}.log"
    if tree is not None:
        proc = _start_in(tree, cmd, log, f"rpcguard {role} ({tree.label})")
    else:
        proc = start(cmd, log, f"rpcguard {role}")
    # A --baseline tree may predate today's ready line: older revisions print RPCGUARD_READY.
    deadline = time.monotonic() + 60
    while not any(marker in proc.output() for marker in (READY_MESSAGE, "RPCGUARD_READY")):
        if not proc.alive() or time.monotonic() > deadline:
            try:
                wait_for_line(proc, READY_MESSAGE, timeout=0)  # raises with the log
            finally:
                proc.stop()  # a pair that never got ready must not outlive the run
        time.sleep(0.02)
    wait_port(port, proc=proc.popen)
    return proc, port


def _rpcguard_pair(workdir: Path, pki: Pki, server_port: int, cprofile: Path | None = None, tree=None,
                   runs: str | None = None) -> tuple[str, int, dict[str, Proc]]:
    """connect -> serve -> the server on ``server_port``, or with ``runs`` (a server binary) serve
    running that server itself, a sandboxed process per session (the ``contained`` arm)."""
    upstream = ["--", runs] if runs else ["--upstream", f"127.0.0.1:{server_port}"]
    serve, sport = _start_rpcguard("serve", workdir, pki.serve_args() + [
        "--mode", "enforce", "--allow-cn", pki.client, *upstream],
        Path(f"{cprofile}serve.cprofile") if cprofile else None, tree)
    connect, cport = _start_rpcguard("connect", workdir, pki.connect_args() + [
        "--server", f"127.0.0.1:{sport}", "--server-name", NODE, "--mode", "enforce", "--no-check"],
        Path(f"{cprofile}connect.cprofile") if cprofile else None, tree)
    return f"127.0.0.1:{cport}", sport, {"connect": connect, "serve": serve}


def _passthrough(workdir: Path, design: str, role: str, cert: str, key: str, ca: str, upstream: int
                 ) -> tuple[Proc, int]:
    port = free_port()
    cmd = [PYTHON, str(Path(__file__).resolve().parent / "passthrough.py"), design, role, "--listen", str(port),
           "--upstream", str(upstream), "--cert", cert, "--key", key, "--ca", ca, "--server-name", NODE]
    proc = start(cmd, workdir / f"passthrough-{design}-{role}-{port}.log", f"passthrough {design} {role}")
    try:
        wait_port(port, proc=proc.popen)
    except BaseException:
        proc.stop()
        raise
    return proc, port


def _passthrough_pair(design: str, workdir: Path, pki: Pki, server_port: int) -> tuple[str, int, dict[str, Proc]]:
    """Two bench/passthrough.py processes of ``design``: ``serve`` (TLS in), then ``connect``."""
    serve, mid = _passthrough(workdir, design, "serve", pki.path(NODE), pki.path(NODE, "key"), pki.path("ca"),
                              server_port)
    try:
        connect, front = _passthrough(workdir, design, "connect", pki.path(pki.client), pki.path(pki.client, "key"),
                                      pki.path("ca"), mid)
    except BaseException:
        serve.stop()
        raise
    return f"127.0.0.1:{front}", mid, {"connect": connect, "serve": serve}


_PAIRS = {"stunnel": _stunnel_pair, "haproxy": _haproxy_pair, "rpcguard": _rpcguard_pair}


def _profiler(kind: str, pid: int, out: Path) -> subprocess.Popen:
    """``py-spy`` (Python + native frames, raw collapsed stacks) or ``perf`` (on-CPU, dwarf stacks)."""
    if kind == "perf":
        cmd = ["perf", "record", "-F", "499", "-e", "cpu-clock", "--call-graph", "dwarf", "-p", str(pid),
               "-o", str(out) + ".perf.data"]
    else:
        venv = Path(os.environ.get("VIRTUAL_ENV") or Path(__file__).resolve().parent.parent / ".venv")
        cmd = [str(venv / "bin" / "py-spy"), "record", "--pid", str(pid), "--native", "--rate", "200",
               "--format", "raw", "-o", str(out) + ".pyspy.txt"]
    with open(str(out) + f".{kind}.log", "wb") as log:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)


def start_arm(arm: str, workdir: Path, pki: Pki, *, profile_dir: Path | None = None,
              profile_tag: str = "", profiler: str = "py-spy", tree=None) -> ArmStack:
    """A fresh real server and the arm's proxies in front of it (nothing for ``direct``). rpcguard
    arms run the code of ``tree`` (bench/baseline.Tree) when one is given."""
    server, server_port = start_rpc_server(workdir, binary=True)
    if arm == "direct":
        return ArmStack(arm, f"127.0.0.1:{server_port}", server)
    try:
        if is_rpcguard(arm):
            cprofile = None
            if profile_dir is not None and profiler == "cprofile":
                profile_dir.mkdir(parents=True, exist_ok=True)
                cprofile = profile_dir / (profile_tag + _arm_tag(arm))
            runs = str(rpc_server_binary()) if arm == "contained" else None
            endpoint, tls_port, proxies = _rpcguard_pair(workdir, pki, server_port, cprofile, tree, runs)
        elif arm in passthrough.DESIGNS:
            endpoint, tls_port, proxies = _passthrough_pair(arm, workdir, pki, server_port)
        else:
            endpoint, tls_port, proxies = _PAIRS[arm](workdir, pki, server_port)
    except BaseException:
        server.stop()
        raise
    stack = ArmStack(arm, endpoint, server, tls_port, proxies)
    stack.baseline = {label: proc_sample(p.popen.pid) for label, p in proxies.items()}
    if profile_dir is not None and is_rpcguard(arm) and profiler != "cprofile":
        profile_dir.mkdir(parents=True, exist_ok=True)
        tag = profile_tag + _arm_tag(arm)
        for label, p in proxies.items():
            stack.profilers.append(_profiler(profiler, p.popen.pid, profile_dir / f"{tag}{label}"))
        time.sleep(1.0)  # let the profilers attach before the first client
    return stack


def check_mtls(pki: Pki, port: int) -> dict[str, bool]:
    """Prove the server-side proxy speaks TLS 1.3 only and requires a client certificate.

    Returns ``{"tls13": ..., "no_cert_refused": ..., "tls12_refused": ...}``; all True is the
    configuration the issue asks for. With TLS 1.3 a missing client certificate is detected by
    the server after the client's handshake completes, so the refusal shows on the first read.
    """
    def attempt(cert: bool, max_version: ssl.TLSVersion | None) -> str:
        ctx = ssl.create_default_context(cafile=pki.path("ca"))
        if cert:
            ctx.load_cert_chain(pki.path(pki.client), pki.path(pki.client, "key"))
        if max_version is not None:
            ctx.maximum_version = max_version
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                with ctx.wrap_socket(raw, server_hostname=NODE) as tls:
                    version = tls.version() or ""
                    tls.settimeout(0.5)
                    try:
                        if not tls.recv(1):
                            return "closed"
                    except (socket.timeout, TimeoutError):
                        return version  # still open: accepted (the upstream waits for a HELLO)
                    return version
        except (ssl.SSLError, OSError):
            return "refused"

    return {"tls13": attempt(True, None) == "TLSv1.3",
            "no_cert_refused": attempt(False, None) in ("refused", "closed"),
            "tls12_refused": attempt(True, ssl.TLSVersion.TLSv1_2) == "refused"}


def tool_versions() -> dict[str, str]:
    """Versions of the proxies and of OpenSSL, for the results header."""
    def first_line(cmd: list[str]) -> str:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
            return (p.stdout + p.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "missing"
    return {
        "haproxy": first_line(["haproxy", "-v"]),
        "stunnel": next((l for l in _all_lines(["stunnel4", "-version"]) if l.startswith("stunnel ")), "missing"),
        "openssl": first_line(["openssl", "version"]),
        "python_ssl": ssl.OPENSSL_VERSION,
    }


def _all_lines(cmd: list[str]) -> list[str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        return (p.stdout + p.stderr).splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []
